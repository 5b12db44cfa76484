"""grpo.refresh_at knots (docs/algorithm.md, "The refresh at the knots"): after an optimizer step CFG's unconditional
prediction is recomputed at the minibatch plan's knots alone and moved by their drift in between, the conditional
interior values are jagg's `interpolate`; exact where the drift is affine in sigma, the passes counted as run, the
combinations that cannot act refused by key."""

from pathlib import Path

import pytest
import torch
from torch import nn

from jagg_scale.grpo import GRPOStepLoss, sample_sde, sigma_schedule
from jagg_scale.jagg import (SharedKnotPlanner, WindowPlanner, fill_interior, interpolate_forwards, knot_backward,
                             plan_uniform)
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.config import ConfigError
from jagg_scale.train.policy import Policy
from jagg_scale.train.update import UncondRefresh
from minibatch import grpo_backward
from toy_velocity import D, CountingModel, LinearVelocity, MLPVelocity

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "train.prompts_per_step=2", "grpo.group_size=3", "log.progress=false",
         "run.checkpoint_every=0"]
G = 4.5  # CFG
B = 3


class SigmaAffine(nn.Module):
    """v = C c + s (E c): affine in sigma and independent of x, so every value and Jacobian along a window is the
    blend of its ends: JAGG, the interpolated interior values and the refresh at the knots are all exact."""

    def __init__(self):
        super().__init__()
        self.C, self.E = nn.Linear(4, D), nn.Linear(4, D)

    def forward(self, x, s, c):
        return (self.C(c) + s[:, None] * self.E(c)).view_as(x)


class ToyPolicy:
    """What UncondRefresh reads of the Policy: model_fn and fresh_uncond (Policy's own)."""

    fresh_uncond = Policy.fresh_uncond

    def __init__(self, model):
        self.model = model

    def model_fn(self):
        return self.model


def _rollout(model, num_steps=10, seed=0):
    """(cond, uncond, batch): a CFG rollout of B rows of the toy model, every step kept."""
    torch.manual_seed(seed)
    cond, uncond = torch.randn(B, 4), torch.zeros(B, 4)
    with torch.no_grad():
        traj = sample_sde(model, (cond, uncond), torch.randn(B, 3, 2, 2), sigma_schedule(num_steps, 3.0),
                          noise_level=0.7, generator=torch.Generator().manual_seed(seed + 1), guidance=G)
    return cond, uncond, traj.step_batch(torch.arange(B), torch.linspace(-1.5, 1.5, B), torch.ones(B, dtype=torch.bool))


def _moved(model, scale=0.05, seed=7):
    """As an optimizer step would: every parameter moved."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _gradient(model, cond, uncond, batch, steps, planner, refresh_at, **kw):
    model.zero_grad(set_to_none=True)
    loss = GRPOStepLoss(noise_level=0.7, clip_range=0.2, scale=1 / len(steps), guidance=G)
    stats = grpo_backward(model, batch, cond, loss, steps, planner, on_policy=False, refresh_at=refresh_at,
                          refresh=UncondRefresh(ToyPolicy(model), uncond, steps, refresh_at), **kw)
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()
    return grad, stats


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


# ------------------------------------------------------------------ the values


def test_moved_fill_is_exact_for_a_drift_affine_in_sigma_and_keeps_the_knots():
    torch.manual_seed(0)
    sigmas = sigma_schedule(10, 3.0)[:9]
    plan = plan_uniform(9, 4)
    old = torch.randn(9, 2, 5)
    drift = torch.randn(2, 5) + sigmas[:, None, None] * torch.randn(2, 5)  # affine in sigma
    new = old + drift
    got = fill_interior(plan, torch.where(torch.tensor([k in (0, 3, 4, 7, 8) for k in range(9)])[:, None, None],
                                          new, old), sigmas, moved=old)
    assert torch.allclose(got, new, atol=1e-6)
    for k in (0, 3, 4, 7, 8):
        assert torch.equal(got[k], new[k])  # the knots are the recomputed values themselves
    # the plain blend of the knots is not: the rollout's values are not affine in sigma
    assert not torch.allclose(fill_interior(plan, new, sigmas), new, atol=1e-3)


def test_interpolate_forwards_counts_the_no_grad_forwards_knot_backward_runs():
    torch.manual_seed(0)
    sigmas = sigma_schedule(10, 3.0)[:9]
    x, cached = torch.randn(9, B, 3, 2, 2), torch.randn(9, B, 3, 2, 2)
    for plan, rows_per_pass, expected in ((plan_uniform(9, 4), None, 0), (plan_uniform(9, 4, share=True), 2, 1),
                                          (plan_uniform(9, 3, share=True), 2, 2), ([(0, 8)], 1, 1)):
        model = CountingModel(LinearVelocity())
        knot_backward(model, plan, x, sigmas, torch.randn(B, 4), lambda k, v: v.square().sum(),
                      cached_velocities=cached, intermediate="interpolate", rows_per_pass=rows_per_pass)
        nograd = [rows for rows, grad in model.forwards if not grad]
        assert interpolate_forwards(plan, rows_per_pass) == expected == len(nograd)
        assert set(nograd) <= {B}


def test_refresh_at_the_knots_recomputes_the_knots_and_moves_the_rest_by_their_drift():
    model = CountingModel(MLPVelocity())
    cond, uncond, batch = _rollout(model)
    steps, plan = list(range(9)), plan_uniform(9, 4)
    on_policy = ToyPolicy(model).fresh_uncond(batch, steps, uncond, plan)
    assert torch.allclose(on_policy.uncond_velocities, batch.uncond_velocities, atol=1e-6)  # the rollout's weights
    _moved(model)
    model.forwards.clear()
    full = ToyPolicy(model).fresh_uncond(batch, steps, uncond)
    assert len(model.forwards) == 9
    model.forwards.clear()
    knots = ToyPolicy(model).fresh_uncond(batch, steps, uncond, plan)
    assert model.forwards == [(B, False)] * 5  # knots 0, 3, 4, 7, 8
    old, new, got = batch.uncond_velocities, full.uncond_velocities, knots.uncond_velocities
    for k in (0, 3, 4, 7, 8):
        assert torch.equal(got[k], new[k])
    a = float((batch.sigmas[1] - batch.sigmas[0]) / (batch.sigmas[3] - batch.sigmas[0]))
    assert torch.allclose(got[1], old[1] + (1 - a) * (new[0] - old[0]) + a * (new[3] - old[3]), atol=1e-6)
    assert not torch.allclose(got[1], new[1], atol=1e-4)  # a nonlinear model: an approximation
    assert torch.equal(knots.rollout_uncond, old) and torch.equal(got[9], old[9])  # untrained step 9 untouched
    # windows of <= 2 steps have no interior: every trained step is a knot, the refresh's values bit for bit
    assert torch.equal(ToyPolicy(model).fresh_uncond(batch, steps, uncond, plan_uniform(9, 2)).uncond_velocities,
                       new)


# ------------------------------------------------------------------ the gradient and its passes


@pytest.mark.parametrize("planner,uncond_passes,nograd_passes", [(WindowPlanner(window=4), (9, 5), (4, 0)),
                                                                  (SharedKnotPlanner(window=4), (9, 4), (5, 1))])
def test_knots_refresh_is_the_full_refresh_for_a_velocity_affine_in_sigma(planner, uncond_passes, nograd_passes):
    """After an optimizer step, on a model affine in sigma: the knots' gradient equals the full refresh's (both
    JAGG's, both exact here), with fewer no-grad passes, counted as run (the CountingModel's no-grad rows)."""
    model = CountingModel(SigmaAffine())
    cond, uncond, batch = _rollout(model)
    _moved(model)
    steps = list(range(9))
    grads = {}
    for at, uncond_n, nograd_n in zip(("steps", "knots"), uncond_passes, nograd_passes):
        model.forwards.clear()
        grads[at], stats = _gradient(model, cond, uncond, batch, steps, planner, at)
        assert (stats.uncond_forward_passes, stats.nograd_forward_passes) == (uncond_n, nograd_n)
        nograd_rows = sum(rows for rows, grad in model.forwards if not grad)
        assert nograd_rows == (uncond_n + nograd_n) * B
    assert _cos(grads["knots"], grads["steps"]) > 1 - 1e-9
    assert torch.allclose(grads["knots"], grads["steps"], rtol=1e-4, atol=1e-6)


def test_knots_refresh_approximates_the_full_refresh_on_a_nonlinear_model():
    model = MLPVelocity()
    cond, uncond, batch = _rollout(model)
    _moved(model, scale=0.1)
    steps = list(range(9))
    full, _ = _gradient(model, cond, uncond, batch, steps, WindowPlanner(window=4), "steps")
    knots, _ = _gradient(model, cond, uncond, batch, steps, WindowPlanner(window=4), "knots")
    assert 0.5 < _cos(knots, full) < 1 - 1e-6  # close, not the same: the check above could fail


# ------------------------------------------------------------------ training and the config


def test_on_policy_the_key_changes_nothing():
    model = MLPVelocity()
    cond, uncond, batch = _rollout(model)
    steps, grads = list(range(9)), []
    for at in ("steps", "knots"):
        model.zero_grad(set_to_none=True)
        loss = GRPOStepLoss(noise_level=0.7, clip_range=0.2, scale=1 / 9, guidance=G)
        stats = grpo_backward(model, batch, cond, loss, steps, WindowPlanner(window=4), on_policy=True, refresh_at=at)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert stats.uncond_forward_passes == stats.nograd_forward_passes == 0
    assert torch.equal(*grads)


@pytest.mark.parametrize("algorithm", ["grpo", "dppo"])
def test_a_training_step_with_refresh_at_knots(tmp_path, algorithm):
    """Two minibatches under CFG, W = 4 on 4 trained steps (knots 0, 3): the off-policy one recomputes the
    unconditional prediction at the 2 knots alone and forwards no interior (refresh_at steps: 4 and 2), the update's
    no-grad rows (seen by the model) as the metrics count them."""
    cfg = load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "sampling.num_steps=4", "sampling.guidance=4.5",
                                     "jagg.window=4", "train.minibatch_size=3", "train.steps=1",
                                     "grpo.refresh_at=knots", f"train.algorithm={algorithm}"])
    trainer = Trainer(cfg)
    rows, update = [], trainer.algorithm.update

    def update_only(*args, **kw):  # the rows of the update phase alone (not the rollout's)
        rows.clear()
        return update(*args, **kw)

    trainer.algorithm.update = update_only
    trainer.model.register_forward_pre_hook(lambda m, args: rows.append((args[0].shape[0], torch.is_grad_enabled())))
    out = trainer.fit()[0]
    trainer.close()
    assert (out["uncond_forward_passes"], out["nograd_forward_passes"]) == (2, 0)
    assert [n for n, grad in rows if not grad] == [3, 3]  # knots 0 and 3 of the second minibatch's 3 rows
    assert [n for n, grad in rows if grad] == [6, 6]  # one joint pass per minibatch
    assert out["optimizer_steps"] == 2


def _refused(*overrides):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["sampling.guidance=4.5", "train.minibatch_size=8", *overrides], check_files=False)
    return str(info.value)


@pytest.mark.parametrize("overrides,key", [
    (["jagg.mode=exact"], "grpo.refresh_at"),
    (["jagg.window=2"], "grpo.refresh_at"),
    (["jagg.jagg_frac=0"], "grpo.refresh_at"),
    (["jagg.intermediate=forward"], "jagg.intermediate"),
    (["jagg.intermediate=cached"], "jagg.intermediate"),
    (["sampling.guidance=1", "jagg.intermediate=interpolate"], "grpo.refresh_at"),
    (["train.minibatch_size=16"], "grpo.refresh_at"),  # one optimizer step per rollout: nothing refreshed
    (["train.algorithm=gcpo", "gcpo.chunks=[5, 4]", "gcpo.chunk_fraction=0.5", "jagg.window=5"], "grpo.refresh_at"),
    (["train.algorithm=nft", "sampling.guidance=1"], "grpo.refresh_at"),
    (["train.algorithm=awm", "sampling.guidance=1"], "grpo.refresh_at"),
])
def test_refresh_at_knots_is_refused_where_it_cannot_act(overrides, key):
    assert f"'{key}'" in _refused("grpo.refresh_at=knots", *overrides)


@pytest.mark.parametrize("overrides", [[], ["train.algorithm=dppo"], ["sampling.guidance=1"],
                                       ["jagg.intermediate=interpolate"], ["jagg.share_knots=true"],
                                       ["jagg.planner=budget"], ["grpo.step_selection=random"],
                                       ["grpo.inner_epochs=2", "train.minibatch_size=16"]])
def test_refresh_at_knots_is_accepted_where_it_acts(overrides):
    cfg = load_config(TINY, ["sampling.guidance=4.5", "train.minibatch_size=8", "grpo.refresh_at=knots", *overrides],
                      check_files=False)
    assert cfg.grpo.refresh_at == "knots"
