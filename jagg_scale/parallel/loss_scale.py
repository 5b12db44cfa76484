"""Dynamic loss scaling: fp16 mixed precision (model.dtype float16) on every engine.

In float16 a gradient below 6e-8 (the smallest subnormal) flushes to zero and one above 65504 overflows. So every
backward is seeded with its gradient times a loss scale S, the gradients are divided by S again (unscaled) before
the clip and the optimizer step, and S is searched as Flow-GRPO's accelerate (`config/base.py:21`
mixed_precision fp16, `scripts/train_sd3.py:933` accelerator.backward) and DiffusionNFT's GradScaler
(`scripts/train_nft_sd3.py:390, 984-1003`) search it, with torch's defaults: 2^16 to start, halved after every step
whose scaled gradients overflowed (that step is skipped), doubled after 2000 clean steps in a row. Per engine:

    none       torch.amp.GradScaler
    fsdp2      torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler: its overflow verdict is all-reduced
               over the ranks, so every rank keeps the same scale (its shards' gradients differ)
    deepspeed  DeepSpeed's own dynamic loss scaler (its `fp16` section, `DS_FP16`), set to the same schedule

`Engine.step` (engine.py) unscales before it clips (clip_grad_norm_ must see the true gradients), decides from the
global gradient norm and the loss (one host read, the loss scale read with it), steps the optimizer or not, then
lets the scaler back off or grow. A bf16 or float32 run has no scaler: nothing here runs.

A skipped step is one of two things, and they are counted apart (train/update.py):
    the scale's search    the loss was finite on every rank and the gradients overflowed at a scale above
                          MIN_LOSS_SCALE (1, DeepSpeed's min_loss_scale default): normal at the start of a run and
                          after each growth; counted as `loss_scale_skips`, never towards train.max_nonfinite_steps
                          (a search from 2^16 skips up to 16 steps in a row, more than max_nonfinite_steps' 10)
    non-finite            a non-finite loss (the forward overflowed: no scale cures that), or gradients that overflow
                          even unscaled (scale <= 1): `nonfinite_steps`, and max_nonfinite_steps in a row stop the run
So a gradient that is NaN at any scale costs at most 16 search steps plus max_nonfinite_steps before the run stops.

The scaler's state is checkpointed with the engine's (`loss_scale.json`, rank 0; DeepSpeed keeps its own in its
checkpoint), so a resumed run scales exactly as the uninterrupted one did.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["DS_FP16", "MIN_LOSS_SCALE", "SCALER_FILE", "load_scaler", "make_scaler", "save_scaler", "search_skip"]

MIN_LOSS_SCALE = 1.0
SCALER_FILE = "loss_scale.json"
# DeepSpeed's dynamic scaler on torch GradScaler's schedule: 2^16, halved at each overflow (hysteresis 1: DeepSpeed's
# default 2 skips a step before halving), doubled after 2000 clean steps (its default window is 1000), floored at
# MIN_LOSS_SCALE (DeepSpeed's least: an integer > 0). At the floor DeepSpeed would raise a bare Exception at the next
# overflow; the engine turns that off (deepspeed_engine.py), so an overflow there is a non-finite step as on the other
# engines and train.max_nonfinite_steps stops the run with its own error
DS_FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000, "hysteresis": 1,
           "min_loss_scale": int(MIN_LOSS_SCALE)}


def make_scaler(compute_dtype: torch.dtype, device: torch.device, sharded: bool):
    """The loss scaler of a model computing in `compute_dtype` (None unless float16) on `device`."""
    if compute_dtype != torch.float16:
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def search_skip(applied: bool, loss_finite: bool, scale: float) -> bool:
    """Whether a step was skipped by the loss scale's search (module docstring) rather than as non-finite."""
    return not applied and loss_finite and scale > MIN_LOSS_SCALE


def save_scaler(directory: Path, scaler) -> Path:
    from ..checkpoint.local import write_bytes

    return write_bytes(Path(directory) / SCALER_FILE, json.dumps(scaler.state_dict(), sort_keys=True).encode())


def load_scaler(directory: Path, scaler) -> None:
    """The scaler's state from a checkpoint (CheckpointError when it has none: a checkpoint of a bf16 or float32 run
    resumed under float16 would restart the search, and the resumed run would not be the uninterrupted one)."""
    from ..checkpoint import CheckpointError

    path = Path(directory) / SCALER_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {directory}: no readable {SCALER_FILE} ({err}), but this run scales its "
                              "loss (model.dtype float16): resume it with the model.dtype it was written with") \
            from None
    want = set(scaler.state_dict())
    if not isinstance(state, dict) or set(state) != want:
        held = sorted(state) if isinstance(state, dict) else repr(state)
        raise CheckpointError(f"checkpoint {directory}: {SCALER_FILE} holds {held}, not a loss scaler's state "
                              f"{sorted(want)}")
    scaler.load_state_dict(state)
