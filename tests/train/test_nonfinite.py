"""Non-finite training (issue 16 item 2): an optimizer step on a non-finite loss or gradient norm is skipped on every
engine (AdamW's state untouched) and counted (`nonfinite_steps`), train.max_nonfinite_steps of them in a row stop
the run (jagg-train exits 1), a checkpoint of non-finite weights is refused before any file is written, a full
disk during a save is named as such, and rewards on a 1e38 scale are reduced in float64. Under model.dtype float16
the loss scale's search is counted apart (`loss_scale_skips`) and does not stop the run; a gradient non-finite at
every scale still does (parallel/loss_scale.py)."""

import errno

import pytest
import torch

from jagg_scale.checkpoint import list_checkpoints
from jagg_scale.cli import train_main
from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.build import build_engine
from jagg_scale.parallel.dist import DistContext
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.parallel.engine import NonFiniteError
from jagg_scale.train.config import TrainConfig
from jagg_scale.rewards.base import Reward, register
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.logging import read_metrics
from train_runs import TINY, small_dit

SMALL = small_dit(4, 3)  # two minibatches (two optimizer steps) per training step
DIT = DiTConfig(image_size=8, in_channels=3, patch_size=4, hidden_size=32, depth=2, num_heads=2, vocab_size=64,
                max_prompt_length=4)


# ------------------------------------------------------------------------------------------------ the engines

@pytest.fixture
def ctx():
    context = DistContext()
    yield context
    context.close()


def _engine(backend: str, ctx):
    torch.manual_seed(0)
    model = DiT(DIT).init_weights(zero_out=False)
    return build_engine(model, ParallelConfig(engine=backend), TrainConfig(lr=1e-3, grad_clip=1.0, ema_decay=0.5), ctx)


def _step(engine, seed: int, grad_scale: float = 1.0, loss: torch.Tensor | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, s = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    c = torch.randint(1, 64, (2, 4), generator=g)
    engine.backward(engine.model(x, s, c), torch.randn(2, 3, 8, 8, generator=g) * grad_scale)
    return engine.step(loss=loss)


@pytest.mark.parametrize("backend", ["none", "fsdp2"])
def test_a_non_finite_step_is_skipped_and_leaves_adamw_as_it_was(ctx, backend):
    ref = _engine(backend, ctx)
    _step(ref, 0)
    _step(ref, 2)
    engine = _engine(backend, ctx)
    _step(engine, 0)
    assert engine.step_applied
    assert not torch.isfinite(_step(engine, 1, grad_scale=float("nan")))  # the norm is reported as it was
    assert not engine.step_applied
    _step(engine, 1, loss=torch.tensor(float("inf")))  # finite gradients, a non-finite loss: skipped too
    assert not engine.step_applied
    assert all(p.grad is None for p in engine.params)  # nothing left to leak into the next step
    _step(engine, 2)
    assert engine.step_applied
    # the skipped steps changed nothing: not the weights, not AdamW's moments or step count, not the EMA
    assert all(int(s["step"]) == 2 for s in engine.optimizer.state.values())
    want, got = ref.full_state_dict(), engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    assert all(torch.equal(full(engine.ema[k]), full(ref.ema[k])) for k in ref.ema)


@pytest.mark.parametrize("backend", ["none", "fsdp2"])
def test_an_engine_refuses_to_save_non_finite_weights(ctx, backend, tmp_path):
    engine = _engine(backend, ctx)
    for name in ("ok", "bad"):
        (tmp_path / name).mkdir()
    engine.save(tmp_path / "ok")  # finite: saved
    with torch.no_grad():
        p = dict(engine.model.named_parameters())["blocks.1.mlp.fc1.weight"]
        (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"refusing to save checkpoint .*bad.*'blocks\.1\.mlp\.fc1\.weight'"):
        engine.save(tmp_path / "bad")
    assert not any((tmp_path / "bad").iterdir())  # refused before any file


@pytest.mark.parametrize("chained", [False, True])
def test_a_full_disk_during_a_save_names_the_directory_and_the_free_space(ctx, tmp_path, monkeypatch, chained):
    import jagg_scale.parallel.local_engine as local  # where the engine's writers are looked up

    def full(path, obj):
        if not chained:
            raise OSError(errno.ENOSPC, "No space left on device")
        try:  # as torch.save reports it: the ENOSPC only in the chain
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError(  # noqa: B904 - mimics torch.save: the ENOSPC only in the implicit __context__
                "[enforce fail at inline_container.cc:672] . unexpected pos 12254528 vs 12254416")

    monkeypatch.setattr(local, "write_object", full)
    engine = _engine("none", ctx)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(OSError, match=r"no space left on device while writing checkpoint .*ckpt \(\d+\.\d\d GiB free "
                                      r"there now.*free disk space or lower run\.keep_last") as info:
        engine.save(tmp_path / "ckpt")
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(local, "write_object", lambda path, obj: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="^other$"):  # any other failure is left as it was
        engine.save(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------------------ the trainer

def _poison(monkeypatch, when):
    """The gradient of the n-th minibatch NaN when `when(n)`, as a numerical blow-up in the model would make it."""
    from jagg_scale.parallel.engine import Engine

    step, calls = Engine.step, []

    def poisoned(self, loss=None):
        calls.append(1)
        if when(len(calls)):
            for p in self.params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return step(self, loss=loss)

    monkeypatch.setattr(Engine, "step", poisoned)


def test_non_finite_minibatches_are_skipped_counted_and_the_weights_stay_finite(tmp_path, monkeypatch):
    _poison(monkeypatch, lambda n: n in (2, 3))  # step 0's second minibatch, step 1's first
    cfg = load_config(TINY, SMALL + ["train.steps=3", "run.checkpoint_every=1", f"run.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    trainer.fit()
    rows = read_metrics(tmp_path)
    assert [r["optimizer_steps"] for r in rows] == [2, 2, 2]
    assert [r["nonfinite_steps"] for r in rows] == [1, 1, 0]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002", "step_00000003"]


def test_max_nonfinite_steps_in_a_row_stop_the_run_with_exit_1(tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, lambda n: n >= 3)  # step 0 trains, then every minibatch is non-finite
    code = train_main([TINY, *SMALL, "train.steps=5", "train.max_nonfinite_steps=3", "run.checkpoint_every=1",
                       f"run.output_dir={tmp_path}"])
    assert code == 1
    err = capsys.readouterr().err
    assert "jagg-train: 3 optimizer steps in a row had a non-finite loss or gradient norm " \
           "(train.max_nonfinite_steps=3), the last at training step 2" in err
    rows = read_metrics(tmp_path)
    assert [r["nonfinite_steps"] for r in rows] == [0, 2]  # step 2 stopped before it logged
    assert not (tmp_path / "summary.json").exists()


def _initial_loss_scale(monkeypatch, scale: float) -> None:
    """model.dtype float16's loss scaler starting at `scale` instead of 2^16."""
    import jagg_scale.parallel.local_engine as engines

    make = engines.make_scaler

    def starting_at(*args, **kwargs):
        scaler = make(*args, **kwargs)
        scaler.load_state_dict({**scaler.state_dict(), "scale": scale})
        return scaler

    monkeypatch.setattr(engines, "make_scaler", starting_at)


def test_the_loss_scale_search_is_counted_apart_and_does_not_stop_the_run(tmp_path, monkeypatch):
    """2^24 overflows the tiny DiT's fp16 gradients: the first steps are skipped and the scale halves each time;
    more of them in a row than max_nonfinite_steps (1), and the run trains on."""
    _initial_loss_scale(monkeypatch, 2.0**24)
    cfg = load_config(TINY, SMALL + ["model.dtype=float16", "train.steps=3", "train.max_nonfinite_steps=1",
                                     f"run.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    trainer.fit()
    rows = read_metrics(tmp_path)
    assert all(r["nonfinite_steps"] == 0 for r in rows)
    assert rows[0]["loss_scale_skips"] >= 2  # in a row: it would have stopped the run as non-finite steps
    skips = 0
    for r in rows:  # halved at every skip (growth needs 2000 clean steps); the scale of each step's last update
        skips += r["loss_scale_skips"]
        assert r["loss_scale"] in (2.0**24 / 2**skips, 2.0**24 / 2 ** (skips - 1))
    assert sum(r["optimizer_steps"] - r["loss_scale_skips"] for r in rows) >= 2  # and it trained
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_gradient_non_finite_at_every_loss_scale_still_stops_the_run(tmp_path, monkeypatch, capsys):
    _initial_loss_scale(monkeypatch, 4.0)
    _poison(monkeypatch, lambda n: n >= 3)  # step 0 trains, then every gradient is NaN, whatever the scale
    code = train_main([TINY, *SMALL, "model.dtype=float16", "train.steps=5", "train.max_nonfinite_steps=2",
                       f"run.output_dir={tmp_path}"])
    assert code == 1
    assert "2 optimizer steps in a row had a non-finite loss or gradient norm (train.max_nonfinite_steps=2), " \
           "the last at training step 2" in capsys.readouterr().err
    rows = read_metrics(tmp_path)  # step 1: the search at 4 and 2; step 2: at 1 and 0.5, non-finite: stopped
    assert [(r["loss_scale_skips"], r["nonfinite_steps"], r["loss_scale"]) for r in rows] == [(0, 0, 4.0),
                                                                                              (2, 0, 2.0)]


def test_a_non_finite_checkpoint_is_never_complete(tmp_path):
    trainer = Trainer(load_config(TINY, SMALL + ["train.steps=1", f"run.output_dir={tmp_path}"]))
    with torch.no_grad():
        next(iter(trainer.model.parameters())).view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match="refusing to save checkpoint"):
        trainer.run_state.save(1, trainer.source)
    assert list_checkpoints(tmp_path / "checkpoints") == []
    assert not any((tmp_path / "checkpoints").iterdir())  # the temp dir is gone too


# ------------------------------------------------------------------------------------------------ rewards

@register("test_huge_scale")
class HugeScale(Reward):
    """A reward on a 1e38 scale (finite in float32; its sums are not)."""

    name = "test_huge_scale"

    def __call__(self, images, prompts, metadata):
        return 1e38 * (1.0 + images.float().mean(dim=(1, 2, 3)))


def test_rewards_on_a_1e38_scale_are_reduced_in_float64(tmp_path):
    cfg = load_config(TINY, SMALL + ["train.steps=1", f"run.output_dir={tmp_path}",
                                     "reward.components={test_huge_scale: {weight: 4}, jpeg_compressibility: null}"])
    trainer = Trainer(cfg)
    metrics = trainer.fit()[0]
    assert metrics["reward_failed"] == 0 and metrics["reward_test_huge_scale_failed"] == 0
    assert 4e38 < metrics["reward_mean"] < 8e38  # a float64 value past float32's range (3.4e38)
    assert metrics["reward_test_huge_scale_mean"] > 1e38
    assert metrics["nonfinite_steps"] == 0 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
