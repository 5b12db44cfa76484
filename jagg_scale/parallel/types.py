"""Choices of the parallel layer, dependency-free so the config can import them without torch.distributed."""

from __future__ import annotations

from typing import Literal, get_args

EngineName = Literal["none", "fsdp2", "deepspeed"]  # parallel.engine: one process | FSDP2 (HSDP) | DeepSpeed ZeRO-3
ENGINES: tuple[str, ...] = get_args(EngineName)
# parallel.grad_sync: when a sharded engine reduces gradients across ranks. boundary: only at a minibatch's last
# backward (the least traffic; FSDP2 then holds each block's gradient unsharded in fp32 until the boundary);
# every: at every backward (reduce-scatter each time, gradients stay sharded); auto: every for a full fine-tune,
# boundary for LoRA-sized trainable parameters (parallel/engine.py resolve_grad_sync).
GradSync = Literal["boundary", "every", "auto"]
GRAD_SYNCS: tuple[str, ...] = get_args(GradSync)
