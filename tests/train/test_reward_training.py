"""Rewards inside training: several rewards (weighted sum and MixGRPO's per-reward advantages), per-reward
metrics, failure masking and the max_fail_frac stop, background scoring, and webdataset prompt streams with
exact resume."""

from pathlib import Path

import pytest
import torch

from jagg_scale.grpo import combine_advantages, compute_advantages
from jagg_scale.rewards import Reward, RewardOutput, register
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.logging import read_metrics
from extras import need

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16", "sampling.num_steps=4",
         "sampling.chunk_size=4", "train.prompts_per_step=2", "train.minibatch_size=8", "log.progress=false"]
TIMING = ("time_",)


@register("test_fails_on_odd_rows")
class _FailsOnOdd(Reward):
    """Brightness, but NaN for prompts containing 'odd' (a reward that cannot score some images)."""

    def __call__(self, images, prompts, metadata):
        scores = images.mean(dim=(1, 2, 3))
        bad = torch.tensor(["odd" in p for p in prompts])
        return RewardOutput(torch.where(bad, torch.full_like(scores, float("nan")), scores))


def cfg(tmp_path, *extra):
    return load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", *extra])


def strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_advantage_aggregation_keeps_a_small_scale_reward_alive():
    groups = [0, 0, 0, 0]
    big = torch.tensor([1000.0, 3000.0, 2000.0, 0.0])  # large scale
    small = torch.tensor([0.04, 0.01, 0.02, 0.03])  # ranks the samples in the opposite order
    valid = torch.ones(4, dtype=torch.bool)
    summed = compute_advantages(big + small, groups)
    mixed = combine_advantages([(1.0, compute_advantages(big, groups)), (1.0, compute_advantages(small, groups))],
                               groups, valid)
    a_big = compute_advantages(big, groups).values
    assert torch.corrcoef(torch.stack([summed.values, a_big]))[0, 1] > 0.999  # the sum is the big reward alone
    assert mixed.values.abs().max() < a_big.abs().max()  # the opposite-ranking small reward pulls it back
    assert torch.allclose(mixed.values, a_big + compute_advantages(small, groups).values)
    # the combination is clipped after summing: |A| <= adv_clip_max in the loss, whatever the weights
    agree = torch.tensor([0.0, 1.0, 2.0, 10.0])
    for w in (1.0, 3.0):
        both = combine_advantages([(w, compute_advantages(agree, groups, adv_clip_max=1.5)),
                                   (w, compute_advantages(2 * agree, groups, adv_clip_max=1.5))], groups, valid,
                                  adv_clip_max=1.5)
        assert both.values.abs().max() == pytest.approx(1.5)
    # a group where no reward separates the samples carries no signal and is masked
    flat = combine_advantages([(1.0, compute_advantages(torch.ones(4), groups))], groups, valid)
    assert flat.zero_std_groups == 1 and not flat.mask.any()


@pytest.mark.parametrize("aggregate", ["sum", "advantage", "gdpo"])
def test_two_rewards_train_with_per_reward_metrics(tmp_path, aggregate):
    comps = ("reward.components={jpeg_compressibility: {weight: 1.0}, "
             "jpeg_incompressibility: {weight: 0.25, quality: 80}}")
    rows = Trainer(cfg(tmp_path, "train.steps=2", comps, f"reward.aggregate={aggregate}")).fit()
    r = rows[-1]
    assert {"reward_jpeg_compressibility_mean", "reward_jpeg_incompressibility_mean"} <= set(r)
    comp, incomp = r["reward_jpeg_compressibility_mean"], r["reward_jpeg_incompressibility_mean"]
    assert comp < 0 < incomp
    assert r["reward_mean"] == pytest.approx(comp + 0.25 * incomp, rel=1e-4, abs=1e-5)
    assert r["reward_jpeg_compressibility_failed"] == 0


def test_failed_samples_are_masked_counted_and_stop_the_run_past_the_limit(tmp_path):
    prompts = "data.prompts=[an odd cat, an even dog]"
    comps = "reward.components={jpeg_compressibility: {weight: 1.0}, test_fails_on_odd_rows: {weight: 1.0}}"
    # every step has 2 prompts x 4 samples: half fail (the 'odd' group)
    row = Trainer(cfg(tmp_path / "ok", "train.steps=1", prompts, comps, "reward.max_fail_frac=0.5")).fit()[0]
    assert row["reward_test_fails_on_odd_rows_failed"] == 4 and row["reward_failed"] == 4
    assert row["reward_jpeg_compressibility_failed"] == 0
    with pytest.raises(RuntimeError, match="test_fails_on_odd_rows.*4/8.*max_fail_frac"):
        Trainer(cfg(tmp_path / "stop", "train.steps=1", prompts, comps, "reward.max_fail_frac=0.25")).fit()


def test_background_scoring_changes_nothing_but_time(tmp_path):
    a = Trainer(cfg(tmp_path / "bg", "train.steps=2", "reward.background=true")).fit()
    b = Trainer(cfg(tmp_path / "fg", "train.steps=2", "reward.background=false")).fit()
    assert strip(a) == strip(b)


def test_bad_reward_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match="reward.aggregate"):
        cfg(tmp_path, "reward.aggregate=product")
    with pytest.raises(ConfigError, match=r"reward\.components\.jpeg_compressibility\.weight"):
        cfg(tmp_path, "reward.components={jpeg_compressibility: {weight: heavy}}")
    # checked with the config, before any work (was a TypeError from Trainer)
    with pytest.raises(ConfigError, match=r"'reward\.components\.jpeg_compressibility'.*unknown option.*qualty"):
        cfg(tmp_path, "reward.components={jpeg_compressibility: {qualty: 3}}")


def test_wds_prompt_stream_trains_and_resumes_exactly(tmp_path):
    need("webdataset")
    from jagg_scale.data import PromptRecord, shard_pattern, write_prompt_shards

    records = [PromptRecord(f"prompt number {i}", {"i": i}) for i in range(40)]
    shards = write_prompt_shards(records, tmp_path / "shards", shard_size=10)
    pattern = shard_pattern(tmp_path / "shards", "prompts", len(shards))
    wds = ["data.source=wds", "data.prompts=null", f"data.shards={pattern}", "run.checkpoint_every=2"]
    full = Trainer(cfg(tmp_path / "full", "train.steps=4", *wds)).fit()
    Trainer(cfg(tmp_path / "cut", "train.steps=2", *wds)).fit()
    resumed = Trainer(cfg(tmp_path / "cut", "train.steps=4", "run.resume=auto", *wds))
    assert resumed.start_step == 2
    resumed.fit()
    assert strip(read_metrics(tmp_path / "cut")) == strip(full)
