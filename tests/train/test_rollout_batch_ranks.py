"""sampling.chunk_size auto agreed across ranks (train/policy.agreed_rollout_batch): two gloo processes whose GPUs
differ resolve different chunks from their own memory, and both run the smaller, logged once. Resolved per rank,
they would run different numbers of rollout chunks, and every chunk runs collectives (the sharded transformer's
gathers, a sharded reward's), which would stop matching."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from extras import need
from hang_guard import RUN_S

need("diffusers")  # the estimator's shapes are diffusers classes on the meta device
need("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist_workers" / "rollout_batch_worker.py"


def test_two_ranks_given_different_memory_both_take_the_smaller_chunk(tmp_path):
    from jagg_scale.parallel.ranks import free_port

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for _ in range(3):  # the free port can be taken between probing and binding
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(WORKER), str(tmp_path)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_S)
        if "EADDRINUSE" not in proc.stderr + proc.stdout:
            break
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    local = [r["local"] for r in ranks]
    assert local[0] > local[1] >= 1  # the 80 GB rank alone would take a larger chunk than the 40 GB one
    assert [r["agreed"] for r in ranks] == [local[1], local[1]]
    line = f"sampling.chunk_size auto: {local[1]} rows per rollout forward on every rank"
    assert (proc.stdout + proc.stderr).count(line) == 1  # logged once, by rank 0
