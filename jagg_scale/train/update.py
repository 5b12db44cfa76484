"""GRPO as an algorithm unit (train.algorithm grpo; the contract in algorithm.py): `GRPO(cfg, policy, engine, dist)`.

    rollout_spec(step)   the SDE on every step or on the SDE window (grpo.sde_window: a random start per step,
                         or sliding), the trained steps (Flow-GRPO's first timestep_fraction of the trajectory, the
                         candidates each row draws its own from: grpo.step_selection random | windows), the KL
                         reference on the trained steps or on the plan's knots (grpo.ref_at), the whole trajectory
                         kept (latents, velocities, log-probs, the reference's and CFG's unconditional predictions)
    advantages           the group-relative advantages (algorithm.py)
    update(...)          inner epochs x minibatches through the runner (runner.py); per minibatch the loss is
                         GRPOStepLoss (grpo/loss.py) over the trained steps, its mean over the valid rows of every
                         rank; with step selection random | windows each row's steps laid out per row
                         (grpo/steps.py positioned); CFG: the unconditional predictions refreshed per micro-batch once
                         the weights moved (grpo.refresh_at: at every trained step, or at the minibatch plan's knots
                         and moved by their drift in between); the first minibatch's log-ratio is the on-policy
                         invariant's value

`auto` intermediate values are the rollout's cached velocities until the first applied optimizer step on this rollout
(exact) and, after it (cached values are then stale), fresh no-grad forwards (grpo.refresh_at steps) or the cached
values moved by the knots' drift (knots: `interpolate`, the same rule as the refreshed unconditional predictions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cond import Cond, index_cond
from ..grpo.guidance import Guidance
from ..grpo.loss import GRPOStepLoss, StepBatch
from ..grpo.rollout import to_device
from ..grpo.steps import candidate_steps, positioned, select_steps
from ..jagg import Plan, exact_plan, plan_knots, trained_steps
from ..jagg.planners import with_switch
from .algorithm import Algorithm, RolloutSpec
from .rows import step_seed
from .runner import Minibatch, MinibatchRunner, Refresh

__all__ = ["GRPO", "UncondRefresh", "resolve_intermediate", "step_minibatch", "trained_rows"]

WINDOW_STREAM = 3  # rows.py step_seed stream of the SDE window's start


def resolve_intermediate(setting: str, on_policy: bool, refresh_at: str = "steps") -> str:
    """`auto`: cached velocities are exact while the parameters are the rollout's, stale after any optimizer
    step (measured: gradient cosine 0.16 cached vs 0.80 forward after one Adam step, docs/algorithm.md section 3);
    then recomputed (grpo.refresh_at steps) or moved by the knots' drift (knots)."""
    if setting != "auto":
        return setting
    return "cached" if on_policy else {"steps": "forward", "knots": "interpolate"}[refresh_at]


@dataclass(frozen=True)
class UncondRefresh:
    """CFG after an optimizer step (a runner Refresh): each micro-batch's unconditional predictions recomputed at the
    current weights before its backward (Policy.fresh_uncond), at every trained step of `steps` (grpo.refresh_at
    steps: one no-grad forward of its rows per step) or at the plan's knots alone (knots: the others moved by the
    knots' drift, linear in sigma)."""

    policy: Any
    uncond: Cond  # the minibatch's unconditional conditioning (B rows)
    steps: list[int]
    at: str = "steps"  # grpo.refresh_at

    def __call__(self, batch: StepBatch, rows: slice, plan: Plan) -> StepBatch:
        return self.policy.fresh_uncond(batch, self.steps, index_cond(self.uncond, rows),
                                        plan if self.at == "knots" else None)

    def passes(self, plan: Plan) -> int:
        return len(self.steps) if self.at == "steps" else len(plan_knots(plan))


def trained_rows(t: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """t[steps] along dim 0; a view when the steps are consecutive (they always are in training)."""
    if steps == list(range(steps[0], steps[0] + len(steps))):
        return t[steps[0] : steps[0] + len(steps)]
    return t[torch.tensor(steps, device=t.device)]


def step_minibatch(batch: StepBatch, cond: Cond, loss: GRPOStepLoss, steps: list[int], *, intermediate: str = "auto",
                   on_policy: bool, refresh: Refresh | None = None, refresh_at: str = "steps") -> Minibatch:
    """A GRPO minibatch for the runner: the trajectory's trained `steps` of `batch` (their latents, sigmas and the
    rollout's velocities), jagg.intermediate `intermediate` resolved for `on_policy` and grpo.refresh_at
    `refresh_at`, `refresh` (CFG's UncondRefresh) run on each micro-batch."""
    return Minibatch(batch=batch, cond=cond, loss=loss, positions=steps,
                     inputs=lambda b: (trained_rows(b.latents, steps), trained_rows(b.sigmas, steps),
                                       trained_rows(b.velocities, steps)),
                     intermediate=resolve_intermediate(intermediate, on_policy, refresh_at), refresh=refresh)


class GRPO(Algorithm):
    """Flow-GRPO and its relatives (MixGRPO's SDE window, DanceGRPO's / eff_grpo's per-row steps, CPS): the module
    docstring. `update` returns the step's update metrics (loss statistics as 0-d device tensors, read with the
    step's other metrics)."""

    name = "grpo"

    def __init__(self, cfg, policy, engine, dist):
        super().__init__(cfg, policy, engine, dist)
        self.runner = MinibatchRunner(cfg, engine, dist)
        # two experts (Wan2.2 A14B): no knot segment crosses their switch (jagg/experts.py)
        self.runner.planner = with_switch(self.runner.planner, self.expert_switch)
        self.importance_cap = 0.0  # set per update: pools.importance_cap for a stale rollout (update's `behind`)
        g = cfg.grpo
        # the steps trained when no SDE window moves them: the first timestep_fraction, or the candidates
        self.steps = (trained_steps(cfg.sampling.num_steps, g.timestep_fraction) if g.step_selection == "first" else
                      list(range(candidate_steps(g.step_selection, cfg.sampling.num_steps))))

    # ------------------------------------------------------------------ the rollout
    def trained_steps_at(self, step: int) -> list[int]:
        """The steps trained at training step `step`: Flow-GRPO's first timestep_fraction of the trajectory, the
        candidates each sample draws its own from (grpo.step_selection random | windows: drawn per minibatch), or
        the SDE window of grpo.sde_window steps (random start per step, sliding, or scattered: any steps of the range),
        seeded by the step."""
        g, s = self.cfg.grpo, self.cfg.sampling
        if g.sde_window == 0:
            return self.steps
        lo, hi = g.sde_window_range or [0, s.num_steps]
        starts = hi - lo - g.sde_window + 1
        if g.sde_window_mode == "sliding":
            start = lo + (step // g.sde_window_every) % starts
            return list(range(start, start + g.sde_window))
        gen = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, step, WINDOW_STREAM))
        if g.sde_window_mode == "scattered":  # any sde_window steps of [lo, hi): UniRL's AllSDEScheduler
            return sorted(lo + int(i) for i in torch.randperm(hi - lo, generator=gen)[: g.sde_window])
        start = lo + int(torch.randint(starts, (1,), generator=gen))
        return list(range(start, start + g.sde_window))

    def rollout_spec(self, step: int) -> RolloutSpec:
        """The SDE on every step (or the SDE window's), the KL reference on the trained steps (grpo.ref_at steps) or
        on the knots of the plan known before the rollout (knots: config.py allows nothing else), every step kept."""
        steps = self.trained_steps_at(step)
        T = len(steps)
        ref_plan = self.runner.planner.fixed_plan(T) if self.cfg.grpo.ref_at == "knots" else exact_plan(T)
        return RolloutSpec(sde_steps=frozenset(steps) if self.cfg.grpo.sde_window else None, trained=tuple(steps),
                           ref_steps=frozenset(steps[q] for q in plan_knots(ref_plan)), ref_plan=ref_plan)

    # ------------------------------------------------------------------ the update
    def update(self, traj, cond, adv, rows, step: int, *, behind: int = 0) -> dict:
        """`behind`: the rollout was sampled `behind` policy versions before the weights trained now (pools:
        pools.max_staleness); then no minibatch is on-policy, and the first one's log-ratio is to the behaviour
        policy (behaviour_log_ratio), not the on-policy invariant's."""
        steps = self.trained_steps_at(step)
        cond, uncond = self.policy.split_cond(cond)
        # a stale rollout under pools.importance_cap: decoupled PPO (grpo/loss.py GRPOStepLoss.importance_cap)
        self.importance_cap = self.cfg.pools.importance_cap if behind else 0.0
        minibatch = self._minibatches(traj, cond, uncond, adv, rows, step, steps, self.policy.guidance_scales)
        done = self.runner.run(self.policy.model_fn(), rows, step, minibatch, fresh=behind == 0)
        # the first minibatch ran at the rollout's parameters: training must reproduce its log-probs
        first = done.first_loss.log_ratio_max() if done.first_loss is not None else None
        window = {"sde_window_start": steps[0]} if self.cfg.grpo.sde_window else {}
        ratio = {"onpolicy_log_ratio": first} if behind == 0 else {"behaviour_log_ratio": first}
        return {**done.metrics(**done.probe, **ratio), **window}

    def make_loss(self, *, scale: float, denominator: float, guidance: Guidance):
        """A minibatch's per-step loss: Flow-GRPO's clipped surrogate (grpo/loss.py), each L_k times `scale` (1 / the
        trained steps), its mean over `denominator` rows, guided with `guidance`. The hook a unit that trains GRPO's
        rollout with another objective overrides (train/dppo.py)."""
        cfg = self.cfg
        return GRPOStepLoss(noise_level=cfg.sampling.noise_level, clip_range=cfg.grpo.clip_range, beta=cfg.grpo.kl_beta,
                            scale=scale, denominator=denominator, guidance=guidance,
                            guidance_rule=self.policy.guidance_rule, sde=cfg.sampling.sde,
                            importance_cap=self.importance_cap)

    def _minibatches(self, traj, cond, uncond, adv, rows, step: int, steps: list[int], guidance: Guidance):
        """The runner's minibatch(epoch, local, global_rows, on_policy): the rows `local` (a host index, for
        index_cond: a conditioning of Tokens is cut from their host lengths, cond.py) of the trajectory; the loss
        guides with `guidance` (1: it is called with the guided velocity itself). With grpo.step_selection first every
        row trains `steps`; otherwise each row draws its own among them (the candidates) and the batch is laid out
        per row over its draw (grpo/steps.py positioned)."""
        cfg, device = self.cfg, self.dist.device
        g = cfg.grpo
        # host -> device once per step, asynchronously (advantages are computed on the host, in float64)
        adv_values, adv_mask = to_device(adv.values[rows.mine], device), to_device(adv.mask[rows.mine], device)
        K = len(steps) if g.step_selection == "first" else cfg.trained_per_sample

        def minibatch(epoch: int, local: torch.Tensor, global_rows: torch.Tensor, on_policy: bool) -> Minibatch:
            # the minibatch's mean is over its valid rows on all ranks (see GRPOStepLoss.denominator)
            loss = self.make_loss(scale=1.0 / K, denominator=float(adv.mask[global_rows].sum()) / rows.world_size,
                                  guidance=guidance)
            # the trained steps as positions in what the trajectory stores (it starts at traj.first)
            batch, trained = traj.step_batch(local, adv_values, adv_mask), traj.positions(steps)
            if g.step_selection != "first":
                drawn = select_steps(g.step_selection, cfg.sampling.num_steps, g.timestep_fraction,
                                     cfg.selection_window, cfg.run.seed, step, rows.mine[local])
                batch, trained = positioned(batch, traj.positions(drawn))
            # the rollout's uncond is stale: recomputed (grpo.refresh_at)
            refresh = (UncondRefresh(self.policy, index_cond(uncond, local), trained, g.refresh_at)
                       if uncond is not None and not on_policy else None)
            return step_minibatch(batch, index_cond(cond, local), loss, trained, intermediate=cfg.jagg.intermediate,
                                  on_policy=on_policy, refresh=refresh, refresh_at=g.refresh_at)

        return minibatch
