"""The engine factory: `build_engine(model, parallel, optim, dist)` makes the `Engine` that `parallel.engine` names,
and `engine_class(name)` is that engine's class (also what reads a checkpoint's weights: weights.py).

It lives apart from engine.py (the contract) and local_engine.py (the single-process reference) so that the
sharding engines import the base and nothing imports them but this factory (lazily: DeepSpeed is only imported when
chosen).
"""

from __future__ import annotations

import torch

from .config import ParallelConfig
from .dist import DistContext
from .engine import Engine, OptimizerSettings
from .local_engine import LocalEngine
from .types import ENGINES

__all__ = ["ENGINES", "build_engine", "engine_class"]


def engine_class(name: str) -> type[Engine]:
    if name == "none":
        return LocalEngine
    if name == "fsdp2":
        from .fsdp import FSDP2Engine

        return FSDP2Engine
    if name == "deepspeed":
        from .deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine
    raise ValueError(f"parallel.engine must be one of {', '.join(ENGINES)}, got {name!r}")


def build_engine(model: torch.nn.Module, parallel: ParallelConfig, optim: OptimizerSettings,
                 dist: DistContext) -> Engine:
    return engine_class(parallel.engine)(model, parallel, optim, dist)
