"""The newer diffusers model families under FSDP2 on 2 processes (gloo, torchrun) train like 1 process: the tiny
Qwen-Image, FLUX.2 [klein] and Z-Image pipelines through `jagg-train`, their text encoders (Qwen2.5-VL, Qwen3)
sharded for inference on the 2-process side (model.shard_text_encoder). Float order is where they may differ: the
tolerances are test_distributed.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_runs import fit_metrics, launch_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# step 0: the same rows, noise and weights; after an update the weights differ by the gradient reduction's order
TOLERANCE = {"reward_mean": 1e-4, "grad_norm": 1e-2, "loss": 5e-2, "ratio_mean": 1e-5}


def run(config: str, nproc: int, out: Path, *overrides: str) -> list[dict]:
    return launch_metrics([config, *overrides], nproc, out)


@pytest.mark.parametrize("kind, resolution", [("qwenimage", 16), ("flux2", 32), ("zimage", 16)])
def test_two_processes_with_a_sharded_text_encoder_match_one_process(kind, resolution, request, tmp_path):
    pipe = request.getfixturevalue(f"{kind}_dir")
    config = str(ROOT / "configs" / f"{kind}_tiny_cpu.yaml")
    common = [f"model.pretrained={pipe}", f"model.resolution={resolution}", "train.steps=2", "log.progress=false",
              "run.checkpoint_every=0"]
    one = fit_metrics(config, common, tmp_path / "one", timing=True)
    two = run(config, 2, tmp_path / "two", *common, "parallel.engine=fsdp2", "model.shard_text_encoder=true")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1]
    for a, b in zip(two, one):
        assert a["backward_passes"] == b["backward_passes"] and a["windows_jagg"] == b["windows_jagg"] > 0
        for key, rel in TOLERANCE.items():
            tol = (1e-3, 1e-7) if key == "reward_mean" and a["step"] > 0 else (rel, 1e-7)
            assert a[key] == pytest.approx(b[key], rel=tol[0], abs=tol[1]), (a["step"], key, a[key], b[key])
