"""Flow-GRPO: the SDE sampler and its log-prob, advantages, the clipped surrogate loss, rollout."""

from .advantages import Advantages, combine_advantages, compute_advantages, gdpo_advantages
from .loss import GRPOStepLoss, StepBatch
from .rollout import Trajectories, guided_velocity, sample_ode, sample_sde
from .schedule import model_schedule, shift_sigmas, sigma_schedule
from .sde import (SDE_KINDS, SDE_STEPS, SDEStep, SdeKind, cps_step_with_logprob, kl_to_reference, ode_step, sde_std,
                  sde_step_with_logprob)

__all__ = [
    "Advantages", "combine_advantages", "compute_advantages", "gdpo_advantages", "GRPOStepLoss", "StepBatch",
    "Trajectories",
    "guided_velocity", "sample_ode", "sample_sde", "model_schedule", "shift_sigmas", "sigma_schedule", "SDEStep",
    "kl_to_reference", "ode_step", "sde_std", "sde_step_with_logprob", "SDE_KINDS", "SDE_STEPS", "SdeKind",
    "cps_step_with_logprob",
]
