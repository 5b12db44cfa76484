"""FLUX.1-Kontext (diffusers FluxKontextPipeline): instruction editing as a `VelocityModel`.

An edit prompt is an instruction and an input image (`data.EditPrompt`: a str carrying `.image`). Everything of
FLUX.1 (flux.py) holds; what Kontext adds is the input image as conditioning tokens beside the noisy ones:

    cond = encode_prompts(prompts)     FLUX's (T5 embeds, CLIP pooled) of the instructions, plus the input images'
                                       VAE latents [B, C, H, W] (vae.encode's mode, shifted and scaled as the
                                       pipeline's _encode_vae_image), unpacked like the policy's latents, so the
                                       JAGG joint pass repeats them along dim 0 like any conditioning
    v    = forward(x, sigma, cond)     the noisy latents and the image latents packed into 2x2 tokens and concatenated
                                       along the sequence ([noise | image]); the image tokens' rope ids are the noise
                                       tokens' with the first axis set to 1 (FluxKontextPipeline.prepare_latents); the
                                       output's first H/2 * W/2 tokens are the velocity (the pipeline's
                                       noise_pred[:, :latents.size(1)])

The input image is resized (shorter side, then a centre crop) to the model's square resolution, so input and output
latents have one shape: the pipeline instead picks the preferred Kontext resolution nearest the image's aspect ratio
(PREFERRED_KONTEXT_RESOLUTIONS); a run's fixed latent shape needs one size. The schedule's mu counts the noise tokens
alone, as the pipeline's does. Guidance: FLUX.1-Kontext is guidance-distilled (`model.distilled_guidance`, the
pipeline's guidance_scale 2.5 by default); `sampling.guidance` > 1 is the pipeline's true CFG (true_cfg_scale: the
plain rule, the negative prompt on the same input image, which Policy.encode gives every edit prompt).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from ..data.images import load_rgb
from . import flux
from .flux import FluxVelocity
from .diffusers_common import resolution_check
from .registry import Family, register

class FluxKontextVelocity(FluxVelocity):
    """v_theta(x, sigma, (embeds, pooled, image_latents)) of a FluxKontextPipeline's transformer."""

    pipeline_class = "FluxKontextPipeline"
    guidance_default = 2.5  # FluxKontextPipeline.__call__'s guidance_scale
    # Flow-Factory's FLUX.1-Kontext default (X-GenGroup/Flow-Factory a0b2bc5 src/flow_factory/models/flux/
    # flux1_kontext.py:140-146; its "default" in examples/grpo/lora/flux1_kontext/default.yaml:23): both streams'
    # attention projections and the double-stream blocks' feed-forwards
    lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
                    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "ff.net.0.proj", "ff_context.net.0.proj", "ff.net.2", "ff_context.net.2")

    @torch.no_grad()
    def encode_images(self, images: Sequence) -> torch.Tensor:
        """Input images (paths, encoded bytes, PIL images) -> their VAE latents [B, C, H, W] at the model's size, as
        the pipeline's _encode_vae_image makes them (the posterior's mode, shifted, scaled); transformer dtype."""
        vae = self.frozen["vae"]
        pixels = torch.stack([load_rgb(im, self.image_size) for im in images]).to(self.device, vae.dtype)
        latents = vae.encode(pixels * 2 - 1).latent_dist.mode()
        return ((latents - vae.config.shift_factor) * vae.config.scaling_factor).to(self.dtype)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T5 embeds, CLIP pooled, input-image latents) of edit prompts (each a `data.EditPrompt`)."""
        missing = [p for p in prompts if getattr(p, "image", None) is None]
        if missing:
            raise ValueError(f"model.kind flux_kontext needs an input image per prompt (a jsonl 'image' field or a "
                             f"shard's image member); {len(missing)} prompt(s) have none, e.g. {str(missing[0])!r}")
        embeds, pooled = super().encode_prompts(prompts)
        return embeds, pooled, self.encode_images([p.image for p in prompts])

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """Velocity v = e - d at unpacked latents x [N, C, H, W] given the input image's latents; in x's dtype."""
        embeds, pooled, image = cond
        n, _, h, w = x.shape
        dtype = self.dtype
        tokens = torch.cat([self.pack(x.to(dtype)), self.pack(image.to(dtype))], dim=1)
        ids = self.image_ids(h, w, x.device, dtype)
        out = self.transformer(
            hidden_states=tokens,
            timestep=self.timestep(sigma, x),
            guidance=self.distilled_guidance(n, x.device),
            pooled_projections=pooled.to(dtype),
            encoder_hidden_states=embeds.to(dtype),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=dtype),
            img_ids=torch.cat([ids, self.input_image_ids(ids)], dim=0),
            return_dict=False,
        )[0]
        return self.unpack(out[:, :ids.shape[0]], h, w).to(x.dtype)

    def input_image_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The input image tokens' rope ids: the noise tokens' with the first axis 1 (cached with them)."""
        key = ("input", tuple(ids.shape), str(ids.device), ids.dtype)
        if key not in self._ids:
            self._ids[key] = ids.clone()
            self._ids[key][:, 0] = 1
        return self._ids[key]


# ------------------------------------------------------------------ the family record (models/registry.py)
def _geometry(cfg, tc, vae, tokens, prompt):
    """FLUX.1's, with the input image's latents in the conditioning and its tokens in every pass."""
    g = flux.geometry(cfg, tc, vae, tokens, prompt)
    return dict(g, cond_row=g["cond_row"] + math.prod(g["latent"]), images_per_pass=2)


FAMILY = register(Family(
    name="flux_kontext", velocity=FluxKontextVelocity,
    build=lambda cfg, path, dtypes: flux.build_flux(FluxKontextVelocity, cfg, path, dtypes),
    pipeline="FluxKontextPipeline", transformer="FluxTransformer2DModel", text="clip_t5",
    prompt_tokens=flux.PROMPT_TOKENS, prompt_limit=flux.PROMPT_TOKENS, keys=frozenset({"distilled_guidance"}),
    checkpoints={"flux.1-kontext-dev": "flux1_kontext_dev"}, geometry=_geometry,
    inputs=functools.partial(flux.inputs, image_copies=2), blocks=flux.blocks, tiny="build_tiny_flux_kontext",
    check=resolution_check()))
