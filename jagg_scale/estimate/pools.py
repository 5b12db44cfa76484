"""The split pipeline priced (pools/, issue 38): a trainer pool of T GPUs and a rollout pool of R, k steps apart.

    rollout pool   the rollout, the KL reference, the prompts' encode and the decode of its share (all rows / R
                   a rank), on a replica (no FSDP gathers), and the send of each trainer's trajectories; a reward's
                   latency after sampling (`reward_s`, which a synchronous step waits in full) overlaps the next
                   step's sampling (rollout_pool.py's sender thread): the pool's cycle is the longer of the two
    trainer pool   the update (with-grad and no-grad passes and their exposed collectives), the encode and the
                   evaluation's share at T ranks, plus the adapter gathered and sent to the R rollout ranks
    steady step    k >= 1: the slower pool (each overlaps the other); k = 0: both in turn, the reward's latency
                   between them

Transfers cross the network at `links.ib_gbps` (a rollout and a trainer rank are on different nodes in general): the
trajectories are the memory model's "rollout storage" of a trainer rank, the weights the trained parameters in the
dtypes the replica computes with (pools/replica.py).

A rollout rank's memory (replica_memory): the policy whole in those dtypes (no shards, gathers, gradients, optimizer
states or EMA), a full fine-tune's KL reference likewise, the frozen encoders, VAE and reward models, its served rows'
conditioning, and the rollout phase of the memory model at its sampling chunk (auto: the trainer pool's, or the largest
smaller one that fits: replica_batch), plus what the pipeline adds: the previous step's trajectories in the sender
thread's hands with one trainer's share packed for its send, and one part of a policy version received
(pools/messages.py WEIGHT_PART_BYTES). A split whose rollout rank does not fit is not offered. Not modelled: a pool
that waits longer than the other's step for a reward whose latency varies."""

from __future__ import annotations

from ..pools.messages import WEIGHT_PART_BYTES
from .memory import DoesNotDivide, GiB, estimate, prepare
from .steptime import step_seconds

__all__ = ["price_split", "replica_batch", "replica_memory", "splits"]

ROLLOUT = ("rollout", "reference", "encode", "decode")
TRAINER = ("train", "train_nograd", "encode", "eval")


def splits(world: int) -> list[int]:
    """Rollout pool sizes R of a `world`-GPU launch the pools accept: R <= world / 2 dividing world - R."""
    return [r for r in range(1, world // 2 + 1) if (world - r) % r == 0]


def _prepared(cfg, world: int, shapes, overhead_gb: float, gpu_gib: float):
    s = prepare(cfg, world, shapes, False, overhead_gb, gpu_gib)
    return s, estimate(s)


def _cast(cfg, s: dict) -> bool:
    """Whether the replica computes in the 16-bit compute dtype (FSDP2's block gathers, ZeRO-3's partitions)."""
    return s["bf16"] and cfg.parallel.engine != "none"


def sent_bytes(cfg, s: dict) -> float:
    """A policy version as trainer 0 sends it: the trainable parameters in the replica's dtypes."""
    st = s["stats"]
    return (2 if _cast(cfg, s) else 4) * (st["lora_params"] if s["lora_rank"] else st["params"])


def replica_memory(cfg, s: dict, chunk: int, per_rollout: int) -> dict[str, float]:
    """{component: bytes} of a rollout rank at its peak (module docstring): `s` prepared at the rollout pool's size
    (a rank's rows: its served trainers' rows), `chunk` the trainer pool's sampling chunk, `per_rollout` the trainers
    one rollout rank serves."""
    st, lora, half = s["stats"], s["lora_rank"] > 0, s["bf16"]
    cast = _cast(cfg, s)
    root = st["root_params"] if cfg.parallel.engine == "fsdp2" else 0  # FSDP2 leaves the root's parameters as placed
    if lora:  # the frozen base as held, the adapter (inside the blocks) as its block computes
        weights = (2 if half else 4) * st["params"] + (2 if cast else 4) * st["lora_params"]
    else:  # a full fine-tune: the master dtype unless cast
        weights = (2 * (st["params"] - root) + 4 * root) if cast else 4 * st["params"]
    rollout = estimate({**s, "sharded": False}, sampling_batch=chunk)
    comp = dict(rollout["phases"]["rollout"]["components"])
    store = rollout["phases"]["update"]["components"]["rollout storage"]  # this rank's rows of a step
    for gone in ("optimizer states", "EMA", "gradients", "FSDP2 gathered weights + reduce buffers"):
        comp.pop(gone, None)
    comp["transformer weights"] = weights
    if comp.get("KL reference"):  # the frozen copy in the replica's dtypes, whole
        comp["KL reference"] = (2 * st["params"] if cast else s["ref_bytes"] * st["params"]) + st["buffers"]
    comp["the previous step's rollout, being sent"] = store + store / per_rollout
    comp["a policy version's part received"] = min(sent_bytes(cfg, s), WEIGHT_PART_BYTES)  # (+ its tensors' views)
    return comp


def replica_batch(cfg, sr: dict, trainer_chunk: int, per_rollout: int, gpu_gib: float, headroom: float = 0.10
                  ) -> int:
    """sampling.chunk_size auto on a rollout rank: the trainer pool's chunk (what a synchronous run's ranks sample
    with), or the largest smaller one whose replica_memory fits `gpu_gib` with `headroom` (1 when none does)."""
    limit = (1 - headroom) * gpu_gib * GiB
    for bs in range(trainer_chunk, 1, -1):
        if sum(replica_memory(cfg, sr, bs, per_rollout).values()) <= limit:
            return bs
    return 1


def price_split(cfg, world: int, rollout: int, *, k: int = 1, reward_s: float = 0.0, links, a2a_gbps: float,
                shapes=None, overhead_gb: float = 1.5, gpu_gib: float = 79.2) -> dict:
    """{pool: seconds} of one steady step of `world` GPUs split into `rollout` rollout ranks and the rest trainers
    (module docstring); DoesNotDivide when a pool's rows do not split over its ranks."""
    trainers = world - rollout
    if rollout < 1 or trainers < rollout or trainers % rollout:
        raise DoesNotDivide(f"{rollout} rollout ranks of {world}: each must serve the same number of trainers")
    sr, er = _prepared(cfg, rollout, shapes, overhead_gb, gpu_gib)
    st, et = _prepared(cfg, trainers, shapes, overhead_gb, gpu_gib)
    chunk = et["sampling_batch"]
    if cfg.sampling.chunk_size == "auto":  # as the rollout rank resolves it (rollout_pool.py)
        chunk = replica_batch(cfg, sr, chunk, trainers // rollout, gpu_gib)
    replica = replica_memory(cfg, sr, chunk, trainers // rollout)
    r = step_seconds(sr, er, links=links, a2a_gbps=a2a_gbps)
    t = step_seconds(st, et, links=links, a2a_gbps=a2a_gbps)
    bw = links.ib_gbps * 1e9
    traj = et["phases"]["update"]["components"]["rollout storage"]  # one trainer's rows of a step
    weights = sent_bytes(cfg, st)
    sample_s = sum(r[p] for p in ROLLOUT)
    send_s = (trainers // rollout) * traj / bw
    trainer_s = sum(t[p] for p in TRAINER) + t["comm"]["exposed"]["train"] + rollout * weights / bw
    rollout_s = max(sample_s, reward_s) + send_s
    step = max(rollout_s, trainer_s) if k >= 1 else sample_s + reward_s + send_s + trainer_s
    return {"gpus": world, "rollout_ranks": rollout, "trainers": trainers, "rollout_pool": rollout_s,
            "trainer_pool": trainer_s, "step": step, "traj_gb": traj / 1e9, "weights_gb": weights / 1e9, "k": k,
            "replica_gib": sum(replica.values()) / GiB, "replica_chunk": chunk,
            "replica": {c: b / GiB for c, b in replica.items() if b}}
