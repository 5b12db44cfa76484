"""Checkpoints across ranks (2 processes, gloo, FSDP2; tests/dist_workers/checkpoint_worker.py says what each
scenario does): every rank hashes only the files it wrote, a resume hashes each file once on one rank and restores
the state bit for bit, and a bad checkpoint or a failed write fails every rank with the same message instead of
leaving one waiting in a collective."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import RUN_S, WAIT_S
from once import once
from jagg_scale.parallel.ranks import free_port

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one torchrun launch shared by the module (~15 s idle)

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist_workers" / "checkpoint_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return once(tmp_path_factory, "checkpoint_ranks", _launch)[1]


def _launch(out: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    # WAIT_S as the process group's timeout: a rank stuck in a collective fails after it (a hang guard)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(WORKER), str(out), str(WAIT_S)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_S)  # a hang guard only
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)]


def test_each_rank_hashes_only_the_files_it_wrote(ranks):
    r0, r1 = ranks[0]["save_hashed"], ranks[1]["save_hashed"]
    assert not set(r0) & set(r1)  # nothing hashed twice
    # rank r: its DCP shard and its RNG state; rank 0 also DCP's .metadata, the engine marker and state.json
    assert "dcp/__1_0.distcp" in r1 and "rng_rank00001.pt" in r1 and len(r1) == 2
    assert {"dcp/__0_0.distcp", "rng_rank00000.pt", "dcp/.metadata", "engine.json", "state.json"} == set(r0)
    manifest = ranks[0]["manifest_ranks"]
    assert manifest["dcp/__1_0.distcp"] == manifest["rng_rank00001.pt"] == 1
    assert manifest["dcp/__0_0.distcp"] == manifest["dcp/.metadata"] == 0
    assert ranks[0]["world_size"] == 2


def test_resume_hashes_each_file_once_across_ranks_and_is_bit_identical(ranks):
    hashed = [set(r["resume_hashed"]) for r in ranks]
    assert ranks[0]["resume_step"] == ranks[1]["resume_step"] == 2
    assert hashed[0] and hashed[1] and not hashed[0] & hashed[1]  # each file once, the work split
    assert len(ranks[0]["resume_hashed"]) == len(hashed[0]) and len(ranks[1]["resume_hashed"]) == len(hashed[1])
    assert hashed[0] | hashed[1] == set(ranks[0]["manifest_ranks"])  # every file of the manifest
    assert ranks[0]["bit_identical"] and ranks[1]["bit_identical"]
    assert ranks[0]["resume_optimizer_steps"] == ranks[1]["resume_optimizer_steps"] == 2  # the EMA rule's count


def test_the_sharded_ema_is_flow_grpos_over_the_warmup_and_the_interval(ranks):
    for r in ranks:  # 20 steps, every 3 with the warm-up, 2 moves an update: tests/train/test_ema.py in 1 process
        assert r["ema_rule_close"], r["ema_rule_maxdiff"]
        assert r["ema_rule_behind"] > 1e-2  # an average behind the weights: far beyond the tolerance


def test_a_corrupted_shard_fails_every_rank_with_the_same_error(ranks):
    a, b = ranks[0]["corrupt"], ranks[1]["corrupt"]
    assert a["type"] == b["type"] == "CheckpointError", (a, b)
    assert a["message"] == b["message"]
    assert ranks[0]["victim"] in a["message"] and "sha256 mismatch" in a["message"] and "step_00000003" in a["message"]
    # rank 0 found nothing itself: it learnt of rank 1's problem from the gather (a timeout would be another error)
    assert ranks[0]["victim"] in ranks[1]["resume_hashed"] and ranks[0]["victim"] not in ranks[0]["resume_hashed"]
    assert ranks[0]["fallback_step"] == ranks[1]["fallback_step"] == 2  # auto: the previous checkpoint


def test_a_truncated_shard_fails_every_rank_before_any_hashing(ranks):
    a, b = ranks[0]["truncated"], ranks[1]["truncated"]
    assert a["type"] == b["type"] == "CheckpointError" and a["message"] == b["message"]
    assert "truncated" in a["message"] and "more problem" not in a["message"]  # both saw it: one problem
    assert ranks[0]["truncated_hashed"] == ranks[1]["truncated_hashed"] == 0


def test_a_planted_pickle_fails_every_rank_with_the_same_error_and_never_runs(ranks):
    a, b = ranks[0]["planted"], ranks[1]["planted"]
    assert not ranks[0]["planted_ran"] and not ranks[1]["planted_ran"]
    assert a["type"] == b["type"] == "CheckpointError" and a["message"] == b["message"], (a, b)
    assert "rng_rank00001.pt" in a["message"] and "refused" in a["message"] and "posix.system" in a["message"]


def test_a_write_failing_on_one_rank_fails_every_rank(ranks):
    a, b = ranks[0]["write_fails"], ranks[1]["write_fails"]
    assert a["type"] == b["type"] == "CheckpointError" and a["message"] == b["message"]
    assert "rank 1: OSError: simulated full disk" in a["message"]
    assert not ranks[0]["published_9"]
