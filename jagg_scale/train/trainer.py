"""The trainer. One training step reads top to bottom as its phases, the same for every algorithm (algorithm.py: the
unit named by train.algorithm, GRPO in update.py, DiffusionNFT in nft.py):

    0. spec        what the algorithm's rollout must sample and keep this step (algorithm.rollout_spec)
    1. rollout     this rank's rows of the step's prompts sampled as the spec says (policy.py), each chunk decoded
                   and scored by the reward in a worker thread while the next one samples
    2. reward      the scores gathered over ranks, failures checked
    3. advantage   the algorithm's advantages over the whole gathered batch
    4. update      the algorithm's update phase: inner epochs x minibatches x micro-batches through the one
                   minibatch runner (runner.py), one optimizer step per minibatch
    5. log         metrics averaged over ranks; `fit` then checkpoints, exports and evaluates (run_state.py)

Distribution: the same code runs on one process or N; which training engine (parallel/: one process, FSDP2 or
DeepSpeed ZeRO-3) is the engine's business, behind one contract. Every rank agrees on the step's prompts, samples
its slice of the rows (rows.py), scores its own images, and the rewards are gathered so every rank computes the
same group advantages; each rank then trains on its slice of every minibatch and the engine reduces the
gradients. Rank 0 writes logs and exports.

Determinism: every random draw of step t comes from a generator seeded by (run.seed, t[, row]), never from global
state, so a run resumed from a checkpoint at step t draws exactly what the uninterrupted run drew, and N ranks
draw what one process would.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import torch
import yaml

from ..checkpoint import capture_rng_state
from ..checkpoint.local import write_object
from ..checkpoint.pickles import load_torch
from ..data import ListPromptSource, PromptSet, StreamPromptSource
from ..models import build_model, family
from ..models.diffusers_common import ATTENTION_BACKENDS, set_attention_backend
from ..parallel.build import build_engine
from ..parallel.dist import init_distributed
from ..pools.trainer_link import TrainerLink, refuse_start
from ..rewards.multi import (ChunkScorer, ComponentScores, ScoringLane, build_reward_mix, check_failures,
                             gather_components)
from .algorithm import build_algorithm
from .config import Config, ConfigError, load_prompt_file, validate_world
from .invariants import check_on_policy
from .evaluate import EvalInterrupted, eval_prompts, evaluate, load_eval, load_grid
from .logging import RunLogger
from .policy import Policy, agreed_rollout_batch
from .preemption import Preemption, StepAbandoned, StopPoints
from .rows import StepRows, step_seed
from .run_lock import RunLock, write_run_file
from .run_state import RunState, check_fresh_start, check_run_dir, clear_earlier_run

log = logging.getLogger(__name__)

__all__ = ["Trainer", "summarize", "step_seed"]


class Trainer:
    def __init__(self, cfg: Config, dist=None):
        """`dist`: the process context when the caller started it (the trainer pool's, pools.rollout_ranks > 0)."""
        self.cfg = cfg
        self.out = Path(cfg.run.output_dir)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.dist = dist or init_distributed(cfg.run.device, timeout_s=cfg.parallel.collective_timeout_s)
        self.lock = None
        self.link = None  # pools: the trainer pool's side of the split pipeline (pools/trainer_link.py)
        try:
            pool = self.dist.pool
            validate_world(cfg, pool.layout.world if pool is not None else self.dist.world_size)
            self.dist.on_main(lambda: check_run_dir(self.out))  # someone's own directory: before the lock is made
            self.lock = RunLock.acquire(self.out, self.dist)  # one job per run directory: fails on every rank if taken
            # run.resume none into an earlier run: refused (unless run.overwrite), before any model is built
            self.dist.on_main(lambda: check_fresh_start(cfg, self.out))
            self._build()
        except BaseException as err:  # a refused start leaves no lock (nor a lock file it created) and no process group
            refuse_start(self.dist, err)  # pools: the rollout ranks stop with this line too
            self.close(refused=True)
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self.device = self.dist.device
        # Inputs first: a bad prompt file or reward name fails before a model is built.
        self.source = self._prompt_source()
        try:
            self.reward = build_reward_mix(cfg.reward)
        except (FileNotFoundError, ValueError) as err:  # a reward's model path or option: the user's input
            raise ConfigError(f"config key 'reward': {err}") from err
        self.scoring = ScoringLane(self.device)  # the reward's thread and stream, one for the run
        self.eval_prompts = eval_prompts(cfg) if cfg.eval.enabled else None
        self.evals: dict[int, dict] = {}

        torch.manual_seed(cfg.run.seed)
        # Built on the host (the transformer in its checkpoint's bf16 when model.dtype is bfloat16, the frozen parts
        # in their compute dtype); the engine places the transformer on the device, sharded first where it shards
        # (upcast to its fp32 master weights on the way); then the frozen parts go to the device on their own.
        model = build_model(cfg.model, keep_stored_dtype=True, meta=self._meta_init())
        if cfg.model.attention in ATTENTION_BACKENDS:  # before sequence parallelism: it checks the backend takes part
            try:
                set_attention_backend(model.transformer, cfg.model.attention, self.device)
            except ValueError as err:
                raise ConfigError(str(err)) from err
        # The KL reference: with LoRA the same transformer with its adapter off (no copy); otherwise a frozen copy
        # of the starting transformer alone, made on the host, sharded like the policy, sharing the policy's VAE
        # and encoders (rebuilt identically on resume, so checkpoints need not hold it). beta = 0 skips the
        # reference entirely: no copy, no forwards.
        lora = cfg.model.lora.enabled
        ref = model.reference_copy() if cfg.uses_reference and not lora else None
        if cfg.parallel.sequence_parallel > 1:  # the transformers' tokens split over each group, before sharding
            self._sequence_parallel(*[m for m in (model, ref) if m is not None])
        self.engine = build_engine(model, cfg.parallel, cfg.train, self.dist)
        self.model = self.engine.model
        model.place_frozen(self.device, shard_t5=self._t5_sharder() if cfg.model.shard_text_encoder else None)
        self.policy = Policy(self.model, cfg, self.device,
                             ref_model=self.engine.shard_frozen(ref) if ref is not None else None,
                             rollout_batch=agreed_rollout_batch(cfg, self.dist, self.device))
        if cfg.reward.shard and self.dist.world_size > 1:
            from ..rewards.sharded import shard_reward

            for _, _, component in self.reward.components:
                shard_reward(component)
        self.algorithm = build_algorithm(cfg, self.policy, self.engine, self.dist)  # train.algorithm's unit
        self.preemption = Preemption()
        # inside a step: a check before every transformer forward, while the step has not moved the weights (not
        # under pools: the rollout pool samples ahead of the step, so only its end is a safe point)
        self.stops = StopPoints(self.preemption, self._agree_control, lambda: self.engine.optimizer_steps,
                                enabled=self.dist.pool is None)
        self.policy.stop_point = self.stops.check
        self.run_state = RunState(cfg, self.dist, self.engine, self.out)
        if self.dist.pool is not None:
            self.link = TrainerLink(cfg, self.dist, self.engine)
            self.run_state.parts.append(self.link)  # the earlier policy versions the next rollouts sample with
        self.start_step = self.run_state.resume(self.source)
        if self.link is not None:
            self.link.start(self.start_step, self.source)

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def close(self, *, refused: bool = False) -> None:
        """End the run's hold on the machine: the process group (every rank) and the run directory's lock (after
        the last write into it; `refused`: a start that wrote nothing removes the lock file and directory it made).
        Idempotent; jagg-train calls it once the run (and rank 0's summary) is done."""
        if getattr(self, "scoring", None) is not None:
            self.scoring.close()
        self.dist.close()
        if self.lock is not None:
            self.lock.release(refused=refused)
            self.lock = None

    def _sequence_parallel(self, *models) -> None:
        from ..parallel.sequence import apply_sequence_parallel

        sp = self.cfg.parallel.sequence_parallel
        self.dist.ensure_group()
        self.dist.sequence_parallel = sp
        for model in models:
            try:
                apply_sequence_parallel(model.transformer, sp, self.dist.rank, self.dist.world_size, self.device)
            except (AttributeError, ValueError) as err:  # a model without a diffusers transformer, or one unplanned
                raise ConfigError(str(err) if "config key" in str(err) else
                                  f"config key 'parallel.sequence_parallel' {sp}: {err}") from err

    def _meta_init(self) -> bool:
        """parallel.meta_init: the transformer a skeleton on the meta device, each rank's shards read by the engine
        (parallel/meta_load.py); FSDP2 with a diffusers pipeline, not a rollout pool's split (its replica is whole)."""
        cfg = self.cfg
        applies = (cfg.parallel.engine == "fsdp2" and family(cfg.model.kind).is_pipeline and self.dist.pool is None)
        if cfg.parallel.meta_init and not applies:
            raise ConfigError("config key 'parallel.meta_init' true: the meta start-up reads FSDP2 shards of a "
                              "diffusers pipeline's transformer, and this run has none to read (the dit, or pools)")
        return applies and cfg.parallel.meta_init is not False

    def _t5_sharder(self):
        """model.shard_text_encoder: the T5 encoder fully_shard-ed for inference over a 1-D mesh of every rank (a
        trivial process group in one process), each rank's shard placed on its device
        (parallel.fsdp.shard_for_inference)."""
        from ..parallel.fsdp import build_mesh, shard_for_inference

        self.dist.ensure_group()
        mesh = build_mesh(self.device.type, self.dist.world_size)
        return lambda module: shard_for_inference(module, mesh)

    def _prompt_source(self):
        cfg = self.cfg
        if cfg.data.source == "wds":
            try:
                return StreamPromptSource(cfg.data.shards, cfg.train.prompts_per_step, cfg.run.seed, self.dist,
                                          num_workers=cfg.data.num_workers)
            except (FileNotFoundError, ValueError) as err:  # a shard not there, too few for the readers, a duplicate
                raise ConfigError(f"config key 'data.shards': {err}") from err
        prompts = (load_prompt_file("data.prompt_file", cfg.data.prompt_file) if cfg.data.prompt_file
                   else PromptSet.from_list(cfg.data.prompts))
        return ListPromptSource(prompts, cfg.train.prompts_per_step, cfg.run.seed)

    # ----------------------------------------------------------------------------------------------------------
    # one training step
    # ----------------------------------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict:
        cfg, algorithm = self.cfg, self.algorithm
        g = cfg.grpo.group_size
        t0 = time.perf_counter()
        self.stops.arm("rollout")  # a preemption from here until the first optimizer step abandons the step
        # 0. what this step's rollout samples and keeps: the algorithm's
        spec = algorithm.rollout_spec(step)
        # 1. rollout: the step's prompts (the same on every rank), this rank's rows, scored chunk by chunk
        records = [r for r in self.source.next_prompts() for _ in range(g)]
        rows = StepRows.draw(len(records), cfg.train.minibatch_size, cfg.run.seed, step, self.dist.rank,
                             self.dist.world_size, cfg.parallel.sequence_parallel)
        mine = rows.mine.tolist()
        prompts, metadata = [records[i].prompt for i in mine], [records[i].metadata for i in mine]
        self.policy.take_counts()  # from here, this step's (not an evaluation's encodes)
        cond = self.policy.encode(prompts)
        if self.link is None:
            traj, parts, scoring, t1 = self._rollout_and_reward(step, spec, cond, rows, prompts, metadata,
                                                                len(records))
            behind = 0
        else:  # pools: the rollout pool sampled and scored this trainer's rows, with the version the step says
            traj, parts, meta = self.link.receive(step, prompts, self.reward.names)
            # the rollout pool scored every row of this trainer's (pools refuse sequence parallelism)
            scoring = {"reward_late": meta["late"], "reward_rows": len(mine)}
            behind, t1 = step - meta["version"], t0
        self.stops.check()  # a rank's signal may have cut its reward wait short: the step is abandoned
        failed = check_failures(parts, cfg.reward.max_fail_frac)
        t2 = time.perf_counter()
        # 3. advantages over the prompt groups (row i is in group i // G)
        adv = algorithm.advantages(parts, self.reward.weights, [i // g for i in range(len(records))])
        # 4. update on this rank's slice of every minibatch
        self.model.train()
        self.stops.rename("update")
        with self._comm("train"):
            update = algorithm.update(traj, cond, adv, rows, step, **({"behind": behind} if self.link else {}))
        self.stops.disarm()
        if self.link is not None:
            self.link.after_update(step)  # the weights to the rollout pool, when a later rollout samples with them
        t3 = time.perf_counter()
        # 5. log
        metrics = {
            "step": step,
            **self._reward_metrics(parts, failed),
            "zero_std_groups": adv.zero_std_groups,
            **scoring,  # reward_late, reward_rows: this rank's (mean over ranks)
            # rows encoded vs distinct prompts encoded, rollout rows (and row-forwards) that shared a group's prefix
            **self.policy.take_counts(),
            **update,
            "time_rollout": t1 - t0,  # includes the reward scoring that overlapped it
            "time_reward": t2 - t1,  # reward time not hidden behind the rollout
            "time_train": t3 - t2 - update.get("time_probe", 0.0),  # the probe is diagnostics, not training
        }
        if self.link is not None:  # the policy version the rollout sampled with, steps behind the trained one; the
            # rollout pool's own phases, and this trainer's wait for them (the rollout's encode included)
            metrics.update(policy_version=step - behind, staleness=behind, **meta["counts"],
                           time_rollout=meta["time_rollout"], time_reward=meta["time_reward"], time_wait=t2 - t0)
        metrics.update(self.engine.comm.take())  # collectives per phase (nothing on one process)
        metrics = fetch_metrics(metrics)  # the step's one device-to-host read of its loss statistics
        metrics = self.dist.mean_over_ranks(metrics, {"ratio_max": "max", "ratio_min": "min",
                                                      "onpolicy_log_ratio": "max", "kl_new_old_max": "max",
                                                      "behaviour_log_ratio": "max"})
        check_on_policy(metrics, cfg.grpo.onpolicy_tolerance, step)  # every rank: the same reduced value
        return metrics

    def _rollout_and_reward(self, step, spec, cond, rows, prompts, metadata, n: int):
        """Steps 1-2 on this rank: its rows sampled, each chunk scored in the background while the next samples,
        the scores gathered over ranks. Returns (trajectories, every row's reward components, this rank's scoring
        counts, the rollout's end time)."""
        cfg = self.cfg
        self.model.eval()
        background = cfg.reward.background and not (cfg.reward.shard and self.dist.world_size > 1)
        scorer = ChunkScorer(self.reward, self.model.decode, background=background, device=self.device,
                             lane=self.scoring)
        # a sequence-parallel group's ranks hold the same rows: each decodes and scores every sp-th of them (a
        # sharded reward needs every rank in each call: then each scores all)
        sp = self.dist.sequence_parallel if not cfg.reward.shard else 1
        owned = torch.arange(len(rows.mine)) % sp == self.dist.rank % sp

        def on_chunk(chunk: slice, final: torch.Tensor) -> None:
            at = owned[chunk].nonzero().flatten()
            if len(at) == len(final):
                scorer.add(final, prompts[chunk], metadata[chunk])
            elif len(at):
                mine = [chunk.start + int(i) for i in at]
                scorer.add(final[at.to(final.device)], [prompts[i] for i in mine], [metadata[i] for i in mine])

        try:
            with self._comm("rollout"):
                traj = self.policy.rollout(cond, rows.mine, step, spec=spec, on_chunk=on_chunk, prompts=prompts)
        except StepAbandoned:
            scorer.abandon()  # its chunks cancelled, not scored on into the checkpoint's save
            raise
        t1 = time.perf_counter()
        # 2. reward: gathered so that every rank sees the whole batch (and takes the same decisions); this rank's
        # own preemption signal ends the wait (the step is then abandoned at the check after the gather)
        self.stops.rename("reward")
        local = scorer.finish(deadline_s=cfg.reward_deadline_s if background else None,
                              stop=lambda: self.preemption.requested)
        if sp > 1:  # this rank's scores in its rows' places (0 and invalid where a group peer scored)
            local = {k: ComponentScores(torch.zeros(len(owned), dtype=c.scores.dtype).index_put_((owned,), c.scores),
                                        torch.zeros(len(owned), dtype=torch.bool).index_put_((owned,), c.valid))
                     for k, c in local.items()}
        with self._comm("reward"):
            parts = gather_components(local, rows.all_rows, n, lambda t: self.dist.all_gather_tensor(t.to(self.device)),
                                      owned=owned if sp > 1 else None)
        # this rank's samples masked by reward.deadline_s, and the rows it decoded and scored
        return traj, parts, {"reward_late": scorer.late, "reward_rows": int(owned.sum())}, t1

    def _reward_metrics(self, parts, failed: dict[str, int]) -> dict:
        total, valid = self.reward.weighted_sum(parts)
        ok = total[valid].double()
        mean, std, failed_n = torch.stack([ok.mean(), ok.std(unbiased=False), (~valid).sum().double()]).tolist()
        out = {"reward_mean": mean, "reward_std": std, "reward_failed": int(failed_n)}  # NaN when none is valid
        if len(parts) > 1:
            for name, p in parts.items():
                out[f"reward_{name}_mean"] = float(p.scores[p.valid].mean()) if p.valid.any() else float("nan")
                out[f"reward_{name}_failed"] = failed[name]
        return out

    def _comm(self, phase: str):
        return self.engine.comm.phase(phase)

    # ----------------------------------------------------------------------------------------------------------
    # the loop: steps, checkpoints, exports, evaluation, preemption
    # ----------------------------------------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        cfg = self.cfg
        main = self.dist.is_main
        if main:
            if cfg.run.overwrite and self.start_step == 0:
                clear_earlier_run(self.out)  # what check_fresh_start found: the user said to replace it
            self.out.mkdir(parents=True, exist_ok=True)
            write_run_file(self.out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            (self.out / "PREEMPTED").unlink(missing_ok=True)
        wandb_cfg = {"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode} if cfg.log.wandb else None
        logger = RunLogger(self.out, total_steps=cfg.train.steps, start_step=self.start_step,
                           progress=cfg.log.progress, wandb_cfg=wandb_cfg, config=cfg.to_dict()) if main else None
        history = []

        def evaluate_and_log(step: int) -> None:  # every rank evaluates; rank 0 also shows it on wandb
            try:
                result = self.evaluate(step)
            except EvalInterrupted:  # preempted mid-evaluation: the state after `step` saved, the eval resumes
                if step > 0 and self.run_state.saved_step != step:
                    self.run_state.save(step, self.source)
                self._exit_preempted(step)
            if logger is not None:
                logger.log_eval(step, result, self.eval_dir(step))

        def eval_due(step: int) -> bool:
            if self.eval_prompts is None:
                return False
            if step == 0:
                return cfg.eval.at_start
            return step == cfg.train.steps or bool(cfg.eval.every and step % cfg.eval.every == 0)

        try:
            with self.preemption.armed():
                if eval_due(self.start_step) and (self.start_step == 0 or not (
                        self.eval_dir(self.start_step) / "eval.json").is_file()):
                    evaluate_and_log(self.start_step)  # step 0's, or one a preemption stopped (or never began)
                for step in range(self.start_step, cfg.train.steps):
                    start = self._step_start() if self.stops.enabled else None
                    try:
                        metrics = self.train_step(step)
                    except StepAbandoned as stopped:
                        self._abandon(step, start, stopped.phase)
                    if logger is not None:
                        logger.log(metrics)
                    history.append(metrics)
                    last = step + 1 == cfg.train.steps
                    preempted = self._agree(self.preemption.requested)
                    self.run_state.after_step(step + 1, self.source, self.model, last=last, preempted=preempted)
                    if preempted:
                        self._exit_preempted(step + 1)
                    if eval_due(step + 1):
                        evaluate_and_log(step + 1)
                self.run_state.finish(self.model, cfg.train.steps)  # the final export, if the loop did not write it
                # every rank leaves together: rank 0 may still be sealing the last checkpoint, and a rank that tore
                # its process group down meanwhile aborted at exit under load (gloo, 2 processes)
                self.dist.barrier()
        finally:
            if logger is not None:
                logger.close()
            if hasattr(self.source, "close"):
                self.source.close()
        return history

    def _agree(self, flag: bool) -> bool:
        """True on every rank if any rank got a preemption signal (one tiny host-side all-reduce when distributed);
        a rank that got none takes the signal number another rank got (its exit code and the PREEMPTED marker)."""
        agreed = self.dist.max_over_ranks(int(self.preemption.signal_number or signal.SIGTERM) if flag else 0)
        if agreed and self.preemption.signal_number is None:
            self.preemption.signal_number = agreed
        return bool(agreed)

    def _agree_control(self, flag: bool) -> bool:
        """_agree inside a step: bookkeeping, counted apart from the phase's model traffic."""
        with self._comm("control"):
            return self._agree(flag)

    def _step_start(self) -> dict:
        """What a checkpoint of the step's start holds besides the weights, taken before the step draws prompts: the
        prompt source's position and the global RNG (a collective for a wds source: every rank, every step)."""
        return {"prompts": self.source.state_dict(), "rng": capture_rng_state()}

    def _abandon(self, step: int, start: dict, phase: str) -> None:
        """A preemption inside step `step` before it moved the weights: the checkpoint of its start (unless the run
        has it already), then exit as preempted; the resumed run trains step `step` from its beginning."""
        self.stops.disarm()
        log.warning("preempted during step %d's %s: the step is abandoned, its start checkpointed", step, phase)
        # step 0's start is the model the config builds (a resumed run with no checkpoint starts there); saving it
        # would not even be that state: DCP gives an optimizer that never stepped a state of its own to save
        # (torch.distributed.checkpoint.state_dict._init_optim_state: a zero-lr step, Adam's count then 1)
        if step > 0 and not self.run_state.has_checkpoint(step):
            self.run_state.save(step, self.source, prompts=start["prompts"], rng=start["rng"])
        self._exit_preempted(step)

    def _exit_preempted(self, next_step: int) -> None:
        """Checkpoint written: mark the run as preempted (the sbatch template requeues on this marker) and exit
        with 128 + the signal number, as a process killed by it would."""
        sig = self.preemption.signal_number
        if self.dist.is_main:
            (self.out / "PREEMPTED").write_text(f"signal {sig}; checkpoint at step {next_step}\n")
        log.warning("preempted by signal %s: checkpoint at step %d written, exiting", sig, next_step)
        raise SystemExit(128 + int(sig))

    def evaluate(self, step: int) -> dict:
        """ODE samples on the held-out prompts after `step` updates -> out/eval/step_XXXXXXXX/{eval.json,grid.png}.
        Each rank samples its share of the images, eval.chunk_size at a time, in the same number of forwards (a
        sharded model needs all ranks in each); the scores are gathered to every rank, rank 0 writes. After step 0
        the step-0 evaluation (the base model; read back from its eval.json in a resumed run) is reported beside it."""
        out_dir = self.eval_dir(step)
        base = None if step == 0 else self.evals.get(0) or load_eval(self.eval_dir(0))
        base_grid = load_grid(self.eval_dir(0)) if step > 0 and self.dist.is_main else None  # an edit grid's "before"
        # preemption between batches: this rank's batches so far kept beside the eval, resumed from there
        partial = out_dir / f"partial_rank{self.dist.rank:05d}.pt"
        resume = load_torch(partial) if partial.is_file() else None
        if resume is not None and (resume.get("world") != self.dist.data_world or "grid_index" not in resume):
            resume = None  # another data world (its shares differ) or an older layout: the evaluation starts over
        try:
            with self.engine.ema_weights():  # the EMA weights when train.ema_decay > 0
                result = evaluate(self.model, self.policy.velocity_fn(), self.policy.encode, self.reward, self.cfg,
                                  self.eval_prompts, out_dir, self.dist, base=base,
                                  stop=lambda: self._agree(self.preemption.requested), resume=resume,
                                  base_grid=base_grid)
        except EvalInterrupted as stopped:
            partial.parent.mkdir(parents=True, exist_ok=True)
            write_object(partial, stopped.partial)
            log.warning("preempted during the evaluation after %d steps: %d batch(es) kept in %s", step,
                        stopped.partial["batches"], partial)
            raise
        partial.unlink(missing_ok=True)
        self.evals[step] = result
        log.info("eval after %d steps: %s %.4f +- %.4f over %d images, diversity %s", step, result["reward"],
                 result["reward_mean"], result["reward_std"], result["num_images"], result["diversity"])
        return result

    def eval_dir(self, step: int) -> Path:
        return self.out / "eval" / f"step_{step:08d}"


def summarize(history: list[dict], window: int = 3) -> dict:
    """Reward over the first vs the last steps and the transformer backward passes JAGG saved."""
    if not history:
        return {}
    k = min(window, len(history))
    mean = lambda rows: sum(r["reward_mean"] for r in rows) / len(rows)
    done = sum(r["backward_passes"] for r in history)
    equiv = sum(r["per_step_equiv"] for r in history)
    return {
        "steps": len(history),
        "reward_first": mean(history[:k]),
        "reward_last": mean(history[-k:]),
        "backward_passes": done,
        "backward_passes_per_step_baseline": equiv,
        "backward_saved_frac": 1.0 - done / equiv if equiv else 0.0,
        "train_seconds": sum(r["time_train"] for r in history),
    }


def fetch_metrics(metrics: dict) -> dict:
    """The step's metrics with every tensor value turned into a Python float by ONE device-to-host copy (a training
    step's only read of its loss statistics); other values pass through unchanged."""
    keys = [k for k, v in metrics.items() if torch.is_tensor(v)]
    if not keys:
        return dict(metrics)
    device = metrics[keys[0]].device
    values = torch.stack([metrics[k].detach().float().reshape(()).to(device) for k in keys]).tolist()
    return {**metrics, **dict(zip(keys, values))}
