"""Run by tests/train/test_rollout_batch_ranks.py under `torchrun --nproc_per_node 2` (gloo on CPU): sampling.chunk_size
auto resolved by ranks whose GPUs differ (rank 0 given 79.2 GiB, rank 1 40 GiB: a mixed partition), on
configs/sd35m_pickscore.yaml's estimate. Each rank's own figure (train/policy.rollout_batch) and the agreed one
(agreed_rollout_batch: one all-gather, the smallest) go to <out>/rank<r>.json: {"gib", "local", "agreed"}.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from jagg_scale.parallel.dist import init_distributed, leave_launch
from jagg_scale.train.config import load_config
from jagg_scale.train.policy import agreed_rollout_batch, rollout_batch

ROOT = Path(__file__).resolve().parents[2]
GIB = (79.2, 40.0)  # per rank


def main(out: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ctx = init_distributed("cpu")
    try:
        cfg = load_config(ROOT / "configs" / "sd35m_pickscore.yaml", [], check_files=False)  # no model files here
        cpu, gib = torch.device("cpu"), GIB[ctx.rank]
        res = {"gib": gib, "local": rollout_batch(cfg, ctx.world_size, cpu, gpu_gib=gib),
               "agreed": agreed_rollout_batch(cfg, ctx, cpu, gpu_gib=gib)}
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(res))
    finally:
        ctx.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_launch(0)  # no interpreter teardown under the launcher (jagg_scale/parallel/dist.py)
