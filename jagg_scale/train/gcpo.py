"""GCPO, chunk-level GRPO (arXiv 2510.21583; xingzhejun/GCPO ea6cc4d), as an algorithm unit (train.algorithm gcpo;
the contract in algorithm.py): `GCPO(cfg, policy, engine, dist)`, GRPO's rollout and minibatch machinery with a chunk
loss.

    rollout_spec(step)   the SDE on every step, the candidates (the first sampling.num_steps - 1 steps, cut into the
                         gcpo section's chunks) kept, no KL reference (GCPO's recipes train without one)
    advantages           the group-relative advantages (algorithm.py)
    update(...)          inner epochs x minibatches through the runner (runner.py); per minibatch each row draws its
                         own int(chunks x gcpo.chunk_fraction) chunks (gcpo/chunks.py, seeded per row, step and inner
                         epoch), the batch is laid out in chunk slots of P = the longest chunk's steps, every chunk's
                         factor f_c = dL_c / d(mean log p) is computed once (GCPOStepLoss.prepared) and the loss is
                         the per-step terms f_c / n_c log p_k(v_k) (gcpo/loss.py) through knot_backward: the per-step
                         plan is GCPO's gradient exactly, one JAGG window per slot (jagg.window = P) a joint pass per
                         chunk

The factors need every chunk step's log-probability at the current weights before the first backward. While no
optimizer step has moved the weights (a step's first minibatch) they come from the rollout's own velocities, at no
cost: exact. After one, every trained position gets one fresh no-grad forward of its rows (and, under CFG, one of the
unconditional branch), before the minibatch is planned; the batch's velocities are then the current weights', so the
JAGG windows' interior values (jagg.intermediate, `cached` on that batch) are exact as well: the only approximation
left is the window's Jacobian interpolation. The first minibatch's log-ratio (the knots' fresh forwards against the
rollout) is the on-policy invariant's value, as in GRPO.
"""

from __future__ import annotations

import dataclasses

import torch

from ..cond import index_cond
from ..gcpo import ChunkBatch, GCPOStepLoss, trained_chunks
from ..gcpo.chunks import draw_chunks, slot_layout
from ..grpo.loss import StepBatch
from ..grpo.rollout import to_device
from ..grpo.steps import positioned
from .algorithm import RolloutSpec
from .runner import micro_batches
from .update import GRPO, step_minibatch

__all__ = ["GCPO"]


class GCPO(GRPO):
    """Chunk-level GRPO (module docstring)."""

    name = "gcpo"

    def __init__(self, cfg, policy, engine, dist):
        super().__init__(cfg, policy, engine, dist)
        self.sizes = cfg.gcpo.layout(cfg.sampling.num_steps)
        self.n_train = trained_chunks(len(self.sizes), cfg.gcpo.chunk_fraction)
        self.steps = list(range(sum(self.sizes)))  # the candidates every chunk is cut from

    def trained_steps_at(self, step: int) -> list[int]:
        return self.steps

    def rollout_spec(self, step: int) -> RolloutSpec:
        """The SDE on every step, the candidates kept; no reference (gcpo has no KL term: config.py)."""
        return RolloutSpec(trained=tuple(self.steps), ref_steps=frozenset())

    def _minibatches(self, traj, cond, uncond, adv, rows, step: int, steps: list[int], guidance: float):
        """The runner's minibatch(epoch, local, global_rows, on_policy): this rank's rows `local` of the trajectory
        laid out over each row's drawn chunks, their factors computed (module docstring)."""
        cfg, device = self.cfg, self.dist.device
        adv_values, adv_mask = to_device(adv.values[rows.mine], device), to_device(adv.mask[rows.mine], device)

        def minibatch(epoch: int, local: torch.Tensor, global_rows: torch.Tensor, on_policy: bool):
            loss = GCPOStepLoss(noise_level=cfg.sampling.noise_level, clip_range=cfg.grpo.clip_range,
                                scale=1.0 / self.n_train,
                                denominator=float(adv.mask[global_rows].sum()) / rows.world_size,
                                guidance=guidance, guidance_rule=self.policy.guidance_rule, sde=cfg.sampling.sde)
            drawn = draw_chunks(len(self.sizes), self.n_train, cfg.run.seed, step, rows.mine[local], epoch)
            layout, real = slot_layout(self.sizes, drawn)
            batch, positions = positioned(traj.step_batch(to_device(local, device), adv_values, adv_mask), layout)
            batch = ChunkBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(StepBatch)},
                               real=to_device(real.repeat_interleave(2, 0), device), slots=self.n_train)
            mb_cond = index_cond(cond, local)
            if not on_policy:  # the rollout's velocities are stale: the current weights' at every position
                batch = self._current(batch, positions, mb_cond, None if uncond is None else index_cond(uncond, local))
            mb = step_minibatch(loss.prepared(batch), mb_cond, loss, positions, intermediate="cached",
                                on_policy=on_policy)
            passes = 0 if on_policy else len(positions) * (1 + (uncond is not None))
            return dataclasses.replace(mb, nograd_forward_passes=passes)

        return minibatch

    @torch.no_grad()
    def _current(self, batch: ChunkBatch, positions: list[int], cond, uncond) -> ChunkBatch:
        """The batch's velocities (and CFG's unconditional ones) at the current weights: one no-grad forward per
        position, train.micro_batch_size rows at a time (the rows of a with-grad pass at most)."""
        fn = self.policy.model_fn()
        velocities = batch.velocities.clone()
        unc = None if uncond is None else batch.uncond_velocities.clone()
        for rows in micro_batches(batch.latents.shape[1], self.cfg.train.micro_batch_size):
            c = index_cond(cond, rows)
            u = None if uncond is None else index_cond(uncond, rows)
            for k in positions:
                x, s = batch.latents[k, rows], batch.sigmas[k, rows]
                velocities[k, rows] = fn(x, s, c).float()
                if unc is not None:
                    unc[k, rows] = fn(x, s, u).float()
        return dataclasses.replace(batch, velocities=velocities, uncond_velocities=unc)
