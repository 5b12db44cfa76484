"""Latent rewards (Reward.on_latents: a reward model over the diffusion model's latents, DiNa-LRM-style): a mix of
them alone is scored on the rollout's final latents and never decodes; beside an image reward each gets its own
input; a run trains on them; the estimator drops the decode for them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jagg_scale.rewards import Reward, RewardOutput, register
from jagg_scale.rewards.multi import ChunkScorer, RewardMix

ROOT = Path(__file__).resolve().parents[2]


@register("_test_latent_mean")
class LatentMean(Reward):
    """The mean of each row's latents: what a latent reward model reads, without its model."""

    on_latents = True

    def __call__(self, latents, prompts, metadata):
        assert latents.ndim == 4, "a latent reward gets the sampler's latents"
        return RewardOutput(scores=latents.float().mean(dim=(1, 2, 3)))


class PixelMean(Reward):
    def __call__(self, images, prompts, metadata):
        assert images.min() >= 0 and images.max() <= 1, "an image reward gets decoded images in [0, 1]"
        return images.mean(dim=(1, 2, 3))


def counting_decode(calls: list):
    def decode(x):
        calls.append(len(x))
        return ((x + 1) / 2).clamp(0, 1)
    return decode


@pytest.mark.parametrize("background", [False, True])
def test_latent_rewards_alone_are_scored_on_the_latents_without_a_decode(background):
    calls: list = []
    latents = torch.randn(6, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    scorer = ChunkScorer(RewardMix([("lat", 1.0, LatentMean())]), counting_decode(calls), background=background)
    scorer.add(latents[:4], ["p"] * 4, [{}] * 4)
    scorer.add(latents[4:], ["p"] * 2, [{}] * 2)
    parts = scorer.finish()
    assert calls == [] and torch.allclose(parts["lat"].scores, latents.mean(dim=(1, 2, 3)))


def test_beside_an_image_reward_each_gets_its_own_input_and_the_chunk_is_decoded_once():
    calls: list = []
    latents = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    mix = RewardMix([("lat", 1.0, LatentMean()), ("pix", 0.5, PixelMean())])
    assert mix.needs_pixels and not RewardMix([("lat", 1.0, LatentMean())]).needs_pixels
    scorer = ChunkScorer(mix, counting_decode(calls), background=False)
    scorer.add(latents, ["p"] * 4, [{}] * 4)
    parts = scorer.finish()
    assert calls == [4]
    assert torch.allclose(parts["lat"].scores, latents.mean(dim=(1, 2, 3)))
    assert torch.allclose(parts["pix"].scores, ((latents + 1) / 2).clamp(0, 1).mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match="reward 'lat' scores latents, none were given"):
        mix.score_components(torch.rand(4, 3, 4, 4), ["p"] * 4, [{}] * 4)


def test_a_run_trains_on_a_latent_reward_and_its_evaluation_scores_it_too(tmp_path, monkeypatch):
    from jagg_scale.models.dit import DiT
    from train_runs import fit_metrics

    calls: list = []
    real = DiT.decode
    monkeypatch.setattr(DiT, "decode", lambda self, x: calls.append(len(x)) or real(self, x))
    rows = fit_metrics(ROOT / "configs" / "tiny_cpu.yaml", [
        "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=8", "model.dit.patch_size=2",
        "sampling.num_steps=4", "train.prompts_per_step=2", "train.minibatch_size=8", "train.steps=2",
        "run.checkpoint_every=0", "reward.name=_test_latent_mean", "reward.options={}", "eval.enabled=false"],
        tmp_path)
    assert len(rows) == 2 and calls == []  # two steps trained, nothing decoded
    assert all(r["reward_std"] > 0 for r in rows)  # the latents' means vary: advantages to train on


def test_the_estimator_drops_the_decode_for_latent_rewards_alone():
    from jagg_scale.estimate import memory as E
    from jagg_scale.estimate.steptime import step_seconds
    from jagg_scale.train.config import load_config

    config = ROOT / "configs" / "sd35m_pickscore.yaml"
    priced = {}
    for reward in ("pickscore", "_test_latent_mean"):
        swap = [] if reward == "pickscore" else [f"reward.name={reward}", "reward.options={}"]
        cfg = load_config(config, swap, check_files=False)
        s = E.prepare(cfg, 8)
        est = E.estimate(s)
        priced[reward] = (step_seconds(s, est)["decode"], est["phases"]["rollout"]["components"])
    assert priced["pickscore"][0] > 0 and priced["_test_latent_mean"][0] == 0
    transients = "encoder / sampling / decode / reward transients"
    assert priced["_test_latent_mean"][1][transients] <= priced["pickscore"][1][transients]
