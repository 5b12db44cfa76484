"""Velocity models: the interface (base.py) and the built-in DiT (dit.py)."""

from __future__ import annotations

from ..paths import resolve_path
from .base import Cond, VelocityModel, cat_cond, index_cond, map_cond, repeat_cond
from .dit import DiT, DiTConfig
from .tokenizer import HashTokenizer


def build_model(cfg) -> VelocityModel:
    """A velocity model from the `model` config section (train.config.ModelConfig)."""
    if cfg.kind == "sd3":
        from .sd3 import SD3Velocity  # diffusers is an optional extra: import it only when asked for

        model = SD3Velocity.from_pretrained(resolve_path(cfg.pretrained))
        model.set_attention_backend(cfg.attention)  # raises early when xformers is asked for without CUDA/xformers
        if cfg.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        if cfg.lora.enabled:
            kwargs = {"targets": tuple(cfg.lora.targets)} if cfg.lora.targets else {}
            model.add_lora(rank=cfg.lora.rank, alpha=cfg.lora.alpha, **kwargs)
        return model
    if cfg.kind == "flux":
        from .flux import FluxVelocity

        model = FluxVelocity.from_pretrained(resolve_path(cfg.pretrained))
        if cfg.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        return model
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


__all__ = ["Cond", "VelocityModel", "cat_cond", "index_cond", "map_cond", "repeat_cond", "DiT", "DiTConfig",
           "HashTokenizer", "build_model", "load_pretrained"]
