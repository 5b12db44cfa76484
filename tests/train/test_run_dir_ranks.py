"""A run directory across processes, with torchrun (issue 16 items 3, 4; train/run_lock.py, train/logging.py):

- every rank of a second 2-process job fails at once, naming the process that holds the directory, instead of
  training beside it (or one rank waiting forever in a collective);
- a worker whose torchrun agent is killed does not train on, orphaned: it gets SIGTERM, saves its checkpoint as on
  a preemption and exits, and a relaunch resumes from that checkpoint;
- a damaged metrics.jsonl fails every rank of a resume with the same error naming the line, not rank 0 alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hang_guard import POLL_S, RUN_S, WAIT_S
from jagg_scale.parallel.ranks import free_port, launcher_env
from process_tree import gone

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # trainer processes under torchrun

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.hidden_size=32", "model.dit.depth=2", "sampling.num_steps=4", "train.prompts_per_step=2",
         "train.minibatch_size=4", "log.progress=false", "jagg.window=2", "run.checkpoint_every=0"]
HOLDER = """
import sys
from jagg_scale.train.run_lock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # held until the test closes stdin
"""


def torchrun(nproc: int, out: Path, *overrides: str) -> list[str]:
    return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
            str(BIN / "jagg-train"), TINY, *SMALL, f"run.output_dir={out}", *overrides]


def test_every_rank_of_a_second_job_fails_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = subprocess.run(torchrun(2, out, "parallel.engine=fsdp2", "train.steps=1"), env=launcher_env(),
                              capture_output=True, text=True, timeout=RUN_S)  # a hang guard only
    finally:
        holder.stdin.close()
        holder.wait(timeout=WAIT_S)  # a hang guard
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert proc.returncode != 0 and "Traceback (most recent call last)" not in log.split("torchrun")[0]
    for rank in (0, 1):  # each rank refused, one line naming the holder (exit 2: the launcher reports it)
        assert f"jagg-train [rank {rank}/2]: run directory {out} is in use by pid {holder.pid}" in log, log[-4000:]
    assert not (out / "metrics.jsonl").exists()


def test_a_worker_exits_when_its_torchrun_agent_is_killed(tmp_path):
    out = tmp_path / "run"
    agent = subprocess.Popen(torchrun(1, out, "train.steps=400"), env=launcher_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_S  # a hang guard: polls for the first metrics line
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and agent.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                break
            time.sleep(POLL_S)
        worker = json.loads((out / ".lock").read_text())["pid"]  # rank 0 wrote its pid into the lock
        assert worker != agent.pid and not gone(worker)
        os.kill(agent.pid, signal.SIGKILL)  # the agent alone: its worker is orphaned
        agent.wait()
        deadline = time.monotonic() + WAIT_S  # a hang guard: one step and a checkpoint, then exit
        while not gone(worker) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        assert gone(worker), "the orphaned worker trains on"
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)  # whatever is left of the job (nothing, when the test passes)
        except ProcessLookupError:
            pass
    done = len(metrics.read_text().splitlines())
    assert 1 <= done < 400
    assert (out / "PREEMPTED").is_file()  # it left as on a preemption: a checkpoint of the steps it logged
    assert (out / "checkpoints" / f"step_{done:08d}" / "COMPLETE").is_file()
    from train_runs import fit_metrics  # the relaunch, in this process: the lock is free again, the checkpoint resumes

    fit_metrics(TINY, [*SMALL, f"train.steps={done + 1}", "run.resume=auto"], out)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(done + 1))


def test_a_damaged_metrics_file_fails_every_rank_of_a_resume(tmp_path):
    from train_runs import fit_metrics

    out = tmp_path / "run"  # the run to resume, fitted in this process (a launch of its own costs ~5 s of CPU)
    fit_metrics(TINY, [*SMALL, "parallel.engine=fsdp2", "train.steps=2"], out)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + "{not json\n" + lines[1])
    proc = subprocess.run(torchrun(2, out, "parallel.engine=fsdp2", "train.steps=3", "run.resume=auto"),
                          env=launcher_env(), capture_output=True, text=True, timeout=RUN_S)  # a hang guard only
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: jagg_scale.train.logging.MetricsFileError: {metrics}: line 2 " in log, log[-4000:]
