"""The one minibatch runner every algorithm's update phase goes through: `MinibatchRunner.run(rows, step, ...)`.

    for each inner epoch, for each minibatch (rows.py: this rank's slice of a global minibatch):
        minibatch the algorithm's Minibatch: its loss's batch, conditioning and loss, the K trained positions and
                  knot_backward's inputs at them (built by a callback of the algorithm's: GRPO's trajectory steps,
                  DiffusionNFT's noised timesteps)
        plan      the planner's knot plan (jagg/planners.py) from what the batch holds, its statistics combined over
                  ranks so that every rank runs the same plan
        probe     jagg.probe_every: the exact gradient beside the plan's, per window and overall, before the first
                  backward (it leaves .grad cleared, so the update is unchanged)
        backward  micro-batches of train.micro_batch_size rows, each the whole plan through knot_backward
                  (jagg/backward.py); an optional refresh of each micro-batch first, given the plan (CFG's
                  unconditional predictions once the weights moved: at every trained step or at the plan's knots);
                  the engine's backward(out, grad, last) with `last` on the final one
        step      engine.step(): clip, optimizer, EMA; a non-finite loss or norm skips it (counted; too many in
                  a row stop the run); under float16 an overflow of the loss scale's search is counted apart
                  (loss_scale_skips, parallel/loss_scale.py) and the scale is logged (loss_scale)

Every plan runs through `knot_backward`, the one place a transformer backward happens, and one synchronisation rule
holds for all of them: `last` marks the minibatch's accumulation boundary, where a sharded engine reduces gradients
across ranks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ..cond import Cond, index_cond
from ..jagg import (Backward, ModelFn, Plan, Planned, Planner, autograd_backward, exact_plan, interpolate_forwards,
                    knot_backward, pass_groups, plan_knots, restrict_plan)
from ..jagg.backward import MinibatchLoss
from ..parallel.engine import NonFiniteError

log = logging.getLogger(__name__)

__all__ = ["BackwardStats", "Minibatch", "MinibatchRunner", "Refresh", "UpdateTotals", "backward_minibatch",
           "micro_batches", "plan_minibatch", "probe_minibatch", "reduce_metrics"]

_EXTREMES = {"ratio_max": torch.amax, "ratio_min": torch.amin,  # GRPO's per-step ratios, GCPO's per-chunk ones
             "chunk_ratio_max": torch.amax, "chunk_ratio_min": torch.amin,
             "kl_new_old_max": torch.amax}  # Flow-DPPO's largest KL between the old and the current step

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def reduce_metrics(recorded: dict[str, list]) -> dict[str, torch.Tensor]:
    """{name: [values]} -> {name: 0-d tensor}: means, except the extremes (_EXTREMES), which keep theirs;
    computed where the values live (no host synchronisation: the Trainer reads the step's row once, when it logs)."""
    out = {}
    for k, vals in recorded.items():
        if vals:
            stacked = torch.stack([torch.as_tensor(v).detach().float().reshape(()) for v in vals])
            out[k] = _EXTREMES.get(k, torch.mean)(stacked)
    return out


class Refresh(Protocol):
    """What a minibatch recomputes in each micro-batch before its backward once the weights moved (CFG's
    unconditional predictions, train/update.py UncondRefresh): `refresh(micro-batch, rows, plan)` -> the micro-batch
    to train, given the minibatch's knot plan; `passes(plan)` its no-grad forwards in B-row passes (the metrics'
    uncond_forward_passes)."""

    def __call__(self, batch: Any, rows: slice, plan: Plan) -> Any: ...

    def passes(self, plan: Plan) -> int: ...


@dataclass
class Minibatch:
    """One minibatch as the runner trains it (an algorithm builds it).

    batch         the loss's batch (grpo StepBatch, nft NFTBatch): `batch.rows(rows)` is a micro-batch of it
    cond          its conditioning (B rows)
    loss          its MinibatchLoss; position j of the plan is the loss's index positions[j]
    positions     the K trained positions of `batch`
    inputs        inputs(batch) -> (latents, sigmas, velocities) at the K positions, [K, B, ...] (sigmas [K] or
                  [K, B]): knot_backward's points, their noise levels and the cached velocities (the planner's
                  input, and the `cached` / `interpolate` intermediate values)
    intermediate  jagg.intermediate as this minibatch resolves it (cached | interpolate | forward)
    plan_sigmas   the noise levels the planner reads ([K]); None: the inputs' sigmas
    refresh       the Refresh of each micro-batch before its backward (None: trained as it is)
    nograd_forward_passes   no-grad passes (B rows) the algorithm spent building the minibatch (GCPO's factors
                  after an optimizer step), counted with the intermediate values' in the metrics
    """

    batch: Any
    cond: Cond
    loss: MinibatchLoss
    positions: list[int]
    inputs: Callable[[Any], Inputs]
    intermediate: str
    plan_sigmas: torch.Tensor | None = None
    refresh: Refresh | None = None
    nograd_forward_passes: int = 0


@dataclass
class BackwardStats:
    """Transformer work of one or more minibatches, counted in passes over B rows (one per-step pass = 1)."""

    windows: int = 0
    windows_jagg: int = 0
    backward_calls: int = 0  # backward() calls through the transformer
    backward_passes: int = 0  # in B-row units: a JAGG joint pass counts 2
    per_step_equiv: int = 0  # what the per-step baseline would have spent: one per trained position
    nograd_forward_passes: int = 0  # no-grad forwards of the interpolated steps' values (forward; interpolate's knots)
    intermediate_forward: int = 0  # windows whose intermediate values came from fresh no-grad forwards
    uncond_forward_passes: int = 0  # CFG: no-grad unconditional forwards (B rows) after an optimizer step
    loss: float | torch.Tensor = 0.0  # sum over trained steps of the (scaled) step losses (0-d: read when logged)
    cosines: list = field(default_factory=list)
    knots: list = field(default_factory=list)  # knot plans: the trained positions computed exactly, per minibatch

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
    """What an update phase counts over its minibatches, and the step's metrics of it."""

    total: BackwardStats = field(default_factory=BackwardStats)
    per_minibatch: dict = field(default_factory=dict)
    optimizer_steps: int = 0
    applied: int = 0  # optimizer steps the engine applied (not skipped as non-finite)
    scale_skips: int = 0  # float16: steps skipped by the loss scale's search (parallel/loss_scale.py)
    loss_scale: float | None = None  # float16: the loss scale of the last optimizer step (None: no loss scaling)
    first_loss: MinibatchLoss | None = None  # the first minibatch's loss (at the rollout's own weights)
    probe: dict = field(default_factory=dict)  # the fidelity probe's metrics, when it ran

    def metrics(self, **extra) -> dict:
        """The phase's metrics (metrics.jsonl), `extra` (the probe's, the algorithm's own) before the pass counts."""
        scaling = {} if self.loss_scale is None else {"loss_scale": self.loss_scale,
                                                      "loss_scale_skips": self.scale_skips}
        return {"loss": self.total.loss / max(1, self.optimizer_steps), **reduce_metrics(self.per_minibatch),
                "optimizer_steps": self.optimizer_steps,
                "nonfinite_steps": self.optimizer_steps - self.applied - self.scale_skips,
                **scaling, **extra, **self.total.metrics()}


def micro_batches(rows: int, micro_batch_size: int) -> list[slice]:
    """Row slices of `micro_batch_size` (0: one slice of all rows); the last one holds the remainder."""
    size = micro_batch_size or rows
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


def _grad_norms(mb: Minibatch) -> list[float]:
    """|g_k| = |dL_k/dv_k| at the cached velocities of each trained position; no transformer pass, nothing
    recorded (the planners that rank windows by it)."""
    probe = mb.loss.fresh()
    velocities = mb.inputs(mb.batch)[2]
    norms = []
    for q, k in enumerate(mb.positions):
        v = velocities[q].detach().float().requires_grad_(True)
        (g,) = torch.autograd.grad(probe(mb.batch, k, v), v)
        norms.append(float(g.norm()))
    return norms


def plan_minibatch(planner: Planner, mb: Minibatch, reduce=None) -> Planned:
    """The planner's plan for this minibatch from what it holds (no transformer pass)."""
    _, sigmas, velocities = mb.inputs(mb.batch)
    return planner.plan(velocities, sigmas if mb.plan_sigmas is None else mb.plan_sigmas,
                        grad_norms=lambda: _grad_norms(mb), reduce=reduce)


def _run_plan(model_fn: ModelFn, mb: Minibatch, batch, cond: Cond, loss: MinibatchLoss, piece: list[int] | None,
              plan, rows_per_pass: int | None, backward: Backward | None) -> torch.Tensor:
    """The plan's gradient over `batch`'s trained positions (the consecutive ones `piece` of them: None, all)
    into .grad (knot_backward); returns the detached loss."""
    inputs = mb.inputs(batch)
    positions = mb.positions
    if piece is not None:
        inputs = tuple(t[piece[0]: piece[-1] + 1] for t in inputs)
        positions = positions[piece[0]: piece[-1] + 1]
    latents, sigmas, velocities = inputs
    return knot_backward(model_fn, plan, latents, sigmas, cond, loss.on(batch, positions),
                         cached_velocities=velocities, intermediate=mb.intermediate, rows_per_pass=rows_per_pass,
                         backward=backward)


def backward_minibatch(model_fn: ModelFn, mb: Minibatch, planner: Planner, *, backward: Backward | None = None,
                       reduce=None, planned: Planned | None = None, micro_batch_size: int = 0) -> BackwardStats:
    """Accumulate the gradient of sum over the trained positions of L_k into .grad; returns what it cost.

    The minibatch is planned once (routing and the planner see all its rows; `planned` skips that) and run in
    micro-batches of `micro_batch_size` rows (0: all at once) with that plan: each row's loss terms are divided by
    the minibatch's denominator, so the accumulated gradient is the whole minibatch's. `backward` is the training
    engine's (plain autograd by default); its `last` is passed on only for the final micro-batch's final backward,
    the minibatch's accumulation boundary."""
    planned = planned if planned is not None else plan_minibatch(planner, mb, reduce)
    backward = backward or autograd_backward
    chunks = micro_batches(mb.inputs(mb.batch)[0].shape[1], micro_batch_size)
    total = []
    for i, rows in enumerate(chunks):
        final = i == len(chunks) - 1
        sub, sub_cond = (mb.batch, mb.cond) if len(chunks) == 1 else (mb.batch.rows(rows), index_cond(mb.cond, rows))
        if mb.refresh is not None:
            sub = mb.refresh(sub, rows, planned.plan)

        def chunk_backward(out, grad, last, final=final):
            backward(out, grad, last=last and final)

        total.append(_run_plan(model_fn, mb, sub, sub_cond, mb.loss, None, planned.plan, planner.rows_per_pass,
                               chunk_backward))
    knots = plan_knots(planned.plan)
    interior = sum(b - a - 1 for a, b in planned.plan if b > a + 1)
    forward = mb.intermediate == "forward"
    # interpolate: a segment whose right knot comes in a later pass is looked up by one no-grad forward
    lookups = interpolate_forwards(planned.plan, planner.rows_per_pass) if mb.intermediate == "interpolate" else 0
    return BackwardStats(
        windows=planned.num_windows, windows_jagg=planned.jagg_windows,
        backward_calls=len(pass_groups(planned.plan, planner.rows_per_pass)) * len(chunks),
        backward_passes=len(knots), per_step_equiv=len(mb.positions),
        nograd_forward_passes=(interior if forward else lookups) + mb.nograd_forward_passes,
        intermediate_forward=planned.jagg_windows if forward else 0,
        uncond_forward_passes=mb.refresh.passes(planned.plan) if mb.refresh is not None else 0,
        loss=torch.stack(total).sum(), cosines=planned.cosines,
        knots=[] if planned.windows is not None else [[mb.positions[q] for q in knots]])


def _flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0, eps=1e-30))


def _norm_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.norm() / b.norm().clamp_min(1e-30))


def probe_minibatch(model_fn: ModelFn, mb: Minibatch, planner: Planner, planned: Planned,
                    params: list[torch.nn.Parameter], *, backward: Backward | None = None) -> dict:
    """The fidelity probe (jagg.probe_every): the exact per-position gradient beside the plan's on the same
    minibatch, through the same engine backward, per window (uniform windows: probe_cos_w<i>, probe_norm_ratio_w<i>)
    and overall (probe_cos, probe_norm_ratio = |g_plan| / |g_exact|). Leaves .grad cleared, so the update is
    unchanged; the loss it evaluates is a fresh copy (nothing recorded)."""
    probe_loss = mb.loss.fresh()
    K = len(mb.positions)
    pieces = planned.windows if planned.windows is not None else [list(range(K))]
    out: dict = {}
    totals: list[torch.Tensor] = []
    for i, piece in enumerate(pieces):
        grads = []
        for plan, rows in ((exact_plan(len(piece)), None), (restrict_plan(planned.plan, piece), planner.rows_per_pass)):
            for p in params:
                p.grad = None
            _run_plan(model_fn, mb, mb.batch, mb.cond, probe_loss, piece, plan, rows, backward)
            grads.append(_flat_grad(params))
        if planned.windows is not None:
            out[f"probe_cos_w{i}"] = _cos(grads[1], grads[0])
            out[f"probe_norm_ratio_w{i}"] = _norm_ratio(grads[1], grads[0])
        totals = grads if not totals else [t + g for t, g in zip(totals, grads)]
    for p in params:
        p.grad = None
    exact, approx = totals
    out["probe_cos"] = _cos(approx, exact)
    out["probe_norm_ratio"] = _norm_ratio(approx, exact)
    return out


class MinibatchRunner:
    """The update phase's loop for any algorithm (module docstring): built once by the algorithm from the run config,
    the training engine (backward, step, params) and the process context; holds the planner and the count of
    optimizer steps skipped in a row (train.max_nonfinite_steps)."""

    def __init__(self, cfg, engine, dist):
        self.cfg, self.engine, self.dist = cfg, engine, dist
        self.planner = cfg.jagg.make_planner()
        self.nonfinite_run = 0  # optimizer steps skipped in a row (train.max_nonfinite_steps stops the run)

    def run(self, model_fn: ModelFn, rows, step: int,
            minibatch: Callable[[int, torch.Tensor, torch.Tensor, bool], Minibatch], *, fresh: bool = True
            ) -> UpdateTotals:
        """Every minibatch of every inner epoch (grpo.inner_epochs) of this rank's `rows` (StepRows), one optimizer
        step each. `minibatch(epoch, local, global_rows, on_policy)` builds each (`local`: this rank's positions in
        its rows, a host index; `global_rows`: the whole minibatch's global rows, every rank's; `on_policy`: the
        rollout was sampled with these weights (`fresh`: not an earlier version's) and no optimizer step was
        applied on it yet)."""
        cfg = self.cfg
        done = UpdateTotals()
        probing = cfg.jagg.probe_every > 0 and step % cfg.jagg.probe_every == 0
        for epoch in range(cfg.grpo.inner_epochs):
            for local, global_rows in rows.minibatches(epoch, cfg.run.seed, step):
                mb = minibatch(epoch, local, global_rows, fresh and done.applied == 0)  # a skipped step changed nothing
                planned = plan_minibatch(self.planner, mb, self.reduce)
                if probing and done.optimizer_steps == 0:  # before the update's backward: it leaves .grad cleared
                    t_probe = time.perf_counter()
                    done.probe = probe_minibatch(model_fn, mb, self.planner, planned, self.engine.params,
                                                 backward=self.engine.backward)
                    done.probe["time_probe"] = time.perf_counter() - t_probe
                stats = backward_minibatch(model_fn, mb, self.planner, backward=self.engine.backward,
                                           planned=planned, micro_batch_size=cfg.train.micro_batch_size)
                if done.optimizer_steps == 0:
                    done.first_loss = mb.loss
                self.optimizer_step(done, stats, mb.loss, step)
        return done

    def optimizer_step(self, done: UpdateTotals, stats: BackwardStats, loss: MinibatchLoss, step: int) -> None:
        """The engine's step after a minibatch's backward, counted in `done` with the loss's metrics."""
        grad_norm = self.engine.step(loss=stats.loss if torch.is_tensor(stats.loss) else None)
        done.optimizer_steps += 1
        done.applied += self.applied(step)
        done.scale_skips += self.engine.scale_skipped
        done.loss_scale = self.engine.loss_scale
        done.total.add(stats)
        for key, value in {**reduce_metrics(loss.metrics), "grad_norm": grad_norm}.items():
            done.per_minibatch.setdefault(key, []).append(value)

    def applied(self, step: int) -> bool:
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

    def reduce(self, values: list[float], how: str) -> list[float]:
        """Planning statistics combined over ranks so that every rank runs the same plan."""
        if not self.dist.active:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        with self.engine.comm.phase("control"):  # bookkeeping, not the model's traffic: counted apart from "train"
            parts = self.dist.all_gather_tensor(t.unsqueeze(0).to(self.dist.device)).cpu()
        return (parts.mean(0) if how == "mean" else parts.pow(2).sum(0).sqrt()).tolist()
