"""Sharded reward models: FSDP2 `fully_shard` in inference mode, so a big reward model (PickScore's CLIP-H, HPS,
a VLM judge) costs 1/world of its weights per rank instead of all of them.

    reward = shard_reward(build_reward(name, **options))      # collective: every rank calls it

Each rank still scores its OWN images: it calls the reward on its own batch as before, and FSDP2 all-gathers
one layer's weights just before that layer runs and frees them right after (`reshard_after_forward=True`, also
for the root), so the peak is the sharded model plus the root's own parameters (embeddings, final norms,
projections: gathered for the duration of a call) plus about one unsharded layer. Nothing else changes: the
gathered weights are the original ones, so the scores are the unsharded scores (bit-identical in the 2-process
CPU test, tests/rewards/test_sharded_reward.py), and the reward API is the same.

Protocol: a reward exposes the modules it scores with as `def torch_modules(self) -> list[torch.nn.Module]`
(the CLIP family returns its CLIPModel, imagenet_class its classifier). For each module `shard_module`
(parallel.fsdp.shard_for_inference, with the CLIP entry points below) applies `fully_shard` to its repeated
layers (parallel.fsdp's block finder, the one the training engine uses: every item with parameters of every
outermost `nn.ModuleList`; for a transformers CLIPModel `text_model.encoder.layers[i]` and
`vision_model.encoder.layers[i]`), then to the module itself (the rest: embeddings, final norms, projections), on
parallel.fsdp's mesh (1-D over all ranks). Parameters keep the module's dtype (no mixed-precision cast),
requires_grad is off, the module is in eval mode.

Methods other than forward: FSDP2 runs its pre-forward hook (lazy init, which also picks the root, and the
all-gather of the root's own parameters) only when the module is *called*. transformers' `CLIPModel.
get_image_features` / `get_text_features` are not forward: they call submodules directly, so without help the
root's embeddings and projections would still be sharded DTensors when used (tried: the patch-embedding conv
fails with "got mixed torch.Tensor and DTensor"), and the first layer to run would lazily become the FSDP root.
`register_fsdp_forward_method` wraps each such method (`forward_methods`, by default the two CLIP ones where
present) in the root's pre/post-forward hooks, so the root is gathered and freed around each call like a forward.
Sharding only the layers and leaving the root replicated would also work but keeps the largest non-layer tensors
(CLIP's token embedding, ~50M parameters for ViT-H) on every rank. Scalar (0-d) parameters, e.g. CLIP's
`logit_scale`, are left out of sharding (`ignored_params`): they cost nothing to replicate, and PickScore reads
`logit_scale` outside any forward.

Collectives: each forward of a sharded layer is an all-gather over the mesh, so every rank must call the reward
the same number of times with the same number of chunks (`ceil(n_images / batch_size)` forwards per model call).
The trainer guarantees equal per-rank image counts: every rank generates and scores the same number of images
per step (rows are split evenly across ranks), with the same reward batch_size. An uneven call pattern, or a
reward that raises on one rank before its model runs, leaves the other ranks waiting in an all-gather until the
process-group timeout; NaN scores (a sample that fails after the model ran) are harmless.

Wiring: the trainer (not this module) applies `shard_reward` when the config's `reward.shard: true` and the world
size is > 1; `shard` is the trainer's option, never passed to `build_reward`.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..parallel.fsdp import build_mesh, repeated_layers, shard_for_inference

__all__ = ["shard_reward", "shard_module", "repeated_layers", "FORWARD_METHODS"]

FORWARD_METHODS = ("get_image_features", "get_text_features")  # transformers CLIPModel entry points besides forward


def _default_mesh(modules: Iterable[nn.Module]) -> DeviceMesh:
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    return build_mesh(device.type, dist.get_world_size())


def shard_module(module: nn.Module, mesh: DeviceMesh, forward_methods: Iterable[str] = FORWARD_METHODS) -> nn.Module:
    """fully_shard `module` in place for inference (layers, then root); a module already sharded is left as is."""
    return shard_for_inference(module, mesh, forward_methods)


def shard_reward(reward, mesh: DeviceMesh | None = None, forward_methods: Iterable[str] = FORWARD_METHODS):
    """Shard every module of `reward.torch_modules()` across `mesh` (default: 1-D over all ranks, on the
    modules' device type) and return the same reward object, now scoring with sharded weights.

    Collective (every rank must call it, on the same reward config). Raises RuntimeError when torch.distributed
    is not initialised and TypeError when the reward does not implement `torch_modules`."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard_reward: torch.distributed is not initialised (init_distributed / "
                           "init_process_group first); sharding a reward needs a process group")
    get_modules = getattr(reward, "torch_modules", None)
    if not callable(get_modules):
        name = getattr(reward, "name", type(reward).__name__)
        raise TypeError(f"shard_reward: reward {name!r} ({type(reward).__name__}) has no torch_modules(); only "
                        "rewards that expose their torch modules can be sharded (set reward.shard: false)")
    modules = [m for m in get_modules() if m is not None]
    if not modules:
        raise ValueError(f"shard_reward: reward {getattr(reward, 'name', reward)!r} returned no torch modules")
    mesh = mesh if mesh is not None else _default_mesh(modules)
    for m in modules:
        shard_module(m, mesh, forward_methods)
    return reward
