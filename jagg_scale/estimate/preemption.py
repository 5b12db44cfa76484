"""How long a preemption takes, so that the scheduler's signal comes early enough: deadlines that nest.

On SIGUSR1/SIGTERM a rank stops at the next safe point (train/preemption.py), saves a checkpoint and exits; torchrun
waits SHUTDOWN_TIMEOUT seconds for that after forwarding the signal, and Slurm sends it --signal=B:USR1@LEAD seconds
before the time limit. So

    SHUTDOWN_TIMEOUT  >=  t_wait + SAFETY x t_save + MARGIN_S        LEAD  >=  SHUTDOWN_TIMEOUT + MARGIN_S
    t_save  =  B / (nodes x write rate per node)  +  B / (nodes x gpus x sha256 rate per core)
    t_wait  =  max(one rollout forward, one update micro-batch before its first optimizer step,
                   the update after its first optimizer step)                         (the whole step under pools)

with B the checkpoint's bytes (the trainable state: fp32 weights and AdamW's two moments, 12 bytes per trained
parameter; +4 with an EMA, +4 for DiffusionNFT's old policy), every rank writing and hashing its share, and the
phases from the step-time model (estimate/steptime.py: an H200's passes; slower GPUs take longer): a rollout forward
is the rollout's time over its chunks x sampling steps; the update's M optimizer steps a step split it evenly, the
first into its micro-batches. The conservative rates of docs/launchers.md (1 GB/s per node, 0.5 GB/s per core) unless
given: `--measure DIR` measures them on the filesystem DIR is on. slurm/jagg.sbatch derives its own signal from it
(the header's --signal lead is the backstop) and refuses a job whose SHUTDOWN_TIMEOUT or time limit is too short.

    python -m jagg_scale.estimate.preemption CONFIG --nodes 2 --gpus 8 [section.key=value ...]   (one JSON line;
                    [--node-gbps W --hash-gbps H]                                 --shell: numbers for `read`)
    python -m jagg_scale.estimate.preemption --measure DIR [--gb 2] [--repeats 3]   (the rates, one JSON line)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

GB = 1e9
NODE_GBPS, HASH_GBPS = 1.0, 0.5  # a node's filesystem write rate, one core's sha256 rate (conservative)
SAFETY, MARGIN_S = 2.0, 30.0  # the save counted twice (a slow node, a busy filesystem) plus 30 s

__all__ = ["GB", "HASH_GBPS", "MARGIN_S", "NODE_GBPS", "SAFETY", "checkpoint_bytes", "lead", "measure_save_rate",
           "save_seconds", "wait_seconds"]


def save_seconds(nbytes: float, nodes: int, gpus: int, node_gbps: float = NODE_GBPS,
                 hash_gbps: float = HASH_GBPS) -> float:
    """Writing B bytes from every node at once, then each rank hashing the files it wrote."""
    return nbytes / (nodes * node_gbps * GB) + nbytes / (nodes * gpus * hash_gbps * GB)


def checkpoint_bytes(cfg, stats: dict) -> float:
    """The trainable state a checkpoint holds: 12 bytes per trained parameter (fp32 weights, AdamW's two moments),
    4 more per shadow copy (the EMA, DiffusionNFT's old policy, AWM's EMA policy); `stats` =
    shapes.transformer_stats."""
    trained = stats["lora_params"] if cfg.model.lora.enabled else stats["params"]
    shadows = (cfg.train.ema_decay > 0) + cfg.algorithm_shadows
    return (12 + 4 * shadows) * trained


def wait_seconds(cfg, phases: dict, est: dict) -> dict:
    """{where: seconds} of the longest a signal waits inside a step for a safe point (module docstring), from the
    step-time model's `phases` and the memory model's `est` (its rows, chunk and micro-batch), and their max "wait"."""
    if cfg.pools.enabled:  # a trainer of the split pipeline stops at the end of its step only
        return {"step": phases["step"], "wait": phases["step"]}
    R, bs = est["local_rows"], est["sampling_batch"] or est["local_rows"]
    forwards = -(-R // bs) * cfg.sampling.num_steps
    M = cfg.optimizer_steps_per_step
    micro = -(-est["local_batch"] // (est["micro_batch_size"] or est["local_batch"]))
    out = {"rollout_forward": phases["rollout"] / forwards, "first_micro_batch": phases["train"] / M / micro,
           "after_first_optimizer_step": phases["train"] * (M - 1) / M}
    return {**out, "wait": max(out.values())}


def lead(cfg, nodes: int, gpus: int, node_gbps: float = NODE_GBPS, hash_gbps: float = HASH_GBPS) -> dict:
    """{checkpoint_gb, per_rank_gb, save_s, step_s and wait_s (None when the memory model lacks this model's
    coefficients: the wait is then taken as a whole step, unknown), waits (wait_seconds), shutdown_s (the least
    SHUTDOWN_TIMEOUT), lead_s (the least signal lead)} for `cfg` on nodes x gpus."""
    from ..models.lora import lora_targets
    from . import memory as E
    from . import steptime as T
    from .activations import CoefficientsMissing
    from .experts import expert_stats
    from .shapes import pipeline_shapes

    world = nodes * gpus
    lora = cfg.model.lora
    rank = lora.rank if lora.enabled else 0
    # every transformer the run trains: both experts of a two-expert pipeline (Wan2.2 A14B)
    stats, _ = expert_stats(pipeline_shapes(cfg)["components"], rank,
                            lora_targets(cfg.model.kind, lora.targets) if rank else ())
    nbytes = checkpoint_bytes(cfg, stats)
    save = save_seconds(nbytes, nodes, gpus, node_gbps, hash_gbps)
    try:
        s = E.prepare(cfg, world)
        est = E.estimate(s)
        phases = T.step_seconds(s, est)
        step, waits = phases["step"], wait_seconds(cfg, phases, est)
    except (CoefficientsMissing, E.DoesNotDivide):
        step, waits = None, {}
    wait = waits.get("wait")
    shutdown = (wait or 0.0) + SAFETY * save + MARGIN_S
    return {"checkpoint_gb": nbytes / GB, "per_rank_gb": nbytes / world / GB, "save_s": save, "step_s": step,
            "wait_s": wait, "waits": waits, "shutdown_s": shutdown, "lead_s": shutdown + MARGIN_S}


def measure_save_rate(directory: Path, gb: float = 2.0, repeats: int = 3) -> dict:
    """The formula's rates on the filesystem of `directory`: `gb` GB of fp32 tensors saved as a DCP checkpoint through
    the trainer's own protocol (checkpoint/local.py `save_checkpoint_dir`, fsync included) by one process, `repeats`
    times; medians of the write (DCP save + fsync: one process's share of W_node), the sha256 of the files just
    written (H: what each rank does on save), the whole save, and a verify (what a resume does, page cache warm),
    in GB/s (1 GB = 1e9 bytes). Leaves nothing behind in `directory`."""
    import shutil
    import statistics
    import tempfile
    import time

    import torch
    import torch.distributed.checkpoint as dcp

    from ..checkpoint import digests, verify_checkpoint
    from ..checkpoint.local import save_checkpoint_dir

    numel = 1 << 24  # 64 MB fp32 tensors, the size of a large weight's shard
    state = {f"w{i}": torch.randn(numel) for i in range(max(1, round(gb * GB / (4 * numel))))}
    nbytes = sum(t.numel() * 4 for t in state.values())
    hash_s = [0.0]
    real = digests.sha256_file

    def timed_hash(path):
        t0 = time.perf_counter()
        try:
            return real(path)
        finally:
            hash_s[0] += time.perf_counter() - t0

    def write(tmp: Path) -> list[Path]:
        dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(tmp / "dcp")))
        return sorted((tmp / "dcp").iterdir())  # one process: every file in it is its own

    runs = []
    digests.sha256_file = timed_hash
    try:
        with tempfile.TemporaryDirectory(dir=directory) as where:
            for i in range(repeats):
                root = Path(where) / f"rate_{i}"
                hash_s[0] = 0.0
                t0 = time.perf_counter()
                path = save_checkpoint_dir(root, 1, write=write, state={})
                total, hashed = time.perf_counter() - t0, hash_s[0]
                t0 = time.perf_counter()
                verify_checkpoint(path)
                runs.append({"save_s": total, "hash_s": hashed, "write_s": total - hashed,
                             "verify_s": time.perf_counter() - t0})
                shutil.rmtree(root)
    finally:
        digests.sha256_file = real
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"bytes": nbytes, "repeats": repeats, "directory": str(directory), "runs": runs,
            "write_gbps": nbytes / med["write_s"] / GB, "hash_gbps": nbytes / med["hash_s"] / GB,
            "save_gbps": nbytes / med["save_s"] / GB, "verify_gbps": nbytes / med["verify_s"] / GB}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jagg_scale.estimate.preemption", description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--node-gbps", type=float, default=NODE_GBPS, help="the filesystem's write rate per node, GB/s")
    ap.add_argument("--hash-gbps", type=float, default=HASH_GBPS, help="one core's sha256 rate, GB/s")
    ap.add_argument("--measure", type=Path, metavar="DIR",
                    help="measure the rates on DIR's filesystem (put it where run.output_dir goes); no config")
    ap.add_argument("--gb", type=float, default=2.0, help="with --measure: the checkpoint's size, GB")
    ap.add_argument("--repeats", type=int, default=3, help="with --measure: saves timed (median)")
    ap.add_argument("--shell", action="store_true",
                    help="one line for a shell's `read`: shutdown_s lead_s checkpoint_gb save_s step_s wait_s "
                         "(integers; step_s and wait_s -1 when unknown)")
    args = ap.parse_intermixed_args(argv)
    if args.measure is not None:
        if args.config is not None:
            ap.error("--measure takes no config: it measures the filesystem only")
        if not args.measure.is_dir():
            ap.error(f"--measure {args.measure}: not a directory")
        print(json.dumps(measure_save_rate(args.measure, args.gb, args.repeats)))
        return 0
    if args.config is None or args.nodes is None or args.gpus is None:
        ap.error("CONFIG, --nodes and --gpus are needed (or --measure DIR)")
    from ..train.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides, check_files=False)
    except ConfigError as err:
        print(f"preemption: {err}", file=sys.stderr)
        return 2
    out = lead(cfg, args.nodes, args.gpus, args.node_gbps, args.hash_gbps)
    if args.shell:
        step, wait = (-1 if out[k] is None else out[k] for k in ("step_s", "wait_s"))
        print(" ".join(str(int(math.ceil(v))) for v in (out["shutdown_s"], out["lead_s"], out["checkpoint_gb"],
                                                         out["save_s"], step, wait)))
    else:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
