"""Knot planners: which knot plan (plans.py) the trained steps of a minibatch get. One small typed object per way
of spending transformer rows, holding its own settings and nothing else:

    ExactPlanner()                                      Flow-GRPO: every trained step its own knot, one forward
                                                        + backward each (JAGG off)
    WindowPlanner(window, jagg_frac, route_by, min_cos) windows of `window` steps; the routed ones (routing.py)
                                                        one joint pass over their two endpoints, the others per
                                                        step, so jagg_frac = 0 is Flow-GRPO bit for bit
    SharedKnotPlanner(window, rows_per_pass)            windows of `window` steps sharing their boundary knots,
                                                        the knots in passes of rows_per_pass
    BudgetPlanner(speedup, error_model, rows_per_pass)  at most T / speedup knots, placed by the DP on the error
                                                        model (knots.py), in passes of rows_per_pass

The window planner's routing (`route_windows`): round(jagg_frac x windows) windows get JAGG, ranked from what the
rollout holds; `vcos`, the paper's rule: mean over samples of cos(v_first, v_last) of the window's endpoint
velocities, the highest first; `weighted`: the expected error (1 - cos) x sum_k |g_k|, the smallest first (low-sigma
steps carry most of the GRPO gradient norm, so an interpolation error there costs most; windows of 1 or 2 steps are
exact under JAGG, their expected error 0). With min_cos set, no window whose endpoint cosine is below it is routed.

`planner.plan(velocities, sigmas, grad_norms=, reduce=)` decides from what the rollout holds (no transformer pass):
the rollout's velocities [T, B, ...] and sigmas [T] at the trained steps, `grad_norms()` the |g_k| of each trained
step (called only by the planners that rank by it), `reduce(values, how)` combining per-rank statistics so that
every data-parallel rank runs the same plan (a sharded model's collectives must match). It returns `Planned`.

What else a planner knows about itself: `rows_per_pass`, what knot_backward takes (None: one pass per segment);
`knots_per_pass`, the most knots one with-grad pass stacks (the pass holds that many times the micro-batch's rows:
the memory estimate's unit); `max_interior(T)`, the most interior steps of one segment (the extra no-grad rows of
the `forward` intermediate values); `fixed_plan(T)`, the plan when it does not depend on what the rollout holds
(None when it does): what lets a run evaluate frozen models at the knots alone before the plan is made.

Two experts switched by noise level (Wan2.2 A14B, experts.py): `with_switch(planner, switch)` gives the window and
shared-knot planners the model's `ExpertSwitch`; they then plan each span of positions that stays within one expert
for every row on its own, so no segment crosses the switch (the velocity is discontinuous there). The exact planner
never crosses it; the budget planner's DP over the whole trajectory is refused with a switch. `switch` is no config
setting (planner_keys leaves it out): the model says where its experts change.

The run config builds one from its `jagg` section (`build_planner(kind, **settings)`, train/config_sections.py):
a planner's settings are its dataclass fields, so a key the chosen planner has no field for is refused, naming
the planners it belongs to (`PlannerSettingError`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import math
from typing import Callable, ClassVar, Literal, Optional, Sequence, Union, get_args

import torch

from .experts import ExpertSwitch
from .knots import ERROR_MODELS, ErrorModel, cosine_error, plan_budget, residual_error, velocity_cosines
from .plans import Plan, budget_for_speedup, exact_plan, knots_from_windows, plan_uniform, split_windows

__all__ = ["BudgetPlanner", "ExactPlanner", "PLANNERS", "Planned", "Planner", "PlannerSettingError", "ROUTE_BY",
           "RouteBy", "Routing", "SharedKnotPlanner", "WindowPlanner", "build_planner", "endpoint_cosines",
           "num_routed", "planner_keys", "route_windows", "with_switch"]

Reduce = Callable[[list[float], str], list[float]]
RouteBy = Literal["vcos", "weighted"]
ROUTE_BY: tuple[str, ...] = get_args(RouteBy)
GradNorms = Callable[[], list[float]]
# a planner field the model sets (with_switch), not the config: planner_keys leaves it out
MODEL_SET = {"set_by": "model"}


class PlannerSettingError(ValueError):
    """Planner settings that are out of range, or that the planner does not take; `keys` names them."""

    def __init__(self, keys: str | list[str], message: str, owners: dict[str, list[str]] | None = None):
        super().__init__(message)
        self.keys = [keys] if isinstance(keys, str) else list(keys)
        self.owners = owners  # a key the planner does not take -> the planners that take it


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise PlannerSettingError(key, message)


@dataclass
class Planned:
    """A minibatch's knot plan over positions 0 .. T-1 of its trained steps, and how it came about."""

    plan: Plan
    windows: Optional[list[list[int]]] = None  # uniform windows (positions): the unit of routing and of the probe
    jagg_windows: int = 0  # routed windows, or the planner's segments with interior steps
    cosines: list[float] = field(default_factory=list)  # endpoint-velocity cosine per window (routing)

    @property
    def num_windows(self) -> int:
        return len(self.windows) if self.windows is not None else len(self.plan)


def _interpolated(plan: Plan) -> int:
    return sum(1 for a, b in plan if b > a + 1)


# ------------------------------------------------------------------ the window planner's routing (jagg_frac)


@dataclass
class Routing:
    use_jagg: list[bool]  # per window
    cosines: list[float]  # endpoint-velocity cosine per window
    scores: list[float]  # the ranking score (higher = JAGG first)

    @property
    def num_jagg(self) -> int:
        return sum(self.use_jagg)


COSINE_CHUNK = 2**22  # elements of a float64 chunk of endpoint_cosines (32 MiB)


def endpoint_cosines(velocities: torch.Tensor, windows: Sequence[Sequence[int]]) -> list[float]:
    """Per window, the mean over samples of the cosine between its first and last velocities ([T, B, ...] input),
    computed on the device and read back to the host once. In float64 a chunk of rows at a time (at most
    COSINE_CHUNK elements): a float64 copy of every window's endpoints would be 4x a bf16 rollout's velocities of
    the whole minibatch (routing would be the update's peak); each row's cosine is the same either way."""
    B = velocities.shape[1]
    rows = max(1, COSINE_CHUNK // max(1, velocities[0, 0].numel()))
    per_window = []
    for w in windows:
        first, last = velocities[w[0]].flatten(1), velocities[w[-1]].flatten(1)  # views
        per_window.append(torch.cat([torch.nn.functional.cosine_similarity(
            first[i:i + rows].double(), last[i:i + rows].double(), dim=1, eps=1e-12) for i in range(0, B, rows)]))
    return torch.stack(per_window).mean(1).tolist()


def num_routed(jagg_frac: float, num_windows: int) -> int:
    """round-half-up(jagg_frac * num_windows)."""
    if not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"jagg_frac must be in [0, 1], got {jagg_frac}")
    return min(num_windows, int(math.floor(jagg_frac * num_windows + 0.5)))


def route_windows(
    windows: Sequence[Sequence[int]],
    velocities: torch.Tensor,
    *,
    jagg_frac: float,
    route_by: str = "vcos",
    min_cos: float | None = None,
    grad_norms: Sequence[float] | None = None,
    reduce: Callable[[list[float], str], list[float]] | None = None,
) -> Routing:
    """Choose which windows train with JAGG. `velocities` [T, B, ...] are the rollout's; `grad_norms[k]` = |g_k|
    for every sampling step k (needed for route_by="weighted").

    With data parallelism each rank holds a slice of the batch but all ranks must run the same plan (the sharded
    model's collectives must match). `reduce(values, how)` combines per-rank statistics before deciding:
    how="mean" for the cosines (equal slices: the global mean), how="norm" for |g_k| (root of summed squares)."""
    if route_by not in ROUTE_BY:
        raise ValueError(f"route_by must be one of {ROUTE_BY}, got {route_by!r}")
    cosines = endpoint_cosines(velocities, windows)
    if reduce is not None:
        cosines = reduce(cosines, "mean")
        if grad_norms is not None:
            grad_norms = reduce(list(grad_norms), "norm")
    if route_by == "vcos":
        scores = list(cosines)
    else:
        if grad_norms is None:
            raise ValueError("route_by='weighted' needs grad_norms (|g_k| per step)")
        scores = [
            0.0 if len(w) <= 2 else -(1.0 - c) * sum(float(grad_norms[k]) for k in w) for w, c in zip(windows, cosines)
        ]
    eligible = [i for i in range(len(windows)) if min_cos is None or cosines[i] >= min_cos]
    ranked = sorted(eligible, key=lambda i: (-scores[i], i))  # stable: earlier window wins a tie
    chosen = set(ranked[: num_routed(jagg_frac, len(windows))])
    return Routing(use_jagg=[i in chosen for i in range(len(windows))], cosines=cosines, scores=scores)


# ------------------------------------------------------------------ the planners


@dataclass(frozen=True)
class ExactPlanner:
    """Flow-GRPO's per-step backward: a lone segment per trained step."""

    name: ClassVar[str] = "exact"
    rows_per_pass: ClassVar[None] = None
    knots_per_pass: ClassVar[int] = 1

    def max_interior(self, T: int) -> int:
        return 0

    def fixed_plan(self, T: int) -> Plan:
        return exact_plan(T)

    def plan(self, velocities: torch.Tensor, sigmas: torch.Tensor, *, grad_norms: GradNorms | None = None,
             reduce: Reduce | None = None) -> Planned:
        T = velocities.shape[0]
        return Planned(exact_plan(T), windows=[[k] for k in range(T)])


@dataclass(frozen=True)
class WindowPlanner:
    """JAGG windows of `window` consecutive trained steps (the last keeps the remainder). round(jagg_frac x windows)
    of them, ranked by `route_by` (vcos: endpoint-velocity cosine; weighted: (1 - cos) x sum |g_k|) and none with an
    endpoint cosine below `min_cos`, take one joint pass over their endpoints; the others train per step."""

    window: int = 4
    jagg_frac: float = 1.0
    route_by: RouteBy = "vcos"
    min_cos: Optional[float] = None
    switch: Optional[ExpertSwitch] = field(default=None, metadata=MODEL_SET)

    name: ClassVar[str] = "window"
    rows_per_pass: ClassVar[None] = None  # one pass per segment: a window's two endpoints together

    def __post_init__(self):
        _require(self.window >= 1, "window", f"must be >= 1, got {self.window}")
        _require(0.0 <= self.jagg_frac <= 1.0, "jagg_frac", f"must be in [0, 1], got {self.jagg_frac}")
        _require(self.route_by in ROUTE_BY, "route_by", f"must be one of {', '.join(ROUTE_BY)}, got {self.route_by!r}")
        _require(self.min_cos is None or -1.0 <= self.min_cos <= 1.0, "min_cos",
                 f"must be in [-1, 1], got {self.min_cos}")

    @property
    def knots_per_pass(self) -> int:
        return 2 if self.window > 1 and self.jagg_frac > 0 else 1

    def max_interior(self, T: int) -> int:
        return max(0, min(self.window, T) - 2) if self.jagg_frac > 0 else 0

    def fixed_plan(self, T: int) -> Plan | None:
        """Every window routed (jagg_frac 1, no min_cos): the plan is known before the rollout (not with an expert
        switch: where it cuts depends on the sigmas)."""
        fixed = self.jagg_frac == 1.0 and self.min_cos is None and self.switch is None
        return plan_uniform(T, self.window) if fixed else None

    def plan(self, velocities: torch.Tensor, sigmas: torch.Tensor, *, grad_norms: GradNorms | None = None,
             reduce: Reduce | None = None) -> Planned:
        # windows of `window` positions within each span of one expert (the whole range without a switch)
        windows = [w for lo, hi in _spans(self.switch, sigmas, velocities.shape[0])
                   for w in split_windows(range(lo, hi + 1), self.window)]
        norms = None
        if self.route_by == "weighted":
            if grad_norms is None:
                raise ValueError("route_by='weighted' needs grad_norms (|g_k| per trained step)")
            norms = grad_norms()
        routing = route_windows(windows, velocities, jagg_frac=self.jagg_frac, route_by=self.route_by,
                                min_cos=self.min_cos, grad_norms=norms, reduce=reduce)
        return Planned(knots_from_windows(windows, use_jagg=routing.use_jagg), windows=windows,
                       jagg_windows=routing.num_jagg, cosines=routing.cosines)


@dataclass(frozen=True)
class SharedKnotPlanner:
    """Segments of `window` steps overlapping on their boundary knot (stride window - 1: fewer knots than
    WindowPlanner's for the same span), the sorted knots `rows_per_pass` at a time per with-grad pass."""

    window: int = 4
    rows_per_pass: int = 2
    switch: Optional[ExpertSwitch] = field(default=None, metadata=MODEL_SET)

    name: ClassVar[str] = "shared"

    def __post_init__(self):
        _require(self.window >= 1, "window", f"must be >= 1, got {self.window}")
        _require(self.rows_per_pass >= 1, "rows_per_pass", f"must be >= 1, got {self.rows_per_pass}")

    @property
    def knots_per_pass(self) -> int:
        return self.rows_per_pass

    def max_interior(self, T: int) -> int:
        return max(0, min(self.window, T) - 2)

    def fixed_plan(self, T: int) -> Plan | None:
        return plan_uniform(T, self.window, share=True) if self.switch is None else None

    def plan(self, velocities: torch.Tensor, sigmas: torch.Tensor, *, grad_norms: GradNorms | None = None,
             reduce: Reduce | None = None) -> Planned:
        # each span of one expert its own shared-knot plan; consecutive spans side by side (no knot shared across)
        plan = [(a + lo, b + lo) for lo, hi in _spans(self.switch, sigmas, velocities.shape[0])
                for a, b in plan_uniform(hi - lo + 1, self.window, share=True)]
        return Planned(plan, jagg_windows=_interpolated(plan))


@dataclass(frozen=True)
class BudgetPlanner:
    """At most floor(T / speedup) knots (first and last trained step included), placed by the DP (knots.py) where
    the error model (residual: the rollout velocities' interpolation residual; cosine: endpoint decorrelation)
    times |g_k| says interpolation would cost least; `rows_per_pass` knots per with-grad pass."""

    speedup: float = 2.0
    error_model: ErrorModel = "residual"
    rows_per_pass: int = 2

    name: ClassVar[str] = "budget"

    def __post_init__(self):
        _require(self.speedup >= 1.0, "speedup", f"must be >= 1, got {self.speedup}")
        _require(self.error_model in ERROR_MODELS, "error_model",
                 f"must be one of {', '.join(ERROR_MODELS)}, got {self.error_model!r}")
        _require(self.rows_per_pass >= 1, "rows_per_pass", f"must be >= 1, got {self.rows_per_pass}")

    @property
    def knots_per_pass(self) -> int:
        return self.rows_per_pass

    def max_interior(self, T: int) -> int:
        return max(0, T - budget_for_speedup(T, self.speedup)) if T > 1 else 0

    def fixed_plan(self, T: int) -> None:
        return None  # the DP reads the rollout's velocities and |g_k|

    def plan(self, velocities: torch.Tensor, sigmas: torch.Tensor, *, grad_norms: GradNorms | None = None,
             reduce: Reduce | None = None) -> Planned:
        """The DP on the error model, fed with |g_k| at the rollout's velocities; with data parallelism the |g_k|
        are combined over ranks (root of summed squares) and the per-rank cost tables averaged before the DP."""
        if grad_norms is None:
            raise ValueError("the budget planner needs grad_norms (|g_k| per trained step)")
        T = velocities.shape[0]
        velocities, sigmas = velocities.cpu(), sigmas.cpu()
        g = grad_norms()
        if reduce is not None:
            g = reduce(list(g), "norm")
        error_fn = (residual_error(velocities, sigmas) if self.error_model == "residual"
                    else cosine_error(velocity_cosines(velocities), sigmas))
        plan = plan_budget(g, error_fn, budget_for_speedup(T, self.speedup),
                           reduce=None if reduce is None else (lambda values: reduce(values, "mean")))
        return Planned(plan, jagg_windows=_interpolated(plan))


Planner = Union[ExactPlanner, WindowPlanner, SharedKnotPlanner, BudgetPlanner]
PLANNERS: dict[str, type] = {cls.name: cls for cls in (ExactPlanner, WindowPlanner, SharedKnotPlanner, BudgetPlanner)}


def planner_keys(kind: str) -> tuple[str, ...]:
    """The settings planner `kind` takes (its dataclass fields, but those the model sets: `switch`)."""
    return tuple(f.name for f in dataclasses.fields(PLANNERS[kind]) if f.metadata != MODEL_SET)


def _spans(switch: ExpertSwitch | None, sigmas: torch.Tensor, T: int) -> list[tuple[int, int]]:
    """The position ranges a plan covers separately: all of 0 .. T-1, or the switch's spans of one expert."""
    return [(0, T - 1)] if switch is None else switch.spans(sigmas)


def with_switch(planner: Planner, switch: ExpertSwitch | None) -> Planner:
    """`planner` cutting its segments at a two-expert model's switch (None: as it is). The exact planner needs no
    cut (each step its own segment); the budget planner's DP places knots over the whole trajectory and has no cut,
    so it is refused (the config refuses jagg.planner budget on such a model first, train/config.py)."""
    if switch is None or isinstance(planner, ExactPlanner):
        return planner
    if isinstance(planner, BudgetPlanner):
        raise PlannerSettingError("planner", "the budget planner cannot cut its segments at a two-expert model's "
                                             "switch; use jagg.planner uniform")
    return dataclasses.replace(planner, switch=switch)


def build_planner(kind: str, **settings) -> Planner:
    """The planner `kind` (PLANNERS) with `settings`. Settings it has no field for raise PlannerSettingError naming
    all of them and the planners that take them; one out of range raises it naming that one."""
    if kind not in PLANNERS:
        raise ValueError(f"planner must be one of {', '.join(PLANNERS)}, got {kind!r}")
    own = planner_keys(kind)
    foreign = [key for key in settings if key not in own]
    if foreign:
        owners = {key: [k for k in PLANNERS if key in planner_keys(k)] for key in foreign}
        groups: dict[tuple, list[str]] = {}
        for key in foreign:
            groups.setdefault(tuple(owners[key]), []).append(key)
        said = "; ".join(f"{', '.join(keys)}: a setting of the {' and '.join(who) or 'no'} "
                         f"planner{'s' * (len(who) > 1)}"
                         for who, keys in groups.items())
        raise PlannerSettingError(foreign, f"the {kind} planner does not use {'them' if len(foreign) > 1 else 'it'} "
                                           f"({said})", owners)
    return PLANNERS[kind](**settings)
