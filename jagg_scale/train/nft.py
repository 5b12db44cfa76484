"""DiffusionNFT as an algorithm unit (train.algorithm nft; the contract in algorithm.py): `NFT(...)`.

The rollout is the old policy's (the engine's shadow weights "old", which the RolloutSpec swaps in), a deterministic
ODE with sampling.ode_solver, CFG-free, keeping only each row's final latents: the clean latents d and the group
advantages are all training reads. Then, per
minibatch (rows.py) and per sample, K = int(num_steps x grpo.timestep_fraction) training timesteps drawn from the
sampling schedule's (a random permutation per sample, its first K, as DiffusionNFT: nft.timesteps per_row; or one
draw for the whole minibatch: per_batch), sorted from high noise to low, drawn afresh with the noise every inner epoch
(grpo.inner_epochs; DiffusionNFT scripts/train_nft_sd3.py:806-812, 868):

    x_t = (1 - t) d + t e       e fresh per timestep, one per sample, or one per JAGG window (nft.noise)
    v_old, v_ref                the old policy's and the reference's velocities there (no grad); with nft.old_at
                                knots at the plan's knots only, linear in t inside each window (fill_interior)
    gradient                    of sum_k L_k / K (nft/loss.py) through knot_backward, the planner's knot plan over the
                                sample's K timesteps: mode exact is DiffusionNFT's one backward per timestep; the
                                window planner's JAGG windows take one joint pass over each window's two endpoints
                                (JAGG-NFT). The interior timesteps' velocity values (jagg.intermediate): cached = the
                                old policy's, interpolate (auto) = the old policy's moved by the endpoints' drift,
                                forward = fresh no-grad forwards
    step                        engine.step(), one optimizer step per minibatch (the minibatch loop, micro-batches,
                                probe and non-finite policy are the runner's: runner.py)

and after the rollout's last minibatch the old policy moves towards the trained one: old = decay old + (1 - decay)
trained, decay = min(max(0, (optimizer steps - flat) x rate), max) (nft.old_decay; DiffusionNFT's return_decay).
The optimality r each sample's loss weighs its positive and negative terms by comes from its group advantage through
nft.adv_mode (nft/loss.py optimality). Every draw is seeded by (run.seed, step, inner epoch, global row), so N ranks
draw what one process does and a resumed run what the uninterrupted one drew; the old policy is checkpointed with the
engine's state.
"""

from __future__ import annotations

import torch

from ..grpo.rollout import to_device
from ..jagg import trained_steps
from ..nft import NFTBatch, NFTStepLoss, optimality
from .algorithm import RolloutSpec
from .forward_process import ForwardProcess
from .rows import row_seed

__all__ = ["NFT", "old_decay"]

NOISE_STREAM, TIMESTEP_STREAM = 5, 6  # row_seed streams (rows.py uses 0-3)


def old_decay(optimizer_steps: int, schedule) -> float:
    """DiffusionNFT's return_decay: 0 before `flat` optimizer steps, then rising by `rate` per step up to `max`."""
    flat, rate, top = schedule
    return 0.0 if optimizer_steps < flat else min((optimizer_steps - flat) * rate, top)


class NFT(ForwardProcess):
    """DiffusionNFT as an algorithm unit (the contract in algorithm.py): its rollout is the old policy's ODE and keeps
    only the final latents; its advantages are the group-relative ones; its update trains through the runner. The
    noise draws and the frozen models' velocities are the forward-process base's (forward_process.py)."""

    name = "nft"
    noise_stream = NOISE_STREAM

    def __init__(self, cfg, policy, engine, dist):
        super().__init__(cfg, policy, engine, dist)
        # the old policy: the starting weights, held like the trained ones (shards, partitions), checkpointed
        engine.add_shadow("old")
        self.sigmas = policy.host_sigmas[: cfg.sampling.num_steps]  # the sampling schedule's noise levels
        # which draw each timestep position takes (nft.noise), the frozen models at the knots (nft.old_at knots)
        self._setup(len(trained_steps(cfg.sampling.num_steps, cfg.grpo.timestep_fraction)), cfg.nft.noise,
                    cfg.nft.old_at == "knots")

    def rollout_spec(self, step: int) -> RolloutSpec:
        """The old policy's ODE on every step (no SDE step, no reference), keeping only the final latents: the
        clean samples d are all the update reads of the rollout."""
        return RolloutSpec(sde_steps=frozenset(), ref_steps=frozenset(), keep="final",
                           weights=lambda: self.engine.shadow_weights("old"))

    # ------------------------------------------------------------------ the training inputs of a minibatch
    def _timesteps(self, step: int, epoch: int, global_rows: torch.Tensor, minibatch: torch.Tensor) -> torch.Tensor:
        """[K, B] the K training timesteps of inner epoch `epoch` of each of `global_rows` (the sampling schedule's
        at a random permutation's first K), sorted from high noise to low; per_batch: the draw of the whole
        minibatch's first row (`minibatch`: its global rows, every rank's) for every row, on every rank."""
        nft = self.cfg.nft
        draws = []
        for r in (minibatch[:1] if nft.timesteps == "per_batch" else global_rows).tolist():
            g = torch.Generator().manual_seed(row_seed(self.cfg.run.seed, step, TIMESTEP_STREAM, r, epoch))
            picked = torch.randperm(len(self.sigmas), generator=g)[: self.K]
            draws.append(torch.tensor(sorted((self.sigmas[i] for i in picked.tolist()), reverse=True)))
        t = torch.stack(draws, dim=1)  # [K, B or 1]
        return t.expand(self.K, len(global_rows)).contiguous()

    def _batch(self, traj, mb_cond, r, local, global_rows, minibatch, step: int, epoch: int) -> NFTBatch:
        """The training inputs in inner epoch `epoch` of this rank's rows `local` (global `global_rows`) of the
        minibatch whose global rows are `minibatch`; `mb_cond` is their conditioning."""
        clean, t, _, noised = self._inputs(traj, local, step, epoch, global_rows,
                                           self._timesteps(step, epoch, global_rows, minibatch))
        with self.engine.shadow_weights("old"):
            old = self._predict(self.policy.model_fn(), noised, t, mb_cond)
        return NFTBatch(clean=clean, t=t, noised=noised, old=old, optimality=r[local], mask=self._mask[local],
                        ref=self._reference(noised, t, mb_cond))

    # ------------------------------------------------------------------ the phase
    def update(self, traj, cond, adv, rows, step: int) -> dict:
        cfg, nft = self.cfg, self.cfg.nft
        r = to_device(optimality(adv.values[rows.mine], cfg.grpo.adv_clip_max, nft.adv_mode), self.dist.device)
        done = self._train(
            cond, adv, rows, step,
            lambda mb_cond, local, global_rows, minibatch, epoch: self._batch(traj, mb_cond, r, local, global_rows,
                                                                              minibatch, step, epoch),
            lambda denominator: NFTStepLoss(beta=nft.mix, kl_beta=nft.kl_beta, adv_clip_max=cfg.grpo.adv_clip_max,
                                            scale=1.0 / self.K, denominator=denominator),
            lambda b: b.old)
        # the old policy moves towards the trained one once per rollout, as DiffusionNFT's epoch end does; the count
        # of optimizer steps so far is a function of the step (the same minibatches every step): resume-exact
        decay = old_decay((step + 1) * done.optimizer_steps, nft.old_decay)
        self.engine.lerp_shadow("old", decay)
        return done.metrics(old_decay=decay, **done.probe)
