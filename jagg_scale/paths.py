"""Paths in configs: plain paths are relative to the working directory; `assets:REL` names a file shipped inside
the package (jagg_scale/assets/REL), so configs that use the committed assets work from any directory and from
an installed wheel."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
PREFIX = "assets:"


def resolve_path(path: str | Path) -> Path:
    text = str(path)
    if text.startswith(PREFIX):
        return ASSETS / text[len(PREFIX):]
    return Path(text).expanduser()
