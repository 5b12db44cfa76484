"""Several rewards at once, and scoring that overlaps the rollout.

`RewardMix` holds (name, weight, reward) components built from the config (`reward.components`, or the single
`reward.name`). It is itself a `Reward` (the weighted sum, what evaluation reports), and it scores every
component separately for training: the algorithm turns the components into advantages under reward.aggregate
(train/algorithm.py Algorithm.advantages). A sample whose reward failed in any component is masked out of the loss
(and counted per component).

`ChunkScorer` decodes and scores rollout chunks in a worker thread while the main thread samples the next chunk
(reward.background; a mix of latent rewards alone is scored on the latents, undecoded): rewards are per image, so
chunking changes nothing but the wall time. A sharded reward model runs collectives, which must stay in step across
ranks and off the training thread's collectives, so it is scored in the main thread.

On CUDA the worker runs on the trainer's device and on a stream of its own (`_Lane`): the current device is per
thread (a new thread's is cuda:0), and on the default stream the worker's kernels and device-to-host copies would
queue behind the rollout's, so nothing would overlap. The producer records an event after each chunk; the worker's
stream waits for it before reading the chunk, and the worker hands back CPU scores only once its stream is done.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .base import Reward, RewardOutput, build_reward, cancellable, score_safely

log = logging.getLogger(__name__)

__all__ = ["RewardMix", "ChunkScorer", "ComponentScores", "ScoringLane", "build_reward_mix", "check_failures",
           "gather_components", "reward_specs"]


@dataclass
class ComponentScores:
    scores: torch.Tensor  # [N], 0 where failed: float32 as scored, float64 once gathered
    valid: torch.Tensor  # bool [N]


class RewardMix(Reward):
    name = "mix"

    def __init__(self, components: Sequence[tuple[str, float, Reward]]):
        if not components:
            raise ValueError("RewardMix needs at least one reward")
        self.components = list(components)
        self.name = (self.components[0][0] if len(self.components) == 1
                     else "+".join(f"{w:g}*{n}" for n, w, _ in self.components))

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.components]

    @property
    def weights(self) -> dict[str, float]:
        return {n: w for n, w, _ in self.components}

    @property
    def needs_pixels(self) -> bool:
        """Whether any component scores decoded images (all latent rewards: the decode is skipped)."""
        return any(not r.on_latents for _, _, r in self.components)

    def score_components(self, images: torch.Tensor | None, prompts: Sequence[str], metadata: Sequence[dict],
                         latents: torch.Tensor | None = None) -> dict[str, ComponentScores]:
        """Each component through score_safely with no limit: the limit is checked once per batch, by the caller,
        over all ranks' samples (see check_failures). A latent reward gets `latents`, the others `images`."""
        out = {}
        for name, _, reward in self.components:
            x = latents if reward.on_latents else images
            if x is None:
                raise ValueError(f"reward {name!r} scores {'latents' if reward.on_latents else 'images'}, "
                                 "none were given")
            scores, valid, _ = score_safely(reward, x, prompts, metadata, max_fail_frac=1.0)
            out[name] = ComponentScores(scores, valid)
        return out

    def __call__(self, images, prompts, metadata, latents=None) -> RewardOutput:
        parts = self.score_components(images, prompts, metadata, latents=latents)
        total, valid = self.weighted_sum(parts)
        info = {f"{n}_mean": float(p.scores[p.valid].double().mean()) if p.valid.any() else float("nan")
                for n, p in parts.items()}
        return RewardOutput(scores=torch.where(valid, total, torch.full_like(total, float("nan"))), info=info)

    def image_features(self, images: torch.Tensor) -> torch.Tensor | None:
        """The first component's backbone features that has any (eval diversity), else None."""
        for _, _, reward in self.components:
            hook = getattr(reward, "image_features", None)
            feats = hook(images) if callable(hook) else None
            if feats is not None:
                return feats
        return None

    def weighted_sum(self, parts: dict[str, ComponentScores]) -> tuple[torch.Tensor, torch.Tensor]:
        """sum_c w_c r_c in float64 (float32 overflows for rewards on a 1e38 scale) and where all succeeded."""
        total = sum(self.weights[n] * p.scores.double() for n, p in parts.items())
        valid = torch.stack([p.valid for p in parts.values()]).all(0)
        return total, valid


def gather_components(local: dict[str, ComponentScores], layout: torch.Tensor, n: int,
                      all_gather: Callable[[torch.Tensor], torch.Tensor], owned: torch.Tensor | None = None
                      ) -> dict[str, ComponentScores]:
    """Every rank's scores in global row order. `all_gather(t)` concatenates the ranks' tensors in rank order,
    whose rows are the global rows `layout` (StepRows.all_rows) out of `n`. `owned`: which of this rank's rows it
    scored (a sequence-parallel group's ranks hold the same rows and split their scoring): each row is taken from
    the rank that scored it (None: every rank scored all of its rows). Gathered in float64: every sum and mean over
    the batch (metrics, advantages) is then float64, where a large-scale reward cannot overflow."""
    take = None if owned is None else all_gather(owned).cpu()
    at = layout if take is None else layout[take]
    out = {}
    for name, p in local.items():
        scores = torch.zeros(n, dtype=torch.float64)
        valid = torch.zeros(n, dtype=torch.bool)
        s, v = all_gather(p.scores.double()).cpu(), all_gather(p.valid).cpu()
        scores[at] = s if take is None else s[take]
        valid[at] = v if take is None else v[take]
        out[name] = ComponentScores(scores, valid)
    return out


def check_failures(parts: dict[str, ComponentScores], max_fail_frac: float) -> dict[str, int]:
    """Failed-sample counts per component; RuntimeError naming the reward when one exceeds max_fail_frac."""
    failed = {}
    for name, p in parts.items():
        n, bad = p.valid.numel(), int((~p.valid).sum())
        failed[name] = bad
        if n and bad / n > max_fail_frac:
            raise RuntimeError(f"reward {name!r} failed on {bad}/{n} samples ({bad / n:.1%} > "
                               f"reward.max_fail_frac={max_fail_frac:.1%}); see the log for the reward's errors")
    return failed


def reward_specs(reward_cfg) -> list[tuple[str, float, dict]]:
    """(name, weight, options) of each reward of the `reward` config section: `components` {name: {weight,
    **options}}, or the single name with its options."""
    if reward_cfg.components:
        return [(n, float((spec or {}).get("weight", 1.0)), {k: v for k, v in (spec or {}).items() if k != "weight"})
                for n, spec in reward_cfg.components.items()]
    return [(reward_cfg.name, 1.0, dict(reward_cfg.options or {}))]


def build_reward_mix(reward_cfg) -> RewardMix:
    """The rewards of the `reward` config section, built (reward_specs)."""
    return RewardMix([(name, weight, build_reward(name, **options))
                      for name, weight, options in reward_specs(reward_cfg)])


class _Lane:
    """Where the worker thread scores: on CUDA the trainer's device and a stream of its own, on the CPU as is."""

    def __init__(self, device: torch.device | None):
        cuda = device is not None and device.type == "cuda"
        # the index now, in the trainer's thread: a bare "cuda" means the calling thread's device
        self.index = (torch.cuda.current_device() if device.index is None else device.index) if cuda else None
        self.stream = None

    def bind(self) -> None:
        """The worker thread's initializer: torch.cuda.set_device is per thread, a new thread's device is cuda:0."""
        if self.index is not None:
            torch.cuda.set_device(self.index)
            self.stream = torch.cuda.Stream(self.index)

    def produced(self):
        """In the producer's thread right after a chunk: an event on its current stream, where the kernels that
        write the chunk may still be queued (None on the CPU)."""
        if self.index is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.index))
        return event

    @contextmanager
    def scoring(self, ready):
        """The worker's stream, once the chunk is ready. Memory: the worker holds the chunk's tensors until this
        exits, after its stream has finished, so the producer's stream can never get their memory back while the
        worker still reads it (the same holds for the scores the worker returns: copied to the host inside)."""
        if self.index is None:
            yield
            return
        try:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                yield
        finally:
            self.stream.synchronize()


class ScoringLane:
    """The reward's worker thread (and on CUDA its stream) for a whole run: every step's ChunkScorer scores on it, so
    the caching allocator's blocks stay with one stream instead of one per step. A chunk that will not end past its
    deadline (a reward blocked with no timeout of its own) is abandoned with its thread, and what was queued behind it
    (under pools: the next step's chunks) with it: later chunks get a new thread."""

    def __init__(self, device: torch.device | None):
        self.lane = _Lane(device)
        self.pool: ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> Future:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="reward", initializer=self.lane.bind)
        return self.pool.submit(fn, *args)

    def abandon(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=False)  # its running chunk keeps the old thread
            self.pool = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


STOP_POLL_S = 0.5  # how often a reward wait looks for this rank's preemption signal
GRACE_S = 30.0  # how long finish() waits for a late chunk already running once told to stop (remote: one request)


class ChunkScorer:
    """Decode + score chunks as they come, in the run's reward thread (or inline); `finish()` concatenates them.

    `device`: the trainer's device; on CUDA the worker thread scores there, on its own stream (module docstring).
    `lane`: the run's ScoringLane (one is made, and closed by finish, when none is given)."""

    def __init__(self, mix: RewardMix, decode: Callable[[torch.Tensor], torch.Tensor], background: bool,
                 device: torch.device | None = None, lane: ScoringLane | None = None):
        self.mix, self.decode = mix, decode
        self.own_scoring = background and lane is None  # closed by finish()
        self.scoring = (lane or ScoringLane(device)) if background else None  # None: scored inline, in add()
        self.lane = self.scoring.lane if background else _Lane(None)
        self.cancel = threading.Event()  # set by finish() for this scorer's late chunks (base.cancelled)
        self.pending: list[Future | dict] = []
        self.sizes: list[int] = []  # rows per chunk
        self.late = 0  # rows masked by finish()'s deadline

    def _score(self, latents, prompts, metadata, ready=None) -> dict[str, ComponentScores]:
        with torch.no_grad(), cancellable(self.cancel), self.lane.scoring(ready):
            images = self.decode(latents) if self.mix.needs_pixels else None  # latent rewards alone: no decode
            parts = self.mix.score_components(images, prompts, metadata, latents=latents)
            # on the host: the trainer reads them on its own stream, after this worker's stream is done
            return {n: ComponentScores(p.scores.cpu(), p.valid.cpu()) for n, p in parts.items()}

    def add(self, latents: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> None:
        self.sizes.append(len(prompts))
        if self.scoring is None:
            self.pending.append(self._score(latents, list(prompts), list(metadata)))
        else:
            ready = self.lane.produced()
            self.pending.append(self.scoring.submit(self._score, latents, list(prompts), list(metadata), ready))

    def finish(self, deadline_s: float | None = None, stop: Callable[[], bool] | None = None
               ) -> dict[str, ComponentScores]:
        """Every chunk's scores, waiting at most `deadline_s` seconds from now for the worker's: a chunk not scored
        by then is masked (valid False; its rows counted in `late`), so a hung reward host costs this step's late
        samples, not the job. Late chunks do not run on into the update: those not started are cancelled, the one
        running is told to stop (base.cancelled: remote and vlm_judge end before their next request) and awaited for
        at most GRACE_S; one that still runs is abandoned with its thread (ScoringLane.abandon). `stop()` true (this
        rank's preemption signal, polled every STOP_POLL_S) ends the wait as the deadline would: the trainer then
        abandons the step."""
        end = None if deadline_s is None else time.monotonic() + deadline_s
        chunks, late, stopped = [], [], False
        try:
            for p, n in zip(self.pending, self.sizes):
                if not isinstance(p, Future):
                    chunks.append(p)
                    continue
                try:
                    chunks.append(self._wait(p, end, stop) if not stopped else p.result(timeout=0))
                except FutureTimeout:
                    stopped = stopped or (stop is not None and stop())
                    self.late += n
                    late.append(p)
                    chunks.append({name: ComponentScores(torch.zeros(n), torch.zeros(n, dtype=torch.bool))
                                   for name in self.mix.names})
            if stopped:  # the step is abandoned: nothing waits for the chunks still running
                self.abandon()
            elif late:
                self._stop(late, min(GRACE_S, deadline_s))
        finally:
            if self.own_scoring:
                self.scoring.close()
        if self.late and not stopped:
            log.warning("reward: %d of %d samples not scored within reward.deadline_s=%g s: masked", self.late,
                        sum(self.sizes), deadline_s)
        return {n: ComponentScores(torch.cat([c[n].scores for c in chunks]), torch.cat([c[n].valid for c in chunks]))
                for n in self.mix.names}

    @staticmethod
    def _wait(p: Future, end: float | None, stop: Callable[[], bool] | None):
        """p's result by `end` (None: no deadline), FutureTimeout at `end` or once `stop()` is true."""
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            if stop is None:
                return p.result(timeout=left)
            if stop():
                raise FutureTimeout
            try:
                return p.result(timeout=STOP_POLL_S if left is None else min(left, STOP_POLL_S))
            except FutureTimeout:
                if left is not None and left <= STOP_POLL_S:
                    raise

    def abandon(self) -> None:
        """The step is abandoned (a preemption in its rollout): no chunk is scored on; the one running is told to stop
        and not awaited (the lane's thread ends with the process)."""
        self.cancel.set()
        for p in self.pending:
            if isinstance(p, Future):
                p.cancel()
        if self.own_scoring:
            self.scoring.close()

    def _stop(self, late: list[Future], grace_s: float) -> None:
        """The late chunks: cancelled if not started, the running one told to stop and awaited for `grace_s`."""
        self.cancel.set()
        running = [p for p in late if not p.cancel()]
        t0 = time.monotonic()
        for p in running:
            try:
                p.result(timeout=max(0.0, grace_s - (time.monotonic() - t0)))
            except FutureTimeout:
                log.warning("reward: a chunk past reward.deadline_s still runs %g s after it was told to stop: "
                            "abandoned with its thread (the next step scores on a new one)", grace_s)
                self.scoring.abandon()
                return
            except Exception:  # its rows are masked anyway; the reward's error was logged by score_safely
                pass
