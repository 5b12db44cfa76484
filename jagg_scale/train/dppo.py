"""Flow-DPPO as an algorithm unit (train.algorithm dppo; the contract in algorithm.py): `DPPO(cfg, policy, engine,
dist)`, GRPO's unit (update.py) with Flow-DPPO's loss.

    rollout_spec(step)   GRPO's: the SDE rollout with every trained step's latents, velocities and log-probs kept
                         (the velocities are what the old policy's SDE means are computed from: no replay forward)
    advantages           the group-relative advantages (algorithm.py)
    update(...)          GRPO's minibatches through the runner (runner.py), each with DPPOStepLoss (dppo/loss.py): the
                         unclipped ratio, masked where the exact KL between the old and the current step is at or
                         above dppo.kl_mask_threshold and the ratio moved in the advantage's direction; the first
                         minibatch's log-ratio is the on-policy invariant's value, as under GRPO

The old policy (log-probs and means) is the rollout's, the same for every minibatch and inner epoch, as both peers
freeze it once per rollout (UniRL prepare_segment, verl-omni's old-log-prob pass).
"""

from __future__ import annotations

from ..dppo import DPPOStepLoss
from ..grpo.guidance import Guidance
from .update import GRPO

__all__ = ["DPPO"]


class DPPO(GRPO):
    """Flow-DPPO (module docstring): GRPO's rollout, steps and minibatches, Flow-DPPO's per-step loss."""

    name = "dppo"

    def make_loss(self, *, scale: float, denominator: float, guidance: Guidance) -> DPPOStepLoss:
        cfg = self.cfg
        return DPPOStepLoss(noise_level=cfg.sampling.noise_level, kl_mask_threshold=cfg.dppo.kl_mask_threshold,
                            add_kl_coefficient=cfg.dppo.add_kl_coefficient, beta=cfg.grpo.kl_beta, scale=scale,
                            denominator=denominator, guidance=guidance, guidance_rule=self.policy.guidance_rule,
                            sde=cfg.sampling.sde)
