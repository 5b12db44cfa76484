"""The run config against a two-expert pipeline (Wan2.2 A14B: `transformer` above the noise level boundary_ratio,
`transformer_2` below; models/wan_experts.py). What cannot be right with two experts is refused before anything is
built, each a ConfigError naming its key:

    train.algorithm            grpo and dppo plan their knots with the expert switch (jagg/planners.py with_switch);
                               nft, awm and gcpo plan theirs without it, so a segment could cross the switch
    grpo.step_selection        first: every row of a pass at the same step, so one expert runs a pass on every rank
                               (random / windows put a rank's rows on either side of the switch: the ranks of a
                               sharded model would then run different experts and their collectives would not match)
    grpo.ref_at                steps: knots needs the plan before the rollout, and where the switch cuts depends on
                               the sigmas the rollout samples at
    jagg.planner               uniform: the budget planner's DP has no cut at the switch

and sampling.guidance_2 (the low-noise expert's CFG scale) is refused with one expert.

Where the pipeline is not on this machine at validation time (a hub id not cached yet), the same checks run when
the algorithm is built (train/algorithm.py), against the loaded model's switch.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..sections import ConfigError

__all__ = ["check_experts", "pipeline_has_experts"]


def pipeline_has_experts(path) -> bool:
    """Whether the pipeline directory's model_index.json names a transformer_2 (a null entry is none)."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return False
    entry = json.loads(index.read_text()).get("transformer_2")
    return isinstance(entry, list) and bool(entry) and entry[0] is not None


def check_experts(cfg, two_experts: bool) -> None:
    """ConfigError naming the first key the two experts rule out (module docstring); with one expert, the key only
    two act on (sampling.guidance_2)."""
    if not two_experts:
        if cfg.sampling.guidance_2 is not None:
            raise ConfigError(f"config key 'sampling.guidance_2' is {cfg.sampling.guidance_2}, but the model has one "
                              "transformer: it is the low-noise expert's CFG scale of a two-expert pipeline (Wan2.2 "
                              "A14B); use sampling.guidance")
        return
    why = "the model has two experts switched by noise level (transformer_2 below boundary_ratio)"
    algorithm = cfg.train.algorithm
    if algorithm not in ("grpo", "dppo"):
        raise ConfigError(f"config key 'train.algorithm' is {algorithm}, but {why}: only grpo and dppo plan their "
                          "JAGG windows within one expert; use one of them")
    if cfg.grpo.step_selection != "first":
        raise ConfigError(f"config key 'grpo.step_selection' is {cfg.grpo.step_selection}, but {why}: rows drawn "
                          "per sample put a pass's rows on both sides of the switch (ranks would run different "
                          "experts); use first")
    if cfg.grpo.ref_at != "steps":
        raise ConfigError(f"config key 'grpo.ref_at' is {cfg.grpo.ref_at}, but {why}: the knots are cut at the "
                          "switch from the sampled sigmas, not known before the rollout; use steps")
    if cfg.jagg.mode == "jagg" and cfg.jagg.planner == "budget":
        raise ConfigError(f"config key 'jagg.planner' is budget, but {why}: its knots are not cut at the switch; "
                          "use uniform")
