"""AWM in the trainer (train.algorithm awm, train/awm.py): the reference's timestep draw, its EMA schedules, training
with micro-batches, the probe, off-policy sampling and an exact resume with the EMA policy, the config's checks."""

from pathlib import Path

import pytest
import torch

from jagg_scale.awm import AWMConfig
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.awm import EMA_SHADOW, schedule_span, stratified_indices
from jagg_scale.train.logging import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
AWM = ["train.algorithm=awm", "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16",
       "sampling.num_steps=8", "sampling.chunk_size=8", "train.prompts_per_step=2", "train.minibatch_size=4",
       "log.progress=false", "run.checkpoint_every=1", "awm.num_train_timesteps=4", "awm.weighting=ghuber",
       "awm.kl_beta=0.01", "awm.ema_kl_beta=1.0", "awm.ema_decay=0.3", "awm.ema_schedule=linear",
       "awm.ema_warmup_steps=4", "awm.ema_update_interval=1"]


def _reference_discrete(batch_size, num_train_timesteps, scheduler_timesteps, timestep_range, include_init, force_init,
                        generator):
    """Flow-Factory utils/noise_schedule.py:184-259 (TimeSampler.discrete and _stratified_sample), its arithmetic
    transcribed, on the CPU: scheduler-scale timesteps [num_train_timesteps, batch_size]."""
    ts = scheduler_timesteps.float()
    frac_start, frac_end = 0.0, float(timestep_range)
    t_min, t_max = 1000.0 * (1.0 - frac_end), 1000.0 * (1.0 - frac_start)
    valid = torch.where((ts >= t_min - 1e-3) & (ts <= t_max + 1e-3))[0]
    min_idx, max_idx = int(valid.min().item()), int(valid.max().item())

    def stratified(n, start_idx, end_idx):
        boundaries = torch.linspace(start_idx, end_idx, n + 1)
        lower, upper = boundaries[:-1].long(), boundaries[1:].long()
        rand_u = torch.rand(n, generator=generator)
        return lower + (rand_u * (upper - lower)).long()

    if force_init:
        if num_train_timesteps == 1:
            t_indices = torch.tensor([min_idx], dtype=torch.long)
        else:
            t_indices = torch.cat([torch.tensor([min_idx], dtype=torch.long),
                                   stratified(num_train_timesteps - 1, min_idx + 1, max_idx)])
    else:
        t_indices = stratified(num_train_timesteps, min_idx if include_init else min_idx + 1, max_idx)
    t_indices = t_indices.clamp(min=0, max=len(ts) - 1)
    return ts[t_indices].unsqueeze(1).expand(-1, batch_size)


@pytest.mark.parametrize("strategy,include_init,force_init", [
    ("discrete", True, False), ("discrete_with_init", True, True), ("discrete_wo_init", False, False)])
def test_the_timestep_draw_is_the_references(strategy, include_init, force_init):
    """SD3.5's 14-step schedule (shift 3) and timestep_range 0.9, the SD3.5 recipe's: the same strata, the same
    indices from the same uniform draws, for every discrete strategy and 6 (the recipe's) or 12 (its default count)
    timesteps."""
    s = torch.linspace(1.0, 1 / 1000, 14, dtype=torch.float64)
    sigmas = 3.0 * s / (1 + 2.0 * s)
    for K in (6, AWMConfig().trained_count(14)):
        first, start, end = schedule_span(sigmas, (0.0, 0.9), strategy)
        for seed in range(5):
            want = _reference_discrete(2, K, (sigmas * 1000).float(), 0.9, include_init, force_init,
                                       torch.Generator().manual_seed(seed))[:, 0]
            g = torch.Generator().manual_seed(seed)
            idx = stratified_indices(K - force_init, start, end, g)
            idx = torch.cat([torch.tensor([first]), idx]) if force_init else idx
            torch.testing.assert_close((sigmas[idx] * 1000).float(), want)
    assert AWMConfig().trained_count(14) == 12 and AWMConfig(timestep_range=(0.1, 0.6)).trained_count(10) == 5


def test_the_ema_schedules_are_flow_factorys():
    """ema/ema_utils.py:38-75 with initial_decay 0: the SD3.5 recipe's linear warm-up to 0.3 over 1000 steps."""
    linear = AWMConfig(ema_kl_beta=1, ema_decay=0.3, ema_schedule="linear", ema_warmup_steps=1000)
    assert [linear.ema_decay_at(s) for s in (0, 500, 999, 1000, 5000)] == pytest.approx([0, 0.15, 0.2997, 0.3, 0.3])
    power = AWMConfig(ema_kl_beta=1)  # the reference's defaults: power, 0.995, warm-up 10
    assert [power.ema_decay_at(s) for s in (0, 10, 10_000)] == pytest.approx([0.1, 11 / 20, 0.995])
    assert AWMConfig(ema_kl_beta=1, ema_schedule="constant", ema_decay=0.9).ema_decay_at(0) == 0.9


def test_the_unit_draws_per_row_per_epoch_and_per_window(tmp_path):
    """Each row its own sorted timesteps, the same wherever it is drawn, fresh every inner epoch; per_batch: the
    minibatch's first row's for all; awm.noise per_window: one draw per JAGG window of 3 ([0-2] [3])."""
    trainer = Trainer(load_config(TINY, AWM + [f"run.output_dir={tmp_path}", "awm.noise=per_window",
                                               "jagg.window=3", "awm.timestep_range=[0, 1]"]))
    unit = trainer.algorithm
    rows = torch.tensor([5, 9, 2])
    t = unit._timesteps(3, 0, rows, rows)
    assert t.shape == (4, 3) and (t[:-1] > t[1:]).all()  # distinct, high noise to low
    assert not torch.equal(t[:, 0], t[:, 1]) or not torch.equal(t[:, 1], t[:, 2])
    assert torch.equal(unit._timesteps(3, 0, rows[1:2], rows)[:, 0], t[:, 1])
    assert not torch.equal(unit._timesteps(3, 1, rows, rows), t)
    trainer.cfg.awm.timesteps = "per_batch"
    assert torch.equal(unit._timesteps(3, 0, rows, rows[1:]), t[:, 1:2].expand(4, 3))
    e = unit._noise(step=3, epoch=0, global_rows=rows, shape=(2, 2))
    assert torch.equal(e[0], e[2]) and not torch.equal(e[2], e[3]) and not torch.equal(e[0, 0], e[0, 1])
    trainer.close()


def test_awm_trains_off_policy_in_micro_batches_and_resumes_exactly(tmp_path):
    """Off-policy (the EMA policy samples and gives the old log-prob: the ratio leaves 1), JAGG windows of 3 over a
    noise draw per window with the frozen models at the knots, micro-batches of 2, the probe on step 0; the EMA
    policy lags the trained weights, moves by the linear schedule, and a resumed run continues exactly."""
    common = AWM + ["awm.off_policy=true", "awm.clip_range=0.2", "awm.noise=per_window", "awm.frozen_at=knots",
                    "jagg.window=3", "train.micro_batch_size=2"]
    full = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'full'}", "train.steps=3",
                                               "jagg.probe_every=3"]))
    rows = full.fit()
    ema = {n: t.clone() for n, t in full.engine.shadows[EMA_SHADOW].items()}
    live = dict(full.engine.model.named_parameters())
    assert any(not torch.equal(ema[n], live[n]) for n in ema)
    assert [r["ema_policy_decay"] for r in rows] == pytest.approx([0.0, 0.075, 0.15])
    # K = 4 timesteps in windows [0-2] [3]: knots 0, 2, 3 per minibatch, two minibatches per step
    assert all(r["backward_passes"] == 3 * 2 and r["per_step_equiv"] == 4 * 2 for r in rows)
    assert 0.5 < rows[0]["probe_cos"] <= 1 + 1e-6 and "probe_cos" not in rows[1]
    assert rows[-1]["ratio_max"] > 1 or rows[-1]["ratio_min"] < 1  # the EMA's log-prob is not the trained one's
    assert rows[-1]["kl"] > 0 and rows[-1]["ema_kl"] > 0
    full.close()
    Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=2",
                                        "jagg.probe_every=3"])).fit()
    resumed = Trainer(load_config(TINY, common + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=3",
                                                  "jagg.probe_every=3", "run.resume=auto"]))
    assert resumed.start_step == 2
    resumed.fit()
    for n, t in resumed.engine.shadows[EMA_SHADOW].items():
        assert torch.equal(t, ema[n]), n
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rs]  # noqa: E731
    assert strip(read_metrics(tmp_path / "cut")) == strip(read_metrics(tmp_path / "full"))
    resumed.close()


@pytest.mark.parametrize("override,key", [
    (["awm.weighting=ghuber"], "awm.weighting"),  # an AWM key on a GRPO run
    (["train.algorithm=awm", "nft.mix=0.5"], "nft.mix"),
    (["train.algorithm=awm", "grpo.timestep_fraction=0.5"], "grpo.timestep_fraction"),
    (["train.algorithm=awm", "grpo.clip_range=0.2"], "grpo.clip_range"),
    (["train.algorithm=awm", "sampling.guidance=4.5"], "sampling.guidance"),
    (["train.algorithm=awm", "awm.ghuber_power=0.5"], "awm.ghuber_power"),  # weighting Uniform
    (["train.algorithm=awm", "awm.clip_range=0.2"], "awm.clip_range"),  # on-policy: ratio 1
    (["train.algorithm=awm", "awm.ema_decay=0.3"], "awm.ema_decay"),  # no EMA policy read
    (["train.algorithm=awm", "awm.ema_kl_beta=1", "awm.ema_schedule=constant", "awm.ema_warmup_steps=5"],
     "awm.ema_warmup_steps"),
    (["train.algorithm=awm", "awm.timestep_range=[0.5, 0.4]"], "awm.timestep_range"),
    (["train.algorithm=awm", "awm.noise=per_window", "jagg.mode=exact"], "awm.noise"),
    (["train.algorithm=awm", "awm.ema_kl_beta=1", "awm.frozen_at=knots", "jagg.jagg_frac=0.5"], "awm.frozen_at"),
    (["train.algorithm=awm", "jagg.intermediate=cached"], "jagg.intermediate"),  # no EMA: nothing cached
    (["train.algorithm=awm", "jagg.planner=budget"], "jagg.planner"),
    (["train.algorithm=awm", "awm.weighting=l2"], "awm.weighting"),
])
def test_what_awm_does_not_use_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(TINY, override)
    assert load_config(TINY, ["train.algorithm=awm", "awm.ema_kl_beta=1", "jagg.intermediate=cached"]).awm.uses_ema


def test_strata_that_may_repeat_a_step_are_refused_under_jagg(tmp_path):
    """14 strata over the steps 1 .. 14 of 15 (discrete_wo_init; all of them in timestep_range here) may draw a step
    twice: a JAGG window then has equal endpoint noise levels. The reference allows it; mode exact trains it."""
    over = AWM + [f"run.output_dir={tmp_path}", "sampling.num_steps=15", "awm.num_train_timesteps=14",
                  "awm.time_sampling=discrete_wo_init"]
    with pytest.raises(ConfigError, match="config key 'awm.num_train_timesteps'"):
        Trainer(load_config(TINY, over))
    Trainer(load_config(TINY, over + ["jagg.mode=exact"])).close()
