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
trajectories are the memory model's "rollout storage" of a trainer rank, the weights the trained parameters in fp32.
Not modelled: the replica's own memory (it is the policy's inference footprint, checked by jagg-train on start) and
a pool that waits longer than the other's step for a reward whose latency varies."""

from __future__ import annotations

from .memory import DoesNotDivide, estimate, prepare
from .steptime import step_seconds

__all__ = ["price_split", "splits"]

ROLLOUT = ("rollout", "reference", "encode", "decode")
TRAINER = ("train", "train_nograd", "encode", "eval")


def splits(world: int) -> list[int]:
    """Rollout pool sizes R of a `world`-GPU launch the pools accept: R <= world / 2 dividing world - R."""
    return [r for r in range(1, world // 2 + 1) if (world - r) % r == 0]


def _prepared(cfg, world: int, shapes, overhead_gb: float, gpu_gib: float):
    s = prepare(cfg, world, shapes, False, overhead_gb, gpu_gib)
    return s, estimate(s)


def price_split(cfg, world: int, rollout: int, *, k: int = 1, reward_s: float = 0.0, links, a2a_gbps: float,
                shapes=None, overhead_gb: float = 1.5, gpu_gib: float = 79.2) -> dict:
    """{pool: seconds} of one steady step of `world` GPUs split into `rollout` rollout ranks and the rest trainers
    (module docstring); DoesNotDivide when a pool's rows do not split over its ranks."""
    trainers = world - rollout
    if rollout < 1 or trainers < rollout or trainers % rollout:
        raise DoesNotDivide(f"{rollout} rollout ranks of {world}: each must serve the same number of trainers")
    sr, er = _prepared(cfg, rollout, shapes, overhead_gb, gpu_gib)
    st, et = _prepared(cfg, trainers, shapes, overhead_gb, gpu_gib)
    r = step_seconds(sr, er, links=links, a2a_gbps=a2a_gbps)
    t = step_seconds(st, et, links=links, a2a_gbps=a2a_gbps)
    bw = links.ib_gbps * 1e9
    traj = et["phases"]["update"]["components"]["rollout storage"]  # one trainer's rows of a step
    weights = 4 * (st["stats"]["lora_params"] if st["lora_rank"] else st["stats"]["params"])
    sample_s = sum(r[p] for p in ROLLOUT)
    send_s = (trainers // rollout) * traj / bw
    trainer_s = sum(t[p] for p in TRAINER) + t["comm"]["exposed"]["train"] + rollout * weights / bw
    rollout_s = max(sample_s, reward_s) + send_s
    step = max(rollout_s, trainer_s) if k >= 1 else sample_s + reward_s + send_s + trainer_s
    return {"gpus": world, "rollout_ranks": rollout, "trainers": trainers, "rollout_pool": rollout_s,
            "trainer_pool": trainer_s, "step": step, "traj_gb": traj / 1e9, "weights_gb": weights / 1e9, "k": k}
