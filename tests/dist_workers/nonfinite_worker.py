"""2-process FSDP2 worker for tests/parallel/test_distributed.py::test_ranks_agree_on_non_finite_steps_and_saves: a loss
that is non-finite on rank 1 alone skips the step on both ranks, and a NaN in rank 1's weight shard makes save refuse on
both (no rank left waiting in the checkpoint's collectives).

    torchrun --nproc_per_node 2 nonfinite_worker.py OUT_JSON CKPT_DIR
"""

import json
import sys
from pathlib import Path

import torch

from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.dist import init_distributed, leave_launch
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.parallel.engine import NonFiniteError
from jagg_scale.train.config import TrainConfig
from jagg_scale.parallel.fsdp import FSDP2Engine

CFG = DiTConfig(image_size=8, in_channels=3, patch_size=4, hidden_size=32, depth=2, num_heads=2, vocab_size=64,
                max_prompt_length=4)


def step(engine, ctx, loss: torch.Tensor | None = None) -> bool:
    g = torch.Generator().manual_seed(ctx.rank)
    x, s = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    c = torch.randint(1, 64, (2, 4), generator=g)
    engine.backward(engine.model(x, s, c), torch.randn(2, 3, 8, 8, generator=g))
    engine.step(loss=loss)
    return engine.step_applied


def main(out_path: str, ckpt: str) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    torch.manual_seed(0)
    engine = FSDP2Engine(DiT(CFG).init_weights(zero_out=False), ParallelConfig(engine="fsdp2"),
                         TrainConfig(lr=1e-3), ctx)
    mine = {"good": step(engine, ctx, torch.tensor(1.0))}
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    mine["rank1_inf_loss"] = step(engine, ctx, torch.tensor(float("inf") if ctx.rank == 1 else 1.0))
    after = engine.full_state_dict()
    mine["unchanged"] = all(torch.equal(after[k], before[k]) for k in before)  # rank 0 holds the full weights
    if ctx.rank == 1:
        with torch.no_grad():
            next(iter(engine.model.parameters())).to_local().view(-1)[0] = float("nan")
    directory = Path(ckpt) / f"rank{ctx.rank}"
    directory.mkdir(parents=True)
    try:
        engine.save(directory)
        mine["refused"] = None
    except NonFiniteError as err:
        mine["refused"] = str(err)
    mine["files"] = len(list(directory.iterdir()))
    rows = ctx.all_gather_object(mine)
    if ctx.rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_launch(0)  # no interpreter teardown under the launcher (jagg_scale/parallel/dist.py)
