"""Qwen-Image's text tokens in the estimate (estimate/prompt_tokens.py): a pass carries its rows' longest prompt
(models/qwenimage.py), so memory is sized at the prompt set's longest encoded prompt and step time at a pass's
expected longest, from the encoded lengths recorded in shapes/qwen_image.json."""

import itertools
import json
from pathlib import Path

import pytest
from extras import need

need("diffusers")  # the shapes are diffusers / transformers classes on the meta device
need("transformers")

from jagg_scale.estimate import memory as E  # noqa: E402 - after the extras check
from jagg_scale.estimate.prompt_tokens import distinct_prompts, expected_longest, longest  # noqa: E402
from jagg_scale.estimate.shapes import pipeline_shapes  # noqa: E402
from jagg_scale.train.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = [[3, 2], [5, 1], [9, 1]]  # four prompts: 3, 3, 5 and 9 tokens


def qwen(*overrides):
    return load_config(ROOT / "configs" / "qwenimage_hps.yaml", list(overrides), check_files=False)


def test_the_expected_longest_is_the_mean_over_every_draw():
    """k prompts drawn from the set (with replacement): the mean of their longest over every draw, exactly."""
    pool = [n for n, c in SMALL for _ in range(c)]
    for k in (1, 2, 3):
        draws = list(itertools.product(pool, repeat=k))
        assert expected_longest(SMALL, 512, k) == pytest.approx(sum(map(max, draws)) / len(draws), rel=1e-12)
    assert expected_longest(SMALL, 4, 2) == pytest.approx((1 * 3 + 3 * 4) / 4)  # model.max_sequence_length cuts
    assert longest(SMALL, 512) == 9 and longest(SMALL, 4) == 4


def test_the_prompts_among_a_passes_rows():
    """Rows drawn without replacement from P prompts x G rows: one row is one prompt, all rows every prompt, and
    the count against the enumeration of every draw of 2 rows of 3 prompts x 2."""
    assert distinct_prompts(1, 16, 12) == pytest.approx(1) and distinct_prompts(192, 16, 12) == pytest.approx(16)
    rows = [p for p in range(3) for _ in range(2)]
    pairs = list(itertools.combinations(range(6), 2))
    assert distinct_prompts(2, 3, 2) == pytest.approx(sum(len({rows[a], rows[b]}) for a, b in pairs) / len(pairs))


def test_the_recorded_lengths_are_the_training_prompt_sets():
    """shapes/qwen_image.json's encoded lengths: one per prompt of qwenimage_hps's prompt file, its statistics as
    shapes/README.md states them."""
    enc = pipeline_shapes(None, "qwen_image")["text_tokens"]["encoded"]
    assert qwen().data.prompt_file.endswith(enc["prompt_file"])
    lengths = sorted(n for n, c in enc["lengths"] for _ in range(c))
    assert len(lengths) == enc["prompts"] == 25432
    assert (round(sum(lengths) / len(lengths), 1), lengths[len(lengths) // 2], lengths[int(0.9 * len(lengths))],
            lengths[-1]) == (31.2, 22, 62, 443)
    assert lengths[0] > 5  # more than the template's 5 closing tokens: a prompt has tokens of its own


@pytest.mark.parametrize("cap, text", [(512, 443), (64, 64), (1024, 443)])
def test_memory_is_sized_at_the_prompt_sets_longest(cap, text):
    """Every pass at most the longest encoded prompt (cut at model.max_sequence_length), not the padded length; the
    stored conditioning likewise; the text encoder still at model.max_sequence_length (its measured coefficients)."""
    s = E.prepare(qwen(f"model.max_sequence_length={cap}"), 8, memory=False)
    assert s["text_tokens"] == text and s["cond_row"] == text * (3584 + 2) and s["prompt_lengths"][1] == cap
    assert [e["seq"] for e in s["encoders"].values()] == [cap]


def test_a_sequence_split_pads_the_prompt_to_a_multiple_of_it():
    """With sequence parallelism the adapter pads the text up to a multiple of the split (Ulysses splits evenly): the
    estimate does too, instead of refusing 443 tokens over 2 ranks (at 1024 px: 4096 image tokens)."""
    s = E.prepare(qwen("parallel.sequence_parallel=2", "model.resolution=1024"), 8, memory=False)
    assert s["text_tokens"] == 444 and s["rank_tokens"] == (2048, 222)


@pytest.mark.slow
def test_a_passes_flops_are_at_its_rows_expected_longest_prompt():
    """The step time prices a pass at its rows' expected longest prompt (56 tokens for qwenimage_hps's 4-row
    micro-batch, 79 for its 12-row rollout chunk): a step below the one of every prompt padded to 512 tokens."""
    from jagg_scale.estimate import steptime as T

    s = E.prepare(qwen(), 8)
    est = E.estimate(s)
    own = T.step_seconds(s, est)
    comp = json.dumps(s["components"]["transformer"], sort_keys=True)
    assert own["forward_tflop_per_row"] * 1e12 == T._transformer_flops(comp, "qwenimage", s["latent"], 2, 56)
    assert own["tflop"]["rollout"] * 1e12 == pytest.approx(
        21 * 24 * T._transformer_flops(comp, "qwenimage", s["latent"], 2, 79), rel=1e-9)
    padded = T.step_seconds({**s, "prompt_lengths": None, "text_tokens": 512}, est)
    assert own["step"] < 0.9 * padded["step"]
