"""Conditioning structures: a tensor, or a (nested) tuple/list/dict of tensors with the batch in dim 0.

Dependency-free (torch only), so the algorithm packages (`jagg/`, `grpo/`) can batch conditioning without
loading any model code. A JAGG joint pass of n x B rows repeats the conditioning along dim 0 (`repeat_cond`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

Cond = Any  # torch.Tensor | tuple | list | dict of tensors, batch in dim 0


def map_cond(fn, cond: Cond) -> Cond:
    """Apply `fn` to every tensor of a (nested) conditioning structure."""
    if isinstance(cond, torch.Tensor):
        return fn(cond)
    if isinstance(cond, dict):
        return {k: map_cond(fn, v) for k, v in cond.items()}
    if isinstance(cond, (tuple, list)):
        return type(cond)(map_cond(fn, v) for v in cond)
    if cond is None:
        return None
    raise TypeError(f"conditioning must be a tensor or a tuple/list/dict of tensors, got {type(cond).__name__}")


def cat_cond(conds: Sequence[Cond]) -> Cond:
    """Concatenate conditioning structures of the same layout along dim 0."""
    first = conds[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(conds), dim=0)
    if isinstance(first, dict):
        return {k: cat_cond([c[k] for c in conds]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(cat_cond([c[i] for c in conds]) for i in range(len(first)))
    if first is None:
        return None
    raise TypeError(f"conditioning must be a tensor or a tuple/list/dict of tensors, got {type(first).__name__}")


def repeat_cond(cond: Cond, times: int) -> Cond:
    """torch.cat([c] * times) on every tensor: the conditioning of a joint batch of `times` x B rows."""
    return cond if times == 1 else cat_cond([cond] * times)


def index_cond(cond: Cond, index) -> Cond:
    """Select rows (an index tensor or slice) of every tensor of the conditioning."""
    return map_cond(lambda t: t[index], cond)
