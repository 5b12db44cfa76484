"""The process group of a run, in one object: who we are, which device, and the few collectives the trainer needs.

`init_distributed` reads the launcher's environment once (ranks.discover: torchrun, Slurm, MPI or a single
process), exports it as torchrun variables, and starts the process group (gloo on CPU, nccl on CUDA). Everything
else in the trainer asks the returned `DistContext` instead of torch.distributed, so a single process needs no
process group at all and the same code path runs everywhere.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .ranks import default_backend, discover, export_env

log = logging.getLogger(__name__)

__all__ = ["DistContext", "init_distributed"]


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    process_group: str = "none"  # the process group's library: gloo | nccl, or none (one process, no group)
    owns_group: bool = False  # a one-process group started for a sharding engine (closed with the context)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def all_gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equally shaped tensors of every rank along dim 0 (rank order)."""
        if not self.active:
            return t
        t = t.contiguous()
        device = self.device if self.process_group == "nccl" else torch.device("cpu")
        parts = [torch.empty_like(t, device=device) for _ in range(self.world_size)]
        dist.all_gather(parts, t.to(device))
        return torch.cat(parts).to(t.device)

    def all_gather_object(self, obj) -> list:
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int = 0):
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def mean_over_ranks(self, metrics: dict[str, float], keep_extremes: dict[str, str] | None = None) -> dict:
        """Average scalar metrics over ranks (max/min for names listed in keep_extremes) with one all-gather."""
        if not self.active:
            return metrics
        rows = self.all_gather_object(metrics)
        keys = sorted(set().union(*rows))
        reduce = {"max": max, "min": min}
        out = {}
        for k in keys:
            vals = [r[k] for r in rows if k in r and r[k] is not None]
            if not vals:
                continue
            how = (keep_extremes or {}).get(k)
            if not all(isinstance(v, (int, float)) for v in vals):
                out[k] = vals[0]  # non-numeric (e.g. the knot plan): identical on every rank by construction
            else:
                out[k] = reduce[how](vals) if how else sum(vals) / len(vals)
        return out

    def ensure_group(self) -> None:
        """FSDP2 and DeepSpeed need a process group even for one process: a trivial in-memory one."""
        if not dist.is_initialized():
            dist.init_process_group("gloo" if self.device.type == "cpu" else "nccl", store=dist.HashStore(),
                                    rank=0, world_size=1)
            self.owns_group = True

    def close(self) -> None:
        if (self.active or self.owns_group) and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> DistContext:
    """Discover ranks and start the process group when there is more than one process.

    device: auto | cpu | cuda. With CUDA each process takes GPU `local_rank` (the launcher decides how many
    processes a node runs)."""
    info = discover()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is available")
    if use_cuda:
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if info.world_size == 1:
        return DistContext(0, 1, 0, dev, "none")
    export_env(info)
    library = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=library, timeout=timedelta(seconds=timeout_s),
                                **({"device_id": dev} if use_cuda else {}))
    log.info("rank %d/%d (local %d, %s) on %s via %s", info.rank, info.world_size, info.local_rank, info.source,
             dev, library)
    # one thread pool per process: on a shared CPU node N ranks x all cores would thrash
    if not use_cuda and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, info.local_world_size)))
    assert default_backend() in ("nccl", "gloo")
    return DistContext(info.rank, info.world_size, info.local_rank, dev, library)
