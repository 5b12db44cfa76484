"""The `pools` section refuses, by key, what the split pipeline cannot run, before any process group or model."""

from __future__ import annotations

import pytest

from jagg_scale.train.config import ConfigError, load_config, validate_world
from train_runs import TINY

ON = ["pools.rollout_ranks=1"]


def _cfg(*overrides):
    return load_config(TINY, list(overrides))


@pytest.mark.parametrize("overrides, key, message", [
    (["pools.rollout_ranks=-1"], "pools.rollout_ranks", "must be >= 0"),
    (["pools.max_staleness=1"], "pools.max_staleness", "pools.rollout_ranks is 0"),
    ([*ON, "pools.max_staleness=-1"], "pools.max_staleness", "must be >= 0"),
    ([*ON, "pools.timeout_s=0"], "pools.timeout_s", "must be >= 1"),
    ([*ON, "pools.max_message_gib=0"], "pools.max_message_gib", r"must be in \(0, 1024\]"),
    ([*ON, "train.algorithm=nft", "grpo.kl_beta=0", "jagg.mode=exact"], "pools.rollout_ranks",
     "supports train.algorithm grpo"),
    ([*ON, "jagg.probe_every=1"], "pools.rollout_ranks", "probe runs on one process"),
    ([*ON, "pools.timeout_s=890"], "pools.timeout_s", "twice it .* must end 30 s inside "
     "parallel.collective_timeout_s=1800"),
    ([*ON, "reward.deadline_s=580"], "reward.deadline_s", "must end 30 s inside pools.timeout_s=600"),
])
def test_a_pools_setting_that_cannot_run_is_refused_by_key(overrides, key, message):
    with pytest.raises(ConfigError, match=rf"config key '{key}'.*{message}"):
        _cfg(*overrides)


def test_the_reward_deadline_defaults_inside_the_pools_wait():
    assert _cfg(*ON, "pools.timeout_s=500").reward_deadline_s == 250
    assert _cfg().reward_deadline_s == 900  # half the collective timeout, as before


@pytest.mark.parametrize("world, overrides, key, message", [
    (3, ["pools.rollout_ranks=3"], "pools.rollout_ranks", "leaves no trainer among the 3 processes"),
    (5, ["pools.rollout_ranks=2"], "pools.rollout_ranks", "must divide the trainer pool's 3 ranks"),
    # the trainer pool's own checks run at its size: 2 trainers need a sharding engine
    (3, ["pools.rollout_ranks=1"], "parallel.engine", "none runs one process, but the launcher started 2"),
])
def test_the_launch_size_is_checked_for_the_pools(world, overrides, key, message):
    with pytest.raises(ConfigError, match=rf"config key '{key}'.*{message}"):
        validate_world(_cfg(*overrides), world)


def test_one_trainer_and_one_rollout_rank_run_on_the_one_process_engine():
    validate_world(_cfg(*ON), 2)  # the trainer pool is one process: parallel.engine none is its engine
