"""What an evaluation shows besides the reward mean (issue 17): within-prompt diversity in the reward backbone's
feature space (pixels without one) beside the base model's, a grid labelled with its prompts, and wandb panels.

- the distance: known values, None without a pair; digit_match's features are its classifier's penultimate layer,
  a reward mix passes its component's features on, a reward without a backbone falls back to pooled pixels;
- a model whose samples ignore their noise (every image of a prompt the same) has diversity 0, the base model's
  ratio to itself is 1: the metric sees the collapse the reward mean cannot;
- grid.png has a label column (the prompt, its reward and diversity) beside each row, eval.json the rows' prompts;
- a run puts the base model's diversity and the ratio in its last eval.json and summary.json, and logs the config,
  the eval scalars, the grid and one captioned panel per prompt to wandb (offline run files checked, and the calls).
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hang_guard import POLL_S, WAIT_S
from jagg_scale.cli import train_main
from jagg_scale.models import build_model
from jagg_scale.rewards.digits import DigitMatch
from jagg_scale.rewards.multi import RewardMix, build_reward_mix
from jagg_scale.train import load_config
from jagg_scale.train.diversity import FEATURES, PIXELS, diversity_features, mean_pairwise_distance
from jagg_scale.train.evaluate import eval_prompts, evaluate
from jagg_scale.train.grid import LABEL_WIDTH, PAD, _label_lines, grid_rows, image_grid
from jagg_scale.train.logging import RunLogger
from jagg_scale.train.policy import Policy
from extras import need

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "sampling.eval_num_steps=3", "train.prompts_per_step=2",
         "grpo.group_size=3", "train.minibatch_size=6", "log.progress=false", "run.checkpoint_every=0",
         "jagg.window=2", "eval.enabled=true", "eval.prompts=[a red apple, a blue sky, a green field]",
         "eval.num_per_prompt=3"]


def _setup(*extra: str):
    cfg = load_config(TINY, SMALL + list(extra))
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model)
    return cfg, model, Policy(model, cfg, torch.device("cpu")), build_reward_mix(cfg.reward)


# ------------------------------------------------------------------------------------------------ the distance


def test_mean_pairwise_distance_known_values():
    same = torch.ones(4, 6)
    assert mean_pairwise_distance(same, FEATURES) == pytest.approx(0.0, abs=1e-12)
    assert mean_pairwise_distance(same, PIXELS) == pytest.approx(0.0, abs=1e-12)
    assert mean_pairwise_distance(torch.eye(3), FEATURES) == pytest.approx(1.0)  # orthogonal: cosine distance 1
    assert mean_pairwise_distance(2 * torch.eye(3), FEATURES) == pytest.approx(1.0)  # the scale does not count
    # pixels: RMS difference; a black and a white image are 1 apart, a third grey one 0.5 from each
    images = torch.stack([torch.zeros(12), torch.ones(12), torch.full((12,), 0.5)])
    assert mean_pairwise_distance(images[:2], PIXELS) == pytest.approx(1.0)
    assert mean_pairwise_distance(images, PIXELS) == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert mean_pairwise_distance(torch.ones(1, 6), FEATURES) is None  # one image: no pair


def test_digit_match_features_are_the_classifier_penultimate_layer_and_others_fall_back_to_pixels():
    images = torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    digits = DigitMatch()
    feats, space = diversity_features(digits, images)
    expected = digits.model.features(digits.model.preprocess(images)).flatten(1)
    assert space == FEATURES and feats.shape == (5, 1024) and torch.equal(feats, expected)
    # a reward mix passes on its first component's features; a reward without a backbone gives pooled pixels
    mixed, space = diversity_features(RewardMix([("digit_match", 1.0, digits)]), images)
    assert space == FEATURES and torch.equal(mixed, expected)
    jpeg = build_reward_mix(load_config(TINY, []).reward)
    pixels, space = diversity_features(jpeg, torch.rand(2, 3, 64, 48))
    assert space == PIXELS and pixels.shape == (2, 3 * 32 * 32)


# ------------------------------------------------------------------------------------------------ in evaluate


def test_evaluation_reports_diversity_and_sees_a_collapse(tmp_path):
    cfg, model, policy, reward = _setup()
    prompts = eval_prompts(cfg)
    base = evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, prompts, tmp_path / "base")
    assert base["diversity_space"] == PIXELS  # the JPEG reward has no backbone
    assert base["diversity"] > 0.01 and all(p["diversity"] > 0 for p in base["per_prompt"])
    assert base["diversity"] == pytest.approx(np.mean([p["diversity"] for p in base["per_prompt"]]))
    assert "base" not in base and "diversity_ratio" not in base
    # the same model against itself: ratio 1
    again = evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, prompts, tmp_path / "again", base=base)
    assert again["diversity_ratio"] == pytest.approx(1.0)
    assert again["base"] == {"reward_mean": base["reward_mean"], "diversity": base["diversity"]}

    # collapsed: v = x / sigma flows every noise to the same image (0), whatever the prompt's reward
    def collapsed(x, sigma, cond):
        return x / sigma.view(-1, *[1] * (x.ndim - 1))

    result = evaluate(model, collapsed, policy.encode, reward, cfg, prompts, tmp_path / "collapsed", base=base)
    assert result["diversity"] == pytest.approx(0.0, abs=1e-6)
    assert result["diversity_ratio"] == pytest.approx(0.0, abs=1e-5)
    written = json.loads((tmp_path / "collapsed" / "eval.json").read_text())
    assert written["diversity_ratio"] == result["diversity_ratio"] and written["base"]["diversity"] == base["diversity"]
    assert [p["diversity"] for p in written["per_prompt"]] == [p["diversity"] for p in result["per_prompt"]]


def test_evaluation_compares_images_in_the_reward_backbone_space(tmp_path):
    cfg, model, policy, _ = _setup()
    digits = RewardMix([("digit_match", 1.0, DigitMatch())])
    result = evaluate(model, policy.velocity_fn(), policy.encode, digits, cfg, eval_prompts(cfg), None)
    assert result["diversity_space"] == FEATURES
    # the first prompt's 3 images again, by hand: the classifier's features of the same samples
    from jagg_scale.grpo import model_schedule, sample_ode
    from jagg_scale.train.evaluate import EvalNoise

    noise = EvalNoise(cfg.eval.seed, model.latent_shape, 9, 9).rows(torch.arange(3))
    sigmas = model_schedule(model, cfg.sampling.eval_num_steps, cfg.sampling.shift)
    with torch.no_grad():
        images = model.decode(sample_ode(policy.velocity_fn(), policy.encode(["a red apple"] * 3), noise, sigmas))
    feats = digits.components[0][2].image_features(images)
    assert result["per_prompt"][0]["diversity"] == pytest.approx(mean_pairwise_distance(feats, FEATURES), rel=1e-5)


# ------------------------------------------------------------------------------------------------ the grid


def _dark(region: np.ndarray) -> int:
    return int((region < 128).any(axis=-1).sum())


def test_grid_rows_carry_their_prompt_labels_and_eval_json_lists_them(tmp_path):
    cfg, model, policy, reward = _setup("eval.grid_images=7")  # 3 prompts x 3 images: the first 7 in the grid
    result = evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, eval_prompts(cfg), tmp_path)
    assert result["grid"] == {"file": "grid.png", "images_per_row": 3,
                              "rows": ["a red apple", "a blue sky", "a green field"]}
    assert json.loads((tmp_path / "eval.json").read_text())["grid"] == result["grid"]
    grid = np.asarray(Image.open(tmp_path / "grid.png").convert("RGB"))
    size = 8 * 8  # 8 px images upscaled to 64
    assert grid.shape[:2] == (3 * (size + PAD) + PAD, LABEL_WIDTH + 3 * (size + PAD) + PAD)
    for r in range(3):  # each row's label column has text in it
        assert _dark(grid[PAD + r * (size + PAD): PAD + r * (size + PAD) + size, :LABEL_WIDTH]) > 20, r
    # the label is the prompt with its reward and diversity: the row's text differs from its neighbour's
    rows = grid_rows(Image.open(tmp_path / "grid.png"), 3)
    assert [row.size for row in rows] == [(grid.shape[1], size)] * 3
    labels = [np.asarray(row.convert("L"))[:, :LABEL_WIDTH] for row in rows]
    assert not np.array_equal(labels[0], labels[1])
    # no labels asked: no label column
    plain = image_grid(torch.rand(4, 3, 8, 8), ncols=2)
    assert plain.size == (2 * (size + PAD) + PAD, 2 * (size + PAD) + PAD)


def test_long_prompts_are_wrapped_and_cut_but_the_scores_stay():
    from PIL import ImageFont

    font = ImageFont.load_default_imagefont()
    long = "a photograph of an astronaut riding a horse on the moon in the style of a renaissance painting"
    lines = _label_lines(long + "\nreward 0.123\ndiversity 0.456", font, LABEL_WIDTH - 2 * PAD, max_lines=4)
    assert lines[-2:] == ["reward 0.123", "diversity 0.456"]
    assert len(lines) == 4 and lines[1].endswith("...")
    assert all(font.getlength(line) <= LABEL_WIDTH - 2 * PAD for line in lines)
    assert _label_lines("short\nreward 1.000", font, 100, max_lines=4) == ["short", "reward 1.000"]


# ------------------------------------------------------------------------------------------------ a run and wandb


@pytest.mark.slow  # a 2-step run with three evaluations and an offline wandb run (~10 s)
def test_run_reports_diversity_beside_the_base_and_shows_the_evaluations_on_wandb(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert train_main([TINY, *SMALL, "train.steps=2", "eval.every=1", "log.wandb=true",
                       f"run.output_dir={run}"]) == 0
    evals = {s: json.loads((run / "eval" / f"step_{s:08d}" / "eval.json").read_text()) for s in (0, 1, 2)}
    base = evals[0]
    for step in (1, 2):  # after training started: the base model's numbers beside, and the ratio
        assert evals[step]["base"] == {"reward_mean": base["reward_mean"], "diversity": base["diversity"]}
        assert evals[step]["diversity_ratio"] == pytest.approx(evals[step]["diversity"] / base["diversity"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["diversity_base"] == base["diversity"]
    assert summary["diversity_after"] == evals[2]["diversity"]
    assert summary["diversity_ratio"] == evals[2]["diversity_ratio"]

    # the offline run: the config, the grids and the per-prompt panels of its three evaluations
    (offline,) = (run / "wandb").glob("offline-run-*")
    media = offline / "files" / "media" / "images" / "eval"
    assert len(list(media.glob("grid_*.png"))) == 3
    assert len(list(media.glob("prompts_*.png"))) >= 3
    # the config (run.output_dir) went with wandb.init: in files/config.yaml once the run is finished, else only in
    # the (chunked, possibly compressed) record stream, which wandb's own process may still be writing on a busy
    # machine (seen under two test workers: the stream held its 7-byte header alone): wait for it
    config = offline / "files" / "config.yaml"
    deadline = time.monotonic() + WAIT_S
    while True:
        sent = config.read_bytes() if config.exists() else next(offline.glob("*.wandb")).read_bytes()
        if str(run).encode() in sent or b"output_dir" in sent:
            break
        assert time.monotonic() < deadline, f"the offline run never recorded its config: {sent[:200]!r}"
        time.sleep(POLL_S)


def test_log_eval_sends_the_scalars_the_grid_and_captioned_prompt_panels(tmp_path, monkeypatch):
    cfg, model, policy, reward = _setup()
    base = evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, eval_prompts(cfg), None)
    result = evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, eval_prompts(cfg), tmp_path,
                      base=base)
    calls = {}

    class FakeImage:
        def __init__(self, data, caption=None):
            self.data, self.caption = data, caption

    class FakeRun:
        def log(self, data, step=None):
            calls["data"], calls["step"] = data, step

        def finish(self):
            pass

    def init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    fake = types.SimpleNamespace(Image=FakeImage, init=init)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = RunLogger(tmp_path / "out", total_steps=1, start_step=0, progress=False,
                       wandb_cfg={"project": "p", "mode": "offline"}, config=cfg.to_dict())
    logger.log_eval(5, result, tmp_path)
    logger.close()
    assert calls["init"]["config"] == cfg.to_dict() and calls["init"]["mode"] == "offline"
    data = calls["data"]
    assert calls["step"] == 5
    assert data["eval/reward_mean"] == result["reward_mean"] and data["eval/diversity"] == result["diversity"]
    assert data["eval/diversity_ratio"] == pytest.approx(1.0) and data["eval/diversity_base"] == base["diversity"]
    assert isinstance(data["eval/grid"], FakeImage)
    assert data["eval/grid"].data.size == Image.open(tmp_path / "grid.png").size
    assert "step 5" in data["eval/grid"].caption and "diversity" in data["eval/grid"].caption
    panels = data["eval/prompts"]
    assert [p.caption.split(":")[0] for p in panels] == ["a red apple", "a blue sky", "a green field"]
    mean0 = sum(result["per_prompt"][0]["scores"]) / 3
    assert f"reward {mean0:.3f}" in panels[0].caption
    assert f"diversity {result['per_prompt'][0]['diversity']:.3f}" in panels[0].caption
    assert all(p.data.height == 64 for p in panels)


def test_real_digits_of_one_class_are_closer_in_the_classifier_space_than_mixed_classes():
    """tools/digits_diversity_reference.py, the yardstick in docs/digits_cpu.md: real digits of one class are less
    diverse in the reward's feature space than a mix of classes (the space separates classes), yet far from 0."""
    need("sklearn")
    from tools.digits_diversity_reference import reference

    ref = reference(groups=3)
    assert ref["groups"] == 30 and ref["space"] == FEATURES
    assert 0.1 < ref["one_class"] < 0.8 * ref["any_class"] < 0.8
