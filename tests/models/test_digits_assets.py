"""The digits task's committed assets: they load, the classifier is accurate on the recomputed held-out split,
`digit_match` scores the right digit high and the wrong one low, the prompt files are consistent with the
templates, and the generator is partly (not fully) trained."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jagg_scale.data import load_prompts
from jagg_scale.data.digits import (
    DIGIT_WORDS,
    DIGITS_SPLIT_SEED,
    HELDOUT_TEMPLATES,
    TRAIN_TEMPLATES,
    load_digits_raw,
    load_digits_split,
    prompt_records,
    stratified_split,
)
from jagg_scale.grpo.rollout import sample_ode
from jagg_scale.grpo.schedule import sigma_schedule
from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.models.dit import HashTokenizer
from jagg_scale.rewards import build_reward, score_safely
from jagg_scale.rewards.digits import DEFAULT_CLASSIFIER, load_classifier, target_digit

ASSETS = Path(__file__).resolve().parents[2] / "jagg_scale" / "assets" / "digits"
FILES = ["generator.safetensors", "generator.json", "classifier.safetensors", "prompts_train.jsonl",
         "prompts_heldout.jsonl", "CARD.md"]


@pytest.fixture(scope="module")
def split():
    return load_digits_split(DIGITS_SPLIT_SEED)


@pytest.fixture(scope="module")
def reward():
    return build_reward("digit_match")


@pytest.fixture(scope="module")
def generator() -> DiT:
    cfg = json.loads((ASSETS / "generator.json").read_text())
    model = DiT(DiTConfig(**cfg))
    state = load_file(str(ASSETS / "generator.safetensors"))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.eval().requires_grad_(False)


def _to_images(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] [N, 1, H, W] -> [0, 1] [N, 3, H, W], as DiT.decode gives them."""
    return ((x + 1) / 2).repeat(1, 3, 1, 1)


def test_asset_files_exist_and_are_small():
    sizes = {f: (ASSETS / f).stat().st_size for f in FILES}
    assert all(s > 0 for s in sizes.values()), sizes
    assert sum(sizes.values()) < 5_000_000, sizes
    assert DEFAULT_CLASSIFIER == (ASSETS / "classifier.safetensors").resolve()


def test_generator_loads_strictly_with_expected_shapes(generator):
    cfg = json.loads((ASSETS / "generator.json").read_text())
    assert cfg == {f: getattr(generator.config, f) for f in cfg}  # every field is a DiTConfig field
    assert (cfg["in_channels"], cfg["image_size"], cfg["patch_size"]) == (1, 16, 2)
    assert generator.latent_shape == (1, 16, 16) and generator.grid_size**2 == 64
    stored = load_file(str(ASSETS / "generator.safetensors"))
    assert all(v.dtype == torch.float16 for v in stored.values())
    assert set(stored) == set(generator.state_dict())
    x = torch.randn(2, 1, 16, 16)
    v = generator(x, torch.tensor([0.5, 0.9]), generator.encode_prompts(["the number 3", ""]))
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert v.abs().mean() > 0.05  # trained: not the adaLN-Zero init, which outputs exactly 0


def test_card_lists_current_sha256():
    card = (ASSETS / "CARD.md").read_text()
    for f in FILES[:-1]:
        digest = hashlib.sha256((ASSETS / f).read_bytes()).hexdigest()
        assert f"`{digest}`" in card, f"CARD.md has a stale sha256 for {f}"
    assert "python -m tools.build_digits_assets" in card


def test_split_is_stratified_disjoint_and_seeded(split):
    train_x, train_y, heldout_x, heldout_y = split
    assert train_x.shape == (1438, 1, 16, 16) and heldout_x.shape == (359, 1, 16, 16)
    assert train_x.min() >= -1 and train_x.max() <= 1 and train_x.dtype == torch.float32
    counts_tr, counts_ho = torch.bincount(train_y, minlength=10), torch.bincount(heldout_y, minlength=10)
    frac = counts_ho.float() / (counts_tr + counts_ho).float()
    assert ((frac - 0.2).abs() < 0.01).all()
    _, labels = load_digits_raw()
    tr, ho = stratified_split(labels, DIGITS_SPLIT_SEED)
    assert len(set(tr.tolist()) & set(ho.tolist())) == 0 and len(tr) + len(ho) == len(labels)
    tr2, ho2 = stratified_split(labels, DIGITS_SPLIT_SEED + 1)
    assert not torch.equal(ho, ho2)  # the seed matters


def test_classifier_heldout_accuracy_from_committed_weights(split):
    _, _, heldout_x, heldout_y = split
    clf = load_classifier()
    assert not clf.training and not any(p.requires_grad for p in clf.parameters())
    with torch.no_grad():
        acc = (clf(_to_images(heldout_x)).argmax(1) == heldout_y).float().mean().item()
        # other resolutions are resized to 16x16 inside the classifier
        big = torch.nn.functional.interpolate(heldout_x, size=(32, 32), mode="bilinear", align_corners=False)
        acc_big = (clf(_to_images(big)).argmax(1) == heldout_y).float().mean().item()
    assert acc >= 0.97, acc
    assert acc_big >= 0.9, acc_big


def test_digit_match_right_digit_high_wrong_digit_low(split, reward):
    _, _, heldout_x, heldout_y = split
    images = _to_images(heldout_x[:120])
    y = heldout_y[:120].tolist()
    right = reward(images, ["x"] * len(y), [{"digit": d} for d in y])
    wrong = reward(images, ["x"] * len(y), [{"digit": (d + 1) % 10} for d in y])
    assert right.scores.shape == (120,) and right.scores.dtype == torch.float32
    assert right.scores.mean() > 0.9 and wrong.scores.mean() < 0.05
    assert right.info["accuracy"] >= 0.95 and wrong.info["accuracy"] <= 0.05
    assert ((right.scores >= 0) & (right.scores <= 1)).all()


def test_digit_match_targets_from_prompt_and_nan_when_unknown(split, reward):
    _, _, heldout_x, heldout_y = split
    i3 = int(torch.nonzero(heldout_y == 3)[0])
    i7 = int(torch.nonzero(heldout_y == 7)[0])
    images = _to_images(heldout_x[[i3, i7, i7, i7, i3]])
    prompts = ["the numeral three", "a drawing of a 7", "a picture of a cat", "a 7 or a one", "anything"]
    metadata = [{}, {}, {}, {}, {"digit": "3"}]
    out = reward(images, prompts, metadata)
    assert out.scores[0] > 0.5 and out.scores[1] > 0.5 and out.scores[4] > 0.5
    assert math.isnan(out.scores[2]) and math.isnan(out.scores[3])  # no digit / ambiguous
    scores, valid, n_failed = score_safely(reward, images, prompts, metadata, max_fail_frac=0.5)
    assert n_failed == 2 and valid.tolist() == [True, True, False, False, True]
    assert target_digit("the number 0", None) == 0 and target_digit("handwritten nine", {}) == 9
    assert target_digit("whatever", {"digit": 4}) == 4 and target_digit("seven", {"digit": 12}) is None


def test_missing_classifier_path_errors_clearly(tmp_path):
    missing = tmp_path / "nope" / "classifier.safetensors"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        build_reward("digit_match", classifier=str(missing))


def test_prompt_files_match_templates():
    train = load_prompts(ASSETS / "prompts_train.jsonl")
    heldout = load_prompts(ASSETS / "prompts_heldout.jsonl")
    assert train.skipped == 0 and heldout.skipped == 0
    for ps, templates in ((train, TRAIN_TEMPLATES), (heldout, HELDOUT_TEMPLATES)):
        assert sorted({r.metadata["digit"] for r in ps}) == list(range(10))
        assert [{"prompt": r.prompt, **r.metadata} for r in ps] == prompt_records(templates)
        assert all(target_digit(r.prompt, None) == r.metadata["digit"] for r in ps)
    assert not set(TRAIN_TEMPLATES) & set(HELDOUT_TEMPLATES)
    assert not set(train.prompts) & set(heldout.prompts)


def test_template_words_do_not_collide_under_the_generator_tokenizer(generator):
    tok: HashTokenizer = generator.tokenizer
    words = {w for t in TRAIN_TEMPLATES + HELDOUT_TEMPLATES for d in range(10)
             for w in re.findall(r"[a-z0-9]+", t.format(word=DIGIT_WORDS[d], d=d))}
    assert len({tok.word_id(w) for w in words}) == len(words) > 20


def test_generator_is_partly_trained_on_heldout_prompts(generator, reward):
    """The build's protocol (ODE, 16 steps, shift 3), 2 images per held-out prompt: well above chance (0.1), well
    below solved, so GRPO has room. The committed value is in CARD.md."""
    records = prompt_records(HELDOUT_TEMPLATES)
    prompts = [r["prompt"] for r in records for _ in range(2)]
    metadata = [{"digit": r["digit"]} for r in records for _ in range(2)]
    noise = torch.randn(len(prompts), *generator.latent_shape, generator=torch.Generator().manual_seed(0))
    x = sample_ode(generator, generator.encode_prompts(prompts), noise, sigma_schedule(16, shift=3.0))
    out = reward(generator.decode(x), prompts, metadata)
    assert 0.2 < float(out.scores.mean()) < 0.9, float(out.scores.mean())
