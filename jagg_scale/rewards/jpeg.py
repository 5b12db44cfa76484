"""JPEG (in)compressibility rewards, as in DDPO (Black et al., 2023).

They need no model weights, are cheap and deterministic, and give a strong, easily verified training
signal (smooth vs. busy images), which makes them the default reward for CPU runs and tests. The score
is the encoded size in kB (1 kB = 1000 bytes, as DDPO) at a fixed quality: negated for compressibility.
"""

from __future__ import annotations

import io
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from .base import Reward, RewardOutput, register

__all__ = ["JpegCompressibility", "JpegIncompressibility", "jpeg_sizes_kb", "to_uint8_hwc"]


def to_uint8_hwc(images: torch.Tensor) -> np.ndarray:
    """Float images [B, 3, H, W] in [0, 1] -> uint8 [B, H, W, 3] (NaN maps to 0, values are clipped)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [B, 3, H, W], got shape {tuple(images.shape)}")
    x = images.detach().float().cpu().nan_to_num(0.0)
    x = (x * 255.0).round().clamp(0, 255).to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """JPEG-encoded size of each image in kB, float32 [B]."""
    sizes = []
    for arr in to_uint8_hwc(images):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class _JpegSize(Reward):
    """Shared implementation; `sign` picks compressibility (-1) or incompressibility (+1)."""

    sign: float = 1.0

    def __init__(self, *, quality: int = 95):
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ValueError(f"{type(self).__name__}: quality must be an int in [1, 100], got {quality!r}")
        self.quality = quality

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        kb = jpeg_sizes_kb(images, self.quality)
        return RewardOutput(scores=self.sign * kb, info={"jpeg_kb_mean": float(kb.mean()) if kb.numel() else 0.0})


@register("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """Score = -(JPEG size in kB): rewards images that compress well."""

    sign = -1.0


@register("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """Score = +(JPEG size in kB): rewards detailed, hard-to-compress images."""

    sign = 1.0
