"""The update phase of a training step, in one place: `Updater(...)(traj, cond, adv, rows, step, steps)`.

    for each inner epoch, for each minibatch (rows.py: this rank's slice of a global minibatch):
        loss      GRPOStepLoss over the minibatch (grpo/loss.py), its mean over the valid rows of every rank
        plan      the planner's knot plan (jagg/planners.py), from what the rollout holds
        probe     jagg.probe_every: the exact gradient beside the plan's (probe_minibatch), before the first backward
        backward  micro-batches of train.micro_batch_size rows, each the whole plan through knot_backward
                  (jagg/backward.py); CFG: the unconditional predictions refreshed per micro-batch once the
                  weights moved; the engine's backward(out, grad, last) with `last` on the minibatch's final one
        step      engine.step(): clip, optimizer, EMA; a non-finite loss or norm skips it (counted; too many in
                  a row stop the run); under float16 an overflow of the loss scale's search is counted apart
                  (loss_scale_skips, parallel/loss_scale.py) and the scale is logged (loss_scale)

Every plan runs through `knot_backward`, the one place a transformer backward happens, and one synchronisation rule
holds for all of them: `last` marks the minibatch's accumulation boundary, where a sharded engine reduces gradients
across ranks. `auto` intermediate values are the rollout's cached velocities until the first applied optimizer step
on this rollout and fresh no-grad forwards after it (cached values are then stale).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cond import Cond, index_cond
from ..grpo.loss import GRPOStepLoss, StepBatch
from ..grpo.rollout import to_device
from ..grpo.steps import positioned, select_steps
from ..jagg import (Backward, ModelFn, Plan, Planned, Planner, autograd_backward, exact_plan, knot_backward,
                    pass_groups, plan_knots, restrict_plan)
from ..parallel.engine import NonFiniteError

log = logging.getLogger(__name__)

__all__ = ["BackwardStats", "Updater", "backward_minibatch", "micro_batches", "plan_minibatch", "probe_minibatch",
           "reduce_metrics", "resolve_intermediate", "run_plan", "step_grad_norms", "trained_rows"]


_EXTREMES = {"ratio_max": torch.amax, "ratio_min": torch.amin}


def reduce_metrics(recorded: dict[str, list]) -> dict[str, torch.Tensor]:
    """{name: [values]} -> {name: 0-d tensor}: means, except ratio_max / ratio_min, which keep their extremes;
    computed where the values live (no host synchronisation: the Trainer reads the step's row once, when it logs)."""
    out = {}
    for k, vals in recorded.items():
        if vals:
            stacked = torch.stack([torch.as_tensor(v).detach().float().reshape(()) for v in vals])
            out[k] = _EXTREMES.get(k, torch.mean)(stacked)
    return out


@dataclass
class BackwardStats:
    """Transformer work of one or more minibatches, counted in passes over B rows (one per-step pass = 1)."""

    windows: int = 0
    windows_jagg: int = 0
    backward_calls: int = 0  # backward() calls through the transformer
    backward_passes: int = 0  # in B-row units: a JAGG joint pass counts 2
    per_step_equiv: int = 0  # what Flow-GRPO would have spent: one per trained step
    nograd_forward_passes: int = 0  # extra no-grad forwards of the `forward` intermediate mode
    intermediate_forward: int = 0  # windows whose intermediate values came from fresh no-grad forwards
    uncond_forward_passes: int = 0  # CFG: no-grad unconditional forwards (B rows) after an optimizer step
    loss: float | torch.Tensor = 0.0  # sum over trained steps of the (scaled) step losses (0-d: read when logged)
    cosines: list = field(default_factory=list)
    knots: list = field(default_factory=list)  # knot plans: the trained-step indices computed exactly, per minibatch

    def add(self, other: "BackwardStats") -> None:
        for name in ("windows", "windows_jagg", "backward_calls", "backward_passes", "per_step_equiv",
                     "nograd_forward_passes", "intermediate_forward", "uncond_forward_passes", "loss"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.cosines += other.cosines
        self.knots += other.knots

    def metrics(self) -> dict:
        """The step's metrics of the transformer work (metrics.jsonl)."""
        return {
            "windows": self.windows,
            "windows_jagg": self.windows_jagg,
            "intermediate_forward": self.intermediate_forward,
            "backward_calls": self.backward_calls,
            "backward_passes": self.backward_passes,
            "per_step_equiv": self.per_step_equiv,
            "nograd_forward_passes": self.nograd_forward_passes,
            "uncond_forward_passes": self.uncond_forward_passes,  # CFG after an optimizer step: no-grad, B rows each
            "pass_ratio": self.backward_passes / max(1, self.per_step_equiv),  # transformer rows vs per-step
            **({"knots": " ".join(map(str, self.knots[0]))} if self.knots else {}),
        }


@dataclass
class UpdateTotals:
    """What an update phase (Updater, NFTUpdater) counts over its minibatches, and the step's metrics of it."""

    total: BackwardStats = field(default_factory=BackwardStats)
    per_minibatch: dict = field(default_factory=dict)
    optimizer_steps: int = 0
    applied: int = 0  # optimizer steps the engine applied (not skipped as non-finite)
    scale_skips: int = 0  # float16: steps skipped by the loss scale's search (parallel/loss_scale.py)
    loss_scale: float | None = None  # float16: the loss scale of the last optimizer step (None: no loss scaling)

    def metrics(self, **extra) -> dict:
        """The phase's metrics (metrics.jsonl), `extra` (the probe's, the algorithm's own) before the pass counts."""
        scaling = {} if self.loss_scale is None else {"loss_scale": self.loss_scale,
                                                      "loss_scale_skips": self.scale_skips}
        return {"loss": self.total.loss / max(1, self.optimizer_steps), **reduce_metrics(self.per_minibatch),
                "optimizer_steps": self.optimizer_steps,
                "nonfinite_steps": self.optimizer_steps - self.applied - self.scale_skips,
                **scaling, **extra, **self.total.metrics()}


def resolve_intermediate(setting: str, on_policy: bool) -> str:
    """`auto`: cached velocities are exact while the parameters are the rollout's, stale after any optimizer
    step (measured: gradient cosine 0.16 cached vs 0.80 forward after one Adam step, docs/algorithm.md section 3)."""
    if setting != "auto":
        return setting
    return "cached" if on_policy else "forward"


def trained_rows(t: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """t[steps] along dim 0; a view when the steps are consecutive (they always are in training)."""
    if steps == list(range(steps[0], steps[0] + len(steps))):
        return t[steps[0] : steps[0] + len(steps)]
    return t[torch.tensor(steps, device=t.device)]


def step_grad_norms(loss: GRPOStepLoss, batch: StepBatch, steps: list[int]) -> list[float]:
    """|g_k| = |dL_k/dv_k| at the rollout's velocities for each trained step (positions of `steps`); no
    transformer pass, no metrics recorded."""
    probe = loss.fresh()
    norms = []
    for k in steps:
        v = batch.velocities[k].detach().float().requires_grad_(True)
        (g,) = torch.autograd.grad(probe(batch, k, v), v)
        norms.append(float(g.norm()))
    return norms


def plan_minibatch(planner: Planner, loss: GRPOStepLoss, batch: StepBatch, steps: list[int], reduce=None) -> Planned:
    """The planner's plan for this minibatch from what the rollout holds (no transformer pass)."""
    return planner.plan(trained_rows(batch.velocities, steps), trained_rows(batch.sigmas, steps),
                        grad_norms=lambda: step_grad_norms(loss, batch, steps), reduce=reduce)


def run_plan(model_fn: ModelFn, batch: StepBatch, cond: Cond, loss: GRPOStepLoss, steps: list[int], plan,
             rows_per_pass: int | None, intermediate: str, backward: Backward | None = None) -> torch.Tensor:
    """The plan's gradient over the trained `steps` into .grad (knot_backward); returns the detached loss."""
    return knot_backward(model_fn, plan, trained_rows(batch.latents, steps), trained_rows(batch.sigmas, steps), cond,
                         loss.on(batch, steps), cached_velocities=trained_rows(batch.velocities, steps),
                         intermediate=intermediate, rows_per_pass=rows_per_pass, backward=backward)


def micro_batches(rows: int, micro_batch_size: int) -> list[slice]:
    """Row slices of `micro_batch_size` (0: one slice of all rows); the last one holds the remainder."""
    size = micro_batch_size or rows
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


def backward_minibatch(model_fn: ModelFn, batch: StepBatch, cond: Cond, loss: GRPOStepLoss, steps: list[int],
                       planner: Planner, *, intermediate: str = "auto", on_policy: bool,
                       backward: Backward | None = None, reduce=None, planned: Planned | None = None,
                       micro_batch_size: int = 0,
                       prepare: Callable[[StepBatch, slice], StepBatch] | None = None) -> BackwardStats:
    """Accumulate the gradient of sum over `steps` of L_k into .grad; returns what it cost.

    The minibatch is planned once (routing and the planner see all its rows; `planned` skips that) and run in
    micro-batches of `micro_batch_size` rows (0: all at once) with that plan: each row's loss terms are divided by
    the minibatch's denominator, so the accumulated gradient is the whole minibatch's. `prepare(batch, rows)` may
    refresh a micro-batch before its backward (CFG's unconditional predictions after an optimizer step).
    `backward` is the training engine's (plain autograd by default); its `last` is passed on only for the final
    micro-batch's final backward, the minibatch's accumulation boundary."""
    intermediate = resolve_intermediate(intermediate, on_policy)
    mb = planned if planned is not None else plan_minibatch(planner, loss, batch, steps, reduce)
    backward = backward or autograd_backward
    chunks = micro_batches(batch.latents.shape[1], micro_batch_size)
    total = []
    for i, rows in enumerate(chunks):
        final = i == len(chunks) - 1
        sub, sub_cond = (batch, cond) if len(chunks) == 1 else (batch.rows(rows), index_cond(cond, rows))
        if prepare is not None:
            sub = prepare(sub, rows)

        def chunk_backward(out, grad, last, final=final):
            backward(out, grad, last=last and final)

        total.append(run_plan(model_fn, sub, sub_cond, loss, steps, mb.plan, planner.rows_per_pass, intermediate,
                              chunk_backward))
    knots = plan_knots(mb.plan)
    interior = sum(b - a - 1 for a, b in mb.plan if b > a + 1)
    return BackwardStats(
        windows=mb.num_windows, windows_jagg=mb.jagg_windows,
        backward_calls=len(pass_groups(mb.plan, planner.rows_per_pass)) * len(chunks),
        backward_passes=len(knots), per_step_equiv=len(steps),
        nograd_forward_passes=interior if intermediate == "forward" else 0,
        intermediate_forward=mb.jagg_windows if intermediate == "forward" else 0,
        loss=torch.stack(total).sum(), cosines=mb.cosines,
        knots=[] if mb.windows is not None else [[steps[q] for q in knots]])


def _flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def probe_minibatch(model_fn: ModelFn, batch: StepBatch, cond: Cond, loss: GRPOStepLoss, steps: list[int],
                    planner: Planner, intermediate: str, params: list[torch.nn.Parameter], *, on_policy: bool,
                    backward: Backward | None = None) -> dict:
    """The fidelity probe (jagg.probe_every): the exact per-step gradient beside the plan's on the same minibatch,
    through the same engine backward, per window (uniform windows: probe_cos_w<i>, probe_norm_ratio_w<i>) and
    overall (probe_cos, probe_norm_ratio = |g_plan| / |g_exact|). Leaves .grad cleared, so the update is unchanged."""
    intermediate = resolve_intermediate(intermediate, on_policy)
    probe_loss = loss.fresh()
    mb = plan_minibatch(planner, probe_loss, batch, steps)
    pieces = mb.windows if mb.windows is not None else [list(range(len(steps)))]
    out: dict = {}
    totals: list[torch.Tensor] = []
    for i, piece in enumerate(pieces):
        sub_steps = [steps[k] for k in piece]
        grads = []
        for plan, rows in ((exact_plan(len(piece)), None), (restrict_plan(mb.plan, piece), planner.rows_per_pass)):
            for p in params:
                p.grad = None
            run_plan(model_fn, batch, cond, probe_loss, sub_steps, plan, rows, intermediate, backward)
            grads.append(_flat_grad(params))
        if mb.windows is not None:
            out[f"probe_cos_w{i}"] = _cos(grads[1], grads[0])
            out[f"probe_norm_ratio_w{i}"] = _norm_ratio(grads[1], grads[0])
        totals = grads if not totals else [t + g for t, g in zip(totals, grads)]
    for p in params:
        p.grad = None
    exact, approx = totals
    out["probe_cos"] = _cos(approx, exact)
    out["probe_norm_ratio"] = _norm_ratio(approx, exact)
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0, eps=1e-30))


def _norm_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.norm() / b.norm().clamp_min(1e-30))


class Updater:
    """The update phase: inner epochs x minibatches x micro-batches of one rollout, one optimizer step per minibatch.

    Built once by the Trainer from the run config, the policy (velocities, CFG's unconditional refresh), the training
    engine (backward, step) and the process context; `updater(traj, cond, adv, rows, step, steps)` returns the
    step's update metrics (loss statistics as 0-d device tensors, read with the step's other metrics)."""

    def __init__(self, cfg, policy, engine, dist):
        self.cfg, self.policy, self.engine, self.dist = cfg, policy, engine, dist
        self.planner = cfg.jagg.planner()
        self.nonfinite_run = 0  # optimizer steps skipped in a row (train.max_nonfinite_steps stops the run)

    def behaviour(self):
        """The policy that samples the rollout: the trained one itself (DiffusionNFT samples with its old policy)."""
        return contextlib.nullcontext(self.engine.model)

    def ref_plan(self, T: int) -> Plan | None:
        """The plan over the T trained steps on whose knots the rollout runs the KL reference (grpo.ref_at): every
        step, or the JAGG plan's knots (known before the rollout: config.py allows nothing else); None: none in
        the rollout."""
        return self.planner.fixed_plan(T) if self.cfg.grpo.ref_at == "knots" else exact_plan(T)

    def __call__(self, traj, cond, adv, rows, step: int, steps: list[int]) -> dict:
        cfg = self.cfg
        predict = self.policy.model_fn()
        cond, uncond = self.policy.split_cond(cond)
        done, probe, onpolicy = UpdateTotals(), {}, None
        probing = cfg.jagg.probe_every > 0 and step % cfg.jagg.probe_every == 0
        for local, batch, loss, trained in self.minibatches(traj, adv, rows, step, steps, self.policy.guidance):
            mb_cond, on_policy = index_cond(cond, local), done.applied == 0  # a skipped step changed nothing
            if probing and done.optimizer_steps == 0:  # before the update's backward: it leaves .grad cleared
                t_probe = time.perf_counter()
                probe = probe_minibatch(predict, batch, mb_cond, loss, trained, self.planner,
                                        cfg.jagg.intermediate, self.engine.params, on_policy=on_policy,
                                        backward=self.engine.backward)
                probe["time_probe"] = time.perf_counter() - t_probe
            refresh = uncond is not None and not on_policy  # the rollout's uncond is stale: recomputed
            stats = backward_minibatch(predict, batch, mb_cond, loss, trained, self.planner,
                                       intermediate=cfg.jagg.intermediate, on_policy=on_policy,
                                       backward=self.engine.backward, reduce=self._reduce,
                                       micro_batch_size=cfg.train.micro_batch_size,
                                       prepare=self._uncond_refresh(index_cond(uncond, local), trained) if refresh
                                       else None)
            stats.uncond_forward_passes = len(trained) if refresh else 0
            if done.optimizer_steps == 0:  # the rollout's parameters: training must reproduce its log-probs
                onpolicy = loss.log_ratio_max()
            self._optimizer_step(done, stats, loss, step)
        return done.metrics(**probe, onpolicy_log_ratio=onpolicy)

    def minibatches(self, traj, adv, rows, step: int, steps: list[int], guidance: float):
        """(local rows on the host, StepBatch, GRPOStepLoss, its trained positions) of every minibatch of every
        inner epoch; the loss guides with `guidance` (1: it is called with the guided velocity itself). The rows stay
        a host index for index_cond (a conditioning of Tokens is cut from their host lengths, cond.py). With
        grpo.step_selection first every row trains `steps`; otherwise each row draws its own among them (the
        candidates) and the batch is laid out per row over its draw (grpo/steps.py positioned)."""
        cfg, device = self.cfg, self.dist.device
        g = cfg.grpo
        # host -> device once per step, asynchronously (advantages are computed on the host, in float64)
        adv_values, adv_mask = to_device(adv.values[rows.mine], device), to_device(adv.mask[rows.mine], device)
        K = len(steps) if g.step_selection == "first" else cfg.trained_per_sample
        for epoch in range(g.inner_epochs):
            for local, global_rows in rows.minibatches(epoch, cfg.run.seed, step):
                # the minibatch's mean is over its valid rows on all ranks (see GRPOStepLoss.denominator)
                loss = GRPOStepLoss(noise_level=cfg.sampling.noise_level, clip_range=g.clip_range,
                                    beta=g.kl_beta, scale=1.0 / K,
                                    denominator=float(adv.mask[global_rows].sum()) / rows.world_size,
                                    guidance=guidance, guidance_rule=self.policy.guidance_rule,
                                    sde=cfg.sampling.sde)
                batch, trained = traj.step_batch(to_device(local, device), adv_values, adv_mask), steps
                if g.step_selection != "first":
                    drawn = select_steps(g.step_selection, cfg.sampling.num_steps, g.timestep_fraction,
                                         cfg.selection_window, cfg.run.seed, step, rows.mine[local])
                    batch, trained = positioned(batch, drawn)
                yield local, batch, loss, trained

    def _optimizer_step(self, done: UpdateTotals, stats: BackwardStats, loss, step: int) -> None:
        """The engine's step after a minibatch's backward, counted in `done` with the loss's metrics."""
        grad_norm = self.engine.step(loss=stats.loss if torch.is_tensor(stats.loss) else None)
        done.optimizer_steps += 1
        done.applied += self._applied(step)
        done.scale_skips += self.engine.scale_skipped
        done.loss_scale = self.engine.loss_scale
        done.total.add(stats)
        for key, value in {**reduce_metrics(loss.metrics), "grad_norm": grad_norm}.items():
            done.per_minibatch.setdefault(key, []).append(value)

    def _uncond_refresh(self, uncond, steps: list[int]):
        """CFG after an optimizer step: each micro-batch's unconditional predictions recomputed at the current
        weights (one no-grad forward of its rows per trained step) before its backward."""
        return lambda batch, rows: self.policy.fresh_uncond(batch, steps, index_cond(uncond, rows))

    def _applied(self, step: int) -> bool:
        """Whether the engine applied the step; a skipped one is counted and warned about, and
        train.max_nonfinite_steps of them in a row stop the run (NonFiniteError: jagg-train exits 1)."""
        if self.engine.step_applied:
            self.nonfinite_run = 0
            return True
        if self.engine.scale_skipped:  # float16: the loss scale's search, not a broken step (loss_scale.py)
            return False
        self.nonfinite_run += 1
        limit = self.cfg.train.max_nonfinite_steps
        if self.dist.is_main:
            log.warning("training step %d: optimizer step skipped, the loss or gradient norm is not finite (%d in a "
                        "row, the run stops at train.max_nonfinite_steps=%d)", step, self.nonfinite_run, limit)
        if self.nonfinite_run >= limit:
            raise NonFiniteError(f"{self.nonfinite_run} optimizer steps in a row had a non-finite loss or gradient "
                                 f"norm (train.max_nonfinite_steps={limit}), the last at training step {step}: "
                                 "stopping; the weights were not updated by them, the newest complete checkpoint "
                                 "holds the last saved state (lower train.lr, check the reward and the data)")
        return False

    def _reduce(self, values: list[float], how: str) -> list[float]:
        """Planning statistics combined over ranks so that every rank runs the same plan."""
        if not self.dist.active:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        with self.engine.comm.phase("control"):  # bookkeeping, not the model's traffic: counted apart from "train"
            parts = self.dist.all_gather_tensor(t.unsqueeze(0).to(self.dist.device)).cpu()
        return (parts.mean(0) if how == "mean" else parts.pow(2).sum(0).sqrt()).tolist()
