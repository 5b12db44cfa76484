"""The trainer pool's side of the pools: the start message, the weights after every update, each step's rollout
received and checked, and the policy versions a checkpoint must hold.

Policy version v is the weights after v training steps. Step s trains on a rollout sampled with version
max(0, s - k) (k = pools.max_staleness), exactly: the rollout pool may run k steps ahead, never more, and which weights
sampled which step is a function of the step, so a resumed run samples what the uninterrupted one did. For that a
checkpoint at step s holds, beside the live weights (version s), the k versions before it that the next k rollouts
sample with (pool_weights.safetensors, written by trainer 0).

Every sync is checked on both sides, by parameter name: the rollout rank binds every trainable parameter (none
missing, none unknown) and reads each back against the sender's digest (rollout_pool.bind); the rollout message then
carries the version it sampled with and the combined digest of what it bound, which every trainer checks against
what trainer 0 sent. At k = 0 the on-policy invariant (train/invariants.py) checks the sync once more: the trainer's
forward must reproduce the rollout replica's log-probs."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..checkpoint.local import write_tensors
from .bridge import PoolError
from .messages import combined, prompts_digest, unpack_rollout, weight_digests, weight_parts
from .replica import compute_dtypes

log = logging.getLogger(__name__)

__all__ = ["HISTORY_FILE", "TrainerLink", "refuse_start"]

HISTORY_FILE = "pool_weights.safetensors"


def refuse_start(dist, err: BaseException) -> None:
    """The trainer pool did not start: trainer 0 tells the rollout ranks why (best effort), so that they stop with
    its line instead of waiting for a start that never comes."""
    member = getattr(dist, "pool", None)
    if member is None or not dist.is_main:
        return
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    try:
        for r in member.layout.rollout_ranks():
            member.bridge.send(r, "start", {"ok": False, "error": line})
        member.bridge.flush()
    except PoolError:
        pass


class TrainerLink:
    """Every trainer rank holds one (module docstring); trainer 0 does the sending."""

    def __init__(self, cfg, dist, engine):
        self.cfg, self.dist, self.engine = cfg, dist, engine
        self.member = dist.pool
        self.bridge, self.layout = self.member.bridge, self.member.layout
        self.k, self.steps = cfg.pools.max_staleness, cfg.train.steps
        self.src = self.layout.rollout_of(dist.rank)
        self._dtypes: dict[str, torch.dtype] | None = None  # _live's
        self.history: dict[int, dict[str, torch.Tensor]] = {}  # trainer 0: the versions a checkpoint holds
        self.sent: dict[int, str] = {}  # every trainer: version -> the combined digest trainer 0 sent

    def version_for(self, step: int) -> int:
        return max(0, step - self.k)

    def _needed(self, version: int, start: int) -> bool:
        """Whether a rollout of a step in [start, train.steps) samples with `version`."""
        return any(self.version_for(s) == version for s in range(start, self.steps))

    # ------------------------------------------------------------------ start, weights
    def start(self, start_step: int, source) -> None:
        """Trainer 0 sends the start (the step, the prompt source's position) and the weights the first rollouts
        sample with: the checkpoint's earlier versions and the live ones (collective over the trainer pool)."""
        if self.dist.is_main:
            for r in self.layout.rollout_ranks():
                self.bridge.send(r, "start", {"ok": True, "start_step": start_step, "source": source.state_dict()})
        live = self._live()
        if self.k and self.dist.is_main:
            self.history[start_step] = live
        for v in sorted({self.version_for(s) for s in range(start_step, self.steps)}):
            if v <= start_step:
                self._send(v, live if v == start_step else self.history.get(v))

    def after_update(self, step: int) -> None:
        """The weights after training step `step` (version step + 1): kept for a checkpoint while a later rollout
        samples with them, sent when one does (collective over the trainer pool when either)."""
        v = step + 1
        if not (self.k or self._needed(v, step + 1)):
            return
        live = self._live()
        if self.k and self.dist.is_main:
            self.history[v] = live
            self.history = {u: w for u, w in self.history.items() if u >= v - self.k}
        if self._needed(v, step + 1):
            self._send(v, live)

    def _live(self) -> dict[str, torch.Tensor]:
        """The trainable weights as full host tensors on trainer 0 (gathered from the shards: collective), copies in
        the dtypes the replica computes with."""
        if self._dtypes is None:  # each parameter sent in the dtype the replica computes with (replica.py)
            module = getattr(self.engine, "module", None) or self.engine.model  # DeepSpeed's engine wraps the module
            self._dtypes = compute_dtypes(module, self.cfg.parallel.engine, getattr(torch, self.cfg.model.dtype))
        return {n: t.detach().to("cpu", self._dtypes[n], copy=True) for n, t in self.engine.full_state_dict().items()}

    def _send(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        """Trainer 0 sends `version` to every rollout rank; every trainer learns its digest (or that trainer 0 does
        not hold it, and stops with the others: one broadcast either way)."""
        digest = None
        if self.dist.is_main:
            if state is None:  # a checkpoint without the version: said on every trainer, not on rank 0 alone
                digest = {"missing": sorted(self.history)}
            else:
                digests = weight_digests(state)
                digest = combined(digests)
                parts = weight_parts(state)
                for i, names in enumerate(parts):  # each part packed once, sent to every rollout rank
                    meta = {"version": version, "part": i, "parts": len(parts),
                            "digests": {n: digests[n] for n in names}}
                    self.bridge.send(self.layout.rollout_ranks(), "weights", meta, {n: state[n] for n in names})
        digest = self.dist.broadcast_object(digest)
        if isinstance(digest, dict):
            raise PoolError(f"pools: policy version {version} is not in the checkpoint resumed (its {HISTORY_FILE} "
                            f"holds versions {digest['missing']}): cannot sample its rollouts; stopping")
        self.sent[version] = digest

    # ------------------------------------------------------------------ a step's rollout
    def receive(self, step: int, prompts: list[str], rewards: list[str]) -> tuple:
        """This trainer's rows of step `step`'s rollout: (trajectories, every row's reward components, meta), checked:
        the step, the policy version it was sampled with, the digest of the weights bound for it, the rows' prompts."""
        meta, tensors = self.bridge.recv(self.src, "rollout")
        want = self.version_for(step)
        where = f"pools: trainer {self.dist.rank}, step {step}: the rollout from rank {self.src}"
        if meta.get("step") != step or meta.get("version") != want:
            raise PoolError(f"{where} is of step {meta.get('step')} sampled with policy version {meta.get('version')}"
                            f", expected step {step} with version {want} (pools.max_staleness={self.k}); stopping")
        if meta.get("bound") != self.sent.get(want):
            raise PoolError(f"{where} was sampled with weights whose digest {meta.get('bound')} is not that of "
                            f"version {want} as sent ({self.sent.get(want)}): the sync bound other weights; stopping")
        if meta.get("prompts") != prompts_digest(prompts):
            raise PoolError(f"{where} holds other prompts than this step's rows (the pools' prompt sources "
                            "diverged); stopping")
        traj, parts = unpack_rollout(tensors, int(meta["first"]), rewards, self.dist.device)
        return traj, parts, meta

    # ------------------------------------------------------------------ checkpoint part
    def save_into(self, tmp: Path, next_step: int) -> list[Path]:
        """Trainer 0 writes the versions the rollouts after `next_step` sample with, other than the live one."""
        keep = [v for v in sorted(self.history) if self.version_for(next_step) <= v < next_step]
        if not (self.k and self.dist.is_main and keep):
            return []
        flat = {f"v{v}/{name}": t for v in keep for name, t in self.history[v].items()}
        return [write_tensors(tmp / HISTORY_FILE, flat)]

    def load_from(self, path: Path) -> None:
        """Trainer 0 reads a checkpoint's earlier versions (data only: safetensors)."""
        if not (self.k and self.dist.is_main and (path / HISTORY_FILE).is_file()):
            return
        from safetensors.torch import load_file

        self.history = {}
        for key, t in load_file(path / HISTORY_FILE).items():
            v, _, name = key.partition("/")
            if not (v.startswith("v") and v[1:].isdigit() and name):
                raise PoolError(f"pools: {path / HISTORY_FILE} holds an entry {key!r} that names no policy version")
            self.history.setdefault(int(v[1:]), {})[name] = t
