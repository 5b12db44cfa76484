"""Which sampling steps of a trajectory are trained (grpo.step_selection), and the minibatch laid out over them.

    first     Flow-GRPO: every row trains the first int(T x timestep_fraction) steps (yifan123/flow_grpo
              scripts/train_sd3.py, `num_train_timesteps = int(config.sample.num_steps * timestep_fraction)`, the
              loop over `range(num_train_timesteps)`).
    random    DanceGRPO: each row its own random int(C x timestep_fraction) of the C = T - 1 candidate steps (the
              trajectory's last transition is not among them): XueZeyue/DanceGRPO (15cc71d)
              fastvideo/train_grpo_flux.py:512-519 (the last step dropped), :552-554 (a randperm per sample), :570
              (its first int(len x timestep_fraction) trained); fastvideo/train_grpo_wan_2_1.py:437-444, :476, :493.
    windows   eff_grpo: the C = T - 1 candidates cut into blocks of W consecutive steps (W = jagg.window; C must be a
              multiple of W, as eff_grpo asserts), each row its own random max(1, int(blocks x timestep_fraction))
              blocks: SchumiDing/eff_grpo (ae14d64) fastvideo/train_grpo_qwenimage_jagg.py:722-725 (the last step
              dropped), :758-761 (the assertion), :762-763 (the count), :767-769 (a block permutation per sample).

Where rows differ, the minibatch is re-laid out per row (`positioned`): position q of row b is the q-th smallest
step row b trains, so every row has the same K positions and one knot plan over the positions serves all rows
(a JAGG window is then W consecutive positions: a row's selected steps, interpolated in that row's own sigmas).
The positioned batch interleaves each position's latent x_k with its successor x_{k+1} (the loss needs both), so
its positions sit at 0, 2, 4, ...; sigmas become per row [2K, B] and the schedule's s_1 is carried apart
(`sigma_max`, the SDE's std at s = 1). Every draw is seeded by (run seed, step, global row): a resumed run and N
ranks select what one uninterrupted process selects.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from .loss import StepBatch

StepSelection = Literal["first", "random", "windows"]
SELECTION_STREAM = 9  # train/rows.py step_seed stream of the per-row selection (rows.py 0-3, NFT 5-6)


def candidate_steps(selection: str, num_steps: int) -> int:
    """C: the steps a selection draws from (first: all T; random, windows: the first T - 1, as the peers)."""
    return num_steps if selection == "first" else max(1, num_steps - 1)


def trained_count(selection: str, num_steps: int, fraction: float, window: int = 1) -> int:
    """K: the steps each row trains."""
    C = candidate_steps(selection, num_steps)
    if selection == "windows":
        return max(1, int(C // window * fraction)) * window
    return max(1, int(C * fraction))


def select_steps(selection: str, num_steps: int, fraction: float, window: int, seed: int, step: int,
                 rows: torch.Tensor) -> torch.Tensor:
    """[K, len(rows)] long: the sorted steps each global row in `rows` trains at training step `step`."""
    from ..train.rows import row_seed  # the trainer's seed scheme (rows.py sits above grpo/)

    C, K = candidate_steps(selection, num_steps), trained_count(selection, num_steps, fraction, window)
    if selection == "first":
        return torch.arange(K).unsqueeze(1).expand(K, len(rows)).clone()
    out = []
    for r in rows.tolist():
        gen = torch.Generator().manual_seed(row_seed(seed, step, SELECTION_STREAM, r))
        if selection == "random":
            picked = torch.randperm(C, generator=gen)[:K]
        else:
            blocks = torch.randperm(C // window, generator=gen)[: K // window]
            picked = (blocks.unsqueeze(1) * window + torch.arange(window)).flatten()
        out.append(picked.sort().values)
    return torch.stack(out, dim=1)


def positioned(batch: StepBatch, steps: torch.Tensor) -> tuple[StepBatch, list[int]]:
    """The batch re-laid out over each row's own steps `steps` [K, B] (module docstring), and the K positions
    (0, 2, ..., 2K - 2) the loss and the knot plan index it by."""
    K, B = steps.shape
    cols = torch.arange(B, device=batch.latents.device)
    at = steps.to(batch.latents.device)
    pair = torch.stack([at, at + 1], dim=1).reshape(2 * K, B)  # x_k, x_{k+1} of each position, interleaved

    def per_row(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
        return None if t is None else t[index, cols]

    def spaced(t: torch.Tensor | None) -> torch.Tensor | None:  # a per-step value at the even slots (odd: unused)
        return None if t is None else per_row(t, at).repeat_interleave(2, dim=0)

    sigmas = batch.sigmas.to(at.device)
    return dataclasses.replace(
        batch, latents=per_row(batch.latents, pair), velocities=spaced(batch.velocities),
        log_probs=spaced(batch.log_probs), sigmas=sigmas[pair], sigma_max=batch.s_max,
        ref_velocities=spaced(batch.ref_velocities), uncond_velocities=spaced(batch.uncond_velocities),
        rollout_uncond=spaced(batch.rollout_uncond),
    ), list(range(0, 2 * K, 2))
