"""Paths in configs: plain paths are relative to the working directory; `assets:REL` names a file shipped inside
the package (jagg_scale/assets/REL), so configs that use the committed assets work from any directory and from
an installed wheel; `data/prompt_sets/REL` (where `make prompts` puts the peers' prompt sets) is read from
$JAGG_PROMPT_SETS/REL when that is set (one shared copy of the sets on a cluster's file system)."""

from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
PREFIX = "assets:"
PROMPT_SETS = "data/prompt_sets/"
PROMPT_SETS_ENV = "JAGG_PROMPT_SETS"


def resolve_path(path: str | Path) -> Path:
    text = str(path)
    if text.startswith(PREFIX):
        return ASSETS / text[len(PREFIX):]
    root = os.environ.get(PROMPT_SETS_ENV)
    if root and text.startswith(PROMPT_SETS):
        return Path(root).expanduser() / text[len(PROMPT_SETS):]
    return Path(text).expanduser()
