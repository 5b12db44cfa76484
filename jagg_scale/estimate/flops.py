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


def _is_attention(op) -> bool:
    # on the meta device SDPA runs as its math: the batched matmuls, which nothing else in these transformers uses
    return "bmm" in str(op) or "scaled_dot_product" in str(op)


def count(fn: Callable[[], object], attention: bool = False):
    """fn's FLOPs; attention=True: (all, the attention's)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn()
    total = float(fc.get_total_flops())
    if not attention:
        return total
    return total, float(sum(v for op, v in fc.get_flop_counts()["Global"].items() if _is_attention(op)))


def count_blocks(module: torch.nn.Module, fn: Callable[[], object]) -> tuple[float, float]:
    """(all, the attention's) FLOPs of fn, a forward of `module`, with its repeated blocks counted once each."""
    from torch.utils.flop_counter import FlopCounterMode

    lists = [(n, m) for n, m in module.named_children() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    kept: list[tuple[str, torch.nn.ModuleList, list[int], list[int]]] = []  # name, whole list, kept indices, repeats
    for name, blocks in lists:
        first: dict[str, int] = {}
        repeats: dict[str, int] = {}
        for i, b in enumerate(blocks):
            key = repr(b)
            first.setdefault(key, i)
            repeats[key] = repeats.get(key, 0) + 1
        kept.append((name, blocks, list(first.values()), [repeats[k] - 1 for k in first]))
    if all(len(idx) == len(blocks) for _, blocks, idx, _ in kept):
        return count(fn, attention=True)
    try:
        for name, blocks, idx, _ in kept:
            setattr(module, name, torch.nn.ModuleList([blocks[i] for i in idx]))
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            fn()
        ran = True
    except (IndexError, KeyError, ValueError, RuntimeError):  # a forward tied to its whole lists
        ran = False
    finally:
        for name, blocks, _, _ in kept:
            setattr(module, name, blocks)
    if not ran:  # counted whole, on the whole lists again
        return count(fn, attention=True)
    counts = fc.get_flop_counts()
    root = type(module).__name__
    if any(f"{root}.{name}.{j}" not in counts for name, _, idx, _ in kept for j in range(len(idx))):
        return count(fn, attention=True)  # a kept block that did not run (or ran under another name): whole
    total = float(fc.get_total_flops())
    attention = float(sum(v for op, v in counts["Global"].items() if _is_attention(op)))
    for name, _, _, extra in kept:
        for j, n in enumerate(extra):
            ops = counts.get(f"{root}.{name}.{j}", {})
            total += n * float(sum(ops.values()))
            attention += n * float(sum(v for op, v in ops.items() if _is_attention(op)))
    return total, attention
