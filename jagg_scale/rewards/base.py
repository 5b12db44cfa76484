"""Reward interface, name registry and the fault-tolerant scoring wrapper.

Rewards are looked up by name from the config, so a typo or a stale option must fail loudly at build
time (listing what *is* available) rather than mid-run. At scoring time the opposite holds: one bad image
(or a flaky external scorer) must not kill a multi-hour run, but a reward that is broken for most of a
batch must not pass silently either. `score_safely` draws that line with an explicit `max_fail_frac`.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "Reward",
    "RewardOutput",
    "UnknownRewardError",
    "register",
    "build_reward",
    "check_reward",
    "available",
    "score_safely",
    "resolve_device",
    "cancelled",
    "cancellable",
    "cancel_event",
]

_SCORING = threading.local()  # the cancel event of the scoring running in this thread (rewards/multi.py)


def cancelled() -> bool:
    """Whether the scoring running in this thread has been given up on (its chunk is past reward.deadline_s): a
    reward that waits on others (remote, vlm_judge) stops before its next request instead of retrying on."""
    event = getattr(_SCORING, "event", None)
    return event is not None and event.is_set()


@contextmanager
def cancellable(event: threading.Event | None):
    """Score inside: `event` set (by ChunkScorer.finish, from another thread) makes cancelled() true here. A reward
    that fans out to threads of its own passes cancel_event() on to them (vlm_judge)."""
    before, _SCORING.event = getattr(_SCORING, "event", None), event
    try:
        yield
    finally:
        _SCORING.event = before


def cancel_event() -> threading.Event | None:
    """The cancel event of the scoring running in this thread (None outside one)."""
    return getattr(_SCORING, "event", None)


@dataclass
class RewardOutput:
    """What a reward returns for a batch.

    `scores` is float32 [B]; a sample the reward could not score is NaN (it is masked out by
    `score_safely`, not silently given some default). `info` carries scalar or per-sample diagnostics
    for logging, e.g. {"jpeg_kb_mean": 41.2}.
    """

    scores: torch.Tensor
    info: dict[str, float | list] = field(default_factory=dict)


class Reward:
    """Abstract reward: images float [B, 3, H, W] in [0, 1] + prompts + per-prompt metadata -> scores [B].

    Subclasses set `name` (done by `@register`) and implement `__call__`. Keyword-only constructor options
    are what `build_reward(name, **kwargs)` accepts.

    `on_latents = True`: a latent reward (a reward model over the diffusion model's latents, DiNa-LRM-style): its
    first argument is the rollout's final latents [B, C, h, w] as the sampler leaves them, not decoded images, so a
    step whose rewards are all latent never runs the VAE decode (rewards/multi.py; the estimator drops the decode).
    """

    name: str = "reward"
    on_latents: bool = False
    # what it scores: images [B, 3, H, W], videos [B, 3, F, H, W] (rewards/video.py), or any (a remote judge's
    # server decides); jagg-reward-server answers a request of another kind 422, naming both
    inputs: str = "images"

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]
    ) -> RewardOutput:  # pragma: no cover - abstract
        raise NotImplementedError

    def image_features(self, images: torch.Tensor) -> torch.Tensor | None:
        """Float [B, D] features of the reward's own image backbone, or None when it has none. The evaluation's
        diversity compares images in this space (cosine distance; pixels when None): a reward model tells apart
        what it scores on."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# --------------------------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[Reward]] = {}
R = TypeVar("R", bound=type)


class UnknownRewardError(KeyError, ValueError):
    """Unknown reward name. Both a KeyError (lookup) and a ValueError (bad config value) so callers can
    catch either; `str()` is the plain message (KeyError would otherwise show it quoted)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def register(name: str) -> Callable[[R], R]:
    """Class decorator: make a Reward subclass buildable as `build_reward(name)`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def deco(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, Reward)):
            raise TypeError(f"@register({name!r}) expects a Reward subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"reward name {name!r} is already registered to {existing.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list[str]:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)


def _check_options(name: str, cls: type, kwargs: dict) -> None:
    """Raise a TypeError naming options the reward's constructor does not take, or required ones not given
    (before calling it, so the message is about the config rather than a Python signature)."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [
        p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"reward {name!r} got unknown option(s) {unknown}; accepted options: {sorted(accepted)}")
    required = sorted(p.name for p in params if p.name in accepted and p.default is inspect.Parameter.empty)
    missing = [n for n in required if n not in kwargs]
    if missing:
        raise TypeError(f"reward {name!r} needs option(s) {missing}; accepted options: {sorted(accepted)}")


def check_reward(name: str, options: dict) -> type[Reward]:
    """The registered class of reward `name`, after checking it takes `options` (nothing is built): the config
    runs this before any work. UnknownRewardError / TypeError as build_reward raises them."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise UnknownRewardError(f"unknown reward {name!r}; available rewards: {available()}")
    _check_options(name, cls, options)
    return cls


def build_reward(name: str, **kwargs) -> Reward:
    """Instantiate a registered reward by name with constructor options from the config."""
    cls = check_reward(name, kwargs)
    try:
        return cls(**kwargs)
    except TypeError as e:  # e.g. a missing required option: keep Python's detail, add the reward name
        raise TypeError(f"could not build reward {name!r} with options {sorted(kwargs)}: {e}") from e


# ------------------------------------------------------------------------------------------ device


def resolve_device(device: str | torch.device) -> torch.device:
    """A reward's `device` option: "auto" -> this process's current CUDA device with its index (`cuda:k`, the
    trainer's rank device, set by parallel.dist.init_distributed), else the CPU; anything else -> torch.device.

    Never a bare "cuda": that means "the calling thread's current device", which is cuda:0 in a worker thread
    (reward.background) whatever the rank's device, so a rank k > 0 would move its images to cuda:0 while its
    reward model sits on cuda:k."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


# ------------------------------------------------------------------------------------------ safe scoring


def score_safely(
    reward: Reward,
    images: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[dict],
    max_fail_frac: float,
    latents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Score a batch, turning reward failures into masked samples.

    Returns (scores float32 [B], valid bool [B], n_failed). A reward that raises fails every sample (the
    exception is logged with the reward's name); NaN/inf scores fail just those samples. Failed samples
    get score 0 and valid False so downstream code can mask them. If n_failed / B > max_fail_frac this
    raises RuntimeError: a mostly-broken reward must stop the run, not quietly train on nothing.
    Mismatched batch inputs are a caller bug and raise ValueError without being counted. `latents`: the batch's
    latents beside its images, for a RewardMix holding latent rewards (the evaluation's).
    """
    if not 0.0 <= max_fail_frac <= 1.0 or math.isnan(max_fail_frac):
        raise ValueError(f"max_fail_frac must be in [0, 1], got {max_fail_frac}")
    b = int(images.shape[0])
    if len(prompts) != b or len(metadata) != b:
        raise ValueError(f"batch mismatch: {b} images, {len(prompts)} prompts, {len(metadata)} metadata entries")
    name = getattr(reward, "name", type(reward).__name__)
    device = images.device

    try:
        out = reward(images, prompts, metadata) if latents is None else reward(images, prompts, metadata,
                                                                                 latents=latents)
        scores = out.scores if isinstance(out, RewardOutput) else out
        scores = torch.as_tensor(scores).detach().to(device=device, dtype=torch.float32).reshape(-1)
        if scores.numel() != b:
            raise ValueError(f"reward returned {scores.numel()} scores for a batch of {b}")
    except Exception:
        logger.exception("reward %r raised on a batch of %d; counting all samples as failed", name, b)
        scores = torch.zeros(b, dtype=torch.float32, device=device)
        valid = torch.zeros(b, dtype=torch.bool, device=device)
    else:
        valid = torch.isfinite(scores)
        scores = torch.where(valid, scores, torch.zeros_like(scores))

    n_failed = int(b - int(valid.sum()))
    if b > 0 and n_failed / b > max_fail_frac:
        raise RuntimeError(
            f"reward {name!r} failed on {n_failed}/{b} samples "
            f"({n_failed / b:.1%} > max_fail_frac={max_fail_frac:.1%})"
        )
    if n_failed:
        logger.warning("reward %r failed on %d/%d samples; they are masked out", name, n_failed, b)
    return scores, valid, n_failed
