"""Z-Image (diffusers ZImagePipeline) as a `VelocityModel`: the transformer is the policy, the rest is frozen.

How the pipeline maps onto the interface of base.py (docs/algorithm.md's rectified flow, x_s = (1 - s) d + s e):

    cond = encode_prompts(prompts)     ZImagePipeline.encode_prompt (no grad): Qwen3's second-to-last hidden states
                                       over the chat-templated prompt, one [L_i, D] tensor per prompt (its padding
                                       dropped), here a cond.Tokens (embeds [B, L, D], mask [B, L], the L_i on the
                                       host) with L the longest prompt's, so conditionings encoded apart concatenate
                                       (padded to their longest)
    v    = forward(x, sigma, cond)     x [N, C, H, W]: the VAE latents as the pipeline keeps them (the transformer
                                       patchifies 2x2 itself); the transformer takes a list of [C, 1, H, W] latents
                                       and a list of prompts, each of its own length (the mask's), at t = 1 - sigma,
                                       and predicts -(e - d): v = -output
    img  = decode(x)                   vae.decode(x / scaling_factor + shift_factor), [-1, 1] -> [0, 1]

Sign and time: the pipeline feeds the transformer `(1000 - timestep) / 1000` = 1 - sigma and steps the scheduler
with the negated output (pipeline_z_image.py's denoising loop), so the transformer's output is d - e and the velocity
of docs/algorithm.md is its negation (tests/models/test_zimage_adapter.py checks the adapter's Euler loop against the
pipeline's own sampling).

Schedule: linspace(1, 1/N, N) shifted by mu from the image tokens (H/2 x W/2) with the scheduler's own config, as
the pipeline does; `pipeline_sigmas` (diffusers_common.py) reproduces it.

Guidance: the pipeline's CFG is v_c + g (v_c - v_u) with the empty negative prompt, off at g = 0 (Z-Image-Turbo's
published setting): the plain rule v_u + w (v_c - v_u) with w = 1 + g, so `sampling.guidance: 1.0` is the pipeline's
guidance_scale 0. (The pipeline's optional cfg_normalization and cfg_truncation are off by default; not offered.)

Host reads: none. The prompts' lengths are known on the host from encoding (each prompt's tensor's length) and ride
in the Tokens, so a forward splits the batch into the transformer's per-prompt list, which it pads to multiples of
32 on the host itself, without reading the device (it read the mask back once per forward before).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..cond import Tokens
from .diffusers_common import DiffusersVelocity, load_pipeline, resolution_check, row_sigmas
from .registry import Family, register

PROMPT_TOKENS = 512  # ZImagePipeline.__call__'s max_sequence_length, and the most it may be


class ZImageVelocity(DiffusersVelocity):
    """v_theta(x, sigma, cond) of a diffusers ZImagePipeline's transformer, on latents [N, C, H, W]."""

    frozen_names = ("vae", "text_encoder")
    t5_name = "text_encoder"
    # Flow-Factory's Z-Image default (X-GenGroup/Flow-Factory a0b2bc5 src/flow_factory/models/z_image/z_image.py:70-75;
    # configs/zimage_pickscore.yaml follows its full fine-tune): every block's attention (the noise and context
    # refiners' too) and SwiGLU feed-forward
    lora_targets = ("attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0",
                    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")

    def __init__(self, pipe, max_sequence_length: int = PROMPT_TOKENS, latent_size: int | None = None):
        super().__init__(pipe, max_sequence_length)
        self.vae_scale_factor = pipe.vae_scale_factor
        latent_size = int(latent_size or 1024 // pipe.vae_scale_factor)  # the pipeline's default: 1024 px
        if latent_size % 2:
            raise ValueError(f"Z-Image latent size must be even (2x2 patches), got {latent_size}")
        self.latent_shape = (self.transformer.config.in_channels, latent_size, latent_size)
        self.image_size = latent_size * self.vae_scale_factor
        self.patch_size = 2

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | dict = torch.float32, *, max_sequence_length: int | None = None,
                        resolution: int | None = None, local_files_only: bool = True) -> "ZImageVelocity":
        """Load a saved ZImagePipeline directory (offline by default); `dtype` as SD3Velocity.from_pretrained's."""
        from diffusers import ZImagePipeline

        pipe = load_pipeline(ZImagePipeline, path, dtype, local_files_only=local_files_only)
        latent_size = cls.latent_size_for(pipe, resolution, 2) if resolution is not None else None
        return cls(pipe, max_sequence_length=max_sequence_length or PROMPT_TOKENS, latent_size=latent_size)

    def _pipeline_sigma_grid(self, num_steps: int):
        """ZImagePipeline's default sigmas: linspace(1, 1/N, N) (get_default_z_image_sigmas), shifted by mu."""
        return np.linspace(1.0, 1 / num_steps, num_steps)

    # ------------------------------------------------------------------ the VelocityModel interface
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Tokens:
        """Tokens(embeds [B, L, D] in the transformer's dtype, mask [B, L] int64, lengths), L the longest prompt's
        (at most max_sequence_length); "" is the pipeline's negative prompt."""
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                            do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)
        lengths = tuple(len(e) for e in embeds)  # shapes: known on the host
        n, length, dim = len(embeds), max(lengths), embeds[0].shape[-1]
        out = embeds[0].new_zeros(n, length, dim)
        mask = torch.zeros(n, length, dtype=torch.int64, device=out.device)
        for i, e in enumerate(embeds):
            out[i, :len(e)] = e
            mask[i, :len(e)] = 1
        return Tokens(out.to(self.dtype).detach(), mask, lengths)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """Velocity v = e - d at latents x [N, C, H, W], sigma [N] in [0, 1]; returned in x's dtype."""
        return zimage_velocity(self.transformer, x, sigma, cond)


def zimage_velocity(transformer, x: torch.Tensor, sigma, cond: Tokens) -> torch.Tensor:
    """The Z-Image velocity of a diffusers ZImageTransformer2DModel at latents x [N, C, H, W]: one [C, 1, H, W] latent
    and one unpadded prompt per row, t = 1 - sigma, the output negated (see the module docstring); in x's dtype."""
    dtype = next(transformer.parameters()).dtype
    prompts = [e[:n] for e, n in zip(cond.embeds.to(dtype).unbind(0), cond.lengths)]  # host lengths: no device read
    t = 1 - row_sigmas(sigma, x).float()  # float32, as the pipeline passes it
    out = transformer(list(x.to(dtype).unsqueeze(2).unbind(0)), t, prompts, return_dict=False)[0]
    return -torch.stack(out, dim=0).squeeze(2).to(x.dtype)



# ------------------------------------------------------------------ the family record (models/registry.py)
def _build(cfg, path, dtypes):
    return ZImageVelocity.from_pretrained(path, dtypes, resolution=cfg.resolution,
                                          max_sequence_length=cfg.max_sequence_length)


def _geometry(cfg, tc, vae, tokens, prompt):
    """The estimator's latents, patch and text tokens (estimate/memory.py): the transformer patchifies 2x2 itself and
    sees each prompt's own tokens rounded up to 32 (ZImageTransformer2DModel's SEQ_MULTI_OF), a pass its longest
    prompt's: at most the padded length."""
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    side = (cfg.model.resolution or vae["sample_size"]) // scale  # ZImagePipeline's default: 1024 px
    return {"scale": scale, "side": side, "latent": (tc["in_channels"], side, side), "patch": tc["all_patch_size"][0],
            "text": -(-prompt // 32) * 32, "cond_row": prompt * (tc["cap_feat_dim"] + 2)}


def _inputs(cfg, n, h, w, t, r, u, device, frames):
    """Lists: one [C, 1, H, W] latent (patchified inside) and one unpadded prompt per row (estimate/measure.py)."""
    p = cfg["all_patch_size"][0]
    return dict(x=list(r(n, cfg["in_channels"], 1, h * p, w * p).unbind(0)), t=u(n),
                cap_feats=list(r(n, t, cfg["cap_feat_dim"]).unbind(0)), return_dict=False)


def _blocks(cfg, side):
    """The image refiner, the prompt refiner, then the joint blocks (estimate/measure.py)."""
    R = cfg["n_refiner_layers"]
    return ["noise"] * R + ["context"] * R + ["joint"] * cfg["n_layers"], dict(cfg, n_refiner_layers=1, n_layers=1)


FAMILY = register(Family(
    name="zimage", velocity=ZImageVelocity, build=_build, pipeline="ZImagePipeline",
    transformer="ZImageTransformer2DModel", text="qwen", prompt_tokens=PROMPT_TOKENS, prompt_limit=PROMPT_TOKENS,
    checkpoints={"z-image": "z_image"}, geometry=_geometry, inputs=_inputs, blocks=_blocks, tiny="build_tiny_zimage",
    check=resolution_check(lambda tc: tc["all_patch_size"][0])))
