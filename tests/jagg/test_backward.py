"""knot_backward (jagg_backward, exact_backward) against its contract (docs/algorithm.md, sections 2-4 and 6)."""

import pytest
import torch

from jagg_scale.jagg import (exact_backward, jagg_backward, num_routed, split_windows, route_windows, trained_steps,
                             window_weights)
from jagg_scale.models import DiT, DiTConfig
from toy_velocity import CountingModel, LinearVelocity, MLPVelocity


def make_step_loss(W, B, seed=0):
    """A nonlinear per-step loss in v (a GRPO-like log-ratio surrogate), distinct per step."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randn(W, B, 3, 2, 2, generator=g, dtype=torch.float64)
    adv = torch.randn(W, B, generator=g, dtype=torch.float64)

    def step_loss(k, v):
        logp = -((v.double() - targets[k]) ** 2).mean(dim=(1, 2, 3))
        return (-adv[k] * torch.exp(0.1 * logp)).mean()

    return step_loss


def collinear_window(W, B, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigmas = torch.sort(torch.rand(W, generator=g, dtype=torch.float64), descending=True).values * 0.9 + 0.05
    a = window_weights(sigmas)
    x0, x1 = torch.randn(2, B, 3, 2, 2, generator=g, dtype=torch.float64)
    latents = torch.stack([(1 - ak) * x0 + ak * x1 for ak in a])
    cond = torch.randn(B, 4, generator=g, dtype=torch.float64)
    return latents, sigmas, cond


def grads_of(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def run(fn, model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = fn(*args, **kwargs)
    return loss, grads_of(model).clone()


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("W", [3, 4, 7])
@pytest.mark.parametrize("mode", ["cached", "interpolate", "forward"])
def test_exact_on_affine_velocity_with_collinear_inputs(W, mode):
    torch.manual_seed(W)
    model = LinearVelocity().double()
    B = 3
    latents, sigmas, cond = collinear_window(W, B, seed=W)
    step_loss = make_step_loss(W, B, seed=W)
    with torch.no_grad():
        cached = torch.stack([model(latents[k], sigmas[k].expand(B), cond) for k in range(W)])
    ref_loss, ref = run(exact_backward, model, model, latents, sigmas, cond, step_loss)
    loss, got = run(jagg_backward, model, model, latents, sigmas, cond, step_loss,
                    cached_velocities=cached, intermediate=mode)
    assert rel_err(got, ref) <= 1e-9
    assert abs(float(loss - ref_loss)) <= 1e-12 * max(1.0, abs(float(ref_loss)))


@pytest.mark.parametrize("W", [3, 5])
@pytest.mark.parametrize("mode", ["cached", "interpolate", "forward"])
def test_exact_with_a_noise_level_per_row(W, mode):
    """sigmas [W, B]: each row at its own noise levels (DiffusionNFT draws a sample's training timesteps on its own),
    every row's inputs collinear in (x, s), x = (1 - s) d + s e: the weights a_k are per row and JAGG stays exact on
    an affine velocity."""
    torch.manual_seed(W)
    model = LinearVelocity().double()
    B = 3
    g = torch.Generator().manual_seed(W)
    sigmas = torch.sort(torch.rand(W, B, generator=g, dtype=torch.float64), dim=0, descending=True).values * 0.9 + 0.05
    d, e = torch.randn(2, B, 3, 2, 2, generator=g, dtype=torch.float64)
    s = sigmas.reshape(W, B, 1, 1, 1)
    latents = (1 - s) * d + s * e
    cond = torch.randn(B, 4, generator=g, dtype=torch.float64)
    step_loss = make_step_loss(W, B, seed=W)
    with torch.no_grad():
        cached = torch.stack([model(latents[k], sigmas[k], cond) for k in range(W)])
    _, ref = run(exact_backward, model, model, latents, sigmas, cond, step_loss)
    _, got = run(jagg_backward, model, model, latents, sigmas, cond, step_loss, cached_velocities=cached,
                 intermediate=mode)
    assert rel_err(got, ref) <= 1e-9
    # per-row noise levels are what the rows have: the first row's for every row (its weights, its model inputs) is not
    shared = sigmas[:, :1].expand(W, B).contiguous()
    _, wrong = run(jagg_backward, model, model, latents, shared, cond, step_loss, cached_velocities=cached,
                   intermediate="cached")
    assert rel_err(wrong, ref) > 1e-3


@pytest.mark.parametrize("W", [1, 2])
def test_exact_for_one_or_two_steps_on_any_model(W):
    torch.manual_seed(0)
    model = MLPVelocity().double()
    B = 4
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(W, B, 3, 2, 2, generator=g, dtype=torch.float64)  # not collinear, model nonlinear
    sigmas = torch.tensor([0.8, 0.3][:W], dtype=torch.float64)
    cond = torch.randn(B, 4, generator=g, dtype=torch.float64)
    step_loss = make_step_loss(W, B)
    _, ref = run(exact_backward, model, model, latents, sigmas, cond, step_loss)
    _, got = run(jagg_backward, model, model, latents, sigmas, cond, step_loss)
    assert rel_err(got, ref) <= 1e-12


def test_nonlinear_model_is_approximate_but_not_exact():
    """Guards the exactness tests above against passing trivially: on a nonlinear model with non-collinear inputs,
    W = 4 JAGG differs from per-step, yet stays well aligned."""
    torch.manual_seed(0)
    model = MLPVelocity().double()
    W, B = 4, 4
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(W, B, 3, 2, 2, generator=g, dtype=torch.float64)
    sigmas = torch.tensor([0.9, 0.7, 0.4, 0.2], dtype=torch.float64)
    cond = torch.randn(B, 4, generator=g, dtype=torch.float64)
    step_loss = make_step_loss(W, B)
    _, ref = run(exact_backward, model, model, latents, sigmas, cond, step_loss)
    _, got = run(jagg_backward, model, model, latents, sigmas, cond, step_loss, intermediate="forward")
    assert rel_err(got, ref) > 1e-6


@pytest.mark.parametrize("mode,nograd_rows", [("cached", []), ("interpolate", []), ("forward", [(5 - 2) * 3])])
def test_one_forward_with_grad_of_2B_rows_and_one_backward(mode, nograd_rows):
    W, B = 5, 3
    model = CountingModel(MLPVelocity().double())
    latents, sigmas, cond = collinear_window(W, B)
    cached = torch.randn(W, B, 3, 2, 2, dtype=torch.float64)
    jagg_backward(model, latents, sigmas, cond, make_step_loss(W, B), cached_velocities=cached, intermediate=mode)
    with_grad = [rows for rows, grad in model.forwards if grad]
    without_grad = [rows for rows, grad in model.forwards if not grad]
    assert with_grad == [2 * B]
    assert without_grad == nograd_rows  # forward mode: one no-grad pass over the W - 2 intermediates
    assert model.backwards == 1


def test_cond_structures_are_repeated_for_the_joint_batch():
    """A dict conditioning is concatenated along dim 0 for the 2B-row joint pass."""
    W, B = 3, 2
    inner = LinearVelocity().double()

    def model_fn(x, s, cond):
        assert cond["c"].shape[0] == x.shape[0]
        return inner(x, s, cond["c"])

    latents, sigmas, cond = collinear_window(W, B)
    with torch.no_grad():
        cached = torch.stack([inner(latents[k], sigmas[k].expand(B), cond) for k in range(W)])
    inner.zero_grad()
    jagg_backward(model_fn, latents, sigmas, {"c": cond}, make_step_loss(W, B), cached_velocities=cached)
    got = grads_of(inner).clone()
    _, ref = run(exact_backward, inner, inner, latents, sigmas, cond, make_step_loss(W, B))
    assert rel_err(got, ref) <= 1e-9


def test_bad_arguments_fail_clearly():
    W, B = 3, 2
    model = LinearVelocity().double()
    latents, sigmas, cond = collinear_window(W, B)
    with pytest.raises(ValueError, match="intermediate"):
        jagg_backward(model, latents, sigmas, cond, make_step_loss(W, B), intermediate="bogus")
    with pytest.raises(ValueError, match="cached_velocities"):
        jagg_backward(model, latents, sigmas, cond, make_step_loss(W, B), intermediate="cached")
    with pytest.raises(ValueError, match="sigmas"):
        jagg_backward(model, latents, sigmas[:2], cond, make_step_loss(W, B))


def test_jagg_on_dit_float64_w2_matches_per_step():
    """The real backbone: W = 2 is exact on the built-in DiT."""
    torch.manual_seed(0)
    model = DiT(DiTConfig(image_size=8, in_channels=3, patch_size=2, hidden_size=32, depth=2, num_heads=2))
    model.init_weights(zero_out=False)
    model = model.double()
    B = 2
    latents = torch.randn(2, B, 3, 8, 8, dtype=torch.float64)
    sigmas = torch.tensor([0.6, 0.4], dtype=torch.float64)
    cond = model.encode_prompts(["a red cat", "a blue dog"])
    targets = torch.randn(2, B, 3, 8, 8, dtype=torch.float64)

    def step_loss(k, v):
        return torch.sin(v.double() * targets[k]).mean()

    _, ref = run(exact_backward, model, model, latents, sigmas, cond, step_loss)
    _, got = run(jagg_backward, model, model, latents, sigmas, cond, step_loss)
    assert rel_err(got, ref) <= 1e-10


# ----------------------------------------------------------------------------------------------------------------
# windows, weights, routing
# ----------------------------------------------------------------------------------------------------------------


def test_windows_cover_any_T_with_a_remainder():
    assert split_windows(range(10), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert split_windows(range(7), 7) == [list(range(7))]
    assert split_windows(range(3), 1) == [[0], [1], [2]]
    for T in range(1, 20):
        for W in range(1, 9):
            flat = [k for w in split_windows(range(T), W) for k in w]
            assert flat == list(range(T))
    with pytest.raises(ValueError, match="window"):
        split_windows(range(4), 0)


def test_trained_steps_follow_timestep_fraction():
    assert trained_steps(10, 1.0) == list(range(10))
    assert trained_steps(10, 0.99) == list(range(9))
    assert trained_steps(10, 0.01) == [0]
    with pytest.raises(ValueError):
        trained_steps(10, 0.0)


def test_weights_come_from_sigmas_not_indices():
    sigmas = torch.tensor([1.0, 0.9, 0.5, 0.0])  # non-uniform
    a = window_weights(sigmas)
    assert torch.allclose(a, torch.tensor([0.0, 0.1, 0.5, 1.0], dtype=torch.float64))
    assert window_weights(torch.tensor([0.3])).tolist() == [0.0]
    with pytest.raises(RuntimeError, match="distinct endpoint sigmas"):  # one row of [W, B] with equal endpoints
        window_weights(torch.tensor([[0.9, 0.8], [0.5, 0.8]]))


def _velocities_with_cosines(cos_per_window, window=2, B=4):
    """[T, B, D] velocities whose window endpoints have the given cosines."""
    vs = []
    for c in cos_per_window:
        e1, e2 = torch.zeros(B, 8), torch.zeros(B, 8)
        e1[:, 0] = 1.0
        e2[:, 0], e2[:, 1] = c, (1 - c**2) ** 0.5
        mids = [e1] * (window - 2)
        vs += [e1, *mids, e2]
    return torch.stack(vs)


def test_route_by_vcos_picks_the_highest_cosine_windows():
    cosines = [0.2, 0.9, 0.5, 0.99]
    v = _velocities_with_cosines(cosines, window=3)
    windows = split_windows(range(12), 3)
    r = route_windows(windows, v, jagg_frac=0.5, route_by="vcos")
    assert r.use_jagg == [False, True, False, True]
    assert [round(c, 6) for c in r.cosines] == cosines
    assert route_windows(windows, v, jagg_frac=0.0).num_jagg == 0
    assert route_windows(windows, v, jagg_frac=1.0).num_jagg == 4
    # min_cos excludes windows below it even when jagg_frac asks for them
    assert route_windows(windows, v, jagg_frac=1.0, min_cos=0.6).use_jagg == [False, True, False, True]


def test_route_by_weighted_picks_the_lowest_expected_error():
    cosines = [0.2, 0.9, 0.5, 0.99]
    v = _velocities_with_cosines(cosines, window=3)
    windows = split_windows(range(12), 3)
    # |g_k| grows towards the end: the last window's error (1 - 0.99) * 300 = 3 outweighs the first's 0.8 * 1
    grad_norms = [1 / 3] * 3 + [1 / 3] * 3 + [1 / 3] * 3 + [100.0] * 3
    r = route_windows(windows, v, jagg_frac=0.5, route_by="weighted", grad_norms=grad_norms)
    # expected errors: 0.8, 0.1, 0.5, 3.0 -> the two smallest are windows 1 and 2
    assert r.use_jagg == [False, True, True, False]
    vcos = route_windows(windows, v, jagg_frac=0.5, route_by="vcos")
    assert vcos.use_jagg != r.use_jagg
    with pytest.raises(ValueError, match="grad_norms"):
        route_windows(windows, v, jagg_frac=0.5, route_by="weighted")


def test_num_routed_rounds_half_up():
    assert [num_routed(f, 4) for f in (0.0, 0.25, 0.5, 0.75, 1.0)] == [0, 1, 2, 3, 4]
    assert num_routed(0.5, 3) == 2
    with pytest.raises(ValueError):
        num_routed(1.5, 4)
