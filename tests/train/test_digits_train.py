"""The digits CPU default end to end: a 2-step run and jagg-eval on the committed generator (its reward, and its
within-prompt diversity in the digit classifier's feature space)."""

import json
import re
from pathlib import Path

import pytest

from jagg_scale.cli import eval_main
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.diversity import FEATURES

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "digits_cpu.yaml")
FAST = ["train.prompts_per_step=2", "grpo.group_size=4", "train.minibatch_size=8", "log.progress=false"]


@pytest.mark.slow  # two GRPO steps with an exact-vs-JAGG probe, two evaluations, a re-evaluation
def test_two_step_digits_run(tmp_path):
    cfg = load_config(DIGITS, FAST + ["train.steps=2", f"run.output_dir={tmp_path}", "eval.num_per_prompt=2",
                                      "jagg.probe_every=1"])
    trainer = Trainer(cfg)
    history = trainer.fit()
    assert len(history) == 2
    for row in history:
        assert 0.0 <= row["reward_mean"] <= 1.0
        assert row["backward_passes"] == 8 and row["per_step_equiv"] == 16  # 16 steps in windows of 4
        assert 0.0 < row["probe_cos"] <= 1.0
    assert sorted(trainer.evals) == [0, 2]
    assert (tmp_path / "eval" / "step_00000002" / "grid.png").exists()
    # diversity in the classifier's feature space, the base model's (step 0) beside the trained one's
    after = trainer.evals[2]
    assert after["diversity_space"] == FEATURES and after["base"]["diversity"] == trainer.evals[0]["diversity"] > 0
    assert after["diversity_ratio"] == pytest.approx(after["diversity"] / trainer.evals[0]["diversity"])
    # jagg-eval on the run directory loads its newest checkpoint and measures what the trainer measured
    out = tmp_path / "re_eval"
    assert eval_main([DIGITS, *FAST, "eval.num_per_prompt=2", "--checkpoint", str(tmp_path), "--output", str(out)]) == 0
    again = json.loads((out / "eval.json").read_text())
    assert again["reward_mean"] == pytest.approx(after["reward_mean"], abs=1e-6)
    assert again["diversity"] == pytest.approx(after["diversity"], abs=1e-6)


def test_jagg_eval_on_the_committed_generator_reproduces_its_card(tmp_path):
    """The card's held-out reward (ODE, 16 steps, seed 1234, 4 images per held-out prompt) is what jagg-eval
    measures with the digits config: same protocol, same number."""
    card = (ROOT / "jagg_scale" / "assets" / "digits" / "CARD.md").read_text()
    assert eval_main([DIGITS, "eval.num_per_prompt=4", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["num_images"] == 80 and result["num_failed"] == 0
    card_value = float(re.search(r"held-out reward \(ODE, held-out prompts\): \*\*([0-9.]+)\*\*", card).group(1))
    assert 0.3 <= result["reward_mean"] <= 0.8
    # bit-identical on the build machine; other CPUs may round differently in the last float bits
    assert result["reward_mean"] == pytest.approx(card_value, abs=0.02)
    assert (tmp_path / "grid.png").stat().st_size > 0
