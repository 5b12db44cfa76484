"""Qwen-Image (diffusers) as a `VelocityModel`: the transformer is the policy, the rest is frozen.

How diffusers' QwenImagePipeline maps onto the interface of base.py (docs/algorithm.md's rectified flow,
x_s = (1 - s) d + s e):

    cond = encode_prompts(prompts)     QwenImagePipeline.encode_prompt (no grad): the last hidden states of the
                                       Qwen2.5-VL text encoder over the pipeline's prompt template, its system part
                                       dropped, at most model.max_sequence_length tokens a prompt: a cond.Tokens
                                       (prompt_embeds [B, L, joint_attention_dim], mask [B, L], each prompt's length
                                       on the host), L the longest prompt's (see "Prompt length")
    v    = forward(x, sigma, cond)     x [N, C, H, W] UNPACKED latents (C = in_channels / 4) packed into 2x2 tokens
                                       [N, H/2 * W/2, 4 C] (QwenImagePipeline._pack_latents), transformer(
                                       hidden_states, timestep=sigma, encoder_hidden_states, mask, img_shapes),
                                       unpacked back to [N, C, H, W]
    img  = decode(x)                   the VAE works on video-shaped latents [N, C, 1, H, W], normalised per channel:
                                       vae.decode(x * latents_std + latents_mean)[:, :, 0], [-1, 1] -> [0, 1]

Timestep: the pipeline passes `timestep / 1000` = sigma (the transformer scales by 1000 itself), as FLUX's does.
Sign: the transformer predicts v = e - d and the scheduler's Euler step is x_next = x + (s_next - s) v: the
convention of docs/algorithm.md, passed through unchanged (tests/models/test_qwenimage_adapter.py checks the
adapter's Euler loop against the pipeline's own sampling).

Prompt length: a pass carries its rows' longest prompt, no more. The pipeline pads a batch's prompts to its
longest (zeros, mask 0); every batch the trainer makes of them (a rollout chunk, a micro-batch, a JAGG joint pass, the
conditional and unconditional rows of CFG) is cut or padded to its own rows' longest by cond.Tokens from each
prompt's length, read from the pipeline's mask once per encode (next to the pipeline's own reads of it), so sizing a
pass reads nothing back from the device. Padding is not free: every text token goes through each of the 60 blocks'
text-stream projections and MLP, not only the attention. The transformer masks padded text tokens out of the joint
attention and gives text token i the same rotary position whatever the padded length, so the velocity is the
pipeline's at any cut (tested); a batch without padding passes no mask, as the pipeline does. With sequence
parallelism the text is padded up to a multiple of the ranks it is split over (Ulysses splits evenly), masked.
(eff_grpo cuts the same way: its rollout pads a batch to its longest prompt, train_grpo_qwenimage_jagg.py:523-548,
and trains one sample at a time at its own length, :805-811.)

Guidance: Qwen-Image's "true CFG" (QwenImagePipeline.__call__) rescales the guided prediction, per packed token,
to the conditional prediction's norm there, with the negative prompt " " (its docstring: CFG needs a negative prompt,
"even an empty negative prompt like ' '"): `guidance_rule = "token_norm"` (grpo/guidance.py) and `negative_prompt`,
used by rollout, evaluation and the GRPO loss alike. (eff_grpo's Qwen-Image recipe trains without CFG:
fastvideo/train_grpo_qwenimage_jagg.py:244 passes guidance=None and the conditional prompt alone.)

The text encoder (Qwen2.5-VL, 7B in the published model) is `t5_name`: `model.shard_text_encoder` shards it for
inference like SD3's and FLUX's T5.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..cond import Tokens
from ..parallel.sequence import sequence_split
from .diffusers_common import DiffusersVelocity, latent_stats, load_pipeline, resolution_check, row_sigmas
from .registry import Family, register

PROMPT_TOKENS = 512  # QwenImagePipeline.__call__'s max_sequence_length
PROMPT_LIMIT = 1024  # the most QwenImagePipeline takes


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] -> the 2x2 token sequence [N, H/2 * W/2, 4 C] (QwenImagePipeline's own, static, _pack_latents)."""
    from diffusers import QwenImagePipeline

    n, c, h, w = x.shape
    return QwenImagePipeline._pack_latents(x, n, c, h, w)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[N, H/2 * W/2, 4 C] -> [N, C, H, W] (H, W: latent size): the pipeline's _unpack_latents at VAE factor 1, its
    frame axis dropped."""
    from diffusers import QwenImagePipeline

    return QwenImagePipeline._unpack_latents(tokens, height, width, 1)[:, :, 0]


class QwenImageVelocity(DiffusersVelocity):
    """v_theta(x, sigma, cond) of a diffusers QwenImagePipeline's transformer, on unpacked latents [N, C, H, W]."""

    frozen_names = ("vae", "text_encoder")
    t5_name = "text_encoder"
    guidance_rule = "token_norm"
    # eff_grpo, whose recipe configs/qwenimage_hps.yaml follows, trains the full model (SchumiDing/eff_grpo ae14d64
    # run_jagg.sh: no LoRA flag), as DanceGRPO's Qwen-Image script does; the default is Flow-Factory's Qwen-Image
    # LoRA (X-GenGroup/Flow-Factory a0b2bc5 src/flow_factory/models/qwen_image/qwen_image.py:81-89): both streams'
    # attention projections and their MLPs' input projections. Its "img_mlp.net.2.proj" / "txt_mlp.net.2.proj" name
    # nothing in diffusers' QwenImage (net.2 is the output Linear itself), so Flow-Factory wraps what this wraps
    lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                    "img_mlp.net.0.proj", "txt_mlp.net.0.proj")
    negative_prompt = " "

    def __init__(self, pipe, max_sequence_length: int = PROMPT_TOKENS, latent_size: int | None = None):
        super().__init__(pipe, max_sequence_length)
        cfg = self.transformer.config
        if cfg.in_channels % 4:
            raise ValueError(f"Qwen-Image transformer in_channels {cfg.in_channels} is not 4 x latent channels")
        self.vae_scale_factor = pipe.vae_scale_factor
        latent_size = int(latent_size or pipe.default_sample_size)  # the pipeline's default: 128 latents (1024 px)
        if latent_size % 2:
            raise ValueError(f"Qwen-Image latent size must be even (2x2 packing), got {latent_size}")
        self.latent_shape = (cfg.in_channels // 4, latent_size, latent_size)
        self.image_size = latent_size * self.vae_scale_factor
        self.patch_size = 2
        self._latent_stats: dict = {}  # the VAE's per-channel mean / std by (device, dtype): copied to a device once

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | dict = torch.float32, *, max_sequence_length: int | None = None,
                        resolution: int | None = None, local_files_only: bool = True) -> "QwenImageVelocity":
        """Load a saved QwenImagePipeline directory (offline by default); `dtype` as for SD3Velocity.from_pretrained."""
        from diffusers import QwenImagePipeline

        pipe = load_pipeline(QwenImagePipeline, path, dtype, local_files_only=local_files_only)
        latent_size = cls.latent_size_for(pipe, resolution, 2) if resolution is not None else None
        return cls(pipe, max_sequence_length=min(max_sequence_length or PROMPT_TOKENS, PROMPT_LIMIT),
                   latent_size=latent_size)

    # ------------------------------------------------------------------ packing and schedule
    pack = staticmethod(pack_latents)  # the module's functions, under the names FLUX's adapter uses
    unpack = staticmethod(unpack_latents)

    def _pipeline_sigma_grid(self, num_steps: int):
        """QwenImagePipeline passes the unshifted grid linspace(1, 1/N, N), shifted by mu (dynamic shifting)."""
        return np.linspace(1.0, 1 / num_steps, num_steps)

    # ------------------------------------------------------------------ the VelocityModel interface
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> Tokens:
        """Tokens(prompt_embeds [B, L, D] in the transformer's dtype, mask [B, L] int64, lengths), L the longest
        prompt's tokens (at most max_sequence_length)."""
        embeds, mask = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, num_images_per_prompt=1,
                                               max_sequence_length=self.max_sequence_length)
        n, length, _ = embeds.shape
        if mask is None:  # the pipeline drops an all-ones mask (every prompt as long as the longest)
            mask = torch.ones(n, length, dtype=torch.int64, device=embeds.device)
        # each prompt's length (its mask is ones, then zeros): the one read of this encode (module docstring)
        return Tokens(embeds.to(self.dtype).detach(), mask.to(torch.int64), tuple(mask.sum(dim=1).tolist()))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """Velocity v = e - d at unpacked latents x [N, C, H, W], sigma [N] in [0, 1]; returned in x's dtype."""
        return qwenimage_velocity(self.transformer, x, sigma, cond)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [N, C, H, W] -> float32 images [N, 3, H, W] in [0, 1], as QwenImagePipeline decodes."""
        vae = self.frozen["vae"]
        mean, std = latent_stats(vae, x.device, self._latent_stats)
        latents = x.to(vae.dtype).unsqueeze(2) * std + mean
        img = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return ((img.float() + 1) / 2).clamp(0, 1)


def qwenimage_velocity(transformer, x: torch.Tensor, sigma, cond: Tokens) -> torch.Tensor:
    """The Qwen-Image velocity of a diffusers QwenImageTransformer2DModel at unpacked latents x [N, C, H, W]: packed
    into 2x2 tokens by the pipeline's own (static) _pack_latents, timestep = sigma (the pipeline's timestep / 1000),
    the prompts at their rows' longest (up to a multiple of a sequence-parallel split) and their mask, none where
    nothing is padding, as the pipeline passes it; the latent grid; unpacked back, in x's dtype. The one place this
    mapping is written: the pipeline adapter above and the GPU check's bare transformer
    (diffusers_common.TransformerVelocity) both call it."""
    dtype = next(transformer.parameters()).dtype
    split, longest = sequence_split(transformer), max(cond.lengths)
    embeds, mask = cond.to_length(-(-longest // split) * split)  # host arithmetic: no device read
    n, c, h, w = x.shape
    out = transformer(
        hidden_states=pack_latents(x.to(dtype)),
        timestep=row_sigmas(sigma, x).to(dtype),  # the transformer scales by 1000 itself
        guidance=None,
        encoder_hidden_states=embeds.to(dtype),
        encoder_hidden_states_mask=None if cond.full and embeds.shape[1] == longest else mask,
        img_shapes=[[(1, h // 2, w // 2)]] * n,  # Python data: no device copy
        return_dict=False,
    )[0]
    return unpack_latents(out, h, w).to(x.dtype)



# ------------------------------------------------------------------ the family record (models/registry.py)
def _build(cfg, path, dtypes):
    return QwenImageVelocity.from_pretrained(path, dtypes, resolution=cfg.resolution,
                                             max_sequence_length=cfg.max_sequence_length)


def geometry(cfg, tc, vae, tokens, prompt):
    """The estimator's latents, patch and text tokens (estimate/memory.py). A video VAE: 8x spatial (2 per
    temporal_downsample level); a pass carries its rows' longest prompt: at most the prompt set's longest
    (estimate/prompt_tokens.py), padded up to a multiple of a sequence-parallel split."""
    from ..estimate.prompt_tokens import longest

    scale = 2 ** len(vae["temperal_downsample"])
    side = (cfg.model.resolution or 1024) // scale  # QwenImagePipeline's default: 1024 px
    lengths = (tokens["encoded"]["lengths"], prompt) if "encoded" in tokens else None
    sp = cfg.parallel.sequence_parallel
    text = -(-(longest(*lengths) if lengths else prompt) // sp) * sp
    return {"scale": scale, "side": side, "latent": (tc["in_channels"] // 4, side, side), "patch": 2, "text": text,
            "cond_row": text * (tc["joint_attention_dim"] + 2), "prompt_lengths": lengths}


def inputs(cfg, n, h, w, t, r, u, device, frames):
    """The transformer's forward arguments as the adapter calls it: packed 2x2 tokens, the prompt with its mask, the
    latent grid (estimate/measure.py model_inputs)."""
    return dict(hidden_states=r(n, h * w, cfg["in_channels"]), timestep=u(n),
                encoder_hidden_states=r(n, t, cfg["joint_attention_dim"]),
                encoder_hidden_states_mask=torch.ones(n, t, dtype=torch.bool, device=device),
                img_shapes=[[(1, h, w)]] * n, return_dict=False)


def blocks(cfg, side):
    """One kind of double-stream block (estimate/measure.py)."""
    return ["double"] * cfg["num_layers"], dict(cfg, num_layers=1)


FAMILY = register(Family(
    name="qwenimage", velocity=QwenImageVelocity, build=_build, pipeline="QwenImagePipeline",
    transformer="QwenImageTransformer2DModel", text="qwen", prompt_tokens=PROMPT_TOKENS, prompt_limit=PROMPT_LIMIT,
    checkpoints={"qwen-image": "qwen_image"}, geometry=geometry, inputs=inputs, blocks=blocks,
    tiny="build_tiny_qwenimage", check=resolution_check()))
