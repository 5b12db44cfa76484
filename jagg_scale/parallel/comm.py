"""Count the collectives a training step issues, and their bytes.

The JAGG claim under sharding is about communication as much as compute: FSDP2 all-gathers a block's parameters
for every forward (and again for the backward when it reshards after forward) and reduce-scatters its gradients
after the backward. A per-step window of W steps pays W of these cycles; JAGG's joint endpoint pass pays one.
`CommCounter` makes that visible: while active it wraps the torch.distributed collectives that FSDP2 and
DeepSpeed call (looked up as `torch.distributed.<name>` at call time) and tallies calls and bytes moved per kind.
It changes nothing about the calls themselves.

One counter per process (`CommCounter.for_process()`), installed by a sharding engine (fsdp2, deepspeed) first
thing in its constructor: DeepSpeed binds the torch.distributed functions when it initialises, so wrapping them
later would miss ZeRO-3's traffic. The single-process engine, which issues no collectives, holds a `NullCounter`
with the same `phase()` / `take()` API, so the trainer counts through `engine.comm` without asking which it has.
"""

from __future__ import annotations

import functools
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "NullCounter"]

# name -> (kind, index of the tensor argument whose size is the payload: the gathered output / the reduced input)
_WRAPPED = {
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
}


_PROCESS_COUNTER = None


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCounter:
    """`with counter.phase("train"): ...` counts collectives into counts["train/all_gather"] and bytes[...]."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self._phase: str | None = None
        self._originals: dict = {}

    def _wrap(self, name: str, kind: str, arg: int):
        original = getattr(dist, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self._phase is not None:
                payload = args[arg] if len(args) > arg else next(iter(kwargs.values()), None)
                self.counts[f"{self._phase}/{kind}"] += 1
                self.bytes[f"{self._phase}/{kind}"] += _nbytes(payload)
            return original(*args, **kwargs)

        return original, counted

    @classmethod
    def for_process(cls) -> "CommCounter":
        """The process-wide installed counter (created on first use; later trainers in the process share it)."""
        global _PROCESS_COUNTER
        if _PROCESS_COUNTER is None:
            _PROCESS_COUNTER = cls().install()
        _PROCESS_COUNTER.take()  # start clean
        return _PROCESS_COUNTER

    def install(self) -> "CommCounter":
        if self._originals:
            return self
        for name, (kind, arg) in _WRAPPED.items():
            if hasattr(dist, name):
                original, counted = self._wrap(name, kind, arg)
                self._originals[name] = original
                setattr(dist, name, counted)
        return self

    @contextmanager
    def phase(self, name: str):
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = previous

    def take(self) -> dict[str, float]:
        """Metrics since the last take: comm_<phase>_<kind> (calls) and comm_<phase>_bytes, then reset."""
        out: dict[str, float] = {}
        for key, n in self.counts.items():
            phase, kind = key.split("/")
            out[f"comm_{phase}_{kind}"] = n
            out[f"comm_{phase}_bytes"] = out.get(f"comm_{phase}_bytes", 0) + self.bytes[key]
        self.counts.clear()
        self.bytes.clear()
        return out


class NullCounter:
    """CommCounter's API for an engine without collectives: phases count nothing, `take()` is empty."""

    @contextmanager
    def phase(self, name: str):
        yield self

    def take(self) -> dict[str, float]:
        return {}
