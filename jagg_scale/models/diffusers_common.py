"""What the diffusers adapters (sd3.py, flux.py) share: the transformer is the policy, the rest is frozen.

Only the transformer is a registered submodule, so `.parameters()`, `.state_dict()` and the optimizer see it alone.
The VAE and the text encoders live in a plain dict (`self.frozen`) with requires_grad False, and follow the
adapter through `.to()` / `.double()` / `.cuda()` (`_apply` is overridden). The pipeline object is kept as
`self.pipe` for its `encode_prompt`, tokenizers and scheduler config.
"""

from __future__ import annotations

import torch

from .base import VelocityModel


class DiffusersVelocity(VelocityModel):
    #: pipeline components that are frozen (set by each adapter)
    frozen_names: tuple[str, ...] = ()

    def __init__(self, pipe, max_sequence_length: int):
        super().__init__()
        self.pipe = pipe  # not an nn.Module: not registered
        self.transformer = pipe.transformer
        self.frozen = {}
        for name in self.frozen_names:
            module = getattr(pipe, name, None)
            if module is not None:
                module.requires_grad_(False).eval()
                self.frozen[name] = module
        self.max_sequence_length = max_sequence_length
        self.num_train_timesteps = pipe.scheduler.config.num_train_timesteps

    # ------------------------------------------------------------------ device / dtype of the frozen parts
    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for module in self.frozen.values():
            module._apply(fn)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    # ------------------------------------------------------------------ training options
    def enable_gradient_checkpointing(self):
        """Recompute each transformer block in backward (diffusers' non-reentrant checkpointing): same
        gradients, activation memory of one block. Active only in train mode with grad enabled."""
        self.transformer.enable_gradient_checkpointing()
        return self

    def disable_gradient_checkpointing(self):
        self.transformer.disable_gradient_checkpointing()
        return self

    # ------------------------------------------------------------------ decoding for the rewards
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [N, C, H, W] -> float32 images [N, 3, H, W] in [0, 1]: unscale (scaling_factor, shift_factor),
        VAE decode, [-1, 1] -> [0, 1]."""
        vae = self.frozen["vae"]
        latents = x.to(vae.dtype) / vae.config.scaling_factor
        if getattr(vae.config, "shift_factor", None) is not None:
            latents = latents + vae.config.shift_factor
        img = vae.decode(latents, return_dict=False)[0]
        return ((img.float() + 1) / 2).clamp(0, 1)
