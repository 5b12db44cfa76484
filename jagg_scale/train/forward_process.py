"""What the forward-process algorithm units share (DiffusionNFT, train/nft.py; AWM, train/awm.py): `ForwardProcess`.

Both train on a CFG-free ODE rollout's clean latents d, noised at K training timesteps t_1 > ... > t_K per sample:

    x_t = (1 - t) d + t e       e drawn per timestep, one per sample, or one per JAGG window (the section's `noise`)
    frozen models               velocities of policies that do not train (the old one, the EMA one, the reference) at
                                every (x_t, t), or at the fixed plan's knots only and linear in t inside each window
                                (the section's frozen-at-knots key: fill_interior)

Every draw comes from a generator seeded by (run.seed, step, inner epoch, global row) in the unit's own row_seed
streams (rows.py), so N ranks draw what one process does and a resumed run what the uninterrupted one drew. The
timesteps themselves are each unit's (DiffusionNFT's random permutation, AWM's stratified draw).
"""

from __future__ import annotations

import torch

from ..cond import index_cond
from ..grpo.rollout import to_device
from ..jagg import fill_interior, plan_knots, split_windows
from .algorithm import Algorithm
from .rows import row_seed
from .runner import Minibatch, MinibatchRunner, micro_batches

__all__ = ["ForwardProcess", "noise_groups"]


def noise_groups(noise: str, K: int, window: int | None) -> list[list[int]]:
    """Which of K timestep positions share a noise draw: per_timestep | per_sample | per_window (windows of the
    window planner's `window`)."""
    if noise == "per_timestep":
        return [[k] for k in range(K)]
    if noise == "per_sample":
        return [list(range(K))]
    return split_windows(range(K), window)


class ForwardProcess(Algorithm):
    """The shared half of a forward-process unit: its runner, the K timestep positions' noise draws (`_noise`), the
    noising (`_noised`) and the frozen models' velocities (`_predict`). A subclass sets `noise_stream` and calls
    `_setup(K, noise, frozen_at_knots)` from its constructor."""

    noise_stream: int = -1  # rows.py row_seed stream of the unit's noise

    def __init__(self, cfg, policy, engine, dist):
        super().__init__(cfg, policy, engine, dist)
        if policy.guidance != 1.0:  # config_forward.py refuses it by key; a unit built by hand is held to it too
            raise ValueError(f"train.algorithm {self.name} samples and trains CFG-free: sampling.guidance must be 1")
        self.runner = MinibatchRunner(cfg, engine, dist)

    def _setup(self, K: int, noise: str, frozen_at_knots: bool) -> None:
        planner = self.runner.planner
        self.K = K
        groups = noise_groups(noise, K, planner.window if noise == "per_window" else None)
        self.draw_of = torch.tensor([i for i, g in enumerate(groups) for _ in g])
        # the plan the frozen models' values are filled by (config.py allows it only for a plan known before the
        # rollout)
        self.frozen_plan = planner.fixed_plan(K) if frozen_at_knots else None

    def _noise(self, step: int, epoch: int, global_rows: torch.Tensor, shape) -> torch.Tensor:
        """[K, B, ...] N(0, 1) per row of inner epoch `epoch` from the row's own seeded stream: one draw per group of
        timesteps (noise_groups), repeated over the group's positions."""
        draws = int(self.draw_of[-1]) + 1
        out = []
        for r in global_rows.tolist():
            g = torch.Generator().manual_seed(row_seed(self.cfg.run.seed, step, self.noise_stream, r, epoch))
            out.append(torch.randn(draws, *shape, generator=g)[self.draw_of])
        return torch.stack(out, dim=1)

    @staticmethod
    def _noised(clean: torch.Tensor, t: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """[K, B, ...] x_t = (1 - t) d + t e for clean [B, ...], t [K, B], e [K, B, ...]."""
        tb = t.reshape(*t.shape, *([1] * (clean.ndim - 1)))
        return (1 - tb) * clean + tb * e

    @torch.no_grad()
    def _predict(self, fn, x: torch.Tensor, t: torch.Tensor, cond) -> torch.Tensor:
        """fn at every (x_t, t) of [K, B, ...], or at the knots of self.frozen_plan and filled in between: one
        timestep of train.micro_batch_size rows per forward (the rows of a with-grad pass at most: the memory
        estimate's unit)."""
        out = torch.empty_like(x)
        positions = range(x.shape[0]) if self.frozen_plan is None else plan_knots(self.frozen_plan)
        for rows in micro_batches(x.shape[1], self.cfg.train.micro_batch_size):
            sub = index_cond(cond, rows)
            for k in positions:
                out[k, rows] = fn(x[k, rows], t[k, rows], sub).float()
        return out if self.frozen_plan is None else fill_interior(self.frozen_plan, out, t)

    def _inputs(self, traj, local, step: int, epoch: int, global_rows, t_host: torch.Tensor):
        """(clean d [B, ...] float32, t [K, B], e [K, B, ...], x_t [K, B, ...]) on the device for this rank's rows
        `local` (global `global_rows`) given their timesteps t_host [K, B] (host)."""
        device = self.dist.device
        clean = traj.final[local].float()
        t = to_device(t_host, device)
        e = to_device(self._noise(step, epoch, global_rows, clean.shape[1:]), device)
        return clean, t, e, self._noised(clean, t, e)

    def _reference(self, noised: torch.Tensor, t: torch.Tensor, cond):
        """The KL reference's velocities at the training inputs (as _predict), or None where no reference runs."""
        fn = self.policy.reference_fn()
        return self._predict(fn, noised, t, cond) if fn is not None else None

    def _train(self, cond, adv, rows, step: int, make_batch, make_loss, cached):
        """The update's minibatches through the runner (its result returned): per minibatch the unit's batch,
        make_batch(conditioning, local rows on the device, their global rows, the minibatch's global rows, inner
        epoch), and loss, make_loss(denominator) (the minibatch's valid rows per rank), trained at the K timestep
        positions with cached(batch) as knot_backward's cached velocities; jagg.intermediate auto is interpolate."""
        device = self.dist.device
        self._mask = to_device(adv.mask[rows.mine], device)
        intermediate = {"auto": "interpolate"}.get(self.cfg.jagg.intermediate, self.cfg.jagg.intermediate)
        positions = list(range(self.K))

        def minibatch(epoch: int, local: torch.Tensor, global_rows: torch.Tensor, on_policy: bool) -> Minibatch:
            mb_cond = index_cond(cond, local)  # a host index (cond.py)
            batch = make_batch(mb_cond, to_device(local, device), rows.mine[local], global_rows, epoch)
            loss = make_loss(float(adv.mask[global_rows].sum()) / rows.world_size)
            return Minibatch(batch=batch, cond=mb_cond, loss=loss, positions=positions,
                             inputs=lambda b: (b.noised, b.t, cached(b)), intermediate=intermediate,
                             plan_sigmas=batch.t.mean(1))

        return self.runner.run(self.policy.model_fn(), rows, step, minibatch)
