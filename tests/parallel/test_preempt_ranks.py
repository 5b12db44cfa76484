"""Preemption inside a step on 2 processes (FSDP2, gloo), with a real SIGUSR1 sent to rank 1 alone (tests/signal_at.py):
the ranks agree at the same safe point (train/preemption.py), rank 0 takes rank 1's signal number, and the resumed
run equals the uninterrupted one: every metric row and every trained weight. A signal in step 1's rollout under
run.checkpoint_every 2 saves the step's start (nothing saved it yet); one in step 1's update (before its first
optimizer step) abandons the step, whose start run.checkpoint_every 1 had saved; one at an evaluation's start keeps
nothing and evaluates again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hang_guard import RUN_S
from jagg_scale.cli import eval_main
from jagg_scale.parallel.ranks import free_port, launcher_env
from train_runs import FSDP2_RUN, dcp_entries, fsdp2_reference, launch_metrics, metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BIN = Path(sys.executable).parent
SCRIPT = str(Path(__file__).resolve().parents[1] / "signal_at.py")
EVAL = ["eval.enabled=true", "eval.at_start=false", "eval.every=1", "eval.num_per_prompt=2", "eval.chunk_size=2",
        "eval.prompts=[a red apple, a blue sky]"]


def cut(out: Path, at: str, *extra: str) -> str:
    """The run with rank 1 signalled at `at` (PHASE:STEP[:NTH]): it must stop as preempted. Returns its output."""
    phase, step, *nth = at.split(":")
    env = {**launcher_env(), "JAGG_TEST_SIGNAL": ":".join([phase, step, "1", *nth])}
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), SCRIPT, *FSDP2_RUN,
           *extra, f"run.output_dir={out}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_S)  # a hang guard
    log = proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.returncode != 0, log  # the workers exited 138 (128 + SIGUSR1): torchrun reports the failure
    assert (out / "PREEMPTED").read_text().startswith("signal 10;"), log  # rank 0 took rank 1's signal
    return log


def resume(out: Path, *extra: str) -> list[dict]:
    return launch_metrics([*FSDP2_RUN, *extra, "run.resume=auto"], 2, out)


def timeless(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "comm_"))} for r in rows]


def same_weights(a: Path, b: Path) -> None:
    wa, wb = dcp_entries(a, "model"), dcp_entries(b, "model")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fsdp2_reference(tmp_path_factory)


@pytest.mark.parametrize("at,every", [("rollout:1:2", 2), ("update:1:1", 1)])
def test_a_signal_on_one_rank_inside_a_step_abandons_it_on_both_and_the_resumed_run_is_the_same(
        reference, tmp_path, at, every):
    ref_out, ref_rows = reference
    out = tmp_path / "cut"
    log = cut(out, at, f"run.checkpoint_every={every}", "train.steps=2")
    step = int(at.split(":")[1])
    assert f"preempted during step {step}'s {at.split(':')[0]}" in log
    assert [r["step"] for r in metrics(out)] == list(range(step))  # the abandoned step is not logged
    # its start: saved now (checkpoint_every 2), or by the step before (1): written once either way
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{step:08d}"]
    assert (out / "PREEMPTED").read_text().strip().endswith(f"checkpoint at step {step}")
    # the resumed run to step 2 (the reference's checkpoint after it: run.checkpoint_every 1)
    assert timeless(resume(out, f"run.checkpoint_every={every}", "train.steps=2")) == timeless(ref_rows[:2])
    same_weights(out / "checkpoints" / "step_00000002", ref_out / "checkpoints" / "step_00000002")


def test_a_signal_on_one_rank_at_an_evaluation_stops_both_and_the_resumed_run_evaluates_the_same(
        reference, tmp_path, capsys):
    """The uninterrupted run is the module's reference (evaluations draw from their own seed: they change no training
    metric), its evaluations `jagg-eval` of its checkpoints (which reproduces a run's own: test_eval_scale.py)."""
    ref_out, ref_rows = reference
    out = tmp_path / "cut"
    cut(out, "eval:1", *EVAL, "train.steps=2")
    assert [r["step"] for r in metrics(out)] == [0]
    assert not (out / "eval" / "step_00000001" / "eval.json").exists()
    resume(out, *EVAL, "train.steps=2")
    assert timeless(metrics(out)) == timeless(ref_rows[:2])
    for step in (1, 2):
        ckpt = f"step_{step:08d}"
        same_weights(out / "checkpoints" / ckpt, ref_out / "checkpoints" / ckpt)
        assert eval_main([*FSDP2_RUN, *EVAL, "--checkpoint", str(ref_out / "checkpoints" / ckpt),
                          "--output", str(tmp_path / "re" / ckpt)]) == 0, capsys.readouterr().err[-3000:]
        a, b = (json.loads((d / "eval.json").read_text()) for d in (tmp_path / "re" / ckpt, out / "eval" / ckpt))
        assert [p["prompt"] for p in a["per_prompt"]] == [p["prompt"] for p in b["per_prompt"]], step
        for pa, pb in zip(a["per_prompt"], b["per_prompt"]):  # one process against two: float order alone
            assert pa["scores"] == pytest.approx(pb["scores"], abs=1e-6), step
    assert os.environ.get("JAGG_TEST_SIGNAL") is None  # the signal is the launched run's, never this process's
