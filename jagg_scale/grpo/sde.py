"""The stochastic sampling steps GRPO trains through, with their log-probabilities; the ODE step; the KL term.

Rectified flow x_s = (1 - s) d + s e (data d, s = 1 is noise; x_k is the latent at step k). Two SDE kinds
(`sampling.sde`), both Flow-GRPO's (yifan123/flow_grpo flow_grpo/diffusers_patch/sd3_sde_with_logprob.py,
`sde_step_with_logprob`, sde_type "sde" and "cps", at commit 54809b5):

flow_grpo (sde_type "sde"), with dt = s_{k+1} - s_k < 0 and noise level a:

    std_k   = a * sqrt(s_k / (1 - s_k))          (s_k == 1: s_1 replaces s_k in the denominator)
    mean_k  = x_k (1 + std_k^2 / (2 s_k) dt) + v_k (1 + std_k^2 (1 - s_k) / (2 s_k)) dt
    x_{k+1} = mean_k + std_k sqrt(-dt) eps
    log p_k = mean over non-batch dims of log N(x_{k+1}; mean_k, (std_k sqrt(-dt))^2)

cps, coefficients-preserving sampling (arXiv 2509.05952): the step keeps the rectified-flow coefficients of the data
and noise predictions, d = x_k - s_k v_k and e = x_k + (1 - s_k) v_k, and injects noise of
std_k = s_{k+1} sin(a pi / 2):

    mean_k  = (1 - s_{k+1}) d + sqrt(s_{k+1}^2 - std_k^2) e
    x_{k+1} = mean_k + std_k eps
    log p_k = -mean over non-batch dims of (x_{k+1} - mean_k)^2

cps's log p_k is Flow-GRPO's: "remove all constants", the variance 2 std_k^2 included, so it is the Gaussian
log-density times 2 std_k^2 plus a constant, not the density itself; GRPO's ratio exp(log p - log p_old) is then
taken of that quantity, as Flow-GRPO takes it (its clip range acts on it). Both kinds report std_k as Flow-GRPO's
KL term divides by it: std_k without sqrt(-dt) for flow_grpo, the step's own std for cps.

Everything is computed in float32 whatever dtype the model ran in: the log-prob ratios of GRPO are
exp(small differences) and bf16 rounding would swamp a clip range of 1e-4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
SdeKind = Literal["flow_grpo", "cps"]  # sampling.sde
SDE_KINDS: tuple[str, ...] = get_args(SdeKind)


@dataclass
class SDEStep:
    """One SDE transition: the sample, its mean, std_k (without sqrt(-dt)), the per-sample log-prob and the
    transition's own std (the Gaussian's: flow_grpo std_k sqrt(-dt), cps std_k)."""

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor  # what Flow-GRPO's KL divides by (flow_grpo: std_k WITHOUT sqrt(-dt); cps: the step's std)
    log_prob: torch.Tensor  # [B]
    noise_std: torch.Tensor  # the std of x_{k+1} around mean (Flow-DPPO's KL between two policies' steps divides by it)


def _as_batch(sigma, x: torch.Tensor) -> torch.Tensor:
    """sigma as float32 of shape [B, 1, 1, ...] (broadcastable to x). A Python number is filled in on x's device
    (no host-to-device copy); a tensor should live there already (the schedule is moved once, not per step)."""
    if isinstance(sigma, (int, float)):
        s = torch.full((), float(sigma), dtype=torch.float32, device=x.device)
    else:
        s = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
    if s.ndim == 0:
        s = s.expand(x.shape[0])
    return s.reshape(-1, *([1] * (x.ndim - 1)))


def sde_std(sigma: torch.Tensor, noise_level: float, sigma_max) -> torch.Tensor:
    """std_k = a sqrt(s_k / (1 - s_k)); at s_k == 1 the denominator uses sigma_max (= s_1 of the schedule: a number,
    or a 0-d tensor on sigma's device, so that no value is read back to the host)."""
    if torch.is_tensor(sigma_max):
        sigma_max = sigma_max.to(sigma.dtype)
    denom = 1.0 - torch.where(sigma >= 1.0, sigma_max, sigma)
    return noise_level * torch.sqrt(sigma / denom)


def standard_normal(shape, generator=None) -> torch.Tensor:
    """float32 N(0, 1) noise on the CPU. `generator` may be one generator for the whole batch or a list with one
    per row: per-row streams make a sample's noise depend on its own seed alone, not on how many rows share a
    batch or a rank, so a run draws the same noise on 1 process or N."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {shape[0]} rows")
        return torch.stack([torch.randn(tuple(shape[1:]), generator=g, dtype=torch.float32) for g in generator])
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32, device="cpu")


def sde_step_with_logprob(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    sigma_max,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
) -> SDEStep:
    """Flow-GRPO's SDE step from sigma to sigma_next (< sigma). Samples x_{k+1} unless `prev_sample` is given,
    in which case it only scores it (the training pass); `noise` is the step's N(0, 1) draw when the caller made
    it (sample_sde draws a chunk's noise up front), else it is drawn from `generator`. All math in float32."""
    x = x.float()
    v = velocity.float()
    s = _as_batch(sigma, x)
    dt = _as_batch(sigma_next, x) - s
    std = sde_std(s, noise_level, sigma_max)
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    step_std = std * torch.sqrt(-dt)
    if prev_sample is None:
        if noise is None:
            noise = standard_normal(x.shape, generator).to(x.device)
        prev_sample = mean + step_std * noise
    prev_sample = prev_sample.detach().float()
    log_prob = -((prev_sample - mean) ** 2) / (2 * step_std**2) - torch.log(step_std) - _LOG_SQRT_2PI
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return SDEStep(prev_sample=prev_sample, mean=mean, std=std, log_prob=log_prob, noise_std=step_std)


def cps_step_with_logprob(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    sigma_max=None,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
) -> SDEStep:
    """The coefficients-preserving step from sigma to sigma_next (module docstring), with Flow-GRPO's log p (its
    constants, the variance included, removed). Same arguments as sde_step_with_logprob (sigma_max is unused: the
    step's std is s_{k+1} sin(a pi / 2), finite at s_k = 1). All math in float32."""
    x = x.float()
    v = velocity.float()
    s, s_next = _as_batch(sigma, x), _as_batch(sigma_next, x)
    std = s_next * math.sin(noise_level * math.pi / 2)
    data, noise_estimate = x - s * v, x + (1 - s) * v
    mean = data * (1 - s_next) + noise_estimate * torch.sqrt(s_next**2 - std**2)
    if prev_sample is None:
        if noise is None:
            noise = standard_normal(x.shape, generator).to(x.device)
        prev_sample = mean + std * noise
    prev_sample = prev_sample.detach().float()
    log_prob = -((prev_sample - mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return SDEStep(prev_sample=prev_sample, mean=mean, std=std, log_prob=log_prob, noise_std=std)


SDE_STEPS = {"flow_grpo": sde_step_with_logprob, "cps": cps_step_with_logprob}  # sampling.sde -> its step


def ode_step(x: torch.Tensor, velocity: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """Deterministic Euler step of the probability-flow ODE (evaluation sampling), in float32."""
    x = x.float()
    dt = _as_batch(sigma_next, x) - _as_batch(sigma, x)
    return x + velocity.float() * dt


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL_k per sample: mean over dims of (mean_theta - mean_ref)^2 / (2 std_k^2), std_k without sqrt(-dt)."""
    kl = (mean.float() - ref_mean.float()) ** 2 / (2 * std.float() ** 2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))
