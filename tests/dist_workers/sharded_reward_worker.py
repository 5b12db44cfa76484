"""Run by tests/rewards/test_sharded_reward.py under `torchrun --nproc_per_node 2` (gloo on CPU): rewards sharded with
`jagg_scale.rewards.sharded.shard_reward` against the same rewards unsharded, each rank scoring its OWN photos.

  clip_score / pickscore / aesthetic on a tiny random CLIP (rank 0 saves it, barrier), imagenet_class on a random
  EfficientNet-Lite0: sharded scores == unsharded scores (allclose 1e-5, max |diff| reported), twice in a row
  layout     the sharded CLIPModel's parameters are DTensors (also after a forward: resharded, root included),
             this rank's local shard is ~1/2 of the parameters, logit_scale (0-d) is a plain replicated tensor,
             requires_grad off, eval mode
  no_modules a reward without torch_modules() -> TypeError

Writes <out>/rank<r>.json: {check: value, ...}.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from jagg_scale.parallel.dist import init_distributed, leave_launch
from jagg_scale.rewards import build_reward
from jagg_scale.rewards.base import Reward, RewardOutput
from jagg_scale.rewards.sharded import shard_reward

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' shared helpers
from tiny_clip import PROJ_DIM, make_tiny_clip  # noqa: E402

def make_assets(d: Path) -> None:
    """Tiny random CLIP (+ tokenizer, preprocessor config), an aesthetic head and Lite0 weights, under d."""
    from safetensors.torch import save_file

    from jagg_scale.rewards.clip import AestheticMLP
    from jagg_scale.rewards.imagenet import EfficientNetLite0

    make_tiny_clip(d / "clip", mean=(0.5, 0.4, 0.3), std=(0.25, 0.2, 0.3))
    head = AestheticMLP(PROJ_DIM)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, d / "head.safetensors")
    torch.save(EfficientNetLite0().state_dict(), d / "lite0.pth")


def photos(rank: int) -> torch.Tensor:
    """3 different scikit-image photos per rank, [3, 3, 96, 128] in [0, 1]."""
    import skimage.data as data

    names = [["astronaut", "coffee", "chelsea"], ["rocket", "immunohistochemistry", "hubble_deep_field"]][rank % 2]
    out = []
    for n in names:
        x = torch.from_numpy(np.ascontiguousarray(getattr(data, n)())).permute(2, 0, 1).float()[None] / 255.0
        out.append(F.interpolate(x, size=(96, 128), mode="bilinear", antialias=True, align_corners=False))
    return torch.cat(out).clamp(0, 1)


PROMPTS = [["an astronaut", "a cup of coffee", "a cat"], ["a rocket", "a tissue sample", "galaxies"]]
CLASSES = [["tabby", "espresso", "Egyptian cat"], ["missile", "mask", "volcano"]]


def main(out: Path) -> None:
    ctx = init_distributed(device="cpu")
    rank, world = ctx.rank, ctx.world_size
    assert world == 2, world
    res: dict = {"rank": rank}
    try:
        d = out / "assets"
        if rank == 0:
            d.mkdir(parents=True, exist_ok=True)
            make_assets(d)
        dist.barrier()
        images, prompts = photos(rank), PROMPTS[rank % 2]
        meta = [{"class": c} for c in CLASSES[rank % 2]]
        specs = {
            "clip_score": dict(path=str(d / "clip"), scale=2.5),
            "pickscore": dict(path=str(d / "clip"), normalize=False),
            "aesthetic": dict(clip_path=str(d / "clip"), head_path=str(d / "head.safetensors")),
            "imagenet_class": dict(weights_path=str(d / "lite0.pth")),
        }
        for name, opts in specs.items():
            plain = build_reward(name, device="cpu", batch_size=2, **opts)  # 2 chunks per call: 2 gathers per layer
            ref = plain(images, prompts, meta).scores
            sharded = shard_reward(build_reward(name, device="cpu", batch_size=2, **opts))
            got = [sharded(images, prompts, meta).scores for _ in range(2)]
            res[name] = {"ref": ref.tolist(), "sharded": got[0].tolist(), "again": got[1].tolist(),
                         "maxdiff": max(float((g - ref).abs().max()) for g in got),
                         "close": all(torch.allclose(g, ref, rtol=1e-5, atol=1e-5) for g in got),
                         "fsdp_units": sum(isinstance(m, FSDPModule) for m in sharded.torch_modules()[0].modules())}
            if name == "clip_score":
                res["layout"] = layout(sharded.torch_modules()[0], world)

        class NoModules(Reward):
            def __call__(self, images, prompts, metadata):
                return RewardOutput(scores=torch.zeros(len(prompts)))

        try:
            shard_reward(NoModules())
            res["no_modules"] = "no error"
        except TypeError as e:
            res["no_modules"] = str(e)
    except Exception:
        res["error"] = traceback.format_exc()
        raise
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
        ctx.close()


def layout(model: torch.nn.Module, world: int) -> dict:
    """How the (already called) sharded CLIPModel holds its parameters on this rank."""
    params = dict(model.named_parameters())
    dtensors = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    total = sum(p.numel() for p in dtensors.values())
    local = sum(p.to_local().numel() for p in dtensors.values())
    fsdp_units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    return {
        "n_params": len(params),
        "not_dtensor": sorted(set(params) - set(dtensors)),
        "total_numel": total,
        "local_numel": local,
        "local_frac": local / total,
        "world": world,
        "fsdp_units": fsdp_units,
        "requires_grad": any(p.requires_grad for p in params.values()),
        "training": any(m.training for m in model.modules()),
        "logit_scale_is_plain": type(model.logit_scale) is torch.nn.Parameter and model.logit_scale.ndim == 0,
    }


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_launch(0)  # no interpreter teardown under the launcher (jagg_scale/parallel/dist.py)
