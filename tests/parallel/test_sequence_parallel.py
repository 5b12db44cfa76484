"""Sequence parallelism (parallel.sequence_parallel, parallel/sequence.py) on CPU with gloo: jagg-train on 2 and 4
processes with groups of 2 ranks splitting every pass's tokens (diffusers' Ulysses context parallelism) trains
as 1 process does - a video model (tiny Wan2.1, on 4 ranks with HSDP: 2 replicas) and an image model (tiny SD3,
with an evaluation) - and a checkpoint written with sp = 2 resumes with sp = 1. Step 0 (the same rows, noise and
weights) must agree to 1e-5; after an update the weights differ by the gradient reduction's float order, as between
any two world sizes (test_distributed.py's tolerances)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hang_guard import RUN_S
from once import once
from train_runs import fit_metrics, launch_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEP0 = {"reward_mean": 1e-5, "grad_norm": 1e-5, "ratio_mean": 1e-6}
LATER = {"reward_mean": 1e-3, "grad_norm": 1e-2, "ratio_mean": 1e-5}
CONFIGS = {"wan": "wan_tiny_cpu.yaml", "flux": "flux_tiny_cpu.yaml", "sd3": "sd3_tiny_cpu.yaml",
           "qwenimage": "qwenimage_tiny_cpu.yaml"}


def run(kind: str, pipe: Path, nproc: int, out: Path, *overrides: str) -> list[dict]:
    """jagg-train on `nproc` processes; nproc 1 is the reference, fitted in this process (train_runs.fit_metrics)."""
    args = [str(ROOT / "configs" / CONFIGS[kind]), f"model.pretrained={pipe}", "log.progress=false",
            "eval.enabled=false", *overrides]
    return fit_metrics(args[0], args[1:], out, timing=True) if nproc == 1 else launch_metrics(args, nproc, out)


def close(a: dict, b: dict) -> None:
    for key, rel in (STEP0 if a["step"] == 0 else LATER).items():
        assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-8), (a["step"], key, a[key], b[key])


SP = ["parallel.engine=fsdp2", "parallel.sequence_parallel=2"]


@pytest.fixture(scope="module")
def wan_sp2(wan_dir, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Tiny Wan2.1, 2 steps with sp = 2 on 2 ranks, a checkpoint after each: the sp run two tests compare."""
    d, rows = once(tmp_path_factory, "wan_sp2",
                   lambda d: run("wan", wan_dir, 2, d / "run", "train.steps=2", "run.checkpoint_every=1", *SP))
    return d / "run", rows


@pytest.fixture(scope="module")
def wan_one(wan_dir, tmp_path_factory) -> list[dict]:
    """Tiny Wan2.1's 2 steps in one process: the reference of both Wan splits (sp 2; sp 2 with HSDP on 4 ranks)."""
    return once(tmp_path_factory, "wan_one", lambda d: run("wan", wan_dir, 1, d / "one", *COMMON))[1]


def _trains_as_one_process(split: list[dict], one: list[dict], nproc: int) -> None:
    assert [r["step"] for r in split] == [r["step"] for r in one] == [0, 1]
    for a, b in zip(split, one):
        assert a["backward_passes"] == b["backward_passes"] and a["windows_jagg"] == b["windows_jagg"] > 0
        # every row decoded and scored once: by one rank of its group (the metric is the mean over ranks)
        assert a["reward_rows"] * nproc == b["reward_rows"] > 0
        close(a, b)


COMMON = ["train.steps=2", "run.checkpoint_every=0"]


# the base model's evaluation, 3 prompts x 3 images in batches of 2 (each split over a group's 2 ranks)
EVAL = ["eval.enabled=true", "eval.at_start=true", "eval.every=0", "eval.prompts=[a red apple, a dog, a blue car]",
        "eval.num_per_prompt=3", "eval.chunk_size=2", "eval.grid_images=5"]


@pytest.mark.parametrize("kind, nproc, extra, layout", [
    ("wan", 4, [], ["parallel.replicate=2"]),  # with HSDP: 2 replicas of 2 shards, each shard group one sp group
    # this stack's own plan; a full fine-tune: its KL reference copy split too; and the evaluation
    ("sd3", 2, ["grpo.kl_beta=0.04", *EVAL], []),
])
def test_groups_of_two_ranks_splitting_the_tokens_train_as_one_process(kind, nproc, extra, layout, request, tmp_path):
    import json

    pipe = request.getfixturevalue(f"{kind}_dir")
    one = request.getfixturevalue("wan_one") if kind == "wan" and not extra else \
        run(kind, pipe, 1, tmp_path / "one", *COMMON, *extra)
    _trains_as_one_process(run(kind, pipe, nproc, tmp_path / "split", *COMMON, *extra, *SP, *layout), one, nproc)
    if extra[-1:] == EVAL[-1:]:  # the images each rank of a group scored, gathered: the one-process evaluation's
        a, b = (json.loads((tmp_path / d / "eval" / "step_00000000" / "eval.json").read_text())
                for d in ("split", "one"))
        assert a["num_images"] == b["num_images"] == 9 and a["num_failed"] == 0
        for pa, pb in zip(a["per_prompt"], b["per_prompt"]):
            assert pa["scores"] == pytest.approx(pb["scores"], rel=1e-5)
            assert pa["diversity"] == pytest.approx(pb["diversity"], rel=1e-4)
        grid = tmp_path / "split" / "eval" / "step_00000000"
        assert (grid / "grid.png").is_file() and not (grid / "grid_parts").exists()  # streamed through, removed


def test_two_ranks_splitting_wans_tokens_train_as_one_process(wan_sp2, wan_one):
    """The module's sp = 2 run (its checkpoints change no metric) against one process."""
    _trains_as_one_process(wan_sp2[1], wan_one, 2)


def test_a_checkpoint_written_with_sp2_resumes_with_sp1(wan_dir, wan_sp2, tmp_path):
    """A step with sp = 2 on 2 ranks, a checkpoint, the second step with sp = 1 on the same 2 ranks (FSDP2 shards
    over every rank either way): the metrics of an uninterrupted sp = 2 run, within the reduction-order tolerance.
    The sp = 2 run's directory as it stood after its first step: its step-1 checkpoint and metrics row."""
    import json
    import shutil

    whole_out, whole = wan_sp2
    split = tmp_path / "split"
    shutil.copytree(whole_out / "checkpoints" / "step_00000001", split / "checkpoints" / "step_00000001")
    (split / "metrics.jsonl").write_text(json.dumps(whole[0]) + "\n")
    resumed = run("wan", wan_dir, 2, split, "train.steps=2", "run.checkpoint_every=1",
                  "run.resume=auto", "parallel.engine=fsdp2")
    assert [r["step"] for r in resumed] == [0, 1]
    for a, b in zip(resumed, whole):
        close(a, b)


def test_a_family_without_a_context_parallel_plan_or_enough_heads_is_refused_by_key(zimage_dir, wan_dir):
    """Refused before any collective: Z-Image's transformer has no _cp_plan in diffusers (SD3's is this stack's own,
    parallel/sequence.py); Ulysses needs whole heads per rank."""
    import torch

    from jagg_scale.models.wan import WanVelocity
    from jagg_scale.models.zimage import ZImageVelocity
    from jagg_scale.parallel.sequence import apply_sequence_parallel

    zimage = ZImageVelocity.from_pretrained(zimage_dir, resolution=16).transformer
    with pytest.raises(ValueError, match="sequence_parallel' 2: ZImageTransformer2DModel has no context-parallel"):
        apply_sequence_parallel(zimage, 2, 0, 2, torch.device("cpu"))
    wan = WanVelocity.from_pretrained(wan_dir, resolution=16, num_frames=5).transformer
    with pytest.raises(ValueError, match="'parallel.sequence_parallel' 4 must divide WanTransformer3DModel's 2"):
        apply_sequence_parallel(wan, 4, 0, 4, torch.device("cpu"))


def test_a_sequence_sp_does_not_divide_is_refused_naming_the_key_and_the_tokens(sd3_dir, tmp_path):
    """SD3.5's 77 CLIP + T5 tokens: with an odd T5 length the text does not split over 2 ranks; the run stops with
    a one-line error naming the key and the tokens (exit 2), not deep inside diffusers' split."""
    import subprocess

    from train_runs import BIN
    from jagg_scale.parallel.ranks import free_port, launcher_env

    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(BIN / "jagg-train"),
           str(ROOT / "configs" / CONFIGS["sd3"]), f"model.pretrained={sd3_dir}", "model.max_sequence_length=31",
           "parallel.engine=fsdp2", "parallel.sequence_parallel=2", f"run.output_dir={tmp_path / 'run'}",
           "train.steps=1", "log.progress=false"]
    proc = subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode != 0
    assert "config key 'parallel.sequence_parallel' 2 must divide the 63 tokens of" in proc.stderr


def test_the_even_split_check_reaches_the_blocks_a_plan_names_by_wildcard(qwenimage_dir):
    """Qwen-Image's plan names its blocks "transformer_blocks.*" (its start failed on the wildcard once): the check
    hooks every block and nothing inside one (a block hands its attention the mask diffusers split: checking it there
    refused 42 prompt tokens over 2 ranks as 21), and a prompt of 63 tokens is refused over 2 ranks naming the key,
    before any collective (the adapter pads it to 64 once parallelism is enabled: models/qwenimage.py)."""
    import torch

    from jagg_scale.models.qwenimage import QwenImageVelocity
    from jagg_scale.parallel.sequence import _check_even_splits

    model = QwenImageVelocity.from_pretrained(qwenimage_dir, resolution=16, max_sequence_length=63)
    t = model.transformer
    _check_even_splits(t, t._cp_plan, 2)
    assert all(len(b._forward_pre_hooks) >= 1 for b in t.transformer_blocks)  # block 0 named twice: 2
    assert not any(m._forward_pre_hooks for b in t.transformer_blocks for m in b.modules() if m is not b)
    with pytest.raises(ValueError, match="'parallel.sequence_parallel' 2 must divide the 63 tokens of transformer_bl"):
        model(torch.randn(1, *model.latent_shape), torch.tensor([0.5]), model.encode_prompts(["a cat " * 20]))
