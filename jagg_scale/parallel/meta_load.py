"""Start-up without the transformer on every rank's host: its skeleton on the meta device, each rank's shards read.

Before, every rank loaded the whole pipeline on its host, then the engine sharded the transformer onto the device:
Wan2.1 14B's 28 GB of bf16 weights (with a full fine-tune's KL reference copy, twice) on each of a node's 8 ranks,
read from shared storage by every rank of the job on every requeue. Now (parallel.meta_init, FSDP2):

    skeleton   the pipeline is loaded with its transformer(s) as skeletons (models/diffusers_common.py
               transformers_on_meta): parameters on the meta device, buffers real (computed by their modules, as a
               load computes them); LoRA is added to the skeleton, the KL reference copies it, all still on meta
    shard      FSDP2 shards the skeleton (parallel/fsdp.py parallelize: the master dtype cast on meta), then
               `materialize` allocates this rank's shards on its device and fills them: each parameter's rows of this
               rank read from the safetensors files with a slice read (a rank reads 1 / world of the weights, the job
               the checkpoint once), cast to the parameter's dtype on the way; the real buffers put back; lora_A drawn
               as add_lora draws it (models/lora.py lora_a_init: the same values on the host path), lora_B zeros
    host       what a rank holds on its host is the frozen parts (VAE, text encoders: moved to the device next) and
               one parameter's rows at a time

The weights are the ones `from_pretrained` would have loaded, bit for bit (tests/parallel/test_meta_init.py: a run
started on meta equals one started on the host). Sources: `model.meta_weights`, {parameter-name prefix: a
component's directory} (models/__init__.py), e.g. {"transformer.": PIPE/transformer}; two experts name each.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..models import safetensors_header

log = logging.getLogger(__name__)

__all__ = ["is_meta", "materialize"]

_WRAPPERS = ("_orig_mod.", "base_layer.")  # torch.compile's and peft's infixes: not in the checkpoint's names


def is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class _Files:
    """The safetensors files of a component directory: which file holds each key (an index, or every file's
    header), opened lazily, data read on demand (safe_open maps the file: a slice reads only its bytes)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no safetensors weights in {self.directory}")
        self.where: dict[str, Path] = {}
        for f in files:
            self.where.update({k: f for k in safetensors_header(f) if k != "__metadata__"})
        self._open: dict[Path, object] = {}

    def read(self, key: str, shape: torch.Size, offset: tuple[int, ...], local: tuple[int, ...]) -> torch.Tensor:
        from safetensors import safe_open

        f = self.where.get(key)
        if f is None:
            raise ValueError(f"{self.directory}: no weight {key!r} for the model's parameter (a checkpoint of another "
                             "model?)")
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt", device="cpu")
        part = self._open[f].get_slice(key)
        if tuple(part.get_shape()) != tuple(shape):
            raise ValueError(f"{f}: {key} is {tuple(part.get_shape())}, the model's parameter {tuple(shape)}")
        if not len(shape):
            return self._open[f].get_tensor(key)
        return part[tuple(slice(o, o + n) for o, n in zip(offset, local))]


def _key(name: str, prefix: str) -> str:
    key = name[len(prefix):]
    for infix in _WRAPPERS:
        key = key.replace(infix, "")
    return key


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, sources: dict[str, Path], *, lora_rank: int = 0,
                seed: int = 0) -> None:
    """Allocate `module`'s shards (FSDP2 DTensors, sharded on meta) on `device` and fill them (module docstring)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ..models.lora import lora_a_init

    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}
    owns = getattr(module, "owns_frozen", None)  # a diffusers adapter's frozen parts follow its _apply: not here
    if owns is not None:
        module.owns_frozen = False
    try:
        module.to_empty(device=device)
    finally:
        if owns is not None:
            module.owns_frozen = owns
    for name, b in module.named_buffers():
        if name in buffers:
            b.copy_(buffers[name])
    del buffers
    files = {prefix: _Files(d) for prefix, d in sources.items()}
    filled = 0
    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        else:
            shape, offset = tuple(p.shape), (0,) * p.dim()
        if "lora_B" in name:
            local.zero_()
            continue
        prefix = next((k for k in files if name.startswith(k)), None)
        if prefix is None:
            raise ValueError(f"parameter {name}: no weights source among {sorted(files)}")
        if "lora_A" in name:  # the rows of the values add_lora draws (its names: the transformer's own)
            full = lora_a_init(name[len("transformer."):].replace("_orig_mod.", ""), p.shape, lora_rank, seed)
            part = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        else:
            part = files[prefix].read(_key(name, prefix), p.shape, tuple(offset), tuple(shape))
        if part.numel():
            local.copy_(part.reshape(local.shape))
        filled += part.numel()
    for name, b in module.named_buffers():  # a persistent buffer the checkpoint holds: its value, not the init's
        prefix = next((k for k in files if name.startswith(k)), None)
        if prefix is not None and _key(name, prefix) in files[prefix].where:
            b.copy_(files[prefix].read(_key(name, prefix), b.shape, (0,) * b.dim(), tuple(b.shape)))
    log.info("meta start-up: %d weights of this rank's shards read from %s", filled,
             ", ".join(str(d) for d in sources.values()))
