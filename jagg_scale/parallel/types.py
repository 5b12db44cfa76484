"""Choices of the parallel layer, dependency-free so the config can import them without torch.distributed."""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["none", "fsdp2", "deepspeed"]  # parallel.backend: one process | FSDP2 (HSDP) | DeepSpeed ZeRO-3
BACKENDS: tuple[str, ...] = get_args(Backend)
