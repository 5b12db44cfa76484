"""GCPO's chunk-level clipped surrogate (arXiv 2510.21583), as a per-step loss that knot_backward can run.

A chunk c of a sample holds n_c consecutive sampling steps. Its log-probability is the mean of its steps' (GCPO,
xingzhejun/GCPO ea6cc4d fastvideo/train_grpo_flux_pickscore.py:453 for the new one, :618 for the old), so with
m_c = mean_{k in c} (log p_k(theta) - log p_k(old))

    r_c = exp(m_c),    L_c = max(-A r_c, -A clip(r_c, 1 - eps, 1 + eps))                          (:738-745)

and a sample's loss is the mean of L_c over the chunks it trains (:757, / train_chunks), the minibatch's the mean over
its valid rows (GRPOStepLoss.denominator). L_c reads theta only through m_c, so with the chunk's factor

    f_c = dL_c / dm_c = -A r_c   where the unclipped branch is taken,   0 where the clip is          (one scalar)

its gradient is f_c / n_c sum_{k in c} d log p_k / d theta: the gradient of the per-step terms

    l_k(v_k) = F_k (log p_k(v_k) - sg log p_k(v_k)) + sg L_c / n_c,    F_k = f_c / (n_c n_train denominator)

each reading theta only through v_k, and summing over the chunk to L_c's value. knot_backward therefore runs it
unchanged: the per-step plan gives exactly GCPO's gradient, one JAGG window per chunk (a joint pass over its two end
steps) the window's interpolation of it, exact when the window's Jacobians are affine in sigma (a chunk of <= 2
steps; a velocity affine along collinear inputs).

The factor needs every step of the chunk at the current weights before any backward: `prepared(batch)` computes it
from the batch's velocities (the rollout's while no optimizer step moved the weights: exact; train/gcpo.py replaces
them by fresh no-grad forwards after one) and records the chunk metrics (chunk_clipfrac, chunk_ratio_*). `__call__`
records |log p_k(theta) - log p_k(old)| at every real step it is evaluated at: the on-policy invariant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..grpo.loss import GRPOStepLoss, StepBatch

__all__ = ["ChunkBatch", "GCPOStepLoss", "chunk_factor"]


@dataclass
class ChunkBatch(StepBatch):
    """A StepBatch laid out in chunk slots (gcpo/chunks.py slot_layout via grpo/steps.py positioned: the per-step
    values at even positions 0, 2, ..., 2 K - 2), with per position: whether it holds a step of its chunk, and once
    `GCPOStepLoss.prepared` ran, its term's factor F_k and value share."""

    real: torch.Tensor | None = None  # [2K, B] bool (odd positions: unused)
    slots: int = 1  # n: the chunks each row trains; slot j holds positions j P .. (j + 1) P - 1
    factor: torch.Tensor | None = None  # [2K, B] F_k (0 at pads and masked rows)
    share: torch.Tensor | None = None  # [2K, B] the chunk loss's share of each real step, L_c / (n_c ...)

    def rows(self, index) -> "ChunkBatch":
        def per_step(t):
            return None if t is None else t[:, index]

        base = super().rows(index)
        return ChunkBatch(**{f.name: getattr(base, f.name) for f in dataclasses.fields(StepBatch)},
                          real=per_step(self.real), slots=self.slots, factor=per_step(self.factor),
                          share=per_step(self.share))


def chunk_factor(m: torch.Tensor, adv: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_c, dL_c/dm_c) of the chunks' mean log-ratios m [n, B] at advantages adv [B], float32: autograd through
    GCPO's clipped surrogate at a detached m (torch.maximum's tie rule and all), one scalar per chunk and row."""
    with torch.enable_grad():
        m = m.detach().float().requires_grad_(True)
        ratio = torch.exp(m)
        a = adv.float()
        loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
        (grad,) = torch.autograd.grad(loss.sum(), m)
    return loss.detach(), grad


@dataclass
class GCPOStepLoss(GRPOStepLoss):
    """l_k of one minibatch's ChunkBatch at a velocity (module docstring): `loss(batch, k, v_k)` after
    `batch = loss.prepared(batch)`. `scale` is 1 / n_train (the mean over a sample's chunks); beta must be 0 (GCPO's
    recipes train without a KL term)."""

    def log_probs_at(self, b: ChunkBatch, velocities: torch.Tensor) -> torch.Tensor:
        """[K, B] log p_k at the velocities [2K, B, ...] (spaced as the batch), every position."""
        # each step's upcast apart: the stored predictions may be bf16 / fp16 (grpo/rollout.py), the SDE math float32
        return torch.stack([self.transition(b, k, velocities[k].float()).log_prob
                            for k in range(0, b.latents.shape[0], 2)])

    def prepared(self, b: ChunkBatch, velocities: torch.Tensor | None = None) -> ChunkBatch:
        """The batch with every position's factor and value share, from the log-probabilities at `velocities`
        (default: the batch's own), its chunk metrics recorded."""
        with torch.no_grad():
            v = b.velocities if velocities is None else velocities
            real = b.real[0::2].float()  # [K, B]
            K, B = real.shape
            lp = self.log_probs_at(b, v)
            diff = (lp - b.log_probs[0::2].float()) * real
            n_c = real.reshape(b.slots, K // b.slots, B).sum(1)  # [n, B]
            m = diff.reshape(b.slots, K // b.slots, B).sum(1) / n_c
            loss, grad = chunk_factor(m, b.advantages, self.clip_range)
            w = b.mask.float()
            denom = w.sum().clamp_min(1.0)
            loss_denom = denom if self.denominator is None else max(float(self.denominator), 1e-12)
            per_step = (w * self.scale / loss_denom) / n_c  # [n, B]: a real step's share of its chunk
            spread = (per_step * grad).repeat_interleave(K // b.slots, 0) * real
            share = (per_step * loss).repeat_interleave(K // b.slots, 0) * real
            ratio = torch.exp(m)
            cw = w.expand_as(m)
            chunks = cw.sum().clamp_min(1)  # the valid rows' chunks
            mt = self.metrics
            mt["policy_loss"].append((loss * w).sum() / loss_denom / b.slots)
            mt["chunk_clipfrac"].append((((ratio - 1).abs() > self.clip_range).float() * cw).sum() / chunks)
            mt["chunk_ratio_mean"].append((ratio * cw).sum() / chunks)
            mt["chunk_ratio_max"].append(ratio.max())
            mt["chunk_ratio_min"].append(ratio.min())
            mt["approx_kl"].append(0.5 * ((m**2) * cw).sum() / chunks)
        return dataclasses.replace(b, factor=spread.repeat_interleave(2, 0), share=share.repeat_interleave(2, 0))

    def __call__(self, b: ChunkBatch, k: int, v: torch.Tensor) -> torch.Tensor:
        if b.factor is None:
            raise ValueError("GCPOStepLoss needs the batch's chunk factors: call it on loss.prepared(batch)")
        lp = self.transition(b, k, v).log_prob
        real = b.real[k]
        with torch.no_grad():
            gap = (lp - b.log_probs[k].float()).abs()
            self.log_ratios.append(torch.where(real, gap, torch.zeros_like(gap)).max())
        term = b.factor[k].to(lp.dtype) * (lp - lp.detach()) + b.share[k].to(lp.dtype)
        return torch.where(real, term, torch.zeros_like(term)).sum()
