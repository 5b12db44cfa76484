"""Preemption: SIGTERM / SIGUSR1 (Slurm sends one before killing a job) become "checkpoint, then exit".

The handler only records the signal; the trainer acts on it at safe points (no collective half done, no optimizer
step half applied), agreed across ranks, writes a checkpoint, leaves a PREEMPTED marker for the sbatch template's
requeue logic and exits with 128 + the signal number. A second signal while saving is ignored rather than killing the
save (Slurm signals both the batch shell and the job steps). The safe points:

  * inside a step, while it has not changed the trained state (the rollout, the reward, the update's passes until its
    first optimizer step): before every transformer forward and after the reward (`StopPoints`). The step is
    abandoned (StepAbandoned): the checkpoint is of the step's start (the weights are still its start's; the prompt
    source and the global RNG as they were when it began), and the resumed run trains the whole step again, drawing
    what the uninterrupted run drew (every draw is seeded by run.seed, the step and the row). A rank waiting for its
    reward stops waiting once its own signal came (the chunks are cancelled), so the reward deadline does not add
    to the preemption's;
  * the end of a step (once an optimizer step was applied, the rest of the update runs: its state is not saved
    half way);
  * between evaluation batches (train/evaluate.py: the batches so far kept, the evaluation resumed from there).

So the longest a signal waits is one transformer forward (or a pass of the update before its first optimizer step),
or what is left of the update after its first optimizer step, or an evaluation batch: estimate/preemption.py prices
it. Under pools (pools.rollout_ranks > 0) a trainer acts at the end of a step only: the rollout pool has sampled ahead.

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
from typing import Callable

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


class StepAbandoned(Exception):
    """A preemption agreed by every rank inside a step that had not changed the trained state (`phase` says where)."""

    def __init__(self, phase: str):
        super().__init__(f"preempted during the {phase}")
        self.phase = phase


class StopPoints:
    """The checks inside a step (module docstring). `agree(flag) -> bool` is true on every rank if it is true on any
    (a collective: every rank checks at the same points, as they run the same forwards); `moved()` counts the
    optimizer steps taken (the engine's count): once it differs from the step start's, the step runs to its end.

    `arm(phase)` at the step's start (after `snapshot` was taken of what the abandoned step's checkpoint restores),
    `phase` renamed as the step goes on, `disarm()` at its end. Checks happen in the main thread only (a reward
    thread never enters a collective)."""

    def __init__(self, preemption: "Preemption", agree: Callable[[bool], bool], moved: Callable[[], int], *,
                 enabled: bool = True):
        self.preemption, self.agree, self.moved, self.enabled = preemption, agree, moved, enabled
        self.phase: str | None = None  # None: disarmed
        self._start = 0

    def arm(self, phase: str) -> None:
        if self.enabled:
            self.phase, self._start = phase, self.moved()

    def disarm(self) -> None:
        self.phase = None

    def rename(self, phase: str) -> None:
        """The step's part now (in the log line of an abandoned step)."""
        if self.phase is not None:
            self.phase = phase

    def check(self) -> None:
        """Raise StepAbandoned on every rank if any rank got the signal (collective while armed)."""
        if self.phase is None or threading.current_thread() is not threading.main_thread():
            return
        if self.moved() != self._start:  # an optimizer step was taken: the state is no longer the step start's
            self.phase = None
            return
        if self.agree(self.preemption.requested):
            raise StepAbandoned(self.phase)


class Preemption:
    def __init__(self):
        self.signal_number: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def _handle(self, signum, frame) -> None:
        if self.signal_number is None:
            log.warning("received signal %d: will checkpoint and exit at the next safe point", signum)
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
