"""Crash-safe checkpoint directories (local.py): temp dir, fsynced files, a sha256 manifest, a COMPLETE marker,
an atomic rename; verified on load, the newest valid one found for resume. Across ranks each file is hashed by one
rank, in parallel (digests.py: the writer on save, a balanced share on verify). Nothing in a checkpoint is
unpickled beyond data (pickles.py; DCP through dcp_reader.py): a checkpoint can be loaded whoever wrote it. The RNG
states it carries: rng.py.

What goes inside comes from the training engine (parallel/: safetensors for one process, DCP shards for FSDP2,
DeepSpeed's own files), written collectively through ``save_checkpoint_dir``; the run-level protocol (what a
run saves, resume, export) is train/run_state.py.
"""

from jagg_scale.checkpoint.errors import UnsafeCheckpointError
from jagg_scale.checkpoint.local import (
    Checkpoint,
    CheckpointError,
    checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    newest_valid_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from jagg_scale.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "UnsafeCheckpointError",
    "capture_rng_state",
    "checkpoint_dir",
    "list_checkpoints",
    "load_checkpoint",
    "newest_valid_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]
