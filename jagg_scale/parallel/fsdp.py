"""FSDP2: the model sharded with `fully_shard`, one parallelize step per model (as torchtitan does).

    parallelize(model)   activation checkpointing per block (optional), fully_shard on every transformer block,
                         then on the root; mixed precision (bf16 params in compute, fp32 gradient reduction);
                         explicit prefetch: block i gathers block i+1 in forward and block i-1 in backward;
                         `reshard_after_forward` configurable; HSDP (replicate x shard mesh) when
                         parallel.replicate > 1.

Communication and JAGG: every forward of a block all-gathers its parameters (and, with resharding after
forward, the backward gathers them again); every synchronised backward reduce-scatters its gradients.
Gradients are synchronised only at the accumulation boundary (the last backward of a minibatch, see
`accumulate`), so a minibatch pays one reduce-scatter per block whatever its window plan, and the all-gather
cycles are one per joint JAGG pass against W per exact window. `CommCounter` (comm.py) measures exactly that.

Checkpoints are torch.distributed.checkpoint (DCP) directories: each rank writes its shards, and a checkpoint
written by N ranks loads on M (DCP reshards on load).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .dist import DistContext
from .engine import TrainEngine, make_optimizer

log = logging.getLogger(__name__)

__all__ = ["FSDP2Engine", "parallelize", "transformer_blocks"]


def transformer_blocks(model: torch.nn.Module) -> list[tuple[torch.nn.ModuleList, int]]:
    """(list, index) of every transformer block: the FSDP units. The built-in DiT keeps them in `blocks`,
    diffusers' SD3 in `transformer.transformer_blocks`, FLUX in those and `transformer.single_transformer_blocks`."""
    found = []
    owners = [model, getattr(model, "transformer", None)]
    for owner in owners:
        if owner is None:
            continue
        for attr in ("blocks", "transformer_blocks", "single_transformer_blocks"):
            blocks = getattr(owner, attr, None)
            if isinstance(blocks, torch.nn.ModuleList):
                found += [(blocks, i) for i in range(len(blocks))]
    if not found:
        raise ValueError(f"parallel.backend fsdp2: no transformer blocks found on {type(model).__name__}")
    return found


def _mesh(dist_ctx: DistContext, replicate: int):
    device_type = dist_ctx.device.type
    world = dist_ctx.world_size
    if replicate < 1 or world % replicate:
        raise ValueError(f"parallel.replicate={replicate} must divide the world size {world}")
    if replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def parallelize(model: torch.nn.Module, pcfg, mesh, *, bf16: bool, activation_checkpointing: bool) -> torch.nn.Module:
    """Shard `model` in place (blocks, then root) and return it."""
    if activation_checkpointing:
        if hasattr(model, "enable_gradient_checkpointing"):  # diffusers' own per-block checkpointing
            model.enable_gradient_checkpointing()
        else:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for blocks, i in transformer_blocks(model):
                blocks[i] = checkpoint_wrapper(blocks[i])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=pcfg.reshard_after_forward)
    units = []
    for blocks, i in transformer_blocks(model):
        fully_shard(blocks[i], **kwargs)
        units.append(blocks[i])
    fully_shard(model, **kwargs)
    if pcfg.prefetch:
        for prev, nxt in zip(units, units[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model


class FSDP2Engine(TrainEngine):
    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, cfg, dist_ctx: DistContext):
        dist_ctx.ensure_group()  # one process: a trivial group (closed with the context)
        self.cfg, self.dist = cfg, dist_ctx
        self.mesh = _mesh(dist_ctx, cfg.parallel.replicate)
        self.bf16 = cfg.model.dtype == "bfloat16"
        self.lora = cfg.model.lora.enabled
        self.model = parallelize(model, cfg.parallel, self.mesh, bf16=self.bf16,
                                 activation_checkpointing=cfg.parallel.activation_checkpointing)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, cfg.train)
        self.init_ema()
        self._options = StateDictOptions(ignore_frozen_params=self.lora)

    def shard_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy (the KL reference of a full fine-tune) sharded the same way, without an optimizer."""
        return parallelize(module, self.cfg.parallel, self.mesh, bf16=self.bf16, activation_checkpointing=False)

    # ------------------------------------------------------------------ one minibatch
    @contextmanager
    def accumulate(self, last: bool):
        self.model.set_requires_gradient_sync(last)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def clip_grad_norm(self) -> float:
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    # ------------------------------------------------------------------ state
    def save(self, directory: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options)
        state = {"model": model_sd, "optimizer": optim_sd, **({"ema": self.ema} if self.ema is not None else {})}
        dcp.save(state, checkpoint_id=str(directory / "dcp"))

    def load(self, directory: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options)
        state = {"model": model_sd, "optimizer": optim_sd, **({"ema": self.ema} if self.ema is not None else {})}
        dcp.load(state, checkpoint_id=str(directory / "dcp"))  # in place, the EMA shards included
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=self._options)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable weights as full CPU tensors on rank 0 (collective; other ranks get {})."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora)
        return get_model_state_dict(self.model, options=options)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return self.full_state_dict()


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)
