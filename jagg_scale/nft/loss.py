"""DiffusionNFT's objective (arXiv 2509.16117; NVlabs/DiffusionNFT scripts/train_nft_sd3.py): online RL on the forward
process, evaluated at a given velocity so that knot_backward can differentiate it.

A sample's clean latent d (sampled by the old policy with a deterministic ODE solver, CFG-free) is noised at training
timestep t: x_t = (1 - t) d + t e. With the trained velocity v = v_theta(x_t, t), the old policy's v_old and the
reference's v_ref (no grad),

    v_+ = beta v + (1 - beta) v_old            the implicit positive policy
    v_- = (1 + beta) v_old - beta v            the implicit negative policy
    d_+ = x_t - t v_+,   d_- = x_t - t v_-     their data predictions
    w_+ = sg(mean |d_+ - d|),  w_- = sg(mean |d_- - d|)    (adaptive x0 weighting, clipped at 1e-5; float64)
    L   = (r ||d_+ - d||^2 / w_+ + (1 - r) ||d_- - d||^2 / w_-) / beta x adv_clip_max  (means over a sample's dims)
        + kl_beta ||v - v_ref||^2

with r in [0, 1] the sample's optimality: its group advantage clipped to +-adv_clip_max, changed by adv_mode
(`optimality`; all keeps it) and mapped by r = clip(A / adv_clip_max / 2 + 1/2, 0, 1). L depends on theta only
through v, which is what lets JAGG move the transformer backward out of the per-timestep loop (docs/algorithm.md,
section 8).

`NFTStepLoss(batch, k, v)` is the loss of timestep position k of an `NFTBatch`; `loss.on(batch)` the step_loss(k, v)
closure knot_backward takes. Means over the batch are over its valid rows (`denominator` as in grpo/loss.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..jagg.backward import MinibatchLoss

__all__ = ["AdvMode", "NFTBatch", "NFTStepLoss", "optimality"]


# DiffusionNFT's config.train.adv_mode (scripts/train_nft_sd3.py:915-925), applied to the advantage clipped to
# +-adv_clip_max (:910-914) before its map to r (:928-929); "all" (its config/nft.py:62 default, and any value its
# chain does not name) leaves it as it is
AdvMode = Literal["all", "positive_only", "negative_only", "one_only", "binary"]  # nft.adv_mode
ADV_MODES = {
    "all": lambda a: a,
    "positive_only": lambda a: a.clamp(min=0.0),  # :916-917 clamp(a, 0, adv_clip_max): a worse sample's r is 1/2
    "negative_only": lambda a: a.clamp(max=0.0),  # :918-919 clamp(a, -adv_clip_max, 0): a better sample's r is 1/2
    # :920-923 the ADVANTAGE 1 where it is > 0, else 0 (so r = 1/2 + 1 / (2 adv_clip_max), not 1: 0.6 at clip 5)
    "one_only": lambda a: (a > 0).to(a.dtype),
    "binary": torch.sign,  # :924-925 -1, 0 or 1 (r = 1/2 -+ 1 / (2 adv_clip_max))
}


def optimality(advantages: torch.Tensor, adv_clip_max: float, adv_mode: AdvMode = "all") -> torch.Tensor:
    """r = clip(mode(clip(A, +-adv_clip_max)) / adv_clip_max / 2 + 1/2, 0, 1) with mode = ADV_MODES[adv_mode]
    (nft.adv_mode): under all, 1 for the best samples and 0 for the worst."""
    a = ADV_MODES[adv_mode](advantages.float().clamp(-adv_clip_max, adv_clip_max))
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


@dataclass
class NFTBatch:
    """What the loss of one minibatch needs, per training timestep position k (K of them per sample)."""

    clean: torch.Tensor  # [B, ...] the sampled clean latents d
    t: torch.Tensor  # [K, B] the training timesteps (noise levels in [0, 1]) of each sample, in position order
    noised: torch.Tensor  # [K, B, ...] x_t = (1 - t) d + t e
    old: torch.Tensor  # [K, B, ...] the old policy's velocities at (x_t, t)
    optimality: torch.Tensor  # [B] r in [0, 1]
    mask: torch.Tensor  # bool [B]: rows with a valid reward
    ref: torch.Tensor | None = None  # [K, B, ...] the reference's velocities, when kl_beta > 0

    def rows(self, index) -> "NFTBatch":
        """The rows `index` of the batch: a micro-batch."""
        per_k = lambda t: None if t is None else t[:, index]  # noqa: E731
        return NFTBatch(clean=self.clean[index], t=self.t[:, index], noised=per_k(self.noised), old=per_k(self.old),
                        optimality=self.optimality[index], mask=self.mask[index], ref=per_k(self.ref))


def _mean_over_sample(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


@dataclass
class NFTStepLoss(MinibatchLoss):
    """L_k of one minibatch at a velocity: `loss(batch, k, v_k)`; `scale` divides each L_k (1 / K: the update is the
    mean over a sample's training timesteps, as DiffusionNFT's accumulation over them)."""

    beta: float = 1.0  # the implicit policies' step (DiffusionNFT's config.beta)
    kl_beta: float = 1e-4  # weight of ||v - v_ref||^2 (its config.train.beta)
    adv_clip_max: float = 5.0
    scale: float = 1.0
    denominator: float | None = None  # valid rows of the minibatch per rank (None: this batch's own count)
    metrics: dict = field(default_factory=lambda: defaultdict(list))

    def __call__(self, b: NFTBatch, k: int, v: torch.Tensor) -> torch.Tensor:
        v = v.float()
        old = b.old[k].float()
        d, x_t = b.clean.float(), b.noised[k].float()
        t = b.t[k].float().reshape(-1, *([1] * (v.ndim - 1)))
        r = b.optimality.float()
        positive = self.beta * v + (1 - self.beta) * old
        negative = (1.0 + self.beta) * old - self.beta * v
        d_pos, d_neg = x_t - t * positive, x_t - t * negative
        with torch.no_grad():  # the adaptive weights are constants for the gradient (float64, as DiffusionNFT)
            w_pos = _mean_over_sample((d_pos.double() - d.double()).abs()).clamp(min=1e-5)
            w_neg = _mean_over_sample((d_neg.double() - d.double()).abs()).clamp(min=1e-5)
        pos_loss = _mean_over_sample((d_pos - d) ** 2) / w_pos.to(v.dtype)
        neg_loss = _mean_over_sample((d_neg - d) ** 2) / w_neg.to(v.dtype)
        per_row = (r * pos_loss / self.beta + (1.0 - r) * neg_loss / self.beta) * self.adv_clip_max
        w = b.mask.float()
        denom = w.sum().clamp_min(1.0)
        loss_denom = denom if self.denominator is None else max(float(self.denominator), 1e-12)
        policy = (per_row * w).sum() / loss_denom
        loss = policy
        kl = None
        if self.kl_beta > 0:
            if b.ref is None:
                raise ValueError("kl_beta > 0 needs the reference's velocities (NFTBatch.ref)")
            kl = (_mean_over_sample((v - b.ref[k].float()) ** 2) * w).sum() / loss_denom
            loss = loss + self.kl_beta * kl
        with torch.no_grad():
            m = self.metrics
            m["policy_loss"].append(policy.detach())
            m["kl"].append(kl.detach() if kl is not None else torch.zeros((), device=policy.device))
            m["old_deviate"].append((_mean_over_sample((v - old) ** 2) * w).sum() / denom)
        return loss * self.scale
