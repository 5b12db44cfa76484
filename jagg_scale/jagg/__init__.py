"""JAGG: Jacobian-Aggregated Group Gradient. Pure torch, no distributed code.

    from jagg_scale.jagg import jagg_backward      # the joint backward of one window (backward.py)
    from jagg_scale.jagg import knot_backward, plan_budget   # knot plans and the budgeted planner (knots.py)
"""

from .backward import INTERMEDIATE_MODES, exact_backward, jagg_backward
from .knots import (budget_for_speedup, check_plan, composite_upstream, cosine_error, knot_backward, knots_from_windows,
                    passes, plan_budget, plan_cost, plan_from_costs, plan_from_knots, plan_knots, plan_uniform, residual_error,
                    segment_costs, velocity_cosines)
from .routing import ROUTE_BY, Routing, endpoint_cosine, num_routed, route_windows
from .windows import plan_windows, trained_steps, window_weights

__all__ = [
    "INTERMEDIATE_MODES", "exact_backward", "jagg_backward", "ROUTE_BY", "Routing", "endpoint_cosine",
    "num_routed", "route_windows", "plan_windows", "trained_steps", "window_weights",
    "budget_for_speedup", "check_plan", "composite_upstream", "cosine_error", "knot_backward", "knots_from_windows",
    "passes", "plan_budget", "plan_cost", "plan_from_costs", "plan_from_knots", "plan_knots", "plan_uniform", "residual_error",
    "segment_costs", "velocity_cosines",
]
