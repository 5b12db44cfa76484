"""jagg-eval reads model weights only: no Trainer, no engine, no optimizer state, for checkpoints of every engine
it can read on one process (none and a one-process fsdp2 run, with and without EMA)."""

import json
from pathlib import Path

import pytest
import torch

from jagg_scale.cli import eval_main
from jagg_scale.train import Trainer, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=3",
         "train.minibatch_size=6", "log.progress=false", "run.checkpoint_every=0", "train.steps=2", "jagg.window=2"]
EVAL = ["eval.enabled=true", "eval.prompts=[a red apple, a blue sky]", "eval.num_per_prompt=2"]

pytestmark = pytest.mark.slow  # each test trains a run and evaluates it twice (~2-6 s): outside make test-fast


@pytest.mark.parametrize("extra", [
    [],
    ["train.ema_decay=0.5"],
    ["parallel.engine=fsdp2", "train.ema_decay=0.5"],
    ["parallel.engine=fsdp2", "parallel.activation_checkpointing=true"],
    pytest.param(["parallel.engine=deepspeed", "train.ema_decay=0.5"], marks=pytest.mark.dist),  # DeepSpeed's JIT op
], ids=["none", "none-ema", "fsdp2-ema", "fsdp2-checkpointed", "deepspeed-ema"])
def test_jagg_eval_reproduces_the_in_run_evaluation(tmp_path, monkeypatch, extra):
    deepspeed = "parallel.engine=deepspeed" in extra
    run = tmp_path / "run"
    trainer = Trainer(load_config(TINY, SMALL + EVAL + extra + [f"run.output_dir={run}"]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    expected = trainer.evals[2]
    assert expected["reward_mean"] != trainer.evals[0]["reward_mean"]  # training moved the weights

    # evaluating a checkpoint never builds an optimizer and never torch.loads a file with pickle enabled
    def refuse(*args, **kwargs):
        raise AssertionError("jagg-eval must not build an optimizer")

    real_load = torch.load

    def weights_only_load(*args, **kwargs):  # DeepSpeed's own checkpoint files are pickles (parallel/weights.py)
        assert deepspeed or kwargs.get("weights_only") is True, "jagg-eval must not unpickle checkpoint files"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "__init__", refuse)
    monkeypatch.setattr(torch, "load", weights_only_load)
    out = tmp_path / "eval_out"
    assert eval_main([TINY, *SMALL, *EVAL, *extra, "--checkpoint", str(run), "--output", str(out)]) == 0
    got = json.loads((out / "eval.json").read_text())
    for a, b in zip(got["per_prompt"], expected["per_prompt"]):
        assert a["prompt"] == b["prompt"] and a["scores"] == pytest.approx(b["scores"], abs=1e-6)
    assert got["reward_mean"] == pytest.approx(expected["reward_mean"], abs=1e-6)


def test_jagg_eval_refuses_a_checkpoint_that_does_not_fit(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(load_config(TINY, SMALL + [f"run.output_dir={run}"])).fit()
    bigger = [o for o in SMALL if not o.startswith("model.dit.hidden_size")] + ["model.dit.hidden_size=64"]
    assert eval_main([TINY, *bigger, *EVAL, "--checkpoint", str(run), "--output", str(tmp_path / "o")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jagg-eval:")]
    assert len(err) == 1 and "has shape" in err[0]  # one line, naming the tensor whose shape differs
