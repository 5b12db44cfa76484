"""Which chunks each sample trains, and the minibatch's layout over them in slots (docs/algorithm.md, "Chunk-level
GRPO").

Each global row draws its own chunks: a random permutation of the chunks, its first n (GCPO's randperm per sample,
xingzhejun/GCPO ea6cc4d fastvideo/train_grpo_flux_pickscore.py:663-671), seeded by (run seed, step, inner epoch,
row) so that N ranks and a resumed run draw what one uninterrupted process draws. The drawn chunks are sorted (the
order a sample's chunks are trained in does not change the summed gradient).

Rows train chunks of different sizes, but one knot plan must serve every row (and every rank: a sharded model's
passes must match), so the minibatch is laid out in n slots of P positions, P the longest chunk's size. A chunk of
n_c steps k_0 < ... < k_{n_c - 1} takes its slot as

    [k_0, k_1, ..., k_{n_c - 2}, pad x (P - n_c), k_{n_c - 1}]

its ends at the slot's ends (the JAGG window's knots), the pads inside holding a copy of k_0 (a valid point whose
loss term weighs 0). A lone step (n_c = 1 < P) sits at the slot's start and its end is a phantom knot, the
neighbouring step, also weighing 0: the window's two knots need distinct noise levels. The pads cost nothing under
a JAGG window (its two knots are the same passes), a pass each under the per-step plan.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_STREAM", "chunk_starts", "draw_chunks", "slot_layout"]

CHUNK_STREAM = 11  # train/rows.py row_seed stream of the per-row chunk draw (rows.py 0-3, NFT 5-6, steps.py 9)


def chunk_starts(sizes: list[int]) -> list[int]:
    """The first step of each chunk."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def draw_chunks(n_chunks: int, n_train: int, seed: int, step: int, rows: torch.Tensor, epoch: int = 0
                ) -> torch.Tensor:
    """[n_train, len(rows)] long: the sorted chunks each global row in `rows` trains at step `step`, inner epoch
    `epoch` (epoch 0: the row's draw of a one-epoch run)."""
    from ..train.rows import row_seed  # the trainer's seed scheme (rows.py sits above gcpo/)

    out = []
    for r in rows.tolist():
        gen = torch.Generator().manual_seed(row_seed(seed, step, CHUNK_STREAM, r, epoch))
        out.append(torch.randperm(n_chunks, generator=gen)[:n_train].sort().values)
    return torch.stack(out, dim=1)


def slot_layout(sizes: list[int], drawn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps [n P, B] long, real [n P, B] bool): each row's drawn chunks `drawn` [n, B] laid out in slots of P =
    max(sizes) positions (module docstring); `real` marks the positions that hold a step of their chunk."""
    P, starts, C = max(sizes), chunk_starts(sizes), sum(sizes)
    n, B = drawn.shape
    steps = torch.empty(n * P, B, dtype=torch.long)
    real = torch.zeros(n * P, B, dtype=torch.bool)
    for j in range(n):
        for b in range(B):
            c = int(drawn[j, b])
            s0, size = starts[c], sizes[c]
            if size == P:
                slot = list(range(s0, s0 + P))
            elif size == 1:  # a lone step and a phantom end knot at its neighbour (distinct noise levels)
                slot = [s0] * (P - 1) + [s0 + 1 if s0 + 1 < C else s0 - 1]
            else:
                slot = list(range(s0, s0 + size - 1)) + [s0] * (P - size) + [s0 + size - 1]
            steps[j * P: (j + 1) * P, b] = torch.tensor(slot)
            real[j * P, b] = True
            real[j * P + 1: j * P + size - 1, b] = True
            if size > 1:
                real[(j + 1) * P - 1, b] = True
    return steps, real
