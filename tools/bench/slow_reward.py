"""A reward of stated latency for the pools benchmark (tools/bench/pools.py): `slow` scores with another registered
reward, then waits until `latency_s` has passed since the request began, as a reward served from elsewhere (a VLM
judge on its own GPUs) does. Loaded by the reward server: `jagg-reward-server --plugin tools.bench.slow_reward
--reward 'slow:{"reward": "digit_match", "latency_s": 0.5}'`."""

from __future__ import annotations

import time

from jagg_scale.rewards import Reward, build_reward, register


@register("slow")
class Slow(Reward):
    def __init__(self, *, reward: str, latency_s: float, **options):
        if not 0 <= latency_s <= 600:
            raise ValueError(f"latency_s must be in [0, 600], got {latency_s}")
        self.inner, self.latency_s = build_reward(reward, **options), float(latency_s)

    def __call__(self, images, prompts, metadata):
        start = time.monotonic()
        out = self.inner(images, prompts, metadata)
        time.sleep(max(0.0, self.latency_s - (time.monotonic() - start)))
        return out


@register("judge")
class Judge(Reward):
    """A batched judge's cost without its model: `fixed_s` a call plus `per_row_s` a row, slept (a VLM judge on a GPU
    pays most of a batch's time whatever its size, up to its batch size); the score is the image's mean pixel, so a
    client can check it got its own rows' scores (tools/bench/reward_load.py)."""

    def __init__(self, *, fixed_s: float = 0.1, per_row_s: float = 0.002):
        if not (0 <= fixed_s <= 60 and 0 <= per_row_s <= 10):
            raise ValueError(f"fixed_s in [0, 60] and per_row_s in [0, 10], got {fixed_s}, {per_row_s}")
        self.fixed_s, self.per_row_s = float(fixed_s), float(per_row_s)

    def __call__(self, images, prompts, metadata):
        time.sleep(self.fixed_s + self.per_row_s * len(prompts))
        return images.mean(dim=tuple(range(1, images.ndim)))
