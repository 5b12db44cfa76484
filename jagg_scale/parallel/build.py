"""The engine factory: `build_engine(model, spec, dist)` makes the `TrainEngine` that `spec.backend` names.

It lives apart from engine.py (the contract and the single-process reference) so that the sharding engines
import the base and nothing imports them but this factory (lazily: DeepSpeed is only imported when chosen).
"""

from __future__ import annotations

import torch

from .dist import DistContext
from .engine import EngineSpec, TrainEngine
from .types import BACKENDS

__all__ = ["BACKENDS", "build_engine"]


def build_engine(model: torch.nn.Module, spec: EngineSpec, dist: DistContext) -> TrainEngine:
    if spec.backend == "none":
        return TrainEngine(model, spec, dist)
    if spec.backend == "fsdp2":
        from .fsdp import FSDP2Engine

        return FSDP2Engine(model, spec, dist)
    if spec.backend == "deepspeed":
        from .deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, spec, dist)
    raise ValueError(f"parallel.backend must be one of {', '.join(BACKENDS)}, got {spec.backend!r}")
