"""Sigma schedules for rectified-flow sampling.

The schedule is decreasing, s_0 = 1 > s_1 > ... > s_T = 0. SD3 (and our default) shifts a uniform grid towards
high noise, s' = shift * s / (1 + (shift - 1) s), which spends more steps where the image's layout forms.
"""

from __future__ import annotations

import torch


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's time shift s' = shift s / (1 + (shift - 1) s); shift = 1 is the identity."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """float32 [num_steps + 1]: uniform in s from 1 to 0, then shifted; the last entry is exactly 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(sigmas, shift).float()


def model_schedule(model, num_steps: int, shift: float | None) -> torch.Tensor:
    """The schedule a run samples with: `sigma_schedule(num_steps, shift)`, or with shift None the loaded
    pipeline's own (`model.pipeline_sigmas`, e.g. FLUX's resolution-dependent dynamic shift)."""
    if shift is not None:
        return sigma_schedule(num_steps, shift)
    if not hasattr(model, "pipeline_sigmas"):
        raise ValueError(f"sampling.shift is null but {type(model).__name__} has no pipeline schedule")
    return model.pipeline_sigmas(num_steps).float()
