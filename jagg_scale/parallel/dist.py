"""The process group of a run, in one object: who we are, which device, and the few collectives the trainer needs.

`init_distributed` reads the launcher's environment once (ranks.discover: torchrun, Slurm, MPI or a single
process), exports it as torchrun variables, and starts the process group (gloo on CPU, nccl on CUDA). Everything
else in the trainer asks the returned `DistContext` instead of torch.distributed, so a single process needs no
process group at all and the same code path runs everywhere.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from .ranks import default_backend, discover, export_env

log = logging.getLogger(__name__)

__all__ = ["DistContext", "RankFailedError", "TooManyLocalRanksError", "init_distributed", "local_device_index",
           "reduce_over_ranks"]

T = TypeVar("T")


class RankFailedError(RuntimeError):
    """Another rank's error, raised here too, when it cannot be rebuilt as its own type."""


class TooManyLocalRanksError(RuntimeError):
    """More processes on a node than GPUs visible to them."""


def local_device_index(local_rank: int, local_world_size: int) -> int:
    """The GPU of a process: its local rank, or the one GPU it sees when it sees exactly one (a scheduler that binds
    a GPU per task: `srun --gpus-per-task=1`, `--gpu-bind`; init_distributed then checks that no two ranks of a node
    share it). A node running more processes than it has visible GPUs is refused otherwise: wrapping around
    (local_rank % device_count) would put two ranks on one GPU, silently, each with half the memory it was sized
    for."""
    count = torch.cuda.device_count()
    if count == 1 and local_world_size > 1:
        return 0
    if local_world_size > count or local_rank >= count:
        raise TooManyLocalRanksError(
            f"LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world_size} processes on this node, but "
            f"torch.cuda.device_count()={count} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): start at most {count} processes per node "
            f"(torchrun --nproc_per_node, srun --ntasks-per-node) or make more GPUs visible")
    return local_rank


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    process_group: str = "none"  # the process group's library: gloo | nccl, or none (one process, no group)
    owns_group: bool = False  # a one-process group started for a sharding engine (closed with the context)
    # parallel.sequence_parallel: consecutive groups of this many ranks hold the same rows (parallel/sequence.py)
    sequence_parallel: int = 1
    # pools.rollout_ranks > 0: this process's place in the rollout / trainer pools (pools/world.py PoolMember); the
    # fields above are then its pool's (rank in the pool, the pool's size), the collectives the pool's
    pool: object | None = None
    # a gloo group over every rank for host-side flags under nccl (any_rank): a flag checked before every forward
    # would otherwise be a device-to-host sync each time; None: the default group's own library is on the host
    host_group: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """The rank among the data-parallel groups: ranks of one sequence-parallel group share it (and their rows)."""
        return self.rank // self.sequence_parallel

    @property
    def data_world(self) -> int:
        return self.world_size // self.sequence_parallel

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

    def max_over_ranks(self, value: int) -> int:
        """The largest of every rank's `value` (a collective; on the host: no device sync under nccl)."""
        if not self.active:
            return int(value)
        if self.host_group is None and self.process_group == "nccl":  # pools: each pool's groups, on the device
            return int(self.all_gather_tensor(torch.tensor([int(value)], device=self.device)).max())
        t = torch.tensor([int(value)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host_group)
        return int(t.item())

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

    # ---------------------------------------------------------------- failing together
    # A rank that raises while the others go on to a collective leaves them waiting until the process group's
    # timeout (30 min under NCCL). Around a step that can fail on some ranks only, these make every rank raise
    # the same error at once instead.

    def on_main(self, fn: Callable[[], T]) -> T:
        """`fn()` on rank 0 alone, its (picklable) result sent to every rank; if it raises, every rank raises
        that error (e.g. rank 0 verifies a checkpoint the others then load)."""
        if not self.active:
            return fn()
        error, outcome = None, None
        if self.is_main:
            try:
                outcome = (True, fn())
            except Exception as e:
                error, outcome = e, (False, _portable(e))
        ok, value = self.broadcast_object(outcome)
        if ok:
            return value
        raise error if error is not None else _rebuild(value, 0)

    def on_every_rank(self, fn: Callable[[], T]) -> T:
        """`fn()` on every rank, then one all-gather of the outcomes: if it raised anywhere, every rank raises
        the error of the lowest rank it raised on. A collective `fn` must fail on all ranks or none (DCP's load
        does), since the others would wait inside it."""
        if not self.active:
            return fn()
        error, result = None, None
        try:
            result = fn()
        except Exception as e:
            error = e
        reports = self.all_gather_object(None if error is None else _portable(error))
        failed = [r for r, report in enumerate(reports) if report is not None]
        if not failed:
            return result
        if failed[0] == self.rank:
            raise error
        raise _rebuild(reports[failed[0]], failed[0]) from error

    def mean_over_ranks(self, metrics: dict[str, float], keep_extremes: dict[str, str] | None = None) -> dict:
        """Average scalar metrics over ranks (max/min for names listed in keep_extremes) with one all-gather."""
        if not self.active:
            return metrics
        return reduce_over_ranks(self.all_gather_object(metrics), keep_extremes)

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


def reduce_over_ranks(rows: list[dict], keep_extremes: dict[str, str] | None = None) -> dict:
    """One metrics dict from every rank's: the mean (max/min for names in keep_extremes). A count that is an int on
    every rank stays an int when the mean is whole (the step, backward passes: the same on every rank), so a
    distributed run logs `"step": 3` and `bwd=6/10` as one process does, not 3.0 and 6.0/10.0."""
    reduce = {"max": max, "min": min}
    out = {}
    for k in sorted(set().union(*rows)):
        vals = [r[k] for r in rows if k in r and r[k] is not None]
        if not vals:
            continue
        how = (keep_extremes or {}).get(k)
        if not all(isinstance(v, (int, float)) for v in vals):
            out[k] = vals[0]  # non-numeric (e.g. the knot plan): identical on every rank by construction
        elif how:
            out[k] = reduce[how](vals)
        elif all(type(v) is int for v in vals) and sum(vals) % len(vals) == 0:
            out[k] = sum(vals) // len(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out


def _portable(exc: Exception) -> tuple[bytes | None, str, str]:
    """An exception as it travels to the other ranks: pickled when it survives the round trip, its type's name and
    its message (what is left when it does not)."""
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    return blob, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc)


def _rebuild(report: tuple[bytes | None, str, str], rank: int) -> Exception:
    """Rank `rank`'s error (see _portable) raised on this rank: its own type and message where possible."""
    blob, kind, message = report
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if not isinstance(exc, Exception):
        exc = RankFailedError(f"{kind}: {message}")
    exc.add_note(f"raised on rank {rank}; every rank stops with it")
    return exc


def _check_one_gpu_each(info, dev: torch.device) -> None:
    """Per-task GPU binding: every rank sees one GPU as cuda:0; two ranks of one host on the same physical GPU
    (a CUDA_VISIBLE_DEVICES the same for all, not a binding) are refused, naming them, on every rank."""
    import socket

    uuid = str(torch.cuda.get_device_properties(dev).uuid)
    seen = [None] * info.world_size
    dist.all_gather_object(seen, (socket.gethostname(), uuid, os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")))
    by_gpu: dict = {}
    for rank, (host, gpu, visible) in enumerate(seen):
        by_gpu.setdefault((host, gpu), []).append((rank, visible))
    shared = {key: ranks for key, ranks in by_gpu.items() if len(ranks) > 1}
    if shared:
        (host, gpu), ranks = next(iter(shared.items()))
        raise TooManyLocalRanksError(
            f"ranks {[r for r, _ in ranks]} on {host} all see one GPU, the same one ({gpu}; CUDA_VISIBLE_DEVICES="
            f"{ranks[0][1]}): bind one GPU per task (srun --gpus-per-task=1), or make every GPU visible to each "
            "process (one per local rank)")


def init_distributed(device: str = "auto", timeout_s: int = 1800, pools=None) -> DistContext:
    """Discover ranks and start the process group when there is more than one process.

    pools: the config's PoolsConfig; with rollout_ranks > 0 the launch is split into a trainer and a rollout pool,
    each with its own process group, and the bridge between them (pools/world.py): the context is the pool's.

    device: auto | cpu | cuda. With CUDA each process takes GPU `local_rank` (the launcher decides how many
    processes a node runs; more than it has visible GPUs is refused, see local_device_index), or the one GPU a
    per-task binding shows it (checked to be its own once the group is up)."""
    info = discover()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is available")
    if use_cuda:
        torch.cuda.set_device(local_device_index(info.local_rank, info.local_world_size))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if info.world_size == 1:
        return DistContext(0, 1, 0, dev, "none")
    export_env(info)
    library = "nccl" if use_cuda else "gloo"
    if pools is not None and pools.enabled:
        from ..pools.world import Layout, start_pools

        rank, world, member = start_pools(info, Layout(info.world_size, pools.rollout_ranks), dev,
                                          timeout_s=timeout_s, pool_timeout_s=pools.timeout_s,
                                          limit_bytes=int(pools.max_message_gib * 2**30))
        _share_cores(use_cuda, info.local_world_size)
        return DistContext(rank, world, info.local_rank, dev, library if world > 1 else "none", pool=member)
    if not dist.is_initialized():
        dist.init_process_group(backend=library, timeout=timedelta(seconds=timeout_s),
                                **({"device_id": dev} if use_cuda else {}))
    if use_cuda and torch.cuda.device_count() == 1 and info.local_world_size > 1:
        _check_one_gpu_each(info, dev)
    log.info("rank %d/%d (local %d, %s) on %s via %s", info.rank, info.world_size, info.local_rank, info.source,
             dev, library)
    _share_cores(use_cuda, info.local_world_size)
    assert default_backend() in ("nccl", "gloo")
    host = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if use_cuda else None  # every rank
    return DistContext(info.rank, info.world_size, info.local_rank, dev, library, host_group=host)


def _share_cores(use_cuda: bool, local_world_size: int) -> None:
    """One thread pool per process: on a shared CPU node N ranks x all cores would thrash."""
    if not use_cuda and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))


def leave_launch(code: int = 0) -> None:
    """End a process that was one rank of a multi-process launch with exit code `code`, skipping the interpreter's
    teardown; a single process returns and exits normally.

    Call it last: its process group destroyed (DistContext.close) and every file written and closed. FSDP's device
    meshes and the checkpoint planners still hold the communication backend then, and its C++ threads were left to
    the process's static destructors: a rank that had finished cleanly aborted there ("terminate called without an
    active exception", exit -6) in about 1 run in 4 of 2-process gloo runs on a loaded 2-core machine, and the
    launcher turned the finished run into a failed one (torchrun stops the other ranks and exits 1; a Slurm job
    would be requeued)."""
    try:
        if discover().world_size <= 1:
            return
    except ValueError:  # a malformed launch environment: named when the run started, nothing to skip here
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
