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
cost: exact. After one, every real chunk step of every row gets one fresh no-grad forward (and, under CFG, one of the
unconditional branch; the (position, row) pairs packed into calls of train.micro_batch_size rows, the pads skipped),
before the minibatch is planned; the batch's velocities are then the current weights', so the
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
from ..grpo.guidance import Guidance
from ..grpo.loss import StepBatch
from ..grpo.rollout import to_device
from ..grpo.steps import positioned
from .algorithm import RolloutSpec
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

    def _minibatches(self, traj, cond, uncond, adv, rows, step: int, steps: list[int], guidance: Guidance):
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
            layout, real = slot_layout(self.sizes, drawn)  # host tensors [n P, B]
            batch, positions = positioned(traj.step_batch(local, adv_values, adv_mask), traj.positions(layout))
            batch = ChunkBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(StepBatch)},
                               real=to_device(real.repeat_interleave(2, 0), device), slots=self.n_train)
            mb_cond = index_cond(cond, local)
            passes = 0
            if not on_policy:  # the rollout's velocities are stale: the current weights' at every real step
                batch = self._current(batch, positions, real, mb_cond,
                                      None if uncond is None else index_cond(uncond, local))
                passes = -(-int(real.sum()) // real.shape[1]) * (1 + (uncond is not None))  # in B-row passes
            mb = step_minibatch(loss.prepared(batch), mb_cond, loss, positions, intermediate="cached",
                                on_policy=on_policy)
            return dataclasses.replace(mb, nograd_forward_passes=passes)

        return minibatch

    def _agreed(self, calls: int) -> int:
        """The most forward calls any rank needs: every rank makes that many (a sharded model's gathers must
        match)."""
        if not self.dist.active:
            return calls
        t = torch.tensor([[float(calls)]], dtype=torch.float64, device=self.dist.device)
        with self.engine.comm.phase("control"):  # bookkeeping, as the runner's plan statistics
            return int(self.dist.all_gather_tensor(t).max())

    @torch.no_grad()
    def _current(self, batch: ChunkBatch, positions: list[int], real: torch.Tensor, cond, uncond) -> ChunkBatch:
        """The batch's velocities (and CFG's unconditional ones) at the current weights at every real step (a pad's
        term weighs 0: its value is not read): the (position, row) pairs packed into calls of at most
        train.micro_batch_size rows (the rows of a with-grad pass at most), as many calls on every rank."""
        B = batch.latents.shape[1]
        q, b = real.nonzero(as_tuple=True)  # host: [K, B] of the slot layout
        m = self.cfg.train.micro_batch_size or B
        calls = self._agreed(-(-len(q) // m))
        per_call = -(-len(q) // calls)
        fn = self.policy.model_fn()
        velocities = batch.velocities.clone()
        unc = None if uncond is None else batch.uncond_velocities.clone()
        k_of = torch.tensor(positions)[q]
        for i in range(calls):
            part = slice(i * per_call, (i + 1) * per_call)
            ks, rows = (k_of[part], b[part]) if len(b[part]) else (k_of[:1], b[:1])  # a rank with fewer: a dummy
            kd, rd = ks.to(batch.latents.device), rows.to(batch.latents.device)
            x, s = batch.latents[kd, rd], batch.sigmas[kd, rd]
            v = fn(x, s, index_cond(cond, rows))
            u = None if unc is None else fn(x, s, index_cond(uncond, rows))
            if len(b[part]):  # in the rollout's storage dtype, the model's own (lossless: v is its output)
                velocities[kd, rd] = v.to(velocities.dtype)
                if unc is not None:
                    unc[kd, rd] = u.to(unc.dtype)
        return dataclasses.replace(batch, velocities=velocities, uncond_velocities=unc)
