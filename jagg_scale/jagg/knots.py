"""Knot plans: JAGG windows generalised, and a DP planner that places the knots under a budget.

A plan covers the T trained steps 0 .. T-1 of a batch (positions in latents[T]) with segments (a, b), a <= b.
Knots are the segments' endpoints: steps whose Jacobian is computed exactly (one with-grad row each). A step k
strictly inside a segment (a < k < b) is interpolated in sigma between its two knots, as in a window (doc 2):

    a_k = (s_k - s_a) / (s_b - s_a),      J_k ~ (1 - a_k) J_a + a_k J_b,

so its upstream gradient g_k = dL_k/dv_k is split (1 - a_k) onto knot a and a_k onto knot b. Each knot q
receives the composite upstream

    G_q = g_q + sum_{segments (a, b) with q in {a, b}} sum_{a<k<b} w_q(k) g_k,     grad ~ sum_q G_q^T J_q.

Segment rules: the first segment starts at step 0 and the last ends at T-1 (the first and last trained steps
are always knots: nothing is extrapolated); the next segment starts at the previous end b (a shared knot) or
at b + 1 (non-shared, as uniform windows). A segment (a, a) is a lone exact step; a shared boundary needs
a < b on both sides. The gradient depends only on the set of knots: between consecutive knots p < q with
q > p + 1 the steps in between can only be interpolated in (p, q); with q = p + 1 there is nothing to
interpolate and sharing or not is the same. So the planner chooses knot sets; the segment list is the
representation (`plan_from_knots` gives the all-shared one, `knots_from_windows` the windows' one).

Error model of the planner (cheap, from the rollout, before any backward; errors of different steps add
coherently, so norms are summed, not squared, as the design doc measured):

    cost(a, b) = sum_{a<k<b} |g_k| e(a, b, k),      e = (1 - vcos(a, b)) a_k (1 - a_k),

zero for a segment without interior. Why this e: a velocity turning at a constant rate across the segment
leaves a relative chord-interpolation residual a_k (1 - a_k) theta^2 / 2 = a_k (1 - a_k)(1 - cos theta) at
step k, so e grows with the endpoints' decorrelation (and through it with the sigma span) and peaks mid-segment.
`residual_error` gives the doc's measured alternative, the actual interpolation residual of the rollout's
velocities |v_k - ((1 - a_k) v_a + a_k v_b)| / |v_k|, as an `error_fn`.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Sequence, get_args

import torch

from ..cond import Cond, repeat_cond
from .backward import INTERMEDIATE_MODES, ModelFn, StepLoss, _intermediate_values, _upstream, run_backward
from .windows import plan_windows, window_weights

Plan = list[tuple[int, int]]
ErrorModel = Literal["residual", "cosine"]  # jagg.error_model: residual_error | cosine_error
ERROR_MODELS: tuple[str, ...] = get_args(ErrorModel)
ErrorFn = Callable[[int, int], torch.Tensor]  # (a, b) -> e(a, b, k) for k = a+1 .. b-1 (float64)


# ----------------------------------------------------------------------------------------------------------------
# plans
# ----------------------------------------------------------------------------------------------------------------


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


def passes(plan: Sequence[tuple[int, int]]) -> int:
    """With-grad transformer rows per sample (= distinct knots); backward calls are ceil(passes / rows_per_pass)."""
    return len(plan_knots(plan))


def plan_from_knots(knots: Sequence[int]) -> Plan:
    """The all-shared plan on these knots: one segment per pair of consecutive knots ([(k, k)] for one knot)."""
    knots = sorted(set(int(k) for k in knots))
    return [(knots[0], knots[0])] if len(knots) == 1 else list(zip(knots[:-1], knots[1:]))


def knots_from_windows(windows: Sequence[Sequence[int]], share: bool = False) -> Plan:
    """The plan of JAGG windows (lists of consecutive steps, as plan_windows gives).

    share=False: each window is a segment (first, last), knots in adjacent pairs: exactly jagg_backward per window.
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
    return [(w[0], w[-1]) for w in windows]


def plan_uniform(T: int, window: int, share: bool = False) -> Plan:
    """Uniform windows of `window` steps. share=False: plan_windows' windows. share=True: segments of `window`
    steps overlapping on their boundary knot (stride window - 1, e.g. T=16, W=4 -> knots 0, 3, ..., 15); the
    last segment holds the remainder."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not share or window == 1:
        return knots_from_windows(plan_windows(range(T), window))
    return plan_from_knots(list(range(0, T - 1, window - 1)) + [T - 1])


def budget_for_speedup(T: int, S: float) -> int:
    """Knots for a backward speedup S over per-step: floor(T / S), at least 2 (1 when T == 1), at most T."""
    if S <= 0:
        raise ValueError(f"speedup must be > 0, got {S}")
    return 1 if T == 1 else min(T, max(2, math.floor(T / S)))


# ----------------------------------------------------------------------------------------------------------------
# composite gradients and the knot backward
# ----------------------------------------------------------------------------------------------------------------


def _interior_weights(sigmas: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """a_k of the interior steps a < k < b (float64), exactly window_weights of the window a .. b."""
    return window_weights(sigmas[a : b + 1])[1:-1]


def composite_upstream(plan: Sequence[tuple[int, int]], g: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """G [n_knots, ...] in plan_knots order from the per-step g [T, ...]: g_q plus the split interior g_k."""
    plan = check_plan(plan, g.shape[0])
    knots = plan_knots(plan)
    slot = {q: i for i, q in enumerate(knots)}
    G = g[knots].clone()
    for a, b in plan:
        if b > a + 1:
            w = _interior_weights(sigmas, a, b).to(g.dtype).reshape(-1, *([1] * (g.ndim - 1)))
            G[slot[a]] += ((1 - w) * g[a + 1 : b]).sum(0)
            G[slot[b]] += (w * g[a + 1 : b]).sum(0)
    return G


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
    rows_per_pass: int = 2,
) -> torch.Tensor:
    """Accumulate the knot-plan gradient of sum_k step_loss(k, v_k) over T steps into the parameters' .grad.

    Conventions of jagg_backward: latents[T, B, ...], sigmas[T], cond of B rows, step_loss(k, v_k) with k the
    position in latents, cached_velocities[T, B, ...], intermediate in INTERMEDIATE_MODES (values of the
    interpolated steps; knots use their fresh forward). Knots go in sorted chunks of rows_per_pass: per chunk one
    forward with grad (len(chunk) * B rows) and one backward with the chunk's composite G, so peak memory is one
    joint pass. "forward" adds one no-grad forward per segment over its interior; "interpolate" needs both knots'
    fresh values, so a segment that straddles two chunks costs one no-grad forward of its right knot (B rows).
    Returns the detached summed loss.
    """
    if intermediate not in INTERMEDIATE_MODES:
        raise ValueError(f"intermediate must be one of {INTERMEDIATE_MODES}, got {intermediate!r}")
    if rows_per_pass < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    T, B = latents.shape[:2]
    if sigmas.shape != (T,):
        raise ValueError(f"sigmas must have shape ({T},), got {tuple(sigmas.shape)}")
    plan = check_plan(plan, T)
    knots = plan_knots(plan)
    by_knot = {q: [seg for seg in plan if q in seg and seg[1] > seg[0] + 1] for q in knots}
    fresh: dict[int, torch.Tensor] = {}  # knot -> detached velocity of its with-grad forward
    parts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # segment -> its shares of G_a, G_b
    losses = []

    def knot_value(q):  # only "interpolate" asks for a knot not yet forwarded (the next chunk's first knot)
        if q not in fresh:
            with torch.no_grad():
                return model_fn(latents[q], sigmas[q].expand(B), cond).detach()
        return fresh[q]

    def segment_parts(a, b, dtype):
        """Interior values -> g_k -> the (1 - a_k) and a_k weighted sums; once per segment."""
        if (a, b) not in parts:
            w = _interior_weights(sigmas, a, b)
            a_all = torch.cat([w.new_zeros(1), w, w.new_ones(1)]).to(dtype if dtype == torch.float64 else torch.float32)
            ends = (knot_value(a), knot_value(b)) if intermediate == "interpolate" else (None, None)
            cached = None if cached_velocities is None else cached_velocities[a : b + 1]
            values = _intermediate_values(model_fn, latents[a : b + 1], sigmas[a : b + 1], cond, cached,
                                          intermediate, a_all, *ends)
            seg_losses, grads = zip(*(_upstream(step_loss, k, v) for k, v in zip(range(a + 1, b), values)))
            losses.extend(seg_losses)
            g = torch.stack(grads)
            w = w.to(g.dtype).reshape(-1, *([1] * (g.ndim - 1)))
            parts[(a, b)] = (((1 - w) * g).sum(0), (w * g).sum(0))
        return parts[(a, b)]

    for i in range(0, len(knots), rows_per_pass):
        chunk = knots[i : i + rows_per_pass]
        x = torch.cat([latents[q] for q in chunk])
        s = torch.cat([sigmas[q].expand(B) for q in chunk])
        v = model_fn(x, s, repeat_cond(cond, len(chunk)))
        fresh.update(zip(chunk, v.detach().split(B)))
        G = []
        for q in chunk:
            loss, G_q = _upstream(step_loss, q, fresh[q])
            losses.append(loss)
            for a, b in by_knot[q]:
                G_q = G_q + segment_parts(a, b, v.dtype)[0 if q == a else 1]
            G.append(G_q)
        run_backward(v, torch.cat(G).to(v.dtype))  # one backward per chunk: sum_q G_q^T J_q
    return torch.stack(losses).sum()


# ----------------------------------------------------------------------------------------------------------------
# the planner
# ----------------------------------------------------------------------------------------------------------------


def velocity_cosines(velocities: torch.Tensor) -> torch.Tensor:
    """[T, T] mean over samples of cos(v_a, v_b) from the rollout's velocities [T, B, ...] (as endpoint_cosine)."""
    v = torch.nn.functional.normalize(velocities.detach().flatten(2).double(), dim=2, eps=1e-12)  # [T, B, D]
    return torch.einsum("abd,cbd->acb", v, v).mean(2)


def cosine_error(vcos, sigmas: torch.Tensor) -> ErrorFn:
    """The default error model as an error_fn: e(a, b, k) = (1 - vcos(a, b)) a_k (1 - a_k) for a < k < b."""
    cos = vcos
    if not callable(vcos):
        table = torch.as_tensor(vcos, dtype=torch.float64).tolist()  # python floats: O(T^2) lookups stay cheap
        cos = lambda a, b: table[a][b]  # noqa: E731

    def e(a: int, b: int) -> torch.Tensor:
        w = _interior_weights(sigmas, a, b)
        return (1.0 - float(cos(a, b))) * w * (1 - w)

    return e


def residual_error(velocities: torch.Tensor, sigmas: torch.Tensor) -> ErrorFn:
    """The doc's measured alternative as an error_fn: mean over samples of the relative interpolation residual
    |v_k - ((1 - a_k) v_a + a_k v_b)| / |v_k| of the rollout's velocities [T, B, ...]."""
    v = velocities.detach().flatten(2).double()  # [T, B, D]
    norms = v.norm(dim=2).clamp_min(1e-12)

    def e(a: int, b: int) -> torch.Tensor:
        w = _interior_weights(sigmas, a, b)[:, None, None]
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


def plan_budget(g_norms, vcos, sigmas: torch.Tensor, max_knots: int, *, error_fn: ErrorFn | None = None) -> Plan:
    """The plan of at most max_knots knots (first and last step included) that minimises the error model.

    g_norms[T]: |g_k| per trained step; vcos: [T, T] endpoint cosines (velocity_cosines) or a callable (a, b),
    giving the default e = (1 - vcos) a_k (1 - a_k); error_fn(a, b) -> e of the interior steps replaces it
    (vcos may then be None). DP over knot sets (the gradient depends on the knots only, see the module docstring):
    best[j, q] = min_p best[j-1, p] + C[p, q], the least cost of steps 0 .. q with j knots, the last at q;
    O(T^2) error evaluations plus O(K T^2) DP. At equal cost the plan with more knots wins: a zero modelled error
    is not a zero real error, and the budget is paid for anyway. Returns the all-shared plan of the chosen knots.
    """
    T = len(g_norms)
    if sigmas.shape != (T,):
        raise ValueError(f"sigmas must have shape ({T},), got {tuple(sigmas.shape)}")
    if T == 1:
        return [(0, 0)]
    return plan_from_costs(segment_costs(g_norms, error_fn or cosine_error(vcos, sigmas)), max_knots)


def plan_from_costs(C: torch.Tensor, max_knots: int) -> Plan:
    """The DP of plan_budget on a segment-cost table C[a, b] (segment_costs). Separate so that data-parallel ranks
    can average their tables first and all run the same plan."""
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
    j = min(range(2, K + 1), key=lambda j: (float(best[j, T - 1]), -j))  # least cost, then most knots
    knots = [T - 1]
    for j in range(j, 1, -1):
        knots.append(int(back[j, knots[-1]]))
    return plan_from_knots(knots)
