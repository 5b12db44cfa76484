"""One minibatch's gradient: plan windows, route them, and run the JAGG or per-step backward on each.

This is where the trainer meets the algorithm. `jagg.mode: exact` is Flow-GRPO (every trained step its own
forward and backward); `jagg.mode: jagg` plans windows of `jagg.window` steps and sends the routed ones through
`jagg_backward`. A window that is not routed runs the very same per-step code as exact mode, which is why
jagg_frac = 0 reproduces Flow-GRPO's gradients bit for bit.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..grpo.loss import GRPOStepLoss
from ..jagg import exact_backward, jagg_backward, plan_windows, route_windows
from ..jagg.knots import (budget_for_speedup, cosine_error, knot_backward, plan_from_costs, plan_knots, plan_uniform,
                          residual_error, segment_costs, velocity_cosines)
from ..jagg.backward import ModelFn, backward_through
from ..cond import Cond
from .config import JAGGConfig


@dataclass
class BackwardStats:
    """Transformer work of one or more minibatches, counted in passes over B rows (one per-step pass = 1)."""

    windows: int = 0
    windows_jagg: int = 0
    backward_calls: int = 0  # backward() calls through the transformer
    backward_passes: int = 0  # in B-row units: a JAGG joint pass counts 2
    per_step_equiv: int = 0  # what Flow-GRPO would have spent: one per trained step
    nograd_forward_passes: int = 0  # extra no-grad forwards of the `forward` intermediate mode
    loss: float = 0.0  # sum over trained steps of the (scaled) step losses
    intermediate: list = field(default_factory=list)
    cosines: list = field(default_factory=list)
    knots: list = field(default_factory=list)  # knot plans: the trained-step indices computed exactly, per minibatch

    def add(self, other: "BackwardStats") -> None:
        for name in ("windows", "windows_jagg", "backward_calls", "backward_passes", "per_step_equiv",
                     "nograd_forward_passes", "loss"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.intermediate += other.intermediate
        self.cosines += other.cosines
        self.knots += other.knots


def resolve_intermediate(setting: str, on_policy: bool) -> str:
    """`auto`: cached velocities are exact while the parameters are the rollout's, stale after any optimizer
    step (the design doc measured gradient cosine 0.16 cached vs 0.80 forward after one Adam step)."""
    if setting != "auto":
        return setting
    return "cached" if on_policy else "forward"


def step_grad_norms(loss: GRPOStepLoss, velocities: torch.Tensor, steps: list[int]) -> list[float]:
    """|g_k| = |dL_k/dv_k| at the given velocities, for steps k (no transformer pass, no metrics recorded)."""
    probe = loss.fresh()
    norms = [0.0] * velocities.shape[0]
    for k in steps:
        v = velocities[k].detach().float().requires_grad_(True)
        (g,) = torch.autograd.grad(probe(k, v), v)
        norms[k] = float(g.norm())
    return norms


@dataclass
class WindowPlan:
    windows: list[list[int]]
    use_jagg: list[bool]
    cosines: list[float]


def plan_minibatch(loss: GRPOStepLoss, steps: list[int], cfg: JAGGConfig, reduce=None) -> WindowPlan:
    """Windows over the trained steps and which of them JAGG takes (mode exact: every step its own window).
    `reduce` combines routing statistics over ranks (see route_windows) so every rank runs the same plan."""
    if cfg.mode == "exact":
        return WindowPlan([[k] for k in steps], [False] * len(steps), [])
    velocities = loss.batch.velocities
    windows = plan_windows(steps, cfg.window)
    grad_norms = step_grad_norms(loss, velocities, steps) if cfg.route_by == "weighted" else None
    routing = route_windows(windows, velocities, jagg_frac=cfg.jagg_frac, route_by=cfg.route_by,
                            min_cos=cfg.min_cos, grad_norms=grad_norms, reduce=reduce)
    return WindowPlan(windows, routing.use_jagg, routing.cosines)


def backward_window(model_fn: ModelFn, cond: Cond, loss: GRPOStepLoss, window: list[int], use_jagg: bool,
                    intermediate: str) -> torch.Tensor:
    """The gradient of one window into .grad: JAGG's joint backward, or Flow-GRPO's per-step one."""
    batch = loss.batch
    idx = torch.tensor(window, device=batch.latents.device)
    latents, sigmas = batch.latents[idx], batch.sigmas[idx].to(batch.latents.device)

    def step_loss(j: int, v: torch.Tensor) -> torch.Tensor:
        return loss(window[j], v)

    if use_jagg:
        return jagg_backward(model_fn, latents, sigmas, cond, step_loss, cached_velocities=batch.velocities[idx],
                             intermediate=intermediate)
    return exact_backward(model_fn, latents, sigmas, cond, step_loss)


Backward = Callable[..., None]  # the training engine's backward(out, grad=None, *, last=True)


def _routed(backward: Backward | None, last: bool):
    """Every backward inside goes through `backward(out, grad, last=last)` (plain autograd without one)."""
    if backward is None:
        return nullcontext()
    return backward_through(lambda out, grad=None: backward(out, grad, last=last))


def backward_minibatch(model_fn: ModelFn, cond: Cond, loss: GRPOStepLoss, steps: list[int], cfg: JAGGConfig, *,
                       on_policy: bool, backward: Backward | None = None, reduce=None) -> BackwardStats:
    """Accumulate the gradient of sum over `steps` of loss(k, v_k) into .grad; returns what it cost.

    Every backward runs through the engine's `backward(out, grad, last=...)` (a sharded engine synchronises
    gradients only when last is True, the accumulation boundary). An exact window is split into its single steps
    for that, so the boundary is the last backward of the minibatch whatever the plan; the gradient is the same
    per-step code."""
    value_mode = resolve_intermediate(cfg.intermediate, on_policy)
    if uses_knots(cfg):
        return backward_knots(model_fn, cond, loss, steps, cfg, value_mode, backward, reduce)
    plan = plan_minibatch(loss, steps, cfg, reduce)
    stats = BackwardStats(per_step_equiv=len(steps), cosines=plan.cosines)
    units = [(win, True) if jagg else ([k], False) for win, jagg in zip(plan.windows, plan.use_jagg)
             for k in (win[:1] if jagg else win)]
    for i, (unit, jagg) in enumerate(units):
        with _routed(backward, last=i == len(units) - 1):
            stats.loss += float(backward_window(model_fn, cond, loss, unit, jagg, value_mode))
    for win, jagg in zip(plan.windows, plan.use_jagg):
        stats.windows += 1
        if jagg:
            stats.windows_jagg += 1
            stats.backward_calls += 1
            stats.backward_passes += min(2, len(win))
            stats.nograd_forward_passes += max(0, len(win) - 2) if value_mode == "forward" else 0
            stats.intermediate.append(value_mode)
        else:
            stats.backward_calls += len(win)
            stats.backward_passes += len(win)
    return stats


# ------------------------------------------------------------------------------------------------- knot plans


def uses_knots(cfg: JAGGConfig) -> bool:
    return cfg.mode == "jagg" and (cfg.plan == "budget" or cfg.share_knots)


def plan_knot_minibatch(loss: GRPOStepLoss, steps: list[int], cfg: JAGGConfig, reduce=None) -> list[tuple[int, int]]:
    """The knot plan over positions 0..T-1 of the trained steps. `budget`: the DP on the error model, fed with
    what is known before any backward: |g_k| at the rollout's velocities and their interpolation residuals (or
    endpoint cosines). With data parallelism the per-rank cost tables are averaged first (same plan everywhere)."""
    T = len(steps)
    if cfg.plan == "uniform":
        return plan_uniform(T, cfg.window, share=cfg.share_knots)
    batch = loss.batch
    idx = torch.tensor(steps, device=batch.velocities.device)
    velocities, sigmas = batch.velocities[idx], batch.sigmas[idx].cpu()
    norms = step_grad_norms(loss, batch.velocities, steps)
    g = [norms[k] for k in steps]
    if reduce is not None:
        g = reduce(g, "norm")
    error_fn = (residual_error(velocities.cpu(), sigmas) if cfg.error_model == "residual"
                else cosine_error(velocity_cosines(velocities.cpu()), sigmas))
    C = segment_costs(g, error_fn)
    if reduce is not None:
        C = torch.tensor(reduce(C.flatten().tolist(), "mean"), dtype=torch.float64).reshape(T, T)
    return plan_from_costs(C, budget_for_speedup(T, cfg.speedup))


def backward_knots(model_fn: ModelFn, cond: Cond, loss: GRPOStepLoss, steps: list[int], cfg: JAGGConfig,
                   value_mode: str, backward: Backward | None = None, reduce=None, plan=None) -> BackwardStats:
    """A knot plan's gradient in chunks of rows_per_pass knots (one forward + backward each). Gradients are
    synchronised per chunk (one all-gather and one reduce-scatter cycle per chunk under sharding)."""
    plan = plan if plan is not None else plan_knot_minibatch(loss, steps, cfg, reduce)
    batch = loss.batch
    idx = torch.tensor(steps, device=batch.latents.device)
    with _routed(backward, last=True):
        total = knot_backward(model_fn, plan, batch.latents[idx], batch.sigmas[idx].to(batch.latents.device), cond,
                              lambda j, v: loss(steps[j], v), cached_velocities=batch.velocities[idx],
                              intermediate=value_mode, rows_per_pass=cfg.rows_per_pass)
    knots = plan_knots(plan)
    interior = [b - a - 1 for a, b in plan if b > a + 1]
    return BackwardStats(
        windows=len(plan), windows_jagg=len(interior), backward_calls=-(-len(knots) // cfg.rows_per_pass),
        backward_passes=len(knots), per_step_equiv=len(steps),
        nograd_forward_passes=sum(interior) if value_mode == "forward" else 0, loss=float(total),
        intermediate=[value_mode] * len(interior), knots=[[steps[q] for q in knots]])


def _flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def probe_minibatch(model_fn: ModelFn, cond: Cond, loss: GRPOStepLoss, steps: list[int], cfg: JAGGConfig,
                    params: list[torch.nn.Parameter], *, on_policy: bool) -> dict:
    """The fidelity probe: the exact per-step gradient beside the JAGG one on the same minibatch, per window and
    overall (cosine and norm ratio |g_jagg| / |g_exact|). Leaves .grad cleared, so the update is unchanged."""
    value_mode = resolve_intermediate(cfg.intermediate, on_policy)
    probe_loss = loss.fresh()
    if uses_knots(cfg):  # the whole minibatch: exact per-step gradient vs the knot plan's
        grads = []
        for p in params:
            p.grad = None
        backward_window(model_fn, cond, probe_loss, steps, False, value_mode)
        grads.append(_flat_grad(params))
        for p in params:
            p.grad = None
        backward_knots(model_fn, cond, probe_loss, steps, cfg, value_mode)
        grads.append(_flat_grad(params))
        for p in params:
            p.grad = None
        exact, approx = grads
        return {"probe_cos": _cos(approx, exact), "probe_norm_ratio": float(approx.norm() / exact.norm().clamp_min(1e-30))}
    plan = plan_minibatch(loss, steps, cfg)
    total_exact = total_jagg = None
    out: dict = {}
    for i, (win, jagg) in enumerate(zip(plan.windows, plan.use_jagg)):
        grads = []
        for use in (False, jagg):
            for p in params:
                p.grad = None
            backward_window(model_fn, cond, probe_loss, win, use, value_mode)
            grads.append(_flat_grad(params))
        exact, approx = grads
        out[f"probe_cos_w{i}"] = _cos(approx, exact)
        out[f"probe_norm_ratio_w{i}"] = float(approx.norm() / exact.norm().clamp_min(1e-30))
        total_exact = exact if total_exact is None else total_exact + exact
        total_jagg = approx if total_jagg is None else total_jagg + approx
    for p in params:
        p.grad = None
    out["probe_cos"] = _cos(total_jagg, total_exact)
    out["probe_norm_ratio"] = float(total_jagg.norm() / total_exact.norm().clamp_min(1e-30))
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0, eps=1e-30))
