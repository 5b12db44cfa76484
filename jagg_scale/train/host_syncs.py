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
loop), not a background reward worker. What it counts: reads of a tensor's values (the methods above), and
`torch.tensor(data, device=...)`; with `device="cuda"` only reads of CUDA tensors and `.to("cpu")` of them. It
skips calls made by torch's own Python code (the optimizer's host-side step counters). On a CPU run every tensor
is on the host, so it over-counts reads of host-resident bookkeeping (advantages, row indices) and cannot see a
host-to-device copy of a host tensor (`x.to(device)`): the rollout therefore moves its noise asynchronously from
pinned memory, and the GPU check (tools/gpu_check.py) counts the real total with CudaSyncs, which sees every
thread (torch's sync debug mode is process-wide).
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that return host data read from the tensor
_READS = {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "cpu"}
# factories that copy Python data into a tensor: a host-to-device copy when a device is named
_FROM_DATA = {"tensor", "as_tensor"}


_COUNTED = _READS | _FROM_DATA | {"to"}


def _in_torch() -> bool:
    """True when torch's own Python code made the call (optimizer step counters, clip_grad_norm_'s grouping):
    those read host-resident bookkeeping, not the accelerator."""
    frame = sys._getframe(2)  # 0 _in_torch, 1 __torch_function__, 2 the code that called the torch function
    return "/torch/" in frame.f_code.co_filename.replace("\\", "/")


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


def _site() -> str:
    """file:line of the innermost jagg_scale frame that made the call (where to look), and of the library frame
    below it when the call was made inside a library (diffusers, torch)."""
    stack = [f for f in traceback.extract_stack(limit=60)[:-3] if not f.filename.endswith("host_syncs.py")]
    for i in range(len(stack) - 1, -1, -1):
        if "jagg_scale" in stack[i].filename:
            site = f"{stack[i].filename.split('jagg_scale/')[-1]}:{stack[i].lineno}"
            if i + 1 < len(stack):
                inner = stack[-1]
                site += f" > {'/'.join(inner.filename.split('/')[-2:])}:{inner.lineno}"
            return site
    return "?"


class HostSyncs(TorchFunctionMode):
    """Counts, in this thread, the torch calls that synchronise the host with an accelerator. `device`: count only
    reads of tensors on that device type ("cuda" on a GPU run); None (a CPU run) counts reads of any tensor, as
    if every tensor lived on the accelerator (an over-count of host-resident bookkeeping, never an under-count)."""

    def __init__(self, device: str | None = None, sites: bool = False):
        super().__init__()
        self.device = device
        self.sites = sites
        self.by_call: collections.Counter = collections.Counter()
        self.by_site: collections.Counter = collections.Counter()

    def _count(self, key: str) -> None:
        self.by_call[key] += 1
        if self.sites:
            self.by_site[f"{key} @ {_site()}"] += 1

    def _on_device(self, t) -> bool:
        return self.device is None or (torch.is_tensor(t) and t.device.type == self.device)

    @property
    def count(self) -> int:
        return sum(self.by_call.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _COUNTED and not _in_torch():
            self._match(name, args, kwargs)
        return func(*args, **kwargs)

    def _match(self, name: str, args, kwargs) -> None:
        if name in _READS and args and self._on_device(args[0]):
            self._count(name)
        elif name == "to" and self.device is not None and args and _to_host(args, kwargs) and self._on_device(args[0]):
            self._count("to(cpu)")
        elif (name in _FROM_DATA and kwargs.get("device") is not None and args and not torch.is_tensor(args[0])
              and (self.device is None or torch.device(kwargs["device"]).type == self.device)):
            self._count(f"{name}(device=)")


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
            if "called a synchronizing" in text:  # not the mode's own "prototype feature" notice
                self.by_call[f"{w.filename.split('/')[-1]}:{w.lineno}"] += 1

    @property
    def count(self) -> int:
        return sum(self.by_call.values())
