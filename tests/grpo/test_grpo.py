"""Flow-GRPO math against independent computations."""

import math

import pytest
import torch

from jagg_scale.train.runner import reduce_metrics
from torch.distributions import Normal

from jagg_scale.grpo import (GRPOStepLoss, StepBatch, compute_advantages, kl_to_reference, ode_step, sample_sde,
                             sde_std, sde_step_with_logprob, shift_sigmas, sigma_schedule)


def test_sigma_schedule_is_shifted_and_ends_at_zero():
    s = sigma_schedule(10, shift=3.0)
    assert s.shape == (11,) and s.dtype == torch.float32
    assert s[0] == 1.0 and s[-1] == 0.0
    assert torch.all(s[1:] < s[:-1])
    u = 0.5
    assert math.isclose(float(shift_sigmas(torch.tensor(u), 3.0)), 3 * u / (1 + 2 * u), rel_tol=1e-6)
    assert torch.equal(sigma_schedule(4, 1.0), torch.linspace(1, 0, 5))


def _reference_step(x, v, s, s_next, a, sigma_max):
    """docs/algorithm.md's formulas (section 1) written out independently, in float64."""
    x, v = x.double(), v.double()
    dt = s_next - s
    std = a * math.sqrt(s / (1 - (sigma_max if s == 1.0 else s)))
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    return mean, std, std * math.sqrt(-dt)


@pytest.mark.parametrize("s,s_next", [(1.0, 0.9), (0.7, 0.55), (0.2, 0.0)])
def test_sde_mean_and_logprob_match_torch_normal(s, s_next):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    a, sigma_max = 0.7, 0.9
    step = sde_step_with_logprob(x, v, s, s_next, noise_level=a, sigma_max=sigma_max, generator=g)
    mean, std, step_std = _reference_step(x, v, s, s_next, a, sigma_max)
    assert torch.allclose(step.mean.double(), mean, atol=1e-5)
    assert math.isclose(float(step.std.flatten()[0]), std, rel_tol=1e-5)
    expected = Normal(mean, step_std).log_prob(step.prev_sample.double()).mean(dim=(1, 2, 3))
    assert torch.allclose(step.log_prob.double(), expected, atol=1e-4)
    assert step.log_prob.dtype == torch.float32 and step.log_prob.shape == (2,)
    # scoring a given sample gives the same log-prob as sampling it
    again = sde_step_with_logprob(x, v, s, s_next, noise_level=a, sigma_max=sigma_max, prev_sample=step.prev_sample)
    assert torch.equal(again.log_prob, step.log_prob)


def test_sde_std_uses_sigma_max_at_one():
    s = torch.tensor([1.0, 0.5])
    std = sde_std(s, 0.7, sigma_max=0.9)
    assert math.isclose(float(std[0]), 0.7 * math.sqrt(1.0 / 0.1), rel_tol=1e-6)
    assert math.isclose(float(std[1]), 0.7, rel_tol=1e-6)


def test_sde_math_is_float32_under_bf16_inputs():
    x = torch.randn(2, 3, 4, 4).bfloat16()
    v = torch.randn(2, 3, 4, 4).bfloat16()
    step = sde_step_with_logprob(x, v, 0.5, 0.4, noise_level=0.7, sigma_max=0.9, generator=torch.Generator())
    assert step.mean.dtype == torch.float32 and step.log_prob.dtype == torch.float32


def test_sde_noise_is_seeded():
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    a = sde_step_with_logprob(x, v, 0.5, 0.4, noise_level=0.7, sigma_max=0.9,
                              generator=torch.Generator().manual_seed(5))
    b = sde_step_with_logprob(x, v, 0.5, 0.4, noise_level=0.7, sigma_max=0.9,
                              generator=torch.Generator().manual_seed(5))
    c = sde_step_with_logprob(x, v, 0.5, 0.4, noise_level=0.7, sigma_max=0.9,
                              generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.prev_sample, b.prev_sample) and not torch.equal(a.prev_sample, c.prev_sample)


def test_kl_formula():
    m1, m2 = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    std = torch.full((3, 1, 1, 1), 0.4)
    expected = ((m1 - m2) ** 2 / (2 * 0.16)).mean(dim=(1, 2, 3))
    assert torch.allclose(kl_to_reference(m1, m2, std), expected, rtol=1e-6)
    assert torch.all(kl_to_reference(m1, m1, std) == 0)


def test_ode_step_is_euler():
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    assert torch.allclose(ode_step(x, v, 0.6, 0.5), x - 0.1 * v, atol=1e-6)


def test_sample_sde_recomputed_logprobs_match():
    """The trajectory's stored log-probs are what the training pass recomputes from its velocities."""
    def vfn(x, s, c):
        return -x * s[:, None, None, None] + c[:, :, None, None]

    sigmas = sigma_schedule(6, 3.0)
    cond = torch.randn(4, 3)
    traj = sample_sde(vfn, cond, torch.randn(4, 3, 4, 4), sigmas, noise_level=0.7,
                      generator=torch.Generator().manual_seed(0))
    assert traj.latents.shape == (7, 4, 3, 4, 4) and traj.velocities.shape == (6, 4, 3, 4, 4)
    assert traj.log_probs.shape == (6, 4)
    for k in range(6):
        step = sde_step_with_logprob(traj.latents[k], traj.velocities[k], sigmas[k], sigmas[k + 1],
                                     noise_level=0.7, sigma_max=float(sigmas[1]), prev_sample=traj.latents[k + 1])
        assert torch.allclose(step.log_prob, traj.log_probs[k], atol=1e-6)


def test_advantages_per_prompt_clip_and_zero_std_masking():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 0.0, 10.0])
    groups = [0, 0, 0, 1, 1, 1, 2, 2]
    adv = compute_advantages(rewards, groups, adv_clip_max=0.9)
    r = torch.tensor([1.0, 2.0, 3.0])
    expected0 = ((r - 2.0) / (r.std(unbiased=False) + 1e-4)).clamp(-0.9, 0.9)
    assert torch.allclose(adv.values[:3], expected0)
    assert adv.zero_std_groups == 1 and adv.num_groups == 3
    assert adv.mask.tolist() == [True, True, True, False, False, False, True, True]
    assert torch.all(adv.values[3:6] == 0)
    assert torch.allclose(adv.values[6:], torch.tensor([-0.9, 0.9]))


@pytest.mark.parametrize("value", [0.826, 5.04, 0.1, 1 / 3])
@pytest.mark.parametrize("G", [8, 16, 24])
def test_a_group_of_equal_non_dyadic_rewards_is_masked(value, G):
    """Equal rewards that are not exact in binary: a float32 std of their group is ~1e-7, not 0, and used to leave
    the group in with advantages of up to ~1e-2; equality is tested exactly now."""
    rewards = torch.cat([torch.full((G,), value), torch.linspace(0.0, 1.0, G)])
    groups = [0] * G + [1] * G
    adv = compute_advantages(rewards, groups)
    assert adv.zero_std_groups == 1
    assert not adv.mask[:G].any() and torch.all(adv.values[:G] == 0)
    assert adv.mask[G:].all()


def test_advantages_are_float64_statistics_as_flow_grpo():
    rewards = torch.tensor([0.1, 0.2, 0.7, 0.30000001], dtype=torch.float64)
    r = rewards.numpy()
    expected = (r - r.mean()) / (r.std() + 1e-4)  # numpy float64, Flow-GRPO's PerPromptStatTracker
    assert torch.allclose(compute_advantages(rewards, [0] * 4).values.double(), torch.from_numpy(expected),
                          rtol=1e-6, atol=1e-7)


def test_advantages_global_std_and_failed_samples():
    rewards = torch.tensor([1.0, 3.0, 10.0, 14.0, 99.0])
    valid = torch.tensor([True, True, True, True, False])
    adv = compute_advantages(rewards, [0, 0, 1, 1, 1], global_std=True, adv_clip_max=100.0, valid=valid)
    gsd = rewards[:4].std(unbiased=False)
    assert torch.allclose(adv.values[:4], torch.tensor([-1.0, 1.0, -2.0, 2.0]) / (gsd + 1e-4))
    assert adv.values[4] == 0 and not adv.mask[4]


def _step_batch(B=4, T=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigmas = sigma_schedule(T, 3.0)
    velocities = torch.randn(T, B, 3, 4, 4, generator=g)
    latents = [torch.randn(B, 3, 4, 4, generator=g)]
    log_probs = []
    for k in range(T):
        st = sde_step_with_logprob(latents[-1], velocities[k], sigmas[k], sigmas[k + 1], noise_level=0.7,
                                   sigma_max=float(sigmas[1]), generator=g)
        latents.append(st.prev_sample)
        log_probs.append(st.log_prob)
    return StepBatch(latents=torch.stack(latents), velocities=velocities, log_probs=torch.stack(log_probs),
                     sigmas=sigmas, advantages=torch.tensor([1.0, -1.0, 2.0, -2.0]),
                     mask=torch.ones(B, dtype=torch.bool), ref_velocities=velocities + 0.1)


def summary(loss: GRPOStepLoss) -> dict:
    """The loss's recorded statistics reduced as the runner reduces them (train/runner.py), then cleared."""
    out = reduce_metrics(loss.metrics)
    loss.metrics.clear()
    return out


def test_grpo_loss_on_policy_ratio_one_and_clipping():
    batch = _step_batch()
    loss = GRPOStepLoss(noise_level=0.7, clip_range=1e-4, beta=0.0)
    val = loss(batch, 1, batch.velocities[1])
    # on-policy: ratio 1, loss = mean(-A) = 0 for these advantages
    assert abs(float(val)) < 1e-6
    m = summary(loss)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clipfrac"] == 0.0
    # off-policy by a lot: every ratio leaves the clip range
    loss(batch, 1, batch.velocities[1] + 0.5)
    assert summary(loss)["clipfrac"] == 1.0


def test_grpo_loss_matches_hand_computation_with_kl():
    batch = _step_batch()
    beta, eps = 0.05, 0.2
    loss = GRPOStepLoss(noise_level=0.7, clip_range=eps, beta=beta, scale=0.5)
    v = batch.velocities[2] + 0.01 * torch.randn_like(batch.velocities[2])
    got = loss(batch, 2, v)
    s, sn, smax = batch.sigmas[2], batch.sigmas[3], float(batch.sigmas[1])
    st = sde_step_with_logprob(batch.latents[2], v, s, sn, noise_level=0.7, sigma_max=smax,
                               prev_sample=batch.latents[3])
    ref = sde_step_with_logprob(batch.latents[2], batch.ref_velocities[2], s, sn, noise_level=0.7, sigma_max=smax,
                                prev_sample=batch.latents[3])
    ratio = torch.exp(st.log_prob - batch.log_probs[2])
    A = batch.advantages
    policy = torch.maximum(-A * ratio, -A * ratio.clamp(1 - eps, 1 + eps)).mean()
    kl = (((st.mean - ref.mean) ** 2) / (2 * st.std**2)).mean(dim=(1, 2, 3)).mean()
    assert torch.allclose(got, 0.5 * (policy + beta * kl), rtol=1e-5)
    assert summary(loss)["kl"] == pytest.approx(float(kl), rel=1e-5)


def test_grpo_loss_masks_samples():
    batch = _step_batch()
    batch.mask = torch.tensor([True, False, False, False])
    loss = GRPOStepLoss(noise_level=0.7, clip_range=1e-4)
    v = batch.velocities[0] + 0.3
    assert torch.allclose(loss(batch, 0, v), loss(_sub(batch, [0]), 0, v[:1]))


def _sub(batch, rows):
    idx = torch.tensor(rows)
    return StepBatch(latents=batch.latents[:, idx], velocities=batch.velocities[:, idx],
                     log_probs=batch.log_probs[:, idx], sigmas=batch.sigmas, advantages=batch.advantages[idx],
                     mask=torch.ones(len(rows), dtype=torch.bool))
