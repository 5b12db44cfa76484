"""The dppo section of the run configuration (train.algorithm dppo; a component's section beside it): Flow-DPPO's
own settings, the two both peers expose, at their defaults (Tencent-Hunyuan/UniRL unirl/algorithms/flowdppo.py:28-35
at 1a7b501, FlowDPPOConfig; verl-project/verl-omni verl_omni/workers/config/diffusion/actor.py:47-48 at a1139ba,
DiffusionLossConfig). Everything else is GRPO's: the SDE rollout (sampling.*), the group advantages and the trained
steps (grpo.*; grpo.clip_range has no meaning here and is refused), the KL to the reference (grpo.kl_beta, ref_at)."""

from __future__ import annotations

from dataclasses import dataclass

from ..sections import Section, require

__all__ = ["DPPOConfig"]


@dataclass
class DPPOConfig(Section):
    # tau: a row whose mean-reduced KL between the old and the current SDE step is at or above this, and whose ratio
    # moved in its advantage's direction, is dropped from the loss (dppo/loss.py)
    kl_mask_threshold: float = 1e-5
    # true: the KL divides the squared mean shift by the transition's variance (the exact Gaussian KL); false: by 1
    # (the raw shift / 2, both peers' option)
    add_kl_coefficient: bool = True

    def check(self, prefix: str) -> None:
        # verl-omni refuses a threshold <= 0 (actor.py:70-71): at 0 every row would be "high-KL"
        require(self.kl_mask_threshold > 0, f"{prefix}.kl_mask_threshold",
                f"must be > 0, got {self.kl_mask_threshold}")
