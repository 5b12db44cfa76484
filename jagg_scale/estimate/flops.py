"""FLOPs of a module's forward on the meta device, counted with torch's FlopCounterMode.

A DiT repeats one block shape tens of times (Qwen-Image 60, Wan 40, SD3.5-L 38), and every block of a shape, fed the
same-shaped tokens, does the same arithmetic; the counter's dispatch costs ~0.1 s a block (5.6 s a Qwen-Image forward,
seven of them a `jagg-estimate` call). `count_blocks` runs each block list with one block per distinct block (its
repr: class, layer types and sizes) in the list's order, and adds the repeats' share from that block's own count
(FlopCounterMode attributes every op to the modules it ran in). The blocks are shape-preserving, so the shorter list
feeds the layers after it the same shapes; exactness is checked against the whole forward for every shipped family
(tests/estimate/test_flops.py). A forward that cannot run on the shorter lists (one that indexes its blocks by a
config count) is counted whole."""

from __future__ import annotations

from typing import Callable

import torch


def _split(ops: dict) -> tuple[float, float]:
    """(all, the attention's) FLOPs of one module's op counts. On the meta device SDPA runs as its math: the batched
    matmuls, which nothing else in these transformers uses."""
    return (float(sum(ops.values())),
            float(sum(v for op, v in ops.items() if "bmm" in str(op) or "scaled_dot_product" in str(op))))


def count(fn: Callable[[], object], attention: bool = False):
    """fn's FLOPs; attention=True: (all, the attention's)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn()
    both = _split(fc.get_flop_counts()["Global"])
    return both if attention else both[0]


def count_blocks(module: torch.nn.Module, fn: Callable[[], object]) -> tuple[float, float]:
    """(all, the attention's) FLOPs of fn, a forward of `module`, with its repeated blocks counted once each."""
    from torch.utils.flop_counter import FlopCounterMode

    kept: list[tuple[str, torch.nn.ModuleList, list[int], list[int]]] = []  # name, whole list, kept indices, repeats
    for name, blocks in module.named_children():
        if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) < 2:
            continue
        first: dict[str, int] = {}
        repeats: dict[str, int] = {}
        for i, b in enumerate(blocks):
            key = repr(b)
            first.setdefault(key, i)
            repeats[key] = repeats.get(key, 0) + 1
        kept.append((name, blocks, list(first.values()), [repeats[k] - 1 for k in first]))
    if all(len(idx) == len(blocks) for _, blocks, idx, _ in kept):
        return count(fn, attention=True)
    counts: dict = {}
    try:
        for name, blocks, idx, _ in kept:
            setattr(module, name, torch.nn.ModuleList([blocks[i] for i in idx]))
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            fn()
        counts = fc.get_flop_counts()
    except (IndexError, KeyError, ValueError, RuntimeError):  # a forward tied to its whole lists: counts stays empty
        pass
    finally:
        for name, blocks, _, _ in kept:
            setattr(module, name, blocks)
    root = type(module).__name__
    if not counts or any(f"{root}.{name}.{j}" not in counts for name, _, idx, _ in kept for j in range(len(idx))):
        return count(fn, attention=True)  # it did not run, or a kept block did not (or under another name): whole
    total, attention = _split(counts["Global"])
    for name, _, _, extra in kept:
        for j, n in enumerate(extra):
            block, block_attention = _split(counts[f"{root}.{name}.{j}"])
            total, attention = total + n * block, attention + n * block_attention
    return total, attention
