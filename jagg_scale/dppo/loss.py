"""Flow-DPPO's per-step loss (arXiv 2606.11025), evaluated at a given velocity: Flow-GRPO's ratio without its clip,
and an asymmetric mask from the exact KL between the old and the current policy's SDE transitions.

With the rollout's log-probability log p_k(old) and the current one log p_k(theta) of the same transition x_k ->
x_{k+1}, mu_old and mu_theta the two steps' means (the same SDE, grpo/sde.py, at the rollout's velocity and at v_k)
and sigma_t the transition's own std (flow_grpo: std_k sqrt(-dt); cps: std_k),

    ratio  = exp(log p_k(theta) - log p_k(old))
    D_k    = mean over a sample's dims of (mu_theta - mu_old)^2 / (2 sigma_t^2)    (add_kl_coefficient false: / 2)
    drop   = D_k >= tau  and  ((ratio > 1 and A > 0) or (ratio < 1 and A < 0))
    L_k    = mean_rows( -A ratio [not drop] ) + beta KL_k(ref)

D_k is the KL of two Gaussians of one variance (the paper's Eq. 14) averaged, not summed, over the latent's
dimensions, so tau = dppo.kl_mask_threshold is calibrated on the mean (both peers: Tencent-Hunyuan/UniRL
unirl/algorithms/flowdppo.py:43-138 at 1a7b501, `_gaussian_kl_div` and `_flowdppo_kl_adv_loss`; verl-project/verl-omni
verl_omni/trainer/diffusion/diffusion_algos.py:361-443 at a1139ba, `FlowDPPOLoss`). A dropped row contributes 0 and
still counts in the mean's denominator (their torch.where(keep, -A ratio, 0).mean()). A high-KL step that moves
back towards the old policy (A > 0 with ratio < 1, or A < 0 with ratio > 1) is kept: it is corrective.
KL_k(ref) is Flow-GRPO's term to the frozen reference (grpo/sde.py kl_to_reference; grpo.kl_beta, grpo.ref_at), as
verl-omni adds it to every policy-gradient loss (verl_omni/workers/utils/losses.py:101-105, its `kl` loss
diffusion_algos.py:1013-1037: use_kl_loss, off by default); UniRL's FlowDPPO has none.

Choices where the two peers differ or leave it open:
  * mu_old is the step's mean at the rollout's own velocity (the velocities the trajectory keeps, guided with the
    rollout's unconditional predictions under CFG), the same values log p_k(old) came from; no forward is spent on
    it. UniRL replays every trained step at the pre-update weights for it (flowdppo.py:219-266, prepare_segment) and
    verl-omni recomputes old log-probs and means in one no-grad pass (ray_diffusion_trainer.py:1047-1065). At the
    rollout's weights the two agree up to the numerics the on-policy invariant bounds (train/invariants.py: the first
    minibatch's |log ratio|, which DPPO checks as GRPO does).
  * sigma_t is the transition's own std: std_k = a sqrt(s_k / (1 - s_k)) with Flow-GRPO's s_1 in the denominator
    at s_k = 1, times sqrt(-dt), as verl-omni takes it from the scheduler step that scored the log-prob. UniRL's
    `_compute_sigma_t` (flowdppo.py:342-368) clamps s_k at 0.99 instead (at s_k = 1: 10 a, where its own sampler's
    std is a / sqrt(1 - s_1)): the two differ on step 0 alone (tests/dppo/test_dppo_loss.py). A trained step's
    sigma_t is never 0 (flow_grpo: s_k > 0; cps: its deterministic last step is refused as under GRPO).
  * Everything in float32 (the means, the KL, the ratio), as both peers' log-probs and verl-omni's means are.
  * The advantages are the group advantages clipped at grpo.adv_clip_max (grpo/advantages.py); verl-omni's
    FlowDPPOLoss leaves them unclipped (its FlowGRPOLoss clips), UniRL's are never clipped.

L_k depends on theta only through v_k: the mask and D_k are functions of v_k but enter the loss as constants (the
peers' keep mask is detached; D_k appears in no gradient), so g_k = dL_k/dv_k is analytic and knot_backward
(jagg/backward.py) runs the loss unchanged: docs/algorithm.md, "Flow-DPPO".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..grpo.guidance import Guidance, guide, scale_at
from ..grpo.loss import StepBatch
from ..grpo.sde import SDE_STEPS, kl_to_reference
from ..jagg.backward import MinibatchLoss

__all__ = ["DPPOStepLoss", "DPPOTerms", "dppo_terms"]


class DPPOTerms(NamedTuple):
    """Flow-DPPO's arithmetic on one step's values, per row [B]."""

    per_row: torch.Tensor  # -A ratio where kept, 0 where dropped (differentiable through the ratio)
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor  # D_k (no grad)
    keep: torch.Tensor  # bool
    pos_removed: torch.Tensor  # bool: dropped with ratio > 1, A > 0
    neg_removed: torch.Tensor  # bool: dropped with ratio < 1, A < 0


def dppo_terms(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
               noise_std: torch.Tensor, adv: torch.Tensor, threshold: float, add_kl_coefficient: bool = True
               ) -> DPPOTerms:
    """The module docstring's ratio, D_k and mask from the current and old log-probs [B], step means [B, ...] and the
    transition's std (broadcastable to the means), in float32. The mask and D_k are constants for the gradient."""
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    adv = adv.float()
    with torch.no_grad():
        shift = (mean.detach().float() - old_mean.float()) ** 2
        kl = shift / (2 * noise_std.float() ** 2) if add_kl_coefficient else shift / 2
        kl = kl.mean(dim=tuple(range(1, kl.ndim)))
        high = kl >= threshold
        pos = high & (ratio > 1.0) & (adv > 0)
        neg = high & (ratio < 1.0) & (adv < 0)
        keep = ~(pos | neg)
    # torch.where, not a product: a ratio that overflowed to inf on a dropped row leaves no inf * 0 = nan
    per_row = torch.where(keep, -adv * ratio, torch.zeros((), device=ratio.device))
    return DPPOTerms(per_row, log_ratio, ratio, kl, keep, pos, neg)


@dataclass
class DPPOStepLoss(MinibatchLoss):
    """L_k of one minibatch at a velocity (module docstring): `loss(batch, k, v_k)`; `scale` divides each L_k (1 / the
    number of trained steps: the mean over them, as GRPOStepLoss). The batch, CFG, sde kinds, `denominator` and the
    on-policy `log_ratio_max` are GRPOStepLoss's (grpo/loss.py)."""

    noise_level: float
    kl_mask_threshold: float = 1e-5
    add_kl_coefficient: bool = True  # D_k divided by sigma_t^2 (the exact KL); false: the squared mean shift / 2
    beta: float = 0.0  # weight of the KL to the frozen reference (grpo.kl_beta)
    scale: float = 1.0
    denominator: float | None = None  # valid rows of the minibatch per rank (None: this batch's own count)
    guidance: Guidance = 1.0
    guidance_rule: str = "plain"
    sde: str = "flow_grpo"
    metrics: dict = field(default_factory=lambda: defaultdict(list))
    log_ratios: list = field(default_factory=list, init=False)

    def _guided(self, b: StepBatch, k: int, v: torch.Tensor, uncond: torch.Tensor | None) -> torch.Tensor:
        if self.guidance == 1.0:
            return v
        if uncond is None:
            raise ValueError("guidance != 1 needs the unconditional predictions (StepBatch.uncond_velocities)")
        return guide(v, uncond[k].detach().to(v.dtype), scale_at(self.guidance, b.sigmas[k]), self.guidance_rule)

    def __call__(self, b: StepBatch, k: int, v: torch.Tensor) -> torch.Tensor:
        s, s_next, sigma_max = b.sigmas[k], b.sigmas[k + 1], b.s_max
        sde_step = SDE_STEPS[self.sde]
        x, x_next = b.latents[k], b.latents[k + 1]
        step = sde_step(x, self._guided(b, k, v, b.uncond_velocities), s, s_next, noise_level=self.noise_level,
                        sigma_max=sigma_max, prev_sample=x_next)
        with torch.no_grad():  # the old policy's step: the rollout's velocity (module docstring)
            old = sde_step(x, self._guided(b, k, b.velocities[k].float(), b.old_uncond), s, s_next,
                           noise_level=self.noise_level, sigma_max=sigma_max, prev_sample=x_next)
        t = dppo_terms(step.log_prob, b.log_probs[k], step.mean, old.mean, step.noise_std, b.advantages,
                       self.kl_mask_threshold, self.add_kl_coefficient)
        w = b.mask.float()
        denom = w.sum().clamp_min(1.0)  # for the metrics: means over this batch's valid rows
        loss_denom = denom if self.denominator is None else max(float(self.denominator), 1e-12)
        policy = (t.per_row * w).sum() / loss_denom
        loss = policy
        kl_ref = None
        if self.beta > 0:
            if b.ref_velocities is None:
                raise ValueError("beta > 0 needs the rollout's reference velocities (ref_velocities)")
            ref = sde_step(x, b.ref_velocities[k], s, s_next, noise_level=self.noise_level, sigma_max=sigma_max,
                           prev_sample=x_next)
            kl_ref = (kl_to_reference(step.mean, ref.mean, step.std) * w).sum() / loss_denom
            loss = loss + self.beta * kl_ref
        with torch.no_grad():
            m, valid = self.metrics, b.mask
            m["policy_loss"].append(policy.detach())
            m["kl"].append(kl_ref.detach() if kl_ref is not None else torch.zeros((), device=policy.device))
            m["approx_kl"].append(0.5 * ((t.log_ratio**2) * w).sum() / denom)
            m["kl_new_old_mean"].append((t.kl * w).sum() / denom)
            m["kl_new_old_max"].append(torch.where(valid, t.kl, torch.zeros_like(t.kl)).max())
            m["kl_mask_fraction"].append(((t.kl >= self.kl_mask_threshold).float() * w).sum() / denom)
            m["masked_fraction"].append(((~t.keep).float() * w).sum() / denom)
            m["pos_removed_fraction"].append((t.pos_removed.float() * w).sum() / denom)
            m["neg_removed_fraction"].append((t.neg_removed.float() * w).sum() / denom)
            m["ratio_mean"].append((t.ratio * w).sum() / denom)
            m["ratio_max"].append(t.ratio.max())
            m["ratio_min"].append(t.ratio.min())
            self.log_ratios.append(t.log_ratio.abs().max())
        return loss * self.scale

    def log_ratio_max(self) -> torch.Tensor:
        """max |log p(theta) - log p(old)| over every row and step evaluated (GRPOStepLoss.log_ratio_max): on a
        step's first minibatch, the on-policy invariant's value."""
        return torch.stack(self.log_ratios).max()
