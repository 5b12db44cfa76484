"""Classifier-free guidance: how a (conditional, unconditional) pair of velocity predictions becomes the one the
sampler moves along and the GRPO loss scores. One function for rollout, evaluation and training, so the training
pass rescores exactly what the rollout sampled; a model family names its rule (VelocityModel.guidance_rule). The
scale is a float, or one per expert of a two-expert model (ExpertGuidance), read at each step's sigma by both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import torch

from ..jagg.experts import ExpertSwitch

__all__ = ["ExpertGuidance", "Guidance", "GuidanceRule", "guide", "scale_at"]

GuidanceRule = Literal["plain", "token_norm"]  # a model family's own CFG (VelocityModel.guidance_rule)


@dataclass(frozen=True)
class ExpertGuidance:
    """Two CFG scales switched with a two-expert pipeline's experts (Wan2.2 A14B): `high` where the high-noise expert
    runs, `low` where the low-noise one does, as WanPipeline's guidance_scale and guidance_scale_2 (diffusers 0.42.1
    pipelines/wan/pipeline_wan.py:597-604; Wan2.2's own (3.0, 4.0), low and high: wan/configs/wan_t2v_A14B.py:37).
    It is never equal to a float, so `guidance != 1` (CFG on) holds for it."""

    high: float
    low: float
    switch: ExpertSwitch

    def at(self, sigma: torch.Tensor) -> torch.Tensor:
        """The scale at each element of `sigma` (a step's noise level: 0-d, or one per row)."""
        return torch.where(self.switch.high(sigma), self.high, self.low)  # on sigma's device: no host read


Guidance = Union[float, ExpertGuidance]  # sampling.guidance alone, or with sampling.guidance_2 on two experts


def scale_at(guidance: Guidance, sigma: torch.Tensor) -> float | torch.Tensor:
    """The CFG scale at noise level `sigma`: the float itself, or ExpertGuidance's per element of sigma."""
    return guidance.at(sigma) if isinstance(guidance, ExpertGuidance) else guidance


def guide(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance: float | torch.Tensor, rule: GuidanceRule = "plain"
          ) -> torch.Tensor:
    """The guided velocity v = v_u + g (v_c - v_u), g a float or a tensor (scale_at: 0-d, or one per row). rule
    token_norm (Qwen-Image's "true CFG", QwenImagePipeline): v rescaled, per 2x2 latent patch (one packed token: its
    C x 2 x 2 values), to the norm of v_c there."""
    if isinstance(guidance, torch.Tensor):
        # a Python float's arithmetic on 16-bit predictions (the pipelines' own): the product taken in float32 and
        # rounded once to their dtype, so a scale per row changes no bit against the float
        g = guidance.float().reshape(-1, *[1] * (v_cond.ndim - 1)) if guidance.ndim else guidance.float()
        diff = v_cond - v_uncond
        v = v_uncond + (g * diff.float()).to(diff.dtype)
    else:
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
