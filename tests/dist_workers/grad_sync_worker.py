"""2-process FSDP2 worker for tests/parallel/test_distributed.py::test_grad_sync_every_keeps_gradients_sharded: per
parallel.grad_sync, the gradient bytes a rank holds after a backward off the accumulation boundary (unsharded
fp32 block gradients FSDP2 keeps for a later reduce-scatter, plus the sharded .grad), the reduce-scatters each
backward issues, and the final gradient.

    torchrun --nproc_per_node 2 grad_sync_worker.py OUT_JSON
"""

import json
import sys

import torch
from torch.distributed.fsdp import FSDPModule

from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.dist import init_distributed, leave_launch
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.train.config import TrainConfig
from jagg_scale.parallel.fsdp import FSDP2Engine

CFG = DiTConfig(image_size=8, in_channels=3, patch_size=2, hidden_size=64, depth=4, num_heads=4, vocab_size=64,
                max_prompt_length=4)


def held_grad_bytes(model) -> dict:
    """Unsharded gradients FSDP2 keeps between backwards, and the local shards of .grad (bytes on this rank)."""
    unsharded = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    for t in (fp.unsharded_accumulated_grad, getattr(fp._unsharded_param, "grad", None)):
                        if t is not None:
                            unsharded += t.numel() * t.element_size()
    sharded = sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return {"unsharded": unsharded, "sharded": sharded}


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    result = {}
    for mode in ("boundary", "every"):
        torch.manual_seed(0)
        model = DiT(CFG).init_weights(zero_out=False)
        full_bytes = sum(p.numel() * 4 for p in model.parameters())
        engine = FSDP2Engine(model, ParallelConfig(engine="fsdp2", grad_sync=mode), TrainConfig(), ctx)
        g = torch.Generator().manual_seed(ctx.rank)
        held, counted = None, []
        for i, last in enumerate((False, True)):
            x, s = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g)
            c = torch.randint(1, 64, (2, 4), generator=g)
            v = engine.model(x, s, c)
            with engine.comm.phase("train"):  # the backward's own collectives (the trainer counts the same way)
                engine.backward(v, torch.randn(2, 3, 8, 8, generator=g), last=last)
            counted.append(engine.comm.take().get("comm_train_reduce_scatter", 0))
            if i == 0:
                held = held_grad_bytes(engine.model)
        grad = torch.cat([p.grad.full_tensor().flatten() for p in engine.model.parameters()])
        units = sum(isinstance(m, FSDPModule) for m in engine.model.modules())
        result[mode] = {"held": held, "full_bytes": full_bytes, "reduce_scatters": counted, "units": units,
                        "grad": grad.tolist() if ctx.rank == 0 else None}
    if ctx.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_launch(0)  # no interpreter teardown under the launcher (jagg_scale/parallel/dist.py)
