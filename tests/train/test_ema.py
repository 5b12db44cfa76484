"""train.ema_decay: an EMA of the trainable weights, moved by Flow-GRPO's rule (train.ema_every, ema_warmup,
ema_repeat: jagg_scale/parallel/ema.py), checkpointed (exact resume), and swapped in for evaluation only."""

from pathlib import Path

import pytest
import torch

from flow_grpo_ema import flow_grpo_ema
from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.build import build_engine
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.parallel.dist import DistContext
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.config import TrainConfig
from jagg_scale.train.logging import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16", "sampling.num_steps=4",
         "train.prompts_per_step=2", "train.minibatch_size=4", "log.progress=false", "train.ema_decay=0.5"]
DIT = DiTConfig(image_size=8, in_channels=3, patch_size=4, hidden_size=32, depth=2, num_heads=2, vocab_size=64,
                max_prompt_length=4)
# Flow-GRPO's SD3.5 EMA (decay 0.9 every 8 optimizer steps with its warm-up, 2 moves per update: parallel/ema.py)
FLOW_GRPO = dict(ema_decay=0.9, ema_every=8, ema_warmup=True, ema_repeat=2)


@pytest.fixture
def ctx():
    context = DistContext()
    yield context
    context.close()  # FSDP2 in one process starts a trivial process group: leave none behind


def _engine(backend: str, ctx, **ema):
    torch.manual_seed(0)
    return build_engine(DiT(DIT).init_weights(zero_out=False), ParallelConfig(engine=backend),
                        TrainConfig(lr=1e-2, grad_clip=1.0, **ema), ctx)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _step(engine, seed: int, grad_scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x, s = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    c = torch.randint(1, 64, (2, 4), generator=g)
    engine.backward(engine.model(x, s, c), torch.randn(2, 3, 8, 8, generator=g) * grad_scale)
    engine.step()


def _trained(engine) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in engine.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("backend, ema", [
    ("none", FLOW_GRPO), ("fsdp2", FLOW_GRPO),  # FSDP2 keeps shards of it (2 processes: test_checkpoint_ranks.py)
    ("none", dict(ema_decay=0.9, ema_every=3, ema_warmup=True)),
    ("none", dict(ema_decay=0.9, ema_warmup=True)),  # DiffusionNFT's: every optimizer step, once
    ("none", dict(ema_decay=0.7, ema_every=2)),  # no warm-up: the constant decay
], ids=["flow_grpo", "flow_grpo_fsdp2", "every3", "diffusion_nft", "no_warmup"])
def test_the_ema_is_flow_grpos_over_the_warmup_and_the_interval(ctx, backend, ema):
    """20 optimizer steps against a float64 transcription of Flow-GRPO's EMAModuleWrapper and the loop calling it
    (tests/flow_grpo_ema.py), which steps the EMA ema_repeat times per optimizer step (its accumulated batches)."""
    engine = _engine(backend, ctx, **ema)
    weights = [_trained(engine)]
    for seed in range(20):
        _step(engine, seed)
        weights.append(_trained(engine))
    assert engine.optimizer_steps == 20
    want = flow_grpo_ema(weights, ema["ema_decay"], ema.get("ema_every", 1), ema.get("ema_warmup", False),
                         accumulation=ema.get("ema_repeat", 1))
    for n, value in want.items():
        got = _full(engine.ema[n]).double()
        assert torch.allclose(got, value, rtol=1e-5, atol=1e-6), (n, float((got - value).abs().max()))
    # an average behind the weights, not the weights: far from them compared with the tolerance above
    behind = sum(float((want[n] - weights[-1][n].double()).abs().sum()) for n in want)
    moved = sum(float((weights[0][n] - weights[-1][n]).abs().sum()) for n in want)
    assert behind > 0.05 * moved > 0


def test_a_skipped_step_counts_but_does_not_move_the_ema(ctx):
    engine = _engine("none", ctx, ema_decay=0.9, ema_warmup=True)
    _step(engine, 0)  # s = 1: moved by min(2 / 11, 0.9)
    ema = {n: _full(t) for n, t in engine.ema.items()}
    _step(engine, 1, grad_scale=float("nan"))  # s = 2, skipped: nothing moves
    assert not engine.step_applied and engine.optimizer_steps == 2
    assert all(torch.equal(engine.ema[n], ema[n]) for n in ema)
    _step(engine, 2)  # s = 3, as Flow-GRPO's global_step counts its skipped (fp16 overflow) steps: 4 / 13
    w = _trained(engine)
    assert all(torch.allclose(engine.ema[n], ema[n] + (1 - 4 / 13) * (w[n] - ema[n]), rtol=1e-6, atol=1e-7)
               for n in ema)


def test_ema_follows_the_weights_and_is_used_only_inside_ema_weights(tmp_path):
    trainer = Trainer(load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "train.steps=1"]))
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()  # 2 optimizer steps: ema = 0.25 w0 + 0.25 w1 + 0.5 w2
    now = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moved = [n for n in now if not torch.equal(now[n], start[n])]
    assert moved
    for n in moved:
        e = trainer.engine.ema[n]
        assert not torch.equal(e, now[n]) and not torch.equal(e, start[n])
    with trainer.engine.ema_weights() as m:
        for n, p in m.named_parameters():
            assert torch.equal(p, trainer.engine.ema[n])
    for n, p in trainer.model.named_parameters():  # restored after the context
        assert torch.equal(p, now[n])


@pytest.mark.parametrize("rule", [[], ["train.ema_every=3", "train.ema_warmup=true", "train.ema_repeat=2"]],
                         ids=["constant", "warmup_every3"])
def test_ema_is_checkpointed_and_resume_is_exact(tmp_path, rule):
    """2 optimizer steps a training step: with every 3 the resumed third step's update (after optimizer step 5, by
    (6 / 15)^2) needs the count the resumed run derives from its step."""
    common = SMALL + ["run.checkpoint_every=1", *rule]
    full = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'full'}", "train.steps=3"]))
    full.fit()
    Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=2"])).fit()
    resumed = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=3",
                                                  "run.resume=auto"]))
    assert resumed.engine.optimizer_steps == 4
    resumed.fit()
    assert resumed.engine.optimizer_steps == full.engine.optimizer_steps == 6
    for n, e in full.engine.ema.items():
        assert torch.equal(e, resumed.engine.ema[n]), n
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]
    assert strip(read_metrics(tmp_path / "cut")) == strip(read_metrics(tmp_path / "full"))


NO_EMA = r"but train\.ema_decay is 0, so there is no EMA for it to act on"


@pytest.mark.parametrize("override, message", [
    ("train.ema_decay=1.0", r"'train\.ema_decay'.*must be in \[0, 1\)"),
    ("train.ema_decay=-0.1", r"'train\.ema_decay'.*must be in \[0, 1\)"),
    ("train.ema_every=0", r"'train\.ema_every'.*must be >= 1"),
    ("train.ema_repeat=0", r"'train\.ema_repeat'.*must be >= 1"),
    # set while there is no EMA (ema_decay 0): a key that would not act
    ("train.ema_decay=0 train.ema_every=8", rf"'train\.ema_every'.*is 8 {NO_EMA}"),
    ("train.ema_decay=0 train.ema_warmup=true", rf"'train\.ema_warmup'.*is true {NO_EMA}"),
    ("train.ema_decay=0 train.ema_repeat=2", rf"'train\.ema_repeat'.*is 2 {NO_EMA}"),
])
def test_ema_config_errors(override, message):
    # every engine keeps an EMA (DeepSpeed: of each rank's fp32 partitions, tests/parallel/test_deepspeed_engine.py;
    # every engine saves and reads it back: tests/parallel/test_engines.py)
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, SMALL + override.split())
