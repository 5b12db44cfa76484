"""The nft section of the run configuration (train.algorithm nft; a component's section beside it, as dppo/config.py
and awm/config.py): DiffusionNFT's own settings (NVlabs/DiffusionNFT config/nft.py, scripts/train_nft_sd3.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..sections import Section, require
from .loss import AdvMode

__all__ = ["NFTConfig", "NFTNoise", "NFTOldAt", "NFTTimesteps"]

NFTTimesteps = Literal["per_row", "per_batch"]  # nft.timesteps: each sample its own training timesteps | one draw
NFTNoise = Literal["per_timestep", "per_sample", "per_window"]  # nft.noise: which training timesteps share a draw
NFTOldAt = Literal["timesteps", "knots"]  # nft.old_at: where the old policy's and the reference's velocities are run


@dataclass
class NFTConfig(Section):
    """DiffusionNFT (train.algorithm nft; NVlabs/DiffusionNFT config/nft.py and scripts/train_nft_sd3.py): its own
    settings. The group advantages are grpo's (group_size, global_std, adv_clip_max), the trained timesteps
    int(num_steps x grpo.timestep_fraction) of the sampling schedule's, the rollout the old policy's ODE
    (sampling.ode_solver on the whole trajectory), the gradient the jagg section's planner over each sample's
    timesteps (mode exact: one backward per timestep, as DiffusionNFT). Each inner epoch (grpo.inner_epochs) draws
    the timesteps and noise afresh, as DiffusionNFT (scripts/train_nft_sd3.py:806-812, 868)."""

    mix: float = 1.0  # the implicit policies' step: v_+ = beta v + (1 - beta) v_old (its config.beta)
    kl_beta: float = 1e-4  # weight of ||v - v_ref||^2 to the starting model (its config.train.beta); 0: no reference
    # the old policy's soft update after every rollout, old = decay old + (1 - decay) trained, decay =
    # min(max(0, (optimizer steps - flat) x rate), max) as [flat, rate, max]; DiffusionNFT's decay_type 1 (its
    # default) is [0, 0.001, 0.5], decay_type 2 (OCR) [75, 0.0075, 0.999], decay_type 0 [0, 0, 0]
    old_decay: tuple[float, float, float] = (0.0, 0.001, 0.5)
    # which of a sample's training timesteps share one noise draw e. Inputs x_t = (1 - t) d + t e of one draw are
    # collinear, which is when JAGG's interpolation is exact for a velocity affine in (x, t) (docs/algorithm.md,
    # section 8). per_timestep: fresh noise at each, as DiffusionNFT; per_sample: one draw for all K; per_window: one
    # draw per JAGG window (jagg.window of the sorted timesteps), fresh between windows: each window on its own line,
    # a draw per window instead of one per sample
    noise: NFTNoise = "per_timestep"
    # where the old policy's and the reference's velocities (no grad) are run: at every training timestep, as
    # DiffusionNFT, or at the plan's knots only and linear in t between them inside a window (the JAGG assumption
    # applied to the frozen models' values: exact for velocities affine along a window's line): 2 forwards per
    # window of each instead of one per timestep. knots needs a plan known before training (jagg.mode jagg with
    # jagg_frac 1, or share_knots)
    old_at: NFTOldAt = "timesteps"
    timesteps: NFTTimesteps = "per_row"  # per_row: each sample's own random timesteps, as DiffusionNFT
    # the clipped advantage before its map to r (nft/loss.py; DiffusionNFT train_nft_sd3.py:915-925): all as is (its
    # config/nft.py:62), positive_only / negative_only the other sign's to 0, one_only 1 where > 0 else 0, binary sign
    adv_mode: AdvMode = "all"

    # read of a forward-process section (as awm/config.py's): the old policy is the one shadow copy of the weights in
    # the engine and the one frozen policy besides the reference run at the training timesteps (or the knots)
    shadow_weights = frozen_policies = 1
    frozen_at_knots = property(lambda self: self.old_at == "knots")

    def check(self, prefix: str) -> None:
        require(self.mix > 0, f"{prefix}.mix", f"must be > 0 (the loss divides by it), got {self.mix}")
        require(self.kl_beta >= 0, f"{prefix}.kl_beta", f"must be >= 0, got {self.kl_beta}")
        flat, rate, top = self.old_decay
        require(flat >= 0 and rate >= 0 and 0 <= top < 1, f"{prefix}.old_decay",
                f"must be [flat >= 0, rate >= 0, max in [0, 1)], got {list(self.old_decay)}")
