"""Distributed training: rank discovery and the process group, training engines, FSDP2 helpers, collective counts.

    ranks.py             who we are in a job (torchrun, Slurm, MPI or one process); the process-group backend
    dist.py              `init_distributed` -> `DistContext` (rank, device, the trainer's few collectives)
    config.py            `ParallelConfig`: the `parallel` section, the engines' own settings
    engine.py            the `Engine` contract and what every engine shares
    local_engine.py      `LocalEngine`, the one-process reference
    build.py             `build_engine(model, parallel, optim, dist)`: the engine `parallel.engine` names
    blocks.py            the transformer blocks: the units FSDP2 shards and `parallel.compile` compiles
    fsdp.py              FSDP2: the mesh and sharding shared by training and reward sharding, `FSDP2Engine`
    deepspeed_engine.py  DeepSpeed ZeRO-3 `DeepSpeedEngine`
    comm.py              `CommCounter` (and `NullCounter`): collectives and bytes per phase of a step
    weights.py           `load_trained_weights`: a checkpoint's weights into a plain model, no engine (jagg-eval)
    types.py             `EngineName`, `GradSync`: the one source of parallel.engine and parallel.grad_sync choices

Only the rank-discovery names are re-exported here (importing them pulls in no torch.distributed machinery).
"""

from jagg_scale.parallel.ranks import (
    RankInfo,
    default_backend,
    discover,
    expand_nodelist,
    export_env,
)

__all__ = ["RankInfo", "default_backend", "discover", "expand_nodelist", "export_env"]
