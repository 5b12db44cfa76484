"""Conditioning structures: a tensor, a `Tokens`, or a (nested) tuple/list/dict of them with the batch in dim 0.

Dependency-free (torch only), so the algorithm packages (`jagg/`, `grpo/`) can batch conditioning without
loading any model code. A JAGG joint pass of n x B rows repeats the conditioning along dim 0 (`repeat_cond`).

`Tokens` holds prompts of different lengths (Qwen-Image's Qwen2.5-VL embeddings, Z-Image's Qwen3 ones) as one batch
cut to its longest prompt: every operation here that makes a new batch of rows (index, cat, repeat, expand) keeps
it so, from each row's length known on the host since encoding, so a pass carries no all-padding column and
sizing it reads nothing back from the device. Rows are therefore selected with a host index (a slice or a CPU
index tensor), which reaches the device asynchronously (`to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

Cond = Any  # torch.Tensor | Tokens | tuple | list | dict of them, batch in dim 0


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host synchronisation: pinned and copied asynchronously on CUDA (the
    caching host allocator keeps the pinned buffer alive until the copy has run)."""
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, eq=False)
class Tokens:
    """Prompts of different lengths as one batch: `embeds` [B, L, D] and `mask` [B, L] (1 on row i's first
    lengths[i] tokens, 0 after) on the device, `lengths` on the host, and L = max(lengths): the batch's longest
    prompt, so no column is padding in every row."""

    embeds: torch.Tensor
    mask: torch.Tensor
    lengths: tuple[int, ...]

    def __post_init__(self):
        n, length = self.embeds.shape[:2]
        if self.mask.shape != (n, length) or len(self.lengths) != n or length != max(self.lengths, default=0):
            raise ValueError(f"Tokens: embeds {tuple(self.embeds.shape)}, mask {tuple(self.mask.shape)} and "
                             f"{len(self.lengths)} lengths (longest {max(self.lengths, default=0)}) do not agree")

    @classmethod
    def padded(cls, embeds: torch.Tensor, mask: torch.Tensor, lengths: Sequence[int]) -> "Tokens":
        """From a batch padded past its longest prompt (zeros, mask 0): the extra columns cut off (a view)."""
        length = max(lengths, default=0)
        return cls(embeds[:, :length], mask[:, :length], tuple(int(n) for n in lengths))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def full(self) -> bool:
        """Every row as long as the longest: the mask masks nothing (QwenImagePipeline then passes none)."""
        return min(self.lengths, default=0) == max(self.lengths, default=0)

    def rows(self, index) -> "Tokens":
        """The rows `index` (a slice or a host index tensor) cut to their own longest prompt."""
        if isinstance(index, slice):
            lengths = self.lengths[index]
            device_index = index
        else:
            if index.device.type != "cpu":
                raise TypeError("Tokens rows are selected with a host index (a slice or a CPU tensor): their lengths "
                                "live on the host; a device index would have to be read back")
            lengths = tuple(self.lengths[i] for i in index.tolist())
            device_index = to_device(index, self.embeds.device)
        length = max(lengths, default=0)
        return Tokens(self.embeds[device_index, :length], self.mask[device_index, :length], lengths)

    def to_length(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds, mask) zero-padded to `length` >= L columns (mask 0 there)."""
        pad = length - self.embeds.shape[1]
        if pad == 0:
            return self.embeds, self.mask
        return F.pad(self.embeds, (0, 0, 0, pad)), F.pad(self.mask, (0, pad))

    @staticmethod
    def cat(parts: Sequence["Tokens"]) -> "Tokens":
        """Rows of every part, padded to the longest prompt among them."""
        length = max(max(p.lengths, default=0) for p in parts)
        embeds, masks = zip(*(p.to_length(length) for p in parts))
        return Tokens(torch.cat(embeds), torch.cat(masks), sum((p.lengths for p in parts), ()))

    def expand(self, n: int) -> "Tokens":
        """A one-row batch as n rows (views, no copy): the negative prompt of classifier-free guidance."""
        if len(self) != 1:
            raise ValueError(f"Tokens.expand: a one-row batch expands, not {len(self)} rows")
        return Tokens(self.embeds.expand(n, -1, -1), self.mask.expand(n, -1), self.lengths * n)


def map_cond(fn, cond: Cond) -> Cond:
    """Apply `fn` to every tensor of a (nested) conditioning structure; `fn` keeps the rows and columns (a dtype or
    device change): a Tokens' lengths are kept."""
    if isinstance(cond, torch.Tensor):
        return fn(cond)
    if isinstance(cond, Tokens):
        return Tokens(fn(cond.embeds), fn(cond.mask), cond.lengths)
    if isinstance(cond, dict):
        return {k: map_cond(fn, v) for k, v in cond.items()}
    if isinstance(cond, (tuple, list)):
        return type(cond)(map_cond(fn, v) for v in cond)
    if cond is None:
        return None
    raise TypeError(f"conditioning must be a tensor, Tokens or a tuple/list/dict of them, got {type(cond).__name__}")


def cat_cond(conds: Sequence[Cond]) -> Cond:
    """Concatenate conditioning structures of the same layout along dim 0 (Tokens padded to their longest)."""
    first = conds[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(conds), dim=0)
    if isinstance(first, Tokens):
        return Tokens.cat(conds)
    if isinstance(first, dict):
        return {k: cat_cond([c[k] for c in conds]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(cat_cond([c[i] for c in conds]) for i in range(len(first)))
    if first is None:
        return None
    raise TypeError(f"conditioning must be a tensor, Tokens or a tuple/list/dict of them, got {type(first).__name__}")


def repeat_cond(cond: Cond, times: int) -> Cond:
    """torch.cat([c] * times) on every tensor: the conditioning of a joint batch of `times` x B rows."""
    return cond if times == 1 else cat_cond([cond] * times)


def expand_cond(cond: Cond, n: int) -> Cond:
    """A one-row conditioning as n rows, as views (no copy)."""
    if isinstance(cond, Tokens):
        return cond.expand(n)
    if isinstance(cond, dict):
        return {k: expand_cond(v, n) for k, v in cond.items()}
    if isinstance(cond, (tuple, list)):
        return type(cond)(expand_cond(v, n) for v in cond)
    return map_cond(lambda t: t.expand(n, *t.shape[1:]), cond)


def index_cond(cond: Cond, index) -> Cond:
    """Select rows of every tensor of the conditioning: `index` a slice or a host (CPU) index tensor, copied to each
    device once, asynchronously; a Tokens is cut to its selected rows' longest prompt. (A device index tensor still
    selects plain tensors on its device; a Tokens refuses it.)"""
    if isinstance(index, slice) or index.device.type != "cpu":
        return _index(cond, index, None)
    return _index(cond, index, {})


def _index(cond: Cond, index, on_device: dict | None) -> Cond:
    if isinstance(cond, Tokens):
        return cond.rows(index)
    if isinstance(cond, torch.Tensor):
        if on_device is None or cond.device.type == "cpu":
            return cond[index]
        if cond.device not in on_device:
            on_device[cond.device] = to_device(index, cond.device)
        return cond[on_device[cond.device]]
    if isinstance(cond, dict):
        return {k: _index(v, index, on_device) for k, v in cond.items()}
    if isinstance(cond, (tuple, list)):
        return type(cond)(_index(v, index, on_device) for v in cond)
    if cond is None:
        return None
    raise TypeError(f"conditioning must be a tensor, Tokens or a tuple/list/dict of them, got {type(cond).__name__}")
