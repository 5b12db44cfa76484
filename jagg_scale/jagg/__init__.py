"""JAGG: Jacobian-Aggregated Group Gradient. Pure torch, no distributed code.

    backward.py   knot_backward, the one place a transformer backward happens: it runs any knot plan;
                  jagg_backward (one window) and exact_backward (Flow-GRPO's per-step baseline) are plans too.
                  Start here: its docstring states the math.
    plans.py      knot plans: segments, knots, passes, composite upstream gradients; trained steps, windows of W
                  steps and their sigma weights a_k
    planners.py   the planners, one typed object each (exact, window, shared, budget): which plan a minibatch gets;
                  the window planner's jagg_frac routing (vcos | weighted)
    knots.py      the budget planner's error models and DP

    from jagg_scale.jagg import jagg_backward
"""

from .backward import (INTERMEDIATE_MODES, Backward, IntermediateMode, ModelFn, StepLoss, autograd_backward,
                       exact_backward, jagg_backward, knot_backward)
from .knots import (ERROR_MODELS, ErrorModel, cosine_error, plan_budget, plan_cost, plan_from_costs, residual_error,
                    segment_costs, velocity_cosines)
from .planners import (PLANNERS, ROUTE_BY, BudgetPlanner, ExactPlanner, Planned, Planner, PlannerSettingError, RouteBy,
                       Routing, SharedKnotPlanner, WindowPlanner, build_planner, endpoint_cosines, num_routed,
                       planner_keys, route_windows)
from .plans import (Plan, budget_for_speedup, check_plan, composite_upstream, exact_plan, fill_interior,
                    interpolate_forwards, knots_from_windows, pass_groups, plan_from_knots, plan_knots, plan_uniform,
                    restrict_plan, split_windows, trained_steps, window_weights)

__all__ = [
    "INTERMEDIATE_MODES", "Backward", "IntermediateMode", "ModelFn", "StepLoss", "autograd_backward",
    "exact_backward", "jagg_backward", "knot_backward",
    "ERROR_MODELS", "ErrorModel", "cosine_error", "plan_budget", "plan_cost", "plan_from_costs", "residual_error",
    "segment_costs", "velocity_cosines",
    "PLANNERS", "BudgetPlanner", "ExactPlanner", "Planned", "Planner", "PlannerSettingError", "SharedKnotPlanner",
    "WindowPlanner", "build_planner", "planner_keys",
    "Plan", "budget_for_speedup", "check_plan", "composite_upstream", "exact_plan", "fill_interior",
    "interpolate_forwards", "knots_from_windows", "pass_groups", "plan_from_knots", "plan_knots", "plan_uniform",
    "restrict_plan",
    "ROUTE_BY", "RouteBy", "Routing", "endpoint_cosines", "num_routed", "route_windows",
    "split_windows", "trained_steps", "window_weights",
]
