"""A checkpoint's trained weights into a plain, unsharded model: no engine, no optimizer, no process group.

    load_trained_weights(model, checkpoint_dir, ema=False)

What `jagg-eval` uses: evaluating a run (or someone else's) reads model weights only. The checkpoint's engine
marker (engine.ENGINE_MARKER) names the engine that wrote it, and that engine's `read_weights` reads its own format
(engine.py, fsdp.py, deepspeed_engine.py). No file is unpickled beyond data (tensors, numbers, containers).

Only the trainable weights are in a LoRA checkpoint; the frozen base comes from the model as built.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.fits import check_fits
from .build import engine_class
from .engine import checkpoint_engine

__all__ = ["load_trained_weights"]


def load_trained_weights(model: torch.nn.Module, directory: str | Path, *, ema: bool = False) -> list[str]:
    """Copy the checkpoint's trainable weights (its EMA of them when `ema`) into `model`; returns the names set.
    Raises CheckpointError naming the directory when the weights do not fit the model."""
    from ..checkpoint import CheckpointError

    directory = Path(directory)
    name = checkpoint_engine(directory)
    try:
        reader = engine_class(name)
    except ValueError:
        raise CheckpointError(f"checkpoint {directory} was written by an unknown engine {name!r}") from None
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    weights = reader.read_weights(directory, model, trainable, ema)
    # the model here may hold a published bf16 transformer (jagg-eval): float32 (what every engine writes) also fits
    check_fits(directory, "the trained weights", weights, params, required=trainable, also=torch.float32)
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
    return sorted(weights)
