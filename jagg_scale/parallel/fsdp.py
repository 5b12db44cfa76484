"""FSDP2: models sharded with `fully_shard`, for training (`FSDP2Engine`) and for inference (reward models).

The helpers both uses share:

    block_slots(module)     the FSDP units (blocks.py): every item with parameters of every outermost nn.ModuleList
                            (the DiT's `blocks`, SD3's `transformer_blocks`, FLUX's `transformer_blocks` and
                            `single_transformer_blocks`, a CLIP's text and vision encoder layers)
    build_mesh(...)         the device mesh: 1-D over all ranks, or HSDP (replicate x shard) when replicate > 1
    parallelize(model)      training: per-block activation checkpointing (optional, the model's own: blocks.py),
                            fully_shard on every block,
                            then on the root; mixed precision (the blocks' params gathered in the compute dtype,
                            bf16 or fp16, the root's in fp32, fp32 gradient reduction, inputs left to the caller's
                            autocast; fp16's loss scaler is the engine's ShardedGradScaler, loss_scale.py);
                            explicit prefetch: block i gathers block i+1 in forward and block i-1 in backward;
                            `reshard_after_forward` configurable (as torchtitan does)
                            compile (parallel.compile): every block torch.compile-d first, so that checkpointing
                            and fully_shard wrap compiled blocks (blocks.compile_blocks)
    shard_for_inference(m)  a frozen module (a reward model) sharded the same way in eval mode, no mixed precision,
                            0-d parameters left replicated, other entry points than forward registered

Communication and JAGG: every forward of a block all-gathers its parameters (and, with resharding after
forward, the backward gathers them again); every synchronised backward reduce-scatters its gradients.
When gradients are synchronised is `parallel.grad_sync`: `boundary` only at the accumulation boundary
(`backward(out, grad, last=True)`, the last backward of a minibatch: one reduce-scatter per block per minibatch,
but until then FSDP2 holds every block's gradient unsharded in fp32, the whole model's per rank); `every` at
every backward (a reduce-scatter per backward, gradients always sharded); `auto` picks every for a full
fine-tune and boundary for LoRA. The all-gather cycles are one per joint JAGG pass against W per exact window,
and under `every` the reduce-scatters too. `engine.comm` (comm.py) measures that.

Checkpoints are torch.distributed.checkpoint (DCP) directories: each rank writes its shards (the EMA shards
too) and reports which files those were (`_ListingWriter`), and a checkpoint written by N ranks loads on M (DCP
reshards on load). They are read through checkpoint/dcp_reader.py: DCP's metadata and non-tensor entries are
pickles, which torch's own reader would unpickle without restriction.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from . import meta_load
from .blocks import block_slots, compile_blocks, enable_activation_checkpointing, repeated_layers
from .comm import CommCounter
from .config import ParallelConfig
from .dist import DistContext
from .engine import HALF, Engine, OptimizerSettings, make_optimizer, place_, resolve_grad_sync, trains_all
from .loss_scale import make_scaler

log = logging.getLogger(__name__)

__all__ = ["FSDP2Engine", "block_slots", "build_mesh", "parallelize", "repeated_layers", "shard_for_inference"]


# ------------------------------------------------------------------------------------------ shared helpers


def build_mesh(device_type: str, world_size: int, replicate: int = 1) -> DeviceMesh:
    """1-D mesh over all ranks ("shard"), or (replicate, world / replicate) HSDP ("replicate", "shard")."""
    if replicate < 1 or world_size % replicate:
        raise ValueError(f"parallel.replicate={replicate} must divide the world size {world_size}")
    if replicate == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard"))


def parallelize(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None, activation_checkpointing: bool,
                reshard_after_forward: bool = True, prefetch: bool = True, device: torch.device | None = None,
                master_dtype: torch.dtype | None = None, compile: bool = False) -> nn.Module:
    """Shard `model` in place for training (blocks, then root) and return it.

    `param_dtype`: the blocks' gathered dtype (bf16 / fp16: model.dtype; None: as held, float32).
    `compile` (parallel.compile): each block torch.compile-d in place first (blocks.compile_blocks), so that the
    activation checkpointing and fully_shard applied next wrap compiled blocks. That order is the one both
    checkpointing can have: the model's own checkpointing calls each block from the model's forward, so it always
    wraps the block as it is, and a recompute re-runs the compiled block. FSDP2's hooks on a compiled block run
    outside its graph (dynamo skips FSDP hooks by default).
    The checkpointing is the model's own (blocks.enable_activation_checkpointing): each block's call in the model's
    block loop is checkpointed, so both the names and the units stay those of the plain model.

    Placement: the model may arrive on the host. Unit by unit (each block, then the root's remaining parameters),
    the unit is placed on `device` (upcast from 16 bits to `master_dtype` on the way when given) and sharded right
    away, so the device never holds more than one unsharded unit beside the shards (fully_shard would move the
    unit's full parameters to the mesh's device too; placing it here first makes the upcast happen there)."""
    slots = block_slots(model)
    if not slots:
        raise ValueError(f"parallel.engine fsdp2: no transformer blocks found on {type(model).__name__}")
    if compile:
        compile_blocks(model)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    # bf16 / fp16 is the trainer's autocast (train/policy.py), as on backend none; FSDP2 adds 16-bit gathers of the
    # blocks alone. Its input cast stays off: it would round every floating input of a unit to 16 bits (the root's
    # sigma: timesteps off by up to 2/1000 in bf16; FLUX's float32 rotary embeddings at each block). The root's own
    # parameters (embedders, final layer: under 1% of the weights) stay float32, so what autocast leaves in float32
    # there (token embeddings and their pooling, sigma's path) is computed as backend none computes it.
    blocks_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    root_mp = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    # FLUX.1's single-stream block returns its text and image tokens as two slices of one tensor; FSDP2 warns at
    # every forward that an in-place op on a returned view would drop its pre-backward hook. Nothing does one (the
    # next block concatenates both, the last one's image part enters norm_out, out of place), and copying them
    # would cost a copy of every token per block: the warning says nothing here (tests/parallel/test_fsdp_flux_views
    # trains FLUX under FSDP2 on 2 processes as 1 process does)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w*FluxSingleTransformerBlock\) returned a view",
                            category=UserWarning)
    units = []
    # a skeleton on the meta device (parallel/meta_load.py): cast to the master dtype there, sharded, and filled by
    # the engine afterwards (materialize) instead of placed here
    place = None if meta_load.is_meta(model) else device
    for blocks, i in slots:
        place_(blocks[i], place, master_dtype)
        fully_shard(blocks[i], mp_policy=blocks_mp, **kwargs)
        units.append(blocks[i])
    place_(model, place, master_dtype)  # the root's own parameters (the blocks' are DTensors now: skipped)
    fully_shard(model, mp_policy=root_mp, **kwargs)
    if prefetch:
        for prev, nxt in zip(units, units[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model


def shard_for_inference(module: nn.Module, mesh: DeviceMesh, forward_methods: Iterable[str] = ()) -> nn.Module:
    """fully_shard a frozen `module` in place for inference (layers, then root; eval mode, requires_grad off,
    weights kept in their dtype, resharded after every forward); a module already sharded is left as is.

    0-d parameters (e.g. CLIP's `logit_scale`) are left out of sharding (replicated: they cost nothing and may be
    read outside a forward). `forward_methods` names entry points other than forward (e.g. CLIPModel's
    get_image_features) that get FSDP's pre/post-forward hooks, so the root is gathered around them too."""
    module.eval().requires_grad_(False)
    if isinstance(module, FSDPModule):
        return module
    kwargs = dict(mesh=mesh, reshard_after_forward=True)
    for layer in repeated_layers(module):
        fully_shard(layer, **kwargs)
    scalars = {p for p in module.parameters() if p.ndim == 0}
    fully_shard(module, **kwargs, ignored_params=scalars or None)
    _keep_output_capture(module)
    for name in forward_methods:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)
    return module.requires_grad_(False)


def _keep_output_capture(module: nn.Module) -> None:
    """fully_shard swaps a module's class for a subclass (FSDPQwen3Model); transformers finds what a model can record
    (`output_hidden_states`) by the class's name, so a text encoder sharded at its root (Z-Image's Qwen3Model) would
    return no hidden states. Register the new class under the model's own recordable outputs."""
    can_record = getattr(module, "_can_record_outputs", None)
    if can_record is None:
        return
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # a transformers without the registry captures outputs without it
        return
    _CAN_RECORD_REGISTRY[module] = can_record


# ------------------------------------------------------------------------------------------ the training engine


class _ListingWriter(FileSystemWriter):
    """DCP's filesystem writer, noting the files this rank wrote: its shards (the write results name them) and, on
    the coordinator, `.metadata`. Anything it misses is still hashed, by rank 0 (checkpoint/local.py)."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.written: list[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        names = {getattr(r.storage_data, "relative_path", None) for r in future.wait()}  # done: DCP writes in place
        self.written += sorted(n for n in names if n)
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.written.append(".metadata")  # torch's name for the global metadata file the coordinator writes


class FSDP2Engine(Engine):
    name = "fsdp2"

    def __init__(self, model: nn.Module, parallel: ParallelConfig, optim: OptimizerSettings, dist_ctx: DistContext):
        self.comm = CommCounter.for_process()  # before any collective is issued
        dist_ctx.ensure_group()  # one process: a trivial group (closed with the context)
        self.parallel, self.optim, self.dist = parallel, optim, dist_ctx
        self.full_fine_tune = trains_all(model)
        self.grad_sync = resolve_grad_sync(parallel, self.full_fine_tune)
        compute = getattr(model, "compute_dtype", torch.float32)
        self.param_dtype = compute if compute in HALF else None  # the blocks' gathers
        self.mesh = build_mesh(dist_ctx.device.type, dist_ctx.world_size, parallel.replicate)
        self.model = self._parallelize(model, parallel.activation_checkpointing, getattr(model, "master_dtype", None),
                                       compile=parallel.compile)
        # sequence parallelism: a rank's gradient is its tokens' share, to be summed over its sequence group and
        # averaged over the data groups (parallel/sequence.py); the reduce-scatter averages over every rank, so each
        # backward is scaled by the group size (FSDP2's own divide factor is a PREMUL_SUM, which gloo lacks)
        self.grad_scale = float(dist_ctx.sequence_parallel)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, optim)
        self.scaler = make_scaler(compute, dist_ctx.device, sharded=True)
        self.init_ema()
        self._options = StateDictOptions(ignore_frozen_params=not self.full_fine_tune)

    def _parallelize(self, module: nn.Module, activation_checkpointing: bool,
                     master_dtype: torch.dtype | None = None, compile: bool = False) -> nn.Module:
        p = self.parallel
        skeleton = meta_load.is_meta(module)
        module = parallelize(module, self.mesh, param_dtype=self.param_dtype,
                             activation_checkpointing=activation_checkpointing,
                             reshard_after_forward=p.reshard_after_forward, prefetch=p.prefetch,
                             device=self.dist.device, master_dtype=master_dtype, compile=compile)
        if skeleton:  # each rank's shards read from the pipeline's files (parallel.meta_init)
            meta_load.materialize(module, self.dist.device, module.meta_weights,
                                  lora_rank=getattr(module, "lora_rank", 0), seed=getattr(module, "lora_seed", 0))
        return module

    def shard_frozen(self, module: nn.Module) -> nn.Module:
        """A frozen copy (the KL reference of a full fine-tune, on the host) sharded the same way, unit by unit onto
        the device, in its own dtype, without an optimizer."""
        return self._parallelize(module, activation_checkpointing=False)

    # ------------------------------------------------------------------ one minibatch
    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None, *, last: bool = True) -> None:
        # read by FSDP2's post-backward hooks only; off the boundary a block's gradient stays unsharded (fp32)
        self.model.set_requires_gradient_sync(last or self.grad_sync == "every")
        if self.grad_scale != 1.0:
            grad = torch.full_like(out, self.grad_scale) if grad is None else grad * self.grad_scale
        out, grad = self._scaled(out, grad)
        try:
            out.backward(grad)
        finally:
            self.model.set_requires_gradient_sync(True)

    def _clip_grads(self) -> torch.Tensor:
        max_norm = self.optim.grad_clip if self.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).detach()

    # ------------------------------------------------------------------ the checkpoint format: DCP
    # dcp/: torch.distributed.checkpoint shards of {"model", "optimizer", "ema"}, written by every rank, resharded on
    # load (N ranks -> M), read through checkpoint/dcp_reader.py (no unpickling beyond data)
    def _dcp_state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options)
        return {"model": model_sd, "optimizer": optim_sd, **self.shadows}  # shadows: "ema", "old", as DCP entries

    def _save(self, directory: Path) -> list[Path]:
        writer = _ListingWriter(directory / "dcp")
        dcp.save(self._dcp_state(), storage_writer=writer)
        return [directory / "dcp" / name for name in writer.written]

    def _load(self, directory: Path) -> None:
        from ..checkpoint.dcp_reader import dcp_load

        state = self._dcp_state()
        dcp_load(state, directory / "dcp")  # in place, the EMA shards included; nothing unpickled but data
        # A LoRA checkpoint holds the trained weights alone (ignore_frozen_params), and torch then loads with strict
        # name checking, which reports every frozen base weight missing: load non-strict and check here that only
        # frozen weights were left out (dcp_load already required every saved entry to be there)
        options = dataclasses.replace(self._options, strict=self.full_fine_tune)
        missing, unexpected = set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                             optim_state_dict=state["optimizer"], options=options)
        trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if unexpected or trained & set(missing):
            raise ValueError(f"checkpoint {directory}: its model state does not fit this model: missing trained "
                             f"{sorted(trained & set(missing))[:5]}, unexpected {sorted(unexpected)[:5]}")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable weights as full CPU tensors on rank 0 (collective; other ranks get {})."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=not self.full_fine_tune)
        return get_model_state_dict(self.model, options=options)

    @classmethod
    def read_weights(cls, directory: Path, model: nn.Module, trainable: set[str], ema: bool
                     ) -> dict[str, torch.Tensor]:
        """The DCP directory's "model" (or "ema") entries, read without a process group and resharded to full
        tensors in the model's dtypes."""
        from ..checkpoint import CheckpointError
        from ..checkpoint.dcp_reader import dcp_load, read_metadata

        path = directory / "dcp"
        section = "ema" if ema else "model"
        saved = read_metadata(path).state_dict_metadata
        names = [key[len(section) + 1:] for key in saved if key.startswith(section + ".")]
        if not names:
            raise CheckpointError(f"checkpoint {directory} holds no {section!r} weights")
        params = dict(model.named_parameters())
        if not set(names) <= set(params):
            raise CheckpointError(f"checkpoint {directory} does not fit the model: unexpected "
                                  f"{sorted(set(names) - set(params))[:5]}")
        wanted = {n: torch.empty(saved[f"{section}.{n}"].size, dtype=params[n].dtype) for n in names}
        dcp_load({section: dict(wanted)}, path, no_dist=True)
        return wanted
