"""estimate/flops.py: a forward's FLOPs with each repeated block counted once and multiplied equal the whole
forward's count, total and attention, exactly: on the shipped families' real shapes (on the meta device) and on
toy stacks, including a forward that indexes its blocks by a config count (counted whole)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jagg_scale.estimate.flops import count, count_blocks

SHAPES = Path(__file__).resolve().parents[2] / "jagg_scale" / "estimate" / "shapes"


# SD3.5-M: 13 dual-attention blocks, 10 plain ones and a last context-pre-only one; FLUX.1: double and single lists;
# Z-Image: two refiner lists and the main one; Wan: a video's tokens; FLUX.2 [klein]: its shared modulation
@pytest.mark.parametrize("name", ["sd35_medium", "flux1_dev", "z_image", "wan21_t2v_14b", "flux2_klein"])
def test_a_shipped_transformer_counts_as_its_whole_forward(name):
    from jagg_scale.estimate.measure import model_inputs
    from jagg_scale.estimate.shapes import meta_module

    shape = json.loads((SHAPES / f"{name}.json").read_text())
    comp = shape["components"]["transformer"]
    m = meta_module(comp)
    args = model_inputs(shape["kind"], comp["config"], 1, 8, 8, 40, device="meta", frames=3 if "wan" in name else 1)
    whole = count(lambda: m(**args), attention=True)
    lists = [b for b in m.children() if isinstance(b, torch.nn.ModuleList)]
    assert count_blocks(m, lambda: m(**args)) == whole and whole[1] > 0
    assert [b for b in m.children() if isinstance(b, torch.nn.ModuleList)] == lists  # the whole lists put back


class Block(torch.nn.Module):
    def __init__(self, wide: bool):
        super().__init__()
        self.proj = torch.nn.Linear(8, 32 if wide else 16)
        self.back = torch.nn.Linear(32 if wide else 16, 8)

    def forward(self, x):
        q = self.proj(x)
        return x + self.back(q) + (q @ q.transpose(-1, -2) @ x).mean()


class Stack(torch.nn.Module):
    def __init__(self, by_index: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(i in (0, 3, 4)) for i in range(7)])
        self.head = torch.nn.Linear(8, 4)
        self.by_index = by_index

    def forward(self, x):
        blocks = [self.blocks[i] for i in range(7)] if self.by_index else self.blocks
        for b in blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("by_index", [False, True])
def test_a_toy_stack_of_two_block_shapes_counts_exactly(by_index):
    m = Stack(by_index).to("meta")
    x = torch.zeros(2, 5, 8, device="meta")
    whole = count(lambda: m(x), attention=True)
    assert whole[1] > 0 and count_blocks(m, lambda: m(x)) == whole
    assert len(m.blocks) == 7
