"""grpo.step_selection (grpo/steps.py): which steps each sample trains, as Flow-GRPO (first), DanceGRPO (random per
sample) and eff_grpo (random windows per sample) choose them, and the per-row layout that trains them."""


import pytest
import torch

from jagg_scale.grpo import GRPOStepLoss
from jagg_scale.grpo.steps import candidate_steps, positioned, select_steps, trained_count
from jagg_scale.jagg import exact_plan, knot_backward
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.logging import read_metrics
from train_runs import TINY, small_dit

SMALL = small_dit(9, 6)


def test_counts_are_the_peers():
    # Flow-GRPO: int(10 x 0.99) = 9 of all 10; DanceGRPO FLUX: int(15 x 0.6) = 9 of the first 15 of 16 steps;
    # eff_grpo Qwen-Image: 21 steps -> 20 candidates, 5 windows of 4, int(5 x 0.6) = 3 trained -> 12 steps
    assert trained_count("first", 10, 0.99) == 9 and candidate_steps("first", 10) == 10
    assert trained_count("random", 16, 0.6) == 9 and candidate_steps("random", 16) == 15
    assert trained_count("windows", 21, 0.6, 4) == 12 and candidate_steps("windows", 21) == 20
    assert trained_count("random", 20, 0.6) == 11  # DanceGRPO Wan2.1: 20 steps -> int(19 x 0.6)


def test_random_is_a_uniform_draw_per_row_independent_of_the_rank_split():
    rows = torch.arange(4000)
    steps = select_steps("random", 16, 0.6, 4, seed=7, step=3, rows=rows)
    assert steps.shape == (9, 4000)
    assert (steps[1:] > steps[:-1]).all() and steps.min() >= 0 and steps.max() <= 14  # sorted, distinct, the last out
    # rows draw their own: 4000 uniform draws of C(15, 9) = 5005 subsets give 5005 (1 - e^(-4000/5005)) ~ 2760 apart
    assert 2650 < len({tuple(c) for c in steps.T.tolist()}) < 2870
    freq = torch.bincount(steps.flatten(), minlength=15).double() / 4000
    assert torch.allclose(freq, torch.full((15,), 9 / 15, dtype=torch.float64), atol=0.03)  # each step 9/15 of rows
    # a rank holding rows 1000..1999 draws what one process drew for them; another step draws anew
    assert torch.equal(select_steps("random", 16, 0.6, 4, 7, 3, rows[1000:2000]), steps[:, 1000:2000])
    assert not torch.equal(select_steps("random", 16, 0.6, 4, 7, 4, rows), steps)


def test_windows_draws_whole_aligned_blocks():
    steps = select_steps("windows", 21, 0.6, 4, seed=0, step=0, rows=torch.arange(2000))
    assert steps.shape == (12, 2000)
    blocks = steps.reshape(3, 4, 2000)
    assert (blocks[:, 0] % 4 == 0).all() and (blocks - blocks[:, :1] == torch.arange(4)[None, :, None]).all()
    starts = torch.bincount((blocks[:, 0] // 4).flatten(), minlength=5).double() / 2000
    assert torch.allclose(starts, torch.full((5,), 0.6, dtype=torch.float64), atol=0.04)  # 3 of 5 blocks each


def test_first_is_every_rows_first_steps():
    assert select_steps("first", 10, 0.99, 4, 0, 0, torch.arange(3)).T.tolist() == [list(range(9))] * 3


def _batch(T=6, B=5, D=8, seed=0):
    from jagg_scale.grpo.loss import StepBatch

    g = torch.Generator().manual_seed(seed)
    sigmas = torch.linspace(1, 0, T + 1)
    return StepBatch(latents=torch.randn(T + 1, B, D, generator=g), velocities=torch.randn(T, B, D, generator=g),
                     log_probs=torch.randn(T, B, generator=g) * 0.01, sigmas=sigmas,
                     advantages=torch.randn(B, generator=g), mask=torch.ones(B, dtype=torch.bool),
                     ref_velocities=torch.randn(T, B, D, generator=g))


def test_the_positioned_batch_is_each_rows_own_steps():
    """Position q of row b gives the loss and the gradient row b's own step steps[q, b] gives: every row's terms
    (policy and KL) equal the full batch's at that row and step."""
    batch = _batch()
    steps = select_steps("random", 7, 0.5, 4, 1, 0, torch.arange(5))  # 3 of the first 6 per row
    moved, positions = positioned(batch, steps)
    assert positions == [0, 2, 4] and moved.sigmas.shape == (6, 5)
    loss = GRPOStepLoss(noise_level=0.7, clip_range=1e-4, beta=0.1, denominator=1.0)
    v = batch.velocities + 0.01
    for q, p in enumerate(positions):
        got = torch.stack([loss(moved.rows(slice(b, b + 1)), p, v[steps[q, b], b : b + 1]) for b in range(5)])
        want = torch.stack([loss(batch.rows(slice(b, b + 1)), int(steps[q, b]), v[steps[q, b], b : b + 1])
                            for b in range(5)])
        assert torch.allclose(got, want, atol=1e-6)
        assert not torch.allclose(got, torch.stack([loss(batch.rows(slice(b, b + 1)), q, v[q, b : b + 1])
                                                    for b in range(5)]), atol=1e-6)  # not the shared steps'


def test_the_exact_gradient_over_positions_is_the_per_row_sum():
    """knot_backward over the positions (per-row sigmas as the model's inputs) = the sum over rows of each row's
    exact per-step gradient on its own steps."""
    torch.manual_seed(0)
    batch = _batch(B=3)
    lin = torch.nn.Linear(9, 8)
    model = lambda x, s, c: lin(torch.cat([x, s[:, None]], dim=1))
    steps = select_steps("random", 7, 0.5, 4, 2, 0, torch.arange(3))
    moved, positions = positioned(batch, steps)
    loss = GRPOStepLoss(noise_level=0.7, clip_range=0.2, beta=0.0, denominator=1.0)
    knot_backward(model, exact_plan(len(positions)), moved.latents[positions], moved.sigmas[positions], None,
                  loss.on(moved, positions))
    got = lin.weight.grad.clone()
    lin.weight.grad = None
    for b in range(3):
        row = batch.rows(slice(b, b + 1))
        own = steps[:, b].tolist()
        knot_backward(model, exact_plan(len(own)), row.latents[own], row.sigmas[own], None, loss.on(row, own))
    assert torch.allclose(got, lin.weight.grad, atol=1e-6)


@pytest.mark.parametrize("selection, window, trained", [("random", 3, 4), ("windows", 4, 4)])
def test_a_run_trains_each_rows_own_steps(tmp_path, selection, window, trained):
    # 9 steps: random trains int(8 x 0.5) = 4 of the first 8; windows 1 of 2 blocks of 4
    cfg = load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "train.steps=2", f"jagg.window={window}",
                                     f"grpo.step_selection={selection}", "grpo.timestep_fraction=0.5",
                                     "grpo.kl_beta=0.01"])
    Trainer(cfg).fit()
    rows = read_metrics(tmp_path)
    assert [r["per_step_equiv"] for r in rows] == [trained] * 2
    for r in rows:
        assert torch.isfinite(torch.tensor([r["loss"], r["grad_norm"], r["kl"]])).all() and r["grad_norm"] > 0
        assert r["onpolicy_log_ratio"] < 1e-6  # the per-row layout reproduces the rollout's log-probs (float order)


@pytest.mark.parametrize("override, key", [
    (["train.algorithm=nft"], "grpo.step_selection"),
    (["grpo.sde_window=3"], "grpo.sde_window"),
    (["grpo.kl_beta=0.01", "grpo.ref_at=knots"], "grpo.ref_at"),
    (["jagg.planner=budget"], "jagg.planner"),
    (["jagg.window=3", "grpo.step_selection=windows"], "jagg.window"),  # 8 candidates in blocks of 3
])
def test_selections_that_cannot_act_are_refused(tmp_path, override, key):
    base = ["grpo.step_selection=random"] if "grpo.step_selection=windows" not in override else []
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", *base, *override])
