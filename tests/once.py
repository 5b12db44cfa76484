"""Work a module or session fixture does (a 2-process training run, a DeepSpeed engine, a tiny pipeline built)
done once per test session instead of once per pytest-xdist worker that happens to run a test using it.

`make test` runs the suite in one xdist worker per core, and a module- or session-scoped fixture is set up in every
worker that runs one of its tests: the 2-process launches behind some of ours cost 5-15 s each, paid twice. (xdist's
own answer, --dist loadgroup, cannot group them on pytest 9.2: xdist 3.8 writes the group into `item._nodeid`, which
pytest 9.2's node ids no longer read.) Here the first worker to ask does the work into a directory both workers see,
under a file lock; the other waits for it and reads the result. What the work leaves there is read-only to the tests
(those that change a run copy it first, as they did before). A failed `make` leaves nothing behind: the next worker to
ask tries again, and fails the same way in its own test."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock


def shared_root(tmp_path_factory) -> Path:
    """The session's temporary directory all workers share (the parent of each worker's own, under xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory, name: str, make: Callable[[Path], Any]) -> tuple[Path, Any]:
    """`make(directory)` run once this session for `name`: the directory and what make returned (JSON-able), read
    back from `name.json` beside the directory by every later caller, in this worker or another."""
    root = shared_root(tmp_path_factory) / "once"
    root.mkdir(exist_ok=True)
    out, done = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)  # a make that failed half-way in another worker
            out.mkdir()
            value = make(out)
            done.write_text(json.dumps(value))  # written last: its presence says the work is whole
    return out, json.loads(done.read_text())
