"""fp16 loss scaling on the one-process engines (jagg_scale/parallel/loss_scale.py): model.dtype float16 gives the
local engine a torch GradScaler and FSDP2 a ShardedGradScaler; each backward is seeded times the scale, the step
unscales before it clips (the norm and the update are the unscaled gradients'), an overflow of the scale's search
skips the step and halves the scale without touching the weights or AdamW, a non-finite loss or an overflow at a
scale <= 1 is a non-finite step instead, and the scaler's state goes through the checkpoint. (Trainer level:
tests/train/test_nonfinite.py; DeepSpeed's fp16: tests/parallel/test_deepspeed_engine.py; 2 processes:
tests/parallel/test_distributed.py.)"""

import pytest
import torch

from jagg_scale.checkpoint import CheckpointError
from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.build import build_engine
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.parallel.dist import DistContext
from jagg_scale.train.config import TrainConfig

DIT = DiTConfig(image_size=8, in_channels=3, patch_size=4, hidden_size=32, depth=2, num_heads=2, vocab_size=64,
                max_prompt_length=4)
BACKENDS = ["none", "fsdp2"]


@pytest.fixture
def ctx():
    context = DistContext()
    yield context
    context.close()


def _engine(backend: str, ctx, dtype=torch.float16):
    torch.manual_seed(0)
    model = DiT(DIT).init_weights(zero_out=False)
    model.compute_dtype = dtype  # model.dtype (models.build_model sets it)
    return build_engine(model, ParallelConfig(engine=backend), TrainConfig(lr=1e-3, grad_clip=1e-3), ctx)


def _set_scale(engine, scale: float) -> None:
    engine.scaler.load_state_dict({**engine.scaler.state_dict(), "scale": scale})


def _backward(engine, seed: int, size: float = 1e-4) -> None:
    """One backward of the fp16-autocast DiT seeded with a gradient of `size` (a GRPO loss's dL/dv is small)."""
    g = torch.Generator().manual_seed(seed)
    x, s = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    c = torch.randint(1, 64, (2, 4), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        v = engine.model(x, s, c)
    engine.backward(v.float(), size * torch.randn(2, 3, 8, 8, generator=g))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(engine) -> list[torch.Tensor]:
    return [_full(p.grad).clone() for p in engine.params]


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_scales_each_backward_and_unscales_before_the_clip(ctx, backend):
    scaled, plain = _engine(backend, ctx), _engine(backend, ctx)
    assert type(scaled.scaler).__name__ == ("GradScaler" if backend == "none" else "ShardedGradScaler")
    assert _engine(backend, ctx, torch.bfloat16).scaler is None  # bf16 has fp32's range: nothing to scale
    _set_scale(plain, 1.0)  # the same fp16 arithmetic, unscaled
    _backward(scaled, 0)
    _backward(plain, 0)
    for a, b in zip(_grads(scaled), _grads(plain)):  # the seed was multiplied by 2^16
        assert torch.allclose(a, 2.0**16 * b, rtol=1e-2, atol=1e-6 * 2.0**16)
    norm, ref = scaled.step(), plain.step()
    assert scaled.step_applied and not scaled.scale_skipped and scaled.loss_scale == 2.0**16
    # the clip (1e-3, which bites) saw the true gradient: the norm is the unscaled one, not 2^16 times it
    assert float(norm) == pytest.approx(float(ref), rel=1e-3) and 1e-3 < float(norm) < 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overflow_is_skipped_backs_off_and_leaves_the_weights_and_adamw(ctx, backend):
    engine = _engine(backend, ctx)
    _backward(engine, 0)
    engine.step(loss=torch.tensor(0.5))
    assert engine.step_applied
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    _set_scale(engine, 2.0**40)  # a scale no fp16 gradient survives
    _backward(engine, 1)
    norm = engine.step(loss=torch.tensor(0.5))
    assert not torch.isfinite(norm) and not engine.step_applied and engine.scale_skipped
    assert engine.loss_scale == 2.0**40 and engine.scaler.get_scale() == 2.0**39  # backed off
    assert all(p.grad is None for p in engine.params)
    assert all(int(s["step"]) == 1 for s in engine.optimizer.state.values())
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    # a non-finite loss is the forward's overflow, which no scale cures: a non-finite step, not the search
    _set_scale(engine, 2.0**10)
    _backward(engine, 2)
    engine.step(loss=torch.tensor(float("inf")))
    assert not engine.step_applied and not engine.scale_skipped
    # and so are gradients that overflow at a scale <= 1
    _set_scale(engine, 1.0)
    _backward(engine, 3, size=float("nan"))
    engine.step(loss=torch.tensor(0.5))
    assert not engine.step_applied and not engine.scale_skipped and engine.scaler.get_scale() == 0.5
    _set_scale(engine, 2.0**10)
    _backward(engine, 4)
    engine.step(loss=torch.tensor(0.5))
    assert engine.step_applied and all(int(s["step"]) == 2 for s in engine.optimizer.state.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_scaler_state_goes_through_the_checkpoint(ctx, backend, tmp_path):
    engine = _engine(backend, ctx)
    engine.scaler.load_state_dict({**engine.scaler.state_dict(), "scale": 2.0**11, "growth_interval": 1})
    _backward(engine, 0)
    engine.step()  # a clean step at growth interval 1: the scale doubles and the tracker restarts
    want = engine.scaler.state_dict()
    assert want["scale"] == 2.0**12
    (tmp_path / "ckpt").mkdir()
    files = engine.save(tmp_path / "ckpt")
    assert tmp_path / "ckpt" / "loss_scale.json" in files  # hashed into the manifest with the rest
    fresh = _engine(backend, ctx)
    fresh.load(tmp_path / "ckpt")
    assert fresh.scaler.state_dict() == want
    (tmp_path / "ckpt" / "loss_scale.json").unlink()
    with pytest.raises(CheckpointError, match=r"no readable loss_scale\.json .*model\.dtype float16"):
        _engine(backend, ctx).load(tmp_path / "ckpt")
