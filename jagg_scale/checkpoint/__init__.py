"""Checkpointing for training runs.

``local`` is the single-process, crash-safe format (safetensors + torch.save + manifest + COMPLETE marker).
It is re-exported here so callers write ``from jagg_scale.checkpoint import save_checkpoint``.
"""

from jagg_scale.checkpoint.local import (
    Checkpoint,
    CheckpointError,
    capture_rng_state,
    checkpoint_dir,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "capture_rng_state",
    "checkpoint_dir",
    "find_resume_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]
