"""Sequence parallelism (parallel.sequence_parallel: N): the tokens of every transformer pass split over N ranks.

A video row (Wan2.1 at 480p: 32k tokens) or a 1024 px+ image does not fit one GPU's activations, and JAGG's joint
pass holds two endpoints per row. With N-way sequence parallelism the ranks of an sp group hold the same rows and
each runs 1/N of every pass's tokens; the attention sees the whole sequence through Ulysses all-to-alls (heads
<-> sequence), and the transformer's output is gathered back, so everything outside the transformer (the SDE, JAGG,
the loss, the rewards) runs unchanged and identically on the group's ranks.

Implementation: diffusers' own context parallelism (`ContextParallelConfig(ulysses_degree=N)`, the model's
`_cp_plan`: which inputs split on which dim, where the output gathers), maintained with the transformers it plans
(FLUX.1, Wan, Qwen-Image, ...) and dispatching to the attention kernels those use. Chosen over yunchang (what xDiT and
FastVideo use) because it needs no patching of each family's attention processor, and over PyTorch's
context_parallel API because that one shards SDPA calls but not a diffusers model's inputs and outputs. A family
whose transformer has no `_cp_plan` (SD3's MMDiT in diffusers 0.42) is refused, naming the key.

Layout (`data_rank`): world = D x N; ranks r = d N + s (d the data rank, s the sequence rank); the rows of a step
are dealt by data rank (train/rows.py), so an sp group samples, scores and trains the same rows. The gathered
output's backward hands each rank the gradient of its own tokens, so each rank's parameter gradients are its tokens'
share and their sum over the group is the full gradient: FSDP2 (over all ranks) reduce-scatters with the divide
factor D, not D N (engine), making the step the data-parallel mean over the D groups, as on D ranks without it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["apply_sequence_parallel", "data_rank", "data_world"]


def data_world(world_size: int, sp: int) -> int:
    return world_size // sp


def data_rank(rank: int, sp: int) -> int:
    return rank // sp


def apply_sequence_parallel(transformer: nn.Module, sp: int, rank: int, world_size: int,
                            device: torch.device) -> nn.Module:
    """Ulysses context parallelism of degree `sp` on a diffusers transformer, in place (before FSDP2 wraps it)."""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    name = type(transformer).__name__
    if getattr(transformer, "_cp_plan", None) is None:
        raise ValueError(f"config key 'parallel.sequence_parallel' {sp}: {name} has no context-parallel plan in "
                         "diffusers (its _cp_plan), so its sequence cannot be split; use 1")
    heads = getattr(transformer.config, "num_attention_heads", None)
    if heads is not None and heads % sp:
        raise ValueError(f"config key 'parallel.sequence_parallel' {sp} must divide {name}'s {heads} attention heads "
                         "(Ulysses gives each rank whole heads)")
    mesh = init_device_mesh(device.type, (world_size // sp, 1, sp), mesh_dim_names=("data", "ring", "ulysses"))
    cp_mesh = mesh["ring", "ulysses"]

    def resolve(config):
        # diffusers' own resolver takes the device as rank % the accelerator count, which fails where there is none
        # (CPU, gloo): the same resolution with this run's device and mesh
        config = ParallelConfig(context_parallel_config=config) if isinstance(config, ContextParallelConfig) else config
        config.setup(rank, world_size, device, mesh=cp_mesh)
        transformer._parallel_config = config
        return config

    transformer._resolve_parallel_config = resolve
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp, mesh=cp_mesh))
    return transformer
