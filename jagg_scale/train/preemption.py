"""Preemption: SIGTERM / SIGUSR1 (Slurm sends one before killing a job) become "checkpoint, then exit".

The handler only records the signal; the trainer checks it at the end of each step (a safe point: no collective
half done, no optimizer step half applied), agrees on it across ranks, writes a checkpoint, leaves a PREEMPTED
marker for the sbatch template's requeue logic and exits with 128 + the signal number. A second signal while
saving is ignored rather than killing the save (Slurm signals both the batch shell and the job steps).

Under torchrun a worker also gets SIGTERM when its agent dies (`follow_launcher`): torchrun starts each worker in
a session of its own and forwards only the signals it handles (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default), so a
signal it does not handle (SIGUSR1 to plain `torchrun`), SIGKILL or the OOM killer took the agent down alone, and
the workers trained on as orphans to the end, never checkpointing on the way out. docs/launchers.md ("Signals")
has what each launch path forwards.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager

log = logging.getLogger(__name__)

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)
_PR_SET_PDEATHSIG = 1  # prctl(2)


def follow_launcher(parent: int) -> bool:
    """Under torchrun (Linux): have the kernel send this worker SIGTERM, the preemption signal, when its agent dies.

    `parent` is os.getppid() read as early as possible: if it differs now, the agent died before the request was in
    place, and the worker signals itself. Returns whether the request is in place. Only under torchrun, whose agent
    starts the workers from its main thread (the parent-death signal fires when the creating *thread* exits)."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        log.warning("could not ask for SIGTERM when the torchrun agent dies (%s): a worker may outlive it", e)
        return False
    if os.getppid() != parent:
        log.warning("the torchrun agent (pid %d) is gone: treating it as preemption", parent)
        os.kill(os.getpid(), signal.SIGTERM)
    return True


class Preemption:
    def __init__(self):
        self.signal_number: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def _handle(self, signum, frame) -> None:
        if self.signal_number is None:
            log.warning("received signal %d: will checkpoint and exit after the current step", signum)
            self.signal_number = signum
        else:
            log.warning("received signal %d again: already saving for preemption, ignoring it", signum)

    @contextmanager
    def armed(self):
        """Install the handlers for the duration of training (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
