"""The per-step invariants that stop a run in one line (train/invariants.py)."""


import pytest
import torch

from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.invariants import InvariantError
from jagg_scale.train.logging import read_metrics
from train_runs import TINY, small_dit

SMALL = small_dit(6, 3) + ["train.steps=2"]


def test_training_reproduces_the_rollouts_log_probs_on_the_first_minibatch(tmp_path):
    Trainer(load_config(TINY, SMALL + [f"run.output_dir={tmp_path}"])).fit()
    rows = read_metrics(tmp_path)
    # float32: the training pass (3 rows, 2 knots stacked) sums in another order than the rollout's 6-row forwards:
    # ~1e-7, four orders under the default tolerance 1e-3; the second minibatch of a step is off-policy
    assert all(0.0 <= r["onpolicy_log_ratio"] < 1e-6 for r in rows)
    assert all(r["ratio_max"] != 1.0 or r["ratio_min"] != 1.0 for r in rows)  # ... and does move the ratio


def test_a_training_forward_that_is_not_the_rollouts_stops_the_run(tmp_path):
    """Dropout left on in training (the rollout runs in eval mode) is the kind of drift the check exists for."""
    trainer = Trainer(load_config(TINY, SMALL + [f"run.output_dir={tmp_path}"]))
    trainer.model.register_forward_hook(
        lambda module, args, out: torch.nn.functional.dropout(out, 0.1, training=module.training))
    try:
        with pytest.raises(InvariantError) as err:
            trainer.fit()
    finally:
        trainer.close()
    message = str(err.value)
    assert "\n" not in message and "grpo.onpolicy_tolerance=0.001" in message and "training step 0" in message
    assert not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path)  # stopped before logging it


def test_the_tolerance_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match=r"grpo\.onpolicy_tolerance"):
        load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "grpo.onpolicy_tolerance=0"])
