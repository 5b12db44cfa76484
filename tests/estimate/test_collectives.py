"""The step-time model's data-parallel collectives (jagg_scale/estimate/collectives.py): the bytes of a pass's
all-gathers and reduce-scatters off a module's parameters as FSDP2 shards them (a tiny module counted by hand, and
the estimator's counts against the real SD3.5-medium transformer on the meta device), their seconds at the stated
links, the overlap rule, and what each layout (HSDP, flat FSDP across nodes, ZeRO-3, Flow-GRPO's DDP) costs a step."""

from pathlib import Path

import pytest
import torch
from extras import need
from torch import nn

need("diffusers")
need("transformers")

from jagg_scale.estimate import collectives as C  # noqa: E402 - after the extras check
from jagg_scale.estimate import memory as E  # noqa: E402
from jagg_scale.estimate import steptime as T  # noqa: E402
from jagg_scale.train.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "sd35m_pickscore.yaml"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)  # 32*64 + 64 + 64*32 + 32 = 4192 weights
        self.adapter = nn.Linear(32, 4, bias=False)  # 128, the trained ones


class Tiny(nn.Module):
    """A LoRA-like model under bf16: the frozen base held in bf16, an fp32 adapter in each of its 3 blocks."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Linear(16, 32), nn.Linear(32, 8)  # the root: 544 + 264 = 808 weights
        self.blocks = nn.ModuleList([Block() for _ in range(3)])


def tiny() -> Tiny:
    with torch.device("meta"):
        m = Tiny()
    for name, p in m.named_parameters():
        trained = "adapter" in name
        p.requires_grad_(trained)
        if not trained:
            p.data = p.data.to(torch.bfloat16)
    return m


# by hand: the root gathered as held (808 bf16 weights), each block in bf16 (4192 + 128 weights), the adapter's
# gradient reduced in fp32 (128 x 4 bytes a block, none at the root)
ROOT_GATHER, BLOCK_GATHER, BLOCK_REDUCE = 808 * 2, (4192 + 128) * 2, 128 * 4


def test_a_tiny_modules_units_are_its_hand_counted_bytes():
    gather, reduce = C.units_of_module(tiny(), param_bytes=2)
    assert gather == [ROOT_GATHER] + [BLOCK_GATHER] * 3 and reduce == [0] + [BLOCK_REDUCE] * 3
    # the estimator's counts (shapes.transformer_stats') give the same
    stats = {"root_params": 808, "block_params": [4192] * 3, "block_lora": [128] * 3, "lora_params": 3 * 128}
    assert C.units(stats, lora=True, half=True) == (gather, reduce)
    # a full fine-tune of the same weights in float32 masters: blocks gathered in bf16, the root in fp32, all reduced
    full = {"root_params": 808, "block_params": [4320] * 3}
    assert C.units(full, lora=False, half=True) == ([808 * 4] + [4320 * 2] * 3, [808 * 4] + [4320 * 4] * 3)


def test_a_passs_collectives_are_its_units_bytes_over_the_links():
    gather, reduce = C.units_of_module(tiny(), param_bytes=2)
    links = C.Links(nvlink_gbps=300.0, ib_gbps=50.0, gpus_per_node=8)
    ring = 7 / 8 / 300e9  # a ring of 8 inside a node
    one_node = C.pass_comm(gather, reduce, C.Layout("fsdp2", 8, shard=8), links)
    assert one_node.gathered_bytes == ROOT_GATHER + 3 * BLOCK_GATHER == 27536
    assert one_node.gather == pytest.approx(27536 * ring)
    assert one_node.gather_head == pytest.approx((ROOT_GATHER + BLOCK_GATHER) * ring)  # the root, then block 0
    assert one_node.reduce == pytest.approx(3 * BLOCK_REDUCE * ring)
    assert one_node.reduce_tail == pytest.approx(BLOCK_REDUCE * ring)  # block 0's: the root trains nothing
    # HSDP, 4 nodes of 8: gathers stay on NVLink, each reduced shard (1/8) is all-reduced over 4 nodes on IB
    hsdp = C.pass_comm(gather, reduce, C.Layout("fsdp2", 32, shard=8, replicate=4), links)
    assert hsdp.gather == one_node.gather
    assert hsdp.reduce == pytest.approx(3 * BLOCK_REDUCE * (ring + 2 * 3 / 4 / 50e9 / 8))
    # flat FSDP over 32 ranks on 4 nodes: a ring as fast as its inter-node hops
    flat = C.pass_comm(gather, reduce, C.Layout("fsdp2", 32, shard=32), links)
    assert flat.gather == pytest.approx(27536 * 31 / 32 / 50e9)
    # DDP (Flow-GRPO's): no gathers, one ring all-reduce of the whole gradient (in one bucket: under 25 MiB)
    ddp = C.pass_comm(gather, reduce, C.Layout("ddp", 32, backward_gathers=0), links)
    assert ddp.gather == 0 and ddp.reduce == pytest.approx(3 * BLOCK_REDUCE * 2 * 31 / 32 / 50e9) == ddp.reduce_tail
    # ZeRO-3 reduces in the 16-bit gradient dtype: half FSDP2's fp32 bytes
    zero3 = C.pass_comm(gather, reduce, C.Layout("deepspeed", 8, shard=8, backward_gathers=2, reduce_bytes=2), links)
    assert zero3.reduce == pytest.approx(one_node.reduce / 2)


def test_the_estimators_units_are_the_real_transformers_on_the_meta_device():
    """SD3.5-medium as a full fine-tune: shapes.transformer_stats' counts give the bytes units_of_module reads off
    the meta module's FSDP2 units (blocks.block_slots, the engine's own)."""
    from jagg_scale.estimate.shapes import meta_module, pipeline_shapes, transformer_stats

    comp = pipeline_shapes(load_config(CONFIG, [], check_files=False))["components"]["transformer"]
    m = meta_module(comp)
    assert all(p.dtype == torch.float32 for p in m.parameters())  # the fp32 masters
    assert C.units(transformer_stats(comp), lora=False, half=True) == C.units_of_module(m.requires_grad_(True), 2)


def test_the_overlap_rule():
    """exposed = head + max(0, comm - head - compute), per direction; a with-grad pass's forward is its share."""
    assert C.exposed(comm=5.0, compute=3.0, head=1.0) == 2.0
    assert C.exposed(comm=2.0, compute=10.0, head=0.5) == 0.5  # hidden but for the head
    assert C.exposed(comm=0.0, compute=1.0, head=0.0) == 0.0
    p = C.PassComm(gather=4.0, gather_head=1.0, gather_head_back=1.5, reduce=2.0, reduce_tail=0.5, gathered_bytes=0)
    assert p.nograd(2.0) == 1.0 + 1.0  # 3 s beyond the head, 2 s of compute to hide them behind
    # a 9 s pass, a third of it forward: forward 1 + max(0, 4 - 1 - 3); backward (gather + reduce) 2 + max(0, 6 - 2 - 6)
    assert p.grad(9.0, 1 / 3, gathers=1, reduce=True) == 1.0 + 2.0
    assert p.grad(9.0, 1 / 3, gathers=1, reduce=False) == 1.0 + 1.5  # off the boundary: no reduce-scatter
    assert p.grad(3.0, 1 / 3, gathers=0, reduce=True) == 3.0 + 0.5  # no backward gather (reshard off / DDP)


def priced(*overrides, world=8, **kw):
    s = E.prepare(load_config(CONFIG, list(overrides), check_files=False), world)
    return T.step_seconds(s, E.estimate(s), **kw)


def test_the_step_adds_what_compute_leaves_exposed_and_one_rank_has_none():
    shipped = priced()
    c = shipped["comm"]
    assert (c["engine"], c["shard"], c["replicate"], c["grad_sync"]) == ("fsdp2", 8, 1, "boundary")
    assert shipped["collectives"] == pytest.approx(sum(c["exposed"].values())) and shipped["collectives"] > 0
    assert 0 < shipped["collectives"] < sum(c["busy"].values())  # prefetch hides most of it
    phases = ("rollout", "reference", "train", "train_nograd", "encode", "decode", "eval", "sp_all_to_all",
              "collectives")
    assert shipped["step"] == pytest.approx(sum(shipped[p] for p in phases))
    one = priced(world=1)  # the CPU bench's pricing: one rank, nothing to gather
    assert one["collectives"] == 0 and one["comm"]["engine"] == "none"


def test_each_layout_moves_the_collectives_the_way_it_should():
    hsdp, flat = priced("parallel.replicate=4", world=32), priced(world=32)
    assert flat["collectives"] > 2 * hsdp["collectives"]  # every gather across nodes, at IB's bandwidth
    assert sum(flat["comm"]["busy"].values()) > 5 * sum(hsdp["comm"]["busy"].values())
    every = priced("parallel.grad_sync=every")  # a reduce-scatter per backward instead of one per minibatch
    assert every["comm"]["busy"]["train"] > priced()["comm"]["busy"]["train"]
    kept = priced("parallel.reshard_after_forward=false")  # no gather in backward
    assert kept["comm"]["busy"]["train"] < priced()["comm"]["busy"]["train"]
    assert kept["comm"]["busy"]["rollout"] == priced()["comm"]["busy"]["rollout"]
    # Flow-GRPO's DDP: one all-reduce of the adapter's gradient per optimizer step, no gathers
    ddp = priced(engine="ddp")
    assert ddp["comm"]["busy"]["rollout"] == 0 and 0 < ddp["comm"]["busy"]["train"] < 0.01


@pytest.mark.slow
def test_jagg_estimate_prints_the_speedup_at_8_32_and_64_gpus(capsys):
    """--world-size 32 runs the LoRA config as slurm/jagg.sbatch would (HSDP, a replica per node) and says so; the
    table prices the step and Flow-GRPO's at each of 8, 32 and 64 GPUs, with one optimizer step a rollout too."""
    from jagg_scale.estimate.cli import main

    assert main([str(CONFIG), "--world-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "parallel.replicate 4: slurm/jagg.sbatch's on 4 nodes of 8" in out and "(HSDP: 4 replicas of 8)" in out
    assert "data-parallel collectives (fsdp2, parameters sharded over 8 ranks x 4 replicas" in out
    assert "checkpointing; ddp)" in out  # Flow-GRPO's LoRA under DDP
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert rows["8"].startswith("| 8 | 144 (72) | 1 |") and rows["32"].startswith("| 32 | 36 (18) | 4 |")
    assert rows["64"].startswith("| 64 | 18 (9) | 8 |")
    speedups = [float(rows[w].split("|")[6].strip().rstrip("x")) for w in ("8", "32", "64")]
    one_step = [float(rows[w].split("|")[8].strip().rstrip("x")) for w in ("8", "32", "64")]
    assert all(1 < s < o for s, o in zip(speedups, one_step))  # one optimizer step a rollout: no refresh
    assert speedups[0] > speedups[1] > speedups[2]  # a rank's passes shrink with the cluster
