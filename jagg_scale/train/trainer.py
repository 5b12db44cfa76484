"""The GRPO trainer. One training step reads top to bottom:

    prompts -> rollout (SDE, log-probs, velocities) -> reward -> advantages -> JAGG updates -> log -> checkpoint

Distribution: the same code runs on one process or N; which training engine (parallel/: one process, FSDP2 or
DeepSpeed ZeRO-3) is the engine's business, behind one contract. Every rank agrees on the step's prompts, samples
its slice of the rows (rows.py), scores its own images, and the rewards are gathered so every rank computes the
same group advantages; each rank then trains on its slice of every minibatch and the engine reduces the
gradients. Metrics are averaged over ranks; rank 0 writes logs and exports.

Determinism: every random draw of step t comes from a generator seeded by (run.seed, t[, row]), never from global
state, so a run resumed from a checkpoint at step t draws exactly what the uninterrupted run drew, and N ranks
draw what one process would.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import yaml

from ..checkpoint import CheckpointError, capture_rng_state, find_resume_checkpoint, restore_rng_state
from ..checkpoint.local import STATE, save_checkpoint_dir, verify_checkpoint
from ..data import ListPromptSource, PromptSet, StreamPromptSource, load_prompts
from ..grpo import (GRPOStepLoss, Trajectories, combine_advantages, compute_advantages, guided_velocity, model_schedule,
                    reduce_metrics, sample_sde)
from ..jagg import trained_steps
from ..cond import index_cond
from ..models import build_model
from ..parallel.build import build_engine
from ..parallel.dist import init_distributed
from ..paths import resolve_path
from ..rewards.multi import ChunkScorer, ComponentScores, build_reward_mix, check_failures
from .config import Config, engine_spec
from .evaluate import eval_prompts, evaluate
from .logging import RunLogger
from .preemption import Preemption
from .rows import StepRows, row_generators, step_seed
from .update import BackwardStats, backward_minibatch, probe_minibatch

log = logging.getLogger(__name__)

__all__ = ["Trainer", "summarize", "step_seed"]


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = Path(cfg.run.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.dist = init_distributed(cfg.run.device)
        self.device = self.dist.device
        if self.dist.world_size > 1 and cfg.jagg.probe_every:
            raise ValueError("jagg.probe_every (the exact-gradient probe) runs on one process; set it to 0")

        # Inputs first: a bad prompt file or reward name fails before a model is built.
        self.source = self._prompt_source()
        self.reward = build_reward_mix(cfg.reward)
        self.eval_prompts = eval_prompts(cfg) if cfg.eval.enabled else None
        self.evals: dict[int, dict] = {}

        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model).to(self.device)
        # The KL reference: with LoRA the same transformer with its adapter off (no copy); otherwise a frozen copy
        # of the starting weights (rebuilt identically on resume, so checkpoints need not hold it). beta = 0 skips
        # the reference entirely: no copy, no forwards.
        self.lora = cfg.model.lora.enabled
        ref = copy.deepcopy(model).requires_grad_(False).eval() if cfg.grpo.beta > 0 and not self.lora else None
        self.engine = build_engine(model, engine_spec(cfg), self.dist)
        self.model = self.engine.model
        self.ref_model = self.engine.shard_frozen(ref) if ref is not None else None
        if cfg.reward.shard and self.dist.world_size > 1:
            from ..rewards.sharded import shard_reward

            for _, _, component in self.reward.components:
                shard_reward(component)
        self.sigmas = model_schedule(self.model, cfg.sampling.num_steps, cfg.sampling.shift).to(self.device)
        self.steps = trained_steps(cfg.sampling.num_steps, cfg.grpo.timestep_fraction)
        self.start_step = 0
        self.preemption = Preemption()
        self._resume()

    def _prompt_source(self):
        cfg = self.cfg
        if cfg.data.source == "wds":
            return StreamPromptSource(cfg.data.shards, cfg.train.prompts_per_step, cfg.run.seed, self.dist,
                                      num_workers=cfg.data.num_workers)
        prompts = (load_prompts(resolve_path(cfg.data.prompt_file)) if cfg.data.prompt_file
                   else PromptSet.from_list(cfg.data.prompts))
        return ListPromptSource(prompts, cfg.train.prompts_per_step, cfg.run.seed)

    # ----------------------------------------------------------------------------------------------------------
    # the policy
    # ----------------------------------------------------------------------------------------------------------

    def velocity_fn(self, model):
        """The policy's velocity: CFG-guided, the model under bf16 autocast when configured (the SDE math that
        consumes it casts back to float32)."""
        guidance = self.cfg.sampling.guidance
        bf16 = self.cfg.model.dtype == "bfloat16"

        def fn(x, sigma, cond):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
                return guided_velocity(model, x, sigma, cond, guidance)

        return fn

    def reference_fn(self):
        """The reference velocity for the KL term, or None when beta = 0."""
        if self.cfg.grpo.beta == 0:
            return None
        if self.ref_model is not None:
            return self.velocity_fn(self.ref_model)
        policy = self.velocity_fn(self.model)

        def adapter_off(x, sigma, cond):
            with self.model.reference_disabled():
                return policy(x, sigma, cond)

        return adapter_off

    def encode(self, prompts: list[str]):
        cond = self.model.encode_prompts(prompts)
        if self.cfg.sampling.guidance != 1.0:
            return cond, self.model.encode_prompts([""] * len(prompts))
        return cond

    # ----------------------------------------------------------------------------------------------------------
    # one training step
    # ----------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def rollout(self, cond, rows: torch.Tensor, step: int, on_chunk=None, sde_steps=None) -> Trajectories:
        """SDE trajectories of the given global rows (cond holds their conditioning, in that order).
        `on_chunk(index, final_latents)` is called after each chunk of sampling.batch_size rows (reward scoring)."""
        cfg = self.cfg
        gens = row_generators(cfg.run.seed, step, rows)
        noise = torch.stack([torch.randn(self.model.latent_shape, generator=g) for g in gens])
        policy, ref = self.velocity_fn(self.model), self.reference_fn()
        parts = []
        for idx in torch.arange(len(rows)).split(cfg.sampling.batch_size):
            parts.append(sample_sde(policy, index_cond(cond, idx.to(self.device)), noise[idx].to(self.device),
                                    self.sigmas, noise_level=cfg.sampling.noise_level,
                                    generator=[gens[i] for i in idx.tolist()], ref_velocity_fn=ref,
                                    sde_steps=sde_steps))
            if on_chunk is not None:
                on_chunk(idx, parts[-1].final)
        return Trajectories.cat(parts)

    def trained_steps_at(self, step: int) -> list[int]:
        """The steps trained at training step `step`: Flow-GRPO's first timestep_fraction of the trajectory, or the
        SDE window of sampling.sde_window steps (random start per step, or sliding), seeded by the step."""
        s = self.cfg.sampling
        if s.sde_window == 0:
            return self.steps
        lo, hi = s.sde_window_range or [0, s.num_steps]
        starts = hi - lo - s.sde_window + 1
        if s.sde_window_mode == "sliding":
            start = lo + (step // s.sde_window_every) % starts
        else:
            gen = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, step, 3))
            start = lo + int(torch.randint(starts, (1,), generator=gen))
        return list(range(start, start + s.sde_window))

    def _route_reduce(self, values: list[float], how: str) -> list[float]:
        """Routing statistics combined over ranks so that every rank runs the same window plan."""
        if not self.dist.active:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        with self._comm("control"):  # bookkeeping, not the model's traffic: counted apart from "train"
            parts = self.dist.all_gather_tensor(t.unsqueeze(0).to(self.device)).cpu()
        return (parts.mean(0) if how == "mean" else parts.pow(2).sum(0).sqrt()).tolist()

    def update(self, traj: Trajectories, cond, adv_values, adv_mask, mask_global, plan: StepRows,
               step: int, steps: list[int]) -> tuple[BackwardStats, dict]:
        """Inner epochs x minibatches; one optimizer step per minibatch. `auto` intermediate values are the
        cached ones until the first optimizer step on this rollout, fresh forwards after it."""
        cfg, j = self.cfg, self.cfg.jagg
        total = BackwardStats()
        metrics: dict[str, list] = {}
        policy = self.velocity_fn(self.model)
        optimizer_steps = 0
        probe = j.probe_every > 0 and step % j.probe_every == 0
        probe_metrics: dict = {}
        for epoch in range(cfg.grpo.inner_epochs):
            for local, global_rows in plan.minibatches(epoch, cfg.run.seed, step):
                local = local.to(self.device)
                # the minibatch's mean is over its valid rows on all ranks (see GRPOStepLoss.denominator)
                denom = float(mask_global[global_rows].sum()) / plan.world_size
                loss = GRPOStepLoss(traj.step_batch(local, adv_values, adv_mask),
                                    noise_level=cfg.sampling.noise_level, clip_range=cfg.grpo.clip_range,
                                    beta=cfg.grpo.beta, scale=1.0 / len(steps), denominator=denom)
                mb_cond, on_policy = index_cond(cond, local), optimizer_steps == 0
                if probe and optimizer_steps == 0:  # before the update's backward: it leaves .grad cleared
                    t_probe = time.perf_counter()
                    probe_metrics = probe_minibatch(policy, mb_cond, loss, steps, j, self.engine.params,
                                                    on_policy=on_policy)
                    probe_metrics["time_probe"] = time.perf_counter() - t_probe
                stats = backward_minibatch(policy, mb_cond, loss, steps, j, on_policy=on_policy,
                                           backward=self.engine.backward, reduce=self._route_reduce)
                grad_norm = self.engine.step()
                optimizer_steps += 1
                total.add(stats)
                for key, value in {**loss.summary(), "grad_norm": grad_norm}.items():
                    metrics.setdefault(key, []).append(value)
        summary = reduce_metrics(metrics)
        summary["optimizer_steps"] = optimizer_steps
        return total, {**summary, **probe_metrics}

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        g = cfg.grpo.group_size
        # 1. prompts (the same on every rank) and this rank's rows of the rollout
        t0 = time.perf_counter()
        records = [r for r in self.source.next_prompts() for _ in range(g)]
        plan = StepRows.plan(len(records), cfg.train.batch_size, cfg.run.seed, step, self.dist.rank,
                             self.dist.world_size)
        mine = plan.mine
        prompts = [records[i].prompt for i in mine.tolist()]
        metadata = [records[i].metadata for i in mine.tolist()]
        cond = self.encode(prompts)
        self.model.eval()
        # 2. rewards: each chunk is decoded and scored (in a worker thread) while the next one samples
        background = cfg.reward.background and not (cfg.reward.shard and self.dist.world_size > 1)
        scorer = ChunkScorer(self.reward, self.model.decode, background=background)
        on_chunk = lambda idx, final: scorer.add(final, [prompts[i] for i in idx.tolist()],  # noqa: E731
                                                 [metadata[i] for i in idx.tolist()])
        steps = self.trained_steps_at(step)
        sde_steps = set(steps) if cfg.sampling.sde_window else None
        with self._comm("rollout"):
            traj = self.rollout(cond, mine, step, on_chunk=on_chunk, sde_steps=sde_steps)
        t1 = time.perf_counter()
        local = scorer.finish()
        # gathered so that every rank sees the whole batch (and takes the same decisions)
        parts = {}
        with self._comm("reward"):
            for name, p in local.items():
                scores = torch.zeros(len(records))
                valid = torch.zeros(len(records), dtype=torch.bool)
                scores[plan.all_rows] = self.dist.all_gather_tensor(p.scores.float().to(self.device)).cpu()
                valid[plan.all_rows] = self.dist.all_gather_tensor(p.valid.to(self.device)).cpu()
                parts[name] = ComponentScores(scores, valid)
        failed = check_failures(parts, cfg.reward.max_fail_frac)
        # 3. advantages over the prompt groups (row i is in group i // G)
        t2 = time.perf_counter()
        groups = [i // g for i in range(len(records))]
        total, valid_all = self.reward.weighted_sum(parts)
        adv_kw = dict(global_std=cfg.grpo.global_std, adv_clip_max=cfg.grpo.adv_clip_max)
        if cfg.reward.aggregate == "advantage" and len(parts) > 1:
            adv = combine_advantages([(self.reward.weights[n], compute_advantages(p.scores, groups, valid=p.valid,
                                                                                  **adv_kw))
                                      for n, p in parts.items()], groups, valid_all)
        else:
            adv = compute_advantages(total, groups, valid=valid_all, **adv_kw)
        # 4. update on this rank's slice of every minibatch
        self.model.train()
        with self._comm("train"):
            stats, loss_metrics = self.update(traj, cond, adv.values[mine].to(self.device),
                                              adv.mask[mine].to(self.device), adv.mask, plan, step, steps)
        t3 = time.perf_counter()
        ok = total[valid_all]
        per_reward = {}
        if len(parts) > 1:
            for name, p in parts.items():
                per_reward[f"reward_{name}_mean"] = float(p.scores[p.valid].mean()) if p.valid.any() else float("nan")
                per_reward[f"reward_{name}_failed"] = failed[name]
        metrics = {
            "step": step,
            "reward_mean": float(ok.mean()) if len(ok) else float("nan"),
            "reward_std": float(ok.std(unbiased=False)) if len(ok) else float("nan"),
            "reward_failed": int((~valid_all).sum()),
            **per_reward,
            "zero_std_groups": adv.zero_std_groups,
            "loss": stats.loss / max(1, loss_metrics["optimizer_steps"]),
            **loss_metrics,
            "windows": stats.windows,
            "windows_jagg": stats.windows_jagg,
            "intermediate_forward": stats.intermediate.count("forward"),
            "backward_calls": stats.backward_calls,
            "backward_passes": stats.backward_passes,
            "per_step_equiv": stats.per_step_equiv,
            "nograd_forward_passes": stats.nograd_forward_passes,
            "pass_ratio": stats.backward_passes / max(1, stats.per_step_equiv),  # transformer rows vs per-step
            **({"sde_window_start": steps[0]} if cfg.sampling.sde_window else {}),
            **({"knots": " ".join(map(str, stats.knots[0]))} if stats.knots else {}),
            "time_rollout": t1 - t0,  # includes the reward scoring that overlapped it
            "time_reward": t2 - t1,  # reward time not hidden behind the rollout
            "time_train": t3 - t2 - loss_metrics.get("time_probe", 0.0),  # the probe is diagnostics, not training
        }
        metrics.update(self.engine.comm.take())  # collectives per phase (nothing on one process)
        return self.dist.mean_over_ranks(metrics, {"ratio_max": "max", "ratio_min": "min"})

    def _comm(self, phase: str):
        return self.engine.comm.phase(phase)

    # ----------------------------------------------------------------------------------------------------------
    # the loop, checkpoints, resume
    # ----------------------------------------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        cfg = self.cfg
        main = self.dist.is_main
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            (self.out / "PREEMPTED").unlink(missing_ok=True)
        wandb_cfg = {"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode} if cfg.log.wandb else None
        logger = RunLogger(self.out, total_steps=cfg.train.steps, start_step=self.start_step,
                           progress=cfg.log.progress, wandb_cfg=wandb_cfg, config=cfg.to_dict()) if main else None
        history = []
        try:
            with self.preemption.armed():
                if self.eval_prompts is not None and self.start_step == 0:
                    self.evaluate(0)
                for step in range(self.start_step, cfg.train.steps):
                    metrics = self.train_step(step)
                    if logger is not None:
                        logger.log(metrics)
                    history.append(metrics)
                    last = step + 1 == cfg.train.steps
                    preempted = self._agree(self.preemption.requested)
                    if last or preempted or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                        self.save(step + 1)
                        self.export()
                    if preempted:
                        self._exit_preempted(step + 1)
                    if self.eval_prompts is not None and (last or (cfg.eval.every and (step + 1) % cfg.eval.every == 0)):
                        self.evaluate(step + 1)
        finally:
            if logger is not None:
                logger.close()
            if hasattr(self.source, "close"):
                self.source.close()
        return history

    def _agree(self, flag: bool) -> bool:
        """True on every rank if any rank got a preemption signal (one tiny all-gather when distributed)."""
        if not self.dist.active:
            return flag
        return bool(self.dist.all_gather_tensor(torch.tensor([int(flag)], device=self.device)).max())

    def _exit_preempted(self, next_step: int) -> None:
        """Checkpoint written: mark the run as preempted (the sbatch template requeues on this marker) and exit
        with 128 + the signal number, as a process killed by it would."""
        sig = self.preemption.signal_number
        if self.dist.is_main:
            (self.out / "PREEMPTED").write_text(f"signal {sig}; checkpoint at step {next_step}\n")
        log.warning("preempted by signal %s: checkpoint at step %d written, exiting", sig, next_step)
        raise SystemExit(128 + int(sig))

    def evaluate(self, step: int) -> dict:
        """ODE samples on the held-out prompts after `step` updates -> out/eval/step_XXXXXXXX/{eval.json,grid.png}."""
        result = self.evaluate_to(self.out / "eval" / f"step_{step:08d}")
        self.evals[step] = result
        log.info("eval after %d steps: %s %.4f +- %.4f over %d images", step, result["reward"],
                 result["reward_mean"], result["reward_std"], result["num_images"])
        return result

    def evaluate_to(self, out_dir: Path) -> dict:
        """Every rank runs the same evaluation (a sharded model needs all ranks in its forward); rank 0 writes."""
        with self.engine.ema_weights():  # the EMA weights when train.ema_decay > 0
            return evaluate(self.model, self.velocity_fn(self.model), self.encode, self.reward, self.cfg,
                            self.eval_prompts, out_dir if self.dist.is_main else None)

    def save(self, next_step: int) -> Path:
        state = {"step": next_step, "prompts": self.source.state_dict(), "config": self.cfg.to_dict(),
                 "world_size": self.dist.world_size}

        def write(tmp: Path) -> None:
            self.engine.save(tmp)
            torch.save(capture_rng_state(), tmp / f"rng_rank{self.dist.rank:05d}.pt")

        return save_checkpoint_dir(self.ckpt_root, next_step, write=write, state=state,
                                   keep_last=self.cfg.run.keep_last, dist=self.dist)

    def export(self) -> Path | None:
        """Weights in the backbone's own format beside the checkpoints: a diffusers LoRA directory
        (`pipe.load_lora_weights(dir)`) or a full `save_pretrained` transformer. Gathered from the shards when
        sharded (collective); written by rank 0 to a temp dir, then renamed over the previous export."""
        if not hasattr(self.model, "save_full"):
            return None
        with self.engine.ema_weights():  # the EMA weights when train.ema_decay > 0
            state = self.engine.full_state_dict()  # gathered on rank 0 when sharded (collective)
            if not self.dist.is_main:
                return None
            final = self.out / ("lora" if self.lora else "transformer")
            tmp = self.out / (final.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            (self.model.save_lora if self.lora else self.model.save_full)(tmp, state=state)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def load_weights(self, path: Path) -> None:
        """Model (and optimizer) state from a verified checkpoint directory."""
        if self.dist.is_main:
            verify_checkpoint(path)
        self.dist.barrier()
        self.engine.load(Path(path))

    def _resume(self) -> None:
        setting = self.cfg.run.resume
        if setting == "none":
            return
        path = None
        if self.dist.is_main:  # one rank reads and hashes; the others follow its choice
            path = find_resume_checkpoint(self.ckpt_root) if setting == "auto" else Path(setting)
        path = self.dist.broadcast_object(str(path) if path is not None else None)
        if path is None:
            log.info("run.resume=auto: no complete checkpoint under %s, starting fresh", self.ckpt_root)
            return
        path = Path(path)
        state = json.loads((path / STATE).read_text())
        saved_model = state.get("config", {}).get("model")
        if saved_model is not None and saved_model != self.cfg.to_dict()["model"]:
            raise CheckpointError(f"checkpoint {path} was written for a different `model` section: {saved_model}")
        self.load_weights(path)
        rng = path / f"rng_rank{self.dist.rank:05d}.pt"
        if state.get("world_size", 1) == self.dist.world_size and rng.is_file():
            restore_rng_state(torch.load(rng, weights_only=False))
        else:  # every draw is seeded per step/row, so only unseeded global draws (none in training) differ
            log.warning("checkpoint %s: written by %s ranks, resuming on %d: global RNG state not restored",
                        path, state.get("world_size"), self.dist.world_size)
        self.source.load_state_dict(state["prompts"])
        self.start_step = int(state["step"])
        log.info("resumed from %s at step %d", path, self.start_step)


def summarize(history: list[dict], window: int = 3) -> dict:
    """Reward over the first vs the last steps and the transformer backward passes JAGG saved."""
    if not history:
        return {}
    k = min(window, len(history))
    mean = lambda rows: sum(r["reward_mean"] for r in rows) / len(rows)  # noqa: E731
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
