"""A Hugging Face hub cache in a temporary directory, laid out as huggingface_hub lays it out, for offline tests:

    HF_HUB_CACHE/models--ORG--NAME/blobs/<sha256>                 the files' bytes
                                   snapshots/<revision>/<path>    symlinks to ../../blobs/<sha256>
                                   refs/main                      the revision (no newline)

`offline_hub(monkeypatch, root)` points HF_HOME / HF_HUB_CACHE at root and makes any network connection raise, so a
test that passes resolved everything from the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def put_in_hub_cache(cache: Path, repo_id: str, files: dict[str, Path], revision: str = REVISION) -> Path:
    """Add `files` ({path in the repo: source file}) to `repo_id` in `cache`; returns the snapshot directory."""
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, src in files.items():
        data = Path(src).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def put_dir_in_hub_cache(cache: Path, repo_id: str, src_dir: Path, only=None) -> Path:
    """Every file under src_dir (or those whose top-level name is in `only`) as repo_id's snapshot."""
    files = {p.relative_to(src_dir).as_posix(): p for p in sorted(Path(src_dir).rglob("*")) if p.is_file()}
    if only is not None:
        files = {k: v for k, v in files.items() if k.split("/")[0] in only}
    return put_in_hub_cache(cache, repo_id, files)


def offline_hub(monkeypatch, root: Path) -> Path:
    """HF_HOME=root, HF_HUB_CACHE=root/hub, no network; returns the cache directory."""
    cache = Path(root) / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HOME", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    def no_network(*args, **kwargs):
        raise OSError(f"network access in an offline test: {args[1:] or kwargs}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    return cache
