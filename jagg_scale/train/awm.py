"""Advantage Weighted Matching as an algorithm unit (train.algorithm awm; the contract in algorithm.py): `AWM(...)`.

AWM (arXiv 2509.25050; X-GenGroup/Flow-Factory trainers/awm.py, commit a0b2bc5) trains on the forward process like
DiffusionNFT: a CFG-free deterministic ODE rollout keeps each row's final latents d, and per minibatch (rows.py) and
sample K = awm.num_train_timesteps training timesteps are drawn from the sampling schedule (the reference's discrete
strategies, trainers/awm.py:156-173 and utils/noise_schedule.py:184-259): the schedule's steps whose noise level lies
in [1 - hi, 1 - lo] (awm.timestep_range [lo, hi]), the first of them eligible (discrete), forced (discrete_with_init)
or excluded (discrete_wo_init), stratified into K strata of the index span with one uniform draw in each, sorted from
high noise to low; drawn afresh with the noise every inner epoch (the reference draws per batch inside its
inner-epoch loop, :417-456):

    x_t = (1 - t) d + t e       e fresh per timestep (:450-456), one per sample, or one per JAGG window (awm.noise)
    v_ema, v_ref                the EMA policy's (awm.ema_kl_beta > 0 or off_policy) and the reference's velocities
                                (awm.kl_beta > 0) there, no grad; with awm.frozen_at knots at the plan's knots only,
                                linear in t inside each window
    gradient                    of sum_k L_k / K (awm/loss.py) through knot_backward, the planner's knot plan over the
                                sample's K timesteps: mode exact is the reference's one backward per timestep; JAGG
                                windows take one joint pass over each window's two endpoints (JAGG-AWM). The interior
                                timesteps' velocity values (jagg.intermediate): interpolate (auto) = v_ema moved by the
                                endpoints' drift (without an EMA policy: the endpoints' own blend), cached = v_ema,
                                forward = fresh no-grad forwards
    step                        engine.step(), one optimizer step per minibatch (the runner's: runner.py)

and after every awm.ema_update_interval-th rollout the EMA policy moves towards the trained one:
ema = decay ema + (1 - decay) trained with decay = awm.ema_schedule at the step (the reference's ema_step after each
epoch's optimisation, :125, ema/ema.py:103-129). The rollout samples with the trained weights, or with the EMA
policy's under awm.off_policy (:85-92, :119-121). Every draw is seeded by (run.seed, step, inner epoch, global row),
so N ranks draw what one process does and a resumed run what the uninterrupted one drew; the EMA policy is a shadow
of the engine's, checkpointed with its state.
"""

from __future__ import annotations

import contextlib

import torch

from ..awm import AWMBatch, AWMStepLoss
from ..grpo.rollout import to_device
from ..sections import ConfigError
from .algorithm import RolloutSpec
from .forward_process import ForwardProcess
from .rows import row_seed

__all__ = ["AWM", "EMA_SHADOW", "schedule_span", "stratified_indices"]

NOISE_STREAM, TIMESTEP_STREAM = 13, 14  # row_seed streams (rows.py 0-4, nft.py 5-6, grpo/steps.py 9)
EMA_SHADOW = "ema_policy"  # the engine's shadow of the EMA policy (the engine's "ema" is train.ema_decay's)


def schedule_span(sigmas: torch.Tensor, timestep_range, time_sampling: str) -> tuple[int, int, int]:
    """(first, start, end): the schedule's steps whose sigma lies in [1 - hi, 1 - lo] span indices first .. end
    (noise_schedule.py:212-218, in sigma rather than the scheduler's 1000 x sigma, its 1e-3 tolerance 1e-6 here), and
    the strata cover start .. end: first (discrete), first + 1 (discrete_with_init's rest, discrete_wo_init)."""
    lo, hi = timestep_range
    valid = torch.where((sigmas >= 1.0 - hi - 1e-6) & (sigmas <= 1.0 - lo + 1e-6))[0]
    if len(valid) == 0:
        raise ConfigError(f"config key 'awm.timestep_range': {list(timestep_range)} holds none of the sampling "
                          f"schedule's noise levels {[round(float(s), 4) for s in sigmas]}")
    first, end = int(valid.min()), int(valid.max())
    return first, first + (time_sampling != "discrete"), end


def stratified_indices(n: int, start: int, end: int, generator: torch.Generator) -> torch.Tensor:
    """n indices from start .. end, one uniform draw in each of n strata (noise_schedule.py:241-259): ascending,
    distinct when n <= end - start."""
    boundaries = torch.linspace(start, end, n + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    return lower + (torch.rand(n, generator=generator) * (upper - lower)).long()


class AWM(ForwardProcess):
    """AWM as an algorithm unit (the contract in algorithm.py): its rollout is a CFG-free ODE keeping only the final
    latents (the trained weights', or the EMA policy's off-policy); its advantages are the group-relative ones; its
    update trains through the runner. The noise draws and the frozen models' velocities are the forward-process
    base's (forward_process.py)."""

    name = "awm"
    noise_stream = NOISE_STREAM

    def __init__(self, cfg, policy, engine, dist):
        super().__init__(cfg, policy, engine, dist)
        a = cfg.awm
        if a.uses_ema:  # the EMA policy starts as the starting weights, held like them, checkpointed
            engine.add_shadow(EMA_SHADOW)
        self.sigmas = torch.tensor(policy.host_sigmas[: cfg.sampling.num_steps], dtype=torch.float64)  # its levels
        self.first, self.start, self.end = schedule_span(self.sigmas, a.timestep_range, a.time_sampling)
        K = a.trained_count(cfg.sampling.num_steps)
        drawn = K - (a.time_sampling == "discrete_with_init")  # the stratified ones
        if cfg.jagg.mode != "exact" and drawn > self.end - self.start:
            raise ConfigError(
                f"config key 'awm.num_train_timesteps': {K} strata over the {self.end - self.start + 1} eligible "
                "steps of the sampling schedule may draw a step twice, and a JAGG window needs distinct noise "
                "levels: lower it, widen awm.timestep_range, or use jagg.mode exact")
        self._setup(K, a.noise, a.frozen_at == "knots")

    def rollout_spec(self, step: int) -> RolloutSpec:
        """The ODE on every step (no SDE step, no reference), keeping only the final latents, with the trained
        weights or (awm.off_policy) the EMA policy's."""
        weights = (lambda: self.engine.shadow_weights(EMA_SHADOW)) if self.cfg.awm.off_policy else \
            contextlib.nullcontext
        return RolloutSpec(sde_steps=frozenset(), ref_steps=frozenset(), keep="final", weights=weights)

    # ------------------------------------------------------------------ the training inputs of a minibatch
    def _timesteps(self, step: int, epoch: int, global_rows: torch.Tensor, minibatch: torch.Tensor) -> torch.Tensor:
        """[K, B] the K training timesteps of inner epoch `epoch` of each of `global_rows`, sorted from high noise
        to low; per_batch: the draw of the minibatch's first row (`minibatch`: its global rows) for every row."""
        a = self.cfg.awm
        draws = []
        for r in (minibatch[:1] if a.timesteps == "per_batch" else global_rows).tolist():
            g = torch.Generator().manual_seed(row_seed(self.cfg.run.seed, step, TIMESTEP_STREAM, r, epoch))
            if a.time_sampling == "discrete_with_init":  # noise_schedule.py:220-230
                rest = stratified_indices(self.K - 1, self.start, self.end, g)
                idx = torch.cat([torch.tensor([self.first]), rest])
            else:
                idx = stratified_indices(self.K, self.start, self.end, g)
            draws.append(self.sigmas[idx.clamp(0, len(self.sigmas) - 1)].float())
        return torch.stack(draws, dim=1).expand(self.K, len(global_rows)).contiguous()

    def _batch(self, traj, mb_cond, adv, local, global_rows, minibatch, step: int, epoch: int) -> AWMBatch:
        """The training inputs in inner epoch `epoch` of this rank's rows `local` (global `global_rows`) of the
        minibatch whose global rows are `minibatch`; `mb_cond` is their conditioning."""
        clean, t, e, noised = self._inputs(traj, local, step, epoch, global_rows,
                                           self._timesteps(step, epoch, global_rows, minibatch))
        ema = None
        if self.cfg.awm.uses_ema:
            with self.engine.shadow_weights(EMA_SHADOW):
                ema = self._predict(self.policy.model_fn(), noised, t, mb_cond)
        return AWMBatch(clean=clean, t=t, noised=noised, noise=e, advantages=adv[local], mask=self._mask[local],
                        ema=ema, ref=self._reference(noised, t, mb_cond))

    @staticmethod
    def _cached(b: AWMBatch) -> torch.Tensor:
        """knot_backward's cached velocities: the EMA policy's, or zeros (a view, no memory) without one, where
        interpolate is the endpoints' own blend (config.py refuses cached and the planners that read them)."""
        return b.ema if b.ema is not None else b.noised.new_zeros(()).expand_as(b.noised)

    # ------------------------------------------------------------------ the phase
    def update(self, traj, cond, adv, rows, step: int) -> dict:
        a = self.cfg.awm
        # the advantages, clipped to +-grpo.adv_clip_max where they are made (trainers/awm.py:469)
        values = to_device(adv.values[rows.mine], self.dist.device)
        done = self._train(
            cond, adv, rows, step,
            lambda mb_cond, local, global_rows, minibatch, epoch: self._batch(traj, mb_cond, values, local,
                                                                              global_rows, minibatch, step, epoch),
            lambda denominator: AWMStepLoss(weighting=a.weighting, ghuber_power=a.ghuber_power,
                                            clip_range=a.clip_range, off_policy=a.off_policy, kl_beta=a.kl_beta,
                                            ema_kl_beta=a.ema_kl_beta, scale=1.0 / self.K, denominator=denominator),
            self._cached)
        extra = {}
        if a.uses_ema and (step + 1) % a.ema_update_interval == 0:  # ema_step(step=epoch): ema/ema.py:103-113
            extra["ema_policy_decay"] = a.ema_decay_at(step)
            self.engine.lerp_shadow(EMA_SHADOW, extra["ema_policy_decay"])
        return done.metrics(**extra, **done.probe)
