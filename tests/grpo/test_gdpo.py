"""reward.aggregate gdpo (grpo/advantages.py gdpo_advantages) against Flow-Factory's own arithmetic, transcribed
below in NumPy from X-GenGroup/Flow-Factory a0b2bc5: src/flow_factory/advantage/advantage_processor.py
compute_gdpo (l. 451-470) with _global_mean_std (l. 260-262, the gathered-array branch), and the clip of its trainer
(trainers/grpo.py:268-269). Several groups, one reward and three, a zero-std group, the clip, failed rows."""

from pathlib import Path

import numpy as np
import pytest
import torch

from jagg_scale.grpo import compute_advantages, gdpo_advantages
from jagg_scale.rewards.multi import ComponentScores
from jagg_scale.train import ConfigError, load_config
from jagg_scale.train.algorithm import Algorithm

G = 4  # group size


def flow_factory_gdpo(rewards: dict, weights: dict, group_indices: np.ndarray, clip: float = 5.0) -> np.ndarray:
    """Flow-Factory's compute_gdpo, line by line (its variable names), then its trainer's clamp."""
    all_reward_advantages = []
    for key, reward_array in rewards.items():  # l. 457-465
        reward_adv = np.zeros_like(reward_array, dtype=np.float64)
        for group_id in np.unique(group_indices):
            mask = group_indices == group_id
            group_rewards = reward_array[mask]
            mean = np.mean(group_rewards)
            std = max(np.std(group_rewards), 1e-6)
            reward_adv[mask] = (group_rewards - mean) / std
        all_reward_advantages.append(reward_adv * weights[key])
    combined_advantages = np.sum(all_reward_advantages, axis=0)  # l. 468
    bn_mean = float(np.mean(combined_advantages))  # l. 469 -> _global_mean_std l. 261-262
    bn_std = max(float(np.std(combined_advantages)), 1e-6)
    advantages = (combined_advantages - bn_mean) / bn_std  # l. 470
    return np.clip(advantages, -clip, clip)  # trainers/grpo.py:268-269


def random_rewards(n_groups: int, names: dict, seed: int, flat_group: int | None = None) -> dict:
    """{name: float32 scores} of n_groups groups of G, each reward on its own scale; `flat_group`'s rewards all
    equal within the group (a non-dyadic 0.826 x scale: equal, never exactly representable)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, scale in names.items():
        r = torch.randn(n_groups * G, generator=gen) * scale + scale
        if flat_group is not None:
            r[flat_group * G:(flat_group + 1) * G] = 0.826 * scale
        out[name] = r.float()
    return out


def ours(rewards: dict, weights: dict, valid=None, clip: float = 5.0):
    n = len(next(iter(rewards.values())))
    ok = {k: torch.ones(n, dtype=torch.bool) if valid is None else valid[k] for k in rewards}
    every = torch.stack(list(ok.values())).all(0)
    return gdpo_advantages([(weights[k], r, ok[k]) for k, r in rewards.items()], [i // G for i in range(n)], every,
                           adv_clip_max=clip)


def groups_of(n: int) -> np.ndarray:
    return np.arange(n) // G


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_three_rewards_with_a_zero_std_group_equal_flow_factorys(seed):
    names, weights = {"pick": 1.0, "clip": 30.0, "ocr": 0.01}, {"pick": 1.0, "clip": 0.5, "ocr": 2.0}
    rewards = random_rewards(6, names, seed, flat_group=2)
    adv = ours(rewards, weights)
    ref = flow_factory_gdpo({k: v.double().numpy() for k, v in rewards.items()}, weights, groups_of(24))
    assert np.allclose(adv.values.double().numpy(), ref, rtol=1e-6, atol=1e-6)
    assert adv.zero_std_groups == 1 and adv.num_groups == 6
    assert adv.mask.tolist() == [i // G != 2 for i in range(24)]  # the flat group is masked: Flow-Factory's A ~ 0
    assert np.abs(ref[8:12]).max() < 1e-6


def test_one_reward_is_batch_normalised_unlike_sum():
    """With one reward gdpo is not `sum`: the batch normalisation divides by the std of the group advantages, about
    sqrt(the fraction of groups with signal): 2 groups of 4 flat scale the rest by sqrt(4 / 2)."""
    rewards = random_rewards(4, {"pick": 1.0}, 3)
    for i in (1, 3):
        rewards["pick"][i * G:(i + 1) * G] = 0.5
    adv = ours(rewards, {"pick": 1.0})
    ref = flow_factory_gdpo({"pick": rewards["pick"].double().numpy()}, {"pick": 1.0}, groups_of(16))
    assert np.allclose(adv.values.double().numpy(), ref, rtol=1e-6, atol=1e-6)
    summed = compute_advantages(rewards["pick"], [i // G for i in range(16)])
    assert torch.allclose(adv.values[adv.mask], summed.values[adv.mask] * 2 ** 0.5, rtol=1e-3)
    assert adv.zero_std_groups == 2


def test_the_clip_comes_after_the_batch_normalisation():
    """One group with signal among 15 flat ones: the batch std is small, the normalised advantages pass 5."""
    rewards = {"pick": torch.full((64,), 0.3)}
    rewards["pick"][:G] = torch.tensor([0.0, 1.0, 2.0, 10.0])
    adv = ours(rewards, {"pick": 1.0})
    ref = flow_factory_gdpo({"pick": rewards["pick"].double().numpy()}, {"pick": 1.0}, groups_of(64))
    assert np.allclose(adv.values.double().numpy(), ref, rtol=1e-6, atol=1e-6)
    assert adv.values.abs().max() == pytest.approx(5.0)


def test_failed_rows_leave_the_statistics_and_are_masked():
    """A row whose rewards all failed: what Flow-Factory computes on the batch without it (its gdpo takes groups of
    any size), the row masked at 0. A row with one reward failed: left out of that reward's group statistics and of
    the batch statistics, masked."""
    names, weights = {"pick": 1.0, "clip": 30.0}, {"pick": 1.0, "clip": 0.5}
    rewards = random_rewards(5, names, 4, flat_group=1)
    failed = [0, 9, 13]
    valid = {k: torch.tensor([i not in failed for i in range(20)]) for k in rewards}
    adv = ours(rewards, weights, valid)
    keep = [i for i in range(20) if i not in failed]
    ref = flow_factory_gdpo({k: v.double().numpy()[keep] for k, v in rewards.items()}, weights, groups_of(20)[keep])
    assert np.allclose(adv.values.double().numpy()[keep], ref, rtol=1e-6, atol=1e-6)
    assert adv.values[failed].abs().max() == 0 and not adv.mask[failed].any()
    # one reward failed on row 17: masked, and the other rows of its group normalised without it in that reward
    valid["clip"] = valid["clip"].clone()
    valid["clip"][17] = False
    partial = ours(rewards, weights, valid)
    assert not partial.mask[17] and partial.mask[[16, 18, 19]].all()
    assert not torch.allclose(partial.values[16:20], adv.values[16:20])


def test_the_algorithm_dispatches_gdpo_and_the_config_refuses_a_global_std():
    """reward.aggregate gdpo reaches the algorithm's advantages (train/algorithm.py): Flow-Factory's numbers."""
    rewards = random_rewards(3, {"a": 1.0, "b": 5.0}, 5)
    parts = {k: ComponentScores(v, torch.ones(12, dtype=torch.bool)) for k, v in rewards.items()}
    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")
    algorithm = Algorithm(load_config(tiny, ["reward.aggregate=gdpo"]), None, None, None)
    adv = algorithm.advantages(parts, {"a": 1.0, "b": 2.0}, [i // G for i in range(12)])
    ref = flow_factory_gdpo({k: v.double().numpy() for k, v in rewards.items()}, {"a": 1.0, "b": 2.0}, groups_of(12))
    assert np.allclose(adv.values.double().numpy(), ref, rtol=1e-6, atol=1e-6)
    assert load_config(tiny, ["reward.aggregate=gdpo"]).reward.aggregate == "gdpo"
    with pytest.raises(ConfigError, match="'grpo.global_std' is true, but reward.aggregate gdpo"):
        load_config(tiny, ["reward.aggregate=gdpo", "grpo.global_std=true"])
