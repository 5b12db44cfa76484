"""The rollout pool's loop: sample each served trainer's rows of a step, score them, send them; bind the weights.

    start      trainer 0's start message: the first step and the prompt source's position (a resumed run's), or the
               trainer pool's refusal to start (then this rank stops with its line)
    per step s
      weights  the policy version v = max(0, s - pools.max_staleness), received from trainer 0 in version order, in
               parts of at most 1 GiB, and bound by parameter name into this rank's replica: every trainable parameter
               bound once, none unknown, each one's digest read back from the replica equal to the sender's (Binder);
               otherwise the run stops
      rollout  for each served trainer t, t's rows exactly as a synchronous run's rank t samples them (StepRows of the
               trainer pool's size, the same chunks), each chunk decoded and scored in the reward's worker thread
      reward   every row's components gathered over the rollout pool (trainer order: the trainers' own layout)
      send     to each trainer its trajectories, every row's rewards, the version sampled with and the digest of what
               was bound (the trainer checks both against what it sent)

The reward and send of step s run in a sender thread while the main thread binds the weights of step s + 1 and samples
it: a reward's latency (a judge served elsewhere) overlaps the next step's sampling, the way the background scorer
overlaps a step's chunks. Only the sender thread runs the pool's collectives and sends rollouts; at most one step is
being sent while the next samples (two steps' trajectories held).

The replica holds the weights in the dtypes the trainer pool's engine computes with (replica.py: FSDP2's 16-bit blocks,
a one-process engine's master dtype), so a rollout at max_staleness 0 is the synchronous run's, bit for bit."""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..models import build_model
from ..rewards.multi import ChunkScorer, ScoringLane, build_reward_mix, gather_components
from ..train.algorithm import build_algorithm
from ..train.config import load_prompt_file
from ..train.policy import Policy, rollout_batch
from ..train.rows import StepRows
from ..data import ListPromptSource, PromptSet
from .bridge import PoolError, digest
from .messages import combined, pack_rollout, prompts_digest
from .replica import place_replica

log = logging.getLogger(__name__)

__all__ = ["Binder", "RolloutWorker", "bind"]


class Binder:
    """One policy version bound into `model`'s trainable parameters part by part, as trainer 0 sends it (a part of at
    most messages.WEIGHT_PART_BYTES, so the replica's device never holds a whole version beside the replica), and
    checked: every trainable parameter bound once (none missing, none unknown), shapes and dtypes equal, each bound
    parameter's digest (read back from the model) equal to the sender's. finish() returns the combined digest of the
    bound parameters; anything else is a PoolError (one line) that stops the run."""

    def __init__(self, model: torch.nn.Module, *, version: int, rank: int):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.where = f"pools: rank {rank} binding policy version {version}"
        self.bound: dict[str, str] = {}
        self.sent: set[str] = set()
        self.parts = self.seen = 0

    @property
    def done(self) -> bool:
        return self.parts > 0 and self.seen == self.parts

    def add(self, state: dict[str, torch.Tensor], digests: dict[str, str], part: int = 0, parts: int = 1) -> None:
        if part != self.seen or parts != (self.parts or parts) or parts < 1:
            raise PoolError(f"{self.where}: part {part} of {parts} arrived after {self.seen} of {self.parts or parts}:"
                            " the sync is out of order; stopping")
        if state.keys() != digests.keys():
            raise PoolError(f"{self.where}: the digests name other parameters than the tensors sent")
        if self.sent & state.keys():
            raise PoolError(f"{self.where}: {sorted(self.sent & state.keys())[0]!r} was sent twice; stopping")
        self.parts, self.seen = parts, self.seen + 1
        self.sent |= state.keys()
        with torch.no_grad():
            for name in sorted(state.keys() & self.params.keys()):
                t, p = state[name], self.params[name]
                if t.shape != p.shape or t.dtype != p.dtype:
                    raise PoolError(f"{self.where}: {name!r} was sent as {t.dtype} {tuple(t.shape)}, the replica "
                                    f"holds {p.dtype} {tuple(p.shape)}; stopping")
                p.copy_(t)
                got = digest(p)
                if got != digests[name]:
                    raise PoolError(f"{self.where}: {name!r} read back other than sent; stopping")
                self.bound[name] = got

    def finish(self) -> str:
        known = self.bound.keys()
        if not known or known != self.params.keys() or known != self.sent:
            missing, unknown = sorted(self.params.keys() - self.sent), sorted(self.sent - self.params.keys())
            raise PoolError(f"{self.where}: {len(known)} of its {len(self.params)} trainable parameters bound from "
                            f"the {len(self.sent)} sent" + (f"; none sent for {missing[0]!r}" if missing else "")
                            + (f"; no parameter named {unknown[0]!r}" if unknown else "")
                            + ": the rollouts would sample other weights than the trainer's; stopping")
        return combined(self.bound)


def bind(model: torch.nn.Module, state: dict[str, torch.Tensor], digests: dict[str, str], *, version: int,
         rank: int) -> str:
    """A version sent in one part, bound and checked (Binder); its combined digest."""
    binder = Binder(model, version=version, rank=rank)
    binder.add(state, digests)
    return binder.finish()


def replica_chunk(cfg, layout, device: torch.device, trainer_chunk: int) -> int:
    """sampling.chunk_size auto on a rollout rank: the trainer pool's chunk, or on a GPU the largest smaller one the
    replica's memory allows (estimate/pools.replica_batch, the chunk `jagg-estimate --pools` prices). A smaller chunk
    samples the same rows in other batches: equal up to the float order of batched kernels, not bit for bit."""
    if device.type != "cuda" or cfg.model.kind == "dit":
        return trainer_chunk
    from ..estimate import memory as M  # the estimator sits above the pools: imported only here
    from ..estimate.pools import replica_batch

    try:
        gib = torch.cuda.get_device_properties(device).total_memory / M.GiB
        return replica_batch(cfg, M.prepare(cfg, layout.rollout, gpu_gib=gib), trainer_chunk, layout.per_rollout, gib)
    except (LookupError, ValueError, OSError) as err:  # no shapes or coefficients for this model
        log.warning("pools: the estimator cannot size the replica (%s); sampling %d rows per forward", err,
                    trainer_chunk)
        return trainer_chunk


class RolloutWorker:
    """One rank of the rollout pool (module docstring). `dist`: the pool's DistContext (its `pool` the PoolMember)."""

    def __init__(self, cfg, dist):
        self.cfg, self.dist, self.member = cfg, dist, dist.pool
        self.bridge, self.layout = self.member.bridge, self.member.layout
        self.device = dist.device
        self.k = cfg.pools.max_staleness
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        prompts = (load_prompt_file("data.prompt_file", cfg.data.prompt_file) if cfg.data.prompt_file
                   else PromptSet.from_list(cfg.data.prompts))
        self.source = ListPromptSource(prompts, cfg.train.prompts_per_step, cfg.run.seed)
        self.reward = build_reward_mix(cfg.reward)
        self.scoring = ScoringLane(self.device)  # the reward's thread and stream, one for the run
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model, keep_stored_dtype=True)
        # the KL reference: with LoRA the replica with its adapter off; a full fine-tune's frozen copy of the start
        ref = model.reference_copy() if cfg.uses_reference and not cfg.model.lora.enabled else None
        engine, compute = cfg.parallel.engine, getattr(torch, cfg.model.dtype)  # as the trainers' forward sees them
        self.model = place_replica(model, self.device, engine, compute)
        model.place_frozen(self.device)
        self.model.eval()
        # the trainer pool's chunks: a served trainer's rows sampled as that trainer would (auto: for its pool size)
        chunk = rollout_batch(cfg, self.layout.trainers, self.device)
        if cfg.sampling.chunk_size == "auto":  # at most what this rank's replica leaves room for
            chunk = min(dist.all_gather_object(replica_chunk(cfg, self.layout, self.device, chunk)))
        self.policy = Policy(self.model, cfg, self.device, rollout_batch=chunk,
                             ref_model=place_replica(ref, self.device, engine, compute) if ref is not None else None)
        self.algorithm = build_algorithm(cfg, self.policy, None, dist)  # its rollout_spec alone
        self.version, self.bound = -1, ""
        self.signalled = None
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="rollout-send")
        self.sending: Future | None = None  # the previous step's reward and send
        for sig in (signal.SIGUSR1, signal.SIGTERM):  # preemption: the trainers checkpoint; this rank follows them
            signal.signal(sig, self._note_signal)

    def _note_signal(self, signum, frame) -> None:
        self.signalled = signum

    def run(self) -> int:
        """The pool's loop until the last step's rollout is sent; the exit code (0, or 128 + a preemption signal
        once the trainers have gone away after it)."""
        try:
            start = self._start()
            for step in range(start, self.cfg.train.steps):
                self._bind(max(0, step - self.k))
                sampled = self._sample(step)
                self._sent()  # the previous step's rewards in and sent: one step in the sender's hands at a time
                self.sending = self.sender.submit(self._score_and_send, *sampled)
            self._sent()
            self.bridge.flush()
        except PoolError:
            if self.signalled is not None:  # the trainers checkpointed on the signal and left: so does this rank
                log.warning("pools: rank %d stops after signal %d", self.member.rank, self.signalled)
                return 128 + int(self.signalled)
            raise
        finally:
            self.sender.shutdown(wait=False, cancel_futures=True)
            self.scoring.close()
        return 0

    def _sent(self) -> None:
        """Wait for the step in the sender thread (its error raised here)."""
        if self.sending is not None:
            sending, self.sending = self.sending, None
            sending.result()

    def _start(self) -> int:
        # the trainers build, verify and load a checkpoint first: waited for as long as a collective may wait
        meta, _ = self.bridge.recv(0, "start", timeout_s=self.cfg.parallel.collective_timeout_s)
        if not meta.get("ok"):
            raise PoolError(f"pools: the trainer pool did not start: {meta.get('error', 'no reason given')}")
        self.source.load_state_dict(meta["source"])
        return int(meta["start_step"])

    def _bind(self, version: int) -> None:
        """Bind `version`, the next one trainer 0 sends (it sends exactly the versions the rollouts sample with, in
        order), part by part."""
        if self.version >= version:
            return
        binder = Binder(self.model, version=version, rank=self.member.rank)
        while not binder.done:
            # the trainers first wait for every rollout rank (pools.timeout_s), then update: twice that here, so
            # that a hung rollout rank is named by the trainer it hangs, not by this rank's wait behind it
            meta, tensors = self.bridge.recv(0, "weights", timeout_s=2 * self.cfg.pools.timeout_s)
            if int(meta["version"]) != version:
                raise PoolError(f"pools: rank {self.member.rank} received policy version {meta['version']} while "
                                f"binding version {version}: the sync is out of order; stopping")
            binder.add(tensors, meta["digests"], int(meta["part"]), int(meta["parts"]))
            del tensors  # this part's buffer, before the next one arrives
        self.bound, self.version = binder.finish(), version

    def _sample(self, step: int) -> tuple:
        """Each served trainer's rows of step `step` sampled, their chunks handed to a scorer as they come."""
        cfg, T = self.cfg, self.layout.trainers
        t0 = time.perf_counter()
        records = self.source.next_prompts()
        records = [r for r in records for _ in range(cfg.grpo.group_size)]
        spec = self.algorithm.rollout_spec(step)
        scorer = ChunkScorer(self.reward, self.model.decode, background=cfg.reward.background, device=self.device,
                             lane=self.scoring)
        shares = []
        for t in self.layout.trainers_of(self.member.rank):
            rows = StepRows.draw(len(records), cfg.train.minibatch_size, cfg.run.seed, step, t, T)
            mine = rows.mine.tolist()
            prompts, metadata = [records[i].prompt for i in mine], [records[i].metadata for i in mine]
            self.policy.take_counts()
            cond = self.policy.encode(prompts)
            traj = self.policy.rollout(cond, rows.mine, step, spec=spec, prompts=prompts,
                                       on_chunk=lambda c, final, p=prompts, m=metadata: scorer.add(final, p[c], m[c]))
            shares.append((t, traj, prompts_digest(prompts), self.policy.take_counts()))
        return step, len(records), scorer, shares, self.version, self.bound, time.perf_counter() - t0

    def _score_and_send(self, step: int, n: int, scorer: ChunkScorer, shares: list, version: int, bound: str,
                        rollout_s: float) -> None:
        """The sender thread: the step's rewards awaited and gathered over the pool, each trainer's share sent."""
        cfg, t1 = self.cfg, time.perf_counter()
        local = scorer.finish(deadline_s=cfg.reward_deadline_s if cfg.reward.background else None)
        layout = StepRows.draw(n, cfg.train.minibatch_size, cfg.run.seed, step, 0, self.layout.trainers).all_rows
        parts = gather_components(local, layout, n, lambda x: self.dist.all_gather_tensor(x.to(self.device)))
        late = self.dist.all_gather_object(scorer.late)
        reward_s = time.perf_counter() - t1
        for t, traj, prompts, counts in shares:
            meta = {"step": step, "version": version, "bound": bound, "prompts": prompts, "first": traj.first,
                    "late": late[t // self.layout.per_rollout], "counts": counts, "time_rollout": rollout_s,
                    "time_reward": reward_s}
            self.bridge.send(t, "rollout", meta, pack_rollout(traj, parts))
