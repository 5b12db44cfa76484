"""A checkpoint's trained weights into a plain, unsharded model: no engine, no optimizer, no process group.

    load_trained_weights(model, checkpoint_dir, ema=False)

What `jagg-eval` uses: evaluating a run (or someone else's) reads model weights only. The checkpoint's engine
marker (engine.ENGINE_MARKER; `state.json`'s "backend" in older checkpoints) names the engine that wrote it:

    none       model.safetensors / ema.safetensors (safetensors: no pickle)
    fsdp2      the DCP directory's "model" / "ema" entries, read without a process group and resharded to full
               tensors; names written through an activation-checkpointing wrapper are mapped back
    deepspeed  the fp32 weights reassembled from the ZeRO-3 partitions (deepspeed.utils.zero_to_fp32); the EMA
               from the per-rank EMA partitions (ema_rank<r>.safetensors, deepspeed_engine.py), reassembled
               the same way. DeepSpeed's own files are torch pickles, which zero_to_fp32 unpickles without
               restriction: each is checked first to load weights-only (checkpoint/pickles.py)

No file is unpickled beyond data (tensors, numbers, containers): DCP's metadata and entries go through
checkpoint/dcp_reader.py, and nothing here reads optimizer state (but DeepSpeed's fp32 weights, which live in its
optimizer-state files).

Only the trainable weights are in a LoRA checkpoint; the frozen base comes from the model as built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["load_trained_weights"]

_WRAPPER = "_checkpoint_wrapped_module."


def _checkpoint_error(msg: str) -> Exception:
    from ..checkpoint import CheckpointError

    return CheckpointError(msg)


def load_trained_weights(model: torch.nn.Module, directory: str | Path, *, ema: bool = False) -> list[str]:
    """Copy the checkpoint's trainable weights (its EMA of them when `ema`) into `model`; returns the names set.
    Raises CheckpointError naming the directory when the weights do not fit the model."""
    from .engine import ENGINE_MARKER

    directory = Path(directory)
    marker, state = directory / ENGINE_MARKER, directory / "state.json"
    if marker.is_file():
        backend = json.loads(marker.read_text()).get("engine", "none")
    else:
        backend = json.loads(state.read_text()).get("backend", "none") if state.is_file() else "none"
    readers = {"none": _read_local, "fsdp2": _read_dcp, "deepspeed": _read_deepspeed}
    if backend not in readers:
        raise _checkpoint_error(f"checkpoint {directory} was written by an unknown engine {backend!r}")
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    weights = readers[backend](directory, model, trainable, ema)
    unexpected = sorted(set(weights) - set(params))
    missing = sorted(trainable - set(weights))
    if unexpected or missing:
        raise _checkpoint_error(f"checkpoint {directory} does not fit the model: unexpected {unexpected[:5]}, "
                                f"missing {missing[:5]}")
    for name, value in weights.items():
        if value.shape != params[name].shape:
            raise _checkpoint_error(f"checkpoint {directory} does not fit the model: {name} has shape "
                                    f"{tuple(value.shape)} there, {tuple(params[name].shape)} in the model")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
    return sorted(weights)


def _read_local(directory: Path, model, trainable: set[str], ema: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = directory / ("ema.safetensors" if ema else "model.safetensors")
    if not path.is_file():
        raise _checkpoint_error(f"checkpoint {directory} has no {path.name}")
    weights = load_file(str(path))
    return {k: v for k, v in weights.items() if k in trainable or ema}


def _read_dcp(directory: Path, model, trainable: set[str], ema: bool) -> dict[str, torch.Tensor]:
    from ..checkpoint.dcp_reader import dcp_load, read_metadata

    path = directory / "dcp"
    section = "ema" if ema else "model"
    saved = read_metadata(path).state_dict_metadata
    names = {key[len(section) + 1:]: key for key in saved if key.startswith(section + ".")}
    if not names:
        raise _checkpoint_error(f"checkpoint {directory} holds no {section!r} weights")
    params = dict(model.named_parameters())
    plain = {saved_name.replace(_WRAPPER, ""): saved_name for saved_name in names}
    if not set(plain) <= set(params):
        raise _checkpoint_error(f"checkpoint {directory} does not fit the model: unexpected "
                                f"{sorted(set(plain) - set(params))[:5]}")
    shapes = {name: saved[f"{section}.{plain[name]}"].size for name in plain}
    wanted = {name: torch.empty(shape, dtype=params[name].dtype) for name, shape in shapes.items()}
    request = {section: {plain[name]: tensor for name, tensor in wanted.items()}}
    dcp_load(request, path, no_dist=True)
    return wanted


def _read_deepspeed(directory: Path, model, trainable: set[str], ema: bool) -> dict[str, torch.Tensor]:
    from deepspeed.utils import zero_to_fp32 as z

    from ..checkpoint.pickles import check_file

    ds_dir = directory / "ds"
    # zero_to_fp32 unpickles DeepSpeed's files without restriction: each is first checked to load weights-only
    # (tensors, plain data, DeepSpeed's own few records), so nothing in them can run
    for f in sorted(ds_dir.glob("*.pt")):
        check_file(f, f.relative_to(directory).as_posix())
    if not ema:
        weights = z.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag="ds")
        return {k: v for k, v in weights.items() if k in trainable}
    from safetensors.torch import load_file

    files = sorted(directory.glob("ema_rank*.safetensors"))
    if not files:
        raise _checkpoint_error(f"checkpoint {directory} has no EMA partitions (ema_rank*.safetensors)")
    parts = [load_file(str(f)) for f in files]
    groups = [[part[f"partition.{i}"] for i in range(len(part))] for part in parts]
    model_states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
    weights = z.to_torch_tensor(z._get_fp32_state_dict_from_zero3_checkpoint(len(groups), groups, model_states,
                                                                             exclude_frozen_parameters=True))
    return {k: v for k, v in weights.items() if k in trainable}
