"""A launch's processes as /proc shows them, for the tests that kill or signal one (Linux): a process's children
(torchrun's workers run in sessions of their own, so a signal to its group does not reach them), whether one is gone
(a zombie nobody reaps counts), waiting until they are, and a SIGKILL that does not mind an exited one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hang_guard import POLL_S, WAIT_S


def children(pid: int) -> list[int]:
    """The processes whose parent is pid."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def gone(pid: int) -> bool:
    """Exited: no longer in /proc, or a zombie (exited, not yet reaped) or dead entry."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + WAIT_S  # a hang guard: a checkpoint save, then exit
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, f"processes {pids} still running"
        time.sleep(POLL_S)


def kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
