"""Classifier-free guidance: how a (conditional, unconditional) pair of velocity predictions becomes the one the
sampler moves along and the GRPO loss scores. One function for rollout, evaluation and training, so the training
pass rescores exactly what the rollout sampled; a model family names its rule (VelocityModel.guidance_rule)."""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["GuidanceRule", "guide"]

GuidanceRule = Literal["plain", "token_norm"]  # a model family's own CFG (VelocityModel.guidance_rule)


def guide(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance: float, rule: GuidanceRule = "plain"
          ) -> torch.Tensor:
    """The guided velocity v = v_u + g (v_c - v_u). rule token_norm (Qwen-Image's "true CFG", QwenImagePipeline):
    v rescaled, per 2x2 latent patch (one packed token: its C x 2 x 2 values), to the norm of v_c there."""
    v = v_uncond + guidance * (v_cond - v_uncond)
    if rule == "token_norm":
        v = v * (_token_norms(v_cond) / _token_norms(v))
    return v


def _token_norms(v: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] -> the L2 norm of each 2x2 patch over all channels (a packed token's norm), broadcast back."""
    n, c, h, w = v.shape
    patches = v.reshape(n, c, h // 2, 2, w // 2, 2)
    norms = torch.linalg.vector_norm(patches, dim=(1, 3, 5), keepdim=True)
    return norms.expand_as(patches).reshape(n, c, h, w)
