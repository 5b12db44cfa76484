"""The reference engine, parallel.engine none: one process, plain autograd, torch AdamW; the one the sharded engines
(fsdp.py, deepspeed_engine.py) are tested against. The contract it implements: engine.py."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.fits import check_fits
from ..checkpoint.local import write_object, write_tensors
from .blocks import compile_blocks, enable_activation_checkpointing
from .comm import NullCounter
from .config import ParallelConfig
from .dist import DistContext
from .engine import Engine, OptimizerSettings, make_optimizer, place_
from .loss_scale import make_scaler


class LocalEngine(Engine):
    """A single process: plain autograd, gradients accumulate in .grad, torch AdamW."""

    name = "none"

    def __init__(self, model: torch.nn.Module, parallel: ParallelConfig, optim: OptimizerSettings,
                 dist: DistContext):
        if dist.world_size > 1:
            raise ValueError(f"parallel.engine none runs one process, but {dist.world_size} were started: "
                             "use parallel.engine fsdp2 or deepspeed")
        self.parallel, self.optim, self.dist = parallel, optim, dist
        self.comm = NullCounter()  # one process: no collectives to count
        if parallel.compile:
            compile_blocks(model)
        if parallel.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.model = place_(model, dist.device, getattr(model, "master_dtype", None))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, optim)
        self.scaler = make_scaler(getattr(model, "compute_dtype", torch.float32), dist.device, sharded=False)
        self.init_ema()

    def shard_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy (the KL reference of a full fine-tune), placed like the model: moved whole here."""
        return place_(module, self.dist.device)

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None, *, last: bool = True) -> None:
        out, grad = self._scaled(out, grad)
        out.backward(grad)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight, or with LoRA (frozen base) the trainable ones alone: the live tensors."""
        state = self.model.state_dict()
        if len(self.params) == sum(1 for _ in self.model.parameters()):
            return state
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trainable}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainable_state_dict()

    # ------------------------------------------------------------------ the checkpoint format: safetensors + torch
    # model.safetensors (the trainable weights), optimizer.pt (read weights-only), <shadow>.safetensors per shadow
    # weight set (ema.safetensors with ema_decay > 0, old.safetensors under DiffusionNFT)
    def _save(self, directory: Path) -> list[Path]:
        files = [write_tensors(directory / "model.safetensors", self.trainable_state_dict()),
                 write_object(directory / "optimizer.pt", self.optimizer.state_dict())]
        files += [write_tensors(directory / f"{name}.safetensors", shadow) for name, shadow in self.shadows.items()]
        return files

    def _load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        from ..checkpoint import CheckpointError
        from ..checkpoint.pickles import load_torch

        # everything read and checked (names, shapes, dtypes, finite) before anything is copied into the model
        state = load_file(str(directory / "model.safetensors"))
        check_fits(directory, "model.safetensors", state, self.trainable_state_dict())
        shadows = {}
        for shadow_name, shadow in self.shadows.items():
            file = directory / f"{shadow_name}.safetensors"
            if not file.is_file():
                raise CheckpointError(f"checkpoint {directory} has no {file.name} but this run keeps the "
                                      f"{shadow_name!r} weights (train.ema_decay > 0, or DiffusionNFT's old policy)")
            shadows[shadow_name] = load_file(str(file))
            check_fits(directory, file.name, shadows[shadow_name], shadow)
        optimizer = load_torch(directory / "optimizer.pt")  # weights-only: tensors and numbers
        self.model.load_state_dict(state, strict=False)
        self.optimizer.load_state_dict(optimizer)
        for shadow_name, saved in shadows.items():
            for name, value in saved.items():
                self.shadows[shadow_name][name].copy_(value)

    @classmethod
    def read_weights(cls, directory: Path, model: torch.nn.Module, trainable: set[str], ema: bool
                     ) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        from ..checkpoint import CheckpointError

        path = directory / ("ema.safetensors" if ema else "model.safetensors")
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} has no {path.name}")
        weights = load_file(str(path))
        return {k: v for k, v in weights.items() if k in trainable or ema}
