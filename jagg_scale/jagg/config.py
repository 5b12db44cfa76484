"""The jagg section of the run configuration (torchtitan's pattern: a component's section beside it): which planner
(planners.py) plans each minibatch's knots, and that planner's settings. A choice owns its keys: a setting the
chosen planner does not take, or any planner key under mode exact, is a ConfigError naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from ..sections import ConfigError, Section, refuse_set, require
from .backward import IntermediateMode
from .knots import ErrorModel
from .planners import ExactPlanner, Planner, PlannerSettingError, RouteBy, build_planner

__all__ = ["JAGGConfig", "JaggMode", "PlanKind", "Intermediate", "PLANNER_SETTINGS", "PLANNER_CHOICE"]

JaggMode = Literal["jagg", "exact"]  # exact: Flow-GRPO's per-step backward
PlanKind = Literal["uniform", "budget"]  # jagg.planner: windows of jagg.window (shared knots or not) | the DP planner
Intermediate = Literal[("auto", *get_args(IntermediateMode))]  # auto: chosen per update (train.update)

# jagg: the planner settings (jagg/planners.py) a config section may carry; null = the chosen planner's default
PLANNER_SETTINGS = ("window", "jagg_frac", "route_by", "min_cos", "speedup", "rows_per_pass", "error_model")
PLANNER_CHOICE = {"window": "jagg.planner uniform", "shared": "jagg.planner uniform with jagg.share_knots true",
                  "budget": "jagg.planner budget"}


@dataclass
class JAGGConfig(Section):
    # Which planner (jagg/planners.py) plans each minibatch's knots: mode exact is JAGG off (Flow-GRPO's per-step
    # backward; the plan keys below are then not used, as lora's are with lora.enabled false); with mode jagg,
    # plan uniform is the window planner (share_knots true: the shared-knot planner) and plan budget the DP planner
    mode: JaggMode = "jagg"
    planner: PlanKind = "uniform"
    share_knots: bool = False
    # The chosen planner's settings; null (unset) = its default. A key the chosen planner does not take is an error
    window: Optional[int] = None  # window, shared: trained steps per window (4)
    jagg_frac: Optional[float] = None  # window: the fraction of windows routed to JAGG (1.0; 0 = Flow-GRPO)
    route_by: Optional[RouteBy] = None  # window: how windows are ranked for routing, vcos | weighted (vcos)
    min_cos: Optional[float] = None  # window: no JAGG for a window whose endpoint cosine is below this (none)
    speedup: Optional[float] = None  # budget: transformer rows per sample <= trained steps / speedup (2.0)
    rows_per_pass: Optional[int] = None  # shared, budget: knots per joint forward+backward (2)
    error_model: Optional[ErrorModel] = None  # budget: residual | cosine (residual)
    # the interpolated steps' velocity values: auto | cached | interpolate | forward
    intermediate: Intermediate = "auto"
    probe_every: int = 0  # every N steps log the exact-vs-plan gradient cosine (extra passes); 0 = off

    @property
    def planner_kind(self) -> str:
        """exact | window | shared | budget (jagg/planners.py PLANNERS)."""
        if self.mode == "exact":
            return "exact"
        if self.planner == "budget":
            return "budget"
        return "shared" if self.share_knots else "window"

    def make_planner(self) -> Planner:
        """The planner this section chooses, with the settings it sets (the one place planners are built)."""
        if self.mode == "exact":
            return ExactPlanner()
        settings = {k: getattr(self, k) for k in PLANNER_SETTINGS if getattr(self, k) is not None}
        return build_planner(self.planner_kind, **settings)

    def check(self, prefix: str) -> None:
        require(self.probe_every >= 0, f"{prefix}.probe_every", "must be >= 0 (0 disables the probe)")
        require(self.mode == "jagg" or self.probe_every == 0, f"{prefix}.probe_every",
                 f"compares a plan's gradient with the exact one: with {prefix}.mode exact there is no plan to probe "
                 "(set it to 0)")
        require(not (self.share_knots and self.planner == "budget"), f"{prefix}.share_knots",
                 f"is a setting of {prefix}.planner uniform (the budget planner's knots are always shared)")
        if self.mode == "exact":
            why = f"{prefix}.mode is exact (one backward per trained step: no planner"
            refuse_set(self, prefix, ("planner", "share_knots", *PLANNER_SETTINGS), f"{why} to set)")
            refuse_set(self, prefix, ("intermediate",), f"{why}, no interpolated step to give a velocity)")
            return
        try:
            self.make_planner()
        except PlannerSettingError as err:
            keys = [f"{prefix}.{k}" for k in err.keys]
            named = ", ".join(f"'{k}'" for k in keys)
            if err.owners is None:  # a value out of range
                raise ConfigError(f"config key {named} {err}") from None
            kind, many = self.planner_kind, len(keys) > 1
            raise ConfigError(f"config key{'s' * many} {named} {'are' if many else 'is'} set, but {err} "
                              f"[{PLANNER_CHOICE[kind]} chose the {kind} planner]: remove {'them' if many else 'it'}, "
                              f"or on the command line {' '.join(k + '=null' for k in keys)}") from None
