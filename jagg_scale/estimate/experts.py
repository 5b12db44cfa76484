"""The estimate of a two-expert pipeline (Wan2.2 A14B: `transformer` and `transformer_2`, switched by noise level;
models/wan_experts.py). Both experts are held, only the active one computes:

    memory    both experts' parameters, in whatever the transformer's count drives (weights, gradients, optimizer
              states, EMA, the KL reference, the FSDP2 root gathered), `expert_stats`' `held`; a pass's activations
              are one expert's (the same measured coefficients: the experts have one architecture, checked)
    step time a pass's FLOPs and its per-block gathers and reduces are one expert's (`pass_`), its root both
              experts' (FSDP2 wraps the two-expert module's root as one unit)
    the plan  the planner cut at the switch (jagg/planners.py with_switch) over the trained steps' sigmas of the
              run's schedule (sampling.shift, or the pipeline scheduler's own), so the backward passes counted are
              the trainer's

A shape file says a pipeline has two experts by its `transformer_2` component and an `experts` entry (boundary_ratio
and the scheduler, as model_index.json and scheduler/scheduler_config.json hold them: shapes.py).
"""

from __future__ import annotations

import importlib

import torch

from ..jagg.experts import ExpertSwitch
from .shapes import ShapeError, clean, transformer_stats

__all__ = ["expert_stats", "plan_sigmas", "shape_switch"]


def expert_stats(comps: dict, rank: int, targets) -> tuple[dict, dict]:
    """(held, pass_) transformer stats: with one transformer both are its own; with a transformer_2, `held` sums the
    two experts (their blocks one after the other) and `pass_` is one expert's blocks with both roots."""
    one = transformer_stats(comps["transformer"], rank, targets)
    if "transformer_2" not in comps:
        return one, one
    a, b = comps["transformer"], comps["transformer_2"]
    if (a["class"], clean(a["config"])) != (b["class"], clean(b["config"])):
        raise ShapeError(f"the estimator sizes two experts of one architecture; transformer is {a['class']} "
                         f"{clean(a['config'])}, transformer_2 {b['class']} {clean(b['config'])}")
    two = transformer_stats(b, rank, targets)
    held = {k: one[k] + two[k] for k in ("params", "buffers", "root_params", "lora_params", "lora_modules",
                                          "block_params", "block_lora")}
    return held, dict(held, block_params=one["block_params"], block_lora=one["block_lora"])


def shape_switch(shapes: dict) -> ExpertSwitch | None:
    """The switch of a two-expert shape (None: one transformer); a transformer_2 without its boundary_ratio and
    scheduler is a ShapeError naming what is missing."""
    if "transformer_2" not in shapes["components"]:
        return None
    experts = shapes.get("experts") or {}
    if experts.get("boundary_ratio") is None or "scheduler" not in experts:
        raise ShapeError(f"{shapes.get('name')}: a transformer_2 without experts.boundary_ratio and "
                         "experts.scheduler (the pipeline never runs it without a boundary_ratio)")
    sched = _scheduler(experts["scheduler"])
    sched.set_timesteps(2)
    return ExpertSwitch(float(experts["boundary_ratio"]), int(sched.config.num_train_timesteps),
                        integer_timesteps=not torch.is_floating_point(sched.timesteps))


def plan_sigmas(cfg, experts: dict | None, trained: int) -> torch.Tensor:
    """The noise levels of the first `trained` steps of the run's schedule: sampling.shift's (grpo/schedule.py), or
    with shift null the pipeline scheduler's own sigmas (models/wan.py pipeline_sigmas; `experts`: the shapes'
    entry, its scheduler). Two experts allow
    grpo.step_selection first only (train/config_experts.py): the trained steps are the schedule's first ones (an
    SDE window's move with the step; its first position is taken)."""
    from ..grpo.schedule import sigma_schedule

    S = cfg.sampling.num_steps
    if cfg.sampling.shift is not None:
        sigmas = sigma_schedule(S, cfg.sampling.shift)
    else:
        sched = _scheduler((experts or {})["scheduler"])
        sched.set_timesteps(S)
        sigmas = sched.sigmas.float()
    start = (cfg.grpo.sde_window_range or [0])[0] if cfg.grpo.sde_window else 0
    return sigmas[start:start + trained]


def _scheduler(spec: dict):
    cls = getattr(importlib.import_module("diffusers"), spec["class"])
    return cls.from_config(spec["config"])
