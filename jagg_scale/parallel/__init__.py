"""Distributed-training helpers (rank discovery, backend choice)."""

from jagg_scale.parallel.ranks import (
    RankInfo,
    default_backend,
    discover,
    expand_nodelist,
    export_env,
)

__all__ = ["RankInfo", "default_backend", "discover", "expand_nodelist", "export_env"]
