"""A launch split into pools: who is a trainer, who rolls out, and the groups each talks over.

    global ranks 0 .. T-1      the trainer pool (T = N - pools.rollout_ranks): its own default process group, the
                               run's engine, checkpoints, logs and evaluation; global rank 0 stays the run's main rank
    global ranks T .. N-1      the rollout pool: its own default process group; rollout rank T + j serves the trainers
                               j*T/R .. (j+1)*T/R - 1 (each trainer's rows, as a synchronous run's rank would sample
                               them) and receives the weights from trainer 0
    the bridge                 a process group over all N ranks for the messages between the pools (bridge.py)

Both groups are made on the launch's own store (torchrun's agent store, or rank 0's under Slurm / MPI), each under
its own prefix, so every pool's collectives, FSDP2 meshes and checkpoints are a plain run's of the pool's size."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .bridge import Bridge

log = logging.getLogger(__name__)

__all__ = ["Layout", "PoolMember", "start_pools"]


@dataclass(frozen=True)
class Layout:
    world: int  # every process of the launch
    rollout: int  # pools.rollout_ranks

    @property
    def trainers(self) -> int:
        return self.world - self.rollout

    @property
    def per_rollout(self) -> int:
        """Trainers each rollout rank serves."""
        return self.trainers // self.rollout

    def role(self, rank: int) -> str:
        return "trainer" if rank < self.trainers else "rollout"

    def rollout_of(self, trainer: int) -> int:
        """The global rank of the rollout rank serving `trainer`."""
        return self.trainers + trainer // self.per_rollout

    def trainers_of(self, rollout: int) -> list[int]:
        j = rollout - self.trainers
        return list(range(j * self.per_rollout, (j + 1) * self.per_rollout))

    def rollout_ranks(self) -> list[int]:
        return list(range(self.trainers, self.world))


@dataclass
class PoolMember:
    """This process's place in the pools: its role, its global rank, the layout and the bridge."""

    role: str
    rank: int  # global rank in the launch
    layout: Layout
    bridge: Bridge


def start_pools(info, layout: Layout, device: torch.device, *, timeout_s: int, pool_timeout_s: int,
                limit_bytes: int) -> tuple[int, int, PoolMember]:
    """Start this process's pool group and the bridge (`info`: parallel.ranks.discover's RankInfo, exported to the
    environment). Returns (rank in its pool, the pool's size, PoolMember)."""
    rank = info.rank
    role = layout.role(rank)
    pool_rank, pool_world = (rank, layout.trainers) if role == "trainer" else (rank - layout.trainers, layout.rollout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = dist.TCPStore(info.master_addr, int(info.master_port), None, rank == 0 and not agent,
                          timeout=timedelta(seconds=timeout_s))
    library = "nccl" if device.type == "cuda" else "gloo"
    if pool_world > 1:
        dist.init_process_group(library, store=dist.PrefixStore(f"jagg/pool/{role}", store), rank=pool_rank,
                                world_size=pool_world, timeout=timedelta(seconds=timeout_s),
                                **({"device_id": device} if library == "nccl" else {}))
    bridge_store = dist.PrefixStore("jagg/bridge", store)
    if library == "nccl":  # GPU to GPU between the pools (not run on this project's CPU machines: docs/async.md)
        group = dist.ProcessGroupNCCL(bridge_store, rank, layout.world, dist.ProcessGroupNCCL.Options())
    else:
        group = dist.ProcessGroupGloo(bridge_store, rank, layout.world, timedelta(seconds=pool_timeout_s))
    bridge = Bridge(group, rank, layout.world, device=device if library == "nccl" else torch.device("cpu"),
                    timeout_s=pool_timeout_s, limit_bytes=limit_bytes)
    log.info("pools: rank %d is %s rank %d of %d (%d trainers, %d rollout ranks) via %s", rank, role, pool_rank,
             pool_world, layout.trainers, layout.rollout, library)
    return pool_rank, pool_world, PoolMember(role, rank, layout, bridge)
