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
