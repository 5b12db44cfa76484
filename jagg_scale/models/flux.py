"""FLUX.1 (diffusers) as a `VelocityModel`: the transformer is the policy, the rest is frozen.

How diffusers' FLUX maps onto the interface of base.py (docs/algorithm.md's rectified flow, x_s = (1 - s) d + s e):

    cond = encode_prompts(prompts)     FluxPipeline.encode_prompt (no grad):
                                       (prompt_embeds [B, L_t5, joint_attention_dim]  -- T5,
                                        pooled_projections [B, P]                     -- CLIP pooled output)
                                       "" gives the unconditional pair
    v    = forward(x, sigma, cond)     x [N, C, H, W] UNPACKED latents (C = in_channels / 4) are packed into
                                       FLUX's 2x2 token sequence [N, H/2 * W/2, 4 C] (FluxPipeline._pack_latents),
                                       transformer(hidden_states, timestep=sigma, guidance, pooled_projections,
                                                   encoder_hidden_states, txt_ids, img_ids)
                                       and the output is unpacked back to [N, C, H, W] (_unpack_latents)
    img  = decode(x)                   vae.decode(x / scaling_factor + shift_factor) mapped [-1, 1] -> [0, 1]

Latents: the interface keeps the unpacked [C, H, W] layout (the same as SD3 and the built-in DiT), so the SDE,
the rollout storage and JAGG never see FLUX's packing. Packing is a pure permutation, so every elementwise
quantity (Euler step, SDE mean / log-prob per element) is the same in either layout.

Timestep: FlowMatchEulerDiscreteScheduler sets timesteps = sigmas * 1000 and FluxPipeline passes
`timestep / 1000` to the transformer (which multiplies by 1000 internally), so the transformer receives sigma
itself. Guidance: FLUX-dev is guidance-distilled; when `transformer.config.guidance_embeds` the distilled
guidance value (`guidance_scale`, default 3.5, the pipeline's default) is fed as `guidance` on every row, as
the pipeline does. It is not CFG: the trainer normally runs FLUX with sampling.guidance 1.0, and a real CFG
pair (cond, uncond) through `grpo.rollout.guided_velocity` still works (uncond = `encode_prompts([""] * N)`).

Sign: the FLUX transformer predicts v = e - d, the scheduler's Euler step is x_next = x + (s_next - s) v on the
packed latents, i.e. dx/ds = v: docs/algorithm.md's convention, so the velocity is passed through unchanged
(tests/models/test_flux_adapter.py checks it against scheduler.step and the pipeline's own sampling loop).

Schedule: FLUX shifts sigmas dynamically (mu from the image sequence length); `pipeline_sigmas(num_steps)`
(diffusers_common.py) returns the schedule FluxPipeline would use for this latent size, with the trailing 0.

Trainable vs frozen: only the transformer is a registered submodule, so `.parameters()`, `.state_dict()` and
the optimizer see the transformer alone. The VAE and the two text encoders live in a plain dict
(`self.frozen`), have requires_grad False, and follow the adapter through `.to()` / `.double()` / `.cuda()`
(`_apply` is overridden). The rest of the pipeline (tokenizers, scheduler) is kept as `self.pipe` for
`encode_prompt` and the scheduler config.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .diffusers_common import DiffusersVelocity, load_pipeline, resolution_check, row_sigmas, t5_length
from .registry import Family, register

PROMPT_TOKENS = 512  # FluxPipeline's max_sequence_length (T5 tokens), its T5 tokenizer's limit too


class FluxVelocity(DiffusersVelocity):
    """v_theta(x, sigma, cond) of a diffusers FluxPipeline's transformer, on unpacked latents [N, C, H, W]."""

    frozen_names = ("vae", "text_encoder", "text_encoder_2")
    t5_name = "text_encoder_2"
    pipeline_class = "FluxPipeline"
    guidance_default = 3.5  # FluxPipeline.__call__'s guidance_scale
    # DanceGRPO's FLUX LoRA (XueZeyue/DanceGRPO 15cc71d fastvideo/train_grpo_flux_lora.py:663, run by
    # scripts/finetune/finetune_flux_grpo_8gpus_lora.sh; its FLUX recipe that configs/flux1_dev_hps.yaml follows trains
    # the full model): bare names, so the image-stream q/k/v/out of the 19 double-stream blocks and q/k/v of the 38
    # single-stream blocks (190 modules on FLUX.1-dev)
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")

    def __init__(self, pipe, max_sequence_length: int = PROMPT_TOKENS, guidance_scale: float = 3.5,
                 latent_size: int | None = None):
        super().__init__(pipe, max_sequence_length)
        self.guidance_scale = float(guidance_scale)
        cfg = self.transformer.config
        if cfg.in_channels % 4:
            raise ValueError(f"FLUX transformer in_channels {cfg.in_channels} is not 4 x latent channels")
        self.vae_scale_factor = pipe.vae_scale_factor
        if latent_size is None:
            # the VAE's sample size (1024 px for FLUX.1, 16 px for the tiny test pipeline); 1024 px if unknown
            vae_sample = getattr(pipe.vae.config, "sample_size", None) if pipe.vae is not None else None
            image = int(vae_sample) if isinstance(vae_sample, int) else 1024
            latent_size = image // self.vae_scale_factor
        if latent_size % 2:
            raise ValueError(f"FLUX latent size must be even (2x2 packing), got {latent_size}")
        self.latent_shape = (cfg.in_channels // 4, latent_size, latent_size)
        self.image_size = latent_size * self.vae_scale_factor
        self.patch_size = 2  # FLUX's 2x2 packing: the image sequence length is (H/2)(W/2) tokens
        self._ids: dict = {}  # rope ids by (kind, size, device, dtype): built once, not at every forward

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | dict = torch.float32, *, max_sequence_length: int | None = None,
                        guidance_scale: float | None = None, latent_size: int | None = None,
                        resolution: int | None = None, local_files_only: bool = True) -> "FluxVelocity":
        """Load a saved `pipeline_class` directory (offline by default); `dtype` as for SD3Velocity.from_pretrained;
        guidance_scale None: the pipeline's own default (`guidance_default`)."""
        import diffusers

        pipe = load_pipeline(getattr(diffusers, cls.pipeline_class), path, dtype, local_files_only=local_files_only)
        guidance_scale = cls.guidance_default if guidance_scale is None else guidance_scale
        max_sequence_length = t5_length(pipe.tokenizer_2, max_sequence_length, PROMPT_TOKENS)
        if resolution is not None:
            latent_size = cls.latent_size_for(pipe, resolution, 2)
        return cls(pipe, max_sequence_length=max_sequence_length, guidance_scale=guidance_scale,
                   latent_size=latent_size)

    # ------------------------------------------------------------------ packing and schedule
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> FLUX's token sequence [N, H/2 * W/2, 4 C]."""
        n, c, h, w = x.shape
        return self.pipe._pack_latents(x, n, c, h, w)

    def unpack(self, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[N, H/2 * W/2, 4 C] -> [N, C, H, W] (H, W: latent size)."""
        f = self.vae_scale_factor
        return self.pipe._unpack_latents(tokens, height * f, width * f, f)

    def image_ids(self, height: int, width: int, device, dtype) -> torch.Tensor:
        """Rope position ids [H/2 * W/2, 3] of the packed image tokens (the pipeline builds them on the host and
        copies them over: cached per size, device and dtype, so the copy happens once, not at every forward)."""
        key = ("img", height, width, str(device), dtype)
        if key not in self._ids:
            self._ids[key] = self.pipe._prepare_latent_image_ids(1, height // 2, width // 2, device, dtype)
        return self._ids[key]

    def _pipeline_sigma_grid(self, num_steps: int):
        """FluxPipeline passes its own unshifted grid linspace(1, 1/N, N) (unless the scheduler uses flow sigmas)."""
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):
            return None
        return np.linspace(1.0, 1 / num_steps, num_steps)

    # ------------------------------------------------------------------ the VelocityModel interface
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds [B, L, D] from T5, pooled [B, P] from CLIP) in the transformer's dtype; "" is the
        unconditional prompt."""
        prompts = list(prompts)
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return embeds.to(self.dtype).detach(), pooled.to(self.dtype).detach()

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """Velocity v = e - d at unpacked latents x [N, C, H, W], sigma [N] in [0, 1]; returned in x's dtype."""
        embeds, pooled = cond
        dtype = self.dtype
        n, _, h, w = x.shape
        out = self.transformer(
            hidden_states=self.pack(x.to(dtype)),
            timestep=self.timestep(sigma, x),
            guidance=self.distilled_guidance(n, x.device),
            pooled_projections=pooled.to(dtype),
            encoder_hidden_states=embeds.to(dtype),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=dtype),  # a fill on the device: no copy
            img_ids=self.image_ids(h, w, x.device, dtype),
            return_dict=False,
        )[0]
        return self.unpack(out, h, w).to(x.dtype)

    def timestep(self, sigma, x: torch.Tensor) -> torch.Tensor:
        """FluxPipeline passes timesteps / 1000 = sigma; the transformer scales by 1000 itself."""
        return row_sigmas(sigma, x).to(self.dtype)

    def distilled_guidance(self, n: int, device) -> torch.Tensor | None:
        """The guidance-embedding input of a guidance-distilled transformer (float32, as the pipeline's), else None."""
        if not self.transformer.config.guidance_embeds:
            return None
        return torch.full((n,), self.guidance_scale, device=device, dtype=torch.float32)


# ------------------------------------------------------------------ the family record (models/registry.py)
def build_flux(cls, cfg, path, dtypes):
    """FLUX.1 and FLUX.1-Kontext (`cls`): the distilled guidance from the config, else the pipeline's default."""
    guidance = {} if cfg.distilled_guidance is None else {"guidance_scale": cfg.distilled_guidance}
    return cls.from_pretrained(path, dtypes, resolution=cfg.resolution, max_sequence_length=cfg.max_sequence_length,
                               **guidance)


def geometry(cfg, tc, vae, tokens, prompt):
    """The estimator's latents, patch and text tokens (estimate/memory.py): FLUX.1's T5 tokens and CLIP's pooled
    vector, or FLUX.2 [klein]'s padded Qwen3 prompt (`prompt`, no pooled vector); 2x2 latent patches."""
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    side = (cfg.model.resolution or vae["sample_size"]) // scale
    text = tokens["t5"] if prompt is None else prompt
    return {"scale": scale, "side": side, "latent": (tc["in_channels"] // 4, side, side), "patch": 2, "text": text,
            "cond_row": text * tc["joint_attention_dim"] + tc.get("pooled_projection_dim", 0)}


def inputs(cfg, n, h, w, t, r, u, device, frames, image_copies: int = 1):
    """The transformer's forward arguments, as FluxVelocity (and FLUX.2's) calls it (estimate/measure.py
    model_inputs): packed 2x2 tokens with their rope ids (3 axes; FLUX.2's 4: T, H, W, L), SD3's and FLUX.1's pooled
    prompt vector (FLUX.2 has none), FLUX.1-dev's distilled guidance; `image_copies` 2: Kontext's input image's
    tokens after the noisy ones, rope axis 0 = 1 (models/kontext.py)."""
    common = dict(encoder_hidden_states=r(n, t, cfg["joint_attention_dim"]), return_dict=False)
    if "pooled_projection_dim" in cfg:
        common["pooled_projections"] = r(n, cfg["pooled_projection_dim"])
    ids = torch.zeros(h, w, len(cfg["axes_dims_rope"]))
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    ids = ids.reshape(-1, ids.shape[-1])
    guidance = torch.full((n,), 3.5, device=device) if cfg.get("guidance_embeds") else None
    tokens = h * w
    if image_copies == 2:
        ids, tokens = torch.cat([ids, torch.cat([torch.ones(len(ids), 1), ids[:, 1:]], dim=1)]), 2 * h * w
    return dict(hidden_states=r(n, tokens, cfg["in_channels"]), timestep=u(n), guidance=guidance,
                img_ids=ids.to(device), txt_ids=torch.zeros(t, ids.shape[-1], device=device), **common)


def blocks(cfg, side):
    """FLUX.1 and FLUX.2: double-stream then single-stream blocks (estimate/measure.py)."""
    types = ["double"] * cfg["num_layers"] + ["single"] * cfg["num_single_layers"]
    kinds = list(dict.fromkeys(types))
    return types, dict(cfg, num_layers=int("double" in kinds), num_single_layers=int("single" in kinds))


FAMILY = register(Family(
    name="flux", velocity=FluxVelocity, build=lambda cfg, path, dtypes: build_flux(FluxVelocity, cfg, path, dtypes),
    pipeline="FluxPipeline", transformer="FluxTransformer2DModel", text="clip_t5", prompt_tokens=PROMPT_TOKENS,
    prompt_limit=PROMPT_TOKENS, keys=frozenset({"distilled_guidance"}),
    checkpoints={"flux.1-dev": "flux1_dev", "flux1-dev": "flux1_dev"}, geometry=geometry, inputs=inputs,
    blocks=blocks, tiny="build_tiny_flux", check=resolution_check()))
