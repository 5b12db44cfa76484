"""jagg_frac routing: deploy JAGG only on the windows where the linear-Jacobian assumption holds.

Two rankings, both computed from what the rollout already holds (no transformer pass):

  vcos      the paper's rule: mean over samples of cos(v_first, v_last) of the window's endpoint velocities;
            the windows with the highest cosine get JAGG.
  weighted  expected error (1 - cos) * sum_k |g_k|: low-sigma steps carry most of the GRPO gradient norm, so
            an interpolation error there costs most. The windows with the smallest expected error get JAGG.
            Windows of 1 or 2 steps are exact under JAGG, so their expected error is 0.

round(jagg_frac * n_windows) windows are routed to JAGG (0 is exactly Flow-GRPO, 1 is JAGG everywhere); with
min_cos set, no window whose endpoint cosine is below it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, get_args

import torch

RouteBy = Literal["vcos", "weighted"]
ROUTE_BY: tuple[str, ...] = get_args(RouteBy)


@dataclass
class Routing:
    use_jagg: list[bool]  # per window
    cosines: list[float]  # endpoint-velocity cosine per window
    scores: list[float]  # the ranking score (higher = JAGG first)

    @property
    def num_jagg(self) -> int:
        return sum(self.use_jagg)


def endpoint_cosines(velocities: torch.Tensor, windows: Sequence[Sequence[int]]) -> list[float]:
    """Per window, the mean over samples of the cosine between its first and last velocities ([T, B, ...] input),
    computed on the device and read back to the host once."""
    first = torch.stack([velocities[w[0]] for w in windows]).flatten(2).double()  # views, no index tensor
    last = torch.stack([velocities[w[-1]] for w in windows]).flatten(2).double()
    return torch.nn.functional.cosine_similarity(first, last, dim=2, eps=1e-12).mean(1).tolist()


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
