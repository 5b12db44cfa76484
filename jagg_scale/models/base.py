"""The velocity-model interface every backbone implements (built-in DiT, diffusers SD3/FLUX adapters).

The trainer and the JAGG engine only ever see three things:

    cond = model.encode_prompts(prompts)       # conditioning for a batch, batch size B in dim 0
    v    = model(x, sigma, cond)               # velocity, x[N, *latent_shape], sigma[N] in [0, 1]
    img  = model.decode(x)                     # images [N, 3, H, W] in [0, 1] for the rewards

`cond` is a tensor or a (nested) tuple/list/dict of tensors with the batch in dim 0, so the JAGG joint batch
can repeat it along dim 0 (`repeat_cond`). Sigma follows the rectified-flow convention of the design doc:
x_s = (1 - s) x_0 + s e, s = 1 is pure noise, and the model predicts v = e - x_0.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

Cond = Any  # torch.Tensor | tuple | list | dict of tensors, batch in dim 0


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


def map_cond(fn, cond: Cond) -> Cond:
    """Apply `fn` to every tensor of a (nested) conditioning structure."""
    if isinstance(cond, torch.Tensor):
        return fn(cond)
    if isinstance(cond, dict):
        return {k: map_cond(fn, v) for k, v in cond.items()}
    if isinstance(cond, (tuple, list)):
        return type(cond)(map_cond(fn, v) for v in cond)
    if cond is None:
        return None
    raise TypeError(f"conditioning must be a tensor or a tuple/list/dict of tensors, got {type(cond).__name__}")


def cat_cond(conds: Sequence[Cond]) -> Cond:
    """Concatenate conditioning structures of the same layout along dim 0."""
    first = conds[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(conds), dim=0)
    if isinstance(first, dict):
        return {k: cat_cond([c[k] for c in conds]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(cat_cond([c[i] for c in conds]) for i in range(len(first)))
    if first is None:
        return None
    raise TypeError(f"conditioning must be a tensor or a tuple/list/dict of tensors, got {type(first).__name__}")


def repeat_cond(cond: Cond, times: int) -> Cond:
    """torch.cat([c] * times) on every tensor: the conditioning of a joint batch of `times` x B rows."""
    return cond if times == 1 else cat_cond([cond] * times)


def index_cond(cond: Cond, index) -> Cond:
    """Select rows (an index tensor or slice) of every tensor of the conditioning."""
    return map_cond(lambda t: t[index], cond)
