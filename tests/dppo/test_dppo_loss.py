"""Flow-DPPO's loss (dppo/loss.py) against the two peers' arithmetic, re-derived here from the cited lines, and
knot_backward on it (docs/algorithm.md, "Flow-DPPO").

UniRL: Tencent-Hunyuan/UniRL at 1a7b501, unirl/algorithms/flowdppo.py (`_gaussian_kl_div` :43-51,
`_flowdppo_kl_adv_loss` :54-138, `compute_loss_and_backward` :268-332, `_compute_sigma_t` :342-368) and its Flow-SDE
step unirl/sde/kernels.py (`FlowSDEStrategy.step` :207-235, `compute_log_prob` :193-205, the mean over dims :176).
verl-omni: verl-project/verl-omni at a1139ba, verl_omni/trainer/diffusion/diffusion_algos.py `FlowDPPOLoss` :361-443
and its CPU test tests/trainer/diffusion/test_diffusion_core_algos_on_cpu.py:161-272.
"""

from __future__ import annotations

import math

import pytest
import torch

from jagg_scale.dppo import DPPOStepLoss, dppo_terms
from jagg_scale.grpo import StepBatch, sde_step_with_logprob, sigma_schedule
from jagg_scale.jagg import exact_plan, knot_backward
from toy_velocity import LinearVelocity, MLPVelocity


def _verl_reference(old_log_prob, log_prob, old_mean, mean, advantages, sigma_t, threshold):
    """verl-omni's test reference, test_diffusion_core_algos_on_cpu.py:161-190 (= FlowDPPOLoss :396-424)."""
    ratio = torch.exp(log_prob - old_log_prob)
    kl = ((mean - old_mean).pow(2) / (2 * sigma_t.pow(2))).mean(dim=tuple(range(1, mean.ndim)))
    low = kl < threshold
    pos = (~low) & (ratio > 1.0) & (advantages > 0)
    neg = (~low) & (ratio < 1.0) & (advantages < 0)
    keep = ~(pos | neg)
    return torch.where(keep, -advantages * ratio, torch.zeros(())).mean(), pos, neg


@pytest.mark.parametrize("add_kl_coefficient", [True, False])
def test_verl_omnis_mask_test_gives_the_same_loss_and_masks_here(add_kl_coefficient):
    """verl-omni's test_compute_policy_loss_flow_dppo_applies_asymmetric_kl_mask (:193-272), its inputs and its
    expectations, on dppo_terms: row 0 (A > 0, ratio 1.2) and row 1 (A < 0, ratio 0.8) are dropped, rows 2 and 3
    (corrective: the ratio moved against the advantage) kept, though every row's KL is above the threshold."""
    old_log_prob = torch.zeros(4)
    log_prob = torch.log(torch.tensor([1.2, 0.8, 1.2, 0.8]))
    advantages = torch.tensor([10.0, -10.0, -8.0, 8.0])
    old_mean = torch.zeros(4, 2, 2, 2)
    mean = torch.full_like(old_mean, 0.2)
    std_dev_t, sqrt_dt = torch.full((4, 1, 1, 1), 0.5), torch.full((4,), 0.5)
    sigma_t = std_dev_t * sqrt_dt.reshape(4, 1, 1, 1)  # :237-240
    t = dppo_terms(log_prob, old_log_prob, mean, old_mean, sigma_t, advantages, 1e-5, add_kl_coefficient)
    ref, pos, neg = _verl_reference(old_log_prob, log_prob, old_mean, mean, advantages,
                                    sigma_t if add_kl_coefficient else torch.ones_like(std_dev_t), 1e-5)
    torch.testing.assert_close(t.per_row.mean(), ref)
    assert t.pos_removed.tolist() == pos.tolist() == [True, False, False, False]
    assert t.neg_removed.tolist() == neg.tolist() == [False, True, False, False]
    assert (~t.keep).float().mean() == pytest.approx(0.5)  # their masked_fraction, :270
    # the mean over all 4 rows of the kept rows' -A ratio: (8 x 1.2 - 8 x 0.8) / 4
    assert float(t.per_row.mean()) == pytest.approx((8 * 1.2 - 8 * 0.8) / 4)
    # their advantages are unclipped in the loss (:252-266); ours are clipped where they are made, not here
    clipped, _, _ = _verl_reference(old_log_prob, log_prob, old_mean, mean, advantages.clamp(-5, 5), sigma_t, 1e-5)
    assert not torch.isclose(t.per_row.mean(), clipped)


def _unirl_step(x, v, x_next, s, s_next, eta, sigma_max):
    """UniRL's FlowSDEStrategy.step (:218-235) and its per-sample log-prob (:193-205, :176): (mean, log_prob)."""
    dt = s_next - s
    std_dev_t = torch.sqrt(s / (1 - torch.where(s == 1, sigma_max, s))) * eta
    mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    std_var = std_dev_t * torch.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * std_var**2) - torch.log(std_var) - 0.5 * math.log(2 * math.pi)
    return mean, lp.mean(dim=tuple(range(1, lp.ndim)))


def _unirl_loss(latents, v_new, v_old, sigmas, adv, eta, threshold, steps, clamp_at_one=True, add_kl_coefficient=True):
    """UniRL's compute_loss_and_backward (:297-319) over `steps`: old log-probs from the rollout, old means replayed
    at the rollout's weights, sigma_t from _compute_sigma_t (:353-368: ones without add_kl_coefficient; clamp_at_one
    false: the transition's own std, verl-omni's std_dev_t * sqrt_dt), loss = mean over [B, S']. Returns
    (loss, kl [B, S'])."""
    sigma_max = sigmas[1]
    new_lp, old_lp, new_means, old_means, sig = [], [], [], [], []
    for k in steps:
        s, s_next = sigmas[k], sigmas[k + 1]
        m, lp = _unirl_step(latents[k], v_new[k], latents[k + 1], s, s_next, eta, sigma_max)
        m_old, lp_old = _unirl_step(latents[k], v_old[k], latents[k + 1], s, s_next, eta, sigma_max)
        new_lp.append(lp), old_lp.append(lp_old), new_means.append(m), old_means.append(m_old)
        denom = 1.0 - (torch.clamp(s, max=0.99) if clamp_at_one else torch.where(s == 1, sigma_max, s))
        sig.append(torch.sqrt(s / denom) * eta * torch.sqrt(s - s_next))
    new_logp, old_logp = torch.stack(new_lp, 1), torch.stack(old_lp, 1)  # [B, S']
    new_m, old_m = torch.stack(new_means, 1), torch.stack(old_means, 1)  # [B, S', C, H, W]
    sigma_t = torch.stack(sig).reshape(1, -1, 1, 1, 1) if add_kl_coefficient else torch.ones(1, len(steps), 1, 1, 1)
    ratio = torch.exp(new_logp - old_logp)
    a = adv.reshape(-1, 1).expand_as(new_logp)
    kl = ((new_m - old_m) ** 2 / (2 * sigma_t**2)).mean(dim=tuple(range(2, new_m.ndim)))  # :92-93
    high = ~(kl < threshold)
    rm = (high & (ratio > 1.0) & (a > 0)) | (high & (ratio < 1.0) & (a < 0))
    return torch.where(~rm, -a * ratio, torch.zeros(())).mean(), kl.detach()  # :107-111, :319


def _rollout(B=8, T=3, seed=0):
    """A 3-step SDE trajectory sampled with the rollout's velocities, and current velocities off them by row scales
    10^-4 .. 10^-0.5, so that the KL of some rows is below the threshold and of others above it."""
    g = torch.Generator().manual_seed(seed)
    sigmas = sigma_schedule(T, 3.0)
    x = [torch.randn(B, 2, 4, 4, generator=g)]
    v_old = torch.randn(T, B, 2, 4, 4, generator=g)
    log_probs = []
    for k in range(T):
        step = sde_step_with_logprob(x[k], v_old[k], sigmas[k], sigmas[k + 1], noise_level=0.7, sigma_max=sigmas[1],
                                     generator=g)
        x.append(step.prev_sample), log_probs.append(step.log_prob)
    scales = torch.logspace(-4, -0.5, B).reshape(1, B, 1, 1, 1)
    v_new = v_old + scales * torch.randn(T, B, 2, 4, 4, generator=g)
    adv = torch.tensor([1.0, -1.0] * (B // 2)) * torch.linspace(0.5, 2.0, B)
    batch = StepBatch(latents=torch.stack(x), velocities=v_old, log_probs=torch.stack(log_probs), sigmas=sigmas,
                      advantages=adv, mask=torch.ones(B, dtype=torch.bool))
    return batch, v_new


def _ours(batch, v_new, steps, threshold, add_kl_coefficient=True):
    """The loss and its gradient in v over `steps`, as the update sums it (scale 1 / K)."""
    loss = DPPOStepLoss(noise_level=0.7, kl_mask_threshold=threshold, scale=1 / len(steps),
                        add_kl_coefficient=add_kl_coefficient)
    v = v_new.clone().requires_grad_(True)
    total = sum(loss(batch, k, v[k]) for k in steps)
    (grad,) = torch.autograd.grad(total, v)
    return total.detach(), grad, loss


@pytest.mark.parametrize("threshold,add_kl_coefficient", [(1e-5, True), (1e-3, True), (1e-4, False)])
def test_the_loss_and_its_gradient_are_unirls_away_from_pure_noise(threshold, add_kl_coefficient):
    """Steps 1 and 2 (s < 0.99): UniRL's loss and its gradient in the current velocities, with rows dropped and
    kept among them, the KL divided by the transition's variance or (add_kl_coefficient false) by 1."""
    batch, v_new = _rollout()
    ours, grad, loss = _ours(batch, v_new, [1, 2], threshold, add_kl_coefficient)
    v = v_new.clone().requires_grad_(True)
    ref, kl = _unirl_loss(batch.latents, v, batch.velocities, batch.sigmas, batch.advantages, 0.7, threshold, [1, 2],
                          add_kl_coefficient=add_kl_coefficient)
    (ref_grad,) = torch.autograd.grad(ref, v)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-8)
    masked = torch.stack(loss.metrics["masked_fraction"])
    assert 0 < float(masked.mean()) < 1  # the mask acts on some rows, not all
    torch.testing.assert_close(torch.stack(loss.metrics["kl_new_old_mean"]), kl.mean(0))


def test_at_pure_noise_the_kl_is_the_transitions_own_where_unirl_clamps_sigma():
    """Step 0 (s = 1): our D_0 divides by the transition's variance (verl-omni's std_dev_t * sqrt_dt, Flow-GRPO's s_1
    in std_k's denominator); UniRL's _compute_sigma_t clamps s at 0.99 instead, so its KL there is ours times
    a^2 / (1 - s_1) / (a^2 / 0.01) = 0.01 / (1 - s_1). Elsewhere the two agree (the test above)."""
    batch, v_new = _rollout()
    _, _, loss = _ours(batch, v_new, [0], 1e-5)
    _, kl_exact = _unirl_loss(batch.latents, v_new, batch.velocities, batch.sigmas, batch.advantages, 0.7, 1e-5, [0],
                              clamp_at_one=False)
    _, kl_unirl = _unirl_loss(batch.latents, v_new, batch.velocities, batch.sigmas, batch.advantages, 0.7, 1e-5, [0])
    ours = loss.metrics["kl_new_old_mean"][0]
    torch.testing.assert_close(ours, kl_exact.mean(), rtol=1e-5, atol=0)
    s1 = float(batch.sigmas[1])
    torch.testing.assert_close(kl_unirl.mean(), ours * 0.01 / (1 - s1), rtol=1e-4, atol=0)


def test_on_policy_nothing_is_dropped_and_the_gradient_is_the_unclipped_ratios():
    """At the rollout's own velocities the KL is 0 and the ratio 1: no row is dropped, and dL/dv is Flow-GRPO's
    unclipped surrogate's (its clip is inactive at ratio 1 too)."""
    from jagg_scale.grpo import GRPOStepLoss

    batch, _ = _rollout()
    ours, grad, loss = _ours(batch, batch.velocities, [0, 1, 2], 1e-5)
    assert float(torch.stack(loss.metrics["kl_new_old_max"]).max()) == 0.0
    assert float(torch.stack(loss.metrics["masked_fraction"]).max()) == 0.0
    assert float(torch.stack(loss.log_ratios).max()) < 1e-6
    grpo = GRPOStepLoss(noise_level=0.7, clip_range=1e-4, scale=1 / 3)
    v = batch.velocities.clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(sum(grpo(batch, k, v[k]) for k in range(3)), v)
    torch.testing.assert_close(grad, ref_grad)


def test_cfg_guides_the_old_policy_with_the_rollouts_unconditional_predictions():
    """With CFG the old mean is the rollout's guided velocity's, u_k the rollout's even after the batch's u_k were
    recomputed at moved weights (StepBatch.rollout_uncond): at the rollout's conditional predictions and refreshed
    u_k the KL is that of the u_k shift alone, (1 - g)^2 times the shift of u."""
    batch, _ = _rollout(B=4)
    g = torch.Generator().manual_seed(3)
    batch.uncond_velocities = torch.randn(batch.velocities.shape, generator=g)
    fresh = batch.uncond_velocities + 0.01 * torch.randn(batch.velocities.shape, generator=g)
    refreshed = StepBatch(**{**vars(batch), "uncond_velocities": fresh, "rollout_uncond": batch.uncond_velocities})
    loss = DPPOStepLoss(noise_level=0.7, guidance=4.5)
    loss(batch, 1, batch.velocities[1])
    loss(refreshed, 1, batch.velocities[1])
    same, moved = (float(v) for v in loss.metrics["kl_new_old_mean"])
    assert same == 0.0 and moved > 0
    plain = DPPOStepLoss(noise_level=0.7)  # the same shift of the velocity itself, (1 - g) (fresh - u), unguided
    plain(batch, 1, batch.velocities[1] + (1 - 4.5) * (fresh[1] - batch.uncond_velocities[1]))
    assert moved == pytest.approx(float(plain.metrics["kl_new_old_mean"][0]), rel=1e-4)


@pytest.mark.parametrize("intermediate", ["forward", "cached"])
def test_knot_backward_is_exact_on_an_affine_velocity_with_collinear_inputs(intermediate):
    """The loss depends on theta only through v_k: for a velocity affine in (x, s) and a window's inputs on the line
    between its ends (weights in sigma), one joint pass gives the per-step gradient, with the mask dropping rows
    (cached: the window's interior at the rollout's velocities, which are the model's own here)."""
    torch.manual_seed(0)
    model = LinearVelocity()
    B, K = 6, 3
    sigmas = torch.tensor([0.9, 0.7, 0.4, 0.2])
    a = ((sigmas[:K] - sigmas[0]) / (sigmas[K - 1] - sigmas[0])).reshape(K, 1, 1, 1, 1)
    ends = torch.randn(2, B, 3, 2, 2)
    line = (1 - a) * ends[0] + a * ends[1]
    cond = torch.randn(B, 4)
    with torch.no_grad():
        v_roll = torch.stack([model(line[k], sigmas[k].expand(B), cond) for k in range(K)])
        if intermediate == "forward":  # the rollout's policy is another one: the KL and the ratio move
            v_roll = v_roll + 0.3 * torch.randn_like(v_roll)
    latents = torch.cat([line, torch.randn(1, B, 3, 2, 2)])
    log_probs = torch.stack([sde_step_with_logprob(latents[k], v_roll[k], sigmas[k], sigmas[k + 1], noise_level=0.7,
                                                   sigma_max=0.9, prev_sample=latents[k + 1]).log_prob
                             for k in range(K)])
    batch = StepBatch(latents=latents, velocities=v_roll, log_probs=log_probs, sigmas=sigmas,
                      advantages=torch.linspace(-1, 1, B), mask=torch.ones(B, dtype=torch.bool))
    loss = DPPOStepLoss(noise_level=0.7, kl_mask_threshold=1e-3, scale=1 / K)
    grads = []
    for plan in (exact_plan(K), [(0, K - 1)]):
        model.zero_grad(set_to_none=True)
        knot_backward(model, plan, latents[:K], sigmas[:K], cond, loss.on(batch), cached_velocities=v_roll,
                      intermediate=intermediate)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-5
    if intermediate == "forward":
        assert float(torch.stack(loss.metrics["masked_fraction"]).max()) > 0


def test_micro_batches_give_the_whole_minibatchs_gradient_with_the_mask_acting():
    """Each row is dropped by its own KL and ratio, and the mean divides by the minibatch's rows: the runner's
    micro-batches of 2 accumulate the gradient of the whole minibatch, off-policy (jagg.intermediate forward) with
    the mask acting, through a JAGG window of 3."""
    from jagg_scale.jagg.planners import WindowPlanner
    from jagg_scale.train.runner import backward_minibatch
    from jagg_scale.train.update import step_minibatch

    torch.manual_seed(0)
    model = MLPVelocity()
    B, K = 6, 3
    sigmas = torch.tensor([0.9, 0.7, 0.4, 0.2])
    latents = torch.randn(K + 1, B, 3, 2, 2)
    cond = torch.randn(B, 4)
    with torch.no_grad():  # the rollout's policy is another one than the trained weights
        v_roll = torch.stack([model(latents[k], sigmas[k].expand(B), cond) for k in range(K)])
        v_roll += 0.2 * torch.randn_like(v_roll)
    log_probs = torch.stack([sde_step_with_logprob(latents[k], v_roll[k], sigmas[k], sigmas[k + 1], noise_level=0.7,
                                                   sigma_max=0.9, prev_sample=latents[k + 1]).log_prob
                             for k in range(K)])
    batch = StepBatch(latents=latents, velocities=v_roll, log_probs=log_probs, sigmas=sigmas,
                      advantages=torch.linspace(-1, 1, B), mask=torch.ones(B, dtype=torch.bool))
    loss = DPPOStepLoss(noise_level=0.7, kl_mask_threshold=1e-3, scale=1 / K, denominator=float(B))
    grads = []
    for size in (0, 2):
        model.zero_grad(set_to_none=True)
        mb = step_minibatch(batch, cond, loss, list(range(K)), intermediate="forward", on_policy=False)
        backward_minibatch(model, mb, WindowPlanner(window=3), micro_batch_size=size)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    masked = torch.stack(loss.metrics["masked_fraction"])
    assert 0 < float(masked.mean()) < 1
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) <= 1e-6
