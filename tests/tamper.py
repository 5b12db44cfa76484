"""What someone who can write a run directory does to a checkpoint after changing its files (the sha256 manifest
stops accidents, not them): the tests of checkpoint trust use it to show what verification and loading still
refuse."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def reseal(ckpt: Path) -> None:
    """Every regular file's size and sha256 into the manifest (a link is listed with its target's, as a careless
    tamperer's tool would), the manifest's hash into COMPLETE."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = [p for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name not in ("manifest.json", "COMPLETE")]
    manifest["files"] = {p.relative_to(ckpt).as_posix(): {"bytes": p.stat().st_size, "rank": 0,
                                                          "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in files}
    raw = json.dumps(manifest, indent=2, sort_keys=True).encode()
    (ckpt / "manifest.json").write_bytes(raw)
    (ckpt / "COMPLETE").write_text(hashlib.sha256(raw).hexdigest() + "\n")
