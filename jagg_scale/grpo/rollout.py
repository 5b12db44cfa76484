"""Rollout: sample trajectories with the Flow-GRPO SDE and keep what training needs.

Per trajectory we store x_0 .. x_T, the model's predictions v_0 .. v_{T-1}, the log-probs log p_k, and (when
beta > 0) the reference model's velocities at the same x_k. The stored predictions are what makes JAGG's `cached`
intermediate mode free: on-policy they equal what a training forward would compute.

Classifier-free guidance (guidance g != 1): the sampler moves along the guided velocity u + g (c - u), computed
from one batched forward of the conditional and unconditional rows, exactly as before. What is stored is the two
predictions apart: `velocities` holds the conditional c_k (what training differentiates) and `uncond_velocities`
the unconditional u_k, which is a constant for the gradient (Flow-GRPO detaches it): while the parameters are the
rollout's, training reuses these u_k and needs no unconditional forward at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection

import torch

from ..cond import Cond, cat_cond
from .loss import StepBatch
from .sde import ode_step, sde_step_with_logprob, standard_normal

VelocityFn = Callable[[torch.Tensor, torch.Tensor, Cond], torch.Tensor]


def cfg_predictions(model: VelocityFn, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> tuple[torch.Tensor, torch.Tensor]:
    """(conditional, unconditional) predictions for `cond` = (cond, uncond): one forward of 2N rows."""
    c, uc = cond
    n = x.shape[0]
    v = model(torch.cat([x, x]), torch.cat([sigma, sigma]), cat_cond([uc, c]))
    return v[n:], v[:n]


def guide(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance: float) -> torch.Tensor:
    """The guided velocity v = v_u + g (v_c - v_u)."""
    return v_uncond + guidance * (v_cond - v_uncond)


def guided_velocity(model: VelocityFn, x: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance: float) -> torch.Tensor:
    """The policy's velocity under classifier-free guidance (sampling, evaluation, the KL reference). `cond` is the
    prompt conditioning, or a pair (cond, uncond) when guidance != 1."""
    if guidance == 1.0:
        return model(x, sigma, cond)
    return guide(*cfg_predictions(model, x, sigma, cond), guidance)


@dataclass
class Trajectories:
    """A batch of N sampled trajectories (all tensors on the rollout device, latents in float32)."""

    latents: torch.Tensor  # [T + 1, N, ...]
    velocities: torch.Tensor  # [T, N, ...] the model's (conditional) predictions
    log_probs: torch.Tensor  # [T, N]
    sigmas: torch.Tensor  # [T + 1]
    ref_velocities: torch.Tensor | None = None  # [T, N, ...]
    uncond_velocities: torch.Tensor | None = None  # [T, N, ...] with guidance != 1: the unconditional predictions

    @property
    def final(self) -> torch.Tensor:
        return self.latents[-1]

    def step_batch(self, index: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> StepBatch:
        """The rows `index` of every per-step tensor, as the loss's StepBatch."""
        return StepBatch(
            latents=self.latents[:, index],
            velocities=self.velocities[:, index],
            log_probs=self.log_probs[:, index],
            sigmas=self.sigmas,
            advantages=advantages[index],
            mask=mask[index],
            ref_velocities=None if self.ref_velocities is None else self.ref_velocities[:, index],
            uncond_velocities=None if self.uncond_velocities is None else self.uncond_velocities[:, index],
        )

    @staticmethod
    def cat(parts: list["Trajectories"]) -> "Trajectories":
        def cat(name):
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors, dim=1)

        return Trajectories(latents=cat("latents"), velocities=cat("velocities"), log_probs=cat("log_probs"),
                            sigmas=parts[0].sigmas, ref_velocities=cat("ref_velocities"),
                            uncond_velocities=cat("uncond_velocities"))


def draw_step_noise(generator, shape, num_steps: int, device: torch.device) -> torch.Tensor:
    """The N(0, 1) noise of `num_steps` SDE steps of a chunk, drawn on the CPU in the order the steps consume it
    (step by step, each row from its own generator: the same numbers as drawing at every step) and copied to the
    device once, from pinned memory without blocking the host: [num_steps, *shape]."""
    noise = torch.stack([standard_normal(shape, generator) for _ in range(num_steps)]) if num_steps else \
        torch.empty(0, *shape)
    return to_device(noise, device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host synchronisation: pinned and copied asynchronously on CUDA (the
    caching host allocator keeps the pinned buffer alive until the copy has run)."""
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def sample_sde(
    velocity_fn: VelocityFn,
    cond: Cond,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    noise_level: float,
    generator: torch.Generator | list[torch.Generator],
    ref_velocity_fn: VelocityFn | None = None,
    sde_steps: Collection[int] | None = None,
    guidance: float = 1.0,
) -> Trajectories:
    """Run the sampler from `noise` (= x_0 at s_0 = 1) through all T steps of `sigmas`: the SDE (with log-probs)
    on `sde_steps` (all when None), the deterministic ODE elsewhere (Flow-GRPO-Fast / MixGRPO: only the SDE
    steps are explored and trained; their log-probs are 0 elsewhere and never used). With guidance != 1 the
    model is called with `cond` = (cond, uncond) through `cfg_predictions` and both predictions are kept."""
    x = noise.float()
    n = x.shape[0]
    sigmas = sigmas.to(x.device)  # once: the per-step scalars below are views of it, never host reads
    sigma_max = sigmas[1]
    trained = [k for k in range(len(sigmas) - 1) if sde_steps is None or k in sde_steps]
    step_noise = draw_step_noise(generator, x.shape, len(trained), x.device)
    latents, velocities, log_probs, ref_vs, uncond_vs = [x], [], [], [], []
    for k in range(len(sigmas) - 1):
        s = sigmas[k].expand(n)
        if guidance == 1.0:
            v = velocity_fn(x, s, cond).float()
            prediction = v
        else:
            c, u = cfg_predictions(velocity_fn, x, s, cond)
            v = guide(c, u, guidance).float()  # the very ops of guided_velocity: the same trajectory
            prediction = c.float()
            uncond_vs.append(u.float())
        stochastic = sde_steps is None or k in sde_steps
        if stochastic:
            step = sde_step_with_logprob(x, v, sigmas[k], sigmas[k + 1], noise_level=noise_level, sigma_max=sigma_max,
                                         noise=step_noise[trained.index(k)])
            x_next, log_prob = step.prev_sample, step.log_prob
        else:
            x_next, log_prob = ode_step(x, v, sigmas[k], sigmas[k + 1]), torch.zeros(n, device=x.device)
        if ref_velocity_fn is not None:  # the KL term is evaluated on the trained (SDE) steps only
            ref_vs.append(ref_velocity_fn(x, s, cond).float() if stochastic else torch.zeros_like(v))
        x = x_next
        latents.append(x)
        velocities.append(prediction)
        log_probs.append(log_prob)
    return Trajectories(
        latents=torch.stack(latents),
        velocities=torch.stack(velocities),
        log_probs=torch.stack(log_probs),
        sigmas=sigmas.clone(),
        ref_velocities=torch.stack(ref_vs) if ref_vs else None,
        uncond_velocities=torch.stack(uncond_vs) if uncond_vs else None,
    )


@torch.no_grad()
def sample_ode(velocity_fn: VelocityFn, cond: Cond, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Deterministic Euler sampling (evaluation): the final latents."""
    x = noise.float()
    for k in range(len(sigmas) - 1):
        s = sigmas[k].to(x.device).expand(x.shape[0])
        x = ode_step(x, velocity_fn(x, s, cond), sigmas[k], sigmas[k + 1])
    return x

