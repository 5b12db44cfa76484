"""Preemption: SIGTERM / SIGUSR1 (Slurm sends one before killing a job) become "checkpoint, then exit".

The handler only records the signal; the trainer checks it at the end of each step (a safe point: no collective
half done, no optimizer step half applied), agrees on it across ranks, writes a checkpoint, leaves a PREEMPTED
marker for the sbatch template's requeue logic and exits with 128 + the signal number. A second signal while
saving is ignored rather than killing the save (Slurm signals both the batch shell and the job steps).
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager

log = logging.getLogger(__name__)

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


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
