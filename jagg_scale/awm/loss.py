"""Advantage Weighted Matching's objective (AWM, arXiv 2509.25050; X-GenGroup/Flow-Factory trainers/awm.py, commit
a0b2bc5), evaluated at a given velocity so that knot_backward can differentiate it.

A sample's clean latent d (a CFG-free ODE rollout) is noised at training timestep t with noise e,
x_t = (1 - t) d + t e, and the flow-matching target there is u = e - d (awm.py:372-373). With the trained velocity
v = v_theta(x_t, t) and the sample's group advantage A (clipped to +-grpo.adv_clip_max, awm.py:467-469):

    m      = mean over the sample's dims of (v - u)^2                    in float64 (awm.py:304-310)
    lp     = w(m, t)                                                     the weighted matching log-prob, float32
             Uniform  -m          t  -m t          t**2  -m t^2          (awm.py:312-330)
             huber    -(sqrt(m + 1e-10) - 1e-5) t
             ghuber   -((m + 1e-10)^p - (1e-10)^p) t / p                 p = awm.ghuber_power
    ratio  = exp(lp - lp_old)                                            (awm.py:497)
    L      = max(-A ratio, -A clip(ratio, 1 - c, 1 + c))                 c = awm.clip_range (awm.py:498-502)
           + kl_beta ||v - v_ref||^2 + ema_kl_beta ||v - v_ema||^2      means over dims (awm.py:507-537)

lp_old is the sampling policy's (awm.py:441-461): on-policy (awm.off_policy false) the current weights at the
minibatch, whose optimizer step comes only after it (awm.py:552-559), so lp_old = sg(lp) here, ratio is 1 in value
and the gradient is -A dlp/dv: advantage-weighted flow matching, no forward spent on it. Off-policy it is the EMA
policy's, lp(v_ema), and the clip acts. L depends on theta only through v (u, t, A, v_ref, v_ema and lp_old are
constants), which is what lets JAGG move the transformer backward out of the per-timestep loop (docs/algorithm.md,
"AWM").

`AWMStepLoss(batch, k, v)` is the loss of timestep position k of an `AWMBatch`; `loss.on(batch)` the step_loss(k, v)
closure knot_backward takes. Means over the batch are over its valid rows (`denominator` as in grpo/loss.py); the
reference's means over its per-device batch are the same with every row valid.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..jagg.backward import MinibatchLoss

__all__ = ["AWMBatch", "AWMStepLoss", "Weighting", "weighted_log_prob"]

Weighting = Literal["Uniform", "t", "t**2", "huber", "ghuber"]  # awm.weighting: the reference's names (awm.py:288)
EPS = 1e-10  # awm.py:321-323


def weighted_log_prob(v: torch.Tensor, target: torch.Tensor, t: torch.Tensor, weighting: Weighting = "Uniform",
                      ghuber_power: float = 0.25) -> torch.Tensor:
    """[B] the weighted matching log-prob w(mean((v - target)^2), t) of the module docstring, computed in float64 and
    returned in float32 as the reference does (awm.py:283-330); t [B] the noise levels in [0, 1]."""
    m = ((v.double() - target.double()) ** 2).mean(dim=tuple(range(1, v.ndim)))
    t = t.reshape(-1).float()  # the reference's sigma is float32 (flow_match_sigma of float32 timesteps)
    if weighting == "Uniform":
        lp = -m
    elif weighting == "t":
        lp = -m * t
    elif weighting == "t**2":
        lp = -m * t**2
    elif weighting == "huber":
        lp = -(torch.sqrt(m + EPS) - 1e-5) * t
    elif weighting == "ghuber":
        eps = torch.tensor(EPS, device=m.device, dtype=m.dtype)
        lp = -(torch.pow(m + eps, ghuber_power) - torch.pow(eps, ghuber_power)) * t / ghuber_power
    else:
        raise ValueError(f"unknown AWM weighting {weighting!r}")
    return lp.float()


@dataclass
class AWMBatch:
    """What the loss of one minibatch needs, per training timestep position k (K of them per sample)."""

    clean: torch.Tensor  # [B, ...] the sampled clean latents d
    t: torch.Tensor  # [K, B] the training timesteps (noise levels in [0, 1]) of each sample, in position order
    noised: torch.Tensor  # [K, B, ...] x_t = (1 - t) d + t e
    noise: torch.Tensor  # [K, B, ...] e: the target is e - d
    advantages: torch.Tensor  # [B] the group advantages, clipped
    mask: torch.Tensor  # bool [B]: rows with a valid reward
    ema: torch.Tensor | None = None  # [K, B, ...] the EMA policy's velocities (ema_kl_beta > 0 or off-policy)
    ref: torch.Tensor | None = None  # [K, B, ...] the reference's velocities, when kl_beta > 0

    def rows(self, index) -> "AWMBatch":
        """The rows `index` of the batch: a micro-batch."""
        per_k = lambda t: None if t is None else t[:, index]  # noqa: E731
        return AWMBatch(clean=self.clean[index], t=self.t[:, index], noised=per_k(self.noised),
                        noise=per_k(self.noise), advantages=self.advantages[index], mask=self.mask[index],
                        ema=per_k(self.ema), ref=per_k(self.ref))


def _mean_over_sample(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


@dataclass
class AWMStepLoss(MinibatchLoss):
    """L_k of one minibatch at a velocity: `loss(batch, k, v_k)`; `scale` divides each L_k (1 / K: the update is the
    mean over a sample's training timesteps, as the reference's accumulation over them, Flow-Factory
    hparams/args.py:403-404)."""

    weighting: Weighting = "Uniform"
    ghuber_power: float = 0.25
    clip_range: float = 1e-4  # the ratio's clip: [1 - c, 1 + c]
    off_policy: bool = False  # lp_old is the EMA policy's (batch.ema), else the current weights' own
    kl_beta: float = 0.0  # weight of ||v - v_ref||^2
    ema_kl_beta: float = 0.0  # weight of ||v - v_ema||^2
    scale: float = 1.0
    denominator: float | None = None  # valid rows of the minibatch per rank (None: this batch's own count)
    metrics: dict = field(default_factory=lambda: defaultdict(list))

    def __call__(self, b: AWMBatch, k: int, v: torch.Tensor) -> torch.Tensor:
        v = v.float()
        target = b.noise[k].float() - b.clean.float()
        t = b.t[k].float()
        lp = weighted_log_prob(v, target, t, self.weighting, self.ghuber_power)
        if self.off_policy:
            if b.ema is None:
                raise ValueError("off_policy needs the EMA policy's velocities (AWMBatch.ema)")
            with torch.no_grad():
                old = weighted_log_prob(b.ema[k].float(), target, t, self.weighting, self.ghuber_power)
        else:  # the current weights sampled: lp_old is lp's own value (awm.py:441-461 under the same weights)
            old = lp.detach()
        ratio = torch.exp(lp - old)
        a = b.advantages.float()
        unclipped = -a * ratio
        clipped = -a * ratio.clamp(1.0 - self.clip_range, 1.0 + self.clip_range)
        per_row = torch.maximum(unclipped, clipped)
        w = b.mask.float()
        denom = w.sum().clamp_min(1.0)
        loss_denom = denom if self.denominator is None else max(float(self.denominator), 1e-12)
        policy = (per_row * w).sum() / loss_denom
        loss = policy
        terms = {}
        for name, beta, frozen in (("kl", self.kl_beta, b.ref), ("ema_kl", self.ema_kl_beta, b.ema)):
            if beta > 0:
                if frozen is None:
                    raise ValueError(f"the {name} term needs its model's velocities in the AWMBatch")
                terms[name] = (_mean_over_sample((v - frozen[k].float()) ** 2) * w).sum() / loss_denom
                loss = loss + beta * terms[name]
        with torch.no_grad():
            m = self.metrics
            m["policy_loss"].append(policy.detach())
            for name in ("kl", "ema_kl"):
                m[name].append(terms[name].detach() if name in terms else torch.zeros((), device=policy.device))
            outside = ((ratio < 1.0 - self.clip_range) | (ratio > 1.0 + self.clip_range)).float()
            m["clip_frac"].append((outside * w).sum() / denom)
            m["ratio_max"].append(torch.where(b.mask, ratio, 1.0).max().detach())
            m["ratio_min"].append(torch.where(b.mask, ratio, 1.0).min().detach())
        return loss * self.scale
