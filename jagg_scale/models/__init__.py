"""Velocity models behind one interface (base.py): v = model(x, sigma, cond), encode_prompts, decode.

    dit.py                the built-in DiT (one readable file), with its hash tokenizer (tokenizer.py)
    sd3.py, flux.py       diffusers SD3/SD3.5 and FLUX.1 pipelines as velocity models (diffusers_common.py)
    lora.py               peft LoRA on the diffusers transformers; adapter off is the KL reference

`build_model(cfg.model)` is the one way the trainer and jagg-eval make a model.
"""

from __future__ import annotations

from ..paths import resolve_path
from .base import VelocityModel
from .dit import DiT, DiTConfig
from .tokenizer import HashTokenizer


def build_model(cfg) -> VelocityModel:
    """A velocity model from the `model` config section (train.config.ModelConfig)."""
    if cfg.kind in ("sd3", "flux"):
        return _build_diffusers(cfg)
    if cfg.kind != "dit":
        raise ValueError(f"model.kind {cfg.kind!r} is not supported")
    model = DiT(cfg.dit)
    if cfg.pretrained:
        load_pretrained(model, cfg.pretrained)
    else:
        # GRPO needs a policy that already draws something; with no weights given we start from a random
        # (not zero-output) DiT so velocities, and therefore rewards, vary between samples from step 0.
        model.init_weights(zero_out=False)
    return model


def _build_diffusers(cfg) -> VelocityModel:
    """SD3 / FLUX from a local pipeline directory, with the config's LoRA, checkpointing and attention options.
    The transformer stays float32 (master weights; bf16 is autocast); with model.dtype bfloat16 the frozen VAE
    and text encoders are stored in bf16, which halves their memory and never feeds a gradient."""
    import torch

    path = resolve_path(cfg.pretrained)
    if cfg.kind == "sd3":
        from .sd3 import SD3Velocity  # diffusers is an optional extra: import it only when asked for

        model = SD3Velocity.from_pretrained(path, resolution=cfg.resolution)
        model.set_attention_backend(cfg.attention)  # raises early when xformers is asked for without CUDA/xformers
    else:
        from .flux import FluxVelocity

        model = FluxVelocity.from_pretrained(path, resolution=cfg.resolution, guidance_scale=cfg.distilled_guidance)
    if cfg.dtype == "bfloat16":
        for module in model.frozen.values():
            module.to(torch.bfloat16)
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    if cfg.lora.enabled:
        kwargs = {"targets": tuple(cfg.lora.targets)} if cfg.lora.targets else {}
        model.add_lora(rank=cfg.lora.rank, alpha=cfg.lora.alpha, **kwargs)
    return model


def load_pretrained(model: VelocityModel, path: str) -> None:
    """Load a safetensors state dict, naming the file and the mismatching keys on failure."""
    from safetensors.torch import load_file

    p = resolve_path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model.pretrained: no such file {p}")
    state = load_file(str(p))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"model.pretrained {p} does not fit the configured model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


__all__ = ["VelocityModel", "DiT", "DiTConfig",
           "HashTokenizer", "build_model", "load_pretrained"]
