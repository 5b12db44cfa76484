"""Knot plans: one representation for every way the trainer spends transformer rows on a minibatch.

A plan covers the T trained steps 0 .. T-1 of a batch (positions in latents[T]) with segments (a, b), a <= b.
Knots are the segments' endpoints: steps whose Jacobian is computed exactly (one with-grad row each). A step k
strictly inside a segment (a < k < b) is interpolated in sigma between its two knots, as in a JAGG window:

    a_k = (s_k - s_a) / (s_b - s_a),      J_k ~ (1 - a_k) J_a + a_k J_b,

so its upstream gradient g_k = dL_k/dv_k is split (1 - a_k) onto knot a and a_k onto knot b. Each knot q
receives the composite upstream

    G_q = g_q + sum_{segments (a, b) with q in {a, b}} sum_{a<k<b} w_q(k) g_k,     grad ~ sum_q G_q^T J_q.

Every gradient the project computes is such a plan:

    Flow-GRPO (exact)            [(0, 0), (1, 1), ..., (T-1, T-1)]      a lone segment per step
    one JAGG window of W steps   [(0, W-1)]                             knots 0 and W-1, one joint pass
    routed windows (jagg_frac)   a segment per routed window, lone segments for the others
    the budget planner           any knot set (knots.py, planners.py)

Segment rules: the first segment starts at step 0 and the last ends at T-1 (the first and last trained steps
are always knots: nothing is extrapolated); the next segment starts at the previous end b (a shared knot) or
at b + 1 (non-shared). A segment (a, a) is a lone exact step; a shared boundary needs a < b on both sides. The
gradient depends only on the set of knots, so the planner chooses knot sets and `plan_from_knots` gives the
all-shared plan of them.

Passes: the knots are computed in with-grad passes (one forward over the stacked knots of a pass, one backward).
`pass_groups(plan)` gives one pass per segment (a window's two endpoints together, each lone step alone: the
window path's layout); `pass_groups(plan, rows_per_pass=n)` chunks the sorted knots n at a time (peak memory of
one n-knot pass whatever the plan).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

Plan = list[tuple[int, int]]


# ------------------------------------------------------------------ trained steps, windows and their weights a_k
# Windows are consecutive runs of W trained steps; T need not be divisible by W, the last window keeps the
# remainder. The interpolation weight of step k inside a window comes from the sigmas, not the step index,
# because shifted schedules are far from uniform: a_k = (s_k - s_0) / (s_{W-1} - s_0).


def trained_steps(num_steps: int, timestep_fraction: float = 1.0) -> list[int]:
    """Flow-GRPO trains the first int(T * timestep_fraction) sampling steps (at least one)."""
    if not 0.0 < timestep_fraction <= 1.0:
        raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
    return list(range(max(1, int(num_steps * timestep_fraction))))


def split_windows(steps: Sequence[int], window: int) -> list[list[int]]:
    """Split the trained steps into consecutive windows of `window` steps; the last one holds the remainder."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    steps = list(steps)
    return [steps[i : i + window] for i in range(0, len(steps), window)]


def window_weights(sigmas: torch.Tensor) -> torch.Tensor:
    """a_k for the sigmas of one window (float64): 0 at the first step, 1 at the last, linear in sigma. `sigmas` is
    [W] (every row at the same noise levels) or [W, B] (each row its own, as DiffusionNFT draws its training
    timesteps per sample): the weights then have the same shape."""
    sigmas = sigmas.detach().double()
    if sigmas.shape[0] == 1:
        return torch.zeros_like(sigmas)
    span = sigmas[-1] - sigmas[0]
    # Checked on the device, on every device (one path): reading span back would stall a GPU's host at every
    # window; on the CPU the assertion raises RuntimeError at once.
    torch._assert_async((span != 0).all(), "a JAGG window needs distinct endpoint sigmas")
    return (sigmas - sigmas[0]) / span


def per_row(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Weights of shape [n] or [n, B] (window_weights) shaped to broadcast against values [n, B, ...] like `like`."""
    return weights.reshape(*weights.shape, *([1] * (like.ndim - weights.ndim)))


# ------------------------------------------------------------------ knot plans


def check_plan(plan: Sequence[tuple[int, int]], T: int) -> Plan:
    """Validate the segment rules of the module docstring for T trained steps; returns the plan as a list."""
    plan = [(int(a), int(b)) for a, b in plan]
    if not plan or plan[0][0] != 0 or plan[-1][1] != T - 1:
        raise ValueError(f"a plan must start at step 0 and end at step {T - 1}: {plan}")
    for i, (a, b) in enumerate(plan):
        if a > b:
            raise ValueError(f"segment {(a, b)} has a > b")
        if i and a not in (plan[i - 1][1], plan[i - 1][1] + 1):
            raise ValueError(f"segment {(a, b)} must start at {plan[i - 1][1]} (shared) or {plan[i - 1][1] + 1}")
        if i and a == plan[i - 1][1] and (a == b or plan[i - 1][0] == a):
            raise ValueError(f"a shared knot {a} needs a segment of length >= 1 on both sides: {plan}")
    return plan


def plan_knots(plan: Sequence[tuple[int, int]]) -> list[int]:
    """The distinct knots of a plan, sorted."""
    return sorted({k for seg in plan for k in seg})


def pass_groups(plan: Sequence[tuple[int, int]], rows_per_pass: int | None = None) -> list[list[int]]:
    """The knots of each with-grad pass, in order: one pass per segment (its knots not computed before) when
    rows_per_pass is None, else the sorted knots in chunks of rows_per_pass."""
    if rows_per_pass is not None:
        if rows_per_pass < 1:
            raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
        knots = plan_knots(plan)
        return [knots[i : i + rows_per_pass] for i in range(0, len(knots), rows_per_pass)]
    groups, seen = [], set()
    for seg in plan:
        new = [q for q in sorted(set(seg)) if q not in seen]
        seen.update(new)
        if new:
            groups.append(new)
    return groups


def interpolate_forwards(plan: Sequence[tuple[int, int]], rows_per_pass: int | None = None) -> int:
    """The no-grad forwards (B rows each) knot_backward's `interpolate` values spend beyond the plan's passes: one
    per segment with interior steps whose right knot comes in a later pass than its left one (its drift is needed
    when the segment is first reached)."""
    pass_of = {q: i for i, group in enumerate(pass_groups(plan, rows_per_pass)) for q in group}
    return sum(1 for a, b in plan if b > a + 1 and pass_of[b] > pass_of[a])


def exact_plan(T: int) -> Plan:
    """Flow-GRPO: every step its own knot."""
    return [(k, k) for k in range(T)]


def plan_from_knots(knots: Sequence[int]) -> Plan:
    """The all-shared plan on these knots: one segment per pair of consecutive knots ([(k, k)] for one knot)."""
    knots = sorted(set(int(k) for k in knots))
    return [(knots[0], knots[0])] if len(knots) == 1 else list(zip(knots[:-1], knots[1:]))


def knots_from_windows(windows: Sequence[Sequence[int]], share: bool = False,
                       use_jagg: Sequence[bool] | None = None) -> Plan:
    """The plan of JAGG windows (lists of consecutive steps, as split_windows gives).

    share=False: each window is a segment (first, last), knots in adjacent pairs: exactly jagg_backward per window;
    a window with use_jagg[i] False becomes lone segments (Flow-GRPO's per-step backward on its steps).
    share=True: adjacent windows share their boundary knot, the previous window's last step: knots are the first
    step and every window's last step (windows that already overlap by one step give the same knots).
    """
    windows = [list(w) for w in windows]
    for w in windows:
        if not w or w != list(range(w[0], w[0] + len(w))):
            raise ValueError(f"a window must be a nonempty run of consecutive steps: {w}")
    if share:
        return plan_from_knots([windows[0][0]] + [w[-1] for w in windows])
    for prev, w in zip(windows, windows[1:]):
        if w[0] != prev[-1] + 1:
            raise ValueError(f"non-shared windows must be contiguous: {prev} then {w}")
    use_jagg = [True] * len(windows) if use_jagg is None else list(use_jagg)
    return [seg for w, jagg in zip(windows, use_jagg) for seg in ([(w[0], w[-1])] if jagg else [(k, k) for k in w])]


def plan_uniform(T: int, window: int, share: bool = False) -> Plan:
    """Uniform windows of `window` steps. share=False: split_windows' windows. share=True: segments of `window`
    steps overlapping on their boundary knot (stride window - 1, e.g. T=16, W=4 -> knots 0, 3, ..., 15); the
    last segment holds the remainder."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not share or window == 1:
        return knots_from_windows(split_windows(range(T), window))
    return plan_from_knots(list(range(0, T - 1, window - 1)) + [T - 1])


def restrict_plan(plan: Sequence[tuple[int, int]], steps: Sequence[int]) -> Plan:
    """The segments lying within the consecutive `steps`, shifted to start at 0 (a window's own plan)."""
    lo, hi = steps[0], steps[-1]
    sub = [(a - lo, b - lo) for a, b in plan if lo <= a and b <= hi]
    return check_plan(sub, hi - lo + 1)


def budget_for_speedup(T: int, S: float) -> int:
    """Knots for a backward speedup S over per-step: floor(T / S), at least 2 (1 when T == 1), at most T."""
    if S <= 0:
        raise ValueError(f"speedup must be > 0, got {S}")
    return 1 if T == 1 else min(T, max(2, math.floor(T / S)))


def interior_weights(sigmas: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """a_k of the interior steps a < k < b (float64, [n] or [n, B]), exactly window_weights of the window a .. b."""
    return window_weights(sigmas[a : b + 1])[1:-1]


def fill_interior(plan: Sequence[tuple[int, int]], values: torch.Tensor, sigmas: torch.Tensor, *,
                  moved: torch.Tensor | None = None) -> torch.Tensor:
    """values [T, B, ...] whose entries at the plan's knots are set, with each segment's interior steps replaced by
    the linear blend of its two knots in sigma, (1 - a_k) v_a + a_k v_b (the JAGG assumption applied to values);
    `sigmas` [T] or [T, B]. With `moved` [T, B, ...], the values every step held before the knots were recomputed,
    an interior step is its old value moved by its knots' drift instead, moved_k + (1 - a_k)(v_a - moved_a) +
    a_k (v_b - moved_b) (knot_backward's `interpolate` values; exact wherever the drift is affine in sigma). Returns
    a new tensor; the knots' entries are unchanged."""
    plan = check_plan(plan, values.shape[0])
    out = values.clone()
    for a, b in plan:
        if b > a + 1:
            w = per_row(interior_weights(sigmas, a, b).to(values.device, torch.float32), values[a + 1 : b])
            if moved is None:
                blend = (1 - w) * values[a].float() + w * values[b].float()
            else:
                drift_a, drift_b = values[a].float() - moved[a].float(), values[b].float() - moved[b].float()
                blend = moved[a + 1 : b].float() + (1 - w) * drift_a + w * drift_b
            out[a + 1 : b] = blend.to(values.dtype)
    return out


def composite_upstream(plan: Sequence[tuple[int, int]], g: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """G [n_knots, ...] in plan_knots order from the per-step g [T, ...]: g_q plus the split interior g_k."""
    plan = check_plan(plan, g.shape[0])
    knots = plan_knots(plan)
    slot = {q: i for i, q in enumerate(knots)}
    G = g[knots].clone()
    for a, b in plan:
        if b > a + 1:
            w = per_row(interior_weights(sigmas, a, b).to(g.dtype), g[a + 1 : b])
            G[slot[a]] += ((1 - w) * g[a + 1 : b]).sum(0)
            G[slot[b]] += (w * g[a + 1 : b]).sum(0)
    return G
