"""An RL algorithm is one unit: what its rollout must produce, its advantages and its update, behind one contract.

The trainer's step (trainer.py) reads the same for every algorithm:

    spec = algorithm.rollout_spec(step)                       what to sample and keep (RolloutSpec)
    traj = policy.rollout(cond, rows, step, spec=spec)        the rollout, as the spec says
    adv  = algorithm.advantages(rewards, weights, group_ids)  from the gathered reward components
    metrics = algorithm.update(traj, cond, adv, rows, step)   the update phase, through the one minibatch runner

The contract (`Algorithm`), what every unit implements:

    rollout_spec(step) -> RolloutSpec   which steps the rollout runs the SDE on and which are trained, where it runs
                                        the KL reference, with which weights it samples, and whether it keeps the
                                        per-step trajectory (latents, velocities, log-probs, ...) or only each row's
                                        final latents: a rollout stores only what the update reads
    advantages(rewards, weights, group_ids) -> Advantages   (default: the group-relative advantages under
                                        reward.aggregate, grpo/advantages.py)
    update(traj, cond, adv, rows, step) -> dict             the update phase's metrics; every algorithm trains its
                                        minibatches through runner.MinibatchRunner (minibatches x micro-batches x
                                        knot plan -> knot_backward -> engine, the probe, the non-finite policy); a
                                        unit that trains a stale rollout (pools, GRPO) also takes `behind=`, the
                                        policy versions between the weights that sampled and those trained

A unit is registered in ALGORITHMS under its train.algorithm name; `build_algorithm` builds the configured one.
Adding an algorithm = its module (a class with this contract, registered here) + its config + tests.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Literal

import torch

from ..grpo.advantages import Advantages, combine_advantages, compute_advantages, gdpo_advantages
from ..jagg import Plan
from .config import ConfigError
from .config_experts import check_experts

__all__ = ["ALGORITHMS", "Algorithm", "RolloutSpec", "algorithm_class", "build_algorithm"]


@dataclass(frozen=True)
class RolloutSpec:
    """What one step's rollout samples and stores (Policy.rollout reads it).

    sde_steps   the sampling steps run with the SDE (log-probs kept); None: every step; empty: the ODE throughout
    trained     the trajectory's steps the update trains (None: the rollout is not trained step by step)
    ref_steps   the steps the KL reference runs on (None: every SDE step; empty: nowhere)
    ref_plan    a plan over `trained` whose knots are `ref_steps`: the other trained steps' reference velocities
                are filled in, linear in sigma between the knots (grpo.ref_at knots); None: nothing filled
    keep        trajectory: latents, velocities, log-probs (and the reference's, CFG's unconditional) of every step;
                final: only each row's final latents x_T
    weights     the context the rollout samples under: the trained weights (nothing to enter) or, for an
                algorithm that samples with another policy, the engine's shadow weights (DiffusionNFT's old policy)
    """

    sde_steps: frozenset[int] | None = None
    trained: tuple[int, ...] | None = None
    ref_steps: frozenset[int] | None = None
    ref_plan: Plan | None = None
    keep: Literal["trajectory", "final"] = "trajectory"
    weights: Callable[[], ContextManager] = field(default=contextlib.nullcontext, compare=False)


class Algorithm:
    """The contract of an RL algorithm (module docstring); a unit subclasses it. Built once by the Trainer with
    the run config, the policy, the training engine and the process context."""

    name = ""

    def __init__(self, cfg, policy, engine, dist):
        self.cfg, self.policy, self.engine, self.dist = cfg, policy, engine, dist
        # a two-expert model (Wan2.2 A14B) loaded from where validation could not look: the same refusals by key
        check_experts(cfg, self.expert_switch is not None)

    @property
    def expert_switch(self):
        """The policy model's ExpertSwitch (jagg/experts.py), None for a model of one transformer."""
        return getattr(getattr(self.policy, "model", None), "expert_switch", None)

    def rollout_spec(self, step: int) -> RolloutSpec:
        raise NotImplementedError

    def advantages(self, rewards: dict, weights: dict[str, float], group_ids: list) -> Advantages:
        """The group advantages of a step's gathered reward components (`rewards`: name -> ComponentScores, the
        weights theirs; row i in group group_ids[i]) under reward.aggregate:

            sum        A = group-normalise( sum_c w_c r_c )                     one reward, weighted before GRPO
            advantage  A = sum_c w_c group-normalise( r_c )                     MixGRPO: a reward with a large
                                                                                scale cannot drown the others
            gdpo       A = batch-normalise( sum_c w_c group-normalise( r_c ) )  Flow-Factory's default

        A sample whose reward failed in any component is masked out (grpo/advantages.py)."""
        cfg = self.cfg
        clip = cfg.grpo.adv_clip_max
        valid = torch.stack([p.valid for p in rewards.values()]).all(0)
        if cfg.reward.aggregate == "gdpo":
            return gdpo_advantages([(weights[n], p.scores, p.valid) for n, p in rewards.items()], group_ids, valid,
                                   adv_clip_max=clip)
        kw = dict(global_std=cfg.grpo.global_std, adv_clip_max=clip)
        if cfg.reward.aggregate == "advantage" and len(rewards) > 1:
            return combine_advantages([(weights[n], compute_advantages(p.scores, group_ids, valid=p.valid, **kw))
                                       for n, p in rewards.items()], group_ids, valid, adv_clip_max=clip)
        # sum: the weighted sum in float64 (a reward on a 1e38 scale overflows float32), as RewardMix.weighted_sum
        total = sum(weights[n] * p.scores.double() for n, p in rewards.items())
        return compute_advantages(total, group_ids, valid=valid, **kw)

    def update(self, traj, cond, adv: Advantages, rows, step: int) -> dict:
        raise NotImplementedError


# train.algorithm -> the unit, as "module:class" under jagg_scale.train: loaded when built, since each unit's module
# imports this one for the contract (an import back would be a cycle)
ALGORITHMS: dict[str, str] = {"grpo": "update:GRPO", "nft": "nft:NFT", "dppo": "dppo:DPPO", "gcpo": "gcpo:GCPO",
                             "awm": "awm:AWM"}


def algorithm_class(name: str) -> type:
    """The unit registered under train.algorithm `name`; an unknown name is a ConfigError naming the key."""
    if name not in ALGORITHMS:
        raise ConfigError(f"config key 'train.algorithm': unknown algorithm {name!r} (known: "
                          f"{', '.join(sorted(ALGORITHMS))})")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def build_algorithm(cfg, policy, engine, dist) -> Algorithm:
    """The unit named by train.algorithm, built; an unknown name is a ConfigError naming the key."""
    return algorithm_class(cfg.train.algorithm)(cfg, policy, engine, dist)
