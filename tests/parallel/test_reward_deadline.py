"""Deadlines that nest: a reward host that stops answering costs the samples it holds, never the job.

Two real jagg-train processes (torchrun, gloo) score with the `remote` reward against a host that accepts
connections and drips its headers a byte at a time, forever (a real socket): without a deadline the rank would wait
for it while the other waited in the reward all-gather under parallel.collective_timeout_s. With reward.deadline_s
each rank masks what is not scored in time before the all-gather; the step completes and counts them."""

from __future__ import annotations

import json
import socket
import itertools
import subprocess
import sys
import threading
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


def _dribbling_server() -> tuple[socket.socket, threading.Event]:
    """A host that answers every connection one byte of headers every 0.5 s, forever: each of the client's socket
    reads gets a byte within its timeout_s, so only the reward's deadline can end the wait (the budget check at
    start-up bounds timeout_s x attempts, which such a host never lets expire)."""
    srv, stop = socket.socket(), threading.Event()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def drip(conn: socket.socket) -> None:
        with conn:
            for byte in itertools.cycle(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 64):
                if stop.wait(0.5):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv, stop


@pytest.mark.dist
@pytest.mark.slow
def test_a_reward_host_that_stops_answering_costs_samples_not_the_job(tmp_path):
    hung, stop = _dribbling_server()
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    remote = {"url": url, "reward": "jpeg_compressibility", "timeout_s": 2, "retries": 0}
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
        stop.set()
        hung.close()
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["reward_late"] == 4  # each rank's 4 samples, in chunks of 2, none scored in time: masked
    assert took < 60  # the deadline ended the wait: the host would have dripped its headers forever
    assert "not scored within reward.deadline_s=3 s: masked" in proc.stderr
