"""Training on a trainer pool and a rollout pool through `jagg-train` under torchrun (pools/), on real gloo processes:
2 trainers and 2 rollout ranks at max_staleness 0 are the synchronous 2-rank run bit for bit (FSDP2; DeepSpeed with
one rollout rank serving both); a rollout rank hung
mid-run stops the job within pools.timeout_s with one line naming it (a killed one torchrun's agent stops at once);
the stopped run resumes to the uninterrupted run's metrics; a trainer pool that refuses to start stops the rollout
ranks with its line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hang_guard import POLL_S, RUN_S
from process_tree import children, kill, wait_gone
from train_runs import BIN, FSDP2_RUN, TINY, dcp_entries, fsdp2_reference, launch_metrics, metrics, small_dit

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # trainer and rollout processes under torchrun

BASE = [TINY, *small_dit(4, 6), "run.keep_last=3"]
POOL_KEYS = ("policy_version", "staleness", "time_", "comm_")  # what only a split run logs, and the clocks


def strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(POOL_KEYS)} for r in rows]


def test_two_trainers_and_two_rollout_ranks_at_staleness_0_train_as_the_synchronous_run(tmp_path, tmp_path_factory):
    # the 2-rank FSDP2 reference of tests/parallel/test_distributed.py (2 minibatches a step, the sharded EMA), split:
    # each rollout rank samples its trainer's rows as rank t of that run does, the rewards gathered over both
    sync_out, sync = fsdp2_reference(tmp_path_factory)
    split = launch_metrics([*FSDP2_RUN, "pools.rollout_ranks=2"], 4, tmp_path / "split")
    assert [r["staleness"] for r in split] == [0, 0, 0] and [r["policy_version"] for r in split] == [0, 1, 2]
    assert strip(split) == strip(sync)  # every loss, ratio, reward and gradient norm, exactly
    weights = [dcp_entries(p / "checkpoints" / "step_00000003", "model") for p in (tmp_path / "split", sync_out)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_deepspeed_trainer_pool_at_staleness_0_trains_as_the_synchronous_deepspeed_run(tmp_path):
    """ZeRO-3 trainers (whose consolidated weights are what they compute with: pools/replica.py) and one rollout rank
    serving both: the 2-rank DeepSpeed run's metrics exactly."""
    from extras import need

    need("deepspeed")
    args = [*BASE, "parallel.engine=deepspeed", "train.steps=2", "run.checkpoint_every=0"]
    sync = launch_metrics(args, 2, tmp_path / "sync")
    split = launch_metrics([*args, "pools.rollout_ranks=1"], 3, tmp_path / "split")
    assert [r["policy_version"] for r in split] == [0, 1]
    assert strip(split) == strip(sync)


def _rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=")[1])


def _torchrun(out: Path, *overrides: str) -> list[str]:
    """jagg-train under torchrun on 3 processes: 2 trainers (FSDP2) and 1 rollout rank, one step ahead."""
    from jagg_scale.parallel.ranks import free_port

    return [str(BIN / "torchrun"), "--nproc_per_node", "3", "--master_port", str(free_port()), str(BIN / "jagg-train"),
            *BASE, "parallel.engine=fsdp2", "pools.rollout_ranks=1", "pools.max_staleness=1", "pools.timeout_s=120",
            "run.checkpoint_every=2", f"run.output_dir={out}", *overrides]


# pools.timeout_s of the hung run (its reward scored inline: no reward deadline to nest in it): a tiny step's wait
# takes < 1 s here, a few s on a loaded 2-core machine; a rollout rank waits twice it for the weights
HUNG_S = 12


def test_a_hung_rollout_rank_stops_the_job_and_the_run_resumes_as_the_uninterrupted_one(tmp_path):
    from jagg_scale.parallel.ranks import free_port, launcher_env

    # 2 trainers (FSDP2) and 1 rollout rank serving both, one step ahead, 200 steps long; once the step-4 checkpoint
    # is written (steps 0-3 logged: the uninterrupted reference) the rollout rank (2) is stopped (SIGSTOP: hung, its
    # connections open) and the trainers stop the job within pools.timeout_s, naming it
    out, hung_run = tmp_path / "hung", ["reward.background=false", f"pools.timeout_s={HUNG_S}"]
    proc = subprocess.Popen(_torchrun(out, "train.steps=200", *hung_run), env=launcher_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    marker = out / "checkpoints" / "step_00000004" / "COMPLETE"
    deadline = time.monotonic() + RUN_S  # a hang guard
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert proc.poll() is None, proc.stderr.read()[-4000:]
    workers = children(proc.pid)
    hung = next(p for p in workers if _rank_of(p) == 2)
    os.kill(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    resumed = tmp_path / "resumed"  # the step-2 checkpoint and the rows before it, as a killed run leaves them
    shutil.copytree(out / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    said, took = [], None
    try:
        for line in proc.stderr:  # until a rank names the hung one (EOF: the job ended without naming it)
            if line.startswith("jagg-train [rank"):
                said.append(line.strip())
                if "from rank 2: nothing within" in line:
                    took = time.monotonic() - stopped
                    break
        os.kill(hung, signal.SIGKILL)  # a stopped process ignores the launcher's SIGTERM: its grace period saved
        proc.communicate(timeout=RUN_S)  # a hang guard
    finally:
        kill(workers)
        wait_gone(workers)
    assert proc.returncode != 0
    # a trainer it serves names it first (a rollout rank would wait twice pools.timeout_s)
    assert said[0].startswith(("jagg-train [rank 0/3]: pools: rank 0 waiting for the rollout message from rank 2: ",
                               "jagg-train [rank 1/3]: pools: rank 1 waiting for the rollout message from rank 2: ")
                              ) and f"nothing within {HUNG_S} s: rank 2 is hung or stopped" in said[0], said
    # named by the pools' timeout, not the collective timeout (1800 s): the bound generous for a loaded machine
    assert took is not None and took < 300, took
    ref = metrics(out)[:4]
    assert [r["staleness"] for r in ref] == [0, 1, 1, 1] and [r["policy_version"] for r in ref] == [0, 0, 1, 2]

    # resumed from step 2 to step 4: the uninterrupted run's metrics, step for step (the rollouts of steps 2 and 3
    # sampled with the versions 1 and 2 the checkpoint holds beside the live weights)
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics(out)[:2]))
    proc = subprocess.run(_torchrun(resumed, "train.steps=4", "run.resume=auto", *hung_run), env=launcher_env(),
                          capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert strip(metrics(resumed)) == strip(ref)
    assert (resumed / "checkpoints" / "step_00000002" / "pool_weights.safetensors").is_file()

    # a start the trainer pool refuses (a fresh start into this run's directory): the rollout rank stops with its line
    refused = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                              str(BIN / "jagg-train"), *BASE, "pools.rollout_ranks=1", "train.steps=4",
                              f"run.output_dir={out}"], env=launcher_env(), capture_output=True, text=True,
                             timeout=RUN_S)
    assert refused.returncode != 0
    said = [line for line in refused.stderr.splitlines() if line.startswith("jagg-train [rank")]
    assert any(line.startswith("jagg-train [rank 0/2]: config key 'run.output_dir'") for line in said), said
    assert any(line.startswith("jagg-train [rank 1/2]: pools: the trainer pool did not start: config key "
                               "'run.output_dir'") for line in said), said
