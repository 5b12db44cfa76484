"""The rollout replica computes with the weights the trainer pool's engine computes with (jagg_scale/pools/replica.py):
under FSDP2 in bf16 its blocks are bf16 (FSDP2's gathers) and its root float32, so its forward equals the engine's bit
for bit, before and after a weight sync; a float32 replica (what the pools held before) does not."""

from __future__ import annotations

import pytest
import torch

from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.build import build_engine
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.parallel.dist import DistContext
from jagg_scale.pools.messages import weight_digests
from jagg_scale.pools.replica import compute_dtypes, place_replica
from jagg_scale.pools.rollout_pool import bind
from jagg_scale.train.config import TrainConfig

DIT = DiTConfig(image_size=8, in_channels=3, patch_size=4, hidden_size=32, depth=2, num_heads=2, vocab_size=64,
                max_prompt_length=4)
BF16 = torch.bfloat16


@pytest.fixture
def ctx():
    context = DistContext()
    yield context
    context.close()


def dit() -> DiT:
    torch.manual_seed(0)
    model = DiT(DIT).init_weights(zero_out=False).to(BF16)  # a checkpoint stored in bf16 (build_model's host copy)
    model.master_dtype, model.compute_dtype = torch.float32, BF16
    return model


def forward(model, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, s = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    c = torch.randint(1, 64, (2, 4), generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return model(x, s, c).float()


@pytest.mark.parametrize("engine", ["none", "fsdp2"])
def test_the_replica_samples_as_the_engine_before_and_after_a_sync(ctx, engine):
    trainer = build_engine(dit(), ParallelConfig(engine=engine), TrainConfig(lr=1e-2), ctx)
    replica = place_replica(dit(), torch.device("cpu"), engine, BF16)
    blocks = {p.dtype for n, p in replica.named_parameters() if n.startswith("blocks.")}
    assert blocks == ({BF16} if engine == "fsdp2" else {torch.float32})
    assert torch.equal(forward(trainer.model), forward(replica))  # the checkpoint's bf16 weights, exact either way

    with torch.autocast("cpu", dtype=BF16):  # one optimizer step, then the sync as trainer 0 sends it
        loss = forward_grad(trainer.model)
    trainer.backward(loss, torch.ones_like(loss))
    trainer.step()
    dtypes = compute_dtypes(trainer.model, engine, BF16)
    assert dtypes == compute_dtypes(dit(), engine, BF16)  # the sender's map is the binder's
    state = {n: t.detach().to("cpu", dtypes[n], copy=True) for n, t in trainer.full_state_dict().items()}
    bind(replica, state, weight_digests(state), version=1, rank=1)
    assert torch.equal(forward(trainer.model), forward(replica))


class Normed(torch.nn.Module):
    """Blocks whose norms carry weights (SD3.5's and FLUX's q/k RMSNorms): autocast runs a norm in float32 with the
    weight as held, so a float32 block and FSDP2's bf16 gather of it compute differently."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
                                          for _ in range(2))
        self.out = torch.nn.Linear(8, 8)
        self.master_dtype, self.compute_dtype = None, BF16

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def test_a_float32_replica_of_an_fsdp2_bf16_run_samples_other_weights_than_its_trainer(ctx):
    trainer = build_engine(Normed(), ParallelConfig(engine="fsdp2"), TrainConfig(lr=1e-2), ctx)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=BF16):
        out = trainer.model(x).float()
    trainer.backward(out, torch.ones_like(out))
    trainer.step()  # masters no longer bf16 values
    masters = {n: t.detach().clone() for n, t in trainer.full_state_dict().items()}
    outs = []
    for rule in ("fsdp2", "none"):  # this replica, and the float32 one the pools held before
        replica = place_replica(Normed(), torch.device("cpu"), rule, BF16)
        dtypes = compute_dtypes(replica, rule, BF16)
        state = {n: t.to(dtypes[n]) for n, t in masters.items()}
        bind(replica, state, weight_digests(state), version=1, rank=1)
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            outs.append(replica(x).float())
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        want = trainer.model(x).float()
    assert torch.equal(outs[0], want) and not torch.equal(outs[1], want)


def forward_grad(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    x, s = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    c = torch.randint(1, 64, (2, 4), generator=g)
    return model(x, s, c).float()


class Adapted(torch.nn.Module):
    """LoRA's layout: blocks of a frozen 16-bit base with a float32 adapter, and a root layer outside them."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4).to(BF16).requires_grad_(False) for _ in range(2))
        for b in self.blocks:
            b.lora_A = torch.nn.Parameter(torch.zeros(2, 4))
        self.final = torch.nn.Linear(4, 4)


@pytest.mark.parametrize("engine, block_adapter, root", [
    ("none", torch.float32, torch.float32),  # autocast rounds at each op, the weights stay as held
    ("fsdp2", BF16, torch.float32),  # a block's gather casts its adapter too; the root's parameters are not cast
    ("deepspeed", BF16, BF16),  # ZeRO-3 partitions every parameter in the compute dtype
])
def test_an_adapter_is_sent_in_the_dtype_its_block_computes_with(engine, block_adapter, root):
    dtypes = compute_dtypes(Adapted(), engine, BF16)
    assert dtypes["blocks.0.lora_A"] == dtypes["blocks.1.lora_A"] == block_adapter
    assert dtypes["blocks.0.weight"] == BF16 and dtypes["final.weight"] == root
    assert set(compute_dtypes(Adapted(), engine, torch.float32).values()) == {BF16, torch.float32}  # fp32 run: as held
