"""GCPO's chunk loss (gcpo/loss.py) against GCPO's own arithmetic, and its gradient through knot_backward: the
per-step plan is exactly autograd through the chunk loss, one JAGG window per chunk equals it where the window's
Jacobians are affine in sigma (chunks of <= 2 steps; an affine velocity along collinear inputs) and not elsewhere."""

import dataclasses
import math

import pytest
import torch

from jagg_scale.gcpo.chunks import draw_chunks, slot_layout
from jagg_scale.gcpo.config import GCPOConfig, chunk_sizes, trained_chunks
from jagg_scale.gcpo.loss import ChunkBatch, GCPOStepLoss
from jagg_scale.grpo.loss import StepBatch
from jagg_scale.grpo.sde import sde_step_with_logprob
from jagg_scale.grpo.steps import positioned
from jagg_scale.jagg import exact_plan, knot_backward
from jagg_scale.sections import ConfigError

ETA, CLIP = 0.7, 0.02


def _shifted(T, shift=3.0):  # GCPO's sd3_time_shift of linspace(1, 0, T + 1)
    t = torch.linspace(1, 0, T + 1)
    return shift * t / (1 + (shift - 1) * t)


def _trajectory(sizes, B=4, D=6, seed=0, line=False, model=None):
    T = sum(sizes) + 1
    g = torch.Generator().manual_seed(seed)
    sig = _shifted(T)
    if line:  # every x_k on one line in sigma per row: a window's inputs collinear with its sigma weights
        lat = torch.randn(B, D, generator=g) + sig[:, None, None] * torch.randn(B, D, generator=g)
    else:
        lat = torch.randn(T + 1, B, D, generator=g)
    vel = torch.randn(T, B, D, generator=g)
    if model is not None:  # the rollout sampled with the model's weights
        with torch.no_grad():
            vel = torch.stack([model(lat[k], sig[k].expand(B), torch.zeros(B, 1)) for k in range(T)])
    # the rollout's log-probabilities: of its own x_{k+1} at its velocities, moved by a little per step (the weights
    # moved since), so that some chunk ratios leave the clip range and some do not
    lp = torch.stack([sde_step_with_logprob(lat[k], vel[k], sig[k], sig[k + 1], noise_level=ETA, sigma_max=sig[1],
                                            prev_sample=lat[k + 1]).log_prob for k in range(T)])
    return StepBatch(latents=lat, velocities=vel, log_probs=lp + 0.01 * torch.randn(T, B, generator=g), sigmas=sig,
                     advantages=torch.tensor([1.5, -0.7, 0.3, -2.0])[:B], mask=torch.ones(B, dtype=torch.bool))


def _chunked(batch, sizes, drawn):
    steps, real = slot_layout(sizes, drawn)
    pb, positions = positioned(batch, steps)
    fields = {f: getattr(pb, f) for f in StepBatch.__dataclass_fields__}
    return ChunkBatch(**fields, real=real.repeat_interleave(2, 0), slots=drawn.shape[0]), positions, steps, real


def _reference_loss(batch, sizes, drawn, v, clip=CLIP):
    """GCPO's arithmetic re-derived from xingzhejun/GCPO ea6cc4d fastvideo/train_grpo_flux_pickscore.py: the
    flow_grpo_step log-prob (:64-103), a chunk's new log-prob the mean of its steps' (:453), its old one the mean of
    the rollout's (:618), the advantage clamped (:738), ratio and clipped surrogate (:739-745), / train_chunks (:757);
    one sample per accumulation step, so the update is the mean over samples."""
    sig, total = batch.sigmas, 0.0
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    n_train, B = drawn.shape
    for b in range(B):
        for j in range(n_train):
            c = int(drawn[j, b])
            new = []
            for i in range(starts[c], starts[c] + sizes[c]):
                sigma, sigma_prev, sigma_max = sig[i], sig[i + 1], sig[1]
                dt = sigma_prev - sigma
                std = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * ETA
                x, out = batch.latents[i, b], v[i, b]
                mean = x * (1 + std**2 / (2 * sigma) * dt) + out * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
                lp = (-((batch.latents[i + 1, b] - mean) ** 2) / (2 * ((std * torch.sqrt(-1 * dt)) ** 2))
                      - torch.log(std * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
                new.append(lp.mean())
            new_lp = torch.stack(new).mean()
            old_lp = batch.log_probs[starts[c]: starts[c] + sizes[c], b].mean()
            adv = torch.clamp(batch.advantages[b], -5.0, 5.0)
            ratio = torch.exp(new_lp - old_lp)
            policy = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)))
            total = total + policy / n_train
    return total / B


def _ours(batch, sizes, drawn, clip=CLIP):
    cb, positions, steps, real = _chunked(batch, sizes, drawn)
    loss = GCPOStepLoss(noise_level=ETA, clip_range=clip, scale=1.0 / drawn.shape[0])
    cb = loss.prepared(cb)
    return cb, positions, steps, real, loss


def test_chunk_layout_is_gcpo_s():
    assert chunk_sizes((2, 3, 4, 7), 4, 16) == [2, 3, 4, 7]  # the published recipe: 16 candidates of 17 steps
    assert chunk_sizes((), 4, 16) == [4, 4, 4, 4] and chunk_sizes((), 5, 16) == [5, 5, 5, 1]  # set_chunk's remainder
    assert trained_chunks(4, 0.5) == 2 and trained_chunks(4, 0.3) == 1
    drawn = draw_chunks(4, 2, seed=3, step=5, rows=torch.arange(400))
    assert drawn.shape == (2, 400) and (drawn[1] > drawn[0]).all()
    assert len({tuple(c) for c in drawn.T.tolist()}) == 6  # every pair of 4 chunks drawn
    assert torch.equal(draw_chunks(4, 2, 3, 5, torch.arange(100, 200)), drawn[:, 100:200])  # rank-split invariant
    steps, real = slot_layout([2, 3, 1], torch.tensor([[0, 2], [1, 1]]))
    assert steps[:, 0].tolist() == [0, 0, 1, 2, 3, 4] and real[:, 0].tolist() == [True, False, True] * 1 + [True] * 3
    assert steps[:3, 1].tolist() == [5, 5, 4] and real[:3, 1].tolist() == [True, False, False]  # lone step: phantom end
    with pytest.raises(ConfigError, match="gcpo.chunks"):
        GCPOConfig(chunks=(2, 3)).check_schedule("gcpo", 17)
    with pytest.raises(ConfigError, match="gcpo.chunk_size"):
        GCPOConfig(chunk_size=3).check("gcpo")


def test_value_and_gradient_are_gcpo_s_arithmetic():
    sizes = [2, 3, 1, 3]
    batch = _trajectory(sizes)
    drawn = torch.tensor([[0, 1, 0, 2], [3, 2, 1, 3]])
    # old log-probs moved so that some chunks are clipped (both signs of A) and some are not
    batch.log_probs[:, 0] -= 0.05
    batch.log_probs[:, 3] += 0.01
    v_ref = batch.velocities.clone().requires_grad_(True)
    ref = _reference_loss(batch, sizes, drawn, v_ref)
    ref.backward()
    cb, positions, steps, real, loss = _ours(batch, sizes, drawn)
    T, B = batch.velocities.shape[:2]
    grad, value = torch.zeros_like(batch.velocities), 0.0
    for q, k in enumerate(positions):
        v = cb.velocities[k].clone().requires_grad_(True)
        term = loss(cb, k, v)
        (g,) = torch.autograd.grad(term, v)
        value += float(term.detach())
        for b in range(B):
            if real[q, b]:
                grad[steps[q, b], b] += g[b]
            else:
                assert g[b].abs().max() == 0  # a pad weighs nothing
    clipfrac = float(loss.metrics["chunk_clipfrac"][0])
    assert 0 < clipfrac < 1  # the case holds clipped and unclipped chunks
    assert value == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, v_ref.grad, rtol=1e-4, atol=1e-8)
    assert float(loss.log_ratio_max()) > 0.04  # the off-policy gap is what the invariant reads


class _Affine(torch.nn.Module):  # v = x W + s u + b: affine in (x, s)
    def __init__(self, D, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W = torch.nn.Parameter(0.3 * torch.randn(D, D, generator=g))
        self.u = torch.nn.Parameter(torch.randn(D, generator=g))
        self.b = torch.nn.Parameter(torch.randn(D, generator=g))

    def forward(self, x, s, cond):
        return x @ self.W + s[:, None] * self.u + self.b + 0 * cond


class _MLP(_Affine):
    def forward(self, x, s, cond):
        return torch.tanh(x @ self.W + s[:, None] * self.u) * 2 + self.b + 0 * cond


def _grads(model, fn):
    for p in model.parameters():
        p.grad = None
    fn()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _plan_grad(model, loss, cb, positions, plan):
    idx = torch.tensor(positions)
    lat, sig, vel = cb.latents[idx], cb.sigmas[idx], cb.velocities[idx]
    cond = torch.zeros(lat.shape[1], 1)
    return _grads(model, lambda: knot_backward(model, plan, lat, sig, cond, loss.on(cb, positions),
                                               cached_velocities=vel, intermediate="cached"))


def _setup(model, sizes, drawn, line, offset=0.0):
    """A trajectory laid out in chunk slots, its factors from the model's own velocities at every position (what
    train/gcpo.py computes after an optimizer step: exact log-probabilities at the current weights)."""
    batch = _trajectory(sizes, line=line, model=model)
    batch.log_probs[:, 1] += offset
    cb, positions, steps, real = _chunked(batch, sizes, drawn)
    with torch.no_grad():
        fresh = torch.stack([model(cb.latents[k], cb.sigmas[k], torch.zeros(cb.latents.shape[1], 1))
                             for k in range(cb.latents.shape[0])])
    cb = dataclasses.replace(cb, velocities=fresh)
    loss = GCPOStepLoss(noise_level=ETA, clip_range=CLIP, scale=1.0 / drawn.shape[0])
    return batch, loss, loss.prepared(cb), positions


def _windows(K, P):
    return [(a, a + P - 1) for a in range(0, K, P)]


def test_per_step_plan_is_autograd_through_the_chunk_loss():
    sizes, drawn = [2, 3, 1, 3], torch.tensor([[0, 1, 0, 2], [3, 2, 1, 3]])
    model = _MLP(6)
    batch, loss, cb, positions = _setup(model, sizes, drawn, line=False, offset=0.05)  # row 1's chunks clipped
    exact = _plan_grad(model, loss, cb, positions, exact_plan(len(positions)))
    assert 0 < float(loss.metrics["chunk_clipfrac"][0]) < 1

    def reference():
        T, B = batch.velocities.shape[:2]
        v = torch.stack([model(batch.latents[k], batch.sigmas[k].expand(B), torch.zeros(B, 1)) for k in range(T)])
        _reference_loss(batch, sizes, drawn, v).backward()

    torch.testing.assert_close(exact, _grads(model, reference), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("case", ["short_chunks", "affine_line"])
def test_one_jagg_window_per_chunk_is_exact_where_the_jacobians_are_affine(case):
    sizes = [2, 1, 2, 2] if case == "short_chunks" else [3, 4, 2, 1]
    drawn = torch.tensor([[0, 1, 0, 2], [3, 2, 1, 3]])
    model = _MLP(6) if case == "short_chunks" else _Affine(6)
    _, loss, cb, positions = _setup(model, sizes, drawn, line=case == "affine_line", offset=0.05)
    K, P = len(positions), max(sizes)
    exact = _plan_grad(model, loss, cb, positions, exact_plan(K))
    jagg = _plan_grad(model, loss, cb, positions, _windows(K, P))
    assert exact.abs().max() > 0
    torch.testing.assert_close(jagg, exact, rtol=1e-4, atol=1e-7)


def test_one_jagg_window_per_long_chunk_is_not_exact_for_a_curved_velocity():
    sizes, drawn = [3, 4, 2, 1], torch.tensor([[0, 1, 0, 2], [3, 2, 1, 3]])
    model = _MLP(6)
    _, loss, cb, positions = _setup(model, sizes, drawn, line=False, offset=0.05)
    K, P = len(positions), max(sizes)
    exact = _plan_grad(model, loss, cb, positions, exact_plan(K))
    jagg = _plan_grad(model, loss, cb, positions, _windows(K, P))
    assert (jagg - exact).norm() > 1e-3 * exact.norm()
