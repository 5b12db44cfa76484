"""The knot planner inside the trainer (jagg.planner: budget, jagg.share_knots): exactness at S = 1, the budget,
agreement with the uniform-window path, the logged plan, and the config checks."""

from pathlib import Path

import pytest
import torch

from jagg_scale.grpo import GRPOStepLoss
from jagg_scale.jagg import Planned, SharedKnotPlanner, plan_uniform
from jagg_scale.train import ConfigError, Trainer, load_config
from minibatch import grpo_backward, plan_of, rollout_minibatch

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.hidden_size=32", "model.dit.depth=2", "model.dit.image_size=16", "sampling.num_steps=8",
         "sampling.chunk_size=8", "train.prompts_per_step=2", "train.minibatch_size=8", "log.progress=false"]


def _setup(tmp_path):
    trainer = Trainer(load_config(TINY, SMALL + [f"run.output_dir={tmp_path}"]))
    cond, batch = rollout_minibatch(trainer)
    loss = GRPOStepLoss(noise_level=0.7, clip_range=1e-4, scale=1 / len(trainer.algorithm.steps))
    return trainer, cond, batch, loss


def _grad(trainer, fn):
    trainer.model.zero_grad(set_to_none=True)
    stats = fn()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters()]), stats


def test_budget_at_speedup_one_is_the_exact_gradient(tmp_path):
    trainer, cond, batch, loss = _setup(tmp_path)
    policy = trainer.policy.velocity_fn()
    exact, _ = _grad(trainer, lambda: grpo_backward(
        policy, batch, cond, loss, trainer.algorithm.steps, **plan_of(mode="exact"), on_policy=True))
    full, stats = _grad(trainer, lambda: grpo_backward(
        policy, batch, cond, loss, trainer.algorithm.steps, **plan_of(planner="budget", speedup=1.0), on_policy=True))
    assert stats.backward_passes == len(trainer.algorithm.steps) == 8 and stats.knots == [list(range(8))]
    assert torch.allclose(full, exact, rtol=1e-5, atol=1e-8)


def test_uniform_windows_as_knots_match_the_window_path(tmp_path):
    trainer, cond, batch, loss = _setup(tmp_path)
    policy = trainer.policy.velocity_fn()
    windows, _ = _grad(trainer, lambda: grpo_backward(
        policy, batch, cond, loss, trainer.algorithm.steps, **plan_of(window=4, intermediate="cached"), on_policy=True))
    # the same knots through the shared-knot planner's path: sorted knots two per pass
    knots, stats = _grad(trainer, lambda: grpo_backward(
        policy, batch, cond, loss, trainer.algorithm.steps, SharedKnotPlanner(window=4, rows_per_pass=2),
        intermediate="cached", on_policy=True, planned=Planned(plan_uniform(8, 4))))
    assert stats.knots == [[0, 3, 4, 7]] and stats.backward_calls == 2
    assert torch.allclose(knots, windows, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(knots, torch.zeros_like(knots))


@pytest.mark.parametrize("speedup,extra", [(2.0, []), (2.67, []), (4.0, ["jagg.rows_per_pass=3"])])
def test_training_with_the_planner_respects_the_budget_and_logs_the_plan(tmp_path, speedup, extra):
    cfg = load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "train.steps=2", "jagg.planner=budget",
                                     f"jagg.speedup={speedup}", *extra])
    rows = Trainer(cfg).fit()
    budget = max(2, int(8 // speedup))
    for r in rows:
        knots = [int(k) for k in r["knots"].split()]
        assert knots[0] == 0 and knots[-1] == 7 and knots == sorted(set(knots))
        assert len(knots) <= budget and r["backward_passes"] == len(knots)
        assert r["pass_ratio"] == pytest.approx(len(knots) / 8)
        assert r["backward_calls"] == -(-len(knots) // cfg.jagg.make_planner().rows_per_pass)


def test_shared_knots_use_fewer_rows_than_windows(tmp_path):
    row = Trainer(load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "train.steps=1", "jagg.window=4",
                                             "jagg.share_knots=true"])).fit()[0]
    assert row["knots"] == "0 3 6 7" and row["backward_passes"] == 4  # windows of 4 sharing boundaries: 0-3, 3-6, 6-7


def test_planner_config_errors_name_the_key(tmp_path):
    for override, key in [("jagg.planner=greedy", "jagg.planner"), ("jagg.speedup=0.5", "jagg.speedup"),
                          ("jagg.rows_per_pass=0", "jagg.rows_per_pass"), ("jagg.error_model=l2", "jagg.error_model")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(TINY, SMALL + [override])
    with pytest.raises(ConfigError, match=r"jagg\.jagg_frac"):
        load_config(TINY, SMALL + ["jagg.planner=budget", "jagg.jagg_frac=0.5"])
    with pytest.raises(ConfigError, match=r"jagg\.jagg_frac"):
        load_config(TINY, SMALL + ["jagg.planner=budget", "jagg.jagg_frac=1.0"])  # set at all, even to the default
