"""Sharded reward models (jagg_scale/rewards/sharded.py): 2 processes with gloo on CPU launched by torchrun, one
launch shared by the checks (tests/dist_workers/sharded_reward_worker.py says what each one does): each rank
scores its own photos with a sharded reward and gets exactly the unsharded scores, while holding half the
weights. Plus the single-process parts (layer discovery, the not-initialised error)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch import nn

from hang_guard import RUN_S
from once import once
from jagg_scale.rewards.sharded import repeated_layers, shard_reward
from extras import need

need("transformers")
need("skimage")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist_workers" / "sharded_reward_worker.py"
REWARDS = ("clip_score", "pickscore", "aesthetic", "imagenet_class")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return once(tmp_path_factory, "sharded_reward", _launch)[1]


def _launch(out: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for _ in range(3):  # the free port can be taken between probing and binding
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(WORKER), str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=RUN_S)  # a hang guard only (tests/hang_guard.py)
        if "EADDRINUSE" not in proc.stderr + proc.stdout:
            break
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# the tests that read `ranks` (one 2-process torchrun launch, ~13 s) are dist and slow; the last two are neither
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", REWARDS)
def test_sharded_scores_equal_unsharded(ranks, name):
    for res in ranks:
        r = res[name]
        assert r["close"], f"rank {res['rank']} {name}: max |sharded - unsharded| = {r['maxdiff']}"
        assert len(r["sharded"]) == 3
        assert r["fsdp_units"] >= 3  # the root + its repeated layers, not just the root
    # each rank scored its own (different) photos: not one batch broadcast to both
    assert ranks[0][name]["ref"] != ranks[1][name]["ref"]


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_clip_holds_half_the_weights(ranks):
    for res in ranks:
        lay = res["layout"]
        assert lay["not_dtensor"] == ["logit_scale"] and lay["logit_scale_is_plain"]  # 0-d: replicated
        assert 0.45 < lay["local_frac"] < 0.55, lay  # resharded after the forwards, root included
        assert sorted(lay["fsdp_units"]) == ["", "text_model.encoder.layers.0", "text_model.encoder.layers.1",
                                             "vision_model.encoder.layers.0", "vision_model.encoder.layers.1"]
        assert not lay["requires_grad"] and not lay["training"]
    a, b = (res["layout"] for res in ranks)
    assert a["total_numel"] == b["total_numel"] == a["local_numel"] + b["local_numel"]  # a split, not a copy


@pytest.mark.dist
@pytest.mark.slow
def test_reward_without_torch_modules_is_refused(ranks):
    for res in ranks:
        assert "has no torch_modules()" in res["no_modules"], res["no_modules"]


def test_needs_a_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        shard_reward(object())


def test_repeated_layers_takes_outermost_lists_with_parameters():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.inner = nn.ModuleList([nn.Linear(2, 2)])  # inside a unit: not a unit of its own

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.acts = nn.ModuleList([nn.ReLU(), nn.GELU()])  # no parameters: nothing to shard
            self.head = nn.Linear(2, 1)

    net = Net()
    assert repeated_layers(net) == [net.blocks[0], net.blocks[1]]
    assert repeated_layers(nn.ModuleList([nn.Linear(1, 1)]))[0] is not None
