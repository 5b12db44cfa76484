"""Which rows of a step's global batch each rank samples and trains, and with which noise.

A step's batch is N = prompts_per_step x group_size rows (row i belongs to group i // group_size). The rows are
shuffled once per step with a seeded permutation (Flow-GRPO shuffles its samples too) and cut into minibatches
of train.minibatch_size; each rank takes an equal, contiguous slice of every minibatch. So every rank trains on a
slice of the same global minibatches, whatever the world size, and an optimizer step on N ranks sees the rows
one process would have seen.

Noise is drawn per row from a generator seeded by (run seed, step, row), never from a shared stream, so a row's
trajectory does not depend on which rank samples it or on what else is in its batch: 1 process and N processes
sample the same images. With sampling.same_initial_noise the starting noise x_0 is drawn per prompt group instead,
from a generator seeded by (run seed, step, group), so every row of a group starts from it wherever it is sampled;
each row's own generator still draws (and here discards) its x_0 first, so its SDE noise is the one it draws without
the option.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["step_seed", "row_seed", "row_generators", "initial_noise", "StepRows"]


def step_seed(seed: int, step: int, stream: int) -> int:
    """A distinct, reproducible seed per (run seed, step, stream); streams: 0 rollout noise, 1 row order,
    2 later inner epochs' order, 3 the SDE window's start, 4 a prompt group's shared initial noise, 5-6 DiffusionNFT's
    noise and timesteps (train/nft.py), 9 the per-sample trained steps (grpo/steps.py), 13-14 AWM's noise and
    timesteps (train/awm.py); at most 15."""
    return ((seed * 1_000_003 + step) * 16 + stream) % (2**63 - 1)


def row_seed(seed: int, step: int, stream: int, row: int, epoch: int = 0) -> int:
    """The seed of one global row's draws in `stream` of a step, and of its inner epoch `epoch` (DiffusionNFT draws
    each inner epoch afresh): a function of (seed, step, stream, epoch, row) alone, so a row draws the same on any
    rank, in any minibatch and after a resume. Epoch 0 keeps the row's seed of the step. `row` may also index
    another unit of the step (a prompt group: initial_noise)."""
    mixed = step_seed(seed, step, stream) * 1_000_033 + int(row)
    return (mixed * 1_000_037 + epoch if epoch else mixed) % (2**63 - 1)


def row_generators(seed: int, step: int, rows: torch.Tensor) -> list[torch.Generator]:
    """One CPU generator per global row index: the row's initial noise and every SDE step's noise."""
    return [torch.Generator().manual_seed(row_seed(seed, step, 0, r)) for r in rows.tolist()]


def initial_noise(gens: list[torch.Generator], rows: torch.Tensor, shape, *, seed: int, step: int,
                  group_size: int | None = None) -> torch.Tensor:
    """The starting noise x_0 of `rows` (global indices; `gens` their row_generators, each advanced past its x_0):
    each row's own draw, or with `group_size` (sampling.same_initial_noise) its group's, row i in group
    i // group_size, drawn from a generator seeded by (seed, step, group) alone: the same whichever rank or chunk
    samples the row. [len(rows), *shape], float32 on the CPU."""
    own = torch.stack([torch.randn(shape, generator=g) for g in gens])
    if group_size is None:
        return own
    group = (rows // group_size).tolist()
    drawn = {g: torch.randn(shape, generator=torch.Generator().manual_seed(row_seed(seed, step, 4, g)))
             for g in dict.fromkeys(group)}
    return torch.stack([drawn[g] for g in group])


@dataclass
class StepRows:
    """The rows of one step. `order` is the global permutation; minibatch m is order[m*bs:(m+1)*bs] and
    rank r holds its slice [r*lbs:(r+1)*lbs] (lbs = bs / world)."""

    order: torch.Tensor  # [N] global row permutation
    batch_size: int  # global minibatch size
    world_size: int
    rank: int
    sp: int = 1  # parallel.sequence_parallel: ranks r and r' with r // sp == r' // sp hold the same rows

    @classmethod
    def draw(cls, n: int, batch_size: int, seed: int, step: int, rank: int, world_size: int,
             sp: int = 1) -> "StepRows":
        if batch_size % (world_size // sp) or n % batch_size:
            groups = f"world size {world_size}" if sp == 1 else f"{world_size // sp} sequence-parallel groups"
            raise ValueError(f"train.minibatch_size={batch_size} must be divisible by the {groups} and divide the "
                             f"step's {n} rows")
        gen = torch.Generator().manual_seed(step_seed(seed, step, 1))
        return cls(torch.randperm(n, generator=gen), batch_size, world_size, rank, sp)

    @property
    def local_batch(self) -> int:
        return self.batch_size // (self.world_size // self.sp)

    @property
    def num_minibatches(self) -> int:
        return len(self.order) // self.batch_size

    def rows_of(self, rank: int) -> torch.Tensor:
        """Global row indices rank `rank` samples, in its local order (minibatch by minibatch): its data rank's."""
        lbs, d = self.local_batch, rank // self.sp
        return torch.cat([self.order[m * self.batch_size + d * lbs: m * self.batch_size + (d + 1) * lbs]
                          for m in range(self.num_minibatches)])

    @property
    def mine(self) -> torch.Tensor:
        return self.rows_of(self.rank)

    @property
    def all_rows(self) -> torch.Tensor:
        """Every rank's rows concatenated in rank order: the layout of an all-gather of per-rank results (with
        sequence parallelism each row once per rank of its group: identical values, written to the same place)."""
        return torch.cat([self.rows_of(r) for r in range(self.world_size)])

    def minibatches(self, epoch: int, seed: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(local positions, global rows of the whole minibatch) per minibatch. Epoch 0 follows the global
        order; later inner epochs permute the local positions with one seeded permutation shared by all
        ranks (rows stay on the rank that sampled them)."""
        lbs, nl = self.local_batch, len(self.order) // (self.world_size // self.sp)
        pos = torch.arange(nl)
        if epoch > 0:
            gen = torch.Generator().manual_seed(step_seed(seed, step, 2) + epoch)
            pos = torch.randperm(nl, generator=gen)
        every = torch.stack([self.rows_of(r) for r in range(self.world_size)])  # [world, nl]
        return [(pos[m * lbs:(m + 1) * lbs], every[:, pos[m * lbs:(m + 1) * lbs]].flatten())
                for m in range(nl // lbs)]
