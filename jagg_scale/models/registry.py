"""Model families by name (`model.kind`): one `Family` record each, declared in its own module (models/<module>.py
ends with `FAMILY = register(Family(...))`) and read by everything that depends on the family:

    build_model (models/__init__.py)      family.build(cfg, path, dtypes): the adapter, from a pipeline directory
    the config (train/config_sections.py) the known kinds, the prompt-token limit, the family-only keys
    the estimator (estimate/)             frozen components, text encoder, shape file, latent geometry, and the
                                          transformer's forward arguments for the measurement and the FLOP count
    sequence parallelism (parallel/)      the context-parallel plan, where diffusers has none
    tests and smoke runs                  family.tiny: a tiny random pipeline built locally (models/tiny.py)

Adding a family is its module (with its record) plus its name in MODULES, a config and tests. An unknown kind is
refused naming the known ones (`family`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Family", "MAX_TOKENS", "MODULES", "families", "family", "family_of_transformer", "register"]

# the most latent tokens a row may have (a family's `check` refuses more, train/config_bounds.py the DiT's): Wan2.1 at
# 720p x 81 frames has 75,600, FLUX.1 at 2048 px 16,384; past this a row's attention is a typo's or an attack's
MAX_TOKENS = 1 << 18

# the modules that declare a family, in registration order: where two families share a transformer class
# (FLUX.1 and Kontext, Qwen-Image and Qwen-Image-Edit) the first one's inputs measure it (family_of_transformer)
MODULES = ("dit", "sd3", "flux", "kontext", "flux2", "qwenimage", "qwenimage_edit", "zimage", "wan")
_FAMILIES: dict[str, "Family"] = {}
_loaded = False


@dataclass(frozen=True)
class Family:
    """Everything the rest of the package needs to know about one model family."""

    name: str  # model.kind
    velocity: type  # the VelocityModel class (its guidance_rule / negative_prompt: the CFG rule)
    # the adapter from a pipeline directory: build(model config, path, {component: dtype}) -> VelocityModel; None for
    # a family that is not a diffusers pipeline (the built-in DiT builds itself in models/__init__.py)
    build: Callable[[Any, Any, dict], Any] | None = None
    pipeline: str | None = None  # the diffusers pipeline class its directories hold
    transformer: str | None = None  # the diffusers transformer class (what the estimator and sequence parallelism see)
    # the text encoder's layout: clip_t5 (CLIP + T5, model.max_sequence_length the T5 tokens), t5 (UMT5 alone), qwen
    # (a Qwen LM run with its K/V cache, every hidden state kept), qwen_lm (a causal Qwen LM, use_cache off, the
    # logits of the last token only)
    text: str = ""
    prompt_tokens: int = 0  # model.max_sequence_length's default: the pipeline's own
    prompt_limit: int = 0  # the most model.max_sequence_length may be
    video: bool = False  # decodes to frames [N, 3, F, H, W]: scored by the video rewards
    keys: frozenset = frozenset()  # model.* keys only this family (and others listing them) takes
    # the estimator: the latent geometry geometry(cfg, transformer config, vae config, text tokens, prompt tokens) ->
    # dict (estimate/memory.py reads it), the transformer's forward arguments inputs(config, n, h, w, t, r, u, device,
    # frames) -> dict (r, u: its random tensors; measurement and FLOPs, estimate/measure.py model_inputs), and its block
    # layout blocks(config, side) -> (block types in forward order, the config with one block of each)
    checkpoints: dict = field(default_factory=dict)  # {checkpoint name (lower case) found in a path: shapes file}
    geometry: Callable[..., dict] | None = None
    inputs: Callable[..., dict] | None = None
    blocks: Callable[[dict, int], tuple[list[str], dict]] | None = None
    # sequence parallelism: None, the transformer's own _cp_plan in diffusers (refused when it has none); else
    # context_parallel(transformer) -> plan, which may also swap the attention processors (SD3's, parallel/sequence.py)
    context_parallel: Callable[[Any], dict] | None = None
    tiny: str | None = None  # its tiny random pipeline's builder in models/tiny.py (tests, smoke runs): build_tiny_*
    # check(model config, pipeline directory) -> a problem (config key, why) or None: the family's shape rules read
    # from the pipeline's configs at config time, before anything loads (train/config.py _check_files)
    check: Callable[[Any, Any], tuple[str, str] | None] | None = None
    extra: dict = field(default_factory=dict)  # anything else one family's own code reads

    @property
    def frozen(self) -> tuple[str, ...]:
        """Frozen components (the adapter's): the VAE first, the large text encoder (model.shard_text_encoder) last."""
        return tuple(getattr(self.velocity, "frozen_names", ()))

    @property
    def is_pipeline(self) -> bool:
        return self.pipeline is not None

    @property
    def cfg_rule(self) -> str:
        """How a (conditional, unconditional) pair combines under CFG (grpo/guidance.py)."""
        return self.velocity.guidance_rule


def register(fam: Family) -> Family:
    """Add a family under its name (a second one of the same name is refused)."""
    if fam.name in _FAMILIES and _FAMILIES[fam.name] is not fam:
        raise ValueError(f"model family {fam.name!r} is registered twice")
    _FAMILIES[fam.name] = fam
    return fam


def families() -> dict[str, Family]:
    """{kind: Family} of every registered family (their modules imported on first use), in MODULES' order whatever
    order they were imported in (a family registered from elsewhere, a test's, after them)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in MODULES:
            importlib.import_module(f".{module}", __package__)
    rank = {f"{__package__}.{m}": i for i, m in enumerate(MODULES)}
    order = sorted(_FAMILIES.values(), key=lambda f: rank.get(f.velocity.__module__, len(MODULES)))
    return {f.name: f for f in order}


def family(kind: str, key: str = "model.kind") -> Family:
    """The family of `kind`, or a ConfigError naming the key and the known kinds."""
    fams = families()
    if kind not in fams:
        from ..sections import ConfigError

        raise ConfigError(f"config key '{key}': unknown model family {kind!r}; known: {', '.join(fams)}")
    return fams[kind]


def family_of_transformer(cls_name: str) -> Family | None:
    """The first registered family whose transformer is the diffusers class `cls_name` (None: no family's)."""
    return next((f for f in families().values() if f.transformer == cls_name), None)
