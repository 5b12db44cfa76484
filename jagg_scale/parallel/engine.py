"""Training engines: how parameters are held, gradients reduced, the optimizer stepped and state checkpointed.

The trainer talks to one `TrainEngine`; which one is `parallel.backend`:

    none       one process, plain autograd and torch AdamW (this file): the reference the others must match
    fsdp2      torch FSDP2 `fully_shard` per transformer block + root (fsdp.py)
    deepspeed  a DeepSpeed ZeRO-3 engine (deepspeed_engine.py)

The contract, in the order a training step uses it:

    engine.model                    the module to call for velocities (sharded or not)
    with engine.accumulate(last):   one backward of the minibatch; gradients are synchronised across ranks only
        ...backward...              when `last` is True (the accumulation boundary)
    engine.step() -> grad_norm      clip (train.grad_clip), optimizer step, zero grads
    engine.save(dir) / load(dir)    model + optimizer state into / from a checkpoint directory (collective)
    engine.full_state_dict()        the trainable weights gathered on rank 0 for export (others get {})
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from .dist import DistContext
from .types import BACKENDS

__all__ = ["TrainEngine", "build_engine", "make_optimizer"]


def make_optimizer(params, train_cfg) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                             betas=tuple(train_cfg.adam_betas), eps=train_cfg.adam_eps)


class TrainEngine:
    """A single process: plain autograd, gradients accumulate in .grad, torch AdamW."""

    name = "none"

    def __init__(self, model: torch.nn.Module, cfg, dist: DistContext):
        if dist.world_size > 1:
            raise ValueError(f"parallel.backend none runs one process, but {dist.world_size} were started: "
                             "use parallel.backend fsdp2 or deepspeed")
        self.cfg, self.dist = cfg, dist
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, cfg.train)
        self.init_ema()

    # ------------------------------------------------------------------ EMA of the trainable weights
    def init_ema(self) -> None:
        """train.ema_decay > 0 keeps an exponential moving average of the trainable weights (shards of them under
        FSDP2), updated after every optimizer step, checkpointed, and used for evaluation and export."""
        decay = float(getattr(self.cfg.train, "ema_decay", 0.0))
        self.ema_decay = decay
        self.ema = ({n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
                    if decay > 0 else None)

    @torch.no_grad()
    def update_ema(self) -> None:
        if getattr(self, "ema", None) is None:
            return
        for name, p in self.model.named_parameters():
            if name in self.ema:
                self.ema[name].lerp_(p.detach(), 1.0 - self.ema_decay)

    @contextmanager
    def ema_weights(self):
        """The model with its EMA weights in place (copied in and back: sharded parameters keep their storage)."""
        if getattr(self, "ema", None) is None:  # also engines that keep no EMA (DeepSpeed)
            yield self.model
            return
        params = {n: p for n, p in self.model.named_parameters() if n in self.ema}
        live = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.ema[n])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(live[n])

    def shard_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy (the KL reference of a full fine-tune), placed like the model; unchanged here."""
        return module

    # ------------------------------------------------------------------ one minibatch
    def accumulate(self, last: bool):
        """Context for one backward of a minibatch; `last` marks the accumulation boundary."""
        return nullcontext()

    def backward_context(self):
        """Installed around the update so every backward goes where the engine needs it (see jagg.backward_through)."""
        return nullcontext()

    def clip_grad_norm(self) -> float:
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def step(self) -> float:
        norm = self.clip_grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.update_ema()
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ state
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight, or with LoRA (frozen base) the trainable ones alone."""
        state = self.model.state_dict()
        if len(self.params) == sum(1 for _ in self.model.parameters()):
            return state
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trainable}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainable_state_dict()

    def save(self, directory: Path) -> None:
        from ..checkpoint.local import _write_object, _write_tensors

        _write_tensors(directory / "model.safetensors", self.trainable_state_dict())
        _write_object(directory / "optimizer.pt", self.optimizer.state_dict())
        if self.ema is not None:
            _write_tensors(directory / "ema.safetensors", self.ema)

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        from ..checkpoint import CheckpointError

        state = load_file(str(directory / "model.safetensors"))
        strict = len(self.params) == sum(1 for _ in self.model.parameters())
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        expected = set(self.trainable_state_dict())
        if unexpected or set(state) != expected or (strict and missing):
            raise CheckpointError(f"checkpoint {directory} does not fit the model: unexpected {unexpected[:5]}, "
                                  f"missing {sorted(expected - set(state))[:5]}")
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=False))
        if self.ema is not None:
            if not (directory / "ema.safetensors").is_file():
                raise CheckpointError(f"checkpoint {directory} has no EMA weights but train.ema_decay > 0")
            for name, value in load_file(str(directory / "ema.safetensors")).items():
                self.ema[name].copy_(value)

    @contextmanager
    def gathered_model(self):
        """The full (unsharded) model for evaluation and export; the plain model here."""
        yield self.model


def build_engine(model: torch.nn.Module, cfg, dist: DistContext, **kwargs) -> TrainEngine:
    backend = cfg.parallel.backend
    if backend == "none":
        return TrainEngine(model, cfg, dist)
    if backend == "fsdp2":
        from .fsdp import FSDP2Engine

        return FSDP2Engine(model, cfg, dist, **kwargs)
    if backend == "deepspeed":
        from .deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, cfg, dist, **kwargs)
    raise ValueError(f"parallel.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
