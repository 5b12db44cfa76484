"""Knot plans and the budgeted planner (jagg_scale/jagg/knots.py) against docs/algorithm.md (sections 3, 5).

The toy models (tests/toy_velocity.py) and the collinear construction are those of tests/jagg/test_backward.py, over all
T steps of a batch instead of one window."""

import math
import random

import pytest
import torch

from jagg_scale.jagg import (budget_for_speedup, check_plan, composite_upstream, cosine_error, exact_backward,
                             fill_interior, jagg_backward, knot_backward, knots_from_windows, pass_groups, plan_budget,
                             plan_cost, plan_from_knots, plan_knots, plan_uniform, split_windows, residual_error,
                             segment_costs, velocity_cosines, window_weights)
from toy_velocity import CountingModel, LinearVelocity, MLPVelocity

MODES = ["cached", "interpolate", "forward"]


def make_step_loss(T, B, seed=0):
    g = torch.Generator().manual_seed(seed)
    targets = torch.randn(T, B, 3, 2, 2, generator=g, dtype=torch.float64)
    adv = torch.randn(T, B, generator=g, dtype=torch.float64)

    def step_loss(k, v):
        logp = -((v.double() - targets[k]) ** 2).mean(dim=(1, 2, 3))
        return (-adv[k] * torch.exp(0.1 * logp)).mean()

    return step_loss


def make_batch(T, B, seed=0, collinear=True):
    """latents [T, B, ...] on the segment x_0 -> x_{T-1}, affine in sigma (collinear=True) or random, and cond."""
    g = torch.Generator().manual_seed(seed)
    sigmas = torch.sort(torch.rand(T, generator=g, dtype=torch.float64), descending=True).values * 0.9 + 0.05
    x0, x1 = torch.randn(2, B, 3, 2, 2, generator=g, dtype=torch.float64)
    latents = torch.stack([(1 - a) * x0 + a * x1 for a in window_weights(sigmas)])
    if not collinear:
        latents = torch.randn(T, B, 3, 2, 2, generator=g, dtype=torch.float64)
    return latents, sigmas, torch.randn(B, 4, generator=g, dtype=torch.float64)


def cached_of(model, latents, sigmas, cond):
    with torch.no_grad():
        return torch.stack([model(latents[k], sigmas[k].expand(latents.shape[1]), cond) for k in range(len(sigmas))])


def grad_after(model, fn, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = fn(*args, **kwargs)
    return loss, torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def all_plans(T):
    """Every valid segment list over T steps, shared and non-shared boundaries (brute force for the DP)."""

    def from_start(a):
        for b in range(a, T):
            if b == T - 1:
                yield [(a, b)]
                continue
            for rest in from_start(b + 1):  # non-shared boundary
                yield [(a, b)] + rest
            if a < b:  # shared knot b: both sides need length >= 1
                for rest in from_start(b):
                    if rest[0][0] < rest[0][1]:
                        yield [(a, b)] + rest

    return list(from_start(0))


def reference_cost(plan, g_norms, vcos, sigmas):
    """The error model written out step by step: sum |g_k| (1 - vcos[a, b]) a_k (1 - a_k) over interior k."""
    total = 0.0
    for a, b in plan:
        for k in range(a + 1, b):
            ak = float((sigmas[k] - sigmas[a]) / (sigmas[b] - sigmas[a]))
            total += float(g_norms[k]) * (1 - float(vcos[a, b])) * ak * (1 - ak)
    return total


def random_plan(T, rng):
    """Random knots (first and last included), each adjacent pair of knots randomly shared or non-shared."""
    knots = sorted({0, T - 1} | {k for k in range(1, T - 1) if rng.random() < 0.4})
    plan = []
    for p, q in zip(knots[:-1], knots[1:]):
        if q == p + 1 and rng.random() < 0.5:  # non-shared boundary between p and q
            if not plan or plan[-1][1] != p:
                plan.append((p, p))
        else:
            plan.append((p, q))
    if not plan or plan[-1][1] != T - 1:
        plan.append((T - 1, T - 1))
    return check_plan(plan, T)


# ----------------------------------------------------------------------------------------------------------------
# plans
# ----------------------------------------------------------------------------------------------------------------


def test_plan_representations():
    assert plan_uniform(10, 4) == [(0, 3), (4, 7), (8, 9)] == knots_from_windows(split_windows(range(10), 4))
    assert plan_uniform(16, 4, share=True) == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15)]  # the doc's 6 rows
    assert knots_from_windows(split_windows(range(16), 4), share=True) == plan_from_knots([0, 3, 7, 11, 15])
    assert knots_from_windows([[0, 1, 2, 3], [3, 4, 5, 6]], share=True) == [(0, 3), (3, 6)]
    assert plan_uniform(5, 1) == [(k, k) for k in range(5)] == plan_uniform(5, 1, share=True)
    assert plan_uniform(1, 4) == [(0, 0)] == plan_uniform(1, 4, share=True)
    assert len(plan_knots(plan_uniform(16, 4))) == 8 and len(plan_knots(plan_uniform(16, 4, share=True))) == 6
    assert plan_knots([(0, 3), (4, 7), (8, 9)]) == [0, 3, 4, 7, 8, 9]
    for T in range(1, 12):
        for W in range(1, 6):
            for share in (False, True):
                plan = check_plan(plan_uniform(T, W, share), T)
                assert max(b - a + 1 for a, b in plan) <= W
    for bad in ([(1, 3)], [(0, 2)], [(0, 3), (5, 5)], [(0, 1), (1, 1)], [(0, 0), (0, 3)], [(2, 1), (2, 3)]):
        with pytest.raises(ValueError):
            check_plan(bad, 4)
    with pytest.raises(ValueError, match="contiguous"):
        knots_from_windows([[0, 1], [3, 4]])
    assert budget_for_speedup(16, 2) == 8 and budget_for_speedup(16, 4) == 4 and budget_for_speedup(16, 100) == 2
    assert budget_for_speedup(16, 1) == 16 and budget_for_speedup(1, 3) == 1 and budget_for_speedup(7, 2.5) == 2


def test_composite_upstream_is_the_weighted_split():
    T = 9
    g = torch.randn(T, 3, 5, dtype=torch.float64)
    sigmas = torch.tensor([1.0, 0.97, 0.9, 0.8, 0.6, 0.45, 0.3, 0.1, 0.02], dtype=torch.float64)
    plan = [(0, 4), (5, 6), (6, 8)]
    G = composite_upstream(plan, g, sigmas)
    expect = {q: g[q].clone() for q in plan_knots(plan)}
    for a, b in plan:
        for k in range(a + 1, b):
            w = (sigmas[k] - sigmas[a]) / (sigmas[b] - sigmas[a])
            expect[a] += (1 - w) * g[k]
            expect[b] += w * g[k]
    assert torch.allclose(G, torch.stack([expect[q] for q in plan_knots(plan)]), atol=1e-14)
    assert torch.allclose(G.sum(0), g.sum(0), atol=1e-13)  # the split weights sum to one


def test_fill_interior_blends_each_segment_in_sigma_per_row():
    """Values at the knots are kept; an interior step gets (1 - a_k) v_a + a_k v_b with each row's own a_k, so values
    affine in sigma come back exactly and anything else does not."""
    T, B = 7, 3
    sigmas = torch.sort(torch.rand(T, B, dtype=torch.float64), dim=0, descending=True).values
    slope, offset = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 4, dtype=torch.float64)
    affine = sigmas[..., None] * slope + offset  # [T, B, 4], affine in each row's sigma
    plan = [(0, 3), (4, 4), (5, 6)]
    holes = affine.clone()
    holes[[1, 2]] = float("nan")  # only the knots may be read
    filled = fill_interior(plan, holes, sigmas)
    assert torch.allclose(filled, affine, atol=1e-12)
    assert torch.isnan(holes[1]).all()  # a new tensor
    curved = affine ** 2
    assert not torch.allclose(fill_interior(plan, curved, sigmas)[1:3], curved[1:3], atol=1e-3)
    assert torch.equal(fill_interior(plan, curved, sigmas)[[0, 3, 4, 5, 6]], curved[[0, 3, 4, 5, 6]])


# ----------------------------------------------------------------------------------------------------------------
# knot_backward
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_uniform_non_shared_windows_equal_jagg_backward_per_window(mode):
    torch.manual_seed(0)
    model, T, B, W = MLPVelocity().double(), 10, 3, 4  # nonlinear, random inputs: JAGG is approximate here
    latents, sigmas, cond = make_batch(T, B, seed=1, collinear=False)
    step_loss = make_step_loss(T, B, seed=2)
    cached = cached_of(model, latents, sigmas, cond) + 0.01 * torch.randn(T, B, 3, 2, 2, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    ref_loss = 0.0
    for w in split_windows(range(T), W):
        idx = torch.tensor(w)
        ref_loss += jagg_backward(model, latents[idx], sigmas[idx], cond, lambda k, v, w=w: step_loss(w[k], v),
                                  cached_velocities=cached[idx], intermediate=mode)
    ref = torch.cat([p.grad.flatten() for p in model.parameters()]).clone()
    loss, got = grad_after(model, knot_backward, model, plan_uniform(T, W), latents, sigmas, cond, step_loss,
                           cached_velocities=cached, intermediate=mode)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-14)
    assert abs(float(loss - ref_loss)) <= 1e-12
    _, exact = grad_after(model, exact_backward, model, latents, sigmas, cond, step_loss)
    assert rel_err(got, exact) > 1e-6  # guards the comparison against passing trivially


@pytest.mark.parametrize("seed", range(4))
def test_any_plan_is_exact_on_affine_velocity_with_collinear_inputs(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model, T, B = LinearVelocity().double(), 9, 3
    latents, sigmas, cond = make_batch(T, B, seed=seed)
    step_loss = make_step_loss(T, B, seed=seed)
    cached = cached_of(model, latents, sigmas, cond)
    ref_loss, ref = grad_after(model, exact_backward, model, latents, sigmas, cond, step_loss)
    plans = [random_plan(T, rng) for _ in range(3)] + [plan_uniform(T, 4), plan_uniform(T, 4, True), [(0, T - 1)],
                                                       [(0, 3), (4, 4), (5, 8)]]
    for plan in plans:
        for mode in MODES:
            loss, got = grad_after(model, knot_backward, model, plan, latents, sigmas, cond, step_loss,
                                   cached_velocities=cached, intermediate=mode, rows_per_pass=rng.randint(1, 4))
            assert rel_err(got, ref) <= 1e-9, (plan, mode)
            assert abs(float(loss - ref_loss)) <= 1e-12


def test_full_budget_gives_every_step_and_the_exact_gradient():
    torch.manual_seed(0)
    model, T, B = MLPVelocity().double(), 7, 3
    latents, sigmas, cond = make_batch(T, B, seed=3, collinear=False)
    step_loss = make_step_loss(T, B, seed=4)
    cached = cached_of(model, latents, sigmas, cond)
    g_norms = torch.rand(T, dtype=torch.float64) + 0.1
    plan = plan_budget(g_norms, cosine_error(velocity_cosines(cached), sigmas), budget_for_speedup(T, 1))
    assert plan_knots(plan) == list(range(T))
    _, ref = grad_after(model, exact_backward, model, latents, sigmas, cond, step_loss)
    _, got = grad_after(model, knot_backward, model, plan, latents, sigmas, cond, step_loss, cached_velocities=cached)
    assert rel_err(got, ref) <= 1e-12


def test_rows_per_pass_same_gradient_and_one_backward_per_chunk():
    torch.manual_seed(0)
    T, B = 11, 2
    latents, sigmas, cond = make_batch(T, B, seed=5, collinear=False)
    step_loss = make_step_loss(T, B, seed=6)
    plan = [(0, 3), (4, 4), (5, 8), (8, 10)]  # knots 0, 3, 4, 5, 8, 10: mixed shared, non-shared, lone step
    model = CountingModel(MLPVelocity().double())
    cached = cached_of(model.inner, latents, sigmas, cond)
    K = len(plan_knots(plan))
    grads = []
    for r in (1, 2, 3, 4, 6, 7):
        model.forwards, model.backwards = [], 0
        _, g = grad_after(model, knot_backward, model, plan, latents, sigmas, cond, step_loss,
                          cached_velocities=cached, rows_per_pass=r)
        grads.append(g)
        assert model.backwards == len(model.grad_rows) == math.ceil(K / r)
        assert model.grad_rows == [B * min(r, K - i) for i in range(0, K, r)]
    for g in grads[1:]:
        assert torch.allclose(g, grads[0], rtol=1e-12, atol=1e-14)
    # the same as one backward of composite_upstream's G through all knots (on-policy: cached = fresh values)
    ups = []
    for k in range(T):
        v = cached[k].clone().requires_grad_(True)
        ups.append(torch.autograd.grad(step_loss(k, v), v)[0])
    G = composite_upstream(plan, torch.stack(ups), sigmas)
    knots = plan_knots(plan)
    model.zero_grad(set_to_none=True)
    v = model(latents[knots].flatten(0, 1), sigmas[knots].repeat_interleave(B), cond.repeat(K, 1))
    v.backward(G.flatten(0, 1))
    assert torch.allclose(torch.cat([p.grad.flatten() for p in model.parameters()]), grads[0], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="rows_per_pass"):
        knot_backward(model, plan, latents, sigmas, cond, step_loss, cached_velocities=cached, rows_per_pass=0)


# ----------------------------------------------------------------------------------------------------------------
# the planner
# ----------------------------------------------------------------------------------------------------------------


def random_problem(T, seed):
    g = torch.Generator().manual_seed(seed)
    sigmas = torch.sort(torch.rand(T, generator=g, dtype=torch.float64), descending=True).values
    g_norms = torch.rand(T, generator=g, dtype=torch.float64) * torch.logspace(0, 1.5, T, dtype=torch.float64)
    if seed % 2:  # cosines of a smooth random velocity path
        vel = torch.cumsum(torch.randn(T, 4, 6, generator=g, dtype=torch.float64), 0)
        vcos = velocity_cosines(vel)
    else:  # any symmetric table: the DP must not rely on the model being physical
        m = torch.rand(T, T, generator=g, dtype=torch.float64) * 2 - 1
        vcos = (m + m.T) / 2
    return g_norms, vcos, sigmas


@pytest.mark.parametrize("T", range(1, 9))
def test_dp_is_optimal_against_brute_force(T):
    plans = all_plans(T)
    assert all(check_plan(p, T) == p for p in plans)
    assert len({tuple(p) for p in plans}) == len(plans)
    for seed in range(4):
        g_norms, vcos, sigmas = random_problem(T, 10 * T + seed)
        for budget in sorted({2, 3, (T + 1) // 2, T - 1, T} - {0, 1} if T > 1 else {1}):
            plan = check_plan(plan_budget(g_norms, cosine_error(vcos, sigmas), budget), T)
            assert len(plan_knots(plan)) <= budget
            best = min(reference_cost(p, g_norms, vcos, sigmas) for p in plans if len(plan_knots(p)) <= budget)
            got = reference_cost(plan, g_norms, vcos, sigmas)
            assert got <= best + 1e-12 * max(1.0, best), (T, seed, budget, plan)
            assert abs(plan_cost(plan, g_norms, cosine_error(vcos, sigmas)) - got) <= 1e-12 * max(1.0, got)


def test_dp_with_the_residual_error_model_and_a_callable_vcos():
    T = 7
    g = torch.Generator().manual_seed(0)
    vel = torch.cumsum(torch.randn(T, 3, 5, generator=g, dtype=torch.float64), 0)
    g_norms, _, sigmas = random_problem(T, 1)
    e = residual_error(vel, sigmas)
    plans = all_plans(T)
    for budget in (2, 3, 4, 5):
        plan = plan_budget(g_norms, e, budget)
        best = min(plan_cost(p, g_norms, e) for p in plans if len(plan_knots(p)) <= budget)
        assert len(plan_knots(plan)) <= budget and plan_cost(plan, g_norms, e) <= best + 1e-12
    vcos = velocity_cosines(vel)
    assert (plan_budget(g_norms, cosine_error(lambda a, b: float(vcos[a, b]), sigmas), 4)
            == plan_budget(g_norms, cosine_error(vcos, sigmas), 4))


def test_planner_keeps_high_gradient_steps_exact_and_is_fast():
    T = 100
    sigmas = torch.linspace(1.0, 0.01, T, dtype=torch.float64)
    g_norms = torch.logspace(0, 2, T, dtype=torch.float64)  # |g| grows ~100x towards low sigma, as measured
    vcos = torch.cos(sigmas[:, None] - sigmas[None, :])  # smooth: decorrelates with the sigma distance
    plan = plan_budget(g_norms, cosine_error(vcos, sigmas), 25)
    # fast = polynomial, checked by counting instead of timing (a wall-clock bound fails on a busy machine): the
    # planner evaluates the error model once per segment (a, b), O(T^2), never once per knot set (C(T, 25))
    calls = []

    def counting_cos(a, b):
        calls.append((a, b))
        return float(vcos[a, b])

    assert plan_budget(g_norms, cosine_error(counting_cos, sigmas), 25) == plan
    assert len(calls) == len(set(calls)) <= T * (T - 1) // 2
    knots = plan_knots(plan)
    assert len(plan_knots(plan)) <= 25 and knots[0] == 0 and knots[-1] == T - 1
    gaps = [q - p for p, q in zip(knots[:-1], knots[1:])]
    assert gaps[0] > gaps[-1]  # long segments at high sigma, dense knots where the gradient is
    assert plan_cost(plan, g_norms, cosine_error(vcos, sigmas)) < plan_cost(plan_uniform(T, 8, True), g_norms,
                                                                          cosine_error(vcos, sigmas))
    assert segment_costs(g_norms[:3], cosine_error(vcos[:3, :3], sigmas[:3]))[0, 1] == 0.0
    with pytest.raises(ValueError, match="max_knots"):
        plan_budget(g_norms, cosine_error(vcos, sigmas), 1)


# ----------------------------------------------------------------------------------------------------------------
# one engine: every plan, every backward through the caller's hook, one synchronisation point
# ----------------------------------------------------------------------------------------------------------------


def nonlinear_problem(T, B, seed):
    """A nonlinear model on random (not collinear) inputs, its step losses and on-policy cached velocities."""
    torch.manual_seed(0)
    model = MLPVelocity().double()
    latents, sigmas, cond = make_batch(T, B, seed=seed, collinear=False)
    return model, latents, sigmas, cond, make_step_loss(T, B, seed=seed + 1), cached_of(model, latents, sigmas, cond)


@pytest.mark.parametrize("plan,rows_per_pass,groups", [
    ([(0, 0), (1, 1), (2, 2), (3, 3)], None, [[0], [1], [2], [3]]),  # Flow-GRPO: a pass per step
    ([(0, 3)], None, [[0, 3]]),  # one JAGG window: one joint pass
    ([(0, 1), (2, 2), (3, 3)], None, [[0, 1], [2], [3]]),  # routed window then two exact steps
    ([(0, 2), (2, 3)], None, [[0, 2], [3]]),  # shared knot: computed once
    ([(0, 2), (2, 3)], 2, [[0, 2], [3]]),
    ([(0, 0), (1, 1), (2, 2), (3, 3)], 3, [[0, 1, 2], [3]]),
])
def test_every_backward_goes_through_the_hook_and_only_the_last_syncs(plan, rows_per_pass, groups):
    assert pass_groups(plan, rows_per_pass) == groups
    T, B = 4, 2
    model, latents, sigmas, cond, step_loss, cached = nonlinear_problem(T, B, seed=7)
    calls = []

    def hook(out, grad, last):
        calls.append((out.shape[0], last))
        out.backward(grad)

    _, with_hook = grad_after(model, knot_backward, model, plan, latents, sigmas, cond, step_loss,
                              cached_velocities=cached, rows_per_pass=rows_per_pass, backward=hook)
    _, plain = grad_after(model, knot_backward, model, plan, latents, sigmas, cond, step_loss,
                          cached_velocities=cached, rows_per_pass=rows_per_pass)
    assert calls == [(B * len(g), i == len(groups) - 1) for i, g in enumerate(groups)]
    assert torch.equal(with_hook, plain)


def test_jagg_and_exact_backward_are_plans_of_the_engine():
    T, B = 5, 2
    model, latents, sigmas, cond, step_loss, cached = nonlinear_problem(T, B, seed=9)
    for mode in MODES:
        _, a = grad_after(model, jagg_backward, model, latents, sigmas, cond, step_loss, cached_velocities=cached,
                          intermediate=mode)
        _, b = grad_after(model, knot_backward, model, [(0, T - 1)], latents, sigmas, cond, step_loss,
                          cached_velocities=cached, intermediate=mode)
        assert torch.equal(a, b)
    _, a = grad_after(model, exact_backward, model, latents, sigmas, cond, step_loss)
    _, b = grad_after(model, knot_backward, model, [(k, k) for k in range(T)], latents, sigmas, cond, step_loss)
    assert torch.equal(a, b)
