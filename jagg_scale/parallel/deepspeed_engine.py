"""DeepSpeed ZeRO-3: parameters, gradients and optimizer state partitioned over ranks by `deepspeed.initialize`.

The DeepSpeed config is built from ours (`build_ds_config`): ZeRO stage 3 with overlapped communication and
contiguous gradients, `gradient_clipping` = train.grad_clip (0 disables), bf16 weights when model.dtype is
bfloat16 (the fp32 master copy lives in the optimizer; the trainer's autocast stays), and AdamW from train.*
as DeepSpeed's optimizer section with `torch_adam: true` (torch.optim.AdamW over the flat fp32 partitions:
no compiled op, runs on CPU and matches the single-process engine). `parallel.deepspeed` is deep-merged over
it, so any DeepSpeed key can be set there; the shorthand `offload_optimizer: cpu` (or true) adds ZeRO-Offload of
the optimizer state (set `optimizer.params.torch_adam: false` to get DeepSpeedCPUAdam, a JIT-compiled op).

Forward goes through the DeepSpeed engine: `engine.model` IS the `deepspeed.DeepSpeedEngine`, and attributes
such as `encode_prompts`, `decode`, `latent_shape`, `save_full` fall through to the wrapped module via its
`__getattr__` (its `state_dict()`/`parameters()` are ZeRO-3 placeholders: use `full_state_dict()`). ZeRO-3's
gather hooks sit on the module itself, so `engine.module(...)` computes the same, but `DeepSpeedEngine.forward`
also registers the output hooks that run the backward prologue (offload/NVMe swap bookkeeping) and advances
ZeRO-3's `micro_step_id`; without that advance the next backward *overwrites* the partitioned gradient instead
of adding to it. `_backward` therefore advances it itself after every backward, so accumulation holds either
way (tested), but call the engine.

Accumulation: train_micro_batch_size_per_gpu = gradient_accumulation_steps = 1, and the trainer marks the
boundary itself. Every backward of a minibatch (one per JAGG window or per exact step, routed through
`engine.backward` by `backward_context`) reduce-scatters its gradients and adds the local partition into
ZeRO-3's gradient partition buffer; `accumulate(last)` sets `engine.set_gradient_accumulation_boundary(last)`, which
decides whether `engine.step()` applies the update and (with optimizer offload) when the accumulated partition
is copied to the CPU optimizer. Gradients are averaged over ranks (each rank's loss is its share of the mean).

State: `save`/`load` are DeepSpeed checkpoints (`save_checkpoint(dir, tag="ds")`: per rank a model-states file
and its fp32-master + optimizer partition under dir/ds; collective; resume on the same world size), written only
inside `dir`. `full_state_dict()` consolidates the 16-bit (fp32 without bf16) weights on rank 0 with
`_zero3_consolidated_16bit_state_dict` (keys of the plain model's `state_dict()`; {} on other ranks; LoRA: the
trainable ones). `gathered_model()` (base) yields the engine, whose forward gathers on every rank.
`shard_frozen` leaves the frozen KL reference unsharded: a full copy per rank (its weights once per rank).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from .dist import DistContext
from .engine import TrainEngine

log = logging.getLogger(__name__)

__all__ = ["DeepSpeedEngine", "build_ds_config", "deep_merge"]

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


def build_ds_config(cfg) -> dict:
    """The DeepSpeed config of a run: ours translated, then `parallel.deepspeed` merged over it."""
    t = cfg.train
    user = dict(cfg.parallel.deepspeed or {})
    offload = user.pop("offload_optimizer", None)  # shorthand: cpu | true
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # the trainer marks the boundary (accumulate)
        "gradient_clipping": float(t.grad_clip),
        "optimizer": {"type": "AdamW", "params": {
            "lr": t.lr, "betas": list(t.adam_betas), "eps": t.adam_eps, "weight_decay": t.weight_decay,
            "torch_adam": True}},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
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


class DeepSpeedEngine(TrainEngine):
    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, cfg, dist_ctx: DistContext):
        import deepspeed

        dist_ctx.ensure_group()  # one process: a trivial group (closed with the context)
        os.environ.setdefault("LOCAL_RANK", str(dist_ctx.local_rank))  # asserted by deepspeed.initialize
        self.cfg, self.dist = cfg, dist_ctx
        self.lora = bool(getattr(getattr(cfg.model, "lora", None), "enabled", False))
        self.ds_config = build_ds_config(cfg)
        if dist_ctx.is_main:
            log.info("DeepSpeed config:\n%s", json.dumps(self.ds_config, indent=2, sort_keys=True))
        self._trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        self._all_trainable = len(self._trainable) == sum(1 for _ in model.parameters())
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=params, config=self.ds_config, dist_init_required=False)
        self.model = self.engine  # forward through the engine; other attributes fall through to the module
        self.module = self.engine.module
        self.params = params

    def shard_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """The frozen KL reference, unchanged: a full copy on every rank (memory: its weights once per rank)."""
        return module.to(self.dist.device)

    # ------------------------------------------------------------------ one minibatch
    @contextmanager
    def accumulate(self, last: bool):
        self.engine.set_gradient_accumulation_boundary(bool(last))
        try:
            yield
        finally:
            self.engine.set_gradient_accumulation_boundary(True)

    def _backward(self, scalar: torch.Tensor) -> None:
        self.engine.backward(scalar)
        # advance ZeRO-3's micro step now (normally done by the next engine forward): the next backward of this
        # minibatch then adds to the gradient partition instead of overwriting it
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()

    def step(self) -> float:
        """Clip (train.grad_clip), AdamW on the partitions, zero grads; the global pre-clip gradient norm."""
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def zero_grad(self) -> None:
        self.engine.optimizer.zero_grad()

    def clip_grad_norm(self) -> float:
        raise NotImplementedError("deepspeed clips inside step(); call step()")

    # ------------------------------------------------------------------ state
    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=TAG, save_latest=False,
                                    exclude_frozen_parameters=self.lora)

    def load(self, directory: Path) -> None:
        from ..checkpoint import CheckpointError

        path, _ = self.engine.load_checkpoint(str(directory), tag=TAG, load_module_strict=not self.lora,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"no DeepSpeed checkpoint (tag {TAG!r}) in {directory}")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable weights, consolidated on rank 0 as CPU tensors (collective; other ranks get {})."""
        state = self.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=self.lora)
        if state is None:
            return {}
        if not self._all_trainable:
            keep = set(self._trainable)
            state = {k: v for k, v in state.items() if k in keep}
        return dict(state)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return self.full_state_dict()
