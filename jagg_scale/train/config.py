"""Typed run configuration: YAML -> dataclasses, with dotted command-line overrides.

Everything is validated before any work starts: an unknown key, a value of the wrong type, a choice that is not
one of its `Literal`'s values, a non-finite float or a value out of range fails with a ConfigError naming the
dotted key, so a typo never silently falls back to a default. The section dataclasses and their own checks are
in config_sections.py, building them from YAML and overrides in config_build.py; this module holds `Config`, the
checks across sections (`validate`) and `load_config`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..gcpo.config import GCPOConfig
from ..jagg import trained_steps
from ..models.registry import families, family
from ..paths import resolve_path
from ..pools.config import PoolsConfig, check_pools
from .config_sections import *  # noqa: F403 - the sections, their choices and ConfigError are this module's API
from .config_sections import (AWMConfig, ConfigError, DataConfig, DPPOConfig, EvalConfig, GRPOConfig, JAGGConfig,
                              LogConfig, ModelConfig, NFTConfig, ParallelConfig, RewardConfig, RunConfig,
                              SamplingConfig, TrainConfig, _require, refuse_set)
from .config_sections import __all__ as _sections_all
from .config_bounds import check_bounds
from .config_experts import check_experts, pipeline_has_experts
from .config_forward import FIXED_WINDOWS, check_forward_process, check_refresh_at, fixed_windows
from .config_build import MAX_YAML_BYTES, RENAMED, _build, _plain, _set_dotted, _yaml, parse_override

log = logging.getLogger(__name__)

__all__ = [*_sections_all, "Config", "RENAMED", "config_from_dict", "load_config", "load_prompt_file", "parse_override",
           "validate", "validate_world"]


# train.algorithm -> what its rollout is: "sde" (the SDE on the trained steps, every step's latents and log-probs kept:
# Flow-GRPO and its relatives, trained on those densities) or "ode" (a deterministic ODE whose final latents are
# trained on the forward process: DiffusionNFT, AWM). The cross-section checks (_check_algorithm) read this, not the
# name.
ROLLOUT_KIND = {"grpo": "sde", "nft": "ode", "dppo": "sde", "gcpo": "sde", "awm": "ode"}
# train.algorithm -> its own config section, where it has one: a key of it set under another algorithm is refused
OWN_SECTION = {"nft": "nft", "dppo": "dppo", "gcpo": "gcpo", "awm": "awm"}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    dppo: DPPOConfig = field(default_factory=DPPOConfig)
    gcpo: GCPOConfig = field(default_factory=GCPOConfig)
    awm: AWMConfig = field(default_factory=AWMConfig)
    jagg: JAGGConfig = field(default_factory=JAGGConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)

    @property
    def forward_process(self) -> bool:
        """Whether train.algorithm trains on the forward process from a deterministic ODE rollout (DiffusionNFT)
        rather than on the SDE rollout's per-step densities (Flow-GRPO and its relatives): ROLLOUT_KIND."""
        return ROLLOUT_KIND[self.train.algorithm] == "ode"

    @property
    def algorithm_section(self):
        """train.algorithm's own config section (OWN_SECTION), or None for one that has none beyond grpo's."""
        name = OWN_SECTION.get(self.train.algorithm)
        return getattr(self, name) if name else None

    @property
    def algorithm_shadows(self) -> int:
        """Shadow copies of the trainable weights train.algorithm holds in the engine besides train.ema_decay's EMA
        (DiffusionNFT's old policy, AWM's EMA policy where it is read): its section's shadow_weights."""
        return getattr(self.algorithm_section, "shadow_weights", 0)

    @property
    def uses_reference(self) -> bool:
        """Whether the run needs the KL reference (the starting model): the KL weight of the algorithm's own section
        (nft.kl_beta under DiffusionNFT) where it has one, else grpo.kl_beta, > 0. Without it no reference is built
        and none is evaluated."""
        own = self.algorithm_section
        return (own.kl_beta if own is not None and hasattr(own, "kl_beta") else self.grpo.kl_beta) > 0

    @property
    def trained_per_sample(self) -> int:
        """K: the steps every sample trains per training step (the SDE window, or grpo.step_selection's count), or
        what an algorithm's own section counts (its trained_count: gcpo's chunk slot positions, pads included;
        awm.num_train_timesteps)."""
        from ..grpo.steps import trained_count

        g, s = self.grpo, self.sampling
        own = self.algorithm_section
        if hasattr(own, "trained_count"):
            return own.trained_count(s.num_steps)
        return g.sde_window or trained_count(g.step_selection, s.num_steps, g.timestep_fraction,
                                             self.selection_window)

    @property
    def selection_window(self) -> int:
        """The block length of grpo.step_selection windows: jagg.window, or the window planner's default."""
        from ..jagg.planners import WindowPlanner

        return self.jagg.window or WindowPlanner.window

    @property
    def reference_steps(self) -> int:
        """The steps whose KL reference the rollout runs per sample (before grpo.ref_at knots thins them): the trained
        ones, or with per-sample selections every candidate (a chunk's rows train different steps)."""
        from ..grpo.steps import candidate_steps

        g = self.grpo
        if g.step_selection == "first" or self.grpo.sde_window:
            return self.trained_per_sample
        return candidate_steps(g.step_selection, self.sampling.num_steps)

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps per training step: one per minibatch of train.minibatch_size rows, every inner epoch. The
        same every step, so the count so far is a function of the step: what a resumed run continues from."""
        return self.grpo.inner_epochs * self.train.prompts_per_step * self.grpo.group_size // self.train.minibatch_size

    @property
    def reward_deadline_s(self) -> float:
        """reward.deadline_s, or (null) half of parallel.collective_timeout_s; under pools half of pools.timeout_s, the
        trainers' wait for a rollout and its rewards."""
        d = self.reward.deadline_s
        if d is not None:
            return float(d)
        return (self.pools.timeout_s if self.pools.enabled else self.parallel.collective_timeout_s) / 2

    def is_set(self, dotted: str) -> bool:
        """Whether config key `dotted` ('jagg.window') holds a value other than its default, given by the YAML, an
        override or code. `key=null` puts a key back to its default, `section=null` a whole section. A key given at
        its default value counts as unset: it changes nothing, and a saved config.yaml names every key."""
        *parents, name = dotted.split(".")
        node = self
        for part in parents:
            node = getattr(node, part)
        return getattr(node, name) != getattr(type(node)(), name)

    def to_dict(self) -> dict:
        """Plain YAML-safe types (tuples -> lists): written to config.yaml and compared on resume."""
        return _plain(self)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                check_files: bool = True) -> Config:
    """Read YAML (optional), apply dotted overrides, type-check and validate: the only way configs are made.
    check_files=False skips what needs the run's files (prompt files, model.pretrained): jagg-estimate sizes a
    production config on a machine that has none of them."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        if path.stat().st_size > MAX_YAML_BYTES:
            raise ConfigError(f"config file {path} is {path.stat().st_size} bytes; a config is read up to "
                              f"{MAX_YAML_BYTES}")
        data = _yaml(path.read_text(), f"config file {path}") or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    cfg = _build(Config, data, "")
    validate(cfg, check_files=check_files)
    return cfg


def config_from_dict(data: dict) -> Config:
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def _check_video_rewards(cfg: Config) -> None:
    """A video model's samples are frames [N, 3, F, H, W]: every reward it is scored by must take videos."""
    from ..rewards.video import VIDEO_ONLY, VIDEO_REWARDS

    r, kind = cfg.reward, cfg.model.kind
    for name in list(r.components) if r.components else [r.name]:
        key = f"reward.components.{name}" if r.components else "reward.name"
        if family(kind).video:
            _require(name in VIDEO_REWARDS, key, f"{name!r} scores images; model.kind {kind} makes videos: use "
                     f"{' or '.join(VIDEO_REWARDS)} (video_frames: {{reward: {name}, options: ...}} scores frames)")
        else:
            _require(name not in VIDEO_ONLY, key, f"{name!r} scores videos; model.kind {kind} makes images")


def validate(cfg: Config, *, check_files: bool = True) -> None:
    """Each section's own range checks, then the checks across sections and (check_files) the files named; each
    names its key."""
    check_bounds(cfg)  # first: the checks below may build from a size key (a plan lists every sampling step)
    for f in dataclasses.fields(cfg):
        getattr(cfg, f.name).check(f.name)
    m, s, g, t = cfg.model, cfg.sampling, cfg.grpo, cfg.train
    _require(s.shift is not None or family(m.kind).is_pipeline, "sampling.shift",
             "null (the pipeline's own schedule) needs a diffusers model.kind "
             f"({', '.join(k for k, f in families().items() if f.is_pipeline)})")
    _check_video_rewards(cfg)
    _require(g.sde_window == 0 or g.timestep_fraction == 1.0, "grpo.timestep_fraction",
             "must be 1.0 with grpo.sde_window (the window decides which steps are trained)")
    _require((t.prompts_per_step * g.group_size) % t.minibatch_size == 0, "train.minibatch_size",
             f"must divide train.prompts_per_step * grpo.group_size = {t.prompts_per_step * g.group_size}")
    _check_algorithm(cfg)
    if cfg.parallel.engine == "deepspeed":  # its 16-bit modes follow model.dtype (build_ds_config)
        from ..parallel.deepspeed_engine import precision_problem

        problem = precision_problem(cfg.parallel.deepspeed, m.dtype)
        _require(problem is None, *(problem or ("", "")))
    _warn_window(cfg)
    _check_rewards(cfg.reward, cfg.reward_deadline_s)
    _require(cfg.reward.aggregate != "gdpo" or not g.global_std, "grpo.global_std", "is true, but reward.aggregate "
             "gdpo normalises each reward by its group's std and the sum by the batch's: set it to false")
    sp = cfg.parallel.sequence_parallel  # xformers' processors take no part in the exchange (parallel/sequence.py)
    _require(sp == 1 or m.attention != "xformers", "model.attention", f"xformers with parallel.sequence_parallel "
             f"{sp}: its attention takes no part in the context-parallel exchange, each rank would attend to its own "
             "tokens alone: use sdpa")
    # deadlines nest: a rank's wait for its rewards ends inside the collective timeout of the all-gather after it
    c = cfg.parallel.collective_timeout_s
    _require(cfg.reward_deadline_s + DEADLINE_MARGIN_S <= c, "reward.deadline_s",
             f"{cfg.reward_deadline_s:g} s must end {DEADLINE_MARGIN_S} s inside parallel.collective_timeout_s={c} "
             "(the other ranks wait for this one in the reward all-gather): lower it or raise the collective timeout")
    check_pools(cfg, DEADLINE_MARGIN_S)
    if check_files:
        _require(cfg.run.device != "cuda" or torch.cuda.is_available(), "run.device",
                 "is cuda, but torch sees no CUDA device here (use auto or cpu, or run on a GPU node)")
        _check_files(cfg)


DEADLINE_MARGIN_S = 30  # reward.deadline_s's distance from parallel.collective_timeout_s: the gather's own time


def _check_step_selection(cfg: Config) -> None:
    """grpo.step_selection other than first: rows train different steps, which these cannot follow."""
    g, s = cfg.grpo, cfg.sampling
    if g.step_selection == "first":
        return
    why = f"grpo.step_selection {g.step_selection} (each sample its own trained steps)"
    _require(not cfg.forward_process, "grpo.step_selection",
             f"is a setting of the SDE algorithms; train.algorithm {cfg.train.algorithm} draws each sample's training "
             f"timesteps itself ({why})")
    _require(g.sde_window == 0, "grpo.sde_window", f"chooses the trained steps itself: it cannot go with {why}")
    _require(g.ref_at == "steps", "grpo.ref_at",
             f"knots needs one plan known before the rollout; with {why} the rollout runs the reference on every "
             "candidate step: set grpo.ref_at steps")
    _require(cfg.jagg.planner_kind != "budget", "jagg.planner",
             f"budget places knots from one sigma per step; with {why} each sample has its own: "
             "use jagg.planner uniform")
    if g.step_selection == "windows":
        C, W = s.num_steps - 1, cfg.selection_window
        _require(C >= W and C % W == 0, "jagg.window",
                 f"{W} must divide the {C} candidate steps (sampling.num_steps - 1) of grpo.step_selection windows, "
                 "as eff_grpo asserts: every sample then trains the same number of whole blocks")


def _check_algorithm(cfg: Config) -> None:
    """What each train.algorithm reads: a key only the other one uses, set away from its default, is refused."""
    s, g = cfg.sampling, cfg.grpo
    nft = cfg.forward_process  # the rollout is the ODE: no SDE window, no SDE to shape
    algo = cfg.train.algorithm
    _refuse_other_algorithm(cfg)
    window_keys = ("sde_window_range", "sde_window_mode", "sde_window_every")  # they place the SDE window
    if not nft and g.sde_window == 0:
        refuse_set(g, "grpo", window_keys, "grpo.sde_window is 0 (every step is SDE: no window to place)")
    _check_sde_window(cfg)
    for key, default in (("ode_solver", "euler"), ("ode_steps", 0)):  # MixGRPO-Flash's compressed ODE, or NFT's
        _require(nft or g.sde_window > 0 or getattr(s, key) == default, f"sampling.{key}",
                 "acts on the ODE steps outside the SDE window: it needs grpo.sde_window > 0 (with sde_window 0 "
                 "every step is SDE) or a forward-process algorithm (train.algorithm nft: its rollout is the ODE)")
    _check_step_selection(cfg)
    if algo == "gcpo":
        _check_gcpo(cfg)
    if not nft:
        if g.ref_at == "knots":
            _require(g.kl_beta > 0, "grpo.ref_at", "knots places the KL reference's forwards, but grpo.kl_beta is 0 "
                     "(no reference runs): leave it out")
            _require(fixed_windows(cfg), "grpo.ref_at", FIXED_WINDOWS)
        check_refresh_at(cfg)
        if s.sde == "cps":  # CPS's last step (to s_T = 0) injects no noise: no density to train on, a KL term of 1 / 0
            if g.sde_window:
                hi = (g.sde_window_range or [0, s.num_steps])[1]
                _require(hi < s.num_steps, "grpo.sde_window_range",
                         f"must end before the last step with sampling.sde cps (its step to s = 0 is deterministic): "
                         f"[lo, hi] with hi <= {s.num_steps - 1}, got {g.sde_window_range or [0, s.num_steps]}")
            else:
                _require(len(trained_steps(s.num_steps, g.timestep_fraction)) < s.num_steps, "grpo.timestep_fraction",
                         "must leave the last step untrained with sampling.sde cps (its step to s = 0 is "
                         "deterministic: no density, a KL term of 1 / 0); Flow-GRPO trains 0.99 of the steps")
        return
    check_forward_process(cfg, OWN_SECTION[algo])


def _check_gcpo(cfg: Config) -> None:
    """train.algorithm gcpo: its chunks against the schedule, the grpo keys it leaves idle, and JAGG windows that are
    its chunk slots (a window cutting across chunks would blend two chunks' factors into one Jacobian)."""
    gc, j = cfg.gcpo, cfg.jagg
    gc.check_schedule("gcpo", cfg.sampling.num_steps)
    refuse_set(j, "jagg", ("intermediate",), "train.algorithm gcpo computes every chunk step's velocity at the "
               "current weights for its factors (the rollout's before an optimizer step, fresh forwards after): the "
               "windows' interior values are those")
    kind = j.planner_kind
    _require(kind in ("exact", "window"), "jagg.planner" if kind == "budget" else "jagg.share_knots",
             f"chooses the {kind} planner, whose knots are not train.algorithm gcpo's chunks: a JAGG window is one "
             "chunk (jagg.planner uniform, jagg.share_knots false)")
    P = max(gc.layout(cfg.sampling.num_steps))
    _require(kind == "exact" or cfg.selection_window == P, "jagg.window",
             f"must be {P} with train.algorithm gcpo: a JAGG window is one chunk, laid out in slots of the longest "
             f"chunk's {P} steps (gcpo/chunks.py), got {cfg.selection_window}")


# Flow-GRPO's own keys of the grpo section; its others (group_size, adv_clip_max, global_std, timestep_fraction,
# inner_epochs: the group advantages and the trained steps) are read by DiffusionNFT too
GRPO_ONLY = {"clip_range": "", "kl_beta": " (its KL weight is {own}.kl_beta)",
             "ref_at": " (its reference runs at its training timesteps, or at the plan's knots by {own}'s own key)",
             "refresh_at": " (it trains CFG-free, its interior timesteps' values interpolated already: "
                           "jagg.intermediate auto)",
             "step_selection": " (it draws each sample's timesteps itself)",
             "onpolicy_tolerance": " (its update has no log-ratio to check)",
             **{k: " (its rollout is the ODE: no SDE window to place)"
                for k in ("sde_window", "sde_window_range", "sde_window_mode", "sde_window_every")}}


# train.algorithm -> the keys of the grpo section its unit does not read though its rollout is GRPO's (the SDE
# algorithms' others act under it): set, they are refused naming what replaces them
GRPO_UNREAD = {"dppo": {"clip_range": " (Flow-DPPO does not clip the ratio: its trust region is "
                                      "dppo.kl_mask_threshold)"},
               # GCPO trains the chunks of its gcpo section (gcpo.chunks, chunk_size, chunk_fraction), without a KL
               # term (its recipes' kl_coeff 0) or an SDE window
               "gcpo": {"timestep_fraction": " (it trains int(chunks x gcpo.chunk_fraction) chunks)",
                        "step_selection": " (each sample draws its own chunks)",
                        "kl_beta": " (GCPO trains without a KL term: kl_coeff 0)",
                        "ref_at": " (no KL reference runs)",
                        "refresh_at": " (its chunk factors need every chunk step at the current weights: after an "
                                      "optimizer step it recomputes them all, train/gcpo.py)",
                        **{k: " (the SDE runs on every step: its chunks cover the trajectory)"
                           for k in ("sde_window", "sde_window_range", "sde_window_mode", "sde_window_every")}}}


def _check_sde_window(cfg: Config) -> None:
    """GRPO's SDE window inside the sampling schedule, and the compressed ODE steps around it."""
    g, s = cfg.grpo, cfg.sampling
    _require(0 <= g.sde_window <= s.num_steps, "grpo.sde_window",
             f"must be in [0, sampling.num_steps] = [0, {s.num_steps}], got {g.sde_window}")
    rng = g.sde_window_range or [0, s.num_steps]
    _require(len(rng) == 2 and 0 <= rng[0] < rng[1] <= s.num_steps and rng[1] - rng[0] >= g.sde_window,
             "grpo.sde_window_range", "must be [lo, hi] with 0 <= lo < hi <= sampling.num_steps and hi - lo >= "
             f"grpo.sde_window, got {g.sde_window_range}")
    _require(s.ode_steps <= s.num_steps - g.sde_window, "sampling.ode_steps",
             f"must be in [0, num_steps - grpo.sde_window] = [0, {s.num_steps - g.sde_window}] (0: the schedule's "
             f"own steps), got {s.ode_steps}")
    if g.sde_window and g.sde_window_mode == "scattered":  # the compressed ODE re-spaces the steps around one window
        refuse_set(s, "sampling", ("ode_solver", "ode_steps"), "grpo.sde_window_mode is scattered (its SDE steps "
                   "need not be one window: the ODE between them runs on the schedule's own steps)")


def _refuse_other_algorithm(cfg: Config) -> None:
    """A key of an algorithm this run does not use, set, is refused naming the algorithm it belongs to: the SDE
    algorithms' keys of the grpo section under a forward-process one (GRPO_ONLY), the grpo keys an SDE unit does not
    read (GRPO_UNREAD), and every other algorithm's own section (OWN_SECTION)."""
    algo = cfg.train.algorithm

    def readers(key: str) -> str:  # the SDE algorithms that read grpo key `key`
        return ", ".join(a for a, kind in ROLLOUT_KIND.items() if kind == "sde" and key not in GRPO_UNREAD.get(a, {}))

    unread = GRPO_ONLY if cfg.forward_process else GRPO_UNREAD.get(algo, {})
    owned = [(cfg.grpo, "grpo", key, readers(key), why) for key, why in unread.items()]
    for other, name in OWN_SECTION.items():
        if other != algo:
            section = getattr(cfg, name)
            owned += [(section, name, f.name, other, "") for f in dataclasses.fields(section)]
    for section, prefix, key, owner, why in owned:
        if section.is_set(key):
            raise ConfigError(f"config key '{prefix}.{key}' belongs to train.algorithm {owner}; this run is "
                              f"{algo}{why.format(own=OWN_SECTION.get(algo))}: unset it ({prefix}.{key}=null)")


def validate_world(cfg: Config, world_size: int) -> None:
    """The checks that need the launch's process count (jagg-train runs them before building anything, with the
    world size the launcher's environment gives: parallel.ranks.discover). Without them a config that cannot run
    on this many ranks fails only after every rank has loaded its models, or at the first step."""
    world_size = cfg.pools.checked_trainers(world_size)  # the checks below are the trainer pool's: the run's engine
    p = cfg.parallel
    if world_size > 1:
        _require(p.engine != "none", "parallel.engine",
                 f"none runs one process, but the launcher started {world_size}: use fsdp2 (or deepspeed)")
        _require(cfg.jagg.probe_every == 0, "jagg.probe_every",
                 f"(the exact-gradient probe) runs on one process, not {world_size}: set it to 0")
    sp = p.sequence_parallel
    _require(world_size % sp == 0, "parallel.sequence_parallel",
             f"{sp} must divide the world size {world_size} (groups of {sp} ranks hold the same rows)")
    groups = world_size // sp
    if cfg.reward.shard and world_size > 1:  # sharded scoring runs inline on every rank (trainer: background)
        refuse_set(cfg.reward, "reward", ("deadline_s",), f"reward.shard on {world_size} ranks scores inside the "
                   "rollout (no background scorer), which no deadline cuts off")
    _require(cfg.train.minibatch_size % groups == 0, "train.minibatch_size",
             f"{cfg.train.minibatch_size} must be divisible by the {groups} data-parallel groups of the world size "
             f"{world_size} (each trains its share)")
    _require(p.engine != "fsdp2" or world_size % p.replicate == 0, "parallel.replicate",
             f"{p.replicate} must divide the world size {world_size} (HSDP: replicas x shards; the node count on "
             "several nodes)")


def _warn_window(cfg: Config) -> None:
    """A JAGG window longer than the steps trained per training step is one window of all of them: legal, but likely
    not what was meant (say, after lowering sampling.num_steps), so say so."""
    window = getattr(cfg.jagg.make_planner(), "window", None)
    trained = cfg.trained_per_sample
    if window is not None and window > trained:
        log.warning("config key 'jagg.window' is %d, more than the %d steps trained per training step "
                    "(sampling.num_steps, grpo.timestep_fraction, grpo.sde_window): one window of all %d is used",
                    window, trained, trained)


def _check_rewards(r: RewardConfig, deadline_s: float) -> None:
    """Every reward named exists and takes the options given, checked without building it (models load later); a
    reward that retries requests retries within the reward's deadline (rewards/remote.py retry_budget_problem)."""
    from .. import rewards  # noqa: F401  (importing the package registers the built-in rewards)
    from ..rewards.base import check_reward
    from ..rewards.multi import reward_specs
    from ..rewards.remote import retry_budget_problem

    for name, _, options in reward_specs(r):
        name_key, options_key = ((f"reward.components.{name}",) * 2 if r.components
                                 else ("reward.name", "reward.options"))
        try:
            cls = check_reward(name, options)
        except KeyError as err:  # UnknownRewardError
            raise ConfigError(f"config key '{name_key}': {err}") from None
        except TypeError as err:
            raise ConfigError(f"config key '{options_key}': {err}") from None
        problem = retry_budget_problem(cls, options, deadline_s)
        _require(problem is None, options_key, problem or "")


def _pretrained_path(cfg: Config):
    """model.pretrained as a local path (a hub id: from the hub cache, nothing downloaded here), or None when it
    is a hub id not cached yet that model.allow_download will fetch when the model is built."""
    from ..hub import HubModelNotFoundError
    from ..models import pretrained_path

    try:
        return pretrained_path(cfg.model, allow_download=False)
    except HubModelNotFoundError as err:
        if cfg.model.allow_download:
            return None
        raise ConfigError(f"config key 'model.pretrained': {err}") from None


def _check_files(cfg: Config) -> None:
    from ..data.fetch import fetch_hint
    from ..data.prompts import prompt_file_problem
    from ..models import safetensors_problem

    pretrained = _pretrained_path(cfg) if cfg.model.pretrained else None
    for key, value in (("data.prompt_file", cfg.data.prompt_file),
                       ("eval.prompt_file", cfg.eval.prompt_file if cfg.eval.enabled else None),
                       ("model.pretrained", pretrained if cfg.model.kind == "dit" else None)):
        _require(value is None or resolve_path(value).is_file(), key,
                 f"names a file that does not exist: {value}{fetch_hint(value)}")
        if value is not None:
            problem = (safetensors_problem if key == "model.pretrained" else prompt_file_problem)(resolve_path(value))
            _require(problem is None, key, problem)
    if cfg.model.kind == "dit":
        check_experts(cfg, False)  # the built-in DiT is one transformer
    if cfg.model.kind != "dit" and pretrained is not None:
        _require((pretrained / "model_index.json").is_file(), "model.pretrained",
                 f"is not a diffusers pipeline directory (no model_index.json): {cfg.model.pretrained}")
        check_experts(cfg, pipeline_has_experts(pretrained))  # Wan2.2 A14B's two experts (config_experts.py)
        problem = family(cfg.model.kind).check(cfg.model, pretrained) if family(cfg.model.kind).check else None
        _require(problem is None, *(problem or ("", "")))  # the family's shape rules (e.g. Wan's frames)
    if cfg.parallel.engine == "deepspeed":
        from ..parallel.deepspeed_engine import deepspeed_problem

        problem = deepspeed_problem()
        _require(problem is None, "parallel.engine", problem)
        _require(cfg.model.dtype != "float16" or (cfg.run.device != "cpu" and torch.cuda.is_available()), "model.dtype",
                 "float16 with parallel.engine deepspeed needs a GPU: DeepSpeed has no fp16 on the CPU")


def load_prompt_file(key: str, value: str):
    """The prompts of the file config key `key` names. One whose lines are all bad records (not JSON, no `prompt`)
    passes the cheap checks of `validate` but holds no prompt: a ConfigError naming the key, as an empty one is."""
    from ..data import load_prompts

    try:
        return load_prompts(resolve_path(value))
    except ValueError as err:
        raise ConfigError(f"config key '{key}': {err}") from None
