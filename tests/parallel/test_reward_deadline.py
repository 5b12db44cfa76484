"""Deadlines that nest: a reward host that stops answering costs the samples it holds, never the job.

Two real jagg-train processes (torchrun, gloo) score with the `remote` reward against a server that accepts
connections and never answers (a real socket): without a deadline the rank would wait for the client's timeout x
retries while the other waited in the reward all-gather under parallel.collective_timeout_s. With reward.deadline_s
each rank masks what is not scored in time before the all-gather; the step completes and counts them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hang_guard import RUN_S
from jagg_scale.parallel.ranks import free_port, launcher_env
from jagg_scale.train import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def test_the_reward_deadline_nests_inside_the_collective_timeout():
    assert load_config(TINY, []).reward_deadline_s == 900  # null: half of the 1800 s collective timeout
    assert load_config(TINY, ["parallel.collective_timeout_s=120", "reward.deadline_s=90"]).reward_deadline_s == 90
    with pytest.raises(ConfigError, match=r"config key 'reward.deadline_s' 100 s must end 30 s inside "
                                          r"parallel.collective_timeout_s=120"):
        load_config(TINY, ["parallel.collective_timeout_s=120", "reward.deadline_s=100"])
    with pytest.raises(ConfigError, match="config key 'reward.deadline_s' must be > 0"):
        load_config(TINY, ["reward.deadline_s=0"])


@pytest.mark.dist
@pytest.mark.slow
def test_a_reward_host_that_stops_answering_costs_samples_not_the_job(tmp_path):
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # connections complete in the kernel's backlog; nothing ever reads or answers them
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    remote = {"url": url, "reward": "jpeg_compressibility", "timeout_s": 90, "retries": 0}
    out = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(BIN / "jagg-train"),
           str(TINY), "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=8",
           "model.dit.patch_size=2", "sampling.num_steps=4", "train.prompts_per_step=2", "train.minibatch_size=8",
           "sampling.chunk_size=2", "train.steps=1", "run.checkpoint_every=0", "log.progress=false",
           "parallel.engine=fsdp2", "parallel.collective_timeout_s=120", "reward.deadline_s=3",
           "reward.max_fail_frac=1.0", "reward.name=remote",
           f"reward.options={json.dumps(remote)}",
           f"run.output_dir={out}"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True, timeout=RUN_S)  # hang guard
    finally:
        hung.close()
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["reward_late"] == 4  # each rank's 4 samples, in chunks of 2, none scored in time: masked
    assert took < 90  # the deadline ended the wait, not the client's 90 s timeout
    assert "not scored within reward.deadline_s=3 s: masked" in proc.stderr
