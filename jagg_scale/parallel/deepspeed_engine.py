"""DeepSpeed ZeRO-3: parameters, gradients and optimizer state partitioned over ranks by `deepspeed.initialize`.

The DeepSpeed config is built from the run's settings (`build_ds_config`): ZeRO stage 3 with overlapped
communication and contiguous gradients, `gradient_clipping` = train.grad_clip (0 disables), bf16 weights when the
model computes in bf16 (the fp32 master copy lives in the optimizer; the trainer's autocast stays), fp16 weights and
DeepSpeed's dynamic loss scaling when it computes in float16 (`fp16`: loss_scale.DS_FP16, torch GradScaler's
schedule; DeepSpeed scales each backward, unscales before its clip and skips an overflowing step), and AdamW from
the train section as DeepSpeed's optimizer section with `torch_adam: true` (torch.optim.AdamW over the flat fp32
partitions: no compiled op, runs on CPU and matches the single-process engine). `parallel.deepspeed` is
deep-merged over it, so any DeepSpeed key can be set there; the shorthand `offload_optimizer: cpu` (or true) adds
ZeRO-Offload of the optimizer state (set `optimizer.params.torch_adam: false` to get DeepSpeedCPUAdam, a
JIT-compiled op).

Activation checkpointing (parallel.activation_checkpointing): the model's own per-block checkpointing
(blocks.enable_activation_checkpointing), switched on before partitioning; ZeRO-3 gathers a block's parameters
again for its recompute in backward, as for any forward.

Forward goes through DeepSpeed's engine: `engine.model` IS the `deepspeed.DeepSpeedEngine` (`engine.ds` too), and
attributes such as `encode_prompts`, `decode`, `latent_shape`, `save_full` fall through to the wrapped module via its
`__getattr__` (its `state_dict()`/`parameters()` are ZeRO-3 placeholders: use `full_state_dict()`). ZeRO-3's
gather hooks sit on the module itself, so `engine.module(...)` computes the same, but `DeepSpeedEngine.forward`
also registers the output hooks that run the backward prologue (offload/NVMe swap bookkeeping) and advances
ZeRO-3's `micro_step_id`; without that advance the next backward *overwrites* the partitioned gradient instead
of adding to it. `backward` therefore advances it itself after every backward, so accumulation holds either
way (tested), but call the engine.

Accumulation: train_micro_batch_size_per_gpu = gradient_accumulation_steps = 1, and the trainer marks the
boundary itself. Every backward of a minibatch (one per JAGG window or per exact step) goes through
`backward(out, grad, last)`: DeepSpeed's `engine.backward` of the equivalent scalar sum(out * grad), under
`set_gradient_accumulation_boundary(last)`. It reduce-scatters its gradients and adds the local partition into
ZeRO-3's gradient partition buffer; the boundary decides (with optimizer offload) when the accumulated partition
is copied to the CPU optimizer. ZeRO-3 keeps gradients partitioned at every backward, so `parallel.grad_sync` does
not apply here (the config refuses it: it is always `every` in effect). `step()` applies the update at the boundary,
clipping inside DeepSpeed, and returns its pre-clip global norm. Gradients are averaged over ranks (each rank's loss
is its share of the mean).

EMA (ema_decay > 0): each rank keeps the EMA of its own fp32 master partitions (the optimizer's flat
`fp32_partitioned_groups_flat`, one tensor per sub-group): no gather, 1/world of the weights per rank, updated
after the applied steps the EMA rule names (ema.py), as on every engine. `ema_weights()` swaps it into the 16-bit
partitions the forward gathers from (as DeepSpeed's own step does: release the gathered parameters, copy into the
flat partitions, re-gather the persistent ones) and restores the live partitions bit for bit afterwards;
evaluation and export run inside it.
NVMe offload (partitions swapped out) and ZeRO stages other than 3 have no EMA here (ValueError at build).

State: `save`/`load` are DeepSpeed checkpoints (`save_checkpoint(dir, tag="ds")`: per rank a model-states file
and its fp32-master + optimizer partition under dir/ds; collective; resume on the same world size), written only
inside `dir`, plus per rank its EMA partition (`ema_rank<r>.safetensors`); `save` returns this rank's files (it
hashes them for the manifest). `load` reads DeepSpeed's files weights-only (they are torch pickles; DeepSpeed's
own reader would unpickle anything in them). `full_state_dict()` consolidates the
16-bit (fp32 without bf16 or fp16) weights on rank 0 with `_zero3_consolidated_16bit_state_dict` (keys of the plain
model's `state_dict()`; {} on other ranks; LoRA: the trainable ones).

Placement: the model arrives on the host. Before `deepspeed.initialize`, `_partition` casts each parameter on the
host to the engine's dtype (the 16-bit compute dtype under bf16 or fp16, else the model's `master_dtype` upcast, if
any), and converts the model to ZeRO-3 parameters with `deepspeed.zero.Init(module=...)`, which moves one parameter
at a time to the device and partitions it at once; buffers are moved to the device. `deepspeed.initialize` then
sees a ZeRO-Init model and neither casts nor moves the whole module (which it would do first for a plain one: the
full model on every GPU before partitioning). The fp32 master partitions are made from the 16-bit ones, as before.

The KL reference of a full fine-tune (`shard_frozen`): a second, inference-only DeepSpeed engine (ZeRO-3 without
an optimizer: `DeepSpeedZeRoOffload`, DeepSpeed-Chat's reference model), partitioned the same way, in the dtype
the reference copy has (the checkpoint's: no cast); its forward all-gathers each module's parameters as the
policy's does, so each rank holds 1/world of the reference's weights (tests/dist_workers/deepspeed_worker.py).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from .blocks import enable_activation_checkpointing
from .comm import CommCounter
from .config import ParallelConfig
from .dist import DistContext
from .engine import HALF, Engine, OptimizerSettings, place_, trains_all
from .loss_scale import DS_FP16, search_skip

log = logging.getLogger(__name__)

__all__ = ["DeepSpeedEngine", "build_ds_config", "deep_merge", "precision_problem"]

TAG = "ds"


def deep_merge(base: dict, override: dict) -> dict:
    """A copy of `base` with `override` merged in: dicts recursively, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_ds_config(parallel: ParallelConfig, optim: OptimizerSettings, compute_dtype: torch.dtype) -> dict:
    """The DeepSpeed config of a run whose model computes in `compute_dtype`: ours translated, then
    `parallel.deepspeed` merged over it."""
    user = dict(parallel.deepspeed or {})
    offload = user.pop("offload_optimizer", None)  # shorthand: cpu | true
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # the trainer marks the boundary (backward's `last`)
        "gradient_clipping": float(optim.grad_clip),
        "optimizer": {"type": "AdamW", "params": {
            "lr": optim.lr, "betas": list(optim.adam_betas), "eps": optim.adam_eps,
            "weight_decay": optim.weight_decay, "torch_adam": True}},
        "bf16": {"enabled": compute_dtype == torch.bfloat16},
        **({"fp16": dict(DS_FP16)} if compute_dtype == torch.float16 else {}),
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 50_000_000,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if offload not in (None, False, "none"):
        pin = torch.cuda.is_available()
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    return deep_merge(ds, user)


def precision_problem(user: dict, dtype: str) -> tuple[str, str] | None:
    """(config key, why) when `parallel.deepspeed` (`user`) sets a DeepSpeed precision mode against model.dtype
    `dtype`, else None. build_ds_config sets `bf16` / `fp16` from model.dtype; DeepSpeed's 16-bit weights under
    another autocast (or none) cannot be right. Under its own dtype a section may tune the mode (fp16's loss
    scaling: loss_scale_window, initial_scale_power, ...)."""
    for section, own in (("fp16", "float16"), ("bf16", "bfloat16")):
        value, on = (user or {}).get(section), dtype == own
        if value is not None and not (isinstance(value, dict) and value.get("enabled", on) == on
                                      and (on or set(value) <= {"enabled"})):
            return (f"parallel.deepspeed.{section}", f"is DeepSpeed's {own} mode, set from model.dtype (here "
                    f"{dtype}); {'tune it here without `enabled`' if on else 'leave it out'}")
    return None


# The DeepSpeed releases whose internals this engine calls (ZeRO-3's fp32_partitioned_groups_flat and
# _partition_all_parameters, the engine's _get_ckpt_name) are verified on: another release is refused at config
# validation instead of failing mid-run (pyproject.toml pins the same range).
TESTED_DEEPSPEED = ((0, 19, 8), (0, 20, 0))  # [low, high)


def deepspeed_problem() -> str | None:
    """Why parallel.engine deepspeed cannot run here (not installed, or an untested release), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("deepspeed")
    except PackageNotFoundError:
        return "is deepspeed, but DeepSpeed is not installed (pip install -c constraints.txt -e '.[deepspeed]')"
    parts = tuple(int(p) for p in re.findall(r"\d+", found)[:3])
    low, high = TESTED_DEEPSPEED
    if not low <= parts < high:
        return (f"is deepspeed, but DeepSpeed {found} is installed: this engine calls DeepSpeed internals verified on "
                f">= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))} only (pip install "
                f"'deepspeed>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}')")
    return None


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, parallel: ParallelConfig, optim: OptimizerSettings,
                 dist_ctx: DistContext):
        self.comm = CommCounter.for_process()  # before DeepSpeed binds the torch.distributed collectives
        import deepspeed

        dist_ctx.ensure_group()  # one process: a trivial group (closed with the context)
        os.environ.setdefault("LOCAL_RANK", str(dist_ctx.local_rank))  # asserted by deepspeed.initialize
        self.parallel, self.optim, self.dist = parallel, optim, dist_ctx
        compute = getattr(model, "compute_dtype", torch.float32)
        self.fp16 = compute == torch.float16
        self.ds_config = build_ds_config(parallel, optim, compute)
        if dist_ctx.is_main:
            log.info("DeepSpeed config:\n%s", json.dumps(self.ds_config, indent=2, sort_keys=True))
        self._trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        self.full_fine_tune = trains_all(model)
        if parallel.activation_checkpointing:
            enable_activation_checkpointing(model)
        dtype = compute if compute in HALF else getattr(model, "master_dtype", None)
        if self._stage3:
            self._partition(model, self.ds_config, dtype)
        else:  # ZeRO-1/2 (parallel.deepspeed override): DeepSpeed casts and moves the whole module, as it always did
            place_(model, None, getattr(model, "master_dtype", None))
        params = [p for p in model.parameters() if p.requires_grad]
        _forget_stale_world_group()
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=params, config=self.ds_config, dist_init_required=False)
        self.model = self.ds  # forward through DeepSpeed's engine; other attributes fall through to the module
        if self.fp16:  # an overflow at the scale's floor is a non-finite step (loss_scale.py), not a bare Exception
            self.ds.optimizer.loss_scaler.raise_error_at_min_scale = False
        self.module = self.ds.module
        self.params = params
        self.init_ema()

    @property
    def _stage3(self) -> bool:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0)) == 3

    def _partition(self, module: torch.nn.Module, ds_config: dict, dtype: torch.dtype | None) -> None:
        """`module` (on the host) into ZeRO-3 partitions on the device, one parameter at a time (see the module
        docstring); parameters cast to `dtype` first when given, buffers moved whole (16-bit ones upcast when dtype
        is float32, as the model's float32 load had them)."""
        import deepspeed

        with torch.no_grad():
            for p in module.parameters():
                if dtype is not None and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for b in module.buffers():
                up = dtype if dtype == torch.float32 and b.dtype in HALF else b.dtype
                b.data = b.data.to(device=self.dist.device, dtype=up)
        deepspeed.zero.Init(module=module, config_dict_or_path=ds_config, dtype=dtype)

    def reference_config(self, module: torch.nn.Module) -> dict:
        """The DeepSpeed config of the frozen reference: the run's ZeRO-3 settings without an optimizer (nor its
        offload), 16-bit weights only where the reference already has them (it is not cast)."""
        ds = copy.deepcopy(self.ds_config)
        ds.pop("optimizer", None)
        ds.pop("scheduler", None)
        ds["zero_optimization"].pop("offload_optimizer", None)
        ds["bf16"] = {"enabled": any(p.dtype == torch.bfloat16 for p in module.parameters())}
        ds.pop("fp16", None)
        return ds

    def shard_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """The frozen KL reference (on the host) as an inference-only ZeRO-3 engine: partitioned over the ranks
        parameter by parameter like the model, gathered per forward; 1/world of its weights per rank."""
        import deepspeed

        module.requires_grad_(False).eval()
        if not self._stage3:  # ZeRO-1/2 do not partition parameters: a full copy per rank, as before
            return place_(module, self.dist.device)
        ds = self.reference_config(module)
        self._partition(module, ds, None)
        engine, _, _, _ = deepspeed.initialize(model=module, config=ds, dist_init_required=False)
        engine.eval()  # DeepSpeedEngine.eval returns None
        return engine

    # ------------------------------------------------------------------ shadows of this rank's fp32 partitions
    @property
    def _zero(self):
        """ZeRO-3's optimizer: the flat fp32 master partitions and the 16-bit partitions the forward gathers."""
        return self.ds.optimizer

    def _live(self) -> dict[str, torch.Tensor]:
        """This rank's flat fp32 master partitions (one per sub-group): what the shadows copy and move towards."""
        zero = self._zero
        flats = getattr(zero, "fp16_partitioned_groups_flat", None)
        if getattr(zero, "fp32_partitioned_groups_flat", None) is None or flats is None:
            raise ValueError("shadow weights (train.ema_decay, DiffusionNFT's old policy) with parallel.engine "
                             "deepspeed need ZeRO stage 3 (they are kept of the flat fp32 partitions), got optimizer "
                             f"{type(zero).__name__}")
        if getattr(zero, "swap_optimizer", False) or any(t is None for t in flats):
            raise ValueError("shadow weights (train.ema_decay, DiffusionNFT's old policy) with parallel.engine "
                             "deepspeed: NVMe offload swaps the partitions out of memory; they need them in memory "
                             "(use offload to cpu or none)")
        return {f"partition.{i}": t for i, t in enumerate(zero.fp32_partitioned_groups_flat)}

    @contextmanager
    def shadow_weights(self, name: str):
        """The engine with the shadow `name` in its 16-bit partitions (collective: every rank enters and leaves)."""
        live = [t.clone() for t in self._zero.fp16_partitioned_groups_flat]
        self._set_partitions(list(self.shadows[name].values()))
        try:
            yield self.model
        finally:
            self._set_partitions(live)

    @torch.no_grad()
    def _set_partitions(self, values: list[torch.Tensor]) -> None:
        """Copy `values` into the 16-bit flat partitions as DeepSpeed's step does after the optimizer: release
        every gathered parameter first (a cached full copy would be stale), re-gather the persistent ones after.
        Where DeepSpeed aliases the fp32 master partitions to these (fp32 weights on the optimizer's device) the
        master changes with them, and is restored with them."""
        zero = self._zero
        zero._partition_all_parameters()
        for i, (flat, value) in enumerate(zip(zero.fp16_partitioned_groups_flat, values)):
            flat.copy_(value)
            zero._unflatten_partitioned_parameters(i)
        if zero.persistent_parameters:
            zero.persistent_parameters[0].all_gather(zero.persistent_parameters)
        zero.invalidate_secondary_tensor()

    # ------------------------------------------------------------------ one minibatch
    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None, *, last: bool = True) -> None:
        """DeepSpeed's backward of the scalar with out.backward(grad)'s gradient, under the accumulation boundary
        `last` (read by ZeRO-3's backward and reduce hooks, not by the forward)."""
        scalar = out if grad is None else (out * grad.detach()).sum()
        self.ds.set_gradient_accumulation_boundary(bool(last))
        try:
            self.ds.backward(scalar)
            # advance ZeRO-3's micro step now (normally done by the next engine forward): the next backward of
            # this minibatch then adds to the gradient partition instead of overwriting it
            clear = getattr(self.ds.optimizer, "clear_backward_seen_flag", None)
            if clear is not None:
                clear()
        finally:
            self.ds.set_gradient_accumulation_boundary(True)

    def step(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """Clip (grad_clip, inside DeepSpeed), AdamW on the partitions, zero grads, EMA; the global pre-clip
        gradient norm (0-d; DeepSpeed has read it to the host already). ZeRO-3 skips the update itself when that
        norm is not finite (its overflow check, bf16 and fp32 included); `step_applied` reports it. `loss` is not
        consulted for that: DeepSpeed's step cannot be withheld at the boundary, and a non-finite loss that carries
        a gradient makes the norm non-finite anyway. Under float16 (its loss scaler) a skipped step's loss is read
        (gathered) to tell the scale's search from a non-finite step (loss_scale.py)."""
        self.ds.set_gradient_accumulation_boundary(True)
        scale = float(self.ds.optimizer.cur_scale) if self.fp16 else None  # a host float: no read of the device
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = torch.tensor(float("nan") if norm is None else float(norm))
        self.step_applied = bool(self.ds.was_step_applied())
        self.loss_scale = scale
        # every rank agrees on the skip (DeepSpeed reduces its overflow verdict), so every rank gathers here
        self.scale_skipped = self.fp16 and not self.step_applied and search_skip(
            False, self._finite(norm.to(self.dist.device), loss)[1], scale)
        self._count_step()
        return norm

    def _local_weights(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's ZeRO-3 partitions (`ds_tensor`; the parameters' own data is empty between gathers) of the
        trainable weights, and its EMA partitions."""
        named = [(n, getattr(p, "ds_tensor", p)) for n, p in zip(self._trainable, self.params)]
        return named + [(f"{s}.{n}", t) for s, shadow in self.shadows.items() for n, t in shadow.items()]

    # ------------------------------------------------------------------ the checkpoint format: DeepSpeed's own
    # ds/: per rank a model-states file and its fp32-master + optimizer partition (save_checkpoint, tag "ds"), plus
    # per rank and shadow its partitions <shadow>_rank<r>.safetensors (ema_rank<r>, old_rank<r>); resumed on the
    # world size that wrote it
    def _shadow_file(self, directory: Path, name: str) -> Path:
        return directory / f"{name}_rank{self.dist.rank:05d}.safetensors"

    def _save(self, directory: Path) -> list[Path]:
        self.ds.save_checkpoint(str(directory), tag=TAG, save_latest=False,
                                    exclude_frozen_parameters=not self.full_fine_tune)
        files = self._own_files(directory)
        from ..checkpoint.local import write_tensors

        files += [write_tensors(self._shadow_file(directory, name), shadow) for name, shadow in self.shadows.items()]
        return files

    def _own_files(self, directory: Path) -> list[Path]:
        """This rank's model-states and optimizer partition files (their names carry this rank's data-parallel
        rank, so no other rank writes them). DeepSpeed's name helpers are private: if they change, the files go
        unreported and rank 0 hashes them (slower, still correct)."""
        try:
            names = [self.ds._get_ckpt_name(str(directory), TAG),
                     self.ds._get_zero_ckpt_name(str(directory), TAG)]
        except (AttributeError, TypeError) as err:
            log.warning("DeepSpeed checkpoint file names unknown (%s): rank 0 hashes them", err)
            return []
        return [Path(n) for n in names if Path(n).is_file()]

    def _load(self, directory: Path) -> None:
        from ..checkpoint import CheckpointError

        with self._weights_only_loads(directory):
            path, _ = self.ds.load_checkpoint(str(directory), tag=TAG,
                                                  load_module_strict=self.full_fine_tune,
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"no DeepSpeed checkpoint (tag {TAG!r}) in {directory}")
        from safetensors.torch import load_file

        from ..checkpoint.fits import check_fits

        for shadow_name, shadow in self.shadows.items():
            file = self._shadow_file(directory, shadow_name)
            if not file.is_file():
                raise CheckpointError(f"checkpoint {directory} has no {shadow_name!r} partition of rank "
                                      f"{self.dist.rank} ({file.name}) but this run keeps those weights")
            saved = load_file(str(file))
            if set(saved) != set(shadow):
                raise CheckpointError(f"checkpoint {directory}: the {shadow_name!r} partitions of rank "
                                      f"{self.dist.rank} do not fit this engine (DeepSpeed resumes on the world size "
                                      "that wrote it)")
            check_fits(directory, file.name, saved, shadow)
            for name, value in saved.items():
                shadow[name].copy_(value)

    @contextmanager
    def _weights_only_loads(self, directory: Path):
        """DeepSpeed reads its files through its checkpoint engine's `load`, a torch.load with weights_only=False:
        for this load it is the weights-only one (checkpoint/pickles.py), which admits DeepSpeed's own few classes
        and refuses, naming the file, anything that would run code."""
        from ..checkpoint.pickles import allowed_globals, load_torch

        ckpt = self.ds.checkpoint_engine

        def load(path, map_location=None):
            path = Path(path)
            name = path.relative_to(directory).as_posix() if path.is_relative_to(directory) else path.name
            return load_torch(path, map_location=map_location, allow=allowed_globals(name))

        ckpt.load = load  # an instance attribute: shadows the class's method, for this engine and this load only
        try:
            yield
        finally:
            del ckpt.load

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable weights, consolidated on rank 0 as CPU tensors (collective; other ranks get {})."""
        state = self.ds._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=not self.full_fine_tune)
        if state is None:
            return {}
        if not self.full_fine_tune:
            keep = set(self._trainable)
            state = {k: v for k, v in state.items() if k in keep}
        return dict(state)

    @classmethod
    def read_weights(cls, directory: Path, model: torch.nn.Module, trainable: set[str], ema: bool
                     ) -> dict[str, torch.Tensor]:
        """The fp32 weights reassembled from the ZeRO-3 partitions (deepspeed.utils.zero_to_fp32); the EMA from the
        per-rank EMA partitions (ema_rank<r>.safetensors), reassembled the same way. zero_to_fp32 unpickles
        DeepSpeed's files without restriction: each is first checked to load weights-only (tensors, plain data,
        DeepSpeed's own few records: checkpoint/pickles.py), so nothing in them can run."""
        from deepspeed.utils import zero_to_fp32 as z
        from safetensors.torch import load_file

        from ..checkpoint import CheckpointError
        from ..checkpoint.pickles import check_file

        ds_dir = directory / TAG
        for f in sorted(ds_dir.glob("*.pt")):
            check_file(f, f.relative_to(directory).as_posix())
        if not ema:
            weights = z.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
            return {k: v for k, v in weights.items() if k in trainable}
        files = sorted(directory.glob("ema_rank*.safetensors"))
        if not files:
            raise CheckpointError(f"checkpoint {directory} has no EMA partitions (ema_rank*.safetensors)")
        parts = [load_file(str(f)) for f in files]
        groups = [[part[f"partition.{i}"] for i in range(len(part))] for part in parts]
        model_states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
        weights = z.to_torch_tensor(z._get_fp32_state_dict_from_zero3_checkpoint(
            len(groups), groups, model_states, exclude_frozen_parameters=True))
        return {k: v for k, v in weights.items() if k in trainable}


def _forget_stale_world_group() -> None:
    """DeepSpeed caches its clone of the world group in a module global (deepspeed.utils.groups._WORLD_GROUP). A
    second engine in the same process, after the first one's process group was destroyed (a test that trains, then
    evaluates; a resumed run in a notebook), would get that dead group; drop it so DeepSpeed clones the live one."""
    import torch.distributed as tdist
    from deepspeed.utils import groups

    group = getattr(groups, "_WORLD_GROUP", None)
    if group is not None and group not in tdist.distributed_c10d._world.pg_group_ranks:
        groups._WORLD_GROUP = None
