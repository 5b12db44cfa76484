"""How long a preemption takes, so that the scheduler's signal comes early enough: deadlines that nest.

On SIGUSR1/SIGTERM a rank finishes its step (or the evaluation batch it is in), saves a checkpoint and exits; torchrun
waits SHUTDOWN_TIMEOUT seconds for that after forwarding the signal, and Slurm sends it --signal=B:USR1@LEAD seconds
before the time limit. So

    SHUTDOWN_TIMEOUT  >=  t_step + SAFETY x t_save + MARGIN_S        LEAD  >=  SHUTDOWN_TIMEOUT + MARGIN_S
    t_save  =  B / (nodes x write rate per node)  +  B / (nodes x gpus x sha256 rate per core)

with B the checkpoint's bytes (the trainable state: fp32 weights and AdamW's two moments, 12 bytes per trained
parameter; +4 with an EMA, +4 for DiffusionNFT's old policy), every rank writing and hashing its share, and t_step
the step-time model's step (estimate/steptime.py: an H200's passes; slower GPUs take longer). The rates are the
conservative ones of docs/launchers.md (1 GB/s per node, 0.5 GB/s per core; tools/checkpoint_rate.py measures a
filesystem's). slurm/jagg.sbatch checks a job against it before starting and refuses, with these numbers, a lead
that is too short.

    python -m jagg_scale.estimate.preemption CONFIG --nodes 2 --gpus 8 [section.key=value ...]   (one JSON line;
                                                                                   --shell: numbers for `read`)
"""

from __future__ import annotations

import argparse
import json
import math
import sys

GB = 1e9
NODE_GBPS, HASH_GBPS = 1.0, 0.5  # a node's filesystem write rate, one core's sha256 rate (conservative)
SAFETY, MARGIN_S = 2.0, 30.0  # the save counted twice (a slow node, a busy filesystem) plus 30 s

__all__ = ["GB", "HASH_GBPS", "MARGIN_S", "NODE_GBPS", "SAFETY", "checkpoint_bytes", "lead", "save_seconds"]


def save_seconds(nbytes: float, nodes: int, gpus: int, node_gbps: float = NODE_GBPS,
                 hash_gbps: float = HASH_GBPS) -> float:
    """Writing B bytes from every node at once, then each rank hashing the files it wrote."""
    return nbytes / (nodes * node_gbps * GB) + nbytes / (nodes * gpus * hash_gbps * GB)


def checkpoint_bytes(cfg, stats: dict) -> float:
    """The trainable state a checkpoint holds: 12 bytes per trained parameter (fp32 weights, AdamW's two moments),
    4 more per shadow copy (the EMA, DiffusionNFT's old policy); `stats` = shapes.transformer_stats."""
    trained = stats["lora_params"] if cfg.model.lora.enabled else stats["params"]
    shadows = (cfg.train.ema_decay > 0) + (cfg.train.algorithm == "nft")
    return (12 + 4 * shadows) * trained


def lead(cfg, nodes: int, gpus: int) -> dict:
    """{checkpoint_gb, per_rank_gb, save_s, step_s (None when the memory model lacks this model's coefficients),
    shutdown_s (the least SHUTDOWN_TIMEOUT), lead_s (the least --signal lead)} for `cfg` on nodes x gpus."""
    from ..models.lora import lora_targets
    from . import memory as E
    from . import steptime as T
    from .activations import CoefficientsMissing
    from .shapes import pipeline_shapes, transformer_stats

    world = nodes * gpus
    comp = pipeline_shapes(cfg)["components"]["transformer"]
    lora = cfg.model.lora
    rank = lora.rank if lora.enabled else 0
    stats = transformer_stats(comp, rank, lora_targets(cfg.model.kind, lora.targets) if rank else ())
    nbytes = checkpoint_bytes(cfg, stats)
    save = save_seconds(nbytes, nodes, gpus)
    try:
        s = E.prepare(cfg, world)
        step = T.step_seconds(s, E.estimate(s))["step"]
    except (CoefficientsMissing, E.DoesNotDivide):
        step = None
    shutdown = (step or 0.0) + SAFETY * save + MARGIN_S
    return {"checkpoint_gb": nbytes / GB, "per_rank_gb": nbytes / world / GB, "save_s": save, "step_s": step,
            "shutdown_s": shutdown, "lead_s": shutdown + MARGIN_S}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jagg_scale.estimate.preemption", description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--shell", action="store_true",
                    help="one line for a shell's `read`: shutdown_s lead_s checkpoint_gb save_s step_s (integers; "
                         "step_s -1 when unknown)")
    args = ap.parse_intermixed_args(argv)
    from ..train.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides, check_files=False)
    except ConfigError as err:
        print(f"preemption: {err}", file=sys.stderr)
        return 2
    out = lead(cfg, args.nodes, args.gpus)
    if args.shell:
        step = -1 if out["step_s"] is None else out["step_s"]
        print(" ".join(str(int(math.ceil(v))) for v in (out["shutdown_s"], out["lead_s"], out["checkpoint_gb"],
                                                         out["save_s"], step)))
    else:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
