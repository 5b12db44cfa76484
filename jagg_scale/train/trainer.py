"""The GRPO trainer. One training step reads top to bottom:

    prompts -> rollout (SDE, log-probs, velocities) -> reward -> advantages -> JAGG updates -> log -> checkpoint

Determinism: every random draw of step t comes from a generator seeded by (run.seed, t), never from global
state, so a run resumed from a checkpoint at step t draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import yaml

from ..checkpoint import (CheckpointError, capture_rng_state, find_resume_checkpoint, load_checkpoint,
                          restore_rng_state, save_checkpoint)
from ..data import GroupSampler, PromptSet, load_prompts
from ..grpo import (GRPOStepLoss, Trajectories, compute_advantages, guided_velocity, model_schedule, reduce_metrics,
                    sample_sde)
from ..jagg import trained_steps
from ..models import build_model, index_cond
from ..paths import resolve_path
from ..rewards import build_reward, score_safely
from .config import Config
from .evaluate import eval_prompts, evaluate
from .logging import RunLogger
from .update import BackwardStats, backward_minibatch, probe_minibatch

log = logging.getLogger(__name__)


def step_seed(seed: int, step: int, stream: int) -> int:
    """A distinct, reproducible seed per (run seed, step, stream); streams: 0 rollout noise, 1 minibatch order."""
    return ((seed * 1_000_003 + step) * 16 + stream) % (2**63 - 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is available")
    return torch.device(name)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = Path(cfg.run.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.device = resolve_device(cfg.run.device)

        # Inputs first: a bad prompt file or reward name fails before a model is built.
        self.prompts = (load_prompts(resolve_path(cfg.data.prompt_file)) if cfg.data.prompt_file
                        else PromptSet.from_list(cfg.data.prompts))
        self.reward = build_reward(cfg.reward.name, **cfg.reward.options)
        self.eval_prompts = eval_prompts(cfg) if cfg.eval.enabled else None
        self.evals: dict[int, dict] = {}

        torch.manual_seed(cfg.run.seed)
        self.model = build_model(cfg.model).to(self.device)
        # The KL reference: with LoRA the same transformer with its adapter off (no copy); otherwise a frozen copy
        # of the starting weights. beta = 0 skips the reference entirely: no copy, no forwards.
        self.lora = cfg.model.lora.enabled
        self.ref_model = None
        if cfg.grpo.beta > 0 and not self.lora:
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                           betas=tuple(cfg.train.adam_betas), eps=cfg.train.adam_eps)
        self.sampler = GroupSampler(len(self.prompts), cfg.train.prompts_per_step, cfg.grpo.group_size, cfg.run.seed)
        self.sigmas = model_schedule(self.model, cfg.sampling.num_steps, cfg.sampling.shift).to(self.device)
        self.steps = trained_steps(cfg.sampling.num_steps, cfg.grpo.timestep_fraction)
        self.start_step = 0
        self._resume()

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

    def trainable_state_dict(self) -> dict:
        """What a checkpoint holds of the model: every weight, or with LoRA the adapter weights alone."""
        state = self.model.state_dict()
        if not self.lora:
            return state
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trainable}

    def encode(self, prompts: list[str]):
        cond = self.model.encode_prompts(prompts)
        if self.cfg.sampling.guidance != 1.0:
            return cond, self.model.encode_prompts([""] * len(prompts))
        return cond

    # ----------------------------------------------------------------------------------------------------------
    # one training step
    # ----------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def rollout(self, cond, num: int, step: int) -> Trajectories:
        cfg = self.cfg
        gen = torch.Generator().manual_seed(step_seed(cfg.run.seed, step, 0))
        noise = torch.randn(num, *self.model.latent_shape, generator=gen)
        policy = self.velocity_fn(self.model)
        parts = []
        ref = self.reference_fn()
        for rows in torch.arange(num).split(cfg.sampling.batch_size):
            parts.append(sample_sde(policy, index_cond(cond, rows.to(self.device)), noise[rows].to(self.device),
                                    self.sigmas, noise_level=cfg.sampling.noise_level, generator=gen,
                                    ref_velocity_fn=ref))
        return Trajectories.cat(parts)

    def update(self, traj: Trajectories, cond, advantages, step: int) -> tuple[BackwardStats, dict]:
        """Inner epochs x minibatches; one optimizer step per minibatch. `auto` intermediate values are the
        cached ones until the first optimizer step on this rollout, fresh forwards after it."""
        cfg, j = self.cfg, self.cfg.jagg
        total = BackwardStats()
        metrics: dict[str, list] = {}
        policy = self.velocity_fn(self.model)
        gen = torch.Generator().manual_seed(step_seed(cfg.run.seed, step, 1))
        n = traj.latents.shape[1]
        optimizer_steps = 0
        probe = j.probe_every > 0 and step % j.probe_every == 0
        probe_metrics: dict = {}
        for _ in range(cfg.grpo.inner_epochs):
            for rows in torch.randperm(n, generator=gen).split(cfg.train.batch_size):
                rows = rows.to(self.device)
                loss = GRPOStepLoss(traj.step_batch(rows, advantages.values, advantages.mask),
                                    noise_level=cfg.sampling.noise_level, clip_range=cfg.grpo.clip_range,
                                    beta=cfg.grpo.beta, scale=1.0 / len(self.steps))
                mb_cond, on_policy = index_cond(cond, rows), optimizer_steps == 0
                if probe and optimizer_steps == 0:  # before the update's backward: it leaves .grad cleared
                    t_probe = time.perf_counter()
                    probe_metrics = probe_minibatch(policy, mb_cond, loss, self.steps, j, self.params,
                                                    on_policy=on_policy)
                    probe_metrics["time_probe"] = time.perf_counter() - t_probe
                stats = backward_minibatch(policy, mb_cond, loss, self.steps, j, on_policy=on_policy)
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf"))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                optimizer_steps += 1
                total.add(stats)
                for key, value in {**loss.summary(), "grad_norm": float(grad_norm)}.items():
                    metrics.setdefault(key, []).append(value)
        summary = reduce_metrics(metrics)
        summary["optimizer_steps"] = optimizer_steps
        return total, {**summary, **probe_metrics}

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        # 1. prompts and rollout
        t0 = time.perf_counter()
        prompt_ids = self.sampler.next_batch()
        records = [self.prompts[i] for i in prompt_ids]
        prompts = [r.prompt for r in records]
        cond = self.encode(prompts)
        self.model.eval()
        traj = self.rollout(cond, len(prompts), step)
        # 2. reward
        t1 = time.perf_counter()
        images = self.model.decode(traj.final)
        scores, valid, n_failed = score_safely(self.reward, images, prompts, [r.metadata for r in records],
                                               max_fail_frac=cfg.reward.max_fail_frac)
        # 3. advantages
        t2 = time.perf_counter()
        adv = compute_advantages(scores, prompt_ids, global_std=cfg.grpo.global_std,
                                 adv_clip_max=cfg.grpo.adv_clip_max, valid=valid)
        # 4. update
        self.model.train()
        stats, loss_metrics = self.update(traj, cond, adv, step)
        t3 = time.perf_counter()
        ok = scores[valid]
        return {
            "step": step,
            "reward_mean": float(ok.mean()) if len(ok) else float("nan"),
            "reward_std": float(ok.std(unbiased=False)) if len(ok) else float("nan"),
            "reward_failed": n_failed,
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
            "time_rollout": t1 - t0,
            "time_reward": t2 - t1,
            "time_train": t3 - t2 - loss_metrics.get("time_probe", 0.0),  # the probe is diagnostics, not training
        }

    # ----------------------------------------------------------------------------------------------------------
    # the loop, checkpoints, resume
    # ----------------------------------------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        wandb_cfg = {"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode} if cfg.log.wandb else None
        logger = RunLogger(self.out, total_steps=cfg.train.steps, start_step=self.start_step,
                           progress=cfg.log.progress, wandb_cfg=wandb_cfg, config=cfg.to_dict())
        history = []
        try:
            if self.eval_prompts is not None and self.start_step == 0:
                self.evaluate(0)
            for step in range(self.start_step, cfg.train.steps):
                metrics = self.train_step(step)
                logger.log(metrics)
                history.append(metrics)
                last = step + 1 == cfg.train.steps
                if last or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                    self.save(step + 1)
                    self.export()
                if self.eval_prompts is not None and (last or (cfg.eval.every and (step + 1) % cfg.eval.every == 0)):
                    self.evaluate(step + 1)
        finally:
            logger.close()
        return history

    def evaluate(self, step: int) -> dict:
        """ODE samples on the held-out prompts after `step` updates -> out/eval/step_XXXXXXXX/{eval.json,grid.png}."""
        result = self.evaluate_to(self.out / "eval" / f"step_{step:08d}")
        self.evals[step] = result
        log.info("eval after %d steps: %s %.4f +- %.4f over %d images", step, result["reward"],
                 result["reward_mean"], result["reward_std"], result["num_images"])
        return result

    def evaluate_to(self, out_dir: Path) -> dict:
        return evaluate(self.model, self.velocity_fn(self.model), self.encode, self.reward, self.cfg,
                        self.eval_prompts, out_dir)

    def save(self, next_step: int) -> Path:
        tensors = {"model": self.trainable_state_dict()}
        if self.ref_model is not None:
            tensors["ref_model"] = self.ref_model.state_dict()
        state = {"step": next_step, "sampler": self.sampler.state_dict(), "config": self.cfg.to_dict()}
        return save_checkpoint(self.ckpt_root, next_step, tensors=tensors,
                               objects={"optimizer": self.optimizer.state_dict(), "rng": capture_rng_state()},
                               state=state, keep_last=self.cfg.run.keep_last)

    def load_model_weights(self, state: dict, path) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=not self.lora)
        if unexpected or (self.lora and set(state) != set(self.trainable_state_dict())):
            raise CheckpointError(f"checkpoint {path} does not fit the model: unexpected {unexpected[:5]}")

    def export(self) -> Path | None:
        """Weights in the backbone's own format beside the checkpoints: a diffusers LoRA directory
        (`pipe.load_lora_weights(dir)`) or a full `save_pretrained` transformer. Written to a temp dir, then
        renamed over the previous export."""
        if not hasattr(self.model, "save_full"):
            return None
        final = self.out / ("lora" if self.lora else "transformer")
        tmp = self.out / (final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (self.model.save_lora if self.lora else self.model.save_full)(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def _resume(self) -> None:
        setting = self.cfg.run.resume
        if setting == "none":
            return
        path = find_resume_checkpoint(self.ckpt_root) if setting == "auto" else Path(setting)
        if path is None:
            log.info("run.resume=auto: no complete checkpoint under %s, starting fresh", self.ckpt_root)
            return
        ckpt = load_checkpoint(path)  # verifies the manifest first
        saved_model = ckpt.state.get("config", {}).get("model")
        if saved_model is not None and saved_model != self.cfg.to_dict()["model"]:
            raise CheckpointError(f"checkpoint {path} was written for a different `model` section: {saved_model}")
        self.load_model_weights(ckpt.tensors["model"], path)
        if self.ref_model is not None:
            if "ref_model" not in ckpt.tensors:
                raise CheckpointError(f"checkpoint {path} has no reference model but grpo.beta > 0")
            self.ref_model.load_state_dict(ckpt.tensors["ref_model"])
        self.optimizer.load_state_dict(ckpt.objects["optimizer"])
        restore_rng_state(ckpt.objects["rng"])
        self.sampler.load_state_dict(ckpt.state["sampler"])
        self.start_step = int(ckpt.state["step"])
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
