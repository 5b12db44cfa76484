"""A checkpoint's tensors against the live tensors they are about to replace (every engine's load and jagg-eval's)."""

from __future__ import annotations

from typing import Mapping

import torch

from .errors import CheckpointError


def check_fits(directory, what: str, saved: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor], *,
               required: set[str] | None = None, also: torch.dtype | None = None) -> None:
    """CheckpointError unless the saved tensors are the live ones by name (each a live tensor; every one of
    `required`, default all of `live`, present) and each has its live tensor's shape (no broadcast) and dtype (or
    `also`), is floating point and finite, naming the tensor: checked before anything is copied, so that wrong
    weights never load silently (a (1,)-shaped EMA broadcast over (768,), int32 weights cast, NaN weights
    evaluated)."""
    unexpected = sorted(set(saved) - set(live))
    missing = sorted((set(live) if required is None else set(required)) - set(saved))
    if unexpected or missing:
        raise CheckpointError(f"checkpoint {directory}: {what} does not fit the model: unexpected {unexpected[:5]}, "
                              f"missing {missing[:5]}")
    for name, value in saved.items():
        target = live[name]
        problem = None
        if tuple(value.shape) != tuple(target.shape):
            problem = f"has shape {tuple(value.shape)}, the model's is {tuple(target.shape)}"
        elif not value.dtype.is_floating_point or value.dtype not in (target.dtype, also):
            problem = f"has dtype {value.dtype}, the model's is {target.dtype}"
        elif not bool(torch.isfinite(value).all()):
            problem = "has NaN or inf values"
        if problem:
            raise CheckpointError(f"checkpoint {directory}: {what}: tensor {name!r} {problem}")
