"""The transformer blocks of a model: the units FSDP2 shards, activation checkpointing recomputes and
`parallel.compile` compiles.

    block_slots(module)      (list, index) of every item with parameters of every outermost nn.ModuleList (the
                             DiT's `blocks`, SD3's `transformer_blocks`, FLUX's `transformer_blocks` and
                             `single_transformer_blocks`, a CLIP's text and vision encoder layers)
    repeated_layers(module)  the modules of those slots
    compile_blocks(module)   torch.compile each block in place (torchtitan's per-block compile)
    enable_activation_checkpointing(model)   parallel.activation_checkpointing, the same on every engine: the
                             model's own per-block checkpointing (diffusers' for sd3/flux, the DiT's), which
                             recomputes each block in backward and keeps every parameter name as it is

Dependency-free within the package (torch only), so the single-process engine (engine.py) and FSDP2 (fsdp.py)
both use it without importing each other.
"""

from __future__ import annotations

from torch import nn

__all__ = ["block_slots", "compile_blocks", "enable_activation_checkpointing", "repeated_layers"]


def block_slots(module: nn.Module) -> list[tuple[nn.ModuleList, int]]:
    """(list, index) of every item with parameters of every outermost nn.ModuleList under `module`, in pre-order
    (lists nested inside an item already taken are skipped, since that item is sharded as one unit)."""
    taken: list[str] = []
    slots: list[tuple[nn.ModuleList, int]] = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        for i, item in enumerate(child):
            if isinstance(item, nn.Module) and any(True for _ in item.parameters()):
                taken.append(f"{name}.{i}" if name else str(i))
                slots.append((child, i))
    return slots


def repeated_layers(module: nn.Module) -> list[nn.Module]:
    """The modules of `block_slots`: the units fully_shard is applied to before the root."""
    return [blocks[i] for blocks, i in block_slots(module)]


def compile_blocks(module: nn.Module) -> list[nn.Module]:
    """torch.compile every block of `module` in place (`nn.Module.compile`) and return the blocks.

    Per block rather than the whole model, as torchtitan does: the blocks of a list share their code, so one
    compiled graph serves all of them (compile time of one block, not of the model), and the rest of the forward
    (embedders, the diffusers pipeline's Python) stays eager. In place rather than `torch.compile(block)`, which
    would wrap each block in an OptimizedModule and add `_orig_mod.` to every parameter name: checkpoints, LoRA
    exports and resume would then differ between compile on and off. The compile itself happens at the first
    call; wrappers applied afterwards (activation checkpointing, fully_shard) wrap the compiled block."""
    slots = block_slots(module)
    if not slots:
        raise ValueError(f"parallel.compile: no transformer blocks found on {type(module).__name__}")
    blocks = [blocks[i] for blocks, i in slots]
    for block in blocks:
        block.compile()
    return blocks


def enable_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Per-block activation checkpointing through the model's own `enable_gradient_checkpointing()` (the block
    loop calls each block under non-reentrant torch.utils.checkpoint in train mode with grad): one block's
    activations alive in backward, the same gradients, parameter names unchanged (checkpoints and exports do not
    depend on it). Every engine applies it before placing or sharding the model."""
    enable = getattr(model, "enable_gradient_checkpointing", None)
    if enable is None:
        raise ValueError(f"parallel.activation_checkpointing: {type(model).__name__} has no per-block checkpointing "
                         "(enable_gradient_checkpointing)")
    enable()
    return model
