"""The per-step GRPO loss of Flow-GRPO, evaluated at a given velocity.

    ratio = exp(log p_k(theta) - log p_k(old))
    L_k   = mean_batch max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)) + beta KL_k

`GRPOStepLoss(batch, k, v_k)` is the loss of step k of a minibatch's `StepBatch`; `loss.on(batch)` is the
`step_loss(k, v_k)` closure knot_backward differentiates. It depends on theta only through v_k, which is what
lets JAGG move the transformer backward out of the per-step loop. It also records the metrics of each evaluation
(clipfrac, approx_kl, ratio, kl) as detached tensors in `metrics`, so no extra pass is spent on logging (the
runner reduces them: train/runner.py reduce_metrics).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..jagg.backward import MinibatchLoss
from .guidance import Guidance, guide, scale_at
from .sde import SDE_STEPS, kl_to_reference


@dataclass
class StepBatch:
    """What the loss of one minibatch needs from the rollout, for every step the trajectory stores (T of them: the
    trained range, grpo/rollout.py; position k is its k-th step). The predictions may be the model's bf16 / fp16:
    whoever reads them upcasts before float32 math."""

    latents: torch.Tensor  # [T + 1, B, ...] the latents of the stored steps and the one after the last
    velocities: torch.Tensor  # [T, B, ...] the rollout's v_k
    log_probs: torch.Tensor  # [T, B] the rollout's log p_k
    sigmas: torch.Tensor  # [T + 1], or [T + 1, B] when rows train different steps (grpo/steps.py positioned)
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # bool [B]
    ref_velocities: torch.Tensor | None = None  # [T, B, ...] when beta > 0
    uncond_velocities: torch.Tensor | None = None  # [T, B, ...] with CFG: the unconditional predictions u_k
    sigma_max: torch.Tensor | None = None  # the schedule's s_1 (the SDE's std at s = 1); None: sigmas[1]
    # [T, B, ...] with CFG once uncond_velocities were recomputed at moved weights (Policy.fresh_uncond): the
    # rollout's own u_k, which the old policy's velocity is guided with (Flow-DPPO's old mean); None: not refreshed
    rollout_uncond: torch.Tensor | None = None

    @property
    def old_uncond(self) -> torch.Tensor | None:
        """The rollout's unconditional predictions, refreshed or not."""
        return self.uncond_velocities if self.rollout_uncond is None else self.rollout_uncond

    @property
    def s_max(self) -> torch.Tensor:
        return self.sigmas[1] if self.sigma_max is None else self.sigma_max

    def rows(self, index) -> "StepBatch":
        """The rows `index` (a slice or index tensor) of the batch: a micro-batch."""
        def per_step(t):
            return None if t is None else t[:, index]

        return StepBatch(latents=per_step(self.latents), velocities=per_step(self.velocities),
                         log_probs=per_step(self.log_probs),
                         sigmas=self.sigmas if self.sigmas.ndim == 1 else per_step(self.sigmas),
                         advantages=self.advantages[index], mask=self.mask[index],
                         ref_velocities=per_step(self.ref_velocities),
                         uncond_velocities=per_step(self.uncond_velocities), sigma_max=self.sigma_max,
                         rollout_uncond=per_step(self.rollout_uncond))


@dataclass
class GRPOStepLoss(MinibatchLoss):
    """L_k of one minibatch at a velocity: `loss(batch, k, v_k)`; `scale` divides each L_k (1 / number of trained
    steps, so the update is the mean over trained steps as in Flow-GRPO's accumulation)."""

    noise_level: float
    clip_range: float
    beta: float = 0.0
    scale: float = 1.0
    # The loss is a mean over the minibatch's valid rows. Under data parallelism a rank holds a slice and the
    # engine averages gradients over ranks, so a rank divides by (global valid rows / world size) instead of
    # its own count: the averaged gradient is then the full minibatch's. None: this batch's own count.
    denominator: float | None = None
    # Classifier-free guidance: with guidance g != 1 the loss is called with the conditional prediction c_k and
    # evaluates L_k at the guided velocity u_k + g (c_k - u_k), u_k from the batch: a constant for the gradient, so
    # dL/dc = g dL/dv flows through the conditional branch only (Flow-GRPO detaches the unconditional one).
    guidance: Guidance = 1.0  # ExpertGuidance: a scale per expert, at the step's sigma (grpo/guidance.py)
    guidance_rule: str = "plain"  # the model family's CFG rule (grpo/guidance.py), as the rollout sampled with it
    sde: str = "flow_grpo"  # the stochastic step the rollout sampled with (grpo/sde.py: flow_grpo | cps)
    # > 0: a rollout sampled by an earlier policy version (pools.max_staleness) trained with decoupled PPO: the ratio
    # and its clip taken to the weights being trained (their log-prob, detached: the proximal policy), the behaviour
    # policy corrected by the importance weight p(prox) / p(behaviour) capped here (pools.importance_cap); 0: the
    # ratio to the behaviour policy's log-probs as recorded at rollout (Flow-GRPO's objective as it is)
    importance_cap: float = 0.0
    metrics: dict = field(default_factory=lambda: defaultdict(list))
    log_ratios: list = field(default_factory=list, init=False)  # |log ratio| maxima per evaluation (log_ratio_max)

    def transition(self, b: StepBatch, k: int, v: torch.Tensor):
        """The SDE step k of the batch's trajectory at velocity v (the conditional prediction under CFG, guided
        here): its mean and the log-probability of the stored x_{k+1} (grpo/sde.py SDEStep)."""
        if self.guidance != 1.0:
            if b.uncond_velocities is None:
                raise ValueError("guidance != 1 needs the unconditional predictions (StepBatch.uncond_velocities)")
            u = b.uncond_velocities[k].detach().to(v.dtype)
            v = guide(v, u, scale_at(self.guidance, b.sigmas[k]), self.guidance_rule)
        s, s_next, sigma_max = b.sigmas[k], b.sigmas[k + 1], b.s_max  # tensors: no host read
        return SDE_STEPS[self.sde](b.latents[k], v, s, s_next, noise_level=self.noise_level, sigma_max=sigma_max,
                                   prev_sample=b.latents[k + 1])

    def __call__(self, b: StepBatch, k: int, v: torch.Tensor) -> torch.Tensor:
        step = self.transition(b, k, v)
        s, s_next, sigma_max = b.sigmas[k], b.sigmas[k + 1], b.s_max
        sde_step = SDE_STEPS[self.sde]
        log_ratio = step.log_prob - b.log_probs[k].float()  # to the behaviour policy
        adv = b.advantages.float()
        if self.importance_cap > 0:  # decoupled: ratio 1 at the proximal weights, the behaviour's share a weight
            prox = step.log_prob.detach()
            weight = torch.exp(prox - b.log_probs[k].float()).clamp(max=self.importance_cap)
            ratio, adv = torch.exp(step.log_prob - prox), adv * weight
        else:
            ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - self.clip_range, 1.0 + self.clip_range)
        w = b.mask.float()
        denom = w.sum().clamp_min(1.0)  # for the metrics: means over this batch's valid rows
        loss_denom = denom if self.denominator is None else max(float(self.denominator), 1e-12)
        policy = (torch.maximum(unclipped, clipped) * w).sum() / loss_denom
        loss = policy
        kl = None
        if self.beta > 0:
            if b.ref_velocities is None:
                raise ValueError("beta > 0 needs the rollout's reference velocities (ref_velocities)")
            ref = sde_step(b.latents[k], b.ref_velocities[k], s, s_next, noise_level=self.noise_level,
                           sigma_max=sigma_max, prev_sample=b.latents[k + 1])
            kl = (kl_to_reference(step.mean, ref.mean, step.std) * w).sum() / loss_denom
            loss = loss + self.beta * kl
        with torch.no_grad():
            m = self.metrics
            # detached tensors, read to the host once per training step (train/trainer.py fetch_metrics): no device sync
            m["policy_loss"].append(policy.detach())
            m["kl"].append(kl.detach() if kl is not None else torch.zeros((), device=policy.device))
            m["approx_kl"].append(0.5 * ((log_ratio**2) * w).sum() / denom)
            m["clipfrac"].append((((ratio - 1.0).abs() > self.clip_range).float() * w).sum() / denom)
            m["ratio_mean"].append((ratio * w).sum() / denom)
            m["ratio_max"].append(ratio.max())
            m["ratio_min"].append(ratio.min())
            self.log_ratios.append(log_ratio.abs().max())
            if self.importance_cap > 0:
                m["importance_weight_mean"].append((weight * w).sum() / denom)
        return loss * self.scale

    def log_ratio_max(self) -> torch.Tensor:
        """max |log p(theta) - log p(old)| over every row (masked ones too) and step this loss evaluated: on a
        step's first minibatch, at the rollout's own parameters, the on-policy invariant's value (0-d, on the
        device: read with the step's metrics)."""
        return torch.stack(self.log_ratios).max()
