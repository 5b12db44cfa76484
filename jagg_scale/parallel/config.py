"""The `parallel` section of the run configuration: the training engine's own settings, kept beside the engines.

An engine (engine.py, fsdp.py, deepspeed_engine.py) is built from this section and the optimizer settings of the
`train` section (`build_engine(model, cfg.parallel, cfg.train, dist)`); what it needs from the model it reads off the
model itself (`compute_dtype`, which parameters train). Every key acts under every engine that accepts it; a key an
engine cannot honour is refused here, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..sections import Section, require
from .types import EngineName, GradSync

__all__ = ["ParallelConfig"]


@dataclass
class ParallelConfig(Section):
    engine: EngineName = "none"  # none: one process | fsdp2: FSDP2 per block (HSDP) | deepspeed: ZeRO-3
    reshard_after_forward: bool = True  # fsdp2: free gathered params after forward (gather again in backward)
    # every engine: recompute each transformer block in backward (the model's own per-block checkpointing:
    # diffusers' for sd3/flux, the DiT's): the activation memory of one block, one more forward per pass
    activation_checkpointing: bool = False
    prefetch: bool = True  # fsdp2: gather block i+1 (forward) / i-1 (backward) while block i computes
    # fsdp2 HSDP: replica groups x shards. On several nodes set it to the node count for LoRA runs: each node
    # shards the frozen base over its own GPUs, so the per-block all-gathers stay on the node and only the
    # adapter's gradient crosses the network (slurm/jagg.sbatch does). 1 = plain FSDP over every rank
    replicate: int = 1
    deepspeed: dict[str, Any] = field(default_factory=dict)  # deepspeed: merged over the built-in ZeRO-3 config
    grad_sync: GradSync = "auto"  # fsdp2: boundary | every | auto (parallel/types.py)
    # none / fsdp2: torch.compile each transformer block in place before checkpointing and sharding wrap it
    # (parallel/blocks.py). Compiles at the first step. Meant for CUDA: on CPU, torch 2.13's vectorised inductor
    # code gets the DiT block's backward 0.1-0.8% wrong (tests/parallel/test_engines.py pins scalar code)
    compile: bool = False
    # seconds a collective may wait before the process group's watchdog aborts the job (init_process_group's
    # timeout); longer than the longest work one rank does while the others wait (a checkpoint save, rank 0's export)
    collective_timeout_s: int = 1800
    # fsdp2 with a diffusers pipeline: the transformer built on the meta device and each rank's shards read from its
    # files (parallel/meta_load.py), not loaded whole on every rank's host first. null: on where it applies; false:
    # the host path (each rank loads the whole transformer, then shards it)
    meta_init: Optional[bool] = None
    # fsdp2: split every transformer pass's tokens over this many ranks (Ulysses, parallel/sequence.py): the ranks of
    # a group hold the same rows, each 1/N of their tokens; for rows too long for one GPU (video, 1024 px+)
    sequence_parallel: int = 1

    def check(self, prefix: str) -> None:
        require(self.replicate >= 1, f"{prefix}.replicate", "must be >= 1")
        require(self.replicate == 1 or self.engine == "fsdp2", f"{prefix}.replicate",
                f"is HSDP, an fsdp2 layout: leave it at 1 with {prefix}.engine {self.engine}")
        require(not self.compile or self.engine in ("none", "fsdp2"), f"{prefix}.compile",
                f"is supported for {prefix}.engine none and fsdp2, not {self.engine}")
        require(not self.deepspeed or self.engine == "deepspeed", f"{prefix}.deepspeed",
                f"is the DeepSpeed config merged over the built-in one: it needs {prefix}.engine deepspeed, not "
                f"{self.engine}")
        require(self.grad_sync == "auto" or self.engine == "fsdp2", f"{prefix}.grad_sync",
                f"chooses when FSDP2 reduce-scatters gradients: it needs {prefix}.engine fsdp2 (ZeRO-3 reduces at "
                f"every backward; one process has nothing to reduce), not {self.engine}")
        for key in ("reshard_after_forward", "prefetch"):  # FSDP2's own switches; ZeRO-3 has its own in `deepspeed`
            require(getattr(self, key) or self.engine == "fsdp2", f"{prefix}.{key}",
                    f"is an FSDP2 setting: false needs {prefix}.engine fsdp2, not {self.engine}")
        require(self.sequence_parallel >= 1, f"{prefix}.sequence_parallel",
                f"must be >= 1, got {self.sequence_parallel}")
        require(self.sequence_parallel == 1 or self.engine == "fsdp2", f"{prefix}.sequence_parallel",
                f"splits the tokens of FSDP2's ranks: it needs {prefix}.engine fsdp2, not {self.engine}")
        require(self.meta_init is not True or self.engine == "fsdp2", f"{prefix}.meta_init",
                f"reads each rank's FSDP2 shards: it needs {prefix}.engine fsdp2, not {self.engine}")
        require(self.collective_timeout_s >= 1, f"{prefix}.collective_timeout_s",
                f"must be >= 1 second, got {self.collective_timeout_s}")
