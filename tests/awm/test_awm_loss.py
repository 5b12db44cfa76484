"""AWM's loss (jagg_scale/awm/loss.py) against the reference's arithmetic on fixed tensors (X-GenGroup/Flow-Factory
trainers/awm.py, commit a0b2bc5): value and gradient for every weighting, on- and off-policy, with both KL terms; and
JAGG-AWM's gradient equal to the per-timestep one where its exactness condition holds."""

import pytest
import torch

from jagg_scale.awm import AWMBatch, AWMStepLoss
from jagg_scale.jagg import exact_plan, knot_backward
from toy_velocity import LinearVelocity


def _reference(noise_pred, old_noise_pred, clean, noise, timestep, adv, weighting, ghuber_power, clip, adv_clip,
               ref_pred, kl_beta, ema_pred, ema_kl_beta):
    """One timestep's loss of trainers/awm.py, its arithmetic transcribed: compute_weighted_log_prob (:304-330) of
    the trained and the sampling policy's predictions against target = noise - clean (:373), the advantage clip
    (:467-469), the clipped ratio loss (:497-502), the velocity KL to the reference (:517-519) and to the EMA
    (:533-535); `timestep` in the scheduler's [0, 1000] scale, sigma = timestep / 1000 (noise_schedule.py:46-48)."""

    def log_prob(model_output):
        model_output, target = model_output.double(), (noise - clean).double()
        lp = -(model_output - target) ** 2
        lp = lp.mean(dim=tuple(range(1, lp.ndim)))
        t = (timestep.view(-1) / 1000.0).clamp(0.0, 1.0)
        if weighting == "Uniform":
            pass
        elif weighting == "t":
            lp = lp * t
        elif weighting == "t**2":
            lp = lp * t**2
        elif weighting == "huber":
            lp = -(torch.sqrt(-lp + 1e-10) - 1e-5) * t
        elif weighting == "ghuber":
            eps = torch.tensor(1e-10, dtype=lp.dtype)
            lp = -(torch.pow(-lp + eps, ghuber_power) - torch.pow(eps, ghuber_power)) * t / ghuber_power
        return lp.float()

    with torch.no_grad():
        old_log_prob = log_prob(old_noise_pred)
    log_prob_now = log_prob(noise_pred)
    adv = torch.clamp(adv, -adv_clip, adv_clip)
    ratio = torch.exp(log_prob_now - old_log_prob)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    if kl_beta > 0:
        kl_div = ((noise_pred - ref_pred) ** 2).mean(dim=tuple(range(1, noise_pred.ndim)))
        loss = loss + kl_beta * kl_div.mean()
    if ema_kl_beta > 0:
        ema_kl = ((noise_pred - ema_pred) ** 2).mean(dim=tuple(range(1, noise_pred.ndim)))
        loss = loss + ema_kl_beta * ema_kl.mean()
    return loss


@pytest.mark.parametrize("weighting,off_policy,clip,kl_beta,ema_kl_beta", [
    ("Uniform", False, 1e-4, 0.0, 0.0), ("t", False, 1e-4, 1e-4, 0.0), ("t**2", True, 0.2, 0.0, 0.5),
    ("huber", True, 1e-4, 0.0, 0.0), ("ghuber", False, 1.0, 1e-4, 1.0),  # the SD3.5 recipe's loss
    ("ghuber", True, 0.05, 1e-4, 1.0)])
def test_the_loss_and_its_gradient_are_the_references(weighting, off_policy, clip, kl_beta, ema_kl_beta):
    g = torch.Generator().manual_seed(0)
    B, shape = 6, (6, 4, 8, 8)
    clean, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.tensor([0.95, 0.8, 0.6, 0.45, 0.3, 0.12])
    ema = (noise - clean) + 0.3 * torch.randn(shape, generator=g)
    ref = (noise - clean) + 0.3 * torch.randn(shape, generator=g)
    adv = torch.tensor([-3.0, -0.7, -0.2, 0.0, 0.6, 2.5])  # beyond the recipe's clip of 1 on both sides
    v_ref_code = (ema + 0.2 * torch.randn(shape, generator=g)).requires_grad_(True)
    # on-policy the reference's old prediction is its own weights' forward at the same input: the same value
    old = ema if off_policy else v_ref_code.detach()
    want = _reference(v_ref_code, old, clean, noise, t * 1000.0, adv, weighting, 0.25, clip, 1.0, ref, kl_beta, ema,
                      ema_kl_beta)
    (want_grad,) = torch.autograd.grad(want, v_ref_code)

    tb = t.view(-1, 1, 1, 1)
    batch = AWMBatch(clean=clean, t=t[None], noised=((1 - tb) * clean + tb * noise)[None], noise=noise[None],
                     advantages=adv.clamp(-1.0, 1.0), mask=torch.ones(B, dtype=torch.bool), ema=ema[None],
                     ref=ref[None])
    v = v_ref_code.detach().clone().requires_grad_(True)
    loss = AWMStepLoss(weighting=weighting, ghuber_power=0.25, clip_range=clip, off_policy=off_policy,
                       kl_beta=kl_beta, ema_kl_beta=ema_kl_beta)
    got = loss(batch, 0, v)
    (got_grad,) = torch.autograd.grad(got, v)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-10)
    assert got_grad.abs().max() > 0
    if off_policy:  # the EMA's log-prob differs from the trained one's: the ratio moves off 1, and the clip may act
        assert float(loss.metrics["ratio_max"][0]) != 1.0
    else:
        assert float(loss.metrics["ratio_max"][0]) == float(loss.metrics["ratio_min"][0]) == 1.0


def test_masked_rows_carry_no_gradient_and_the_denominator_is_the_minibatchs():
    g = torch.Generator().manual_seed(1)
    shape = (4, 3, 2, 2)
    clean, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.tensor([0.9, 0.7, 0.5, 0.2])
    batch = AWMBatch(clean=clean, t=t[None], noised=noise[None], noise=noise[None],
                     advantages=torch.tensor([1.0, -1.0, 0.5, 0.3]), mask=torch.tensor([True, True, False, True]))
    v = torch.randn(shape, generator=g).requires_grad_(True)
    (grad,) = torch.autograd.grad(AWMStepLoss(weighting="ghuber", denominator=6.0)(batch, 0, v), v)
    assert grad[2].abs().max() == 0 and grad[0].abs().max() > 0
    (half,) = torch.autograd.grad(AWMStepLoss(weighting="ghuber", denominator=3.0)(batch, 0, v), v)
    torch.testing.assert_close(half, 2 * grad)


def _awm_batch(K, B, shared_noise, g):
    d = torch.randn(B, 3, 2, 2, generator=g, dtype=torch.float64)
    t = torch.sort(torch.rand(K, B, generator=g, dtype=torch.float64), dim=0, descending=True).values * 0.9 + 0.05
    e = torch.randn(1 if shared_noise else K, B, 3, 2, 2, generator=g, dtype=torch.float64).expand(K, B, 3, 2, 2)
    tb = t.reshape(K, B, 1, 1, 1)
    ema = torch.randn(K, B, 3, 2, 2, generator=g, dtype=torch.float64)
    return AWMBatch(clean=d, t=t, noised=(1 - tb) * d + tb * e, noise=e, advantages=torch.randn(B, generator=g),
                    mask=torch.ones(B, dtype=torch.bool), ema=ema, ref=ema + 0.1)


@pytest.mark.parametrize("intermediate", ["forward", "interpolate"])
def test_jagg_awm_is_exact_with_shared_noise_on_an_affine_velocity(intermediate):
    """JAGG-AWM's exactness condition (docs/algorithm.md, "AWM"): a sample's inputs x_t = (1 - t) d + t e with one
    e lie on a line in (x, t), and L_k depends on theta only through v(x_t, t); for a velocity affine along the line
    one joint pass over the two end timesteps gives the per-timestep gradient exactly (interpolate: when v - v_ema
    is affine too), with each row's own timesteps. With fresh noise per timestep the inputs leave the line: not
    exact."""
    K, B = 5, 3
    torch.manual_seed(0)
    model = LinearVelocity().double()
    cond = torch.randn(B, 4, dtype=torch.float64)
    loss = AWMStepLoss(weighting="ghuber", off_policy=True, clip_range=0.5, kl_beta=0.1, ema_kl_beta=1.0,
                       scale=1 / K)
    for shared, exact in ((True, True), (False, False)):
        batch = _awm_batch(K, B, shared, torch.Generator().manual_seed(1))
        with torch.no_grad():  # the EMA policy: the trained one moved by a constant (v - v_ema affine)
            batch.ema = torch.stack([model(batch.noised[k], batch.t[k], cond) for k in range(K)]) + 0.01
        grads = []
        for plan in (exact_plan(K), [(0, K - 1)]):
            model.zero_grad(set_to_none=True)
            knot_backward(model, plan, batch.noised, batch.t, cond, loss.fresh().on(batch), cached_velocities=batch.ema,
                          intermediate=intermediate)
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        err = float((grads[1] - grads[0]).norm() / grads[0].norm())
        assert (err < 1e-9) if exact else (err > 1e-4), (shared, intermediate, err)
