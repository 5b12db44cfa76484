"""Rewards: JPEG scores order smooth vs. noisy images, the registry fails loudly, score_safely masks failures."""

from __future__ import annotations

import logging

import pytest
import torch

from jagg_scale.rewards import Reward, RewardOutput, available, build_reward, register, score_safely


def _smooth_and_noise(h: int = 64, w: int = 64) -> torch.Tensor:
    """[3, 3, H, W]: constant grey, horizontal gradient, uniform noise."""
    const = torch.full((3, h, w), 0.5)
    grad = torch.linspace(0, 1, w).expand(3, h, w).clone()
    noise = torch.rand(3, h, w, generator=torch.Generator().manual_seed(0))
    return torch.stack([const, grad, noise])


def _call(reward: Reward, images: torch.Tensor) -> RewardOutput:
    b = images.shape[0]
    return reward(images, ["p"] * b, [{}] * b)


def test_jpeg_compressibility_prefers_smooth_images():
    out = _call(build_reward("jpeg_compressibility"), _smooth_and_noise())
    assert out.scores.dtype == torch.float32 and out.scores.shape == (3,)
    const, grad, noise = out.scores.tolist()
    assert const > noise and grad > noise
    assert noise < -5.0  # 64x64 noise at q95 is well over 5 kB; catches a wrong unit or sign
    assert out.info["jpeg_kb_mean"] > 0


def test_jpeg_incompressibility_is_negation():
    images = _smooth_and_noise()
    comp = _call(build_reward("jpeg_compressibility"), images).scores
    incomp = _call(build_reward("jpeg_incompressibility"), images).scores
    torch.testing.assert_close(incomp, -comp)


def test_jpeg_quality_option_changes_size():
    noise = _smooth_and_noise()[2:]
    hi = _call(build_reward("jpeg_incompressibility", quality=95), noise).scores
    lo = _call(build_reward("jpeg_incompressibility", quality=10), noise).scores
    assert hi.item() > lo.item()


def test_jpeg_rejects_bad_shape_and_quality():
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        _call(build_reward("jpeg_compressibility"), torch.rand(2, 1, 8, 8))
    with pytest.raises(ValueError, match="quality"):
        build_reward("jpeg_compressibility", quality=0)


def test_registry_lists_jpeg_rewards_sorted():
    names = available()
    assert {"jpeg_compressibility", "jpeg_incompressibility"} <= set(names)
    assert names == sorted(names)


def test_unknown_reward_names_available():
    with pytest.raises((KeyError, ValueError)) as exc:
        build_reward("no_such_reward")
    msg = str(exc.value)
    assert "no_such_reward" in msg and "jpeg_compressibility" in msg and "jpeg_incompressibility" in msg


def test_bad_option_raises_type_error_naming_it():
    with pytest.raises(TypeError, match="qualty"):
        build_reward("jpeg_compressibility", qualty=90)


def test_register_rejects_duplicate_name():
    with pytest.raises(ValueError, match="already registered"):

        @register("jpeg_compressibility")
        class Other(Reward):
            pass


# ------------------------------------------------------------------------------------------ score_safely


class _Raises(Reward):
    name = "boom"

    def __call__(self, images, prompts, metadata):
        raise RuntimeError("scorer crashed")


class _NaNAt(Reward):
    name = "nan_at"

    def __init__(self, bad: int):
        self.bad = bad

    def __call__(self, images, prompts, metadata):
        scores = torch.arange(images.shape[0], dtype=torch.float32) + 1.0
        scores[self.bad] = float("nan")
        return RewardOutput(scores=scores)


def _batch(b: int = 4):
    return torch.rand(b, 3, 8, 8), [f"p{i}" for i in range(b)], [{} for _ in range(b)]


def test_score_safely_raising_reward_over_threshold(caplog):
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as exc:
        score_safely(_Raises(), *_batch(4), max_fail_frac=0.5)
    assert "boom" in str(exc.value) and "4/4" in str(exc.value)
    assert any("boom" in r.getMessage() and r.exc_info for r in caplog.records)


def test_score_safely_raising_reward_masked_under_threshold():
    scores, valid, n_failed = score_safely(_Raises(), *_batch(4), max_fail_frac=1.0)
    assert n_failed == 4
    assert valid.dtype == torch.bool and not valid.any()
    assert scores.dtype == torch.float32 and torch.equal(scores, torch.zeros(4))


def test_score_safely_nan_sample_is_invalid_others_valid():
    scores, valid, n_failed = score_safely(_NaNAt(bad=1), *_batch(4), max_fail_frac=0.25)
    assert n_failed == 1
    assert valid.tolist() == [True, False, True, True]
    assert scores.tolist() == [1.0, 0.0, 3.0, 4.0]


def test_score_safely_inf_counts_and_threshold_is_strict():
    class _Inf(Reward):
        name = "inf"

        def __call__(self, images, prompts, metadata):
            return RewardOutput(scores=torch.tensor([float("inf"), 1.0]))

    with pytest.raises(RuntimeError, match="1/2"):
        score_safely(_Inf(), *_batch(2), max_fail_frac=0.49)
    _, valid, n_failed = score_safely(_Inf(), *_batch(2), max_fail_frac=0.5)
    assert n_failed == 1 and valid.tolist() == [False, True]


def test_score_safely_wrong_length_counts_as_failure():
    class _Short(Reward):
        name = "short"

        def __call__(self, images, prompts, metadata):
            return RewardOutput(scores=torch.ones(images.shape[0] - 1))

    _, valid, n_failed = score_safely(_Short(), *_batch(3), max_fail_frac=1.0)
    assert n_failed == 3 and not valid.any()


def test_score_safely_real_jpeg_reward_all_valid():
    scores, valid, n_failed = score_safely(build_reward("jpeg_compressibility"), *_batch(2), max_fail_frac=0.0)
    assert n_failed == 0 and valid.all() and (scores < 0).all()


def test_a_chunk_not_scored_within_the_deadline_is_masked_and_the_step_goes_on():
    """ChunkScorer.finish(deadline_s): the background worker's chunk that is still being scored when the deadline
    passes is masked (valid False, counted in `late`) and finish returns on time; the chunks scored before it keep
    their scores. Without a deadline finish waits for every chunk."""
    import threading
    import time

    from jagg_scale.rewards.multi import ChunkScorer, RewardMix

    release = threading.Event()

    class Hangs(Reward):
        name = "hangs"

        def __call__(self, images, prompts, metadata):
            if prompts[0] == "hang":
                release.wait(30)  # a reward host that stopped answering (until the test lets it go)
            return RewardOutput(images.flatten(1).mean(1))

    mix = RewardMix([("hangs", 1.0, Hangs())])
    scorer = ChunkScorer(mix, decode=lambda x: x, background=True)
    scorer.add(torch.full((2, 3, 4, 4), 0.5), ["ok", "ok"], [{}, {}])
    scorer.add(torch.full((3, 3, 4, 4), 0.5), ["hang"] * 3, [{}] * 3)
    t0 = time.monotonic()
    parts = scorer.finish(deadline_s=0.5)
    waited = time.monotonic() - t0
    release.set()
    assert 0.4 < waited < 10  # the deadline, not the hung call
    p = parts["hangs"]
    assert p.valid.tolist() == [True, True, False, False, False] and scorer.late == 3
    assert torch.allclose(p.scores[:2], torch.tensor([0.5, 0.5]))
    again = ChunkScorer(mix, decode=lambda x: x, background=True)
    again.add(torch.full((3, 3, 4, 4), 0.25), ["hang"] * 3, [{}] * 3)  # released: no deadline, scored
    assert again.finish()["hangs"].valid.all() and again.late == 0
