"""FLUX.2 [dev] and [klein] (diffusers Flux2Pipeline, Flux2KleinPipeline) as a `VelocityModel`: the transformer is
the policy, the rest frozen. One module for both: they share the transformer class, the VAE, the latent packing and
the schedule; what differs is the text encoder (Mistral3 for [dev], Qwen3 for [klein], behind each pipeline's own
encode_prompt) and [dev]'s guidance distillation.

How the pipeline maps onto the interface of base.py (docs/algorithm.md's rectified flow, x_s = (1 - s) d + s e):

    cond = encode_prompts(prompts)     the pipeline's encode_prompt (no grad): the text model's hidden states of three
                                       layers ([klein] Qwen3's 9, 18, 27; [dev] Mistral3's 10, 20, 30) over the
                                       chat-templated prompt, concatenated per token, padded to
                                       model.max_sequence_length tokens by the pipeline itself (no mask: the padding
                                       is part of the conditioning, as the pipeline runs it)
    v    = forward(x, sigma, cond)     x [N, 4C, H/2, W/2]: the pipeline's own latent variables (the VAE latents
                                       patchified 2x2), flattened to tokens [N, H/2 * W/2, 4C] with their (T, H, W, L)
                                       position ids and the prompt's, transformer(timestep=sigma, guidance: [dev]'s
                                       distilled value (model.distilled_guidance, default 4.0), [klein] None)
    img  = decode(x)                   the VAE's batch-norm statistics undone, unpatchified, vae.decode, [0, 1]

Timestep: the pipeline passes timestep / 1000 = sigma. Schedule: linspace(1, 1/N, N) shifted by the pipeline's
empirical mu (compute_empirical_mu of the image tokens and the step count). Guidance: FLUX.2 [klein] base is not
guidance-distilled; its CFG is the plain combination with the empty negative prompt (the pipeline's default), so
`guidance_rule` stays plain. FLUX.2 [dev] is guidance-distilled: no CFG pair (sampling.guidance 1), its guidance
embedding fed on every row as Flux2Pipeline does. Sign: v = e - d, Euler steps x_next = x + (s_next - s) v, as
FLUX.1 (tested against the pipeline's own loop in tests/models/test_flux2_adapter.py). The text encoder is
`t5_name`: `model.shard_text_encoder` shards it for inference (Mistral-Small-3.1 24B for [dev]).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import flux
from .diffusers_common import DiffusersVelocity, load_pipeline, resolution_check, row_sigmas
from .registry import Family, register

PROMPT_TOKENS = 512  # Flux2Pipeline's and Flux2KleinPipeline's max_sequence_length, and the most it may be
DISTILLED_GUIDANCE_DEFAULT = 4.0  # Flux2Pipeline.__call__'s guidance_scale: FLUX.2 [dev]'s guidance embedding
PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline")  # FLUX.2 [dev], FLUX.2 [klein]


class Flux2Velocity(DiffusersVelocity):
    """v_theta(x, sigma, cond) of a diffusers Flux2Pipeline's or Flux2KleinPipeline's transformer, on its latents
    [N, 4C, H/2, W/2]."""

    frozen_names = ("vae", "text_encoder")
    t5_name = "text_encoder"
    # Flow-Factory's FLUX.2 [klein] default (X-GenGroup/Flow-Factory a0b2bc5 src/flow_factory/models/flux/
    # flux2_klein.py:92-104; [dev]'s flux2.py:92-104 is the same list; configs/flux2_klein_pickscore.yaml follows its
    # full fine-tune): the double-stream blocks' attention and feed-forwards, the single-stream blocks' fused
    # qkv + MLP input. Its list names "attn.to_out.0" twice, for the single-stream blocks too, whose output
    # projection is a bare Linear (attn.to_out): it matches nothing there, so Flow-Factory wraps what this wraps
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                    "attn.to_qkv_mlp_proj")

    def __init__(self, pipe, max_sequence_length: int = PROMPT_TOKENS, latent_size: int | None = None,
                 guidance_scale: float | None = None):
        super().__init__(pipe, max_sequence_length)
        distilled = bool(self.transformer.config.guidance_embeds)
        if guidance_scale is not None and not distilled:
            raise ValueError(f"model.distilled_guidance {guidance_scale} is for a guidance-distilled FLUX.2 ([dev]); "
                             f"this {type(pipe).__name__}'s transformer has no guidance embedding")
        self.guidance_scale = (DISTILLED_GUIDANCE_DEFAULT if guidance_scale is None else float(guidance_scale)
                               ) if distilled else None
        self.vae_scale_factor = pipe.vae_scale_factor
        latent_size = int(latent_size or pipe.default_sample_size)  # the VAE's latent side (128: 1024 px)
        if latent_size % 2:
            raise ValueError(f"FLUX.2 latent size must be even (2x2 patches), got {latent_size}")
        self.latent_shape = (self.transformer.config.in_channels, latent_size // 2, latent_size // 2)
        self.image_size = latent_size * self.vae_scale_factor
        self.patch_size = 1  # the latent variables are already 2x2 patches: one token each
        self._ids: dict = {}  # position ids by (kind, size, device): built once, not at every forward

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | dict = torch.float32, *, max_sequence_length: int | None = None,
                        resolution: int | None = None, guidance_scale: float | None = None,
                        local_files_only: bool = True) -> "Flux2Velocity":
        """Load a saved Flux2Pipeline ([dev]) or Flux2KleinPipeline ([klein]) directory, the class its model_index.json
        names (offline by default); `dtype` as SD3Velocity.from_pretrained's."""
        import diffusers

        name = _pipeline_class(Path(path))
        pipe = load_pipeline(getattr(diffusers, name), path, dtype, local_files_only=local_files_only)
        latent_size = cls.latent_size_for(pipe, resolution, 2) if resolution is not None else None
        return cls(pipe, max_sequence_length=max_sequence_length or PROMPT_TOKENS, latent_size=latent_size,
                   guidance_scale=guidance_scale)

    # ------------------------------------------------------------------ schedule
    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """float32 [num_steps + 1]: linspace(1, 1/N, N) shifted by the pipeline's empirical mu, trailing 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        sched = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        tokens = self.latent_shape[1] * self.latent_shape[2]
        mu = compute_empirical_mu(image_seq_len=tokens, num_steps=num_steps)
        grid = None if sched.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        sched.set_timesteps(num_steps, sigmas=grid, mu=mu)
        return sched.sigmas.float().cpu()

    # ------------------------------------------------------------------ the VelocityModel interface
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """prompt_embeds [B, max_sequence_length, 3 x Qwen3 hidden] in the transformer's dtype ("" unconditional)."""
        with last_token_logits(self.pipe.text_encoder):
            embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                                max_sequence_length=self.max_sequence_length)
        return embeds.to(self.dtype).detach()

    def _position_ids(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        key = (kind, tuple(like.shape[1:]), str(like.device))
        if key not in self._ids:
            make = self.pipe._prepare_latent_ids if kind == "img" else self.pipe._prepare_text_ids
            self._ids[key] = make(like[:1].detach()).to(like.device)
        return self._ids[key]

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """Velocity v = e - d at latents x [N, 4C, H/2, W/2], sigma [N] in [0, 1]; returned in x's dtype."""
        dtype, (n, c, h, w) = self.dtype, x.shape
        embeds = cond.to(dtype)
        out = self.transformer(
            hidden_states=x.to(dtype).reshape(n, c, h * w).permute(0, 2, 1),  # the pipeline's _pack_latents
            timestep=row_sigmas(sigma, x).to(dtype),  # the pipeline's timestep / 1000: scaled by 1000 inside
            guidance=None if self.guidance_scale is None else torch.full((n,), self.guidance_scale, device=x.device),
            encoder_hidden_states=embeds,
            txt_ids=self._position_ids("txt", embeds).expand(n, -1, -1),
            img_ids=self._position_ids("img", x).expand(n, -1, -1),
            return_dict=False,
        )[0]
        return out.permute(0, 2, 1).reshape(n, c, h, w).to(x.dtype)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [N, 4C, H/2, W/2] -> float32 images [N, 3, H, W] in [0, 1], as Flux2KleinPipeline decodes."""
        vae = self.frozen["vae"]
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x.device, vae.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x.device, vae.dtype)
        latents = self.pipe._unpatchify_latents(x.to(vae.dtype) * std + mean)
        img = vae.decode(latents, return_dict=False)[0]
        return ((img.float() + 1) / 2).clamp(0, 1)


@contextlib.contextmanager
def last_token_logits(text_encoder: torch.nn.Module):
    """The text encoder's calls made with logits_to_keep=1 while inside. Both pipelines call their causal LM
    (Qwen3ForCausalLM, Mistral3ForConditionalGeneration) and read three of its hidden states; the LM head over every
    token would compute logits nobody reads: [rows, 512, 151,936] for Qwen3 (13.9 GiB in bf16 for a rank's 96
    prompts). The hidden states are the same computation (the head runs after the last layer); the head then sees
    one token. A
    pre-hook rather than a call of the base model: a text encoder sharded at its root (model.shard_text_encoder)
    must be entered through the root's own forward."""
    handle = text_encoder.register_forward_pre_hook(
        lambda module, args, kwargs: (args, {**kwargs, "logits_to_keep": 1}), with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _pipeline_class(path: Path) -> str:
    """The FLUX.2 pipeline class a saved directory's model_index.json names, or a ValueError naming the file."""
    import json

    index = path / "model_index.json"
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"model.pretrained {path}: no readable model_index.json ({err})") from None
    if name not in PIPELINES:
        raise ValueError(f"model.kind flux2 loads {' or '.join(PIPELINES)}; {index} names {name!r}")
    return name


# ------------------------------------------------------------------ the family record (models/registry.py)
def _build(cfg, path, dtypes):
    return Flux2Velocity.from_pretrained(path, dtypes, resolution=cfg.resolution,
                                         max_sequence_length=cfg.max_sequence_length,
                                         guidance_scale=cfg.distilled_guidance)


FAMILY = register(Family(
    name="flux2", velocity=Flux2Velocity, build=_build, pipeline="Flux2KleinPipeline",
    transformer="Flux2Transformer2DModel", text="qwen_lm", prompt_tokens=PROMPT_TOKENS, prompt_limit=PROMPT_TOKENS,
    keys=frozenset({"distilled_guidance"}),
    checkpoints={"flux.2-klein-4b": "flux2_klein", "flux.2-klein-base-4b": "flux2_klein"}, geometry=flux.geometry,
    inputs=flux.inputs, blocks=flux.blocks, tiny="build_tiny_flux2", check=resolution_check()))
