"""Study whole_step: one rank's share of sd35m_pickscore's training step at production proportions, phase by phase.

One rank's share of `configs/sd35m_pickscore.yaml`'s training step at production proportions
(`tools/bench/whole_step.py`): four trainers built from that config (the fast recipe from its own,
configs/sd35m_pickscore_fast.yaml) on the SD3-shaped bench model, scaled by rows only, step round-robin after a
warm-up step each; `--set gpus=32` takes a rank's share on 32 GPUs (36 rows in production, 4 here). Flow-GRPO runs
its train_sd3.py update (FlowGRPOUpdater: its 9-row batch scaled, the conditional and unconditional rows in one
forward with grad, the reference at training, no checkpointing); the shipped recipe as shipped; then one optimizer
step a rollout; then the fast recipe, each arm one change on the one before. Phases are timed by wrapping the
trainer's own callables. The step-time model (`jagg_scale/estimate/steptime.py`) is priced with this model's passes
measured in the same run and set beside the measured phases. A study, not in the default run.

The arms, on common.SD3_FULL as a diffusers StableDiffusion3Pipeline with tiny text encoders and VAE:

    Flow-GRPO        scripts/train_sd3.py as it runs (yifan123/flow_grpo, commit ac4c86e): the rollout in its
                     9-row batch, no reference in the rollout; then per minibatch, per 9-row training batch and per
                     trained step (lines 864-941) ONE forward of the unconditional and conditional rows together
                     with grad (compute_log_prob, lines 180-215: the unconditional half detached), the KL
                     reference's CFG forward with the adapter off (lines 875-878), a backward; the optimizer step at
                     the minibatch's end; no activation checkpointing. FlowGRPOUpdater below, in this bench only.
    shipped          the config as shipped (JAGG windows, rollout at `auto`, reference where grpo.ref_at says,
                     per-block checkpointing)
    one step a rollout  the shipped config with one minibatch of every row (nothing to refresh)
    fast recipe      configs/sd35m_pickscore_fast.yaml: a 4-step SDE window in the first half, JAGG over it,
                     DPM-Solver++(2M) on 2 ODE steps outside it (MixGRPO-Flash's compressed rollout), one
                     optimizer step a rollout

Proportions: a rank of the 8-GPU production step holds 144 rows (48 prompts x 24 / 8) in 2 minibatches of 72,
samples in 72-row chunks (sampling.chunk_size auto) where Flow-GRPO samples and trains 9 rows at a time; here a
rank holds ROWS = 16 (2 prompts x 8) in 2 minibatches of 8, samples in 8-row chunks, Flow-GRPO in
round(16 x 9 / 144) = 1. The schedule (10 steps, 9 trained), CFG 4.5, the noise level, the KL weight, LoRA r32 and
the text length's share of the tokens (205 of 1229; here 48 of 304) are the config's. float32 on the CPU, inline
reward scoring (the phases are timed one after another), a cheap reward (jpeg_compressibility) for PickScore.

Phases, timed by wrapping the trainer's own callables (a CPU runs them synchronously): sampling (the rollout's
policy forwards), reference (the KL reference's forwards, in the rollout or in training), train with grad (the
with-grad passes and their backwards), train no-grad (interior and unconditional refreshes), encode (the text
encoders), decode + reward. The evaluation is off (the same for every arm).

The passes that price the step-time model: no-grad and with-grad at 1 to 16 rows, LoRA and checkpointing, in
passes.json's format; the model within 20% of the measured step is the target.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from .common import ROOT, SD3_FULL, SD3_QUICK, median, paired_speedup, quiet

from jagg_scale.cond import cat_cond, index_cond
from jagg_scale.estimate import memory as E
from jagg_scale.estimate import steptime as T
from jagg_scale.grpo.rollout import guide
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.runner import BackwardStats, UpdateTotals, micro_batches
from jagg_scale.train.update import GRPO

PROD_ROWS, FG_BATCH_PROD = 144, 9  # a rank's rows on 8 GPUs; Flow-GRPO's per-GPU batch (config/grpo.py:118, :124)
PHASES = ("sampling", "reference", "train", "train_nograd", "encode", "decode", "reward")
MODEL_PHASES = {"sampling": "rollout", "reference": "reference", "train": "train", "train_nograd": "train_nograd",
                "encode": "encode", "decode": "decode"}
# each arm one change on the one before it: the faithful recipe as shipped, then one optimizer step a rollout (no
# refresh), then the fast recipe (configs/sd35m_pickscore_fast.yaml: its SDE window, dpm2 and one step a rollout)
ARMS = ("Flow-GRPO", "shipped", "one step a rollout", "fast recipe")
CONFIGS = {"fast recipe": "configs/sd35m_pickscore_fast.yaml"}  # the others: configs/sd35m_pickscore.yaml
FULL = {"rows": 16, "shape": SD3_FULL, "t5": 16, "rounds": 3, "calib_rows": (1, 2, 4, 8, 16), "reps": 3}
QUICK = {"rows": 4, "shape": SD3_QUICK, "t5": 4, "rounds": 1, "calib_rows": (1, 2), "reps": 1}


class FlowGRPOUpdater(GRPO):
    """Flow-GRPO's update phase as scripts/train_sd3.py runs it (see the module docstring): per training batch of
    train.micro_batch_size rows and per trained step, one forward of [uncond; cond] rows with grad, u detached, the
    guided velocity into the loss; the reference's guided velocity with the adapter off, no grad, at that point;
    one backward per step; one optimizer step per minibatch. The rollout runs no reference."""

    def rollout_spec(self, step: int):
        return dataclasses.replace(super().rollout_spec(step), ref_steps=frozenset(), ref_plan=None)

    def update(self, traj, cond, adv, rows, step: int) -> dict:
        cfg, g = self.cfg, self.policy.guidance
        steps = self.trained_steps_at(step)
        predict, ref = self.policy.model_fn(), self.policy.reference_fn()
        c_all, u_all = self.policy.split_cond(cond)
        minibatch = self._minibatches(traj, c_all, u_all, adv, rows, step, steps, guidance=1.0)  # first N: `steps`
        done = UpdateTotals()
        for epoch in range(cfg.grpo.inner_epochs):
            for local, global_rows in rows.minibatches(epoch, cfg.run.seed, step):
                mb = minibatch(epoch, local, global_rows, done.applied == 0)
                batch, loss = mb.batch, mb.loss
                chunks = micro_batches(len(local), cfg.train.micro_batch_size)
                total = []
                for i, mrows in enumerate(chunks):
                    sub, idx = batch.rows(mrows), local[mrows]
                    c, u_cond = index_cond(c_all, idx), index_cond(u_all, idx)
                    n = sub.latents.shape[1]
                    for j, k in enumerate(traj.positions(steps)):  # positions in what it stores
                        x, s = sub.latents[k], sub.sigmas[k].expand(n)
                        if ref is not None:
                            with torch.no_grad():
                                sub.ref_velocities[k] = ref(x, s, (c, u_cond)).float()
                        out = predict(torch.cat([x, x]), torch.cat([s, s]), cat_cond([u_cond, c]))
                        v = guide(out[n:], out[:n].detach(), g).float()
                        value = loss(sub, k, v)
                        last = i == len(chunks) - 1 and j == len(steps) - 1
                        self.engine.backward(value, torch.ones_like(value), last=last)
                        total.append(value.detach())
                stats = BackwardStats(windows=len(steps), backward_calls=len(steps) * len(chunks),
                                      backward_passes=len(steps), per_step_equiv=len(steps),
                                      loss=torch.stack(total).sum())
                self.runner.optimizer_step(done, stats, loss, step)
        return done.metrics()


class PhaseClock:
    """Seconds per phase of one training step, from wrappers around the trainer's own callables. On a GPU pass
    `sync` (torch.cuda.synchronize): each timed call is then closed by it, so its kernels are counted in its phase."""

    def __init__(self, trainer: Trainer, sync=None):
        self.t, self.where, self.in_ref = {}, "rollout", False
        done = sync or (lambda: None)
        policy, model, algorithm = trainer.policy, trainer.model, trainer.algorithm
        model_fn, reference_fn, encode = policy.model_fn, policy.reference_fn, policy.encode
        decode, score = model.decode, trainer.reward.score_components

        def timed(fn, phase):
            def run(*a, **k):
                done()
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    done()
                    key = phase() if callable(phase) else phase
                    self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0
            return run

        def nograd_forwards(f):  # a no-grad policy forward in training (not one inside the reference's call)
            def run(x, s, c):
                if torch.is_grad_enabled() or self.in_ref or self.where != "train":
                    return f(x, s, c)
                return timed(f, "train_nograd")(x, s, c)
            return run

        def reference(f):
            def run(x, s, c):
                self.in_ref = True
                try:
                    return timed(f, f"reference_{self.where}")(x, s, c)
                finally:
                    self.in_ref = False
            return run

        policy.model_fn = lambda *a, **k: nograd_forwards(model_fn(*a, **k))
        policy.reference_fn = lambda: (lambda f: None if f is None else reference(f))(reference_fn())
        policy.encode = timed(encode, "encode")
        model.decode = timed(decode, "decode")
        trainer.reward.score_components = timed(score, "reward")
        call = algorithm.update

        def in_train(*a, **k):
            self.where = "train"
            try:
                return call(*a, **k)
            finally:
                self.where = "rollout"

        algorithm.update = in_train

    def step(self, trainer: Trainer, step: int) -> dict:
        self.t = {}
        m = trainer.train_step(step)
        t = self.t
        ref = t.get("reference_rollout", 0.0) + t.get("reference_train", 0.0)
        inline = t.get("encode", 0.0) + t.get("decode", 0.0) + t.get("reward", 0.0) + t.get("reference_rollout", 0.0)
        return {"sampling": m["time_rollout"] - inline, "reference": ref,
                "train": m["time_train"] - t.get("train_nograd", 0.0) - t.get("reference_train", 0.0),
                "train_nograd": t.get("train_nograd", 0.0), "encode": t.get("encode", 0.0),
                "decode": t.get("decode", 0.0), "reward": t.get("reward", 0.0) + m["time_reward"],
                "step": m["time_rollout"] + m["time_reward"] + m["time_train"],
                "backward_passes": float(m["backward_passes"]), "per_step_equiv": float(m["per_step_equiv"])}


def fg_batch(rows: int, production_rows: int = PROD_ROWS) -> int:
    """Flow-GRPO's 9-row batch at this many rows per rank (`production_rows` in production)."""
    return max(1, round(rows * FG_BATCH_PROD / production_rows))


def own_overrides(arm: str, rows: int, production_rows: int = PROD_ROWS) -> list[str]:
    """What an arm changes in its config (beyond the scale)."""
    fg = fg_batch(rows, production_rows)
    every = [f"train.minibatch_size={rows}"]  # one minibatch of every row (micro-batches of half: 2 chunks)
    return {
        "Flow-GRPO": ["jagg=null", "jagg.mode=exact", "grpo.ref_at=steps", f"sampling.chunk_size={fg}",
                      f"train.micro_batch_size={fg}", "parallel.activation_checkpointing=false"],
        "shipped": [],
        "one step a rollout": every,
        "fast recipe": every,
    }[arm]


def arm_overrides(arm: str, size: dict, pipe: Path, out: Path) -> list[str]:
    """The scale (the bench model, the rows of a rank, float32, a cheap inline reward, no eval), then the arm's."""
    rows = size["rows"]
    scale = [f"model.pretrained={pipe}", "model.lora.expect_modules=null", "model.dtype=float32",
             f"model.max_sequence_length={size['t5']}",
             f"model.resolution={2 * size['shape']['sample_size']}", "parallel.engine=none",
             "train.prompts_per_step=2", f"grpo.group_size={rows // 2}", f"train.minibatch_size={rows // 2}",
             f"train.micro_batch_size={rows // 2}", "data.prompt_file=null",
             "data.prompts=[a red apple on a table, a blue sky over the sea]", "reward.name=jpeg_compressibility",
             "reward.options={}", "reward.background=false", "eval.enabled=false", "log.wandb=false",
             "log.progress=false", "run.checkpoint_every=0", "run.resume=none", "train.steps=1000", "run.device=cpu",
             f"run.output_dir={out / arm.replace(' ', '_').replace('+', 'plus')}"]
    return scale + own_overrides(arm, rows, size["production_rows"])


def build(arm: str, size: dict, pipe: Path, out: Path) -> Trainer:
    config = CONFIGS.get(arm, "configs/sd35m_pickscore.yaml")
    cfg = load_config(str(ROOT / config), arm_overrides(arm, size, pipe, out))
    trainer = Trainer(cfg)
    if arm == "Flow-GRPO":
        trainer.algorithm = FlowGRPOUpdater(cfg, trainer.policy, trainer.engine, trainer.dist)
    return trainer


def _shares(trainer: Trainer) -> dict:
    """What the step-time model reads of the memory estimate: the rank's rows, its minibatch share, the micro-batch
    and the rollout chunk, here the ones the trainer resolved (sampling.chunk_size auto off a GPU: half the rows)."""
    R, B = E.local_rows(trainer.cfg, 1)
    return {"local_rows": R, "local_batch": B, "micro_batch_size": min(trainer.cfg.train.micro_batch_size or B, B),
            "sampling_batch": trainer.policy.rollout_batch}


def calibrate(trainer: Trainer, F: float, size: dict) -> dict:
    """Passes of the bench model measured here, in passes.json's format: no-grad, and with grad (LoRA, per-block
    checkpointing: forward, recomputed forward, backward), medians of `reps` after one warm-up, at each row count."""
    predict = trainer.policy.model_fn()
    c, _ = trainer.policy.split_cond(trainer.policy.encode(["a red apple on a table"]))
    out = {"gpu": "this CPU (the bench model)", "forward_tflop_per_row": F / 1e12, "grad": [], "nograd": []}
    for n in size["calib_rows"]:
        x = torch.randn(n, *trainer.model.latent_shape)
        s = torch.rand(n)
        cond = index_cond(c, torch.zeros(n, dtype=torch.long))
        for kind in ("nograd", "grad"):
            times = []
            for _ in range(size["reps"] + 1):
                t0 = time.perf_counter()
                if kind == "nograd":
                    with torch.no_grad():
                        predict(x, s, cond)
                else:
                    predict(x, s, cond).float().square().mean().backward()
                times.append(time.perf_counter() - t0)
            out[kind].append([n, median(times[1:])])
    for p in trainer.engine.params:
        p.grad = None
    return out


def parse_settings(settings: dict[str, str]) -> dict:
    """`--set gpus=N`: a rank's share at N GPUs' proportions (8: 16 rows a rank for production's 144; 32: 4 for
    36); an unknown key or a count that leaves no row is an error naming it."""
    bad = sorted(set(settings) - {"gpus"})
    if bad:
        raise SystemExit(f"whole_step: unknown --set keys {bad}; known: ['gpus']")
    gpus = int(settings["gpus"])
    if gpus < 1 or PROD_ROWS * 8 % gpus or FULL["rows"] * 8 % gpus or FULL["rows"] * 8 // gpus < 2:
        raise SystemExit(f"whole_step: --set gpus={gpus} must split 144 x 8 rows and leave >= 2 here (8, 16, 32, 64)")
    return {"gpus": gpus}


def run(quick: bool, gpus: int = 8) -> dict:
    size = dict(QUICK if quick else FULL)
    # a rank's rows at this cluster size, in production and here (the same ratio)
    size.update(rows=max(2, size["rows"] * 8 // gpus), production_rows=PROD_ROWS * 8 // gpus)
    quiet()
    from jagg_scale.models.tiny import make_tiny_sd3

    with tempfile.TemporaryDirectory(prefix="jagg_bench_whole_") as tmp:
        work = Path(tmp)
        pipe = make_tiny_sd3(work / "pipe", seed=0, transformer=size["shape"])
        trainers = {a: build(a, size, pipe, work) for a in ARMS}
        clocks = {a: PhaseClock(t) for a, t in trainers.items()}
        for a in ARMS:  # warm-up: first-use allocations, the autocast caches
            clocks[a].step(trainers[a], 0)
        records = {a: [] for a in ARMS}
        for r in range(size["rounds"]):
            order = ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]
            for a in order:
                records[a].append(clocks[a].step(trainers[a], r + 1))
            print(f"    round {r + 1}/{size['rounds']}: " + ", ".join(
                f"{a} {records[a][-1]['step']:.1f}s" for a in ARMS), flush=True)
        prepared = {a: E.prepare(trainers[a].cfg, 1, memory=False) for a in ARMS}
        s0 = prepared["shipped"]
        F = T._transformer_flops(json.dumps(s0["components"]["transformer"], sort_keys=True),
                                 s0["kind"], tuple(s0["latent"]), s0["patch"], s0["text_tokens"])
        calib = calibrate(trainers["shipped"], F, size)
        model = {a: T.step_seconds(prepared[a], _shares(trainers[a]), cfg_rows_with_grad=a == "Flow-GRPO",
                                   calib=calib) for a in ARMS}
        setup = {"rows_per_rank": size["rows"], "production_rows_per_rank": size["production_rows"], "gpus": gpus,
                 "flow_grpo_batch": fg_batch(size["rows"], size["production_rows"]),
                 "transformer": size["shape"], "tokens_per_row": [s0["image_tokens"], s0["text_tokens"]],
                 "parameters": sum(p.numel() for p in trainers["shipped"].model.parameters()),
                 "trainable": sum(p.numel() for p in trainers["shipped"].engine.params),
                 "rounds": size["rounds"], "config": "configs/sd35m_pickscore.yaml",
                 "configs": {a: CONFIGS.get(a, "configs/sd35m_pickscore.yaml") for a in ARMS},
                 "overrides": {a: own_overrides(a, size["rows"], size["production_rows"]) for a in ARMS}}
        for t in trainers.values():
            t.close()
    arms = {}
    for a in ARMS:
        rec = records[a]
        arms[a] = {p: median([x[p] for x in rec]) for p in (*PHASES, "step", "backward_passes", "per_step_equiv")}
        arms[a]["speedup_vs_flow_grpo"] = paired_speedup([x["step"] for x in records["Flow-GRPO"]],
                                                         [x["step"] for x in rec])
        arms[a]["model"] = model[a]
        measured_model_phases = sum(arms[a][p] for p in MODEL_PHASES)
        arms[a]["model_vs_measured"] = {p: (model[a][q] / arms[a][p] if arms[a][p] > 0 else None)
                                        for p, q in MODEL_PHASES.items()}
        arms[a]["model_vs_measured"]["counted phases"] = (sum(model[a][q] for q in MODEL_PHASES.values())
                                                          / measured_model_phases)
        arms[a]["all"] = rec
    ratio = {a: arms["Flow-GRPO"]["step"] / arms[a]["step"] for a in ARMS}
    model_ratio = {a: model["Flow-GRPO"]["step"] / model[a]["step"] for a in ARMS}
    # the model per phase against the measured phase, where the phase is at least 5% of the arm's step (a smaller
    # one's ratio is noise on a CPU: the encode of tiny text encoders, the decode of a tiny VAE)
    phase_errors = [abs(arms[a]["model_vs_measured"][p] - 1) for a in ARMS for p in MODEL_PHASES
                    if arms[a]["model_vs_measured"][p] is not None and arms[a][p] >= 0.05 * arms[a]["step"]]
    worst = max(phase_errors, default=0.0)
    return {"setup": setup, "arms": arms, "calibration": calib,
            "summary": {"step_speedup": ratio, "model_speedup": model_ratio, "model_worst_phase_error": worst},
            "target": {"name": "whole step >= 2.0x Flow-GRPO's as shipped, >= 3.5x with the fast recipe; the "
                               "step-time model within 15% of each measured phase of >= 5% of a step",
                       "met": ratio["shipped"] >= 2.0 and ratio["fast recipe"] >= 3.5 and worst <= 0.15}}


def markdown(res: dict) -> str:
    s, arms = res["setup"], res["arms"]
    lines = [
        f"One rank's share of `{s['config']}` at production proportions: {s['rows_per_rank']} rows per rank "
        f"(production: {s['production_rows_per_rank']}), Flow-GRPO's batch {s['flow_grpo_batch']} row(s); the "
        f"SD3-shaped bench transformer ({s['parameters']:,} parameters, {s['trainable']:,} trained by LoRA r32), "
        f"{s['tokens_per_row'][0]} image + {s['tokens_per_row'][1]} text tokens per row. Medians of "
        f"{s['rounds']} round-robin steps after a warm-up step each. Arm overrides: "
        + "; ".join(f"{a}: `{' '.join(o) or '(as shipped)'}`" for a, o in s["overrides"].items()) + ".",
        "",
        "| arm | step s | sampling | reference | train (grad) | train (no grad) | encode | decode | reward | "
        "backward passes (per-step equiv) | vs Flow-GRPO | model step s | model / measured (counted phases) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a, r in arms.items():
        lines.append(f"| {a} | {r['step']:.1f} | " + " | ".join(f"{r[p]:.1f}" for p in PHASES) +
                     f" | {r['backward_passes']:.0f} ({r['per_step_equiv']:.0f}) | {r['speedup_vs_flow_grpo']:.2f}x | "
                     f"{r['model']['step']:.1f} | {r['model_vs_measured']['counted phases']:.2f} |")
    lines += ["", "The step-time model per phase, priced with the passes measured here (model / measured):", "",
              "| arm | " + " | ".join(MODEL_PHASES) + " |", "|---|" + "---|" * len(MODEL_PHASES)]
    for a, r in arms.items():
        lines.append(f"| {a} | " + " | ".join("-" if r["model_vs_measured"][p] is None else
                                               f"{r['model_vs_measured'][p]:.2f}" for p in MODEL_PHASES) + " |")
    c = res["calibration"]
    lines += ["", "Passes measured (rows: seconds): no grad " + ", ".join(f"{n}: {t:.3f}" for n, t in c["nograd"])
              + "; with grad (LoRA, checkpointing) " + ", ".join(f"{n}: {t:.3f}" for n, t in c["grad"]) + "."]
    return "\n".join(lines)


def plot(res: dict, ax) -> None:
    colors = {p: f"C{i}" for i, p in enumerate(PHASES)}
    ref = res["arms"]["Flow-GRPO"]["step"]
    for x, r in enumerate(res["arms"].values()):
        b = 0.0
        for p in PHASES:
            ax.bar(x, r[p] / ref, bottom=b, color=colors[p], label=p if x == 0 else None)
            b += r[p] / ref
    ax.set_xticks(range(len(res["arms"])))
    ax.set_xticklabels(list(res["arms"]), fontsize=8)
    ax.set(ylabel="step time / Flow-GRPO's", title="one rank's training step at production proportions")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)

