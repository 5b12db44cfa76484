"""Part time_to_reward (a study, not in the default run): held-out reward against wall-clock on the digits task.

Held-out reward per wall-clock on the digits task (`tools/bench/time_to_reward.py`): every arm trains the same
config (the study's pinned recipe) from the same weights and seeds for the same steps (the same prompts); the seeds
are split over worker processes, each holding every arm as a trainer and stepping them round-robin, so the machine's
noise hits every arm alike. Wall-clock is whole steps (rollout + reward + training phase; no probe, evaluations not
counted). Flow-GRPO is every step SDE and trained per step; JAGG W4 and the knot planner (S = 2.67) change only the
backward; Fast k2 (Flow-GRPO-Fast) samples and trains a 2-step SDE window, per step; `JAGG in SDE k4` a 4-step
window with one JAGG joint pass; `+ dpm2` also compresses the ODE outside the window (`sampling.ode_solver: dpm2`,
DPM-Solver++(2M), on `sampling.ode_steps` steps: MixGRPO-Flash; the steps are shared between the parts before and
after the window in proportion to the schedule's steps there, at least one on a non-empty side, and re-spaced evenly
in the schedule's step index; the window keeps its own sigmas, log-probs and JAGG windows). A study, not in the
default run.

The arms:

    Flow-GRPO          jagg.mode=exact: every step SDE and trained, one backward per step (the reference)
    JAGG W4            jagg.window=4, jagg_frac 1: one joint backward per window of 4 steps
    budget S2.67       jagg.planner=budget, jagg.speedup=2.67: the knot planner, T / 2.67 exact rows per sample
    Fast k2            Flow-GRPO-Fast: a 2-step SDE window (random start in the first half), per-step backward
    JAGG in SDE k4     a 4-step SDE window (same draw), JAGG W4 on it: one joint backward per sample
    ... + dpm2         the same with the compressed rollout: DPM-Solver++(2M) on 4 ODE steps outside the window
                       (MixGRPO-Flash), 8 model forwards per sample instead of 16
    per-step in SDE k4 + dpm2   MixGRPO-Flash itself: that rollout with per-step backwards in the window (what JAGG
                       adds on top of the peers' best practice is the difference to the arm above)
    CPS, JAGG W4 CPS   coefficients-preserving sampling (sampling.sde cps, noise level 0.8 as Flow-GRPO's README
                       runs it), per step and with JAGG windows of 4; the first 15 of the 16 steps trained (the step
                       to s = 0 injects no noise: timestep_fraction 0.99, Flow-GRPO's)
    NFT                DiffusionNFT (train.algorithm nft) scaled to digits: the old policy's dpm2 ODE rollout of the
                       schedule's 16 steps, 15 training timesteps per sample (timestep_fraction 0.99), one backward
                       each, beta 1, KL 1e-4, decay_type 1, the study's lr; no SDE KL (grpo.kl_beta 0)
    NFT shared noise   the same with one noise draw per sample for its 15 timesteps
    JAGG-NFT           that with one JAGG window over the 15 timesteps: 2 backwards per sample instead of 15
    JAGG-NFT W5 lines  (a variant) windows of 5 timesteps, one noise draw per window (nft.noise per_window: each
                       window on its own line, 3 draws per sample instead of 1) and the old policy's and the
                       reference's velocities at the knots only (nft.old_at knots): 6 backwards and 6 + 6 frozen
                       forwards per sample instead of 15 + 15 + 15
    Flow-DPPO, GCPO, AWM, CFG-free GRPO and their JAGG arms (OBJECTIVES, issue 36): the objectives users pick now,
                       each per step as its peer runs it and with JAGG (arm_overrides says how each is scaled to
                       digits); PAIRS reads JAGG's own share of each

Every trainer starts from the same weights and the evaluation is deterministic, so the step-0 held-out reward is
measured once.

Reported per arm: the held-out gain (final - start, mean and seed std), the gain as a fraction of Flow-GRPO's
(mean +- std over seeds, each seed's gain over Flow-GRPO's mean gain), the wall-clock of whole steps (mean over
seeds), and the wall-clock at which the seed-mean curve first reaches 95% of Flow-GRPO's final mean gain (linear
interpolation between evaluations), also as a fraction of Flow-GRPO's whole wall-clock.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import ROOT, matmul_gflops, median

from jagg_scale.train import Trainer, load_config

# the study's report (its table, notes and plot: what tools/bench/report.py calls on this part) and the names both
# halves read
from .time_to_reward_report import (REFERENCE, TARGET_FINAL, TARGET_FRAC, TARGET_TIME, markdown,  # noqa: F401
                                    notes, plot, value_at)

ARMS = ("Flow-GRPO", "JAGG W4", "budget S2.67", "Fast k2", "JAGG in SDE k4", "JAGG in SDE k4 + dpm2",
        "per-step in SDE k4 + dpm2", "CPS", "JAGG W4 CPS", "NFT", "NFT shared noise", "JAGG-NFT")
# Recipe variants, not in the default arms (the same code path as their base arm): JAGG-NFT with a stronger KL to
# the reference, the lever our GRPO default recipe pulled to keep within-prompt diversity (grpo.kl_beta 0.2).
# JAGG-NFT W4: windows of 4 of the sorted timesteps instead of one window of all (docs/algorithm.md section 8:
# gradient cosine 0.9996 vs 0.94 at K = 15), 8 backwards per sample instead of 2.
# JAGG-NFT Wn lines: windows of n, a noise draw per window (its own line), the frozen models at the knots only: the
# gradient's cosine to the expected NFT gradient (over noise draws) is 0.970 (W4) and 0.961 (W5) against 0.990 for
# NFT's own per-timestep draw and 0.870 for one shared window (docs/algorithm.md section 8). NFT kl 0.1: the peer's
# recipe with the KL weight our diversity lever needed (the pilot's JAGG-NFT kl 0.1 kept 60% of the diversity);
# kl 1: the full study's kl 0.1 kept 40% (after 64 steps), so the follow-up on diversity pulls harder.
LINES = ["nft.noise=per_window", "nft.old_at=knots"]
VARIANTS = {"JAGG-NFT kl 0.01": ("JAGG-NFT", ["nft.kl_beta=0.01"]),
            "JAGG-NFT kl 0.1": ("JAGG-NFT", ["nft.kl_beta=0.1"]),
            "JAGG-NFT W4": ("JAGG-NFT", ["jagg.window=4"]),
            "NFT kl 0.1": ("NFT", ["nft.kl_beta=0.1"]),
            "JAGG-NFT W4 lines": ("JAGG-NFT", ["jagg.window=4"] + LINES),
            "JAGG-NFT W5 lines": ("JAGG-NFT", ["jagg.window=5"] + LINES),
            "JAGG-NFT W5 lines kl 0.1": ("JAGG-NFT", ["jagg.window=5", "nft.kl_beta=0.1"] + LINES),
            "NFT kl 1": ("NFT", ["nft.kl_beta=1.0"]),
            # issue 37's fast recipe (configs/sd35m_pickscore_fast.yaml) on digits: a group's rows share x_0 (its ODE
            # prefix is then computed once per group) and the KL reference runs at the window's knots only
            "Fast JAGG recipe": ("JAGG in SDE k4 + dpm2", ["sampling.same_initial_noise=true", "grpo.ref_at=knots"]),
            "JAGG-NFT W5 lines kl 1": ("JAGG-NFT", ["jagg.window=5", "nft.kl_beta=1.0"] + LINES)}
# What the peers run (issue 23's comparison): the rest are this stack's (JAGG, or NFT's shared noise)
PEERS = ("Flow-GRPO", "Fast k2", "per-step in SDE k4 + dpm2", "CPS", "NFT", "NFT kl 0.1", "NFT kl 1", "Flow-DPPO",
         "GCPO", "AWM", "CFG-free GRPO")
# The objectives users pick now (issue 36), each per step as its peer runs it and with JAGG where it has room:
#   Flow-DPPO      UniRL's SD3.5 recipe (configs/sd35m_dppo_pickscore.yaml): 3 SDE steps scattered in the first half
#                  of the schedule, no KL to the reference, the KL-masked unclipped ratio; JAGG: one window over them
#   GCPO           chunk-level GRPO: GCPO's chunk list scaled to the 15 candidate steps, half the chunks per sample;
#                  JAGG: one joint pass per chunk
#   AWM            Flow-Factory's SD3.5 recipe on digits: 6 discrete timesteps, ghuber 0.25, KL 1e-4 to the reference
#                  and 1 to the EMA policy; JAGG-AWM: windows of 3 timesteps on one noise line each
#   CFG-free GRPO  Flow-GRPO's own Fast nocfg recipe (configs/sd35m_pickscore_nocfg.yaml): CPS 0.8, a 3-step SDE
#                  window starting in steps 0-2, beta 0 (on digits every arm samples CFG-free, so it differs from
#                  Flow-GRPO by its window and CPS); JAGG: one window over the 3
OBJECTIVES = ("Flow-DPPO", "JAGG Flow-DPPO", "GCPO", "JAGG GCPO", "AWM", "JAGG-AWM W3 lines",
              "CFG-free GRPO", "JAGG CFG-free GRPO")
PAIRS = (  # (JAGG arm, the same recipe per step, max wall-clock ratio to the latter's 95% line)
    ("JAGG in SDE k4 + dpm2", "per-step in SDE k4 + dpm2", 0.75),
    ("JAGG Flow-DPPO", "Flow-DPPO", 0.6),  # issue 36: >= 3 trained steps: >= 0.95x the gain at <= 0.6x the time
    ("JAGG GCPO", "GCPO", 0.6),
    ("JAGG-AWM W3 lines", "AWM", 0.6),
    ("JAGG CFG-free GRPO", "CFG-free GRPO", 0.6),
    ("JAGG-NFT", "NFT", 0.5),
    ("JAGG-NFT W4 lines", "NFT", 0.5),
    ("JAGG-NFT W5 lines", "NFT", 0.5),
    ("JAGG-NFT W5 lines kl 0.1", "NFT kl 0.1", 0.5),
    ("JAGG-NFT W5 lines kl 1", "NFT kl 1", 0.5),
)


def arm_overrides(arm: str, num_steps: int) -> list[str]:
    """The arm's config overrides for a schedule of `num_steps` steps. SDE windows start in the first half of the
    trajectory (Flow-GRPO-Fast's choice); the compressed rollout runs num_steps / 4 ODE steps around the window
    (4 of the 12 outside a 4-step window of 16)."""
    if arm in VARIANTS:
        base, extra = VARIANTS[arm]
        return arm_overrides(base, num_steps) + extra
    half = f"grpo.sde_window_range=[0, {num_steps // 2}]"
    window4 = ["jagg.mode=jagg", "jagg.window=4", "grpo.sde_window=4", half]
    dpm2 = ["sampling.ode_solver=dpm2", f"sampling.ode_steps={num_steps // 4}"]
    cps = ["sampling.sde=cps", "sampling.noise_level=0.8", "grpo.timestep_fraction=0.99"]  # its last step: no noise
    nft = ["train.algorithm=nft", "grpo.kl_beta=0", "sampling.ode_solver=dpm2", "grpo.timestep_fraction=0.99",
           "nft.mix=1.0", "nft.kl_beta=1e-4", "jagg=null", "jagg.mode=exact"]
    K = max(1, int(num_steps * 0.99))
    exact = ["jagg=null", "jagg.mode=exact"]
    # GCPO's published chunk list [2, 3, 4, 7] covers 16 candidate steps; over num_steps - 1 = 15 its last chunk is 6
    C = num_steps - 1
    chunks = [2, 3, 4, C - 9] if C >= 10 else [C // 2, C - C // 2]
    # GCPO trains without a KL term (its kl_coeff 0; config.py refuses grpo.kl_beta under gcpo)
    gcpo = ["train.algorithm=gcpo", f"gcpo.chunks=[{', '.join(map(str, chunks))}]", "grpo.kl_beta=null"]
    # Flow-Factory examples/awm/lora/sd3_5/default.yaml: 6 discrete_wo_init timesteps in [0, 0.9], ghuber 0.25,
    # kl 1e-4, EMA-KL 1 with the EMA at decay 0.3 on a linear schedule (its warm-up of 1000 steps scaled to the study)
    awm = ["train.algorithm=awm", "grpo.kl_beta=0", "sampling.ode_solver=dpm2", "awm.num_train_timesteps=6",
           "awm.time_sampling=discrete_wo_init", "awm.weighting=ghuber", "awm.ghuber_power=0.25", "awm.kl_beta=1e-4",
           "awm.ema_kl_beta=1.0", "awm.ema_decay=0.3", "awm.ema_schedule=linear", "awm.ema_update_interval=1",
           "awm.ema_warmup_steps=16"]
    dppo = ["train.algorithm=dppo", "grpo.kl_beta=0", "grpo.sde_window=3",
            f"grpo.sde_window_range=[0, {num_steps // 2}]", "grpo.sde_window_mode=scattered"]
    nocfg = ["sampling.sde=cps", "sampling.noise_level=0.8", "grpo.sde_window=3", "grpo.sde_window_range=[0, 5]",
             "grpo.kl_beta=0"]
    return {
        "Flow-GRPO": ["jagg=null", "jagg.mode=exact"],
        "JAGG W4": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=1.0"],
        "budget S2.67": ["jagg.mode=jagg", "jagg.planner=budget", "jagg.window=null", "jagg.speedup=2.67"],
        "Fast k2": ["jagg=null", "jagg.mode=exact", "grpo.sde_window=2", half],
        "JAGG in SDE k4": window4,
        "JAGG in SDE k4 + dpm2": window4 + dpm2,
        "per-step in SDE k4 + dpm2": ["jagg=null", "jagg.mode=exact", "grpo.sde_window=4", half] + dpm2,
        "CPS": ["jagg=null", "jagg.mode=exact"] + cps,
        "JAGG W4 CPS": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=1.0"] + cps,
        "NFT": nft,
        "NFT shared noise": nft + ["nft.noise=per_sample"],
        "JAGG-NFT": nft[:-1] + ["jagg.mode=jagg", f"jagg.window={K}", "nft.noise=per_sample"],
        "Flow-DPPO": dppo + exact,
        "JAGG Flow-DPPO": dppo + ["jagg.mode=jagg", "jagg.window=3", "jagg.jagg_frac=1.0"],
        "GCPO": gcpo + exact,
        "JAGG GCPO": gcpo + ["jagg.mode=jagg", f"jagg.window={max(chunks)}", "jagg.jagg_frac=1.0"],
        "AWM": awm + exact,
        "JAGG-AWM W3 lines": awm + ["jagg.mode=jagg", "jagg.window=3", "jagg.jagg_frac=1.0", "awm.noise=per_window",
                                    "awm.frozen_at=knots"],
        "CFG-free GRPO": nocfg + exact,
        "JAGG CFG-free GRPO": nocfg + ["jagg.mode=jagg", "jagg.window=3", "jagg.jagg_frac=1.0"],
    }[arm]


PARTIAL = Path(tempfile.gettempdir()) / "jagg_time_to_reward_partial.json"
COMMON = ["eval.enabled=true", "eval.every=0", "eval.at_start=false", "run.checkpoint_every=0",
          "log.progress=false", "log.wandb=false", "jagg.probe_every=0", "run.resume=none"]
# The study's recipe, pinned so that retuning the default job does not move it: the digits job's reward-seeking
# setting (Flow-GRPO's KL beta, per-prompt advantage std, no EMA), which gains fastest per step and so gives the
# comparison the most power for its wall-clock. Every arm trains it.
RECIPE = ["grpo.kl_beta=0.04", "grpo.global_std=false", "train.lr=2e-4", "train.ema_decay=0.0"]
# Sized so that Flow-GRPO's held-out gain is >= 5x its seed std (docs/benchmarks.md section 4): 4 seeds x 6 arms
# x 64 steps, two worker processes of 2 seeds each on a 2-core CPU, one torch thread each (~65 s per round of a
# worker's 12 trainers, ~50 s per round of its evaluations: about 80 minutes).
FULL = {"steps": 64, "eval_every": 8, "seeds": [0, 1, 2, 3], "num_steps": 16, "extra": RECIPE, "workers": 2}
QUICK = {"steps": 1, "eval_every": 1, "seeds": [0, 1], "num_steps": 8,
         "extra": ["sampling.num_steps=8", "sampling.eval_num_steps=8", "train.prompts_per_step=1",
                   "train.minibatch_size=8", "sampling.chunk_size=8", "eval.num_per_prompt=2"], "workers": 2}


def parse_settings(settings: dict[str, str]) -> dict:
    """`--set` values (strings) as run()'s keywords; an unknown key or arm is an error naming it."""
    known = {"steps": int, "eval_every": int, "workers": int,
             "seeds": lambda v: [int(x) for x in v.split(",")], "arms": lambda v: [a.strip() for a in v.split(";")]}
    bad = sorted(set(settings) - set(known))
    if bad:
        raise SystemExit(f"time_to_reward: unknown --set keys {bad}; known: {sorted(known)}")
    out = {k: known[k](v) for k, v in settings.items()}
    unknown = [a for a in out.get("arms", []) if a not in ARMS and a not in VARIANTS and a not in OBJECTIVES]
    if unknown:
        raise SystemExit(f"time_to_reward: unknown arms {unknown}; known: {[*ARMS, *VARIANTS, *OBJECTIVES]}")
    return out


def build(overrides: list[str], seed: int, steps: int, out: Path) -> Trainer:
    return Trainer(load_config(str(ROOT / "configs" / "digits_cpu.yaml"),
                               COMMON + overrides + [f"run.seed={seed}", f"train.steps={steps}",
                                                     f"run.output_dir={out}"]))


def run(quick: bool, steps: int | None = None, eval_every: int | None = None, seeds: list[int] | None = None,
        arms: list[str] | None = None, work: str | None = None, workers: int | None = None) -> dict:
    size = QUICK if quick else FULL
    steps, eval_every = steps or size["steps"], eval_every or size["eval_every"]
    seeds, arms = seeds or size["seeds"], arms or list(ARMS)
    workers = min(workers or size["workers"], len(seeds))
    if REFERENCE not in arms:
        arms = [REFERENCE, *arms]
    overrides = {a: size["extra"] + arm_overrides(a, size["num_steps"]) for a in arms}
    job = {"overrides": overrides, "steps": steps, "eval_every": eval_every, "work": work}
    if workers > 1:
        parts = _in_workers(job, [seeds[i::workers] for i in range(workers)])
    else:
        parts = [measure(**job, seeds=seeds)]
    runs = [r for part in parts for r in part["runs"]]
    starts = [part["start"] for part in parts]  # the same weights and a deterministic evaluation in every worker
    if max(starts) - min(starts) > 1e-6:
        raise RuntimeError(f"the workers' step-0 held-out rewards differ: {starts}")
    rows = summarize(runs, arms)
    setup = {"config": "configs/digits_cpu.yaml", "overrides": size["extra"], "steps": steps, "eval_every": eval_every,
             "seeds": seeds, "workers": workers, "num_steps": parts[0]["num_steps"],
             "samples_per_step": parts[0]["samples_per_step"], "eval_images": parts[0]["eval_images"],
             "arms": {a: arm_overrides(a, size["num_steps"]) for a in arms}, "reference": REFERENCE,
             "default_arms": list(ARMS), "full": {"steps": FULL["steps"], "seeds": FULL["seeds"]}}
    ref = rows[REFERENCE]
    summary = {"reference_wall_seconds": ref["wall"][0], "reference_step_seconds": ref["step_seconds"]}
    for a in arms:
        if a != REFERENCE:
            summary[f"step_speedup_{_tag(a)}"] = ref["step_seconds"] / rows[a]["step_seconds"]
    return {"setup": setup, "runs": runs, "rows": rows, "summary": summary, "target": target(rows),
            "comparisons": comparisons(rows),
            "matmul_gflops_per_eval": [g for part in parts for g in part["gflops"]], "start_reward": starts[0]}


def measure(overrides: dict[str, list[str]], seeds: list[int], steps: int, eval_every: int,
            work: str | None = None, partial: Path = PARTIAL) -> dict:
    """Train every arm x seed round-robin in this process; the per-trainer curves and step times."""
    arms = list(overrides)
    with tempfile.TemporaryDirectory(prefix="jagg_bench_ttr_") as tmp:
        work_dir = Path(work or tmp)
        trainers = {(a, s): build(overrides[a], s, steps, work_dir / f"{_tag(a)}_s{s}") for a in arms for s in seeds}
        first = trainers[(arms[0], seeds[0])]
        t0 = time.perf_counter()
        base = first.evaluate(0)  # the same weights, the same deterministic evaluation for all
        start, base_diversity = base["reward_mean"], _diversity(base)
        eval_s = time.perf_counter() - t0
        print(f"    held-out reward at step 0: {start:.4f} ({eval_s:.1f} s per evaluation; seeds {seeds})", flush=True)
        keys = list(trainers)
        runs = {k: {"arm": k[0], "seed": k[1], "step_seconds": [], "eval_steps": [0], "eval_reward": [start],
                    "eval_diversity": [base_diversity], "phases": [], "backward_passes": 0, "per_step_equiv": 0}
                for k in keys}
        gflops = []
        t_all = time.perf_counter()
        for step in range(steps):
            order = keys[step % len(keys):] + keys[: step % len(keys)]
            for key in order:
                t = time.perf_counter()
                m = trainers[key].train_step(step)
                runs[key]["step_seconds"].append(time.perf_counter() - t)
                runs[key]["phases"].append([m["time_rollout"], m["time_reward"], m["time_train"]])
                runs[key]["backward_passes"] += m["backward_passes"]
                runs[key]["per_step_equiv"] += m["per_step_equiv"]
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                for key in keys:
                    result = trainers[key].evaluate(step + 1)
                    runs[key]["eval_steps"].append(step + 1)
                    runs[key]["eval_reward"].append(result["reward_mean"])
                    runs[key]["eval_diversity"].append(_diversity(result))
                gflops.append(matmul_gflops(512, 5))
            done = time.perf_counter() - t_all
            line = ", ".join(f"{a} {statistics.mean(runs[(a, s)]['step_seconds'][-1] for s in seeds):.2f}s"
                             for a in arms)
            print(f"    seeds {seeds} step {step + 1}/{steps} ({done / 60:.1f} min): {line}", flush=True)
            partial.write_text(json.dumps(list(runs.values())))  # a long study keeps what it has measured so far
        for t in trainers.values():
            t.dist.close()
    cfg = first.cfg
    return {"runs": list(runs.values()), "start": start, "gflops": gflops, "num_steps": cfg.sampling.num_steps,
            "samples_per_step": cfg.train.prompts_per_step * cfg.grpo.group_size,
            "eval_images": len(first.eval_prompts.records) * cfg.eval.num_per_prompt}


def _in_workers(job: dict, seed_sets: list[list[int]]) -> list[dict]:
    """One process per seed set, each on its own share of the cores and round-robin over all arms, so the
    machine's noise still hits every arm alike; their results are read back from JSON files."""
    import torch

    threads = max(1, torch.get_num_threads() // len(seed_sets))
    with tempfile.TemporaryDirectory(prefix="jagg_bench_ttr_workers_") as tmp:
        procs = []
        for i, seeds in enumerate(seed_sets):
            spec = Path(tmp) / f"job{i}.json"
            spec.write_text(json.dumps({**job, "seeds": seeds,
                                        "partial": str(PARTIAL.with_name(f"{PARTIAL.stem}_{i}.json"))}))
            procs.append(subprocess.Popen([sys.executable, "-m", "tools.bench.time_to_reward", str(spec),
                                           str(spec.with_suffix(".out.json")), str(threads)], cwd=ROOT,
                                          env=dict(os.environ, OMP_NUM_THREADS=str(threads))))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"time_to_reward workers exited with {codes} (their output is above)")
        return [json.loads((Path(tmp) / f"job{i}.out.json").read_text()) for i in range(len(seed_sets))]


def _diversity(result: dict) -> float | None:
    """The evaluation's within-prompt diversity (train/diversity.py), as a number."""
    d = result.get("diversity")
    if isinstance(d, dict):
        d = d.get("mean", d.get("value"))
    return None if d is None else float(d)


def _tag(arm: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in arm.replace("+", "plus")).strip("_")


def _mean_std(xs: list[float]) -> list[float]:
    return [statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0]


def curve(rs: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """(mean cumulative wall-clock, mean held-out reward, its seed std) at each evaluation of one arm's seeds."""
    times, means, stds = [], [], []
    for i, step in enumerate(rs[0]["eval_steps"]):
        times.append(statistics.mean(sum(r["step_seconds"][:step]) for r in rs))
        m, s = _mean_std([r["eval_reward"][i] for r in rs])
        means.append(m)
        stds.append(s)
    return times, means, stds


def time_to(times: list[float], values: list[float], level: float) -> float | None:
    """The first time the piecewise-linear curve reaches `level` (None: never)."""
    for i, v in enumerate(values):
        if v >= level:
            if i == 0:
                return times[0]
            t0, t1, v0 = times[i - 1], times[i], values[i - 1]
            return t0 + (t1 - t0) * (level - v0) / (v - v0)
    return None


def summarize(runs: list[dict], arms: list[str]) -> dict:
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in arms}
    ref_gains = [r["eval_reward"][-1] - r["eval_reward"][0] for r in by_arm[REFERENCE]]
    ref_gain = statistics.mean(ref_gains)
    ref_wall = statistics.mean(sum(r["step_seconds"]) for r in by_arm[REFERENCE])
    rows = {}
    for a, rs in by_arm.items():
        gains = [r["eval_reward"][-1] - r["eval_reward"][0] for r in rs]
        times, means, stds = curve(rs)
        level = means[0] + TARGET_FRAC * ref_gain
        t95 = time_to(times, means, level) if ref_gain > 0 else None
        wall = _mean_std([sum(r["step_seconds"]) for r in rs])
        rows[a] = {
            "start": means[0], "final": [means[-1], stds[-1]], "gain": _mean_std(gains),
            "gain_frac": _mean_std([g / ref_gain for g in gains]) if ref_gain else [math.nan, math.nan],
            "wall": wall, "step_seconds": median([s for r in rs for s in r["step_seconds"]]),
            "phases": [median([p[i] for r in rs for p in r["phases"]]) for i in range(3)],
            # transformer backward passes per sample and step (B-row units: a JAGG joint pass counts 2)
            "backward_passes_per_step": statistics.mean(r["backward_passes"] for r in rs) / len(rs[0]["step_seconds"]),
            "per_step_equiv_per_step": statistics.mean(r["per_step_equiv"] for r in rs) / len(rs[0]["step_seconds"]),
            "t95": t95, "t95_frac": None if t95 is None else t95 / ref_wall,
            "curve": {"seconds": times, "reward": means, "reward_std": stds, "steps": rs[0]["eval_steps"]},
        }
    rows[REFERENCE]["gain_over_seed_std"] = (ref_gain / rows[REFERENCE]["gain"][1]
                                             if rows[REFERENCE]["gain"][1] > 0 else None)
    # against the best arm's final gain too (the study's question is what users would pick, not only Flow-GRPO)
    best = max(rows, key=lambda a: rows[a]["gain"][0])
    best_gain = rows[best]["gain"][0]
    for a, rs in by_arm.items():
        r = rows[a]
        c = r["curve"]
        r["t95_best"] = time_to(c["seconds"], c["reward"], c["reward"][0] + TARGET_FRAC * best_gain)
        divs = [x["eval_diversity"][-1] for x in rs if x.get("eval_diversity") and x["eval_diversity"][-1] is not None]
        base = rs[0].get("eval_diversity", [None])[0]
        r["diversity"] = _mean_std(divs) if divs else None
        r["diversity_ratio"] = (r["diversity"][0] / base) if divs and base else None
    rows[best]["best_gain_arm"] = True
    return rows


def target(rows: dict) -> dict:
    """The best arm: the earliest to 95% of the reference's final gain among those whose final gain is >= 0.95x
    the reference's (any arm, when none is)."""
    others = {a: r for a, r in rows.items() if a != REFERENCE}
    good = {a: r for a, r in others.items() if r["gain_frac"][0] >= TARGET_FINAL}
    pool = {a: r for a, r in (good or others).items() if r["t95_frac"] is not None} or (good or others)
    best = min(pool, key=lambda a: pool[a]["t95_frac"] if pool[a]["t95_frac"] is not None else math.inf)
    r = pool[best]
    return {"name": f"an arm reaches {TARGET_FRAC:.0%} of {REFERENCE}'s final held-out gain in <= "
                    f"{TARGET_TIME}x its wall-clock, final gain >= {TARGET_FINAL}x",
            "best_arm": best, "t95_frac": r["t95_frac"], "gain_frac": r["gain_frac"],
            "met": r["t95_frac"] is not None and r["t95_frac"] <= TARGET_TIME and r["gain_frac"][0] >= TARGET_FINAL,
            "reference_gain_over_seed_std": rows[REFERENCE]["gain_over_seed_std"]}


def comparisons(rows: dict) -> list[dict]:
    """Issue 23's questions, each from this run's rows: what JAGG adds to a recipe run per step (its final gain
    >= 0.95x, its time to 95% of the per-step arm's final gain <= the pair's ratio of the per-step arm's time), and
    the stack's best arm against the best peer arm (each one's time to 95% of the best arm's final gain; the stack's
    arm keeping >= 50% of the base model's within-prompt diversity)."""
    out = []
    for jagg, step, ratio in PAIRS:
        if jagg not in rows or step not in rows:
            continue
        j, p = rows[jagg], rows[step]
        level = p["start"] + TARGET_FRAC * p["gain"][0]
        tj = time_to(j["curve"]["seconds"], j["curve"]["reward"], level)
        tp = time_to(p["curve"]["seconds"], p["curve"]["reward"], level)
        gain = j["gain"][0] / p["gain"][0] if p["gain"][0] > 0 else math.nan
        t = None if tj is None or not tp else tj / tp
        out.append({"name": f"{jagg} vs {step}", "gain_ratio": gain, "t95_ratio": t, "max_t95_ratio": ratio,
                    "met": gain >= TARGET_FINAL and t is not None and t <= ratio})
    peers = [a for a in rows if a in PEERS]
    ours = [a for a in rows if a not in PEERS and (rows[a].get("diversity_ratio") or 0) >= 0.5]
    if peers:
        def first(arms):
            timed = [a for a in arms if rows[a].get("t95_best") is not None]
            return min(timed, key=lambda a: rows[a]["t95_best"]) if timed else None
        bp, bo = first(peers), first(ours)
        tp = rows[bp]["t95_best"] if bp else None
        to = rows[bo]["t95_best"] if bo else None
        ratio = None if to is None else (0.0 if tp is None else to / tp)  # 0: no peer arm reaches the line
        out.append({"name": "the stack's best arm (diversity >= 0.5x the base's) vs the best peer arm",
                    "ours": bo, "peer": bp, "t95_ratio": ratio, "max_t95_ratio": 0.7,
                    "met": ratio is not None and ratio <= 0.7})
    return out




if __name__ == "__main__":  # one worker of run(workers > 1): JOB.json OUT.json THREADS
    import torch

    torch.set_num_threads(int(sys.argv[3]))
    spec = json.loads(Path(sys.argv[1]).read_text())
    spec["partial"] = Path(spec["partial"])
    Path(sys.argv[2]).write_text(json.dumps(measure(**spec)))
