"""A checkpoint someone else tampered with cannot reach outside its directory, load wrong weights, or resume at the
wrong step (issue 26 items 2, defects 3, 6, 7 and the deep manifest of 10).

Each case tampers with the newest checkpoint (step 2) of a real two-step run (one process, an EMA), re-sealing the
manifest as a tamperer would; run.resume=auto must then fall back to step 1, a resume by path and jagg-eval must
refuse with one line naming what is wrong, and nothing outside the checkpoint may be read.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jagg_scale.checkpoint import CheckpointError, checkpoint_dir, digests, verify_checkpoint
from jagg_scale.cli import eval_main
from jagg_scale.train import Trainer, load_config
from tamper import reseal

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=4", "log.progress=false", "run.checkpoint_every=1", "jagg.window=2",
         "train.ema_decay=0.9", "eval.prompts=[a red apple]", "eval.num_per_prompt=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("hostile") / "run"
    t = Trainer(load_config(TINY, [*SMALL, f"run.output_dir={run}", "train.steps=2"]))
    try:
        t.fit()
    finally:
        t.close()
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy, symlinks=True)
    return copy


def step(run: Path, n: int) -> Path:
    return checkpoint_dir(run / "checkpoints", n)


def resumed_step(run: Path) -> int:
    """run.resume=auto on the tampered run: the step it starts from (the newest checkpoint that can be resumed)."""
    t = Trainer(load_config(TINY, [*SMALL, f"run.output_dir={run}", "train.steps=3", "run.resume=auto"]))
    try:
        return t.start_step
    finally:
        t.close()


def eval_refusal(run: Path, capsys, *extra: str) -> str:
    """jagg-eval --checkpoint on the tampered step: exit 2 and one line on stderr."""
    rc = eval_main([TINY, *SMALL, *extra, f"run.output_dir={run}", "--checkpoint", str(step(run, 2)),
                    "--output", str(run.parent / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, (rc, err)
    return err[0]


def rewrite_tensors(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_a_weight_file_linked_outside_is_refused_unread(run, tmp_path, monkeypatch, capsys):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(step(run, 2) / "model.safetensors", outside)
    (step(run, 2) / "model.safetensors").unlink()
    (step(run, 2) / "model.safetensors").symlink_to(outside)
    reseal(step(run, 2))
    hashed = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: hashed.append(Path(p)) or real(p))
    with pytest.raises(CheckpointError, match="symbolic link"):
        verify_checkpoint(step(run, 2))
    assert not hashed  # refused before any file of it is read
    assert "model.safetensors" in eval_refusal(run, capsys)
    assert resumed_step(run) == 1


def test_a_linked_state_file_falls_back_instead_of_crashing(run, tmp_path):
    outside = tmp_path / "system_file"
    outside.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (step(run, 2) / "state.json").unlink()
    (step(run, 2) / "state.json").symlink_to(outside)
    reseal(step(run, 2))
    assert resumed_step(run) == 1


def test_a_checkpoint_directory_that_is_a_link_is_refused(run, tmp_path, capsys):
    moved = tmp_path / "moved_step"
    shutil.move(step(run, 2), moved)
    step(run, 2).symlink_to(moved, target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link"):
        verify_checkpoint(step(run, 2))
    assert "symbolic link" in eval_refusal(run, capsys)
    assert resumed_step(run) == 1


@pytest.mark.parametrize("case", ["ema_shape", "int32", "float16", "nan", "ema_nan"])
def test_wrong_weights_are_refused_naming_the_tensor(run, case, capsys):
    file = step(run, 2) / ("ema.safetensors" if case.startswith("ema") else "model.safetensors")
    name = sorted(load_file(str(file)))[0]

    def change(tensors):
        t = tensors[name]
        tensors[name] = {"ema_shape": lambda: t.flatten()[:1].clone(), "int32": lambda: t.to(torch.int32),
                         "float16": lambda: t.to(torch.float16),
                         "nan": lambda: torch.full_like(t, float("nan")),
                         "ema_nan": lambda: torch.full_like(t, float("nan"))}[case]()

    rewrite_tensors(file, change)
    reseal(step(run, 2))
    expected = {"ema_shape": "has shape", "int32": "has dtype torch.int32", "float16": "has dtype torch.float16",
                "nan": "NaN", "ema_nan": "NaN"}[case]
    # the resume by path refuses, naming the tensor
    t = None
    with pytest.raises(CheckpointError) as err:
        t = Trainer(load_config(TINY, [*SMALL, f"run.output_dir={run}", "train.steps=3",
                                       f"run.resume={step(run, 2)}"]))
    if t is not None:
        t.close()
    assert name in str(err.value) and expected in str(err.value)
    # jagg-eval reads the EMA with ema_decay > 0, the model's weights without
    line = eval_refusal(run, capsys, *([] if case.startswith("ema") else ["train.ema_decay=0"]))
    assert "step_00000002" in line and name in line and expected in line
    assert resumed_step(run) == 1


def test_a_state_whose_step_is_not_its_directory_is_refused(run, capsys):
    state = json.loads((step(run, 2) / "state.json").read_text())
    (step(run, 2) / "state.json").write_text(json.dumps({**state, "step": 1}))
    reseal(step(run, 2))
    with pytest.raises(CheckpointError, match="state.json says step 1"):
        verify_checkpoint(step(run, 2))
    assert resumed_step(run) == 1  # not "at step 1" from the step-2 directory: from the real step 1


def test_a_deep_manifest_is_refused_and_resume_falls_back(run, capsys):
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    (step(run, 2) / "manifest.json").write_bytes(deep)
    (step(run, 2) / "COMPLETE").write_text(hashlib.sha256(deep).hexdigest() + "\n")
    with pytest.raises(CheckpointError, match="unreadable manifest.json"):
        verify_checkpoint(step(run, 2))
    assert "manifest.json" in eval_refusal(run, capsys)
    assert resumed_step(run) == 1


def test_an_oversized_state_file_is_not_read_whole(run, monkeypatch):
    from jagg_scale.checkpoint import local

    state = json.loads((step(run, 2) / "state.json").read_text())
    (step(run, 2) / "state.json").write_text(json.dumps({**state, "padding": "x" * 100_000}))
    reseal(step(run, 2))
    limit = (step(run, 2) / "manifest.json").stat().st_size + 1  # the manifest is read; the padded state is not
    monkeypatch.setattr(local, "MAX_SMALL_FILE", limit)
    with pytest.raises(CheckpointError, match=rf"state.json is \d+ bytes \(at most {limit} are read"):
        verify_checkpoint(step(run, 2))
