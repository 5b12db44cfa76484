"""A run directory under the ways runs end and start (issue 16 items 3, 4, 5, 8), in one process: a torn last line
of metrics.jsonl, a second job on the same directory, run.resume=auto with no valid checkpoint, run.resume and
run.output_dir typos, a checkpoint past train.steps, and summary.json after a resume with nothing left to train;
a fresh start into an earlier run's directory (issue 17 item 6). (Across processes and torchrun:
test_run_dir_ranks.py.)"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import WAIT_S
from jagg_scale.checkpoint import CheckpointError
from jagg_scale.checkpoint.local import save_checkpoint_dir
from jagg_scale.cli import train_main
from jagg_scale.parallel.dist import DistContext
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.logging import MetricsFileError, parse_metrics, read_metrics
from jagg_scale.train.run_state import RunDirExistsError
from stand_ins import sigterm_at_step

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=4", "log.progress=false", "run.checkpoint_every=0", "jagg.window=2"]


def cfg(out: Path, *extra: str):
    return load_config(TINY, [*SMALL, f"run.output_dir={out}", *extra])


def train(out: Path, *extra: str) -> list[dict]:
    return Trainer(cfg(out, *extra)).fit()


# ------------------------------------------------------------------------------------------ metrics.jsonl (item 3)


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_the_run_resumes(tmp_path, caplog):
    train(tmp_path, "train.steps=2")
    metrics = tmp_path / "metrics.jsonl"
    before = metrics.read_text()
    with metrics.open("a") as f:
        f.write('{"step": 2, "reward_mean": 0.5, "lo')  # killed mid-write (or the disk filled up)
    with caplog.at_level(logging.WARNING):
        rows = train(tmp_path, "train.steps=3", "run.resume=auto")
    assert [r["step"] for r in rows] == [2]
    assert any("metrics.jsonl" in r.getMessage() and "line 3" in r.getMessage() and "torn" in r.getMessage()
               for r in caplog.records)
    assert metrics.read_text().startswith(before)  # the lines before it are kept as they were
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


def test_a_damaged_metrics_line_before_the_last_is_a_named_error_and_nothing_is_rewritten(tmp_path):
    train(tmp_path, "train.steps=2")
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    damaged = lines[0] + '{"step": 1, "rew\n' + lines[1]
    metrics.write_text(damaged)
    with pytest.raises(MetricsFileError, match=r"metrics\.jsonl: line 2 "):
        train(tmp_path, "train.steps=3", "run.resume=auto")
    assert metrics.read_text() == damaged


@pytest.mark.parametrize("tail,rows", [
    ('{"step": 2}', [0, 1, 2]),  # complete but for its newline: kept
    ('{"step": 2, "x": [1,', [0, 1]),
    ("\x00\x00\x00\x00", [0, 1]),  # a crash that extended the file with zeros
    ('{"step": 2, "x": 1}\n\n', [0, 1, 2]),  # blank lines are not rows
    ('{"step": 2.0}\n', [0, 1, 2]),  # an older distributed run's step: averaged over ranks as a float
])
def test_parse_metrics_tolerates_a_torn_last_line_only(tmp_path, tail, rows):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n' + tail)
    assert [r["step"] for r in parse_metrics(path)] == rows
    path.write_text('{"step": 0}\n' + tail.rstrip("\n") + '\n{"step": 1}\n')
    if rows[-1] == 1:
        with pytest.raises(MetricsFileError, match="line 2"):
            parse_metrics(path)


# ---------------------------------------------------------------------------------------- one job per run dir (item 4)


HOLDER = """
import sys
from jagg_scale.train.run_lock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # held until the test closes stdin
"""


def test_a_second_job_on_a_locked_run_directory_fails_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=rf"in use by pid {holder.pid} on host {socket.gethostname()}"):
            Trainer(cfg(tmp_path, "train.steps=1"))
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=WAIT_S)  # a hang guard
    assert len(train(tmp_path, "train.steps=1")) == 1  # the holder is gone: so is its lock
    info = json.loads((tmp_path / ".lock").read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()


def test_temp_checkpoint_names_are_unique_per_attempt_and_stale_ones_still_go(tmp_path):
    stale = tmp_path / ".tmp_step_00000001_12345_deadbeef"
    (stale / "dcp").mkdir(parents=True)
    (stale / "dcp" / ".metadata.tmp").write_text("an attempt killed mid-save")
    seen = []

    def write(tmp: Path):
        seen.append(tmp.name)
        return [tmp / "x.bin"] if (tmp / "x.bin").write_bytes(b"x") else []

    for _ in range(2):  # the same step twice, through the collective path (a DistContext)
        save_checkpoint_dir(tmp_path, 1, write=write, state={}, dist=DistContext())
    assert len(set(seen)) == 2 and all(f"_{os.getpid()}_" in name for name in seen)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


# ------------------------------------------------------------------------------------------ resume (items 5, 8)


def test_resume_auto_refuses_when_checkpoints_exist_but_none_is_valid(tmp_path):
    train(tmp_path, "train.steps=2", "run.checkpoint_every=1", "run.keep_last=3")
    metrics = (tmp_path / "metrics.jsonl").read_text()
    for step in (1, 2):
        shard = tmp_path / "checkpoints" / f"step_{step:08d}" / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="none valid") as err:
        Trainer(cfg(tmp_path, "train.steps=3", "run.resume=auto"))
    for step in (1, 2):
        assert f"step_{step:08d}: model.safetensors is" in str(err.value)
    assert "run.resume=none run.overwrite=true" in str(err.value)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # nothing rewritten
    with pytest.raises(RunDirExistsError):  # none alone would replace the run: refused too
        Trainer(cfg(tmp_path, "train.steps=3", "run.resume=none"))
    assert Trainer(cfg(tmp_path, "train.steps=3", "run.resume=none", "run.overwrite=true")).start_step == 0


@pytest.mark.parametrize("override,message", [
    ("run.resume=Auto", r"'run\.resume' is 'Auto'.*neither a keyword \(none \| auto\).*does not exist.*'auto'\?"),
    ("run.resume=/no/such/checkpoint", r"'run\.resume'.*does not exist"),
    ("run.resume=''", r"'run\.resume'"),
    ("run.output_dir=''", r"'run\.output_dir' must not be empty"),
])
def test_run_section_typos_are_named_config_errors(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [f"run.output_dir={tmp_path}", override])
    assert train_main([TINY, f"run.output_dir={tmp_path / 'x'}", override]) == 2
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_past_train_steps_is_refused(tmp_path):
    train(tmp_path, "train.steps=2")
    with pytest.raises(ConfigError, match=r"'train\.steps' is 1, but the checkpoint .*step_00000002.* is at step 2"):
        Trainer(cfg(tmp_path, "train.steps=1", "run.resume=auto"))
    assert Trainer(cfg(tmp_path, "train.steps=2", "run.resume=auto")).start_step == 2  # at the end: fine


def test_a_sigterm_in_the_last_step_still_gets_a_summary_after_the_resume(tmp_path):
    trainer = Trainer(cfg(tmp_path, "train.steps=2"))
    sigterm_at_step(trainer, 1)
    with pytest.raises(SystemExit):
        trainer.fit()
    assert not (tmp_path / "summary.json").exists()
    assert train_main([TINY, *SMALL, f"run.output_dir={tmp_path}", "train.steps=2", "run.resume=auto"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2  # the whole run's steps, from metrics.jsonl


# ------------------------------------------------------------------------------ a fresh start over an earlier run


def test_a_fresh_start_into_an_earlier_run_is_refused_naming_it(tmp_path, capsys):
    train(tmp_path, "train.steps=2", "run.checkpoint_every=1", "run.keep_last=3")
    metrics = (tmp_path / "metrics.jsonl").read_text()
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(RunDirExistsError, match=rf"{tmp_path} already holds a run \(metrics\.jsonl \(2 rows\), "
                                                r"checkpoints/step_00000001 \.\. step_00000002 \(2\)\)") as err:
        Trainer(cfg(tmp_path, "train.steps=2"))  # run.resume: none, the default
    for way in ("run.resume=auto", "new run.output_dir", "run.overwrite=true"):
        assert way in str(err.value)
    assert isinstance(err.value, ConfigError)
    # jagg-train: one line, exit 2, nothing touched
    assert train_main([TINY, *SMALL, f"run.output_dir={tmp_path}", "train.steps=2"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == checkpoints
    # the ways on: continue it, or a directory with nothing in it yet (a failed start leaves no run behind)
    assert Trainer(cfg(tmp_path, "train.steps=2", "run.resume=auto")).start_step == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text("\n")
    assert Trainer(cfg(tmp_path / "other", "train.steps=1")).start_step == 0


def test_overwrite_replaces_the_earlier_run(tmp_path):
    train(tmp_path, "train.steps=3", "run.checkpoint_every=1", "run.keep_last=3")
    (tmp_path / "eval" / "step_00000003").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("the user's own file")
    rows = train(tmp_path, "train.steps=1", "run.overwrite=true")
    assert [r["step"] for r in rows] == [0]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]
    # the old run's later checkpoints are gone: run.resume=auto cannot mistake step 3 for this run's
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    assert not (tmp_path / "eval").exists()
    assert (tmp_path / "notes.txt").read_text() == "the user's own file"  # only what a run writes is replaced


def test_overwrite_with_a_resume_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'run\.overwrite' is true .* while run\.resume is 'auto'"):
        load_config(TINY, [f"run.output_dir={tmp_path}", "run.resume=auto", "run.overwrite=true"])
