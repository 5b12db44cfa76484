"""Rollout: sample trajectories with the Flow-GRPO SDE and keep what training needs.

Per trajectory we store the latents x_0 .. x_T of the sampling steps (x_0 the starting noise at s_0 = 1), the model's
predictions v_0 .. v_{T-1}, the log-probs log p_k, and (when beta > 0) the reference model's velocities at the same
x_k. The stored predictions are what makes JAGG's `cached`
intermediate mode free: on-policy they equal what a training forward would compute.

Classifier-free guidance (guidance g != 1): the sampler moves along the guided velocity u + g (c - u), computed
from one batched forward of the conditional and unconditional rows, exactly as before. What is stored is the two
predictions apart: `velocities` holds the conditional c_k (what training differentiates) and `uncond_velocities`
the unconditional u_k, which is a constant for the gradient (Flow-GRPO detaches it): while the parameters are the
rollout's, training reuses these u_k and needs no unconditional forward at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch

from ..cond import Cond, cat_cond, index_cond, to_device
from .guidance import GuidanceRule, guide
from .loss import StepBatch
from .sde import SDE_STEPS, ode_step, standard_normal
from .solver import OdeSolverState, window_grids

VelocityFn = Callable[[torch.Tensor, torch.Tensor, Cond], torch.Tensor]


def cfg_predictions(model: VelocityFn, x: torch.Tensor, sigma: torch.Tensor,
                    cond: Cond) -> tuple[torch.Tensor, torch.Tensor]:
    """(conditional, unconditional) predictions for `cond` = (cond, uncond): one forward of 2N rows."""
    c, uc = cond
    n = x.shape[0]
    v = model(torch.cat([x, x]), torch.cat([sigma, sigma]), cat_cond([uc, c]))
    return v[n:], v[:n]


def guided_velocity(model: VelocityFn, x: torch.Tensor, sigma: torch.Tensor, cond: Cond,
                    guidance: float, rule: GuidanceRule = "plain") -> torch.Tensor:
    """The policy's velocity under classifier-free guidance (sampling, evaluation, the KL reference). `cond` is the
    prompt conditioning, or a pair (cond, uncond) when guidance != 1."""
    if guidance == 1.0:
        return model(x, sigma, cond)
    return guide(*cfg_predictions(model, x, sigma, cond), guidance, rule)


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
        """The rows `index` (a host index: the trainer's local positions) of every per-step tensor, as the loss's
        StepBatch: views of the trajectory where the index is a contiguous ascending range (every row, or an epoch-0
        minibatch: no copy of the minibatch), gathered copies otherwise (a later inner epoch's permuted rows).
        Nothing that reads a StepBatch writes into it (Policy.fresh_uncond and GCPO clone what they replace)."""
        rows = row_index(index, self.latents.device)

        def per_step(t):
            return None if t is None else t[:, rows]

        return StepBatch(latents=per_step(self.latents), velocities=per_step(self.velocities),
                         log_probs=per_step(self.log_probs), sigmas=self.sigmas, advantages=advantages[rows],
                         mask=mask[rows], ref_velocities=per_step(self.ref_velocities),
                         uncond_velocities=per_step(self.uncond_velocities))

    @staticmethod
    def cat(parts: list["Trajectories"]) -> "Trajectories":
        def cat(name):
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors, dim=1)

        return Trajectories(latents=cat("latents"), velocities=cat("velocities"), log_probs=cat("log_probs"),
                            sigmas=parts[0].sigmas, ref_velocities=cat("ref_velocities"),
                            uncond_velocities=cat("uncond_velocities"))


def row_index(index: torch.Tensor, device: torch.device) -> slice | torch.Tensor:
    """`index` (host) as a slice when it is a contiguous ascending range (indexing with it is a view), else on
    `device` for a gather; decided on the host, without a device read."""
    if index.device.type == "cpu" and index.ndim == 1 and len(index):
        start = int(index[0])
        if torch.equal(index, torch.arange(start, start + len(index))):
            return slice(start, start + len(index))
    return to_device(index, device) if index.device.type == "cpu" else index


@dataclass
class FinalLatents:
    """A rollout that keeps only each row's final latents x_T (sample_sde keep="final"): what DiffusionNFT trains on.
    None of the per-step tensors of `Trajectories` is stored."""

    final: torch.Tensor  # [N, ...]

    @staticmethod
    def cat(parts: list["FinalLatents"]) -> "FinalLatents":
        return FinalLatents(torch.cat([p.final for p in parts]))


class _Dropped:
    """A per-step store that keeps nothing (keep="final"): the sampler's assignments into it are discarded."""

    def __setitem__(self, k, value) -> None:
        pass


def draw_step_noise(generator, shape, num_steps: int, device: torch.device) -> torch.Tensor:
    """The N(0, 1) noise of `num_steps` SDE steps of a chunk, drawn on the CPU in the order the steps consume it
    (step by step, each row from its own generator: the same numbers as drawing at every step) and copied to the
    device once, from pinned memory without blocking the host: [num_steps, *shape]."""
    noise = torch.stack([standard_normal(shape, generator) for _ in range(num_steps)]) if num_steps else \
        torch.empty(0, *shape)
    return to_device(noise, device)


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
    ref_steps: Collection[int] | None = None,
    guidance: float = 1.0,
    guidance_rule: GuidanceRule = "plain",
    ode_solver: str = "euler",
    ode_steps: int = 0,
    host_sigmas: Sequence[float] | None = None,
    sde: str = "flow_grpo",
    keep: str = "trajectory",
    shared_prefix: torch.Tensor | None = None,
) -> Trajectories | FinalLatents:
    """Run the sampler from `noise` (the latent x_0 at s_0 = 1) through all T steps of `sigmas`: the SDE (with
    log-probs) on `sde_steps` (all when None), the deterministic ODE elsewhere (Flow-GRPO-Fast / MixGRPO: only the SDE
    steps are explored and trained; their log-probs are 0 elsewhere and never used). With guidance != 1 the
    model is called with `cond` = (cond, uncond) through `cfg_predictions` and both predictions are kept. `sde` is
    the stochastic step (sde.py: flow_grpo | cps). The reference (`ref_velocity_fn`, the KL term's) is evaluated on
    the SDE steps in `ref_steps` (all of them when None): only the trained ones use it (Flow-GRPO's
    timestep_fraction trains 9 of 10); zeros elsewhere.

    Compressed rollout (MixGRPO-Flash; `sde_steps` one window of consecutive steps): `ode_solver` (euler | dpm2)
    steps the deterministic parts, on `ode_steps` steps in all around the window (0: the schedule's own grid
    points), re-spaced as grpo/solver.py describes; the window's SDE steps are unchanged. The trajectory keeps the
    schedule's layout, so trained steps index it as before: latents, velocities and log-probs of the window at
    their own indices, x_T the final sample; grid points the compressed parts do not visit hold zeros (training
    never reads them). The solver's coefficients are Python floats computed from `host_sigmas` (the schedule's
    values as a list; read from `sigmas` when not given: one read of the device), never per step on the device.

    `keep` final: only x_T is returned (FinalLatents); nothing per step is held, not even while sampling.

    Shared prefix (`shared_prefix`, a host index [N]: row i's lead row, the lead's entry itself): the deterministic
    steps before the first SDE step depend only on x_0 and the conditioning, so rows whose x_0 and conditioning
    (both halves with CFG) equal their lead's take them from it: they run once on the lead rows and their latents,
    predictions and final state are copied to every row (a row reads exactly its lead's numbers)."""
    x = noise.float()
    n = x.shape[0]
    T = len(sigmas) - 1
    compressed = _compressed(sde_steps, ode_solver, ode_steps)
    if compressed and host_sigmas is None:
        host_sigmas = sigmas.tolist()
    sigmas = sigmas.to(x.device)  # once: the per-step scalars below are views of it, never host reads
    sigma_max = sigmas[1]
    trained = [k for k in range(T) if sde_steps is None or k in sde_steps]
    sde_step = SDE_STEPS[sde]
    step_noise = draw_step_noise(generator, x.shape, len(trained), x.device)

    def predict(x, s, cond=cond):
        """(the guided velocity the sampler moves along, the stored prediction, the unconditional one or None)."""
        if guidance == 1.0:
            v = velocity_fn(x, s, cond).float()
            return v, v, None
        c, u = cfg_predictions(velocity_fn, x, s, cond)
        return guide(c, u, guidance, guidance_rule).float(), c.float(), u.float()  # guided_velocity's very ops

    final_only = keep == "final"
    latents: list = _Dropped() if final_only else [x] + [None] * T
    velocities: list = _Dropped() if final_only else [None] * T
    uncond_vs: list = _Dropped() if final_only else [None] * T
    ref_vs: list = _Dropped() if final_only else [None] * T
    log_probs: list = _Dropped() if final_only else [None] * T

    def sde(k, x):
        s = sigmas[k].expand(n)
        v, velocities[k], uncond_vs[k] = predict(x, s)
        step = sde_step(x, v, sigmas[k], sigmas[k + 1], noise_level=noise_level, sigma_max=sigma_max,
                        noise=step_noise[trained.index(k)])
        if ref_velocity_fn is not None and (ref_steps is None or k in ref_steps):  # the KL term's, where trained
            ref_vs[k] = ref_velocity_fn(x, s, cond).float()
        latents[k + 1], log_probs[k] = step.prev_sample, step.log_prob
        return step.prev_sample

    first = 0 if sde_steps is None else trained[0] if trained else T  # the deterministic prefix: steps < first
    if compressed:
        window = sorted(sde_steps)
        if window != list(range(first, first + len(window))):
            raise ValueError(f"a compressed rollout needs one window of consecutive SDE steps, got {window}")
        before, after = window_grids(host_sigmas, first, len(window), ode_steps)
    # the prefix on the lead rows alone where rows share it, then copied to every row
    lead = None if shared_prefix is None or first == 0 else torch.unique(shared_prefix)
    lead = None if lead is None or len(lead) == n else lead
    px, pcond = (x, cond) if lead is None else (x[to_device(lead, x.device)], index_cond(cond, lead))
    m = px.shape[0]
    if compressed:
        px = _ode_segment(lambda x, s: predict(x, s, pcond), px, before, OdeSolverState(ode_solver), m, latents,
                          velocities, uncond_vs)
    else:
        for k in range(first):
            v, velocities[k], uncond_vs[k] = predict(px, sigmas[k].expand(m), pcond)
            px = latents[k + 1] = ode_step(px, v, sigmas[k], sigmas[k + 1])
    x = px if lead is None else _broadcast_prefix(px, lead, shared_prefix, first, final_only, latents, velocities,
                                                   uncond_vs)
    if compressed:
        for k in window:
            x = sde(k, x)
        x = _ode_segment(predict, x, after, OdeSolverState(ode_solver), n, latents, velocities, uncond_vs)
    else:
        for k in range(first, T):
            if k in trained:
                x = sde(k, x)
                continue
            v, velocities[k], uncond_vs[k] = predict(x, sigmas[k].expand(n))
            x = latents[k + 1] = ode_step(x, v, sigmas[k], sigmas[k + 1])
    if final_only:
        return FinalLatents(x)

    def stack(ts: list, like: torch.Tensor) -> torch.Tensor:  # zeros where nothing was computed (see above)
        return torch.stack([t if t is not None else torch.zeros_like(like) for t in ts])

    no_log_prob = torch.zeros(n, device=x.device)
    return Trajectories(
        latents=stack(latents, x),
        velocities=stack(velocities, x),
        log_probs=stack(log_probs, no_log_prob),
        sigmas=sigmas.clone(),
        ref_velocities=None if ref_velocity_fn is None else stack(ref_vs, x),
        uncond_velocities=None if guidance == 1.0 else stack(uncond_vs, x),
    )


def _compressed(sde_steps, ode_solver: str, ode_steps: int) -> bool:
    return sde_steps is not None and (ode_solver != "euler" or ode_steps > 0)


def prefix_forwards(host_sigmas: Sequence[float], sde_steps: Collection[int] | None, ode_solver: str = "euler",
                    ode_steps: int = 0) -> int:
    """The model calls of sample_sde's deterministic prefix (before the first SDE step; on the compressed grid
    where the rollout is compressed): what a row that shares its prefix (`shared_prefix`) does not run."""
    T = len(host_sigmas) - 1
    trained = [k for k in range(T) if sde_steps is None or k in sde_steps]
    first = 0 if sde_steps is None else trained[0] if trained else T
    if not first or not _compressed(sde_steps, ode_solver, ode_steps):
        return first
    return max(len(window_grids(host_sigmas, first, len(trained), ode_steps)[0]) - 1, 0)


def _broadcast_prefix(x: torch.Tensor, lead: torch.Tensor, shared: torch.Tensor, first: int, final_only: bool,
                      latents: list, velocities: list, uncond_vs: list) -> torch.Tensor:
    """The lead rows' state after the first `first` steps, and what they stored of those steps, as every row's: row i
    gets its lead's (`shared[i]`, a position in the chunk; `lead` the sorted lead positions)."""
    rows = to_device(torch.searchsorted(lead, shared), x.device)
    if final_only:
        return x[rows]
    for k in range(first):
        for store, at in ((latents, k + 1), (velocities, k), (uncond_vs, k)):
            if store[at] is not None:
                store[at] = store[at][rows]
    return latents[first] if latents[first] is not None else x[rows]


def _ode_segment(predict, x, grid, solver: OdeSolverState, n: int, latents: list, velocities: list,
                 uncond_vs: list) -> torch.Tensor:
    """The deterministic steps of `grid` ((sigma, grid index or None) points) from x; the latents and
    predictions that fall on the schedule's grid points are stored at their indices."""
    for (s, k), (t, k_next) in zip(grid[:-1], grid[1:]):
        v, prediction, u = predict(x, torch.full((n,), s, dtype=torch.float32, device=x.device))
        if k is not None:
            velocities[k], uncond_vs[k] = prediction, u
        x = solver.step(x, v, s, t)
        if k_next is not None:
            latents[k_next] = x
    return x


@torch.no_grad()
def sample_ode(velocity_fn: VelocityFn, cond: Cond, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Deterministic Euler sampling (evaluation): the final latents."""
    x = noise.float()
    for k in range(len(sigmas) - 1):
        s = sigmas[k].to(x.device).expand(x.shape[0])
        x = ode_step(x, velocity_fn(x, s, cond), sigmas[k], sigmas[k + 1])
    return x

