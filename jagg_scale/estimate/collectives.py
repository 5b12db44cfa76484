"""The data-parallel collectives of a step's transformer passes: their bytes, their seconds at a stated link
bandwidth, and the part of them compute does not hide (the step-time model's, steptime.py).

What the engines issue (parallel/fsdp.py, parallel/deepspeed_engine.py):

    fsdp2      every block is an FSDP unit, then the root (blocks.block_slots). Each forward of the transformer
               all-gathers every unit's parameters: the blocks in the mixed-precision param_dtype (the compute dtype,
               bf16 / fp16: 2 bytes a parameter, as the frozen base of LoRA is held; float32 runs 4), the root as
               held (its MixedPrecisionPolicy has no param_dtype: a full fine-tune's fp32 masters, LoRA's base in the
               compute dtype). With reshard_after_forward (every shipped config) a with-grad pass's backward gathers
               every unit again (the recompute under activation checkpointing runs inside that gather: FSDP2's
               pre-forward hook leaves the unshard to the pre-backward one). A backward reduce-scatters each unit's
               trained gradient in the fp32 reduce_dtype (LoRA: the adapter, MBs; a full fine-tune: 4 bytes a
               weight): at every backward under grad_sync every, at the minibatch's last one under boundary (LoRA's
               auto). HSDP (parallel.replicate R): the gathers and reduce-scatters over a shard group of world / R,
               then each reduced shard all-reduced over the R replicas.
    deepspeed  ZeRO-3 priced the same way: every module's parameters gathered in 16 bits in forward, again for
               the recompute under checkpointing and again for the backward (its post-forward hooks release them),
               its gradients reduce-scattered at every backward in the 16-bit gradient dtype (DeepSpeed's
               communication_data_type default). No shipped config runs it.
    ddp        Flow-GRPO's own layout for LoRA (accelerate MULTI_GPU: yifan123/flow_grpo
               scripts/accelerate_configs/multi_gpu.yaml and multi_node.yaml, scripts/single_node/grpo.sh,
               scripts/multi_node/main.sh): the whole transformer on every GPU, no gathers, the trained gradient
               all-reduced once per optimizer step (accelerator.accumulate syncs only at the accumulation boundary,
               scripts/train_sd3.py:353-361, :872), in fp32, in DDP's 25 MiB buckets behind that backward.

Seconds: NCCL's ring collectives move (n - 1) / n of a tensor per rank (an all-reduce twice that) at the link's bus
bandwidth: a group inside one node at NVLINK_GBPS, a group spanning nodes at IB_GBPS (a ring is as fast as its
slowest hop). Ranks are placed node by node (torchrun), and HSDP's shard group is the mesh's inner dimension: a shard
group of at most gpus_per_node ranks stays on one node.

Overlap, as FSDP2's prefetch runs (fsdp.parallelize: block i gathers block i + 1 in forward and i - 1 in backward, on
their own streams): the collectives of a pass's forward hide behind its forward compute, those of its backward
(gathers and reduce-scatters) behind the backward's, up to that compute; the rest is exposed. The first gathers of
each direction (the root and the first block it runs: nothing computes before them) and the last reduce-scatter
(FSDP2 waits for it at the end of the backward) are exposed always:

    exposed = head + max(0, comm - head - compute)          per pass and direction

A with-grad pass's forward is 1 / (3 x factor) of its compute (the calibration's pass: forward, recomputed forward,
backward ~ 3 forwards; steptime.step_seconds' factor for a full fine-tune or no checkpointing).

Not counted: NCCL's per-collective latency (tens of microseconds, ~50 collectives a pass), the slowdown of compute
that shares its SMs with NCCL's kernels, the frozen text encoder's and reward models' gathers where they are sharded
(model.shard_text_encoder, reward.shard: once per encode or scored chunk), the optimizer step's norm all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..parallel.blocks import block_slots
from ..parallel.engine import resolve_grad_sync

__all__ = ["GPUS_PER_NODE", "IB_GBPS", "LINKS", "NVLINK_GBPS", "Layout", "Links", "PassComm", "exposed",
           "flow_grpo_engine", "layout", "pass_comm", "units", "units_of_module"]

# GB/s of NCCL's all-gather / reduce-scatter bus bandwidth inside one 8-GPU H100 SXM node: an assumption, not
# measured here. NVLink 4 through NVSwitch carries 450 GB/s a GPU each way; nccl-tests' ring all_gather_perf /
# reduce_scatter_perf on a DGX H100 reach ~80% of it at messages of 100 MB and more (an SD3.5-medium block in bf16:
# 200 MB; FLUX.1's: 330 MB). NVLink SHARP's in-switch all-reduce (460-480 GB/s bus) is not assumed.
NVLINK_GBPS = 360.0
# GB/s a GPU moves across nodes: one ConnectX-7 NIC of 400 Gb/s (50 GB/s) per GPU, 8 rails a node (DGX H100 /
# HGX H100 reference design), NCCL's bus bandwidth ~90% of the line rate: an assumption, not measured here
IB_GBPS = 45.0
GPUS_PER_NODE = 8
DDP_BUCKET_BYTES = 25 * 2**20  # torch DistributedDataParallel's bucket_cap_mb default


@dataclass(frozen=True)
class Links:
    """The stated bandwidths (GB/s of NCCL bus bandwidth per GPU) and the node size."""
    nvlink_gbps: float = NVLINK_GBPS
    ib_gbps: float = IB_GBPS
    gpus_per_node: int = GPUS_PER_NODE

    def gbps(self, group: int, span: int) -> float:
        """A ring of `group` ranks whose ranks lie within `span` consecutive ranks: NVLink inside one node."""
        return self.nvlink_gbps if span <= self.gpus_per_node else self.ib_gbps


LINKS = Links()  # the stated figures above


@dataclass(frozen=True)
class Layout:
    """How an engine shards the transformer over `world` ranks."""
    engine: str                 # fsdp2 | deepspeed | ddp | none
    world: int
    shard: int = 1              # ranks a parameter is sharded over (HSDP: world / replicate)
    replicate: int = 1          # HSDP replica groups
    backward_gathers: int = 1   # gathers of every unit in a with-grad pass's backward
    grad_sync: str = "boundary"  # every: a reduce at each backward; boundary: at a minibatch's last backward
    reduce_bytes: int = 4       # bytes a gradient element is reduced in


def layout(cfg, world: int, engine: str | None = None) -> Layout:
    """The config's engine (or `engine`: ddp for Flow-GRPO's own) on `world` ranks. A sequence-parallel group shards
    like any data-parallel rank (FSDP2's mesh is over every rank)."""
    p, engine = cfg.parallel, engine or cfg.parallel.engine
    if engine == "none" or world == 1:
        return Layout("none", world)
    if engine == "ddp":
        return Layout("ddp", world, backward_gathers=0)
    if engine == "deepspeed":  # ZeRO-3: again for the recompute, and reduced in the 16-bit gradient dtype
        half = cfg.model.dtype != "float32"
        return Layout("deepspeed", world, world, 1, 1 + p.activation_checkpointing, "every", 2 if half else 4)
    return Layout("fsdp2", world, world // p.replicate, p.replicate, int(p.reshard_after_forward),
                  resolve_grad_sync(p, not cfg.model.lora.enabled))


def flow_grpo_engine(cfg) -> str | None:
    """The engine of Flow-GRPO's step of `cfg`: DDP for LoRA (train_sd3.py under accelerate MULTI_GPU, the module
    docstring), the config's own for a full fine-tune (DDP would hold every weight's fp32 gradient and AdamW state
    on each GPU: the peer is priced with the sharding this config needs)."""
    return "ddp" if cfg.model.lora.enabled else None


def units(stats: dict, lora: bool, half: bool) -> tuple[list[float], list[float]]:
    """(bytes one all-gather of each FSDP unit produces, bytes of its trained gradient in fp32), root first, from
    shapes.transformer_stats' counts: what units_of_module reads off a module, without FSDP2's padding of a
    parameter's first dimension to a multiple of the shard group (under 0.1% of a block)."""
    cdt, blocks = 2 if half else 4, stats["block_params"]
    if lora:  # the frozen base in the compute dtype (models/__init__.py), the adapter fp32 (cast to 16 bits in blocks)
        block_lora = stats["block_lora"]
        root_lora = stats["lora_params"] - sum(block_lora)
        gather = [cdt * stats["root_params"] + 4 * root_lora] + [cdt * (p + a) for p, a in zip(blocks, block_lora)]
        return gather, [4 * root_lora] + [4 * a for a in block_lora]
    root = stats["root_params"]
    return [4 * root] + [cdt * p for p in blocks], [4 * root] + [4 * p for p in blocks]


def units_of_module(module: nn.Module, param_bytes: int | None) -> tuple[list[float], list[float]]:
    """The same off a module (its parameters' dtypes and requires_grad; the meta device will do), units as
    fsdp.parallelize makes them: every block of blocks.block_slots (gathered in `param_bytes` a parameter, the
    param_dtype's; None: as held), then the root's remaining parameters as held; gradients reduced in fp32."""
    blocks = [b[i] for b, i in block_slots(module)]
    in_block = {id(p) for b in blocks for p in b.parameters()}
    root = [p for p in module.parameters() if id(p) not in in_block]

    def size(params, cast):
        return sum(p.numel() * (cast or p.element_size()) for p in params)

    def grads(params):
        return sum(4 * p.numel() for p in params if p.requires_grad)

    return ([size(root, None)] + [size(b.parameters(), param_bytes) for b in blocks],
            [grads(root)] + [grads(b.parameters()) for b in blocks])


def exposed(comm: float, compute: float, head: float) -> float:
    """Seconds of a direction's collectives that compute does not hide: `head` (what runs before any compute can
    overlap it) always, the rest beyond the compute."""
    return head + max(0.0, comm - head - compute)


@dataclass(frozen=True)
class PassComm:
    """One pass's collectives in seconds (and the bytes gathered per forward), per direction."""
    gather: float          # every unit's all-gather, once
    gather_head: float     # the root's and the first block's (forward) / the root's and the last block's (backward)
    gather_head_back: float
    reduce: float          # every unit's gradient reduction (reduce-scatter, HSDP's all-reduce, or DDP's all-reduce)
    reduce_tail: float     # the last of it (the root's or first block's; DDP's last bucket)
    gathered_bytes: float

    def nograd(self, compute: float) -> float:
        return exposed(self.gather, compute, self.gather_head)

    def grad(self, compute: float, forward_share: float, gathers: int, reduce: bool) -> float:
        """A with-grad pass of `compute` seconds, `gathers` gathers of every unit in its backward, reducing its
        gradients or not."""
        fwd, back = compute * forward_share, compute * (1 - forward_share)
        comm = gathers * self.gather + (self.reduce if reduce else 0.0)
        head = (self.gather_head_back if gathers else 0.0) + (self.reduce_tail if reduce else 0.0)
        return self.nograd(fwd) + exposed(comm, back, head)


def pass_comm(gather: list[float], reduce: list[float], lay: Layout, links: Links) -> PassComm:
    """The collectives of one pass of a transformer whose units gather `gather` bytes and reduce `reduce` bytes."""
    if lay.engine == "none":
        return PassComm(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    n = lay.world
    if lay.engine == "ddp":  # ring all-reduce of every trained gradient, in buckets
        total = sum(reduce)
        bw = links.gbps(n, n) * 1e9
        ar = 2 * (n - 1) / n / bw
        return PassComm(0.0, 0.0, 0.0, total * ar, min(total, DDP_BUCKET_BYTES) * ar, 0.0)
    S, R = lay.shard, lay.replicate
    ring = (S - 1) / S / (links.gbps(S, S) * 1e9)  # seconds a byte of the whole tensor, gathered or reduced
    # HSDP: the reduced shard (1 / S of the gradient) all-reduced over R replicas, one per node or spread over nodes
    across = 2 * (R - 1) / R / (links.gbps(R, n) * 1e9) / S if R > 1 else 0.0
    g = [b * ring for b in gather]
    r = [b * (lay.reduce_bytes / 4) * (ring + across) for b in reduce]
    # the root gathers first in forward (its embedders run before block 0) and first in backward (the final layer);
    # the last reduce-scatter is the first block's, or the root's when it trains
    tail = r[0] if reduce[0] else (r[1] if len(r) > 1 else 0.0)
    return PassComm(sum(g), g[0] + (g[1] if len(g) > 1 else 0.0), g[0] + (g[-1] if len(g) > 1 else 0.0), sum(r),
                    tail, sum(gather))
