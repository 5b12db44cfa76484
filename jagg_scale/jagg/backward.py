"""The JAGG joint backward: one transformer backward per window of W sampling steps instead of W.

Every per-step GRPO loss L_k depends on theta only through the velocity v_k = v_theta(x_k, s_k, c), so

    grad = sum_k g_k^T J_k,      g_k = dL_k / dv_k   (analytic in v_k: no transformer pass),
                                 J_k = d v_theta(x_k, s_k, c) / d theta.

JAGG replaces the intermediate Jacobians by their sigma-interpolation between the window's endpoints,
J_k ~ (1 - a_k) J_0 + a_k J_{W-1} with a_k = (s_k - s_0) / (s_{W-1} - s_0), so the window collapses into two
composite upstream gradients

    G_0 = sum_k (1 - a_k) g_k,     G_{W-1} = sum_k a_k g_k,     grad ~ G_0^T J_0 + G_{W-1}^T J_{W-1},

applied in ONE backward of ONE forward over the stacked endpoints [x_0; x_{W-1}] (2B rows). It is exact when
v is affine in (x, s) along a window whose inputs are collinear with the same weights, and always for W <= 2.

The g_k need a value for every intermediate velocity v_k (the endpoints use the fresh forward):
  cached       the rollout's stored v_k (exact on-policy, no extra forward)
  interpolate  c_k + (1 - a_k)(v_0 - c_0) + a_k (v_{W-1} - c_{W-1}): cached values moved by the endpoints' drift
  forward      a no-grad forward at (x_k, s_k) (W - 2 extra rows, exact values after optimizer steps)

The result equals autograd through the surrogate v~_k = value_k + (1 - a_k)(v_0 - sg v_0) + a_k (v_{W-1} - sg v_{W-1});
we form G_0 and G_{W-1} explicitly, which makes the single backward visible and cheap to count.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Literal, get_args

import torch

from ..cond import Cond, repeat_cond
from .windows import window_weights

ModelFn = Callable[[torch.Tensor, torch.Tensor, Cond], torch.Tensor]
StepLoss = Callable[[int, torch.Tensor], torch.Tensor]

IntermediateMode = Literal["cached", "interpolate", "forward"]
INTERMEDIATE_MODES: tuple[str, ...] = get_args(IntermediateMode)

# How a backward is run. Plain autograd by default; the trainer installs the training engine's
# `backward(out, grad, last=...)` (with `last` bound) with `backward_through`: it receives what `out.backward(grad)`
# would, and runs it as the engine needs (FSDP2 gradient sync, DeepSpeed's engine.backward of sum(out * grad)).
_BACKWARD_FN: ContextVar[Callable[[torch.Tensor, torch.Tensor | None], None] | None] = ContextVar(
    "jagg_backward_fn", default=None)


@contextmanager
def backward_through(fn: Callable[[torch.Tensor, torch.Tensor | None], None]):
    """Route every backward of jagg_backward / exact_backward (and the knot engine) through `fn(out, grad)`."""
    token = _BACKWARD_FN.set(fn)
    try:
        yield
    finally:
        _BACKWARD_FN.reset(token)


def run_backward(out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    """out.backward(grad), or the installed engine's backward `fn(out, grad)`."""
    fn = _BACKWARD_FN.get()
    if fn is None:
        out.backward(grad)
    else:
        fn(out, grad)


def _upstream(step_loss: StepLoss, k: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_k, g_k) at a velocity value; g_k comes from autograd through the loss alone (no model pass)."""
    v = value.detach().to(torch.promote_types(value.dtype, torch.float32)).requires_grad_(True)
    loss = step_loss(k, v)
    (grad,) = torch.autograd.grad(loss, v)
    return loss.detach(), grad


def _intermediate_values(model_fn, latents, sigmas, cond, cached, mode, a, v_first, v_last) -> list[torch.Tensor]:
    """Velocity values of steps 1 .. W-2 for the chosen mode."""
    W, B = latents.shape[:2]
    if W <= 2:
        return []
    if mode == "forward":
        with torch.no_grad():
            x = latents[1:-1].reshape(-1, *latents.shape[2:])
            s = sigmas[1:-1].repeat_interleave(B)
            v = model_fn(x, s, repeat_cond(cond, W - 2))
        return list(v.reshape(W - 2, B, *v.shape[1:]))
    if cached is None:
        raise ValueError(f"intermediate={mode!r} needs cached_velocities (the rollout's velocities)")
    if cached.shape[:2] != latents.shape[:2]:
        raise ValueError(f"cached_velocities has shape {tuple(cached.shape)}, latents {tuple(latents.shape)}")
    if mode == "cached":
        return [cached[k] for k in range(1, W - 1)]
    drift_first, drift_last = v_first - cached[0], v_last - cached[-1]
    return [cached[k] + (1 - a[k]) * drift_first + a[k] * drift_last for k in range(1, W - 1)]


def jagg_backward(
    model_fn: ModelFn,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Cond,
    step_loss: StepLoss,
    *,
    cached_velocities: torch.Tensor | None = None,
    intermediate: str = "cached",
) -> torch.Tensor:
    """Accumulate the JAGG gradient of sum_k step_loss(k, v_k) over one window into the parameters' .grad.

    latents[W, B, ...] are the window's x_k, sigmas[W] their noise levels, cond the conditioning of B rows.
    Exactly one forward with grad (2B rows; B when W == 1) and one backward. Returns the detached summed loss.
    """
    if intermediate not in INTERMEDIATE_MODES:
        raise ValueError(f"intermediate must be one of {INTERMEDIATE_MODES}, got {intermediate!r}")
    W, B = latents.shape[:2]
    if sigmas.shape != (W,):
        raise ValueError(f"sigmas must have shape ({W},), got {tuple(sigmas.shape)}")
    if W == 1:
        v = model_fn(latents[0], sigmas[0].expand(B), cond)
        loss = step_loss(0, v)
        run_backward(loss)
        return loss.detach()

    a = window_weights(sigmas)
    x = torch.cat([latents[0], latents[-1]])
    s = torch.cat([sigmas[0].expand(B), sigmas[-1].expand(B)])
    v = model_fn(x, s, repeat_cond(cond, 2))
    v_first, v_last = v[:B].detach(), v[B:].detach()
    a_vals = a.to(v.dtype if v.dtype == torch.float64 else torch.float32)
    values = [v_first, *_intermediate_values(model_fn, latents, sigmas, cond, cached_velocities, intermediate,
                                              a_vals, v_first, v_last), v_last]

    losses, grads = zip(*(_upstream(step_loss, k, value) for k, value in enumerate(values)))
    g = torch.stack(grads)  # g_k = dL_k/dv_k, [W, B, ...]
    w = a.to(g.dtype).reshape(-1, *([1] * (g.ndim - 1)))
    g_first, g_last = ((1 - w) * g).sum(0), (w * g).sum(0)  # G_0 and G_{W-1}
    run_backward(v, torch.cat([g_first, g_last]).to(v.dtype))  # the one backward: G_0^T J_0 + G_{W-1}^T J_{W-1}
    return torch.stack(losses).sum()


def exact_backward(model_fn: ModelFn, latents: torch.Tensor, sigmas: torch.Tensor, cond: Cond,
                   step_loss: StepLoss) -> torch.Tensor:
    """Flow-GRPO's per-step baseline: one forward with grad and one backward per step (W of each)."""
    W, B = latents.shape[:2]
    total = None
    for k in range(W):
        v = model_fn(latents[k], sigmas[k].expand(B), cond)
        loss = step_loss(k, v)
        run_backward(loss)
        total = loss.detach() if total is None else total + loss.detach()
    return total
