"""Tests for the single-process checkpoint format: round trip, integrity checks, resume fallback, pruning,
RNG capture and crash safety (the properties a preempted GRPO run relies on)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import jagg_scale.checkpoint.local as local
from jagg_scale.checkpoint import (
    CheckpointError,
    capture_rng_state,
    list_checkpoints,
    newest_valid_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)


def _trained_linear(seed: int = 0) -> tuple[nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save(root, step, value: float = 0.0, **kw):
    return save_checkpoint(
        root, step, tensors={"model": {"w": torch.full((16,), value)}}, objects={"extra": {"v": value}},
        state={"step": step}, **kw,
    )


def test_round_trip_is_bit_identical_and_training_continues_identically(tmp_path):
    model, opt = _trained_linear()
    state = {"step": 7, "sampler": {"epoch": 1, "index": 42}}
    path = save_checkpoint(tmp_path, 7, tensors={"model": model.state_dict()},
                           objects={"optimizer": opt.state_dict()}, state=state)
    assert path == tmp_path / "step_00000007"

    ckpt = load_checkpoint(path)
    assert ckpt.step == 7 and ckpt.state == state and ckpt.path == path
    for k, v in model.state_dict().items():
        assert ckpt.tensors["model"][k].dtype == v.dtype and torch.equal(ckpt.tensors["model"][k], v)
    saved_opt = ckpt.objects["optimizer"]["state"]
    for i, s in opt.state_dict()["state"].items():
        assert torch.equal(saved_opt[i]["exp_avg"], s["exp_avg"])
        assert torch.equal(saved_opt[i]["exp_avg_sq"], s["exp_avg_sq"])
        assert torch.equal(saved_opt[i]["step"], s["step"])

    # A restored copy must take exactly the same next step as the original.
    model2 = nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2.load_state_dict(ckpt.tensors["model"])
    opt2.load_state_dict(ckpt.objects["optimizer"])
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).pow(2).mean().backward()
        o.step()
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)


def test_tied_noncontiguous_and_bf16_tensors_save(tmp_path):
    base = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    sd = {"embed": base, "lm_head": base, "t": base.t(), "view": base[1]}  # shared storage + views
    path = save_checkpoint(tmp_path, 1, tensors={"model": sd}, objects={}, state={})
    loaded = load_checkpoint(path).tensors["model"]
    for k, v in sd.items():
        assert loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], v)


def test_manifest_records_size_and_sha256_of_every_file(tmp_path):
    model, opt = _trained_linear()
    path = save_checkpoint(tmp_path, 3, tensors={"model": model.state_dict()},
                           objects={"optimizer": opt.state_dict()}, state={"step": 3})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json", "COMPLETE"}
    assert set(manifest["files"]) == on_disk == {"model.safetensors", "optimizer.pt", "state.json"}
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert (path / "COMPLETE").read_text().strip() == hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    verify_checkpoint(path)


def test_a_run_directory_relative_to_the_working_directory_saves_and_verifies(tmp_path, monkeypatch):
    """make run writes into runs/digits_cpu, a relative path: the writers' reported files were once read against
    the temp dir a second time (runs/.../runs/...) and the first save of the CPU default job failed."""
    monkeypatch.chdir(tmp_path)
    path = _save(Path("runs") / "job" / "checkpoints", 20, keep_last=2)
    assert path == tmp_path / "runs" / "job" / "checkpoints" / "step_00000020"
    verify_checkpoint(path)
    assert newest_valid_checkpoint(Path("runs") / "job" / "checkpoints")[0] is not None


def test_truncated_tensor_file_fails_verify_and_resume_falls_back(tmp_path, caplog):
    first, second = _save(tmp_path, 1, 1.0), _save(tmp_path, 2, 2.0)
    f = second / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])

    with pytest.raises(CheckpointError, match="model.safetensors") as err:
        verify_checkpoint(second)
    assert str(second) in str(err.value) and "truncated" in str(err.value)
    with pytest.raises(CheckpointError):
        load_checkpoint(second)

    with caplog.at_level(logging.WARNING, logger=local.__name__):
        assert newest_valid_checkpoint(tmp_path)[0] == first
    assert "step_00000002" in caplog.text and "model.safetensors" in caplog.text
    assert torch.equal(load_checkpoint(first).tensors["model"]["w"], torch.full((16,), 1.0))


def test_same_size_corruption_is_caught_by_sha256(tmp_path):
    path = _save(tmp_path, 1)
    f = path / "extra.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"extra\.pt sha256 mismatch"):
        verify_checkpoint(path)


def test_missing_file_and_tampered_or_missing_manifest_are_reported(tmp_path):
    a, b = _save(tmp_path, 1), _save(tmp_path, 2)
    (a / "state.json").unlink()
    with pytest.raises(CheckpointError, match="missing file state.json"):
        verify_checkpoint(a)
    manifest = b / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 2 '))  # edited after COMPLETE
    with pytest.raises(CheckpointError, match="manifest.json sha256 does not match the COMPLETE marker"):
        verify_checkpoint(b)
    manifest.unlink()
    with pytest.raises(CheckpointError, match="missing manifest.json"):
        verify_checkpoint(b)


def test_dir_without_complete_marker_is_skipped(tmp_path, caplog):
    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    (second / "COMPLETE").unlink()
    (tmp_path / "step_00000003").mkdir()  # e.g. created by hand or by a foreign tool
    with pytest.raises(CheckpointError, match="missing COMPLETE marker"):
        verify_checkpoint(second)
    with caplog.at_level(logging.WARNING, logger=local.__name__):
        assert newest_valid_checkpoint(tmp_path)[0] == first
    assert "step_00000002" in caplog.text and "step_00000003" in caplog.text


def test_list_checkpoints_sorts_by_step_and_ignores_other_entries(tmp_path):
    for step in (10, 2, 100):
        _save(tmp_path, step)
    (tmp_path / "notes").mkdir()
    (tmp_path / "step_abc").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000010", "step_00000100"]
    assert list_checkpoints(tmp_path / "missing") == [] and newest_valid_checkpoint(tmp_path / "missing")[0] is None


def test_keep_last_keeps_newest_and_never_the_one_just_written(tmp_path):
    for step in range(1, 5):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]

    # Replaying an older step after a rollback: newest (4) kept, just-written (1) protected, 3 pruned.
    _save(tmp_path, 1, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000004"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]


def test_resave_same_step_replaces_previous(tmp_path):
    _save(tmp_path, 5, 1.0)
    path = _save(tmp_path, 5, 2.0)
    assert torch.equal(load_checkpoint(path).tensors["model"]["w"], torch.full((16,), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000005"]


def test_rng_capture_restore_reproduces_sequences(tmp_path):
    state = capture_rng_state()
    expected = (torch.rand(5), random.random(), np.random.rand(3))
    # Round trip through a checkpoint, then scramble the generators before restoring.
    path = save_checkpoint(tmp_path, 1, tensors={}, objects={"rng": state}, state={})
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    restore_rng_state(load_checkpoint(path).objects["rng"])
    assert torch.equal(torch.rand(5), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.rand(3), expected[2])


@pytest.mark.parametrize("crash_point", ["torch.save", "_write_complete", "os.replace"])
@pytest.mark.parametrize("hard", [False, True], ids=["clean", "hard"])
def test_crash_mid_save_leaves_nothing_complete_looking(tmp_path, monkeypatch, crash_point, hard):
    first = _save(tmp_path, 1, 1.0)

    def boom(*a, **k):
        raise OSError("simulated crash")

    if crash_point == "torch.save":
        monkeypatch.setattr(local.torch, "save", boom)
    elif crash_point == "os.replace":
        monkeypatch.setattr(local.os, "replace", boom)
    else:
        monkeypatch.setattr(local, crash_point, boom)
    if hard:  # a kill -9 runs no cleanup: the temp dir stays behind
        monkeypatch.setattr(local, "_remove_tree", lambda p: None)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, 2, 2.0)
    monkeypatch.undo()

    assert list_checkpoints(tmp_path) == [first]
    assert newest_valid_checkpoint(tmp_path)[0] == first
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]
    assert bool(leftovers) == hard
    assert torch.equal(load_checkpoint(first).tensors["model"]["w"], torch.full((16,), 1.0))

    # The next successful save cleans up whatever the crash left.
    _save(tmp_path, 2, 2.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_crash_while_replacing_existing_step_keeps_the_old_one(tmp_path, monkeypatch):
    path = _save(tmp_path, 1, 1.0)
    real_replace, calls = os.replace, []

    def flaky(src, dst):
        calls.append(src)
        if len(calls) == 2:  # first call moves the old dir aside, second would publish the new one
            raise OSError("simulated crash")
        return real_replace(src, dst)

    monkeypatch.setattr(local.os, "replace", flaky)
    with pytest.raises(OSError):
        _save(tmp_path, 1, 2.0)
    monkeypatch.undo()
    assert newest_valid_checkpoint(tmp_path)[0] == path
    assert torch.equal(load_checkpoint(path).tensors["model"]["w"], torch.full((16,), 1.0))


def test_bad_arguments_fail_before_writing(tmp_path):
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, tensors={}, objects={}, state={"x": object()})
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, 1, tensors={"../evil": {}}, objects={}, state={})
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, 1, tensors={}, objects={}, state={}, keep_last=0)
    assert list(tmp_path.iterdir()) == []


def test_manifest_names_the_rank_that_hashed_each_file_and_each_file_is_hashed_once(tmp_path, monkeypatch):
    from jagg_scale.checkpoint import digests

    hashed = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(hashed) == sorted(manifest["files"]) == ["extra.pt", "model.safetensors", "state.json"]
    assert manifest["world_size"] == 1 and {e["rank"] for e in manifest["files"].values()} == {0}
    hashed.clear()
    verify_checkpoint(path)
    assert sorted(hashed) == sorted(manifest["files"])  # verify: once each too


def test_a_manifest_without_ranks_still_verifies_and_a_newer_format_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())

    def rewrite(m):
        raw = json.dumps(m).encode()
        (path / "manifest.json").write_bytes(raw)
        (path / "COMPLETE").write_text(hashlib.sha256(raw).hexdigest() + "\n")

    old = {k: v for k, v in manifest.items() if k != "world_size"}
    old["files"] = {n: {"bytes": e["bytes"], "sha256": e["sha256"]} for n, e in manifest["files"].items()}
    rewrite(old)  # what checkpoints written before the per-rank digests hold
    verify_checkpoint(path)
    rewrite(dict(manifest, format_version=2))
    with pytest.raises(CheckpointError, match="format_version 2; this code reads up to 1"):
        verify_checkpoint(path)


def test_a_writer_reporting_a_file_it_did_not_write_fails_the_save(tmp_path):
    from jagg_scale.checkpoint.local import save_checkpoint_dir

    with pytest.raises(ValueError, match="reported writing ghost.bin, which is not a file"):
        save_checkpoint_dir(tmp_path, 1, write=lambda tmp: [tmp / "ghost.bin"], state={})
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        save_checkpoint_dir(tmp_path, 1, write=lambda tmp: [tmp.parent / "x"], state={})
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_verify_shares_split_every_file_once_and_balance_the_bytes(world):
    from jagg_scale.checkpoint.digests import share

    sizes = {f"dcp/__{i}_0.distcp": 1000 + i for i in range(8)} | {"state.json": 10, ".metadata": 50}
    parts = [share(sizes, r, world) for r in range(world)]
    assert sorted(n for p in parts for n in p) == sorted(sizes)
    loads = [sum(sizes[n] for n in p) for p in parts]
    assert max(loads) - min(loads) <= max(sizes.values())
