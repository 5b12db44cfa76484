"""Deterministic solvers for the ODE part of a rollout, and the compressed schedule around an SDE window.

Rectified flow x_s = (1 - s) d + s e (s = 1 is noise), velocity v = e - d, so the model's data prediction at
(x, s) is d = x - s v. Two solvers step the probability-flow ODE from s to t < s:

    euler   x_t = x + (t - s) v                                                   first order (the default)
    dpm2    DPM-Solver++(2M) in the flow-matching form (diffusers' DPMSolverMultistepScheduler with
            prediction_type="flow_prediction"): with alpha_s = 1 - s, sigma_s = s, lambda_s = log(alpha_s / s)
            and h = lambda_t - lambda_s,
                x_t = (t / s) x + (alpha_t - alpha_s t / s) D
            where D = d is the first-order update (it equals Euler exactly for rectified flow) and the
            multistep correction D = d + (d - d') / (2 r), r = (lambda_s - lambda_s') / h, uses the previous
            step's data prediction d' at s'. Second order; first order where lambda is infinite: the step
            that leaves s = 1 (no history), the one after it (lambda_1 = -inf makes r infinite, the correction's
            limit is 0) and the final step to t = 0 (diffusers' lower_order_final with final sigma 0).

All coefficients are Python floats computed on the host from the host copy of the schedule: a solver step reads
nothing back from the device.

Compressed rollout (sampling.ode_steps, MixGRPO-Flash): the SDE window's steps [a, a + W) keep the schedule's
own sigmas; the deterministic parts before it (s_0 = 1 -> s_a) and after it (s_{a+W} -> 0) run `ode_steps` steps
in all on a re-spaced grid. `split_ode_steps` shares them out in proportion to the original number of steps on
each side (rounded; a side that is not empty gets at least one step, and no side more than it had), and
`respace` places a side's n steps at equal distances in the original grid's step index, the sigma of a
fractional index being the linear interpolation of its two neighbouring grid points: a side's end points are
exactly the schedule's, n = its original count gives the original grid, and a divisor of it a subset of it.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence, get_args

import torch

from .sde import ode_step

OdeSolver = Literal["euler", "dpm2"]
ODE_SOLVERS = get_args(OdeSolver)


def _lambda(s: float) -> float:
    """The half log-SNR log(alpha_s / sigma_s) = log((1 - s) / s): -inf at s = 1, +inf at s = 0."""
    if s >= 1.0:
        return -math.inf
    if s <= 0.0:
        return math.inf
    return math.log1p(-s) - math.log(s)


class OdeSolverState:
    """One deterministic trajectory segment's solver: `step(x, v, s, t)` -> x_t, in float32. `euler` keeps no
    state; `dpm2` keeps the previous data prediction (a new segment starts without history: after an SDE step
    the previous prediction belongs to another ODE trajectory)."""

    def __init__(self, solver: str):
        if solver not in ODE_SOLVERS:
            raise ValueError(f"unknown ODE solver {solver!r}; choose from {ODE_SOLVERS}")
        self.solver = solver
        self._prev: tuple[torch.Tensor, float] | None = None  # (the data prediction d, its sigma)

    def step(self, x: torch.Tensor, v: torch.Tensor, s: float, t: float) -> torch.Tensor:
        x, v = x.float(), v.float()
        if self.solver == "euler":
            return ode_step(x, v, s, t)
        x0 = x - v * s
        d = x0
        if self._prev is not None and t > 0.0:
            x0_prev, s_prev = self._prev
            h, h_prev = _lambda(t) - _lambda(s), _lambda(s) - _lambda(s_prev)
            if math.isfinite(h_prev):  # s_prev = 1: r is infinite, the correction's limit is 0
                d = x0 + (x0 - x0_prev) * (h / (2.0 * h_prev))
        self._prev = (x0, s)
        return x * (t / s) + d * ((1.0 - t) - (1.0 - s) * t / s)


def respace(sigmas: Sequence[float], lo: int, hi: int, n: int) -> list[tuple[float, int | None]]:
    """n steps from sigmas[lo] to sigmas[hi] (lo < hi), equally spaced in the grid's step index: n + 1 points
    (sigma, the grid index it falls on, or None between grid points)."""
    out = []
    for i in range(n + 1):
        num = (hi - lo) * i  # the position lo + num / n, in exact integer arithmetic
        j, rem = lo + num // n, num % n
        if rem == 0:
            out.append((float(sigmas[j]), j))
        else:
            f = rem / n
            out.append((float(sigmas[j]) + f * (float(sigmas[j + 1]) - float(sigmas[j])), None))
    return out


def split_ode_steps(ode_steps: int, before: int, after: int) -> tuple[int, int]:
    """The deterministic steps (before, after) the window: `ode_steps` in all (0: the original counts) in
    proportion to the original `before` and `after`, each non-empty side at least 1 and at most its original."""
    total = before + after
    if ode_steps <= 0 or ode_steps >= total:
        return before, after

    def clamp(n: int, side: int) -> int:
        return max(min(n, side), 1 if side else 0)

    n_before = clamp(math.floor(ode_steps * before / total + 0.5), before)
    n_after = clamp(ode_steps - n_before, after)
    return clamp(ode_steps - n_after, before), n_after


Grid = list[tuple[float, "int | None"]]


def window_grids(sigmas: Sequence[float], start: int, width: int, ode_steps: int) -> tuple[Grid, Grid]:
    """The deterministic grids around the SDE window [start, start + width) of the schedule `sigmas` (T + 1
    host values): (before: 1 .. s_start, after: s_{start+width} .. 0) as `respace` points; [] for a side
    without steps."""
    T = len(sigmas) - 1
    end = start + width
    n_before, n_after = split_ode_steps(ode_steps, start, T - end)
    before = respace(sigmas, 0, start, n_before) if n_before else []
    after = respace(sigmas, end, T, n_after) if n_after else []
    return before, after
