"""One job per run directory.

Two jobs writing one run directory log every step twice and race on its checkpoints. It happens without anyone
meaning it: kill only the torchrun agent and its workers train on, orphaned; a relaunch (or a requeued Slurm job)
then runs beside them. So:

    RunLock.acquire(out, dist)  rank 0 takes an exclusive flock on out/.lock, without waiting, and writes who holds
                                it (pid, host, start time, Slurm job) into the file; every rank learns the outcome
                                in one broadcast, so all ranks of a second job fail at once with RunDirLocked
                                naming the holder, before any model is built. The lock lives as long as the
                                descriptor: release(), or the end of the process, however it ends (the kernel
                                drops a flock with its process, SIGKILL included: no stale lock to clean up).
                                Acquiring again in the same process (a second Trainer on the same directory,
                                e.g. a test that trains, then resumes) shares the held lock.

No worker outlives its torchrun agent either: train/preemption.py `follow_launcher` (the other half of the
orphaned-workers problem).

The file stays after the run (removing it would let a third job lock a new file while a second still holds the
old one); its content is the last holder's.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["LOCK_FILE", "RunDirLocked", "RunLock", "write_run_file"]

LOCK_FILE = ".lock"


class RunDirLocked(RuntimeError):
    """Another job holds the run directory's lock; the message names it (pid, host)."""


@dataclass
class _Held:
    fd: int
    count: int
    created: list[Path]  # what this acquisition made (the lock file, the run directory): a refused start removes it


_HELD: dict[str, _Held] = {}  # this process's locks, by lock file path
_GUARD = threading.Lock()


class RunLock:
    def __init__(self, path: Path | None):
        self.path = path  # None: not held by this rank (ranks > 0, or a filesystem without flock)

    @classmethod
    def acquire(cls, out: str | os.PathLike, dist=None) -> "RunLock":
        """The lock of run directory `out` on rank 0 (collective with `dist`); RunDirLocked on every rank when
        another process holds it."""
        main = dist is None or dist.is_main
        lock, problem = cls(None), None
        if main:
            try:
                lock = cls(_lock(Path(out) / LOCK_FILE))
            except RunDirLocked as err:
                problem = str(err)
        if dist is not None:
            problem = dist.broadcast_object(problem)
        if problem:
            raise RunDirLocked(problem)
        return lock

    def release(self, *, refused: bool = False) -> None:
        """Drop this hold (the flock goes with the last one). `refused`: the start was refused before the run wrote
        anything, so the lock file and the run directory this acquisition created are removed too (an empty
        directory only): a refused start leaves nothing behind."""
        if self.path is None:
            return
        key, self.path = str(self.path), None
        with _GUARD:
            held = _HELD.get(key)
            if held is None:
                return
            held.count -= 1
            if held.count == 0:
                del _HELD[key]
                if refused:
                    for made in held.created:  # the file first, then its directory if nothing else is in it
                        try:
                            made.unlink() if made.name == LOCK_FILE else made.rmdir()
                        except OSError:
                            pass
                os.close(held.fd)  # drops the flock


def _lock(path: Path) -> Path | None:
    import fcntl

    key = str(path.parent.resolve() / path.name)  # the lock file itself is never resolved: never followed
    with _GUARD:
        if key in _HELD:  # this process holds it already
            _HELD[key].count += 1
            return Path(key)
        made_dir = not path.parent.is_dir()
        path.parent.mkdir(parents=True, exist_ok=True)
        created = ([] if os.path.lexists(path) else [path]) + ([path.parent] if made_dir else [])
        try:  # O_NOFOLLOW: a lock file that is a link fails (ELOOP) instead of being written through to its target
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise RunDirLocked(f"run directory lock {path} is a symbolic link: refusing to follow it (a lock "
                                   "written through it would overwrite its target); remove it") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirLocked(f"run directory {path.parent} is in use by {_holder(path)} (lock {path}): "
                                   "another job is writing it. Wait for it to end, stop it, or set another "
                                   "run.output_dir") from None
            # e.g. a network filesystem mounted without flock support: run, but say what is not guarded
            log.warning("cannot lock %s (%s): a second job on this run directory will not be detected", path, err)
            return None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                **({"slurm_job": os.environ["SLURM_JOB_ID"]} if "SLURM_JOB_ID" in os.environ else {})}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        _HELD[key] = _Held(fd, 1, created)
        return Path(key)


def _holder(path: Path) -> str:
    """Who holds the lock, from what it wrote into the file."""
    try:
        info = json.loads(path.read_text())
        who = f"pid {info['pid']} on host {info['host']}"
        extra = [f"since {info['started']}"] if "started" in info else []
        extra += [f"Slurm job {info['slurm_job']}"] if "slurm_job" in info else []
        return who + (f" ({', '.join(extra)})" if extra else "")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its pid yet)"


def write_run_file(path: Path, text: str, *, append: bool = False) -> None:
    """Write (or append to) a file of the run directory without following a link planted in its place: a run writes
    only its own files (O_NOFOLLOW: ELOOP, named, instead of writing through to the link's target)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link: a run writes only its own files, never through a link",
                          str(path)) from None
        raise
    with os.fdopen(fd, "a" if append else "w") as f:
        f.write(text)
