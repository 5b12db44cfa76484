"""Which sampling steps are trained, how they are grouped into JAGG windows, and the sigma weights.

Windows are consecutive runs of W trained steps; T need not be divisible by W, the last window keeps the
remainder. The interpolation weight of step k inside a window comes from the sigmas, not the step index,
because shifted schedules are far from uniform:

    a_k = (s_k - s_0) / (s_{W-1} - s_0),    J_k ~ (1 - a_k) J_0 + a_k J_{W-1}
"""

from __future__ import annotations

from typing import Sequence

import torch


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
    """a_k for the sigmas of one window (float64): 0 at the first step, 1 at the last, linear in sigma."""
    sigmas = sigmas.detach().double()
    if sigmas.numel() == 1:
        return torch.zeros(1, dtype=torch.float64, device=sigmas.device)
    span = sigmas[-1] - sigmas[0]
    if sigmas.device.type == "cpu":
        if span == 0:
            raise ValueError("a JAGG window needs distinct endpoint sigmas")
    else:  # checked on the device: reading span back would stall the host at every window
        torch._assert_async(span != 0, "a JAGG window needs distinct endpoint sigmas")
    return (sigmas - sigmas[0]) / span
