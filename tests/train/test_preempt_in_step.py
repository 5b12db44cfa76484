"""Preemption inside a step (train/preemption.py StopPoints), one process, real signals: a signal in the rollout, in
the reward wait or in the update before its first optimizer step abandons the step (the checkpoint is of its start,
the resumed run trains it again and equals the uninterrupted run: every metric, every weight); one after the
update's first optimizer step lets the step finish and checkpoints after it. (Two processes, the signal on one rank:
tests/parallel/test_preempt_ranks.py.)"""

import json
import signal
from pathlib import Path

import pytest
import torch

from jagg_scale.train import Trainer, load_config
from stand_ins import signal_in_step

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
# 4 rows a step in two minibatches (two optimizer steps a step), 4 sampling steps, checkpoints only when preempted
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=2", "log.progress=false", "run.checkpoint_every=0", "jagg.window=2", "train.steps=3"]
TIMING = ("time_",)


def rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)} for line in lines if line.strip()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    trainer = Trainer(load_config(TINY, SMALL + [f"run.output_dir={out}"]))
    trainer.fit()
    weights = {k: v.clone() for k, v in trainer.engine.full_state_dict().items()}
    trainer.close()
    return rows(out), weights


def cut_and_resume(out: Path, phase: str, nth: int = 1, extra=()) -> tuple[Trainer, list[dict]]:
    overrides = SMALL + [f"run.output_dir={out}", *extra]
    cut = Trainer(load_config(TINY, overrides))
    signal_in_step(cut, 1, phase, nth)
    with pytest.raises(SystemExit) as code:
        cut.fit()
    cut.close()
    assert code.value.code == 128 + signal.SIGTERM
    assert (out / "PREEMPTED").is_file()
    logged = rows(out)
    resumed = Trainer(load_config(TINY, overrides + ["run.resume=auto"]))
    resumed.fit()
    return resumed, logged


@pytest.mark.parametrize("phase,nth", [("rollout", 1), ("rollout", 3), ("reward", 1), ("update", 2)])
def test_a_signal_before_the_first_optimizer_step_abandons_the_step_and_the_resumed_run_is_the_same(
        tmp_path, uninterrupted, phase, nth):
    full_rows, full_weights = uninterrupted
    resumed, logged = cut_and_resume(tmp_path, phase, nth)
    assert [r["step"] for r in logged] == [0]  # step 1 was abandoned: not logged ...
    assert (tmp_path / "checkpoints" / "step_00000001" / "COMPLETE").is_file()  # ... its start saved
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()
    assert resumed.start_step == 1
    assert rows(tmp_path) == full_rows  # step 1 trained again from its start: the same draws, the same metrics
    weights = resumed.engine.full_state_dict()
    assert weights.keys() == full_weights.keys()
    assert all(torch.equal(weights[k], full_weights[k]) for k in weights)
    resumed.close()


def test_a_signal_after_the_first_optimizer_step_finishes_the_step(tmp_path, uninterrupted):
    full_rows, full_weights = uninterrupted
    resumed, logged = cut_and_resume(tmp_path, "optimizer")
    assert [r["step"] for r in logged] == [0, 1]  # the weights had moved: step 1 ran to its end, then saved
    assert (tmp_path / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert not (tmp_path / "checkpoints" / "step_00000001").exists()
    assert resumed.start_step == 2
    assert rows(tmp_path) == full_rows
    weights = resumed.engine.full_state_dict()
    assert all(torch.equal(weights[k], full_weights[k]) for k in weights)
    resumed.close()


def test_an_abandoned_step_whose_start_is_saved_already_writes_nothing_new(tmp_path):
    """run.checkpoint_every 1: the step's start is the checkpoint written after the step before; it is not
    written again (its files and their time unchanged)."""
    overrides = SMALL + [f"run.output_dir={tmp_path}", "run.checkpoint_every=1"]
    cut = Trainer(load_config(TINY, overrides))
    signal_in_step(cut, 1, "rollout")
    saved = tmp_path / "checkpoints" / "step_00000001" / "COMPLETE"
    real_save = cut.run_state.save
    saves = []
    cut.run_state.save = lambda step, *a, **k: saves.append(step) or real_save(step, *a, **k)
    with pytest.raises(SystemExit):
        cut.fit()
    cut.close()
    assert saves == [1] and saved.is_file()  # after step 0 only
    assert (tmp_path / "PREEMPTED").read_text().startswith("signal 15; checkpoint at step 1")


def test_a_signal_in_step_0_saves_nothing_and_the_run_starts_over_the_same(tmp_path, uninterrupted):
    """Step 0's start is the model the config builds: nothing is saved (DCP would give the optimizer a state of its
    own), the resumed run (run.resume auto, no checkpoint) starts at step 0 and equals the uninterrupted run."""
    full_rows, full_weights = uninterrupted
    overrides = SMALL + [f"run.output_dir={tmp_path}"]
    cut = Trainer(load_config(TINY, overrides))
    signal_in_step(cut, 0, "update")
    with pytest.raises(SystemExit):
        cut.fit()
    cut.close()
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "PREEMPTED").is_file()
    resumed = Trainer(load_config(TINY, overrides + ["run.resume=auto"]))
    assert resumed.start_step == 0
    resumed.fit()
    assert rows(tmp_path) == full_rows
    weights = resumed.engine.full_state_dict()
    assert all(torch.equal(weights[k], full_weights[k]) for k in weights)
    resumed.close()
