"""The `pools` section: rollout and training on separate rank pools of one launch, at most k steps apart.

The issue's `async` settings: `async` is a Python keyword, so the section that splits the world into pools and sets
how far the rollout may run ahead is named for what it makes (pools/__init__.py has the design)."""

from __future__ import annotations

from dataclasses import dataclass

from ..sections import Section, require

__all__ = ["PoolsConfig"]


@dataclass
class PoolsConfig(Section):
    # 0: one pool, every rank rolls out and trains in turn (the synchronous step). R > 0: the launch's last R ranks
    # are the rollout pool (sample, decode, score) and the first N - R the trainer pool (the engine, checkpoints, logs,
    # evaluation); each rollout rank serves (N - R) / R trainers
    rollout_ranks: int = 0
    # k: step s's rollout samples with the weights after step max(0, s - k), exactly: the rollout pool runs up to k
    # steps ahead of the trainer. 0 is the synchronous step, bit for bit
    max_staleness: int = 0
    # seconds one pool waits for the other's next message (a step's rollout; the weights it samples with) before the
    # job stops, naming the rank it waited for: longer than a step's rollout, inside parallel.collective_timeout_s
    timeout_s: int = 900
    # the largest message between the pools (a trainer's rows of a step's rollout), checked from its header before a
    # buffer is allocated
    max_message_gib: float = 64.0

    @property
    def enabled(self) -> bool:
        return self.rollout_ranks > 0

    def trainer_world(self, world_size: int) -> int:
        """The trainer pool's size in a launch of `world_size` processes."""
        return world_size - self.rollout_ranks

    def check(self, prefix: str) -> None:
        require(self.rollout_ranks >= 0, f"{prefix}.rollout_ranks", f"must be >= 0, got {self.rollout_ranks}")
        require(self.max_staleness >= 0, f"{prefix}.max_staleness", f"must be >= 0, got {self.max_staleness}")
        require(self.max_staleness == 0 or self.enabled, f"{prefix}.max_staleness",
                f"is {self.max_staleness}, but {prefix}.rollout_ranks is 0: one pool rolls out and trains in turn, "
                "nothing runs ahead (set the rollout pool's size)")
        require(self.timeout_s >= 1, f"{prefix}.timeout_s", f"must be >= 1 second, got {self.timeout_s}")
        require(0 < self.max_message_gib <= 1024, f"{prefix}.max_message_gib",
                f"must be in (0, 1024], got {self.max_message_gib}")
