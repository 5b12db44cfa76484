"""train.ema_decay: an EMA of the trainable weights, updated per optimizer step, checkpointed (exact resume), and
swapped in for evaluation only."""

from pathlib import Path

import pytest
import torch

from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.logging import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16", "sampling.num_steps=4",
         "train.prompts_per_step=2", "train.batch_size=4", "log.progress=false", "train.ema_decay=0.5"]


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


def test_ema_is_checkpointed_and_resume_is_exact(tmp_path):
    common = SMALL + ["run.checkpoint_every=1"]
    full = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'full'}", "train.steps=3"]))
    full.fit()
    Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=2"])).fit()
    resumed = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=3",
                                                  "run.resume=auto"]))
    resumed.fit()
    for n, e in full.engine.ema.items():
        assert torch.equal(e, resumed.engine.ema[n]), n
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]
    assert strip(read_metrics(tmp_path / "cut")) == strip(read_metrics(tmp_path / "full"))


def test_ema_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.ema_decay"):
        load_config(TINY, SMALL + ["train.ema_decay=1.0"])
    with pytest.raises(ConfigError, match=r"train\.ema_decay"):
        load_config(TINY, SMALL + ["train.ema_decay=-0.1"])
    # every engine keeps an EMA (DeepSpeed: of each rank's fp32 partitions, tests/parallel/test_deepspeed_engine.py;
    # every engine saves and reads it back: tests/parallel/test_engines.py)
