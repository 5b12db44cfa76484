"""knot_backward: the one place a transformer backward happens, for every knot plan (plans.py).

Every per-step GRPO loss L_k depends on theta only through the velocity v_k = v_theta(x_k, s_k, c), so

    grad = sum_k g_k^T J_k,      g_k = dL_k / dv_k   (analytic in v_k: no transformer pass),
                                 J_k = d v_theta(x_k, s_k, c) / d theta.

JAGG replaces the intermediate Jacobians by their sigma-interpolation between the window's endpoints,
J_k ~ (1 - a_k) J_0 + a_k J_{W-1} with a_k = (s_k - s_0) / (s_{W-1} - s_0), so the window collapses into two
composite upstream gradients

    G_0 = sum_k (1 - a_k) g_k,     G_{W-1} = sum_k a_k g_k,     grad ~ G_0^T J_0 + G_{W-1}^T J_{W-1},

applied in ONE backward of ONE forward over the stacked endpoints [x_0; x_{W-1}] (2B rows). It is exact when
v is affine in (x, s) along a window whose inputs are collinear with the same weights, and always for W <= 2.

The g_k need a value for every intermediate velocity v_k (the endpoints use the fresh forward):
  cached       the rollout's stored v_k (exact on-policy, no extra forward)
  interpolate  c_k + (1 - a_k)(v_0 - c_0) + a_k (v_{W-1} - c_{W-1}): cached values moved by the endpoints' drift
  forward      a no-grad forward at (x_k, s_k) (W - 2 extra rows, exact values after optimizer steps)

The result equals autograd through the surrogate v~_k = value_k + (1 - a_k)(v_0 - sg v_0) + a_k (v_{W-1} - sg v_{W-1});
we form G_0 and G_{W-1} explicitly, which makes the single backward visible and cheap to count.

One function for every gradient: `knot_backward` runs any knot plan (plans.py) pass by pass. A JAGG window is the
plan [(0, W-1)] (`jagg_backward`), Flow-GRPO's per-step baseline the plan of lone steps (`exact_backward`),
routed windows and the budget planner's knots are plans too (planners.py chooses them); the trainer's update
(train/update.py) and the fidelity probe call the same function. Every backward goes through
`backward(out, grad, last=...)`, plain autograd by default; a training engine passes its own (DeepSpeed must see
every backward; `last` marks the last backward of the call, where a sharded engine synchronises gradients across
ranks).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable, Literal, Sequence, get_args

import torch

from ..cond import Cond, repeat_cond
from .plans import check_plan, exact_plan, interior_weights, pass_groups, per_row, plan_knots

ModelFn = Callable[[torch.Tensor, torch.Tensor, Cond], torch.Tensor]
StepLoss = Callable[[int, torch.Tensor], torch.Tensor]


class MinibatchLoss:
    """The base of a minibatch's per-step loss `loss(batch, k, v)` that keeps its `metrics` (a dataclass field of
    lists): grpo.GRPOStepLoss, nft.NFTStepLoss."""

    def fresh(self):
        """The same loss with its own, empty metrics (for probes and planning that must not be logged)."""
        return dataclasses.replace(self, metrics=defaultdict(list))

    def on(self, batch, positions: Sequence[int] | None = None) -> StepLoss:
        """knot_backward's step_loss(j, v) for this batch; with `positions`, position j is step positions[j]."""
        if positions is None:
            return lambda k, v: self(batch, k, v)
        return lambda j, v: self(batch, positions[j], v)
Backward = Callable[..., None]  # backward(out, grad, *, last): last marks the final backward of the call

IntermediateMode = Literal["cached", "interpolate", "forward"]
INTERMEDIATE_MODES: tuple[str, ...] = get_args(IntermediateMode)


def autograd_backward(out: torch.Tensor, grad: torch.Tensor | None, last: bool) -> None:
    """The default `backward`: plain autograd (one process; nothing to synchronise)."""
    out.backward(grad)


def _upstream(step_loss: StepLoss, k: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_k, g_k) at a velocity value; g_k comes from autograd through the loss alone (no model pass)."""
    v = value.detach().to(torch.promote_types(value.dtype, torch.float32)).requires_grad_(True)
    loss = step_loss(k, v)
    (grad,) = torch.autograd.grad(loss, v)
    return loss.detach(), grad


def _interior_values(model_fn, latents, sigmas, cond, cached, mode, a, v_first, v_last) -> list[torch.Tensor]:
    """Velocity values of the interior steps 1 .. n-2 of one segment's latents[n] for the chosen mode; `a` holds
    the segment's weights a_k (0 .. 1), v_first / v_last its knots' fresh values (for interpolate)."""
    n, B = latents.shape[:2]
    if n <= 2:
        return []
    if mode == "forward":
        with torch.no_grad():
            x = latents[1:-1].reshape(-1, *latents.shape[2:])
            s = sigmas[1:-1].repeat_interleave(B) if sigmas.ndim == 1 else sigmas[1:-1].reshape(-1)
            v = model_fn(x, s, repeat_cond(cond, n - 2))
        return list(v.reshape(n - 2, B, *v.shape[1:]))
    if mode == "cached":
        return [cached[k] for k in range(1, n - 1)]
    drift_first, drift_last = v_first - cached[0], v_last - cached[-1]
    a = per_row(a, cached)  # [n, 1, ...] or [n, B, 1, ...]: a[k] broadcasts over one step's rows
    return [cached[k] + (1 - a[k]) * drift_first + a[k] * drift_last for k in range(1, n - 1)]


def knot_backward(
    model_fn: ModelFn,
    plan: Sequence[tuple[int, int]],
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Cond,
    step_loss: StepLoss,
    *,
    cached_velocities: torch.Tensor | None = None,
    intermediate: str = "cached",
    rows_per_pass: int | None = None,
    backward: Backward | None = None,
) -> torch.Tensor:
    """Accumulate the plan's gradient of sum_k step_loss(k, v_k) over T steps into the parameters' .grad.

    latents[T, B, ...] are the x_k, sigmas[T] their noise levels (or sigmas[T, B]: each row its own, the weights
    a_k then per row), cond the conditioning of B rows, step_loss(k, v_k)
    with k the position in latents, cached_velocities[T, B, ...] the rollout's velocities (needed by cached /
    interpolate when a segment has interior steps), intermediate in INTERMEDIATE_MODES (the values of interpolated
    steps; knots use their fresh forward). The knots go in the passes of `pass_groups(plan, rows_per_pass)`: per
    pass one forward with grad (len(pass) * B rows) and one backward with the pass's composite G, so peak memory is
    one pass. "forward" adds one no-grad forward per segment over its interior; "interpolate" needs both knots'
    fresh values, so a segment whose knots sit in two passes costs one no-grad forward of its right knot (B rows).
    `backward(out, grad, last=...)` runs each backward, last=True on the final one. Returns the detached summed loss.
    """
    if intermediate not in INTERMEDIATE_MODES:
        raise ValueError(f"intermediate must be one of {INTERMEDIATE_MODES}, got {intermediate!r}")
    T, B = latents.shape[:2]
    if sigmas.shape not in ((T,), (T, B)):
        raise ValueError(f"sigmas must have shape ({T},) or ({T}, {B}) (a noise level per row), got "
                         f"{tuple(sigmas.shape)}")
    plan = check_plan(plan, T)
    groups = pass_groups(plan, rows_per_pass)
    interpolated = [seg for seg in plan if seg[1] > seg[0] + 1]
    if interpolated and intermediate != "forward":
        if cached_velocities is None:
            raise ValueError(f"intermediate={intermediate!r} needs cached_velocities (the rollout's velocities)")
        if cached_velocities.shape[:2] != latents.shape[:2]:
            raise ValueError(f"cached_velocities has shape {tuple(cached_velocities.shape)}, latents "
                             f"{tuple(latents.shape)}")
    backward = backward or autograd_backward
    by_knot = {q: [seg for seg in interpolated if q in seg] for q in plan_knots(plan)}
    fresh: dict[int, torch.Tensor] = {}  # knot -> detached velocity of its with-grad forward
    parts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # segment -> its shares of G_a, G_b
    losses = []

    def knot_value(q):  # only "interpolate" asks for a knot not yet forwarded (a later pass's knot)
        if q not in fresh:
            with torch.no_grad():
                return model_fn(latents[q], sigmas[q].expand(B), cond).detach()
        return fresh[q]

    def segment_parts(a, b, dtype):
        """Interior values -> g_k -> the (1 - a_k) and a_k weighted sums; once per segment."""
        if (a, b) not in parts:
            w = interior_weights(sigmas, a, b)
            zero, one = w.new_zeros(1, *w.shape[1:]), w.new_ones(1, *w.shape[1:])
            a_all = torch.cat([zero, w, one]).to(dtype if dtype == torch.float64 else torch.float32)
            ends = (knot_value(a), knot_value(b)) if intermediate == "interpolate" else (None, None)
            cached = None if cached_velocities is None else cached_velocities[a : b + 1]
            values = _interior_values(model_fn, latents[a : b + 1], sigmas[a : b + 1], cond, cached, intermediate,
                                      a_all, *ends)
            seg_losses, grads = zip(*(_upstream(step_loss, k, v) for k, v in zip(range(a + 1, b), values)))
            losses.extend(seg_losses)
            g = torch.stack(grads)
            w = per_row(w.to(g.dtype), g)
            parts[(a, b)] = (((1 - w) * g).sum(0), (w * g).sum(0))
        return parts[(a, b)]

    for i, group in enumerate(groups):
        x = latents[group[0]] if len(group) == 1 else torch.cat([latents[q] for q in group])
        s = torch.cat([sigmas[q].expand(B) for q in group])
        v = model_fn(x, s, repeat_cond(cond, len(group)))
        fresh.update(zip(group, v.detach().split(B)))
        G = []
        for q in group:
            loss, G_q = _upstream(step_loss, q, fresh[q])
            losses.append(loss)
            for a, b in by_knot[q]:
                G_q = G_q + segment_parts(a, b, v.dtype)[0 if q == a else 1]
            G.append(G_q)
        backward(v, torch.cat(G).to(v.dtype), last=i == len(groups) - 1)  # sum_q G_q^T J_q over the pass's knots
    return torch.stack(losses).sum()


def jagg_backward(
    model_fn: ModelFn,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Cond,
    step_loss: StepLoss,
    *,
    cached_velocities: torch.Tensor | None = None,
    intermediate: str = "cached",
    backward: Backward | None = None,
) -> torch.Tensor:
    """Accumulate the JAGG gradient of sum_k step_loss(k, v_k) over one window into the parameters' .grad.

    latents[W, B, ...] are the window's x_k, sigmas[W] their noise levels, cond the conditioning of B rows.
    Exactly one forward with grad (2B rows; B when W == 1) and one backward. Returns the detached summed loss.
    """
    W = latents.shape[0]
    return knot_backward(model_fn, [(0, W - 1)], latents, sigmas, cond, step_loss, cached_velocities=cached_velocities,
                         intermediate=intermediate, backward=backward)


def exact_backward(model_fn: ModelFn, latents: torch.Tensor, sigmas: torch.Tensor, cond: Cond,
                   step_loss: StepLoss, *, backward: Backward | None = None) -> torch.Tensor:
    """Flow-GRPO's per-step baseline: one forward with grad and one backward per step (W of each)."""
    return knot_backward(model_fn, exact_plan(latents.shape[0]), latents, sigmas, cond, step_loss, backward=backward)
