"""The rollout replica holds the policy in the dtypes the trainer pool's engine computes with, parameter by parameter.

A synchronous run samples through its engine's model, so a rollout pool that is to sample the same trajectories
(bit for bit at pools.max_staleness 0) must compute with the same weights as that model's forward sees them:

    engine none      the weights as placed: 16-bit ones upcast to the model's master dtype (a full fine-tune's
                     float32), the rest as held (LoRA's frozen 16-bit base, its float32 adapter); autocast rounds
    engine fsdp2     under a 16-bit model.dtype each block is gathered in it (parallel/fsdp.py's param_dtype: the
                     block's adapter too), the root's own parameters stay as placed; buffers are never cast
    engine deepspeed under a 16-bit model.dtype ZeRO-3 partitions every parameter in it

So a full fine-tune's replica under FSDP2 or DeepSpeed in bf16 holds its blocks in bf16 (FLUX.1: 24 GB, not 48), and
a replica of an FSDP2 run in bf16 no longer samples with float32 blocks where the trainer's rollout had bf16 ones.
Trainer 0 sends each trainable parameter in the same dtype (trainer_link.py): the rounding happens once, on the sender,
and the digests are of what the replica computes with."""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.blocks import block_slots
from ..parallel.engine import HALF, place_, placed_dtype

__all__ = ["compute_dtypes", "place_replica"]


def compute_dtypes(model: nn.Module, engine: str, compute: torch.dtype) -> dict[str, torch.dtype]:
    """{parameter name: the dtype the trainer pool's forward computes with} for `model` (placed or not, wrapped by
    FSDP2 or not: names and block lists are the same), its engine's name and model.dtype's torch dtype."""
    master = getattr(model, "master_dtype", None)
    placed = {n: placed_dtype(p.dtype, master) for n, p in model.named_parameters()}
    if compute not in HALF or engine == "none":
        return placed
    if engine == "deepspeed":
        return {n: compute if d.is_floating_point else d for n, d in placed.items()}
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = [names[id(blocks[i])] + "." for blocks, i in block_slots(model)]
    return {n: compute if d.is_floating_point and n.startswith(tuple(prefixes)) else d for n, d in placed.items()}


def place_replica(model: nn.Module, device: torch.device, engine: str, compute: torch.dtype) -> nn.Module:
    """`model` placed on `device` in compute_dtypes's dtypes, one tensor at a time (place_)."""
    dtypes = compute_dtypes(model, engine, compute)
    return place_(model, device, getattr(model, "master_dtype", None),
                  dtypes={id(p): dtypes[n] for n, p in model.named_parameters()})
