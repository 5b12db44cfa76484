"""What travels between the pools, as a bridge message's (meta, tensors): a step's rollout for one trainer, and the
adapter weights of one policy version, each with the digests both sides check."""

from __future__ import annotations

import hashlib
from dataclasses import fields

import torch

from ..grpo.rollout import Trajectories
from ..rewards.multi import ComponentScores
from .bridge import PoolError, digest

__all__ = ["WEIGHT_PART_BYTES", "combined", "pack_rollout", "prompts_digest", "unpack_rollout", "weight_digests",
           "weight_parts"]

# A policy version travels in parts of at most this many bytes (a larger tensor alone in its part): the rollout rank's
# device holds one part beside the replica instead of a whole version (a full fine-tune of Qwen-Image: 38 GiB in
# bf16), and trainer 0's device one part in flight to every rollout rank. 1 GiB keeps NCCL at full bandwidth.
WEIGHT_PART_BYTES = 1 << 30

_TRAJ_TENSORS = [f.name for f in fields(Trajectories) if f.name != "first"]


def weight_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{parameter name: digest} of a weight set."""
    return {name: digest(t) for name, t in sorted(state.items())}


def weight_parts(state: dict[str, torch.Tensor], part_bytes: int | None = None) -> list[list[str]]:
    """The names of a weight set in sending order (by name), cut into parts of at most `part_bytes` (None:
    WEIGHT_PART_BYTES)."""
    part_bytes = part_bytes or WEIGHT_PART_BYTES
    parts: list[list[str]] = [[]]
    size = 0
    for name in sorted(state):
        n = state[name].numel() * state[name].element_size()
        if parts[-1] and size + n > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += n
    return parts


def combined(digests: dict[str, str]) -> str:
    """One digest of a {name: digest} set: names and contents, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()


def prompts_digest(prompts: list[str]) -> str:
    """A step's rows' prompts, in row order: the pools check they sample and train the same rows."""
    h = hashlib.blake2b(digest_size=16)
    for p in prompts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def pack_rollout(traj: Trajectories, parts: dict[str, ComponentScores]) -> dict[str, torch.Tensor | None]:
    """A trainer's rows of the step's trajectories and every row's reward components, as named tensors."""
    out = {f"traj.{name}": getattr(traj, name) for name in _TRAJ_TENSORS}
    for name, p in parts.items():
        out[f"reward.{name}.scores"] = p.scores
        out[f"reward.{name}.valid"] = p.valid
    return out


def unpack_rollout(tensors: dict[str, torch.Tensor], first: int, rewards: list[str], device: torch.device
                   ) -> tuple[Trajectories, dict[str, ComponentScores]]:
    """pack_rollout's inverse: the trajectories on `device`, the reward components (float64 scores, bool valid)
    on the host; PoolError naming what is missing."""
    missing = [k for k in ("traj.latents", "traj.velocities", "traj.log_probs", "traj.sigmas") if k not in tensors]
    missing += [f"reward.{n}.{part}" for n in rewards for part in ("scores", "valid")
                if f"reward.{n}.{part}" not in tensors]
    if missing:
        raise PoolError(f"pools: a rollout message lacks {', '.join(missing)}")
    traj = Trajectories(first=first, **{name: (tensors[f"traj.{name}"].to(device) if f"traj.{name}" in tensors
                                               else None) for name in _TRAJ_TENSORS})
    parts = {n: ComponentScores(tensors[f"reward.{n}.scores"].cpu().double(),
                                tensors[f"reward.{n}.valid"].cpu().bool()) for n in rewards}
    return traj, parts
