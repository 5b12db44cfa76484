"""The knot planner: where to put a budget of exactly-computed steps (knots) so that JAGG's interpolation costs
least. The plans themselves, and how a plan's gradient is formed, are in plans.py.

Error model of the planner (cheap, from the rollout, before any backward; errors of different steps add
coherently, so norms are summed, not squared, as measured: docs/algorithm.md, section 5):

    cost(a, b) = sum_{a<k<b} |g_k| e(a, b, k),      e = (1 - vcos(a, b)) a_k (1 - a_k),

zero for a segment without interior. Why this e: a velocity turning at a constant rate across the segment
leaves a relative chord-interpolation residual a_k (1 - a_k) theta^2 / 2 = a_k (1 - a_k)(1 - cos theta) at
step k, so e grows with the endpoints' decorrelation (and through it with the sigma span) and peaks mid-segment.
`residual_error` gives the doc's measured alternative, the actual interpolation residual of the rollout's
velocities |v_k - ((1 - a_k) v_a + a_k v_b)| / |v_k|, as an `error_fn` (the trainer's default, error_model
`residual`).

The gradient depends only on the set of knots (plans.py), so the DP chooses knot sets.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, get_args

import torch

from .plans import Plan, interior_weights, plan_from_knots

ErrorModel = Literal["residual", "cosine"]
ERROR_MODELS: tuple[str, ...] = get_args(ErrorModel)
ErrorFn = Callable[[int, int], torch.Tensor]  # (a, b) -> e(a, b, k) for k = a+1 .. b-1 (float64)


def velocity_cosines(velocities: torch.Tensor) -> torch.Tensor:
    """[T, T] mean over samples of cos(v_a, v_b) from the rollout's velocities [T, B, ...]
    (as routing.endpoint_cosines)."""
    v = torch.nn.functional.normalize(velocities.detach().flatten(2).double(), dim=2, eps=1e-12)  # [T, B, D]
    return torch.einsum("abd,cbd->acb", v, v).mean(2)


def cosine_error(vcos, sigmas: torch.Tensor) -> ErrorFn:
    """The default error model as an error_fn: e(a, b, k) = (1 - vcos(a, b)) a_k (1 - a_k) for a < k < b."""
    cos = vcos
    if not callable(vcos):
        table = torch.as_tensor(vcos, dtype=torch.float64).tolist()  # python floats: O(T^2) lookups stay cheap
        cos = lambda a, b: table[a][b]

    def e(a: int, b: int) -> torch.Tensor:
        w = interior_weights(sigmas, a, b)
        return (1.0 - float(cos(a, b))) * w * (1 - w)

    return e


def residual_error(velocities: torch.Tensor, sigmas: torch.Tensor) -> ErrorFn:
    """The doc's measured alternative as an error_fn: mean over samples of the relative interpolation residual
    |v_k - ((1 - a_k) v_a + a_k v_b)| / |v_k| of the rollout's velocities [T, B, ...]."""
    v = velocities.detach().flatten(2).double()  # [T, B, D]
    norms = v.norm(dim=2).clamp_min(1e-12)

    def e(a: int, b: int) -> torch.Tensor:
        w = interior_weights(sigmas, a, b)[:, None, None]
        residual = v[a + 1 : b] - (1 - w) * v[a] - w * v[b]
        return (residual.norm(dim=2) / norms[a + 1 : b]).mean(1)

    return e


def segment_costs(g_norms, error_fn: ErrorFn) -> torch.Tensor:
    """C[a, b] = sum_{a<k<b} |g_k| e(a, b, k) for a < b (float64 [T, T]; 0 for b = a + 1, inf for b <= a)."""
    g = torch.as_tensor(g_norms, dtype=torch.float64)
    T = g.shape[0]
    C = torch.full((T, T), math.inf, dtype=torch.float64)
    for a in range(T - 1):
        C[a, a + 1 :] = torch.stack([(g[a + 1 : b] * error_fn(a, b)).sum() for b in range(a + 1, T)])
    return C


def plan_cost(plan, g_norms, error_fn: ErrorFn) -> float:
    """The error model summed over a plan's segments (to log what the planner chose; tests check the DP with it)."""
    g = torch.as_tensor(g_norms, dtype=torch.float64)
    return sum(float((g[a + 1 : b] * error_fn(a, b)).sum()) for a, b in plan if b > a + 1)


def plan_budget(g_norms, error_fn: ErrorFn, max_knots: int, *,
                reduce: Callable[[list[float]], list[float]] | None = None) -> Plan:
    """The plan of at most max_knots knots (first and last step included) that minimises the error model.

    g_norms[T]: |g_k| per trained step; error_fn(a, b) -> e of the interior steps (cosine_error or residual_error).
    DP over knot sets (the gradient depends on the knots only, see the module docstring): best[j, q] =
    min_p best[j-1, p] + C[p, q], the least cost of steps 0 .. q with j knots, the last at q; O(T^2) error
    evaluations plus O(K T^2) DP. At equal cost the plan with more knots wins: a zero modelled error is not a zero
    real error, and the budget is paid for anyway. `reduce(values)` averages the flattened cost table over
    data-parallel ranks before the DP, so that every rank runs the same plan. Returns the all-shared plan of the
    chosen knots."""
    T = len(g_norms)
    if T == 1:
        return [(0, 0)]
    C = segment_costs(g_norms, error_fn)
    if reduce is not None:
        C = torch.tensor(reduce(C.flatten().tolist()), dtype=torch.float64).reshape(T, T)
    return plan_from_costs(C, max_knots)


def plan_from_costs(C: torch.Tensor, max_knots: int) -> Plan:
    """The DP of plan_budget on a segment-cost table C[a, b] (segment_costs)."""
    T = C.shape[0]
    if T == 1:
        return [(0, 0)]
    if max_knots < 2:
        raise ValueError(f"max_knots must be >= 2 (the first and last step), got {max_knots}")
    K = min(max_knots, T)
    best = torch.full((K + 1, T), math.inf, dtype=torch.float64)
    back = torch.zeros((K + 1, T), dtype=torch.long)
    best[1, 0] = 0.0
    for j in range(2, K + 1):
        best[j], back[j] = (best[j - 1][:, None] + C).min(0)  # over the previous knot p < q
    n_knots = min(range(2, K + 1), key=lambda j: (float(best[j, T - 1]), -j))  # least cost, then most knots
    knots = [T - 1]
    for j in range(n_knots, 1, -1):
        knots.append(int(back[j, knots[-1]]))
    return plan_from_knots(knots)
