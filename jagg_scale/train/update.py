"""One minibatch's gradient: plan windows, route them, and run the JAGG or per-step backward on each.

This is where the trainer meets the algorithm. `jagg.mode: exact` is Flow-GRPO (every trained step its own
forward and backward); `jagg.mode: jagg` plans windows of `jagg.window` steps and sends the routed ones through
`jagg_backward`. A window that is not routed runs the very same per-step code as exact mode, which is why
jagg_frac = 0 reproduces Flow-GRPO's gradients bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..grpo.loss import GRPOStepLoss
from ..jagg import exact_backward, jagg_backward, plan_windows, route_windows
from ..jagg.backward import ModelFn
from ..models.base import Cond


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

    def add(self, other: "BackwardStats") -> None:
        for name in ("windows", "windows_jagg", "backward_calls", "backward_passes", "per_step_equiv",
                     "nograd_forward_passes", "loss"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.intermediate += other.intermediate
        self.cosines += other.cosines


def resolve_intermediate(setting: str, on_policy: bool) -> str:
    """`auto`: cached velocities are exact while the parameters are the rollout's, stale after any optimizer
    step (the design doc measured gradient cosine 0.16 cached vs 0.80 forward after one Adam step)."""
    if setting != "auto":
        return setting
    return "cached" if on_policy else "forward"


def step_grad_norms(loss: GRPOStepLoss, velocities: torch.Tensor, steps: list[int]) -> list[float]:
    """|g_k| = |dL_k/dv_k| at the given velocities, for steps k (no transformer pass). Metrics are not recorded."""
    probe = GRPOStepLoss(loss.batch, loss.noise_level, loss.clip_range, loss.beta, loss.scale)
    norms = [0.0] * velocities.shape[0]
    for k in steps:
        v = velocities[k].detach().float().requires_grad_(True)
        (g,) = torch.autograd.grad(probe(k, v), v)
        norms[k] = float(g.norm())
    return norms


def backward_minibatch(
    model_fn: ModelFn,
    cond: Cond,
    loss: GRPOStepLoss,
    steps: list[int],
    *,
    mode: str,
    window: int,
    jagg_frac: float,
    route_by: str = "vcos",
    min_cos: float | None = None,
    intermediate: str = "auto",
    on_policy: bool = True,
) -> BackwardStats:
    """Accumulate the gradient of sum over `steps` of loss(k, v_k) into .grad; returns what it cost."""
    batch = loss.batch
    stats = BackwardStats(per_step_equiv=len(steps))
    if mode == "exact":
        windows, use_jagg = [[k] for k in steps], [False] * len(steps)
    else:
        windows = plan_windows(steps, window)
        grad_norms = step_grad_norms(loss, batch.velocities, steps) if route_by == "weighted" else None
        routing = route_windows(windows, batch.velocities, jagg_frac=jagg_frac, route_by=route_by,
                                min_cos=min_cos, grad_norms=grad_norms)
        use_jagg = routing.use_jagg
        stats.cosines = routing.cosines
    value_mode = resolve_intermediate(intermediate, on_policy)
    for win, jagg in zip(windows, use_jagg):
        idx = torch.tensor(win, device=batch.latents.device)
        latents, sigmas = batch.latents[idx], batch.sigmas[idx].to(batch.latents.device)

        def step_loss(j: int, v: torch.Tensor, win=win) -> torch.Tensor:
            return loss(win[j], v)

        stats.windows += 1
        if jagg:
            window_loss = jagg_backward(model_fn, latents, sigmas, cond, step_loss, cached_velocities=batch.velocities[idx],
                          intermediate=value_mode)
            stats.windows_jagg += 1
            stats.backward_calls += 1
            stats.backward_passes += min(2, len(win))
            stats.nograd_forward_passes += max(0, len(win) - 2) if value_mode == "forward" else 0
            stats.intermediate.append(value_mode)
        else:
            window_loss = exact_backward(model_fn, latents, sigmas, cond, step_loss)
            stats.backward_calls += len(win)
            stats.backward_passes += len(win)
        stats.loss += float(window_loss)
    return stats
