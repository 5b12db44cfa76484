"""Counting host synchronisations: the calls that make the Python thread wait for the accelerator.

A training step that reads a device value back (`float(loss)`, `.item()`, `.tolist()`, `.cpu()`, `bool(t)`), or
builds a device tensor from Python data (`torch.tensor(window, device=cuda)`: a blocking host-to-device copy),
stalls the host until every kernel queued before it has run. A few per step cost nothing; hundreds, one per SDE
step or per window, leave the GPU idle between launches. Two counters, the same interface:

    with HostSyncs() as syncs:          # any device, CPU included: counts the calls that WOULD sync on a GPU
        trainer.train_step(0)
    syncs.count, syncs.by_call          # 12, {"item": 3, "tolist": 4, ...}

    with CudaSyncs() as syncs: ...      # CUDA only: torch's sync debug mode, every real synchronisation

HostSyncs is a TorchFunctionMode, which is thread-local: it counts the thread that entered it (the training
loop), not a background reward worker. On a CPU run it cannot see a host-to-device copy of an existing host
tensor (`x.to(device)` is a no-op there), so noise and ids must be made on the device, which it does see
(`torch.tensor(data, device=...)`). CudaSyncs counts every thread (the debug mode is process-wide).
"""

from __future__ import annotations

import collections
import warnings

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that return host data read from the tensor
_READS = {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "cpu"}
# factories that copy Python data into a tensor: a host-to-device copy when a device is named
_FROM_DATA = {"tensor", "as_tensor"}


def _to_host(args, kwargs) -> bool:
    """`t.to(...)` / `t.copy_(...)` call that lands on the CPU (a device-to-host copy on a GPU)."""
    target = kwargs.get("device")
    if target is None:
        target = next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
    if target is None:
        return False
    try:
        return torch.device(target).type == "cpu"
    except (RuntimeError, TypeError):
        return False


class HostSyncs(TorchFunctionMode):
    """Counts, in this thread, the torch calls that synchronise the host with an accelerator."""

    def __init__(self):
        super().__init__()
        self.by_call: collections.Counter = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.by_call.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.by_call[name] += 1
        elif name == "to" and _to_host(args, kwargs):
            self.by_call["to(cpu)"] += 1
        elif name in _FROM_DATA and kwargs.get("device") is not None and args and not torch.is_tensor(args[0]):
            self.by_call[f"{name}(device=)"] += 1
        return func(*args, **kwargs)


class CudaSyncs:
    """Every CUDA synchronisation of the process (torch.cuda.set_sync_debug_mode "warn"), counted by message."""

    def __enter__(self) -> "CudaSyncs":
        self.by_call: collections.Counter = collections.Counter()
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        self._previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(self._previous)
        self._caught.__exit__(*exc)
        for w in self._records:
            text = str(w.message)
            if "synchroniz" in text.lower():
                self.by_call[text.split("\n")[0][:80]] += 1

    @property
    def count(self) -> int:
        return sum(self.by_call.values())
