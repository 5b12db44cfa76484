"""One rank's share of a production config, as overrides that make a single process run it.

    rank_share(cfg, world_size) -> ["train.prompts_per_step=6", "train.batch_size=72", "sampling.num_steps=10", ...]

A rank of `world_size` samples prompts_per_step / world_size groups and trains batch_size / world_size rows of every
minibatch (train/rows.py), through the same sampler, loss and planner. The overrides carry the config's whole
`sampling`, `grpo` and `jagg` sections and its precision and LoRA switch, so a CPU test or a one-GPU check on a
small model runs the production loop itself (tests/train/test_host_syncs.py, tools/gpu_check.py), not a copy of
its values that could drift from the config.
"""

from __future__ import annotations

import dataclasses

import yaml

__all__ = ["rank_share"]


def _value(v) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def rank_share(cfg, world_size: int) -> list[str]:
    t = cfg.train
    if t.prompts_per_step % world_size or t.batch_size % world_size:
        raise ValueError(f"train.prompts_per_step {t.prompts_per_step} and train.batch_size {t.batch_size} must be "
                         f"multiples of the world size {world_size} for a rank's share to be a whole config")
    out = [f"train.prompts_per_step={t.prompts_per_step // world_size}",
           f"train.batch_size={t.batch_size // world_size}", f"train.micro_batch_size={t.micro_batch_size}",
           f"model.dtype={cfg.model.dtype}", f"model.lora.enabled={str(cfg.model.lora.enabled).lower()}"]
    for section in ("sampling", "grpo", "jagg"):
        data = dataclasses.asdict(getattr(cfg, section))
        out += [f"{section}.{k}={_value(v)}" for k, v in data.items()]
    return out
