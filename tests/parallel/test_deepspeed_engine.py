"""The DeepSpeed ZeRO-3 engine (jagg_scale/parallel/deepspeed_engine.py) on CPU: 2 processes with gloo launched by
torchrun, one launch shared by every check (tests/dist_workers/deepspeed_worker.py says what each one does),
against the single-process reference LocalEngine."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import RUN_S
from once import once

# dist and slow: one torchrun launch shared by the module (~50 s where DeepSpeed's shm_comm extension is compiled on
# first use; `make setup-extras` builds it with the install) and the single-process DeepSpeed check (~6 s)
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not importable (pip install deepspeed)"),
              pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist_workers" / "deepspeed_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for _ in range(3):  # the free port can be taken between probing and binding
        proc = subprocess.run(args(_free_port()), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=RUN_S)  # a hang guard only (tests/hang_guard.py)
        if "EADDRINUSE" not in proc.stderr + proc.stdout:
            break
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return once(tmp_path_factory, "deepspeed_engine", lambda out: _run(
        lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                      str(port), str(WORKER), str(out)], out))[1]


def test_jagg_and_exact_backward_accumulate_into_one_step(result):
    assert result["accumulate"], f"max |w_ds - w_ref| = {result['accumulate_maxdiff']}"
    assert result["sensitive"]  # the step differs from one on the last backward alone
    assert result["grad_norm"], result["norms"]
    assert result["three_steps"]


def test_backward_last_marks_the_accumulation_boundary(result):
    assert result["boundary"], result["boundary_seen"]


def test_resume_is_bit_identical(result):
    assert result["resume_load"]
    assert result["resume"]
    assert any(f.startswith("ds/") and f.endswith("optim_states.pt") for f in result["checkpoint_files"])


def test_save_returns_the_files_each_rank_wrote(result):
    """What each rank hashes for the manifest: its model-states and optimizer partition, its EMA partition; rank 0
    also the engine marker. DeepSpeed's recovery scripts (rank 0, unreported) are left to rank 0's sweep."""
    r0, r1 = (set(files) for files in result["written_by_rank"])
    assert not r0 & r1
    for rank, files in ((0, r0), (1, r1)):
        assert f"ds/zero_pp_rank_{rank}_mp_rank_00_model_states.pt" in files
        assert f"ds/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in files
        assert f"ema_rank{rank:05d}.safetensors" in files
    assert r0 - r1 == r0 and "engine.json" in r0 and len(r0) == 4 and len(r1) == 3
    unreported = set(result["checkpoint_files"]) - r0 - r1
    assert all(f.endswith(".py") for f in unreported), unreported


def test_ema_of_the_partitions_exports_resumes_and_restores(result):
    assert result["ema"]  # the EMA export is the single-process engine's EMA
    assert result["ema_restored"]  # leaving ema_weights() puts the live weights back bit for bit
    assert result["ema_resume"]  # checkpointed per rank, resumed bit for bit
    assert result["ema_persistent"], result["ema_persistent_maxdiff"]  # persistent parameters too; training goes on
    assert result["ema_files"] == ["ema_rank00000.safetensors", "ema_rank00001.safetensors"]


def test_full_state_dict_on_rank0(result):
    assert result["export_keys"]
    assert result["rank1_empty"]  # rank 1 gets {} from every full_state_dict(), rank 0 does not
    assert result["accumulate"]  # the exported weights are the reference's


def test_engine_attributes_bf16_offload_and_bare_module(result):
    assert result["attributes"]
    assert result["bf16"]
    assert result["offload"]
    assert result["module_forward"]


def test_reference_is_an_inference_engine_holding_one_world_th_per_rank(result):
    """shard_frozen: the frozen KL reference partitioned over the 2 ranks (each holds ~half its bytes, padding of
    at most one element per tensor aside), like the policy engine, with the unsharded copy's forward."""
    assert result["reference"]
    b = result["reference_bytes"]
    pad = 4 * b["tensors"]  # fp32: at most one padding element per tensor and rank
    for per_rank in (b["per_rank"], b["policy_per_rank"]):
        assert len(per_rank) == 2 and sum(per_rank) >= b["full"]
        assert all(abs(r - b["full"] / 2) <= pad for r in per_rank), (per_rank, b["full"])


def test_single_process(tmp_path):
    res = _run(lambda port: [sys.executable, str(WORKER), str(tmp_path), "--single"], tmp_path)
    assert res["single"]
    assert res["nonfinite_skipped"] and res["nonfinite_refused"]  # issue 16: ZeRO-3's own skip, save's check
    assert res["zero2_resume"]
    # model.dtype float16: DeepSpeed's fp16 partitions and dynamic loss scale (loss_scale.DS_FP16), the search's skip
    assert res["fp16_partitions"] and res["fp16_scale"] and res["fp16_applied"]
    assert res["fp16_overflow"] and res["fp16_resume"] and res["fp16_floor"]
