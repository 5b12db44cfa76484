"""The velocity-model interface every backbone implements (built-in DiT, diffusers SD3/FLUX adapters).

The trainer and the JAGG engine only ever see three things:

    cond = model.encode_prompts(prompts)       # conditioning for a batch, batch size B in dim 0
    v    = model(x, sigma, cond)               # velocity, x[N, *latent_shape], sigma[N] in [0, 1]
    img  = model.decode(x)                     # images [N, 3, H, W] in [0, 1] for the rewards

`cond` is a tensor or a (nested) tuple/list/dict of tensors with the batch in dim 0, so the JAGG joint batch
can repeat it along dim 0 (`jagg_scale.cond`). Sigma follows the rectified-flow convention of the design doc:
x_s = (1 - s) x_0 + s e, s = 1 is pure noise, and the model predicts v = e - x_0.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..cond import Cond


class VelocityModel(nn.Module):
    """Base class: a velocity field v_theta(x, sigma, cond) with prompt encoding and decoding to images."""

    #: shape of one latent without the batch dim, e.g. (C, H, W)
    latent_shape: tuple[int, ...]

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def encode_prompts(self, prompts: Sequence[str]) -> Cond:  # pragma: no cover
        """Conditioning for a list of prompts; "" is the unconditional (CFG) prompt."""
        raise NotImplementedError

    def decode(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """Final latents -> float images [N, 3, H, W] in [0, 1]."""
        raise NotImplementedError
