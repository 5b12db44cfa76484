"""One minibatch's gradient: choose its knot plan, then run the plan through the gradient engine.

Every configuration is a knot plan (jagg/plans.py) over the trained steps of the minibatch:

    jagg.mode exact                 Flow-GRPO: a lone segment per step (one forward + backward each)
    jagg.plan uniform               windows of jagg.window steps; the jagg_frac routed ones are segments (one joint
                                    pass each), the others lone steps, so jagg_frac = 0 is Flow-GRPO bit for bit
    jagg.plan uniform, share_knots  windows sharing their boundary knots, in passes of jagg.rows_per_pass knots
    jagg.plan budget                the DP planner's knots (jagg/knots.py), in passes of jagg.rows_per_pass knots

and every plan runs through `knot_backward` (jagg/backward.py), the one place a transformer backward happens.
One synchronisation rule for all of them: the engine's `backward(out, grad, last)` is told `last` only on the
minibatch's final backward, the accumulation boundary where a sharded engine reduces gradients across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cond import Cond, index_cond
from ..grpo.loss import GRPOStepLoss, StepBatch
from ..jagg import (Backward, ModelFn, Plan, autograd_backward, budget_for_speedup, cosine_error, exact_plan, knot_backward,
                    knots_from_windows, pass_groups, plan_from_costs, plan_knots, plan_uniform, plan_windows,
                    residual_error, restrict_plan, route_windows, segment_costs, velocity_cosines)
from .config import JAGGConfig


@dataclass
class MinibatchPlan:
    """The knot plan of a minibatch over positions 0 .. T-1 of its trained steps, and how it came about."""

    plan: Plan
    rows_per_pass: int | None  # None: one pass per segment (jagg/plans.py pass_groups)
    windows: list[list[int]] | None = None  # uniform windows (positions): the unit of routing and of the probe
    windows_jagg: int = 0  # routed windows, or the planner's interpolated segments
    cosines: list[float] = field(default_factory=list)  # endpoint-velocity cosine per window (routing)

    @property
    def num_windows(self) -> int:
        return len(self.windows) if self.windows is not None else len(self.plan)


@dataclass
class BackwardStats:
    """Transformer work of one or more minibatches, counted in passes over B rows (one per-step pass = 1)."""

    windows: int = 0
    windows_jagg: int = 0
    backward_calls: int = 0  # backward() calls through the transformer
    backward_passes: int = 0  # in B-row units: a JAGG joint pass counts 2
    per_step_equiv: int = 0  # what Flow-GRPO would have spent: one per trained step
    nograd_forward_passes: int = 0  # extra no-grad forwards of the `forward` intermediate mode
    intermediate_forward: int = 0  # windows whose intermediate values came from fresh no-grad forwards
    uncond_forward_passes: int = 0  # CFG: no-grad unconditional forwards (B rows) after an optimizer step
    loss: float | torch.Tensor = 0.0  # sum over trained steps of the (scaled) step losses (0-d: read when logged)
    cosines: list = field(default_factory=list)
    knots: list = field(default_factory=list)  # knot plans: the trained-step indices computed exactly, per minibatch

    def add(self, other: "BackwardStats") -> None:
        for name in ("windows", "windows_jagg", "backward_calls", "backward_passes", "per_step_equiv",
                     "nograd_forward_passes", "intermediate_forward", "uncond_forward_passes", "loss"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.cosines += other.cosines
        self.knots += other.knots


def resolve_intermediate(setting: str, on_policy: bool) -> str:
    """`auto`: cached velocities are exact while the parameters are the rollout's, stale after any optimizer
    step (measured: gradient cosine 0.16 cached vs 0.80 forward after one Adam step, docs/algorithm.md section 3)."""
    if setting != "auto":
        return setting
    return "cached" if on_policy else "forward"


def _rows(t: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """t[steps] along dim 0; a view when the steps are consecutive (they always are in training)."""
    if steps == list(range(steps[0], steps[0] + len(steps))):
        return t[steps[0] : steps[0] + len(steps)]
    return t[torch.tensor(steps, device=t.device)]


def step_grad_norms(loss: GRPOStepLoss, batch: StepBatch, steps: list[int]) -> list[float]:
    """|g_k| = |dL_k/dv_k| at the rollout's velocities for each trained step (positions of `steps`); no
    transformer pass, no metrics recorded."""
    probe = loss.fresh()
    norms = []
    for k in steps:
        v = batch.velocities[k].detach().float().requires_grad_(True)
        (g,) = torch.autograd.grad(probe(batch, k, v), v)
        norms.append(float(g.norm()))
    return norms


def plan_minibatch(loss: GRPOStepLoss, batch: StepBatch, steps: list[int], cfg: JAGGConfig,
                   reduce=None) -> MinibatchPlan:
    """The minibatch's plan from what the rollout holds (no transformer pass). `reduce(values, how)` combines
    routing and planning statistics over ranks, so every rank runs the same plan (a sharded model's collectives
    must match)."""
    T = len(steps)
    if cfg.mode == "exact":
        return MinibatchPlan(exact_plan(T), None, windows=[[k] for k in range(T)])
    if cfg.plan == "uniform" and not cfg.share_knots:
        windows = plan_windows(range(T), cfg.window)
        grad_norms = step_grad_norms(loss, batch, steps) if cfg.route_by == "weighted" else None
        routing = route_windows(windows, _rows(batch.velocities, steps), jagg_frac=cfg.jagg_frac,
                                route_by=cfg.route_by, min_cos=cfg.min_cos, grad_norms=grad_norms, reduce=reduce)
        return MinibatchPlan(knots_from_windows(windows, use_jagg=routing.use_jagg), None, windows=windows,
                             windows_jagg=routing.num_jagg, cosines=routing.cosines)
    plan = plan_uniform(T, cfg.window, share=True) if cfg.plan == "uniform" else _budget_plan(loss, batch, steps,
                                                                                               cfg, reduce)
    return MinibatchPlan(plan, cfg.rows_per_pass, windows_jagg=sum(1 for a, b in plan if b > a + 1))


def _budget_plan(loss: GRPOStepLoss, batch: StepBatch, steps: list[int], cfg: JAGGConfig, reduce) -> Plan:
    """The DP on the error model, fed with |g_k| at the rollout's velocities and their interpolation residuals
    (or endpoint cosines). With data parallelism the per-rank cost tables are averaged first."""
    T = len(steps)
    velocities, sigmas = _rows(batch.velocities, steps).cpu(), _rows(batch.sigmas, steps).cpu()
    g = step_grad_norms(loss, batch, steps)
    if reduce is not None:
        g = reduce(g, "norm")
    error_fn = (residual_error(velocities, sigmas) if cfg.error_model == "residual"
                else cosine_error(velocity_cosines(velocities), sigmas))
    C = segment_costs(g, error_fn)
    if reduce is not None:
        C = torch.tensor(reduce(C.flatten().tolist(), "mean"), dtype=torch.float64).reshape(T, T)
    return plan_from_costs(C, budget_for_speedup(T, cfg.speedup))


def run_plan(model_fn: ModelFn, batch: StepBatch, cond: Cond, loss: GRPOStepLoss, steps: list[int], plan: Plan,
             rows_per_pass: int | None, intermediate: str, backward: Backward | None = None) -> torch.Tensor:
    """The plan's gradient over the trained `steps` into .grad (the engine call); returns the detached loss."""
    return knot_backward(model_fn, plan, _rows(batch.latents, steps), _rows(batch.sigmas, steps), cond,
                         loss.on(batch, steps), cached_velocities=_rows(batch.velocities, steps),
                         intermediate=intermediate, rows_per_pass=rows_per_pass, backward=backward)


def micro_batches(rows: int, micro_batch_size: int) -> list[slice]:
    """Row slices of `micro_batch_size` (0: one slice of all rows); the last one holds the remainder."""
    size = micro_batch_size or rows
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


def backward_minibatch(model_fn: ModelFn, batch: StepBatch, cond: Cond, loss: GRPOStepLoss, steps: list[int],
                       cfg: JAGGConfig, *, on_policy: bool, backward: Backward | None = None, reduce=None,
                       plan: MinibatchPlan | None = None, micro_batch_size: int = 0,
                       prepare: Callable[[StepBatch, slice], StepBatch] | None = None) -> BackwardStats:
    """Accumulate the gradient of sum over `steps` of L_k into .grad; returns what it cost.

    The minibatch is planned once (routing and the planner see all its rows; `plan` skips that) and run in
    micro-batches of `micro_batch_size` rows (0: all at once) with that plan: each row's loss terms are divided by
    the minibatch's denominator, so the accumulated gradient is the whole minibatch's. `prepare(batch, rows)` may
    refresh a micro-batch before its backward (CFG's unconditional predictions after an optimizer step).
    `backward` is the training engine's (plain autograd by default); its `last` is passed on only for the final
    micro-batch's final backward, the minibatch's accumulation boundary."""
    intermediate = resolve_intermediate(cfg.intermediate, on_policy)
    mb = plan if plan is not None else plan_minibatch(loss, batch, steps, cfg, reduce)
    backward = backward or autograd_backward
    chunks = micro_batches(batch.latents.shape[1], micro_batch_size)
    total = []
    for i, rows in enumerate(chunks):
        final = i == len(chunks) - 1
        sub, sub_cond = (batch, cond) if len(chunks) == 1 else (batch.rows(rows), index_cond(cond, rows))
        if prepare is not None:
            sub = prepare(sub, rows)

        def chunk_backward(out, grad, last, final=final):
            backward(out, grad, last=last and final)

        total.append(run_plan(model_fn, sub, sub_cond, loss, steps, mb.plan, mb.rows_per_pass, intermediate,
                              chunk_backward))
    knots = plan_knots(mb.plan)
    interior = sum(b - a - 1 for a, b in mb.plan if b > a + 1)
    return BackwardStats(
        windows=mb.num_windows, windows_jagg=mb.windows_jagg,
        backward_calls=len(pass_groups(mb.plan, mb.rows_per_pass)) * len(chunks),
        backward_passes=len(knots), per_step_equiv=len(steps),
        nograd_forward_passes=interior if intermediate == "forward" else 0,
        intermediate_forward=mb.windows_jagg if intermediate == "forward" else 0,
        loss=torch.stack(total).sum(), cosines=mb.cosines,
        knots=[] if mb.windows is not None else [[steps[q] for q in knots]])


def _flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def probe_minibatch(model_fn: ModelFn, batch: StepBatch, cond: Cond, loss: GRPOStepLoss, steps: list[int],
                    cfg: JAGGConfig, params: list[torch.nn.Parameter], *, on_policy: bool,
                    backward: Backward | None = None) -> dict:
    """The fidelity probe: the exact per-step gradient beside the plan's on the same minibatch, through the same
    engine, per window (uniform windows) and overall: cosine and norm ratio |g_plan| / |g_exact|. Leaves .grad
    cleared, so the update is unchanged."""
    intermediate = resolve_intermediate(cfg.intermediate, on_policy)
    probe_loss = loss.fresh()
    mb = plan_minibatch(probe_loss, batch, steps, cfg)
    pieces = mb.windows if mb.windows is not None else [list(range(len(steps)))]
    out: dict = {}
    totals = []
    for i, piece in enumerate(pieces):
        sub_steps = [steps[k] for k in piece]
        grads = []
        for plan, rows in ((exact_plan(len(piece)), None), (restrict_plan(mb.plan, piece), mb.rows_per_pass)):
            for p in params:
                p.grad = None
            run_plan(model_fn, batch, cond, probe_loss, sub_steps, plan, rows, intermediate, backward)
            grads.append(_flat_grad(params))
        if mb.windows is not None:
            out[f"probe_cos_w{i}"] = _cos(grads[1], grads[0])
            out[f"probe_norm_ratio_w{i}"] = _norm_ratio(grads[1], grads[0])
        totals = grads if not totals else [t + g for t, g in zip(totals, grads)]
    for p in params:
        p.grad = None
    exact, approx = totals
    out["probe_cos"] = _cos(approx, exact)
    out["probe_norm_ratio"] = _norm_ratio(approx, exact)
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0, eps=1e-30))


def _norm_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.norm() / b.norm().clamp_min(1e-30))
