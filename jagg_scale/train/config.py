"""Typed run configuration: YAML -> dataclasses, with dotted command-line overrides.

Everything is validated before any work starts: an unknown key, a value of the wrong type or out of range
fails with a ConfigError naming the dotted key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ..models.dit import DiTConfig
from ..parallel.build import BACKENDS
from ..parallel.engine import EngineSpec
from ..paths import resolve_path


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


@dataclass
class LoRAConfig:
    enabled: bool = False
    rank: int = 32  # Flow-GRPO: r 32, alpha 64
    alpha: float = 64.0
    targets: list = field(default_factory=list)  # empty: the backbone's defaults (attention q/k/v/out + add_*)


@dataclass
class ModelConfig:
    kind: str = "dit"  # dit (built-in) | sd3 | flux (a diffusers StableDiffusion3Pipeline / FluxPipeline directory)
    pretrained: Optional[str] = None  # dit: a safetensors state dict; sd3/flux: the pipeline directory (required)
    dtype: str = "float32"  # float32 | bfloat16 (autocast for the model; SDE math stays float32)
    dit: DiTConfig = field(default_factory=DiTConfig)  # shape of the built-in DiT
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # sd3/flux: train a LoRA adapter instead of all weights
    gradient_checkpointing: bool = False  # sd3/flux: diffusers' per-block activation checkpointing
    attention: str = "sdpa"  # sdpa | xformers (sd3; CUDA with xformers installed only)
    resolution: Optional[int] = None  # sd3/flux: image size in pixels; None = the checkpoint's native size
    distilled_guidance: float = 3.5  # flux: the guidance-embedding value FLUX.1-dev was distilled with (not CFG)


@dataclass
class SamplingConfig:
    num_steps: int = 10
    noise_level: float = 0.7
    guidance: float = 1.0  # classifier-free guidance scale; 1.0 disables CFG
    shift: Optional[float] = 3.0  # SD3's time shift; null = the loaded pipeline's own schedule (sd3/flux)
    batch_size: int = 16  # rollout rows per forward
    eval_num_steps: int = 20
    # SDE window (Flow-GRPO-Fast / MixGRPO): only `sde_window` consecutive steps are sampled with the SDE and
    # trained, the others run the ODE; 0 = every step is SDE (Flow-GRPO). The window's start is drawn per step
    # in [lo, hi - sde_window] (sde_window_range, default the whole trajectory): `random` (Flow-GRPO-Fast) or
    # `sliding` (MixGRPO: moves one step every sde_window_every training steps, wrapping around).
    sde_window: int = 0
    sde_window_range: list = field(default_factory=list)
    sde_window_mode: str = "random"
    sde_window_every: int = 1


@dataclass
class GRPOConfig:
    group_size: int = 4
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    beta: float = 0.0  # KL weight; 0 skips the reference model entirely
    timestep_fraction: float = 1.0
    inner_epochs: int = 1
    global_std: bool = False


@dataclass
class JAGGConfig:
    mode: str = "jagg"  # jagg | exact (Flow-GRPO's per-step backward)
    window: int = 4
    jagg_frac: float = 1.0
    min_cos: Optional[float] = None
    route_by: str = "vcos"  # vcos | weighted
    intermediate: str = "auto"  # auto | cached | interpolate | forward
    probe_every: int = 0  # every N steps log the exact-vs-JAGG gradient cosine (extra passes); 0 = off
    # knot plans (jagg/knots.py): `budget` places the exactly-computed steps where the error model says JAGG's
    # interpolation would cost most, with at most trained_steps / speedup with-grad rows per sample
    plan: str = "uniform"  # uniform (windows of `window`, jagg_frac routing) | budget (the DP planner)
    speedup: float = 2.0  # budget: transformer rows per sample <= trained steps / speedup
    share_knots: bool = False  # uniform: adjacent windows share their boundary knot (fewer rows, longer spans)
    rows_per_pass: int = 2  # knot plans: knots per joint forward+backward (2 = the paper's joint endpoint pass)
    error_model: str = "residual"  # budget: residual (velocity interpolation residual) | cosine


@dataclass
class TrainConfig:
    steps: int = 20
    prompts_per_step: int = 4
    batch_size: int = 8  # samples per optimizer step
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: list = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    ema_decay: float = 0.0  # > 0: EMA of the trainable weights (per optimizer step), used for eval and export


@dataclass
class DataConfig:
    source: str = "list"  # list: prompt_file / prompts in memory | wds: webdataset shards streamed per rank
    prompt_file: Optional[str] = None  # .txt or .jsonl; when unset, `prompts` is used
    prompts: list = field(default_factory=list)
    shards: Optional[str] = None  # wds: brace pattern of tar shards (tools/make_prompt_shards.py)
    num_workers: int = 0  # wds: DataLoader workers per rank


@dataclass
class RewardConfig:
    name: str = "jpeg_compressibility"  # one reward (jagg_scale.rewards.available())
    options: dict = field(default_factory=dict)
    components: dict = field(default_factory=dict)  # several: {name: {weight: w, option: value, ...}}; replaces name
    aggregate: str = "sum"  # sum: GRPO on sum_c w_c r_c | advantage: sum_c w_c A_c (MixGRPO)
    max_fail_frac: float = 0.25  # per reward: a larger failed fraction of a batch stops the run
    background: bool = True  # decode + score rollout chunks in a worker thread while the next chunk samples
    shard: bool = False  # split reward-model weights across ranks (FSDP2, inference); each rank scores its images


@dataclass
class LogConfig:
    progress: bool = True
    wandb: bool = False
    wandb_mode: str = "offline"
    wandb_project: str = "jagg-scale"


@dataclass
class EvalConfig:
    enabled: bool = False
    prompt_file: Optional[str] = None  # held-out prompts (.txt / .jsonl); when unset, `prompts`
    prompts: list = field(default_factory=list)
    num_per_prompt: int = 2
    every: int = 0  # also evaluate every N steps; 0: only before and after training
    seed: int = 1234  # eval noise is fixed by this seed, so every evaluation sees the same starting noise
    batch_size: int = 32


@dataclass
class ParallelConfig:
    backend: str = "none"  # none (one process) | fsdp2 | deepspeed
    reshard_after_forward: bool = True  # fsdp2: free gathered params after forward (gather again in backward)
    activation_checkpointing: bool = False  # fsdp2/deepspeed: recompute each transformer block in backward
    prefetch: bool = True  # fsdp2: gather block i+1 (forward) / i-1 (backward) while block i computes
    replicate: int = 1  # fsdp2 HSDP: replica groups x shards (e.g. nodes x GPUs per node); 1 = plain FSDP
    deepspeed: dict = field(default_factory=dict)  # deepspeed: merged over the built-in ZeRO-3 config


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    seed: int = 0
    resume: str = "none"  # none | auto | path to a checkpoint directory
    checkpoint_every: int = 10
    keep_last: int = 2
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    jagg: JAGGConfig = field(default_factory=JAGGConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------------------
# building dataclasses from plain dicts, with type checks
# --------------------------------------------------------------------------------------------------------------

def _check_type(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(key, value, inner[0])
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp in (list, dict) or origin in (list, dict):
        base = origin or tp
        if isinstance(value, base):
            return value
    else:
        return value
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"config key '{key}' must be of type {name}, got {type(value).__name__} ({value!r})")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}' (valid keys: {', '.join(sorted(names))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name] or {}, f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = _check_type(f"{prefix}{f.name}", data[f.name], tp)
    return cls(**kwargs)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply dotted overrides, type-check and validate: the only way configs are made."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def engine_spec(cfg: Config) -> EngineSpec:
    """The slice of the run configuration a training engine needs (parallel.build.build_engine)."""
    t, p = cfg.train, cfg.parallel
    return EngineSpec(backend=p.backend, lr=t.lr, weight_decay=t.weight_decay, adam_betas=tuple(t.adam_betas),
                      adam_eps=t.adam_eps, grad_clip=t.grad_clip, ema_decay=t.ema_decay,
                      bf16=cfg.model.dtype == "bfloat16", frozen_base=cfg.model.lora.enabled,
                      activation_checkpointing=p.activation_checkpointing,
                      reshard_after_forward=p.reshard_after_forward, prefetch=p.prefetch, replicate=p.replicate,
                      deepspeed=dict(p.deepspeed or {}))


def config_from_dict(data: dict) -> Config:
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {msg}")


def validate(cfg: Config) -> None:
    """Range and consistency checks, each naming the offending key."""
    _require(cfg.model.kind in ("dit", "sd3", "flux"), "model.kind", f"must be dit, sd3 or flux, got {cfg.model.kind!r}")
    _require(cfg.model.kind == "dit" or bool(cfg.model.pretrained), "model.pretrained",
             f"must name the diffusers pipeline directory when model.kind is {cfg.model.kind}")
    _require(cfg.model.dtype in ("float32", "bfloat16"), "model.dtype", f"must be float32 or bfloat16, got {cfg.model.dtype!r}")
    m = cfg.model
    _require(not m.lora.enabled or m.kind != "dit", "model.lora.enabled", "is supported for model.kind sd3 and flux, not dit")
    _require(m.resolution is None or m.kind != "dit", "model.resolution", "is for sd3/flux; the dit's size is model.dit.image_size")
    _require(m.resolution is None or m.resolution >= 16, "model.resolution", f"must be >= 16 pixels, got {m.resolution}")
    _require(m.distilled_guidance > 0, "model.distilled_guidance", "must be > 0")
    _require(not m.gradient_checkpointing or m.kind != "dit", "model.gradient_checkpointing",
             "is supported for the diffusers backbones (sd3, flux), not the built-in dit")
    _require(m.attention == "sdpa" or m.kind == "sd3", "model.attention", "xformers is wired for sd3 only")
    _require(m.attention in ("sdpa", "xformers"), "model.attention", f"must be sdpa or xformers, got {m.attention!r}")
    _require(m.lora.rank >= 1, "model.lora.rank", "must be >= 1")
    _require(m.lora.alpha > 0, "model.lora.alpha", "must be > 0")
    d = cfg.model.dit
    for key in ("image_size", "in_channels", "patch_size", "hidden_size", "depth", "num_heads", "vocab_size",
                "max_prompt_length"):
        _require(getattr(d, key) >= 1, f"model.dit.{key}", "must be >= 1")
    _require(d.image_size % d.patch_size == 0, "model.dit.patch_size", "must divide model.dit.image_size")
    _require(d.hidden_size % d.num_heads == 0, "model.dit.num_heads", "must divide model.dit.hidden_size")
    s = cfg.sampling
    _require(s.num_steps >= 1, "sampling.num_steps", f"must be >= 1, got {s.num_steps}")
    _require(s.eval_num_steps >= 1, "sampling.eval_num_steps", "must be >= 1")
    _require(s.noise_level > 0, "sampling.noise_level", f"must be > 0, got {s.noise_level}")
    _require(s.guidance >= 1.0, "sampling.guidance", f"must be >= 1 (1 disables CFG), got {s.guidance}")
    _require(s.shift is None or s.shift > 0, "sampling.shift", f"must be > 0, got {s.shift}")
    _require(s.shift is not None or cfg.model.kind != "dit", "sampling.shift",
             "null (the pipeline's own schedule) needs model.kind sd3 or flux")
    _require(s.batch_size >= 1, "sampling.batch_size", "must be >= 1")
    _require(0 <= s.sde_window <= s.num_steps, "sampling.sde_window", f"must be in [0, num_steps], got {s.sde_window}")
    rng = s.sde_window_range or [0, s.num_steps]
    _require(len(rng) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in rng)
             and 0 <= rng[0] < rng[1] <= s.num_steps and rng[1] - rng[0] >= s.sde_window, "sampling.sde_window_range",
             f"must be [lo, hi] with 0 <= lo < hi <= num_steps and hi - lo >= sde_window, got {s.sde_window_range}")
    _require(s.sde_window_mode in ("random", "sliding"), "sampling.sde_window_mode",
             f"must be random or sliding, got {s.sde_window_mode!r}")
    _require(s.sde_window_every >= 1, "sampling.sde_window_every", "must be >= 1")
    _require(s.sde_window == 0 or cfg.grpo.timestep_fraction == 1.0, "grpo.timestep_fraction",
             "must be 1.0 with sampling.sde_window (the window decides which steps are trained)")
    g = cfg.grpo
    _require(g.group_size >= 2, "grpo.group_size", f"must be >= 2 for group-relative advantages, got {g.group_size}")
    _require(g.clip_range > 0, "grpo.clip_range", "must be > 0")
    _require(g.adv_clip_max > 0, "grpo.adv_clip_max", "must be > 0")
    _require(g.beta >= 0, "grpo.beta", "must be >= 0")
    _require(0 < g.timestep_fraction <= 1, "grpo.timestep_fraction", f"must be in (0, 1], got {g.timestep_fraction}")
    _require(g.inner_epochs >= 1, "grpo.inner_epochs", "must be >= 1")
    j = cfg.jagg
    _require(j.mode in ("jagg", "exact"), "jagg.mode", f"must be 'jagg' or 'exact', got {j.mode!r}")
    _require(j.window >= 1, "jagg.window", f"must be >= 1, got {j.window}")
    _require(0.0 <= j.jagg_frac <= 1.0, "jagg.jagg_frac", f"must be in [0, 1], got {j.jagg_frac}")
    _require(j.min_cos is None or -1.0 <= j.min_cos <= 1.0, "jagg.min_cos", "must be in [-1, 1]")
    _require(j.route_by in ("vcos", "weighted"), "jagg.route_by", f"must be 'vcos' or 'weighted', got {j.route_by!r}")
    _require(j.intermediate in ("auto", "cached", "interpolate", "forward"), "jagg.intermediate",
             f"must be auto, cached, interpolate or forward, got {j.intermediate!r}")
    _require(j.probe_every >= 0, "jagg.probe_every", "must be >= 0 (0 disables the probe)")
    _require(j.plan in ("uniform", "budget"), "jagg.plan", f"must be uniform or budget, got {j.plan!r}")
    _require(j.speedup >= 1.0, "jagg.speedup", f"must be >= 1, got {j.speedup}")
    _require(j.rows_per_pass >= 1, "jagg.rows_per_pass", "must be >= 1")
    _require(j.error_model in ("residual", "cosine"), "jagg.error_model", f"must be residual or cosine, got {j.error_model!r}")
    _require(not (j.plan == "budget" and j.jagg_frac != 1.0), "jagg.jagg_frac",
             "routes uniform windows; with jagg.plan budget the planner decides (leave jagg_frac at 1.0)")
    t = cfg.train
    _require(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
    _require(t.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
    _require(t.batch_size >= 1, "train.batch_size", "must be >= 1")
    _require((t.prompts_per_step * g.group_size) % t.batch_size == 0, "train.batch_size",
             f"must divide train.prompts_per_step * grpo.group_size = {t.prompts_per_step * g.group_size}")
    _require(t.lr > 0, "train.lr", "must be > 0")
    _require(len(t.adam_betas) == 2 and all(0 <= b < 1 for b in t.adam_betas), "train.adam_betas",
             "must be two numbers in [0, 1)")
    _require(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    _require(0.0 <= t.ema_decay < 1.0, "train.ema_decay", f"must be in [0, 1), got {t.ema_decay}")
    _require(cfg.data.source in ("list", "wds"), "data.source", f"must be list or wds, got {cfg.data.source!r}")
    _require(cfg.data.source != "list" or bool(cfg.data.prompt_file) or len(cfg.data.prompts) > 0,
             "data.prompt_file", "is required when data.prompts is empty")
    _require(cfg.data.source != "wds" or bool(cfg.data.shards), "data.shards", "is required when data.source is wds")
    _require(cfg.data.num_workers >= 0, "data.num_workers", "must be >= 0")
    _require(all(isinstance(p, str) for p in cfg.data.prompts), "data.prompts", "must be a list of strings")
    _require(0.0 <= cfg.reward.max_fail_frac <= 1.0, "reward.max_fail_frac", "must be in [0, 1]")
    _require(cfg.reward.aggregate in ("sum", "advantage"), "reward.aggregate",
             f"must be sum or advantage, got {cfg.reward.aggregate!r}")
    for name, spec in cfg.reward.components.items():
        _require(isinstance(spec, dict) or spec is None, f"reward.components.{name}",
                 "must be a mapping of options (with an optional weight)")
        weight = (spec or {}).get("weight", 1.0)
        _require(isinstance(weight, (int, float)) and not isinstance(weight, bool), f"reward.components.{name}.weight",
                 f"must be a number, got {weight!r}")
    _require(cfg.log.wandb_mode in ("offline", "online", "disabled"), "log.wandb_mode", "must be offline, online or disabled")
    e = cfg.eval
    _require(not e.enabled or bool(e.prompt_file) or len(e.prompts) > 0, "eval.prompt_file",
             "is required when eval.enabled and eval.prompts is empty")
    _require(e.num_per_prompt >= 1, "eval.num_per_prompt", "must be >= 1")
    _require(e.every >= 0, "eval.every", "must be >= 0")
    _require(e.batch_size >= 1, "eval.batch_size", "must be >= 1")
    for key, value in (("data.prompt_file", cfg.data.prompt_file),
                       ("eval.prompt_file", cfg.eval.prompt_file if e.enabled else None),
                       ("model.pretrained", cfg.model.pretrained if cfg.model.kind == "dit" else None)):
        _require(value is None or resolve_path(value).is_file(), key, f"names a file that does not exist: {value}")
    if cfg.model.kind != "dit" and cfg.model.pretrained:
        _require((resolve_path(cfg.model.pretrained) / "model_index.json").is_file(), "model.pretrained",
                 f"is not a diffusers pipeline directory (no model_index.json): {cfg.model.pretrained}")
    p = cfg.parallel
    _require(p.backend in BACKENDS, "parallel.backend", f"must be one of {', '.join(BACKENDS)}, got {p.backend!r}")
    _require(p.replicate >= 1, "parallel.replicate", "must be >= 1")
    r = cfg.run
    _require(r.checkpoint_every >= 0, "run.checkpoint_every", "must be >= 0 (0: only at the end)")
    _require(r.keep_last >= 1, "run.keep_last", "must be >= 1")
    _require(r.device in ("auto", "cpu", "cuda"), "run.device", f"must be auto, cpu or cuda, got {r.device!r}")
    _require(r.threads >= 0, "run.threads", "must be >= 0")
