"""Wan2.1 / Wan2.2 text-to-video (diffusers WanPipeline) as a `VelocityModel`: the transformer is the policy.

The algorithm is shape-agnostic: a video's latents [N, C, F, H, W] go through the rollout, the SDE log-probs, the
JAGG windows and the loss exactly as an image's [N, C, H, W] do (docs/algorithm.md: every quantity is per element,
reduced over all latent dimensions but the batch).

    cond = encode_prompts(prompts)     WanPipeline.encode_prompt (no grad): UMT5's last hidden states, each prompt's
                                       padding zeroed, [B, model.max_sequence_length, text_dim] (the pipeline's 512)
    v    = forward(x, sigma, cond)     transformer(x [N, C, F, H, W], timestep = 1000 sigma, embeds): the
                                       scheduler's timesteps are sigma x num_train_timesteps, and the transformer
                                       predicts v = e - d (flow prediction), as SD3's does
    img  = decode(x)                   vae.decode(x * latents_std + latents_mean) -> frames [N, 3, F', H', W'] in
                                       [0, 1] (F' = 4 (F - 1) + 1 for the published VAE)

VAE: float32, as diffusers' Wan example loads it (pipelines/wan/pipeline_wan.py:56 in diffusers 0.42.1,
`AutoencoderKLWan.from_pretrained(..., torch_dtype=torch.float32)` beside a bfloat16 pipeline); `_build` asks for it
whatever model.dtype is, and the estimator counts it so (estimate/memory.py).

Schedule: the pipeline samples with its own scheduler (UniPCMultistepScheduler with flow sigmas shifted by
flow_shift in the published Wan2.1 pipelines); `pipeline_sigmas` asks that scheduler class for its sigmas, and the
rollout steps them with the Flow-GRPO SDE (Euler-Maruyama), as Flow-GRPO and DanceGRPO train Wan. Guidance: plain
CFG with the pipeline's empty negative prompt (WanPipeline's guidance_scale 5.0 by default).

Wan2.2 A14B: two experts by noise level, `transformer` (high noise) while t >= boundary_ratio x num_train_timesteps
and `transformer_2` below (pipeline_wan.py:585-604). The adapter's `transformer` is then both experts as one module
(wan_experts.py WanExperts): each row of a pass goes through the expert the pipeline would run at its timestep, so
the rollout and the training passes call one velocity function, both experts train (full, or a LoRA on each: the
targets match in both), and `expert_switch` tells the planner where to cut (no JAGG segment crosses the switch,
jagg/experts.py). The low-noise expert is guided with sampling.guidance, as the pipeline does when guidance_scale_2
is not given (pipeline_wan.py:517-518). A LoRA export writes the high expert's adapter to out_dir and the low one's
to out_dir/transformer_2, for `load_lora_weights(..., load_into_transformer_2=True)` (loaders/lora_pipeline.py:4231).
Wan2.1 and Wan2.2 TI2V-5B have one transformer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from .diffusers_common import DiffusersVelocity, latent_stats, load_pipeline, row_sigmas, token_problem
from .registry import Family, register
from ..sections import ConfigError
from .wan_experts import ExpertsError, WanExperts, expert_switch, split_state

PROMPT_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length, and the most it may be


class WanVelocity(DiffusersVelocity):
    """v_theta(x, sigma, cond) of a diffusers WanPipeline's transformer, on video latents [N, C, F, H, W]."""

    frozen_names = ("vae", "text_encoder")
    t5_name = "text_encoder"
    is_video = True
    # DanceGRPO's Wan2.1 script, whose recipe configs/wan21_t2v_14b_hps.yaml follows, trains the full model
    # (XueZeyue/DanceGRPO 15cc71d fastvideo/train_grpo_wan_2_1.py: no LoRA); the default is Flow-Factory's Wan2.1 T2V
    # LoRA (X-GenGroup/Flow-Factory a0b2bc5 src/flow_factory/models/wan/wan2_t2v.py:74-85): self- and
    # cross-attention projections and the feed-forward
    lora_targets = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")

    def __init__(self, pipe, max_sequence_length: int = PROMPT_TOKENS, latent_size: int | None = None,
                 num_frames: int = 81):
        switch = expert_switch(pipe)  # None: one transformer (Wan2.1, Wan2.2 TI2V-5B)
        super().__init__(pipe, max_sequence_length)
        self.expert_switch = switch
        if switch is not None:  # Wan2.2 A14B: both experts behind one call (module docstring)
            self.transformer = WanExperts(pipe.transformer, pipe.transformer_2, switch)
        t, s = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        if (num_frames - 1) % t:
            raise ValueError(f"model.num_frames {num_frames} must be 1 + a multiple of the VAE's temporal factor {t}")
        p = self.transformer.config.patch_size
        latent_size = int(latent_size or 480 // s)  # Wan2.1's 480 px class
        if latent_size % p[1]:
            raise ValueError(f"Wan latent size must be a multiple of the patch {p[1]}, got {latent_size}")
        self.vae_scale_factor = s
        self.num_frames = num_frames
        self.latent_shape = (self.transformer.config.in_channels, (num_frames - 1) // t + 1, latent_size, latent_size)
        self.image_size = latent_size * s
        self.patch_size = p[1]
        self._latent_stats: dict = {}

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | dict = torch.float32, *, max_sequence_length: int | None = None,
                        resolution: int | None = None, num_frames: int = 81,
                        local_files_only: bool = True) -> "WanVelocity":
        """Load a saved WanPipeline directory (offline by default); `dtype` as SD3Velocity.from_pretrained's."""
        from diffusers import WanPipeline

        pipe = load_pipeline(WanPipeline, path, dtype, local_files_only=local_files_only)
        f, patch = pipe.vae_scale_factor_spatial, (pipe.transformer or pipe.transformer_2).config.patch_size[1]
        if resolution is not None and resolution % (f * patch):
            raise ValueError(f"model.resolution {resolution} must be a multiple of {f * patch} (VAE factor {f} x "
                             f"patch {patch})")
        latent_size = resolution // f if resolution is not None else None
        return cls(pipe, max_sequence_length=max_sequence_length or PROMPT_TOKENS, latent_size=latent_size,
                   num_frames=num_frames)

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """float32 [num_steps + 1]: the sigmas the pipeline's own scheduler class sets for num_steps, trailing 0."""
        sched = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        sched.set_timesteps(num_steps)
        sigmas = sched.sigmas.float().cpu()
        return sigmas if len(sigmas) == num_steps + 1 else torch.cat([sigmas[:num_steps], sigmas.new_zeros(1)])

    # ------------------------------------------------------------------ the VelocityModel interface
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """UMT5 embeddings [B, max_sequence_length, text_dim] in the transformer's dtype ("" unconditional)."""
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        return embeds.to(self.dtype).detach()

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """Velocity v = e - d at video latents x [N, C, F, H, W], sigma [N] in [0, 1]; returned in x's dtype."""
        return wan_velocity(self.transformer, x, sigma, cond, self.num_train_timesteps)

    # ------------------------------------------------------------------ exports of the two experts
    def save_lora(self, out_dir, state: dict | None = None) -> Path:
        """One expert: diffusers' LoRA file in out_dir. Two: the high-noise expert's there and the low-noise one's in
        out_dir/transformer_2 (load it with load_lora_weights(..., load_into_transformer_2=True))."""
        if self.expert_switch is None:
            return super().save_lora(out_dir, state)
        from .lora import save_lora

        parts = split_state(state) if state is not None else {"high": None, "low": None}
        save_lora(self.transformer.high, out_dir, pipeline_cls=type(self.pipe), state=parts["high"])
        save_lora(self.transformer.low, Path(out_dir) / "transformer_2", pipeline_cls=type(self.pipe),
                  state=parts["low"])
        return Path(out_dir)

    def save_full(self, out_dir, state: dict | None = None) -> Path:
        """One expert: its transformer directory. Two: the high-noise expert's in out_dir, the low-noise one's in
        out_dir/transformer_2 (each a WanTransformer3DModel directory)."""
        if self.expert_switch is None:
            return super().save_full(out_dir, state)
        parts = split_state(state) if state is not None else {"high": None, "low": None}
        for name, sub in (("high", Path(out_dir)), ("low", Path(out_dir) / "transformer_2")):
            super(WanVelocity, self.with_transformer(getattr(self.transformer, name))).save_full(sub, parts[name])
        return Path(out_dir)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [N, C, F, H, W] -> float32 frames [N, 3, F', H', W'] in [0, 1], as WanPipeline decodes."""
        vae = self.frozen["vae"]
        mean, std = latent_stats(vae, x.device, self._latent_stats)
        video = vae.decode(x.to(vae.dtype) * std + mean, return_dict=False)[0]
        return ((video.float() + 1) / 2).clamp(0, 1)


def wan_velocity(transformer, x: torch.Tensor, sigma, cond, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The Wan velocity of a diffusers WanTransformer3DModel at latents x [N, C, F, H, W]: timestep = sigma x the
    scheduler's num_train_timesteps (the pipeline's `t`), the prompt embeddings; in x's dtype."""
    dtype = next(transformer.parameters()).dtype
    out = transformer(hidden_states=x.to(dtype), timestep=row_sigmas(sigma, x).float() * num_train_timesteps,
                      encoder_hidden_states=cond.to(dtype), return_dict=False)[0]
    return out.to(x.dtype)


# ------------------------------------------------------------------ the family record (models/registry.py)
def _build(cfg, path, dtypes):
    # the VAE float32 (diffusers' Wan example, pipeline_wan.py:56); transformer_2 in the transformer's dtype (both are
    # the policy: float32 masters, or a LoRA's 16-bit frozen base)
    dtypes = dict(dtypes, vae=torch.float32, transformer_2=dtypes.get("transformer", dtypes.get("default")))
    try:
        return WanVelocity.from_pretrained(path, dtypes, resolution=cfg.resolution, num_frames=cfg.num_frames or 81,
                                           max_sequence_length=cfg.max_sequence_length)
    except ExpertsError as err:  # the pipeline's experts cannot be trained as they are: one line naming the key
        raise ConfigError(f"config key 'model.pretrained': {err}") from None


def _geometry(cfg, tc, vae, tokens, prompt):
    """Video latents [C, F, H, W] (estimate/memory.py): the VAE's 8x spatial and 4x temporal factors, (1, 2, 2)
    patches, every latent frame's tokens in a pass; the transformer cross-attends to the padded UMT5 prompt (480 px,
    81 frames unless set)."""
    scale, nf = vae.get("scale_factor_spatial", 8), cfg.model.num_frames or 81
    side = (cfg.model.resolution or 480) // scale
    latent = (tc["in_channels"], (nf - 1) // vae.get("scale_factor_temporal", 4) + 1, side, side)
    return {"scale": scale, "side": side, "latent": latent, "patch": 2, "text": tokens["t5"],
            "cond_row": tokens["t5"] * tc["text_dim"], "images_per_pass": latent[1]}


def _inputs(cfg, n, h, w, t, r, u, device, frames):
    """Video latents [N, C, F, H, W] patchified (1, 2, 2) inside, timestep 1000 sigma (estimate/measure.py)."""
    _, ph, pw = cfg["patch_size"]
    return dict(hidden_states=r(n, cfg["in_channels"], frames, h * ph, w * pw), timestep=u(n) * 1000,
                encoder_hidden_states=r(n, t, cfg["text_dim"]), return_dict=False)


def _check(cfg, path) -> tuple[str, str] | None:
    """model.num_frames and model.resolution against the pipeline's VAE factors and patch (read from its configs, as
    WanPipeline sets them: pipeline_wan.py's vae_scale_factor_temporal / _spatial), before anything loads."""
    import json

    if not (Path(path) / "vae" / "config.json").is_file():  # not a whole pipeline: its load says what is missing
        return None
    vae = json.loads((Path(path) / "vae" / "config.json").read_text())
    t, f = vae.get("scale_factor_temporal", 4), vae.get("scale_factor_spatial", 8)
    tdir = Path(path) / ("transformer" if (Path(path) / "transformer" / "config.json").is_file() else "transformer_2")
    tc = json.loads((tdir / "config.json").read_text()) if tdir.is_dir() else {}
    patch, rope = tc.get("patch_size", [1, 2, 2])[1], tc.get("rope_max_seq_len", 1024)
    if cfg.num_frames is not None and (cfg.num_frames - 1) % t:
        return "model.num_frames", f"{cfg.num_frames} must be 1 + a multiple of the VAE's temporal factor {t}"
    if cfg.resolution is not None and cfg.resolution % (f * patch):
        return "model.resolution", f"{cfg.resolution} must be a multiple of {f * patch} (VAE {f} x patch {patch})"
    side = (cfg.resolution or 480) // (f * patch)  # the adapter's square side: 480 px unset (WanVelocity)
    frames = ((cfg.num_frames or 81) - 1) // t + 1
    for key, n, what in (("model.resolution", side, "a side"), ("model.num_frames", frames, "latent frames")):
        if n > rope:  # its rotary table has rope_max_seq_len positions an axis (WanRotaryPosEmbed)
            return key, f"makes {n} patches for {what}, over the transformer's rope_max_seq_len {rope}"
    return token_problem(frames * side * side)


def _blocks(cfg, side):
    """One kind of block: self-attention, cross-attention to the prompt, FFN (estimate/measure.py)."""
    return ["block"] * cfg["num_layers"], dict(cfg, num_layers=1)


FAMILY = register(Family(
    name="wan", velocity=WanVelocity, build=_build, pipeline="WanPipeline", transformer="WanTransformer3DModel",
    text="t5", prompt_tokens=PROMPT_TOKENS, prompt_limit=PROMPT_TOKENS, video=True, keys=frozenset({"num_frames"}),
    checkpoints={"wan2.1-t2v-14b": "wan21_t2v_14b", "wan2.2-t2v-a14b": "wan22_t2v_a14b"}, geometry=_geometry,
    inputs=_inputs, blocks=_blocks, tiny="build_tiny_wan", check=_check, extra={"vae_float32": True}))
