"""JAGG: Jacobian-Aggregated Group Gradient. Pure torch, no distributed code.

    from jagg_scale.jagg import jagg_backward      # the joint backward of one window (backward.py)
"""

from .backward import INTERMEDIATE_MODES, exact_backward, jagg_backward
from .routing import ROUTE_BY, Routing, endpoint_cosine, num_routed, route_windows
from .windows import plan_windows, trained_steps, window_weights

__all__ = [
    "INTERMEDIATE_MODES", "exact_backward", "jagg_backward", "ROUTE_BY", "Routing", "endpoint_cosine",
    "num_routed", "route_windows", "plan_windows", "trained_steps", "window_weights",
]
