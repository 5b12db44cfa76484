"""One rank's share of a production config, as overrides that make a single process run it.

    rank_share(cfg, world_size) -> ["train.prompts_per_step=6", "train.minibatch_size=72", "sampling.num_steps=10", ...]

A rank of `world_size` samples prompts_per_step / world_size groups and trains batch_size / world_size rows of every
minibatch (train/rows.py), through the same sampler, loss and planner. The overrides carry the config's whole
`sampling`, `grpo` and `jagg` sections and its precision and LoRA switch, so a CPU test or a one-GPU check on a
small model runs the production loop itself (tests/train/test_host_syncs.py, tools/gpu_check.py), not a copy of
its values that could drift from the config.
"""

from __future__ import annotations

import dataclasses

import yaml

__all__ = ["launch_replicate", "rank_share", "replicas_per_node"]


def _value(v) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def rank_share(cfg, world_size: int) -> list[str]:
    t = cfg.train
    if t.prompts_per_step % world_size or t.minibatch_size % world_size:
        raise ValueError(f"train.prompts_per_step {t.prompts_per_step} and train.minibatch_size {t.minibatch_size} "
                         "must be "
                         f"multiples of the world size {world_size} for a rank's share to be a whole config")
    out = [f"train.prompts_per_step={t.prompts_per_step // world_size}",
           f"train.minibatch_size={t.minibatch_size // world_size}", f"train.micro_batch_size={t.micro_batch_size}",
           f"model.dtype={cfg.model.dtype}", f"model.lora.enabled={str(cfg.model.lora.enabled).lower()}"]
    for section in ("sampling", "grpo", "jagg"):
        data = dataclasses.asdict(getattr(cfg, section))
        out += [f"{section}.{k}={_value(v)}" for k, v in data.items()]
    return out


def replicas_per_node(cfg, nodes: int, gpus: int, gpu_gib: float = 79.2, headroom: float = 0.10) -> tuple[int, str]:
    """(parallel.replicate, why) for a config left at replicate 1 on `nodes` nodes of `gpus` GPUs (slurm/jagg.sbatch
    asks). HSDP with one replica per node keeps FSDP's per-block all-gathers of the weights on a node's NVLink and
    sends only the gradient's reduction between nodes (FLUX.1-dev: 23.8 GB of bf16 weights gathered per forward
    otherwise cross the network). A LoRA run takes it always (its sharded state is small); a full fine-tune when its
    per-rank peak, sharded over one node instead of all, still fits the GPU by the memory model (else flat FSDP:
    the state needs every node's memory). slurm/jagg.sbatch asks it on several nodes, and jagg-estimate prices a world
    of several nodes at its answer (launch_replicate)."""
    p = cfg.parallel
    if nodes <= 1 or p.engine != "fsdp2" or p.replicate != 1:
        return p.replicate, "one node, or not fsdp2, or parallel.replicate set: as configured"
    if p.sequence_parallel > 1 and gpus % p.sequence_parallel:  # a group would straddle nodes, and so replicas
        return 1, (f"parallel.sequence_parallel {p.sequence_parallel} does not divide a node's {gpus} GPUs: flat FSDP "
                   "over every node")
    if cfg.model.lora.enabled:
        return nodes, "LoRA: only the adapter's gradient crosses nodes"
    from .memory import GiB, estimate, fits, prepare

    hsdp = dataclasses.replace(cfg, parallel=dataclasses.replace(p, replicate=nodes))
    est = estimate(prepare(hsdp, nodes * gpus, gpu_gib=gpu_gib))
    peak, limit = est["total"] / GiB, (1 - headroom) * gpu_gib
    if fits(est, gpu_gib, headroom):
        return nodes, (f"full fine-tune: sharded over one node it peaks at {peak:.1f} GiB per rank, within "
                       f"{limit:.1f} GiB: HSDP keeps the weights' all-gathers inside a node")
    return 1, (f"full fine-tune: sharded over one node it would peak at {peak:.1f} GiB per rank, over {limit:.1f} GiB: "
               "flat FSDP over every node")


def launch_replicate(cfg, world: int, gpus: int) -> tuple[int, str]:
    """(parallel.replicate, why) as slurm/jagg.sbatch runs `cfg` on `world` ranks of `gpus` a node: its
    replicas_per_node on several whole nodes, the config's own on one node (or a world that is not whole nodes)."""
    if world <= gpus or world % gpus:
        return cfg.parallel.replicate, "one node (or not whole nodes): as configured"
    return replicas_per_node(cfg, world // gpus, gpus)
