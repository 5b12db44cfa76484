"""A checkpoint runs none of its writer's code when it loads (issue 16 item 1; checkpoint/pickles.py).

The attack: a pickle whose __reduce__ calls os.system, planted in a checkpoint file, the manifest and the COMPLETE
marker recomputed (the sha256 manifest stops accidents, not whoever can write the directory). Planted in every
pickle a checkpoint holds (optimizer state, RNG state, DCP's metadata, its per-rank fallback metadata, a DCP
non-tensor entry, DeepSpeed's partition files), it must never run: not on run.resume=auto, not on a resume by
path, not on jagg-eval, not when an engine loads the directory unverified; and the error names the file."""

from __future__ import annotations

import os
import pickle
import random
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from jagg_scale.checkpoint import (CheckpointError, UnsafeCheckpointError, capture_rng_state, restore_rng_state,
                                   verify_checkpoint)
from jagg_scale.checkpoint.pickles import allowed_globals, check_file, load_dcp_metadata, load_torch
from jagg_scale.cli import eval_main
from jagg_scale.models import build_model
from jagg_scale.parallel.weights import load_trained_weights
from jagg_scale.train import Trainer, load_config
from extras import need
from tamper import reseal

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=4", "log.progress=false", "run.checkpoint_every=0", "train.steps=1", "jagg.window=2",
         "eval.prompts=[a red apple]", "eval.num_per_prompt=1"]
STEP = "checkpoints/step_00000001"


class Payload:
    """Unpickled by the general unpickler, it creates `marker`: the proof that a checkpoint ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def refusal(marker: Path, action, kind: type = CheckpointError) -> str:
    """The message of the `kind` error `action` raises; before anything else, the payload must not have run."""
    try:
        action()
    except BaseException as err:
        assert not marker.exists(), f"the checkpoint ran code (and then: {type(err).__name__}: {err})"
        if not isinstance(err, kind):
            raise
        return str(err)
    assert not marker.exists(), "the checkpoint ran code"
    pytest.fail(f"not refused: no {kind.__name__}")


def plant_in_torch_file(ckpt: Path, name: str, marker: Path) -> None:
    """The file's own content, plus the payload (a DeepSpeed file needs DeepSpeed's classes to be read)."""
    obj = load_torch(ckpt / name, allow=allowed_globals(name))
    obj["payload"] = Payload(marker)
    torch.save(obj, ckpt / name)


def plant_in_metadata(ckpt: Path, name: str, marker: Path) -> None:
    if name != "dcp/.metadata":  # DCP falls back to a rank's own metadata when the global one cannot be read
        (ckpt / "dcp" / ".metadata").unlink()
    (ckpt / name).write_bytes(pickle.dumps(Payload(marker)))


def plant_in_dcp_entry(ckpt: Path, name: str, marker: Path) -> None:
    """DCP stores a non-tensor entry (the optimizer's lr) as a torch.save of its own: the payload replaces it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = ckpt.parent / "whole.pt"
    dcp_to_torch_save(ckpt / "dcp", whole)  # our own untampered checkpoint: fine to read it fully here
    state = torch.load(whole, weights_only=False)
    state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
    shutil.rmtree(ckpt / "dcp")
    dcp.save(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    whole.unlink()


PLANTS = {
    ("none", "optimizer.pt"): plant_in_torch_file,
    ("none", "rng_rank00000.pt"): plant_in_torch_file,
    ("fsdp2", "dcp/.metadata"): plant_in_metadata,
    ("fsdp2", "dcp/__0.metadata"): plant_in_metadata,
    ("fsdp2", "dcp/__0_0.distcp"): plant_in_dcp_entry,
}


def overrides(backend: str, out: Path, *extra: str) -> list[str]:
    return [*SMALL, f"parallel.engine={backend}", f"run.output_dir={out}", *extra]


def trainer(backend: str, out: Path, *extra: str) -> Trainer:
    t = Trainer(load_config(TINY, overrides(backend, out, *extra)))
    t.dist.close()  # one process: the trivial group of a sharding engine (only an engine load follows)
    return t


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One trained step per engine, checkpointed; each test tampers with a copy."""
    out = {}
    for backend in ("none", "fsdp2"):
        run = tmp_path_factory.mktemp(backend) / "run"
        t = Trainer(load_config(TINY, overrides(backend, run)))
        try:
            t.fit()
        finally:
            t.dist.close()
        out[backend] = run
    return out


@pytest.fixture(params=sorted(PLANTS), ids=lambda k: f"{k[0]}:{k[1]}")
def tampered(request, runs, tmp_path):
    backend, name = request.param
    run = tmp_path / "run"
    shutil.copytree(runs[backend], run)
    marker = tmp_path / "PWNED"
    PLANTS[request.param](run / STEP, name, marker)
    reseal(run / STEP)
    return backend, name, run, marker


def test_resume_auto_refuses_a_planted_pickle_without_running_it(tampered):
    backend, name, run, marker = tampered
    err = refusal(marker, lambda: trainer(backend, run, "run.resume=auto", "train.steps=2"))
    assert "none valid" in err and "step_00000001" in err and name.split("/")[-1] in err


def test_resume_by_path_refuses_a_planted_pickle_without_running_it(tampered):
    backend, name, run, marker = tampered
    err = refusal(marker, lambda: trainer(backend, run, f"run.resume={run / STEP}", "train.steps=2"))
    assert "refused" in err and name.split("/")[-1] in err


def test_jagg_eval_refuses_a_planted_pickle_without_running_it(tampered, capsys):
    backend, name, run, marker = tampered
    rc = eval_main([TINY, *overrides(backend, run), "--checkpoint", str(run / STEP), "--output", str(run / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert not marker.exists(), "the checkpoint ran code"
    assert rc == 2 and len(err) == 1 and "refused" in err[0] and name.split("/")[-1] in err[0]  # one line, exit 2
    # given the run directory, jagg-eval looks for a valid checkpoint, finds none, and says why
    assert eval_main([TINY, *overrides(backend, run), "--checkpoint", str(run), "--output", str(run / "e")]) == 2
    assert not marker.exists()


def test_an_engine_loading_an_unverified_directory_runs_nothing(tampered, tmp_path):
    """The loaders are safe on their own: verification is not what stands between a pickle and its code."""
    backend, name, run, marker = tampered
    if name.startswith("rng_"):
        pytest.skip("RNG state is read by the resume alone, after verification")
    t = trainer(backend, tmp_path / "other")
    err = refusal(marker, lambda: t.engine.load(run / STEP), UnsafeCheckpointError)
    assert "refused" in err and str(run / STEP) in err


@pytest.mark.dist  # DeepSpeed's JIT-compiled op on first use
def test_deepspeed_partitions_are_read_weights_only(tmp_path, capsys):
    need("deepspeed")
    run, marker = tmp_path / "run", tmp_path / "PWNED"
    t = Trainer(load_config(TINY, overrides("deepspeed", run)))
    try:
        t.fit()
        ckpt = run / STEP
        pristine = tmp_path / "pristine"
        shutil.copytree(ckpt, pristine)
        t.engine.load(pristine)  # an untampered DeepSpeed checkpoint loads weights-only (its two classes admitted)
        for i, name in enumerate(sorted(p.relative_to(ckpt).as_posix() for p in (ckpt / "ds").glob("*.pt"))):
            shutil.rmtree(ckpt)
            shutil.copytree(pristine, ckpt)
            plant_in_torch_file(ckpt, name, marker)
            reseal(ckpt)
            # unverified: DeepSpeed's own reader, made weights-only
            assert Path(name).name in refusal(marker, lambda: t.engine.load(ckpt), UnsafeCheckpointError)
            assert Path(name).name in refusal(marker, lambda: verify_checkpoint(ckpt))
            if i == 0:  # jagg-eval, end to end (it reads through the engine's reader checked above for every file)
                rc = eval_main([TINY, *overrides("deepspeed", run), "--checkpoint", str(ckpt), "--output",
                                str(tmp_path)])
                err = capsys.readouterr().err.strip().splitlines()
                assert not marker.exists() and rc == 2 and Path(name).name in err[-1]  # one line, exit 2
            # jagg-eval's reader, unverified
            assert Path(name).name in refusal(marker, lambda: load_trained_weights(build_model(t.cfg.model), ckpt),
                                              UnsafeCheckpointError)
    finally:
        t.dist.close()


# ------------------------------------------------------------------------------------------ the readers themselves


def test_rng_state_is_tensors_and_numbers_and_older_rng_files_still_restore(tmp_path):
    state = capture_rng_state()
    torch.save(state, tmp_path / "new.pt")
    torch.load(tmp_path / "new.pt", weights_only=True)  # nothing beyond tensors and numbers
    expected = (torch.rand(3), random.random(), np.random.rand(2))
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    restore_rng_state(load_torch(tmp_path / "new.pt"))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.array_equal(np.random.rand(2), expected[2])
    # the form checkpoints had before: python and numpy states as tuples (a numpy array inside)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, tmp_path / "rng_rank00000.pt")
    expected = np.random.rand(2)
    np.random.seed(2)
    check_file(tmp_path / "rng_rank00000.pt", "rng_rank00000.pt")
    restore_rng_state(load_torch(tmp_path / "rng_rank00000.pt", allow=allowed_globals("rng_rank00000.pt")))
    assert np.array_equal(np.random.rand(2), expected)
    with pytest.raises(UnsafeCheckpointError, match="optimizer.pt"):  # numpy arrays: RNG files only
        shutil.copy(tmp_path / "rng_rank00000.pt", tmp_path / "optimizer.pt")
        check_file(tmp_path / "optimizer.pt", "optimizer.pt")


# a name the allowlist's module holds but does not admit: torch's metadata module imports os, and protocol 4 resolves
# dotted names, so "os.system" there is os.system
SNEAKY = b"\x80\x04ctorch.distributed.checkpoint.metadata\nos.system\n(S'true'\ntR."


@pytest.mark.parametrize("data,refused", [
    (pickle.dumps(__import__("collections").Counter(a=1)), "collections.Counter"),
    (SNEAKY, "os.system"),
    (pickle.dumps({"not": "metadata"}), "not DCP metadata"),
], ids=["counter", "module-attribute", "dict"])
def test_dcp_metadata_admits_its_own_classes_only(tmp_path, data, refused):
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=refused):
        load_dcp_metadata(path)
