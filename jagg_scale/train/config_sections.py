"""The sections of the run configuration: one dataclass each, its typed choices and its own range checks.

Choices are `Literal` types with one source each: the config's own concepts are defined here, the others where the
concept lives (imported below); the `parallel` section is the engines' own (parallel/config.py). `config._check_type`
validates them (and every other typed field) while the config is built, so the `check` methods below hold range
checks only. Checks of several sections, and of files, are `config.validate`. Every error names the dotted key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from ..dppo.config import DPPOConfig
from ..grpo.sde import SdeKind
from ..grpo.solver import OdeSolver
from ..grpo.steps import StepSelection
from ..jagg.backward import IntermediateMode
from ..jagg.config import Intermediate, JAGGConfig, JaggMode, PlanKind
from ..jagg.knots import ErrorModel
from ..jagg.planners import RouteBy
from ..models.dit import DiTConfig
from ..models.registry import families, family
from ..awm.config import AWMConfig
from ..nft.config import NFTConfig, NFTNoise, NFTOldAt, NFTTimesteps
from ..parallel.config import ParallelConfig
from ..parallel.types import EngineName, GradSync
from ..sections import ConfigError, refuse_set, require as _require
from ..sections import Section as _Section

# autocast dtype of the model; the SDE math stays float32. float16: fp16 mixed precision with dynamic loss scaling
# (parallel/loss_scale.py), Flow-GRPO's and DiffusionNFT's mixed_precision fp16
DType = Literal["float32", "bfloat16", "float16"]
# sdpa: diffusers' own; cudnn / flash: its CUDA backends (models/diffusers_common.py set_attention_backend)
Attention = Literal["sdpa", "xformers", "cudnn", "flash"]
SdeWindowMode = Literal["random", "sliding", "scattered"]  # Flow-GRPO-Fast | MixGRPO | UniRL's sparse SDE steps
Algorithm = Literal["grpo", "nft", "dppo", "gcpo", "awm"]  # train.algorithm (its rollout: config.py ROLLOUT_KIND)
RefAt = Literal["steps", "knots"]  # grpo.ref_at, refresh_at: on every trained step, or on the plan's knots
DataSource = Literal["list", "wds"]  # prompt_file / prompts in memory | webdataset shards streamed per rank
RewardAggregate = Literal["sum", "advantage", "gdpo"]  # rewards/multi.py: GRPO on sum w r | MixGRPO's | Flow-Factory's
WandbMode = Literal["offline", "online", "disabled"]
Device = Literal["auto", "cpu", "cuda"]
TextEncoders = Literal["all", "no_t5"]  # sd3: no_t5 loads no T5 encoder (zero T5 embeddings, as diffusers does)
ExportDType = Literal["auto", "float32", "bfloat16"]  # the exported weights' dtype (run.export_dtype)
RESUME_KEYWORDS = ("none", "auto")  # run.resume: these, or the path of a checkpoint directory

__all__ = [
    "ConfigError", "DType", "Attention", "SdeWindowMode", "JaggMode", "Algorithm", "NFTTimesteps",
    "NFTNoise", "NFTOldAt", "RefAt", "PlanKind", "Intermediate", "StepSelection",
    "DataSource", "RewardAggregate", "WandbMode", "Device", "EngineName", "GradSync", "ErrorModel", "IntermediateMode",
    "RouteBy", "TextEncoders", "ExportDType", "OdeSolver", "SdeKind",
    "DiTConfig", "LoRAConfig", "ModelConfig", "SamplingConfig", "GRPOConfig", "JAGGConfig", "TrainConfig",
    "DataConfig", "RewardConfig", "LogConfig", "EvalConfig", "NFTConfig", "DPPOConfig", "AWMConfig", "ParallelConfig",
    "RunConfig",
]


@dataclass
class LoRAConfig(_Section):
    enabled: bool = False
    rank: int = 32  # Flow-GRPO: r 32, alpha 64
    alpha: float = 64.0
    # module names peft wraps (a name, or a name's ending after a dot: "attn.to_q" is not "attn2.to_q"); empty: the
    # family's default, its cited peer's list (models/lora.py lora_targets; each velocity class's lora_targets)
    targets: list[str] = field(default_factory=list)
    # the number of modules the targets must wrap on this model (the startup log prints it); any other count is
    # refused when the model is built. null: not checked (a run that wraps none is refused either way)
    expect_modules: Optional[int] = None

    def check(self, prefix: str) -> None:
        _require(self.rank >= 1, f"{prefix}.rank", "must be >= 1")
        _require(self.alpha > 0, f"{prefix}.alpha", "must be > 0")
        _require(self.expect_modules is None or self.expect_modules >= 1, f"{prefix}.expect_modules",
                 f"must be >= 1 (a LoRA that wraps no module is refused), got {self.expect_modules}")
        _require(self.expect_modules is None or self.enabled, f"{prefix}.expect_modules",
                 f"is the module count of a LoRA adapter: set {prefix}.enabled true, or leave it null")


def _check_dit(d: DiTConfig, prefix: str) -> None:
    for key in ("image_size", "in_channels", "patch_size", "hidden_size", "depth", "num_heads", "vocab_size",
                "max_prompt_length"):
        _require(getattr(d, key) >= 1, f"{prefix}.{key}", "must be >= 1")
    _require(d.hidden_size * d.mlp_ratio >= 1, f"{prefix}.mlp_ratio", "must leave the MLP >= 1 unit (hidden x it)")
    _require(d.image_size % d.patch_size == 0, f"{prefix}.patch_size", f"must divide {prefix}.image_size")
    _require(d.hidden_size % d.num_heads == 0, f"{prefix}.num_heads", f"must divide {prefix}.hidden_size")
    _require(d.hidden_size % 4 == 0, f"{prefix}.hidden_size", "must be a multiple of 4 (the 2-D sin-cos embedding)")


@dataclass
class ModelConfig(_Section):
    kind: str = "dit"  # a registered model family (models/registry.py); any other than dit: a diffusers pipeline
    pretrained: Optional[str] = None  # dit: a safetensors state dict; sd3/flux: the pipeline directory (required)
    # pretrained may be a hub id (ORG/NAME, dit: ORG/NAME/FILE) found in the local hub cache; true: fetch it when
    # it is not there (false: a missing id fails at once, naming the command that fetches it)
    allow_download: bool = False
    dtype: DType = "float32"  # autocast for the model; SDE math stays float32
    dit: DiTConfig = field(default_factory=DiTConfig)  # shape of the built-in DiT
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # sd3/flux: train a LoRA adapter instead of all weights
    attention: Attention = "sdpa"
    resolution: Optional[int] = None  # sd3/flux: image size in pixels; None = the checkpoint's native size
    # flux, flux_kontext, flux2 ([dev]): the guidance-embedding value of a guidance-distilled FLUX (not CFG); null =
    # the pipeline's default (FluxPipeline 3.5, FluxKontextPipeline 2.5, Flux2Pipeline 4.0)
    distilled_guidance: Optional[float] = None
    # sd3/flux text encoders: all, or (sd3) no_t5: the T5 encoder is not loaded, its embeddings are zeros
    text_encoders: TextEncoders = "all"
    # sd3/flux: the T5 encoder sharded with FSDP2 across all ranks for inference (1/world of its weights per rank;
    # every rank must then encode the same number of times: the trainer does)
    shard_text_encoder: bool = False
    # wan: frames per video, 1 + a multiple of the VAE's temporal factor (4: 81 is Wan2.1's 5 s at 16 fps); null = 81
    num_frames: Optional[int] = None
    # sd3/flux: T5 prompt tokens; null = the pipeline's default (diffusers: SD3 256, FLUX 512). Recipes set their
    # own (Flow-GRPO and DiffusionNFT encode SD3.5 prompts at 128). Every transformer pass carries these tokens.
    # qwenimage, flux2, zimage: the Qwen text encoder's prompt tokens every prompt is padded to (null: the pipeline's
    # 512; at most 1024 for qwenimage, 512 for the others)
    max_sequence_length: Optional[int] = None

    def check(self, prefix: str) -> None:
        fam = family(self.kind, f"{prefix}.kind")  # an unknown kind: refused, naming the known ones
        pipelines = ", ".join(k for k, f in families().items() if f.is_pipeline)
        takes = lambda key: ", ".join(k for k, f in families().items() if key in f.keys)  # noqa: E731
        _require(not fam.is_pipeline or bool(self.pretrained), f"{prefix}.pretrained",
                 f"must name the diffusers pipeline directory when {prefix}.kind is {self.kind}")
        _require(not self.lora.enabled or fam.is_pipeline, f"{prefix}.lora.enabled",
                 f"is supported for the diffusers kinds ({pipelines}), not dit")
        _require(self.resolution is None or fam.is_pipeline, f"{prefix}.resolution",
                 f"is for sd3/flux; the dit's size is {prefix}.dit.image_size")
        _require(self.resolution is None or self.resolution >= 16, f"{prefix}.resolution",
                 f"must be >= 16 pixels, got {self.resolution}")
        _require(self.distilled_guidance is None or "distilled_guidance" in fam.keys, f"{prefix}.distilled_guidance",
                 f"is for the guidance-distilled FLUX kinds, not {self.kind} ({takes('distilled_guidance')})")
        _require(self.distilled_guidance is None or self.distilled_guidance > 0, f"{prefix}.distilled_guidance",
                 "must be > 0")
        xf = self.attention == "xformers"  # sd3.py's own; cudnn / flash: diffusers' backends, for any pipeline
        _require(self.attention == "sdpa" or ("attention" in fam.keys if xf else fam.is_pipeline),
                 f"{prefix}.attention", f"{self.attention} is for {takes('attention') if xf else pipelines} only")
        _require(self.text_encoders == "all" or "text_encoders" in fam.keys, f"{prefix}.text_encoders",
                 f"no_t5 is supported for {prefix}.kind {takes('text_encoders')} (FLUX's prompt embeddings are T5's)")
        _require(not self.shard_text_encoder or (fam.is_pipeline and self.text_encoders == "all"),
                 f"{prefix}.shard_text_encoder",
                 f"needs a large text encoder (T5; Qwen-Image's Qwen2.5-VL): {prefix}.kind "
                 f"{pipelines} with {prefix}.text_encoders all")
        n = self.max_sequence_length
        _require(n is None or fam.is_pipeline, f"{prefix}.max_sequence_length",
                 "is the prompt length of a diffusers pipeline; the dit's is model.dit.max_prompt_length")
        limit = fam.prompt_limit
        _require(n is None or 1 <= n <= limit, f"{prefix}.max_sequence_length",
                 f"must be in [1, {limit}] prompt tokens for {prefix}.kind {self.kind}, got {n}")
        _require(self.num_frames is None or "num_frames" in fam.keys, f"{prefix}.num_frames",
                 f"is the frame count of a video model (kind {takes('num_frames')}), not {self.kind}")
        _require(self.num_frames is None or self.num_frames >= 1, f"{prefix}.num_frames",
                 f"must be >= 1, got {self.num_frames}")
        self.lora.check(f"{prefix}.lora")
        _check_dit(self.dit, f"{prefix}.dit")


@dataclass
class SamplingConfig(_Section):
    num_steps: int = 10
    # the stochastic step (grpo/sde.py): flow_grpo, Flow-GRPO's SDE | cps, coefficients-preserving sampling (Flow-GRPO's
    # sde_type "cps", which its README runs at noise level 0.8)
    sde: SdeKind = "flow_grpo"
    noise_level: float = 0.7
    guidance: float = 1.0  # classifier-free guidance scale; 1.0 disables CFG
    # a two-expert model's (Wan2.2 A14B) low-noise expert's scale, `guidance` the high-noise one's: WanPipeline's
    # guidance_scale_2 (null: `guidance` on both, as the pipeline does without it; grpo/guidance.py ExpertGuidance)
    guidance_2: Optional[float] = None
    shift: Optional[float] = 3.0  # SD3's time shift; null = the loaded pipeline's own schedule (sd3/flux)
    # rollout rows per forward (no grad), or auto: the largest chunk whose rollout phase fits the GPU beside
    # everything else by jagg-estimate's memory model (estimate/memory.rollout_batch), at most half a rank's rows so
    # the first chunk's reward is scored while the second samples; half a rank's rows off a GPU
    chunk_size: Union[int, Literal["auto"]] = 16
    eval_num_steps: int = 20
    # The deterministic steps outside the SDE window (MixGRPO-Flash): `ode_solver` euler, or dpm2 (DPM-Solver++(2M)
    # for flow matching, second order), on `ode_steps` steps in all before and after the window (0: the schedule's
    # own num_steps - grpo.sde_window steps), shared out in proportion to the steps each side had and re-spaced there
    # (grpo/solver.py); the window keeps its sigmas, log-probs and training are unchanged. Evaluation stays Euler.
    ode_solver: OdeSolver = "euler"
    ode_steps: int = 0
    # a prompt group's rows start from one x_0 drawn per (run seed, step, group), each row's SDE noise its own
    # (train/rows.py initial_noise): Flow-GRPO's sample.same_latent, DanceGRPO's --init_same_noise. false: per row
    same_initial_noise: bool = False

    def check(self, prefix: str) -> None:
        _require(self.num_steps >= 1, f"{prefix}.num_steps", f"must be >= 1, got {self.num_steps}")
        _require(self.eval_num_steps >= 1, f"{prefix}.eval_num_steps", "must be >= 1")
        # upper bounds: past them the SDE's std (noise_level) or the CFG extrapolation overflow float32 math
        _require(0 < self.noise_level <= 10, f"{prefix}.noise_level",
                 f"must be in (0, 10] (Flow-GRPO uses 0.7), got {self.noise_level}")
        _require(self.sde != "cps" or self.noise_level <= 1, f"{prefix}.noise_level",
                 f"must be in (0, 1] with {prefix}.sde cps (its noise std is s_next sin(noise_level pi / 2)), got "
                 f"{self.noise_level}")
        _require(1.0 <= self.guidance <= 100, f"{prefix}.guidance",
                 f"must be in [1, 100] (1 disables CFG), got {self.guidance}")
        _require(self.guidance_2 is None or 1.0 <= self.guidance_2 <= 100, f"{prefix}.guidance_2",
                 f"must be in [1, 100] or null, got {self.guidance_2}")
        # the pipeline guides neither expert when guidance_scale is 1 (pipeline_wan.py: CFG on for guidance_scale > 1)
        _require(self.guidance_2 is None or self.guidance != 1.0, f"{prefix}.guidance_2",
                 f"is the low-noise expert's CFG scale, but {prefix}.guidance is 1 (CFG off on both experts); set "
                 f"{prefix}.guidance or leave guidance_2 null")
        _require(self.shift is None or self.shift > 0, f"{prefix}.shift", f"must be > 0, got {self.shift}")
        _require(self.chunk_size == "auto" or self.chunk_size >= 1, f"{prefix}.chunk_size",
                 f"must be >= 1 or auto, got {self.chunk_size}")
        _require(self.ode_steps >= 0, f"{prefix}.ode_steps", f"must be >= 0, got {self.ode_steps}")
        # sde_window's bounds against num_steps (and ode_steps against the window): train/config.py _check_sde_window


@dataclass
class GRPOConfig(_Section):
    group_size: int = 4
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0  # KL weight; 0 skips the reference model entirely
    # where the rollout runs the KL reference (ref_at) and, after an optimizer step, the update recomputes CFG's
    # unconditional prediction and JAGG's interior velocities (refresh_at; jagg.intermediate auto): on every trained
    # step (Flow-GRPO), or on the JAGG plan's knots only, linear in sigma between them (the window's own assumption,
    # exact for a velocity affine along its line). ref_at knots needs a plan known before the rollout
    ref_at: RefAt = "steps"
    refresh_at: RefAt = "steps"
    timestep_fraction: float = 1.0
    # which steps a sample trains (grpo/steps.py): first, Flow-GRPO's first int(T x timestep_fraction) | random,
    # DanceGRPO's int((T - 1) x timestep_fraction) of the first T - 1 drawn per sample | windows, eff_grpo's blocks of
    # jagg.window steps, int(blocks x timestep_fraction) of them drawn per sample
    step_selection: StepSelection = "first"
    inner_epochs: int = 1
    global_std: bool = False
    # the on-policy invariant (train/invariants.py): the largest |log ratio| training may find to the rollout on a
    # step's first minibatch (the rollout's own parameters) before the run stops
    onpolicy_tolerance: float = 1e-3
    # GRPO's sampler, its SDE window (Flow-GRPO-Fast / MixGRPO): only `sde_window` consecutive steps of the
    # sampling schedule are sampled with the SDE and trained, the others run the ODE; 0 = every step is SDE
    # (Flow-GRPO). The window's start is drawn per step in [lo, hi - sde_window] (sde_window_range [lo, hi], empty:
    # the whole trajectory): `random` (Flow-GRPO-Fast) or `sliding` (MixGRPO: moves one step every
    # sde_window_every training steps, wrapping); `scattered` draws any sde_window steps of [lo, hi) per step,
    # consecutive or not (UniRL's AllSDEScheduler with num_sde_steps, its Flow-DPPO recipe)
    sde_window: int = 0
    sde_window_range: list[int] = field(default_factory=list)
    sde_window_mode: SdeWindowMode = "random"
    sde_window_every: int = 1

    def check(self, prefix: str) -> None:
        _require(self.group_size >= 2, f"{prefix}.group_size",
                 f"must be >= 2 for group-relative advantages, got {self.group_size}")
        _require(self.clip_range > 0, f"{prefix}.clip_range", "must be > 0")
        _require(self.adv_clip_max > 0, f"{prefix}.adv_clip_max", "must be > 0")
        _require(self.kl_beta >= 0, f"{prefix}.kl_beta", "must be >= 0")
        _require(0 < self.timestep_fraction <= 1, f"{prefix}.timestep_fraction",
                 f"must be in (0, 1], got {self.timestep_fraction}")
        _require(self.inner_epochs >= 1, f"{prefix}.inner_epochs", "must be >= 1")
        _require(self.onpolicy_tolerance > 0, f"{prefix}.onpolicy_tolerance", "must be > 0")
        _require(self.sde_window_every >= 1, f"{prefix}.sde_window_every", "must be >= 1")


@dataclass
class TrainConfig(_Section):
    # grpo: Flow-GRPO's clipped surrogate on SDE rollouts (the grpo section) | nft: DiffusionNFT on ODE rollouts of
    # its old policy, trained on the forward process (the nft section; train/nft.py) | dppo: Flow-DPPO, GRPO's SDE
    # rollout with the KL-masked unclipped ratio (the dppo section; train/dppo.py) | gcpo: GCPO's chunk-level clipped
    # surrogate on SDE rollouts (the gcpo section; train/gcpo.py)
    # | awm: Advantage Weighted Matching on ODE rollouts, trained on the forward process (the awm section; train/awm.py)
    algorithm: Algorithm = "grpo"
    steps: int = 20
    prompts_per_step: int = 4
    minibatch_size: int = 8  # samples per optimizer step
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    # > 0: an EMA of the trainable weights for evaluation and export, moved by Flow-GRPO's rule (parallel/ema.py):
    # every ema_every optimizer steps, ema_repeat moves, its decay warmed up by ema_warmup (default: every step, fixed)
    ema_decay: float = 0.0
    ema_every: int = 1
    ema_warmup: bool = False
    ema_repeat: int = 1
    # rows per forward/backward chunk on each rank; 0 = the rank's whole share of a minibatch in one chunk. The
    # minibatch's gradient is accumulated over its chunks (a JAGG joint pass then holds 2 x micro_batch_size rows)
    micro_batch_size: int = 0
    # optimizer steps with a non-finite loss or gradient norm are skipped (counted as nonfinite_steps; under float16
    # an overflow of the loss scale's search is loss_scale_skips instead, parallel/loss_scale.py); this many
    # in a row stop the run: the model or the data is broken, and skipping forever would train on nothing
    max_nonfinite_steps: int = 10

    def check(self, prefix: str) -> None:
        _require(self.steps >= 1, f"{prefix}.steps", f"must be >= 1, got {self.steps}")
        _require(self.micro_batch_size >= 0, f"{prefix}.micro_batch_size",
                 f"must be >= 0 (0: the whole minibatch share per chunk), got {self.micro_batch_size}")
        _require(self.prompts_per_step >= 1, f"{prefix}.prompts_per_step", "must be >= 1")
        _require(self.minibatch_size >= 1, f"{prefix}.minibatch_size", "must be >= 1")
        _require(0 < self.lr <= 1, f"{prefix}.lr", f"must be in (0, 1], got {self.lr}")
        _require(self.weight_decay >= 0, f"{prefix}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        # AdamW's decoupled decay multiplies every weight by 1 - lr * weight_decay per step: at >= 1 it zeroes them
        _require(self.lr * self.weight_decay < 1, f"{prefix}.weight_decay",
                 f"times {prefix}.lr must be < 1 (each step scales the weights by 1 - lr * weight_decay), got "
                 f"{self.weight_decay} * {self.lr}")
        _require(all(0 <= b < 1 for b in self.adam_betas), f"{prefix}.adam_betas", "must be two numbers in [0, 1)")
        _require(self.adam_eps > 0, f"{prefix}.adam_eps", f"must be > 0 (Adam divides by it), got {self.adam_eps}")
        _require(self.grad_clip >= 0, f"{prefix}.grad_clip", "must be >= 0 (0 disables clipping)")
        _require(0.0 <= self.ema_decay < 1.0, f"{prefix}.ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        for key, least in (("ema_every", "optimizer steps between EMA updates"), ("ema_repeat", "moves per update")):
            _require(getattr(self, key) >= 1, f"{prefix}.{key}", f"must be >= 1 ({least}), got {getattr(self, key)}")
        # set while there is no EMA: keys that would not act
        for key, default in (("ema_every", "1"), ("ema_warmup", "false"), ("ema_repeat", "1")):
            value = str(getattr(self, key)).lower()
            _require(self.ema_decay > 0 or value == default, f"{prefix}.{key}",
                     f"is {value} but {prefix}.ema_decay is 0, so there is no EMA for it to act on: set "
                     f"{prefix}.ema_decay > 0 or leave {key} at {default}")
        _require(self.max_nonfinite_steps >= 1, f"{prefix}.max_nonfinite_steps",
                 f"must be >= 1, got {self.max_nonfinite_steps}")


def _one_prompt_source(section, prefix: str) -> None:
    """A prompt file and an inline list are two sources: the file wins, so the list would be dropped unread."""
    if section.prompt_file:
        refuse_set(section, prefix, ("prompts",), f"{prefix}.prompt_file is set too (its prompts are the ones read)")


@dataclass
class DataConfig(_Section):
    source: DataSource = "list"
    prompt_file: Optional[str] = None  # .txt or .jsonl; when unset, `prompts` is used
    prompts: list[str] = field(default_factory=list)
    shards: Optional[str] = None  # wds: brace pattern of tar shards (python -m jagg_scale.data.make_shards)
    num_workers: int = 0  # wds: DataLoader workers per rank
    # webdataset runs `pipe:CMD` shard URLs as shell commands: a config file would run code. Refused unless this is
    # true (the user's own config, e.g. pipe:aws s3 cp ...); plain paths and http(s) URLs need nothing.
    allow_pipe: bool = False

    def check(self, prefix: str) -> None:
        if self.source == "wds":
            refuse_set(self, prefix, ("prompt_file", "prompts"), f"{prefix}.source is wds (the prompts stream from "
                       f"{prefix}.shards)")
        else:
            refuse_set(self, prefix, ("shards", "num_workers", "allow_pipe"), f"{prefix}.source is list (the prompts "
                       f"come from {prefix}.prompt_file or {prefix}.prompts; shards are read with {prefix}.source wds)")
        _one_prompt_source(self, prefix)
        _require(self.source != "list" or bool(self.prompt_file) or len(self.prompts) > 0, f"{prefix}.prompt_file",
                 f"is required when {prefix}.prompts is empty")
        _require(self.source != "wds" or bool(self.shards), f"{prefix}.shards",
                 f"is required when {prefix}.source is wds")
        _require(self.num_workers >= 0, f"{prefix}.num_workers", "must be >= 0")
        _require(self.allow_pipe or not (self.shards or "").lstrip().startswith("pipe:"), f"{prefix}.shards",
                 f"is a pipe: URL ({self.shards!r}), which runs a shell command: set {prefix}.allow_pipe=true if "
                 "this config is your own")
        for i, p in enumerate(self.prompts):
            _require(isinstance(p, str) and bool(p.strip()), f"{prefix}.prompts",
                     f"entry #{i} must be a non-empty string, got {p!r}")


@dataclass
class RewardConfig(_Section):
    name: str = "jpeg_compressibility"  # one reward (jagg_scale.rewards.available())
    options: dict[str, Any] = field(default_factory=dict)
    # several: {name: {weight: w, option: value, ...}}; replaces name
    components: dict[str, Optional[dict[str, Any]]] = field(default_factory=dict)
    aggregate: RewardAggregate = "sum"
    max_fail_frac: float = 0.25  # per reward: a larger failed fraction of a batch stops the run
    background: bool = True  # decode + score rollout chunks in a worker thread while the next chunk samples
    # the most seconds a rank waits, once its rollout is done, for the chunks its worker is still scoring; a chunk
    # not scored by then is masked (its rows count as failed rewards, metric reward_late) and the step goes on, so a
    # hung reward host costs samples, never the job. null: half of parallel.collective_timeout_s (of pools.timeout_s
    # with pools). It must end inside it (the others wait for this rank in the reward all-gather after): validated.
    # Background scoring only (inline and sharded scoring run inside the rollout and cannot be cut off)
    deadline_s: Optional[float] = None
    shard: bool = False  # split reward-model weights across ranks (FSDP2, inference); each rank scores its images

    def check(self, prefix: str) -> None:
        if self.components:
            refuse_set(self, prefix, ("name", "options"), f"{prefix}.components names the rewards, each with its own "
                       "options ({name: {weight: w, option: value}})")
        _require(self.aggregate != "advantage" or len(self.components) > 1, f"{prefix}.aggregate",
                 f"is advantage (the sum of each reward's own group advantages), which needs two or more "
                 f"{prefix}.components; with one reward it is sum: unset it ({prefix}.aggregate=null)")
        if not self.background:
            refuse_set(self, prefix, ("deadline_s",), f"{prefix}.background is false (scoring runs inside the "
                       "rollout, which no deadline cuts off)")
        _require(0.0 <= self.max_fail_frac <= 1.0, f"{prefix}.max_fail_frac", "must be in [0, 1]")
        _require(self.deadline_s is None or self.deadline_s > 0, f"{prefix}.deadline_s",
                 f"must be > 0 seconds (null: half of parallel.collective_timeout_s), got {self.deadline_s}")
        for name, spec in self.components.items():
            weight = (spec or {}).get("weight", 1.0)
            _require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight),
                     f"{prefix}.components.{name}.weight", f"must be a finite number, got {weight!r}")


@dataclass
class LogConfig(_Section):
    progress: bool = True
    wandb: bool = False
    wandb_mode: WandbMode = "offline"
    wandb_project: str = "jagg-scale"


@dataclass
class EvalConfig(_Section):
    enabled: bool = False
    prompt_file: Optional[str] = None  # held-out prompts (.txt / .jsonl); when unset, `prompts`
    prompts: list[str] = field(default_factory=list)
    num_per_prompt: int = 2
    every: int = 0  # also evaluate every N steps; 0: only before and after training
    video_fps: int = 16  # a video model's eval GIFs (Wan2.1 generates at 16 fps)
    seed: int = 1234  # eval noise is fixed by this seed, so every evaluation sees the same starting noise
    chunk_size: int = 32  # images per rank encoded, sampled, decoded and scored at once (eval memory is per batch)
    at_start: bool = True  # also evaluate before the first step (step 0) of a fresh run; false skips it
    grid_images: int = 64  # grid.png shows the first N images (all when fewer; 0: no grid), gathered to rank 0

    def check(self, prefix: str) -> None:
        _require(not self.enabled or bool(self.prompt_file) or len(self.prompts) > 0, f"{prefix}.prompt_file",
                 f"is required when {prefix}.enabled and {prefix}.prompts is empty")
        _one_prompt_source(self, prefix)
        for key, least in (("num_per_prompt", 1), ("every", 0), ("chunk_size", 1), ("video_fps", 1), ("seed", 0)):
            _require(getattr(self, key) >= least, f"{prefix}.{key}", f"must be >= {least}, got {getattr(self, key)}")
        _require(self.grid_images >= 0, f"{prefix}.grid_images", "must be >= 0 (0: no grid.png)")
        for i, p in enumerate(self.prompts):
            _require(isinstance(p, str) and bool(p.strip()), f"{prefix}.prompts",
                     f"entry #{i} must be a non-empty string, got {p!r}")


@dataclass
class RunConfig(_Section):
    output_dir: str = "runs/default"
    seed: int = 0
    # none: start at step 0 | auto: the newest valid checkpoint (none yet: step 0; some but none valid: refused) |
    # the path of a checkpoint directory
    resume: str = "none"
    # with resume none, a run directory that already holds a run (metrics rows, checkpoints, an export) is refused:
    # true replaces that run (its outputs are deleted when training starts)
    overwrite: bool = False
    checkpoint_every: int = 10
    keep_last: int = 2
    # out/lora | out/transformer: at the last step, and every export_every steps when > 0; never on preemption (the
    # signal's lead time is the checkpoint's alone: docs/launchers.md)
    export_every: int = 0
    # auto: the dtype model.pretrained's transformer is published in (SD3.5, FLUX: bfloat16, half the bytes of
    # float32: FLUX 23.8 GB instead of 47.6 GB), float32 for anything else (the built-in DiT, mixed dtypes)
    export_dtype: ExportDType = "auto"
    device: Device = "auto"
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default

    def check(self, prefix: str) -> None:
        _require(bool(self.output_dir.strip()), f"{prefix}.output_dir",
                 "must not be empty (the run directory: checkpoints, metrics.jsonl, exports)")
        _require(not Path(self.output_dir).exists() or Path(self.output_dir).is_dir(), f"{prefix}.output_dir",
                 f"is {self.output_dir!r}, which exists and is not a directory")
        _require(0 <= self.seed < 2**32, f"{prefix}.seed", f"must be in [0, 2**32) (numpy's seeds), got {self.seed}")
        if self.resume not in RESUME_KEYWORDS:
            # a path must exist now: a typo of a keyword ('Auto') would otherwise fail later as a missing state.json
            # (a file check in a section's own check: the run section owns it)
            hint = f"; did you mean '{self.resume.lower()}'?" if self.resume.lower() in RESUME_KEYWORDS else ""
            _require(bool(self.resume.strip()) and Path(self.resume).is_dir(), f"{prefix}.resume",
                     f"is {self.resume!r}, which is neither a keyword ({' | '.join(RESUME_KEYWORDS)}) nor an "
                     f"existing checkpoint directory (the path does not exist){hint}")
        _require(not self.overwrite or self.resume == "none", f"{prefix}.overwrite",
                 f"is true (start over at step 0, replacing the run in {prefix}.output_dir) while {prefix}.resume is "
                 f"{self.resume!r} (continue it): set {prefix}.resume=none to start over, or drop {prefix}.overwrite")
        _require(self.checkpoint_every >= 0, f"{prefix}.checkpoint_every", "must be >= 0 (0: only at the end)")
        _require(self.export_every >= 0, f"{prefix}.export_every", "must be >= 0 (0: only at the end)")
        _require(self.keep_last >= 1, f"{prefix}.keep_last", "must be >= 1")
        _require(self.threads >= 0, f"{prefix}.threads", "must be >= 0")
