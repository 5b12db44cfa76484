"""The checks across sections of a forward-process algorithm (config.py ROLLOUT_KIND "ode": DiffusionNFT, AWM), what
a frozen model run at a plan's knots needs (grpo.ref_at, nft.old_at, awm.frozen_at knots), and what the update's
refresh at the knots needs (grpo.refresh_at knots). config.validate calls them; every error is a ConfigError naming
the dotted key."""

from __future__ import annotations

from .config_sections import SamplingConfig, _require

__all__ = ["FIXED_WINDOWS", "check_forward_process", "check_refresh_at", "fixed_windows"]

# what grpo.ref_at knots and nft.old_at knots need: JAGG windows known before the rollout (the frozen models run at
# their knots before the plan of a minibatch would be made)
FIXED_WINDOWS = ("knots evaluates a frozen model at the JAGG plan's knots alone: it needs windows known before "
                 "the rollout (jagg.mode jagg with jagg.planner uniform and jagg_frac 1, no min_cos; or share_knots "
                 "true); with another plan set it to its default (grpo.ref_at=steps, nft.old_at=timesteps, "
                 "awm.frozen_at=timesteps)")

# why a forward-process algorithm samples and trains CFG-free
_CFG_FREE = {"nft": "DiffusionNFT samples and trains CFG-free",
             "awm": "the forward-process update trains CFG-free, as Flow-Factory's AWM recipes sample at "
                    "guidance_scale 1.0 (examples/awm/lora/sd3_5/default.yaml:71)"}
# the own section's key that places its frozen models at the knots
_FROZEN_KEY = {"nft": "old_at", "awm": "frozen_at"}


def fixed_windows(cfg) -> bool:
    return cfg.jagg.mode == "jagg" and cfg.jagg.make_planner().fixed_plan(2) is not None


def check_forward_process(cfg, name: str) -> None:
    """A forward-process run (train.algorithm's own section `name`): its rollout is a deterministic CFG-free ODE,
    a noise draw per JAGG window needs the window planner, frozen models at the knots a plan known in advance."""
    s, algo, own = cfg.sampling, cfg.train.algorithm, cfg.algorithm_section
    _require(not s.same_initial_noise, "sampling.same_initial_noise",
             f"would make every row of a group the same sample: train.algorithm {algo}'s rollout is the deterministic "
             "ODE (DiffusionNFT's config/nft.py:65), so a shared start leaves nothing to compare in a group")
    default = SamplingConfig()
    for key in ("sde", "noise_level"):  # the forward-process rollout is deterministic: no SDE to shape
        _require(getattr(s, key) == getattr(default, key), f"sampling.{key}",
                 f"shapes the SDE of a GRPO rollout; train.algorithm {algo}'s is the ODE: leave it out")
    _require(s.guidance == 1.0, "sampling.guidance", f"must be 1 with train.algorithm {algo} ({_CFG_FREE[algo]})")
    kind = cfg.jagg.planner_kind
    _require(own.noise != "per_window" or kind == "window", f"{name}.noise",
             f"per_window draws one noise per JAGG window: it needs the window planner (jagg.mode jagg, jagg.planner "
             f"uniform, jagg.share_knots false), this run has the {kind} planner")
    _require(not own.frozen_at_knots or fixed_windows(cfg), f"{name}.{_FROZEN_KEY[algo]}", FIXED_WINDOWS)
    if algo == "awm":
        _check_awm(cfg)


def _check_awm(cfg) -> None:
    """AWM's keys across sections: it counts its own training timesteps, and a JAGG plan without the EMA policy's
    velocities has no cached values to interpolate from or rank windows by (train/awm.py)."""
    _require(not cfg.grpo.is_set("timestep_fraction"), "grpo.timestep_fraction",
             "is not read by train.algorithm awm: its training timesteps are awm.num_train_timesteps of "
             "awm.timestep_range: unset it (grpo.timestep_fraction=null)")
    if cfg.awm.uses_ema or cfg.jagg.mode == "exact":
        return
    why = ("holds no cached velocities without the EMA policy (awm.ema_kl_beta 0, awm.off_policy false): the "
           "interior timesteps' values come from the knots alone")
    _require(cfg.jagg.intermediate != "cached", "jagg.intermediate", f"cached {why}: use interpolate or forward")
    _require(fixed_windows(cfg), "jagg.planner", f"reads the velocities to plan, and train.algorithm awm {why}: use "
             "fixed windows (jagg.planner uniform with jagg_frac 1 and no min_cos, or share_knots)")


def check_refresh_at(cfg) -> None:
    """grpo.refresh_at knots under an SDE algorithm that reads it (grpo, dppo: train/update.py): after an optimizer
    step the values of the plan's interpolated steps come from its knots, so there must be interpolated steps, an
    optimizer step before a minibatch, and something the key changes; the conditional interior values must be the
    knots' (interpolate), as the unconditional ones are."""
    g, j = cfg.grpo, cfg.jagg
    if g.refresh_at != "knots":
        return
    K = cfg.trained_per_sample
    _require(j.mode == "jagg" and j.make_planner().max_interior(K) > 0, "grpo.refresh_at",
             f"knots takes the values of the JAGG plan's interpolated steps from its knots, but this plan has none "
             f"(jagg.mode exact, a window of <= 2 steps, jagg_frac 0, or a budget of all {K} steps): every trained "
             "step is a knot, recomputed as under steps: leave it out")
    _require(j.intermediate in ("auto", "interpolate"), "jagg.intermediate",
             f"{j.intermediate} with grpo.refresh_at knots: the interior velocities after an optimizer step are the "
             "rollout's moved by the knots' drift (interpolate), as the unconditional predictions are; "
             + ("forward recomputes them: set grpo.refresh_at steps" if j.intermediate == "forward" else
                "cached would leave them stale beside refreshed unconditional ones: use auto or interpolate"))
    _require(cfg.sampling.guidance != 1.0 or j.intermediate == "auto", "grpo.refresh_at",
             "knots changes nothing here: without CFG (sampling.guidance 1) it only chooses jagg.intermediate auto's "
             "values after an optimizer step, and jagg.intermediate interpolate chose them already: leave it out")
    _require(cfg.optimizer_steps_per_step > 1, "grpo.refresh_at",
             "knots acts after an optimizer step on a rollout, but this run takes one optimizer step per rollout "
             "(train.minibatch_size = train.prompts_per_step x grpo.group_size, grpo.inner_epochs 1): nothing is "
             "refreshed: leave it out")
