"""The velocity-model interface every backbone implements (built-in DiT, diffusers SD3/FLUX adapters).

The trainer and knot_backward only ever see three things:

    cond = model.encode_prompts(prompts)       # conditioning for a batch, batch size B in dim 0
    v    = model(x, sigma, cond)               # velocity, x[N, *latent_shape], sigma[N] in [0, 1]
    img  = model.decode(x)                     # images [N, 3, H, W] in [0, 1] for the rewards

Placement (the trainer, parallel/): a model is built on the host. Its registered parameters (the transformer) are
what a training engine shards and places on the device, upcast to `master_dtype` on the way when that is set;
`place_frozen(device)` then moves the parts that never train (a diffusers VAE and text encoders) on their own.
`reference_copy()` is the KL reference of a full fine-tune: a frozen copy of the trained part alone.

`cond` is a tensor or a (nested) tuple/list/dict of tensors with the batch in dim 0, so the JAGG joint batch
can repeat it along dim 0 (`jagg_scale.cond`). Sigma follows the rectified-flow convention of docs/algorithm.md:
x_s = (1 - s) d + s e (data d, noise e), s = 1 is pure noise, and the model predicts v = e - d.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn

from ..cond import Cond


class VelocityModel(nn.Module):
    """Base class: a velocity field v_theta(x, sigma, cond) with prompt encoding and decoding to images."""

    #: shape of one latent without the batch dim, e.g. (C, H, W)
    latent_shape: tuple[int, ...]
    #: the dtype the trainable weights must have once placed (float32 master weights) when they were loaded in a
    #: lower one to spare host memory (models.build_model(keep_stored_dtype=True)); None: as they are
    master_dtype: torch.dtype | None = None
    #: the dtype the model computes in under the trainer's autocast (model.dtype: float32 or bfloat16); a training
    #: engine reads it (FSDP2's bf16 gathers, DeepSpeed's bf16 weights)
    compute_dtype: torch.dtype = torch.float32
    #: classifier-free guidance: how the (conditional, unconditional) pair combines (grpo/guidance.py) and the
    #: prompt the unconditional half encodes
    guidance_rule: str = "plain"
    negative_prompt: str = ""

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def encode_prompts(self, prompts: Sequence[str]) -> Cond:  # pragma: no cover
        """Conditioning for a list of prompts; "" is the unconditional (CFG) prompt."""
        raise NotImplementedError

    def decode(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """Final latents -> float images [N, 3, H, W] in [0, 1]."""
        raise NotImplementedError

    # ------------------------------------------------------------------ placement and the KL reference
    def reference_copy(self) -> "VelocityModel":
        """A frozen copy (requires_grad off, eval mode) of what trains, made on the host before placement: the KL
        reference of a full fine-tune. Here the whole model (the built-in DiT is all transformer); the diffusers
        adapters copy the transformer alone and share everything else."""
        return copy.deepcopy(self).requires_grad_(False).eval()

    def place_frozen(self, device: torch.device, shard_t5: Callable[[nn.Module], nn.Module] | None = None
                     ) -> "VelocityModel":
        """Move the frozen parts that are not registered parameters (none here) to `device`."""
        return self
