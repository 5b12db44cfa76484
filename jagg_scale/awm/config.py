"""The awm section of the run configuration (train.algorithm awm; train/awm.py): Advantage Weighted Matching's own
settings, with the reference's defaults (X-GenGroup/Flow-Factory hparams/training_args.py:534-623 AWMTrainingArguments,
and the EMA's, training_args.py:226-242, ema/ema_utils.py, commit a0b2bc5). Its group advantages are grpo's
(group_size, global_std, adv_clip_max: the reference's adv_clip_range, symmetric), its inner epochs
grpo.inner_epochs; the gradient is the jagg section's planner over each sample's timesteps.

The reference's keys not carried: kl_type (only 'v-based' is accepted for AWM, training_args.py:618-619), time_shift
(read by its uniform and logit_normal timestep draws only, not by the discrete ones, utils/noise_schedule.py:184-239),
ema_device and ref_param_device (placement, not math)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..sections import Section, refuse_set, require
from .loss import Weighting

__all__ = ["AWMConfig", "AWMEmaSchedule", "AWMFrozenAt", "AWMNoise", "AWMTimeSampling", "AWMTimesteps"]

# the reference's discrete time_sampling_strategy values (trainers/awm.py:156-173): stratified over the sampling
# schedule's steps inside timestep_range, with its first (noisiest) step eligible | forced first | excluded
AWMTimeSampling = Literal["discrete", "discrete_with_init", "discrete_wo_init"]
AWMTimesteps = Literal["per_row", "per_batch"]  # each sample its own draw | one draw for the whole minibatch
AWMNoise = Literal["per_timestep", "per_sample", "per_window"]  # which training timesteps share a noise draw
AWMFrozenAt = Literal["timesteps", "knots"]  # where the EMA policy's and the reference's velocities are run
AWMEmaSchedule = Literal["constant", "power", "linear"]  # Flow-Factory ema/ema_utils.py:27-75


@dataclass
class AWMConfig(Section):
    # the matching log-prob's weighting (trainers/awm.py:312-328) and ghuber's power
    weighting: Weighting = "Uniform"
    ghuber_power: float = 0.25
    # sample with the EMA policy and take its log-prob as the old one (trainers/awm.py:85-92, :443); false: the
    # current weights sample and the ratio is 1 in value (awm/loss.py)
    off_policy: bool = False
    clip_range: float = 1e-4  # the ratio's clip [1 - c, 1 + c] (its default (-1e-4, 1e-4)); acts off-policy only
    kl_beta: float = 0.0  # weight of ||v - v_ref||^2 to the starting model; 0: no reference
    ema_kl_beta: float = 0.0  # weight of ||v - v_ema||^2 to the EMA policy
    # training timesteps per sample; 0: int(sampling.num_steps x (timestep_range[1] - timestep_range[0])), at least 1
    num_train_timesteps: int = 0
    time_sampling: AWMTimeSampling = "discrete"
    # [lo, hi]: the fractions along the denoising axis whose steps are eligible, sigma in [1 - hi, 1 - lo] (its
    # float 0.9 is [0, 0.9])
    timestep_range: tuple[float, float] = (0.0, 0.9)
    timesteps: AWMTimesteps = "per_row"  # the reference draws once per per-device batch (see docs/algorithm.md)
    # which of a sample's timesteps share one noise draw: per_timestep as the reference (trainers/awm.py:450);
    # per_window: one per JAGG window, its noised inputs on one line (JAGG-AWM's exactness condition)
    noise: AWMNoise = "per_timestep"
    frozen_at: AWMFrozenAt = "timesteps"  # knots: the frozen models at the plan's knots, linear in t between them
    # the EMA policy (its KL anchor, and the sampler off-policy): ema = decay ema + (1 - decay) trained after every
    # ema_update_interval-th rollout, decay(step) by ema_schedule: constant d | power min(d, (1 + s) / (warmup + s))
    # | linear d min(s / warmup, 1) (initial decay 0)
    ema_decay: float = 0.995
    ema_update_interval: int = 10
    ema_schedule: AWMEmaSchedule = "power"
    ema_warmup_steps: int = 10

    @property
    def uses_ema(self) -> bool:
        """Whether the EMA policy is read: its KL term, or it samples (off-policy)."""
        return self.ema_kl_beta > 0 or self.off_policy

    @property
    def shadow_weights(self) -> int:
        """Shadow copies of the trainable weights the unit holds in the engine: the EMA policy, where it is read."""
        return int(self.uses_ema)

    @property
    def frozen_policies(self) -> int:
        """Frozen policies besides the KL reference evaluated at training timesteps: the EMA policy, where read."""
        return int(self.uses_ema)

    @property
    def frozen_at_knots(self) -> bool:
        return self.frozen_at == "knots"

    def trained_count(self, num_steps: int) -> int:
        """K: the training timesteps per sample (num_train_timesteps, or its default from timestep_range)."""
        lo, hi = self.timestep_range
        return self.num_train_timesteps or max(1, int(num_steps * (hi - lo)))

    def ema_decay_at(self, step: int) -> float:
        """The EMA's decay after rollout `step` (Flow-Factory ema_utils.py:38-75 with its initial_decay 0)."""
        d, warmup = self.ema_decay, self.ema_warmup_steps
        if self.ema_schedule == "constant" or (self.ema_schedule == "power" and warmup == 0):
            return d
        if self.ema_schedule == "power":
            return min(d, (1 + step) / (warmup + step))
        return d if step >= warmup else d * step / warmup

    def check(self, prefix: str) -> None:
        require(self.ghuber_power > 0, f"{prefix}.ghuber_power", f"must be > 0, got {self.ghuber_power}")
        require(self.clip_range > 0, f"{prefix}.clip_range", f"must be > 0, got {self.clip_range}")
        for key in ("kl_beta", "ema_kl_beta"):
            require(getattr(self, key) >= 0, f"{prefix}.{key}", f"must be >= 0, got {getattr(self, key)}")
        require(self.num_train_timesteps >= 0, f"{prefix}.num_train_timesteps",
                f"must be >= 0 (0: from timestep_range), got {self.num_train_timesteps}")
        lo, hi = self.timestep_range
        require(0 <= lo < hi <= 1, f"{prefix}.timestep_range", f"must be [lo, hi] with 0 <= lo < hi <= 1, got "
                f"{list(self.timestep_range)}")
        require(0 <= self.ema_decay < 1, f"{prefix}.ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        require(self.ema_update_interval >= 1, f"{prefix}.ema_update_interval",
                f"must be >= 1 rollouts, got {self.ema_update_interval}")
        require(self.ema_warmup_steps >= (1 if self.ema_schedule == "linear" else 0), f"{prefix}.ema_warmup_steps",
                f"must be >= 0 (>= 1 with the linear schedule), got {self.ema_warmup_steps}")
        # keys that act only under another choice of this section
        if self.weighting != "ghuber":
            refuse_set(self, prefix, ("ghuber_power",), f"{prefix}.weighting is {self.weighting}, not ghuber")
        if not self.off_policy:
            refuse_set(self, prefix, ("clip_range",), f"{prefix}.off_policy is false: the current weights sample, the "
                         "ratio is 1 and its clip never acts")
        if not self.uses_ema:
            refuse_set(self, prefix, ("ema_decay", "ema_update_interval", "ema_schedule", "ema_warmup_steps"),
                         f"no EMA policy is read ({prefix}.ema_kl_beta 0 and {prefix}.off_policy false)")
        if not self.uses_ema and self.kl_beta == 0:
            refuse_set(self, prefix, ("frozen_at",), f"no frozen model runs ({prefix}.ema_kl_beta, {prefix}.kl_beta 0 "
                       f"and {prefix}.off_policy false)")
        if self.uses_ema and self.ema_schedule == "constant":
            refuse_set(self, prefix, ("ema_warmup_steps",), f"{prefix}.ema_schedule constant has no warm-up")
