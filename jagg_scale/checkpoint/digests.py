"""Who hashes what: the sha256 digests of a checkpoint, computed by the ranks, not by rank 0 alone.

At 100+ GB (a FLUX full fine-tune: ~143 GB of DCP shards) one process hashing everything would be the slowest
part of every save, preemption included, and of every resume (sha256 runs at ~1 GB/s per core). So:

- save: every rank hashes the files it wrote itself (its shards, just written: usually still in its page cache),
  all ranks at once; the digests travel in one all_gather_object, and rank 0 writes them into the manifest (with
  the rank that hashed each file). Files no rank reported (e.g. DeepSpeed's recovery scripts) are hashed by rank 0.
- verify (resume): every rank checks the marker, the manifest and every file's size (cheap; a truncated file
  fails every rank the same way at once), then hashes its share of the files (balanced by bytes, `share`); the
  problems are gathered and every rank raises the first one, or none does. Each byte is hashed once, on one rank.

This module only computes and merges; local.py owns the protocol and raises the CheckpointErrors.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Mapping

_CHUNK = 8 << 20  # large reads: the hash, not the syscalls, should bound the rate


def sha256_file(path: Path) -> str:
    """The one file hasher (tests count its calls)."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def entry(path: Path, rank: int) -> dict:
    """A manifest entry: size, sha256 and the rank that hashed the file (its writer where known)."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path), "rank": rank}


def hash_written(tmp: Path, written: Iterable[str | Path], rank: int) -> dict[str, dict]:
    """{path relative to `tmp`: entry} of the files this rank reports having written (absolute, or relative to
    `tmp`). ValueError for a path outside `tmp` or one that is not a file: a writer must report what it wrote."""
    out: dict[str, dict] = {}
    for p in written:
        p = Path(p)
        full = p if p.is_absolute() else tmp / p
        try:
            rel = full.relative_to(tmp).as_posix()
        except ValueError:
            raise ValueError(f"reported {p}, which is outside the checkpoint directory {tmp}") from None
        if ".." in Path(rel).parts:
            raise ValueError(f"reported {p}, which is outside the checkpoint directory {tmp}")
        if not full.is_file():
            raise ValueError(f"reported writing {rel}, which is not a file")
        if rel not in out:
            out[rel] = entry(full, rank)
    return out


def merge(parts: list[tuple[dict, str | None]]) -> tuple[dict[str, dict], str | None]:
    """The ranks' (digests, problem) pairs, in rank order, into one {path: entry}; or the first problem. A file
    reported by two ranks must hash the same on both (the lower rank's entry is kept)."""
    problems = [p for _, p in parts if p]
    if problems:
        return {}, first_problem(problems)
    files: dict[str, dict] = {}
    for digests, _ in parts:
        for name, e in digests.items():
            if name in files and files[name]["sha256"] != e["sha256"]:
                return {}, (f"{name} was reported by ranks {files[name]['rank']} and {e['rank']} with different "
                            "contents (two ranks wrote the same file)")
            files.setdefault(name, e)
    return files, None


def first_problem(problems: Iterable[str | None]) -> str | None:
    """The lowest rank's problem, so that every rank raises the same message, with a count of the other ones."""
    found = [p for p in problems if p]
    if not found:
        return None
    more = len(set(found) - {found[0]})  # a problem every rank saw (a truncated file) is one problem
    return found[0] + (f" (and {more} more problem{'s' if more > 1 else ''} on other ranks)" if more else "")


def share(sizes: Mapping[str, int], rank: int, world_size: int) -> list[str]:
    """The files `rank` of `world_size` hashes when verifying: largest first to the least-loaded rank (ties to
    the lower rank), so every rank computes the same split from the manifest alone and the bytes balance."""
    load = [0] * world_size
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return sorted(mine)
