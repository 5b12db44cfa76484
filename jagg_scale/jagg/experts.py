"""Two experts switched by noise level (Wan2.2 A14B): which expert computes a row's velocity, and where a knot plan
must cut so that no JAGG segment crosses the switch.

diffusers' WanPipeline (0.42.1, pipelines/wan/pipeline_wan.py:585-604) runs `transformer` (the high-noise expert)
while its scheduler's timestep t >= boundary_ratio x num_train_timesteps and `transformer_2` below. The velocity is
discontinuous there: a JAGG segment whose knots sit on either side of the switch would interpolate one expert's
Jacobian from the other's (the high-noise expert's parameters have no gradient at a low-noise step at all), so the
planners (planners.py) cut every segment at the switch: each lies within one expert.

    switch = ExpertSwitch(boundary_ratio=0.875, num_train_timesteps=1000, integer_timesteps=True)
    switch.high(sigma)            True where the high-noise expert runs (per row)
    switch.cuts(sigmas)           positions q (1 .. K-1) where a segment must end at q - 1: for some row, the
                                  step at q runs another expert than the step at q - 1 (sigmas [K] or [K, B])
    switch.spans(sigmas)          [(lo, hi)] inclusive position ranges, each within one expert for every row

The timestep compared is the one the pipeline compares: t = sigma x num_train_timesteps in float32 (as the adapter
passes it to the transformer, models/wan.py wan_velocity), truncated to an integer when the pipeline's scheduler
keeps integer timesteps (UniPCMultistepScheduler casts its flow timesteps to int64,
schedulers/scheduling_unipc_multistep.py:441 and :466; FlowMatchEulerDiscreteScheduler keeps them float).
tests/jagg/test_experts.py checks the rule against the schedulers' own timesteps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertSwitch"]


@dataclass(frozen=True)
class ExpertSwitch:
    """The noise level at which a two-expert pipeline changes experts (the pipeline's `boundary_ratio`)."""

    boundary_ratio: float
    num_train_timesteps: int = 1000
    integer_timesteps: bool = False  # the scheduler's timesteps are int64 (UniPC): t is truncated before comparing

    def __post_init__(self):
        if not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must be in (0, 1), got {self.boundary_ratio}")

    @property
    def boundary_timestep(self) -> float:
        """pipeline_wan.py:586: boundary_ratio x the scheduler's num_train_timesteps."""
        return self.boundary_ratio * self.num_train_timesteps

    def high_at_timestep(self, timestep: torch.Tensor) -> torch.Tensor:
        """bool per element: the high-noise expert (`transformer`) runs at this transformer timestep."""
        t = timestep.float()
        if self.integer_timesteps:
            t = torch.floor(t)  # timesteps are >= 0: int64's truncation is the floor
        return t >= self.boundary_timestep  # pipeline_wan.py:597

    def high(self, sigma: torch.Tensor) -> torch.Tensor:
        """bool per element of sigma (any shape): the high-noise expert runs at this noise level."""
        return self.high_at_timestep(torch.as_tensor(sigma).float() * self.num_train_timesteps)

    def cuts(self, sigmas: torch.Tensor) -> list[int]:
        """Positions q where the expert changes from position q - 1 for at least one row (sigmas [K] or [K, B]):
        a segment ending at or after q must start at or after q."""
        high = self.high(sigmas.detach().cpu())
        if high.ndim == 1:
            high = high[:, None]
        changed = (high[1:] != high[:-1]).reshape(high.shape[0] - 1, -1).any(1)
        return [int(q) + 1 for q in torch.nonzero(changed).flatten()]

    def spans(self, sigmas: torch.Tensor) -> list[tuple[int, int]]:
        """Inclusive ranges of positions 0 .. K-1 between the cuts: within each, every row stays with one expert."""
        K = sigmas.shape[0]
        starts = [0, *self.cuts(sigmas)]
        return [(a, b - 1) for a, b in zip(starts, [*starts[1:], K])]
