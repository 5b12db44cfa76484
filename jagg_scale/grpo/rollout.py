"""Rollout: sample trajectories with the Flow-GRPO SDE and keep what training needs.

Per trajectory we store the latents x_k of the sampling steps (x_0 the starting noise at s_0 = 1), the model's
predictions v_k, the log-probs log p_k (of the steps training reads: below), and (when beta > 0) the reference
model's velocities at the same x_k. The stored predictions are what makes JAGG's `cached` intermediate mode free:
on-policy they equal what a training forward would compute.

What is stored, and in which dtype (sample_sde's keep_steps, prediction_dtype, ref_dtype; Policy.rollout passes
the RolloutSpec's trained steps and the compute dtype):
- only the steps training reads: the range from the first to the last trained step (their x_k and x_{k+1},
  predictions, log-probs), so a trajectory starts at step `first`; x_T beside it where the range ends before T (the
  reward's input). Steps outside it (an ODE prefix, the steps after an SDE window, Flow-GRPO's untrained last step)
  are dropped as they are sampled, never allocated.
- predictions c_k, u_k (and the reference's where it is its model's own output: guidance 1, no fill between knots)
  in the dtype the model computed them in: an adapter returns its transformer's bf16 / fp16 output upcast to
  float32, so storing it in that dtype loses nothing, and every reader upcasts before its float32 math.
- latents and log-probs in float32: they are the SDE's float32 results (x_{k+1} = mean + std noise), which a bf16
  copy would round (the loss scores the stored x_{k+1} against its mean: the log-ratio would no longer be 0
  on-policy). The same for the reference under CFG (the guided combination is float32 math) or filled between its
  knots (a float32 blend).

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
from .guidance import Guidance, GuidanceRule, guide, scale_at
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
                    guidance: Guidance, rule: GuidanceRule = "plain") -> torch.Tensor:
    """The policy's velocity under classifier-free guidance (sampling, evaluation, the KL reference). `cond` is the
    prompt conditioning, or a pair (cond, uncond) when guidance != 1 (a scale per expert: grpo/guidance.py)."""
    if guidance == 1.0:
        return model(x, sigma, cond)
    return guide(*cfg_predictions(model, x, sigma, cond), scale_at(guidance, sigma), rule)


@dataclass
class Trajectories:
    """A batch of N sampled trajectories over the K stored steps first .. first + K - 1 (all tensors on the rollout
    device; latents and log-probs in float32, predictions in the model's dtype: module docstring). Position q of
    every per-step tensor is trajectory step first + q."""

    latents: torch.Tensor  # [K + 1, N, ...] x_first .. x_{first+K}
    velocities: torch.Tensor  # [K, N, ...] the model's (conditional) predictions
    log_probs: torch.Tensor  # [K, N]
    sigmas: torch.Tensor  # [K + 1] their noise levels
    ref_velocities: torch.Tensor | None = None  # [K, N, ...]
    uncond_velocities: torch.Tensor | None = None  # [K, N, ...] with guidance != 1: the unconditional predictions
    first: int = 0  # the trajectory step of position 0
    sigma_max: torch.Tensor | None = None  # the schedule's s_1 (the SDE's std at s = 1); None: sigmas[1]
    last: torch.Tensor | None = None  # [N, ...] x_T where the stored range ends before it

    @property
    def final(self) -> torch.Tensor:
        return self.latents[-1] if self.last is None else self.last

    def positions(self, steps):
        """Trajectory steps (a list, or a tensor of them) as positions in the stored tensors."""
        return [k - self.first for k in steps] if isinstance(steps, (list, tuple)) else steps - self.first

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
                         uncond_velocities=per_step(self.uncond_velocities), sigma_max=self.sigma_max)

    @staticmethod
    def cat(parts: list["Trajectories"]) -> "Trajectories":
        def cat(name):
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors, dim=1)

        return Trajectories(latents=cat("latents"), velocities=cat("velocities"), log_probs=cat("log_probs"),
                            sigmas=parts[0].sigmas, ref_velocities=cat("ref_velocities"),
                            uncond_velocities=cat("uncond_velocities"), first=parts[0].first,
                            sigma_max=parts[0].sigma_max,
                            last=None if parts[0].last is None else torch.cat([p.last for p in parts]))


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


class _Kept:
    """A per-step store of the sampler that keeps the entries of steps lo .. hi - 1, each in `dtype`, and drops the
    others as they are assigned (nothing outside the range is held, even while sampling; keep="final": nothing)."""

    def __init__(self, lo: int, hi: int, dtype: torch.dtype):
        self.lo, self.hi, self.dtype, self.kept = lo, hi, dtype, {}

    def __setitem__(self, k: int, value: torch.Tensor | None) -> None:
        if value is not None and self.lo <= k < self.hi:
            self.kept[k] = value.to(self.dtype)

    def __getitem__(self, k: int) -> torch.Tensor | None:
        return self.kept.get(k)

    def stack(self, like: torch.Tensor) -> torch.Tensor:
        """[hi - lo, ...]: zeros in like's shape where nothing was computed (a compressed rollout's unvisited grid
        points, the reference off its knots before they are filled: training never reads them)."""
        zero = torch.zeros(like.shape, dtype=self.dtype, device=like.device)
        return torch.stack([self.kept.get(k, zero) for k in range(self.lo, self.hi)])


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
    guidance: Guidance = 1.0,
    guidance_rule: GuidanceRule = "plain",
    ode_solver: str = "euler",
    ode_steps: int = 0,
    host_sigmas: Sequence[float] | None = None,
    sde: str = "flow_grpo",
    keep: str = "trajectory",
    shared_prefix: torch.Tensor | None = None,
    keep_steps: Collection[int] | None = None,
    prediction_dtype: torch.dtype | None = None,
    ref_dtype: torch.dtype | None = None,
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
    schedule's layout over its stored range, so trained steps index it as before (at positions k - first):
    latents, velocities and log-probs of the window, x_T the final sample; grid points of the range the compressed
    parts do not visit hold zeros (training never reads them). The solver's coefficients are Python floats computed
    from `host_sigmas` (the schedule's values as a list; read from `sigmas` when not given: one read of the device),
    never per step on the device.

    `keep` final: only x_T is returned (FinalLatents); nothing per step is held, not even while sampling.
    `keep_steps` (the steps training reads; None: every step): the trajectory holds the range from the first to the
    last of them only, and x_T (module docstring); the predictions are stored in `prediction_dtype`, the reference's
    in `ref_dtype` (None: float32), each where that loses nothing (the caller's decision: Policy.rollout).

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
            v = velocity_fn(x, s, cond)
            return v.float(), v, None
        c, u = cfg_predictions(velocity_fn, x, s, cond)
        return guide(c, u, scale_at(guidance, s), guidance_rule).float(), c, u  # guided_velocity's very ops

    final_only = keep == "final"
    lo, hi = (0, 0) if final_only else (0, T) if keep_steps is None else (min(keep_steps), max(keep_steps) + 1)
    latents, log_probs = _Kept(lo, hi + 1, torch.float32), _Kept(lo, hi, torch.float32)
    velocities, uncond_vs = (_Kept(lo, hi, prediction_dtype or torch.float32) for _ in range(2))
    ref_vs = _Kept(lo, hi, ref_dtype or torch.float32)
    latents[0] = x

    def sde(k, x):
        s = sigmas[k].expand(n)
        v, velocities[k], uncond_vs[k] = predict(x, s)
        step = sde_step(x, v, sigmas[k], sigmas[k + 1], noise_level=noise_level, sigma_max=sigma_max,
                        noise=step_noise[trained.index(k)])
        if ref_velocity_fn is not None and (ref_steps is None or k in ref_steps):  # the KL term's, where trained
            ref_vs[k] = ref_velocity_fn(x, s, cond)
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

    return Trajectories(
        latents=latents.stack(x),
        velocities=velocities.stack(x),
        log_probs=log_probs.stack(torch.zeros(n, device=x.device)),
        sigmas=sigmas[lo : hi + 1].clone(),
        ref_velocities=None if ref_velocity_fn is None else ref_vs.stack(x),
        uncond_velocities=None if guidance == 1.0 else uncond_vs.stack(x),
        first=lo, sigma_max=sigma_max.clone(),
        last=x if hi < T else None,
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

