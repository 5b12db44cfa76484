"""Distributed training: rank discovery and the process group, training engines, FSDP2 helpers, collective counts.

    ranks.py             who we are in a job (torchrun, Slurm, MPI or one process); the process-group backend
    dist.py              `init_distributed` -> `DistContext` (rank, device, the trainer's few collectives)
    engine.py            the `TrainEngine` contract, its `EngineSpec`, and the single-process reference engine
    build.py             `build_engine(model, spec, dist)`: the engine `spec.backend` names
    blocks.py            the transformer blocks: the units FSDP2 shards and `parallel.compile` compiles
    fsdp.py              FSDP2: the mesh and sharding shared by training and reward sharding, `FSDP2Engine`
    deepspeed_engine.py  DeepSpeed ZeRO-3 `DeepSpeedEngine`
    comm.py              `CommCounter` (and `NullCounter`): collectives and bytes per phase of a step
    weights.py           `load_trained_weights`: a checkpoint's weights into a plain model, no engine (jagg-eval)
    types.py             `Backend`: the engine names, the one source of parallel.engine's choices

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
