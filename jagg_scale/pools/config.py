"""The `pools` section: rollout and training on separate rank pools of one launch, at most k steps apart.

The issue's `async` settings: `async` is a Python keyword, so the section that splits the world into pools and sets
how far the rollout may run ahead is named for what it makes (pools/__init__.py has the design)."""

from __future__ import annotations

from dataclasses import dataclass

from ..sections import Section, require

__all__ = ["PoolsConfig", "check_pools"]


@dataclass
class PoolsConfig(Section):
    # 0: one pool, every rank rolls out and trains in turn (the synchronous step). R > 0: the launch's last R ranks
    # are the rollout pool (sample, decode, score) and the first N - R the trainer pool (the engine, checkpoints, logs,
    # evaluation); each rollout rank serves (N - R) / R trainers
    rollout_ranks: int = 0
    # k: step s's rollout samples with the weights after step max(0, s - k), exactly: the rollout pool runs up to k
    # steps ahead of the trainer. 0 is the synchronous step, bit for bit
    max_staleness: int = 0
    # c > 0: a stale rollout trained with decoupled PPO: the ratio and grpo.clip_range taken to the weights being
    # trained, the behaviour policy corrected by an importance weight capped at c (grpo/loss.py). 0: the ratio to the
    # behaviour policy as recorded at rollout (Flow-GRPO's objective, whose 1e-4 clip a stale rollout mostly exceeds)
    importance_cap: float = 0.0
    # seconds a trainer waits for its next rollout before the job stops, naming the rank it waited for (a rollout rank
    # waits twice this for the weights: the trainers' own wait for the other rollout ranks, then their update): longer
    # than a step's rollout and an update; twice it inside parallel.collective_timeout_s
    timeout_s: int = 600
    # the largest message between the pools (a trainer's rows of a step's rollout), checked from its header before a
    # buffer is allocated
    max_message_gib: float = 64.0

    @property
    def enabled(self) -> bool:
        return self.rollout_ranks > 0

    def trainer_world(self, world_size: int) -> int:
        """The trainer pool's size in a launch of `world_size` processes."""
        return world_size - self.rollout_ranks

    def checked_trainers(self, world_size: int) -> int:
        """The trainer pool's size in a launch of `world_size` processes (all of them without pools), refused by key
        when the split cannot be made."""
        if not self.enabled:
            return world_size
        trainers = self.trainer_world(world_size)
        require(trainers >= 1, "pools.rollout_ranks", f"{self.rollout_ranks} leaves no trainer among the "
                f"{world_size} processes the launcher started")
        require(trainers % self.rollout_ranks == 0, "pools.rollout_ranks",
                f"{self.rollout_ranks} must divide the trainer pool's {trainers} ranks (each rollout rank serves the "
                "same number of trainers)")
        return trainers

    def check(self, prefix: str) -> None:
        require(self.rollout_ranks >= 0, f"{prefix}.rollout_ranks", f"must be >= 0, got {self.rollout_ranks}")
        require(self.max_staleness >= 0, f"{prefix}.max_staleness", f"must be >= 0, got {self.max_staleness}")
        require(self.max_staleness == 0 or self.enabled, f"{prefix}.max_staleness",
                f"is {self.max_staleness}, but {prefix}.rollout_ranks is 0: one pool rolls out and trains in turn, "
                "nothing runs ahead (set the rollout pool's size)")
        require(self.importance_cap >= 0, f"{prefix}.importance_cap", f"must be >= 0, got {self.importance_cap}")
        require(self.importance_cap == 0 or self.max_staleness > 0, f"{prefix}.importance_cap",
                f"corrects a rollout sampled by an earlier policy version: it needs {prefix}.max_staleness > 0")
        require(self.timeout_s >= 1, f"{prefix}.timeout_s", f"must be >= 1 second, got {self.timeout_s}")
        require(0 < self.max_message_gib <= 1024, f"{prefix}.max_message_gib",
                f"must be in (0, 1024], got {self.max_message_gib}")


def check_pools(cfg, margin_s: float) -> None:
    """The checks across sections when pools.rollout_ranks > 0: what the split pipeline does not support yet is
    refused by key, and its deadlines nest: a rollout rank's reward deadline inside the trainers' wait for its rollout
    (`margin_s` apart), that wait inside the collective timeout (a trainer whose rollout never comes stops with the
    pool's one line, not the watchdog's)."""
    p = cfg.pools
    if not p.enabled:
        return
    why = "pools.rollout_ranks splits rollout and training"
    require(cfg.train.algorithm == "grpo", "pools.rollout_ranks", f"{why}, which supports train.algorithm grpo "
            f"(the behaviour policy's log-probs travel with the rollout), not {cfg.train.algorithm}")
    require(cfg.data.source == "list", "pools.rollout_ranks", f"{why}: both pools read the step's prompts from a "
            "prompt list (data.source list); a wds stream is sharded over one pool's ranks")
    require(cfg.parallel.sequence_parallel == 1, "pools.rollout_ranks", f"{why}: not combined with "
            "parallel.sequence_parallel yet")
    require(not cfg.reward.shard, "pools.rollout_ranks", f"{why}: the rollout pool scores its rows itself "
            "(reward.shard false)")
    require(cfg.jagg.probe_every == 0, "pools.rollout_ranks", f"{why}: the exact-gradient probe runs on one process")
    c = cfg.parallel.collective_timeout_s
    require(2 * p.timeout_s + margin_s <= c, "pools.timeout_s",
            f"{p.timeout_s} s: twice it (a rollout rank's wait for the weights) must end {margin_s} s inside "
            f"parallel.collective_timeout_s={c} (a rank waiting at the bridge keeps its pool waiting in the next "
            "collective): lower it or raise the collective timeout")
    require(not cfg.reward.background or cfg.reward_deadline_s + margin_s <= p.timeout_s, "reward.deadline_s",
            f"{cfg.reward_deadline_s:g} s must end {margin_s} s inside pools.timeout_s={p.timeout_s} (the trainers "
            "wait that long for a rollout and its rewards)")
