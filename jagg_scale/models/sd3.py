"""Stable Diffusion 3 / 3.5 (diffusers) as a `VelocityModel`: the transformer is the policy, the rest is frozen.

How diffusers' SD3 maps onto the interface of base.py (docs/algorithm.md's rectified flow, x_s = (1 - s) d + s e):

    cond = encode_prompts(prompts)     StableDiffusion3Pipeline.encode_prompt (no CFG, no grad):
                                       (prompt_embeds [B, L_clip + L_t5, joint_attention_dim],
                                        pooled_projections [B, P])   -- "" gives the unconditional pair
    v    = forward(x, sigma, cond)     transformer(hidden_states=x, timestep=1000 * sigma,
                                                   encoder_hidden_states, pooled_projections)
    img  = decode(x)                   vae.decode(x / scaling_factor + shift_factor) mapped [-1, 1] -> [0, 1]

Timestep: FlowMatchEulerDiscreteScheduler sets timesteps = sigmas * num_train_timesteps (1000) and the pipeline
feeds those to the transformer, so sigma in [0, 1] becomes timestep 1000 * sigma here.

Sign: the SD3 transformer predicts v = e - d (noise minus data), the scheduler's Euler step is
x_next = x + (s_next - s) v, i.e. dx/ds = v for x_s = (1 - s) d + s e: the same convention as docs/algorithm.md,
so the velocity is passed through unchanged (tests/models/test_sd3_adapter.py checks it against scheduler.step and
the pipeline's own sampling loop).

CFG is not done here: the trainer passes (cond, uncond) through `grpo.rollout.guided_velocity`, which calls
this model once on 2N rows; the uncond half is `encode_prompts([""] * N)`.

Trainable vs frozen: only the transformer is a registered submodule, so `.parameters()`, `.state_dict()` and
the optimizer see the transformer alone. The VAE and the three text encoders live in a plain dict
(`self.frozen`), have requires_grad False, and follow the adapter through `.to()` / `.double()` / `.cuda()`
(`_apply` is overridden). The rest of the pipeline (tokenizers, scheduler) is kept as `self.pipe` for
`encode_prompt` and the scheduler config.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .diffusers_common import DiffusersVelocity, load_pipeline, resolution_check, row_sigmas, t5_length
from .registry import Family, register

PROMPT_TOKENS = 256  # StableDiffusion3Pipeline's max_sequence_length (T5 tokens)
PROMPT_LIMIT = 512  # its T5 tokenizer's


class SD3Velocity(DiffusersVelocity):
    """v_theta(x, sigma, cond) of a diffusers StableDiffusion3Pipeline's transformer."""

    frozen_names = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    t5_name = "text_encoder_3"
    # Flow-GRPO's (yifan123/flow_grpo ac4c86e scripts/train_sd3.py:419-428) and DiffusionNFT's (NVlabs/DiffusionNFT
    # 24af555 scripts/train_nft_sd3.py:420-429) joint-attention projections, "attn."-prefixed: SD3.5-medium's
    # dual-attention blocks' attn2 is left out (191 modules at r 32 = 18.8M parameters, not 243 = 23.9M)
    lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")

    def __init__(self, pipe, max_sequence_length: int = PROMPT_TOKENS, latent_size: int | None = None):
        super().__init__(pipe, max_sequence_length)
        cfg = self.transformer.config
        vae_scale = pipe.vae_scale_factor
        latent_size = int(latent_size or cfg.sample_size)  # default: the transformer's native size (1024 px)
        if latent_size % cfg.patch_size:
            raise ValueError(f"SD3 latent size {latent_size} is not a multiple of the patch size {cfg.patch_size}")
        self.latent_shape = (cfg.in_channels, latent_size, latent_size)
        self.image_size = latent_size * vae_scale
        self.patch_size = cfg.patch_size
        self.attention = "sdpa"  # the attention kernel (set_attention): sdpa | xformers

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | dict = torch.float32, *, max_sequence_length: int | None = None,
                        resolution: int | None = None, local_files_only: bool = True, t5: bool = True
                        ) -> "SD3Velocity":
        """Load a saved StableDiffusion3Pipeline directory (offline by default). `dtype`: one dtype, or diffusers'
        per-component dict ({"transformer": ..., "default": ...}) applied while loading. `t5=False` loads no T5
        encoder (text_encoder_3 None): the pipeline then encodes zero T5 embeddings of the same shape, as diffusers
        documents for SD3 without T5 (its tokenizer is still loaded: it fixes the T5 sequence length)."""
        from diffusers import StableDiffusion3Pipeline

        no_t5 = {} if t5 else {"text_encoder_3": None}
        pipe = load_pipeline(StableDiffusion3Pipeline, path, dtype, local_files_only=local_files_only, **no_t5)
        max_sequence_length = t5_length(pipe.tokenizer_3, max_sequence_length, PROMPT_TOKENS)
        latent_size = cls.latent_size_for(pipe, resolution, pipe.transformer.config.patch_size)
        return cls(pipe, max_sequence_length=max_sequence_length, latent_size=latent_size)

    # ------------------------------------------------------------------ training options
    def set_attention(self, name: str = "sdpa") -> "SD3Velocity":
        """"sdpa" (default): diffusers' torch scaled_dot_product_attention processors (JointAttnProcessor2_0 /
        AttnProcessor2_0). "xformers": xformers' memory-efficient attention, which needs CUDA and an importable
        xformers; otherwise a RuntimeError says which is missing."""
        from diffusers.models.attention_processor import (
            AttnProcessor2_0, JointAttnProcessor2_0, XFormersAttnProcessor, XFormersJointAttnProcessor,
        )

        name = str(name).lower()
        if name == "sdpa":
            for module in self.transformer.modules():
                proc = getattr(module, "processor", None)
                if isinstance(proc, XFormersJointAttnProcessor):
                    module.set_processor(JointAttnProcessor2_0())
                elif isinstance(proc, XFormersAttnProcessor):
                    module.set_processor(AttnProcessor2_0())
        elif name == "xformers":
            missing = []
            if not torch.cuda.is_available():
                missing.append("CUDA is not available (torch.cuda.is_available() is False)")
            try:
                import xformers
                import xformers.ops  # noqa: F401
            except Exception as exc:  # ImportError, or a broken build
                missing.append(f"`import xformers` failed ({type(exc).__name__}: {exc})")
            if missing:
                raise RuntimeError("model.attention 'xformers' unavailable: " + "; ".join(missing)
                                   + ". Use model.attention sdpa.")
            self.transformer.enable_xformers_memory_efficient_attention()
        else:
            raise ValueError(f"unknown attention {name!r}: expected 'sdpa' or 'xformers'")
        self.attention = name
        return self

    # ------------------------------------------------------------------ the VelocityModel interface
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds [B, L, D], pooled [B, P]) in the transformer's dtype; "" is the unconditional prompt."""
        prompts = list(prompts)
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
        )
        return embeds.to(self.dtype).detach(), pooled.to(self.dtype).detach()

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """Velocity v = e - d at latents x [N, C, H, W], sigma [N] in [0, 1]; returned in x's dtype."""
        return sd3_velocity(self.transformer, x, sigma, cond, self.num_train_timesteps)


def sd3_velocity(transformer, x: torch.Tensor, sigma: torch.Tensor, cond, num_train_timesteps: int = 1000
                 ) -> torch.Tensor:
    """The SD3 velocity of a diffusers SD3Transformer2DModel: cond = (prompt_embeds, pooled), timestep = 1000 sigma
    (in at least float32), inputs in the transformer's dtype, the result in x's dtype. The one place this mapping is
    written: the pipeline adapter above and the bare-transformer wrapper below both call it."""
    embeds, pooled = cond
    dtype = next(transformer.parameters()).dtype
    sigma = row_sigmas(sigma, x)
    timestep = sigma.to(torch.promote_types(sigma.dtype, torch.float32)) * num_train_timesteps
    v = transformer(
        hidden_states=x.to(dtype),
        timestep=timestep,
        encoder_hidden_states=embeds.to(dtype),
        pooled_projections=pooled.to(dtype),
        return_dict=False,
    )[0]
    return v.to(x.dtype)


class SD3TransformerVelocity(torch.nn.Module):
    """v(x, sigma, (embeds, pooled)) of a bare SD3Transformer2DModel, without a pipeline (no encoders, no VAE): what
    the benchmarks and the GPU check train at the real shape with random weights (tools/bench, tools/gpu_check.py).
    `autocast` (e.g. torch.bfloat16): the forward under that autocast, as the trainer's policy runs it."""

    def __init__(self, transformer, num_train_timesteps: int = 1000, autocast: torch.dtype | None = None):
        super().__init__()
        self.transformer = transformer
        self.num_train_timesteps = num_train_timesteps
        self.autocast = autocast
        cfg = transformer.config
        self.latent_shape = (cfg.in_channels, cfg.sample_size, cfg.sample_size)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            return sd3_velocity(self.transformer, x, sigma, cond, self.num_train_timesteps)


# ------------------------------------------------------------------ the family record (models/registry.py)
def _build(cfg, path, dtypes):
    model = SD3Velocity.from_pretrained(path, dtypes, resolution=cfg.resolution, t5=cfg.text_encoders == "all",
                                        max_sequence_length=cfg.max_sequence_length)
    model.set_attention(cfg.attention)  # raises early when xformers is asked for without CUDA/xformers
    return model


def _geometry(cfg, tc, vae, tokens, prompt):
    """The estimator's latents, patch and text tokens (estimate/memory.py): CLIP's and T5's tokens side by side."""
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    side = cfg.model.resolution // scale if cfg.model.resolution else tc["sample_size"]
    text = tokens["clip"] + tokens["t5"]
    return {"scale": scale, "side": side, "latent": (tc["in_channels"], side, side), "patch": tc["patch_size"],
            "text": text, "cond_row": text * tc["joint_attention_dim"] + tc["pooled_projection_dim"]}


def _inputs(cfg, n, h, w, t, r, u, device, frames):
    """The transformer's forward arguments, as SD3Velocity calls it (estimate/measure.py model_inputs)."""
    p = cfg["patch_size"]
    text, pooled = r(n, t, cfg["joint_attention_dim"]), r(n, cfg["pooled_projection_dim"])  # drawn in this order
    return dict(hidden_states=r(n, cfg["in_channels"], h * p, w * p), timestep=u(n) * 1000,
                encoder_hidden_states=text, pooled_projections=pooled, return_dict=False)


def _blocks(cfg, side):
    """Block types in forward order (SD3.5's dual-attention layers, the last block's context-free output), and the
    config with one block of each, its positions up to `side` patches (estimate/measure.py)."""
    L, dual = cfg["num_layers"], set(cfg.get("dual_attention_layers") or ())
    types = ["last" if i == L - 1 else "dual" if i in dual else "joint" for i in range(L)]
    kinds = list(dict.fromkeys(types))
    return types, dict(cfg, num_layers=len(kinds), dual_attention_layers=(0,) if "dual" in kinds else (),
                       pos_embed_max_size=side)


def _context_parallel(transformer):
    from ..parallel.sequence import sd3_context_parallel

    return sd3_context_parallel(transformer)


FAMILY = register(Family(
    name="sd3", velocity=SD3Velocity, build=_build, pipeline="StableDiffusion3Pipeline",
    transformer="SD3Transformer2DModel", text="clip_t5", prompt_tokens=PROMPT_TOKENS, prompt_limit=PROMPT_LIMIT,
    keys=frozenset({"text_encoders", "attention"}),
    checkpoints={"stable-diffusion-3.5-medium": "sd35_medium", "stable-diffusion-3.5-large": "sd35_large"},
    geometry=_geometry, inputs=_inputs,
    blocks=_blocks, context_parallel=_context_parallel, tiny="build_tiny_sd3",
    check=resolution_check(lambda tc: tc["patch_size"])))
