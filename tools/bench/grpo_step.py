"""Part 2, grpo_step: whole GRPO steps (rollout + reward + training phase) through `jagg_scale.train.Trainer`.

Three arms per model, built from the same config and seed (same prompts, same noise at every step):

    exact        jagg.mode=exact: Flow-GRPO's per-step backward on every trained step
    W4 frac1.0   jagg.mode=jagg, window 4, jagg_frac 1.0 (JAGG on every window)
    W4 frac0.5   jagg.mode=jagg, window 4, jagg_frac 0.5 (JAGG on half the windows, the rest per-step)

Models: the tiny random SD3 pipeline (configs/sd3_tiny_cpu.yaml, written by tools/make_tiny_pipeline.py into a
temporary directory: the real diffusers SD3 code path, CFG 4.5) and the digits DiT (configs/digits_cpu.yaml).
The three trainers live side by side in this process and step round-robin (order rotated per round) after a
warm-up step each; the per-step times are the trainer's own metrics (time_rollout, time_reward, time_train).
Reported: medians, and speedups as medians of paired per-round ratios exact / arm, for the training phase
(target >= 1.8x at W = 4, jagg_frac 1) and for the whole step. No eval, no checkpoints (not timed anyway).
"""

from __future__ import annotations

import importlib
import statistics
import tempfile
import time
from pathlib import Path

from .common import ROOT, median, ops_table, paired_speedup, top_ops

from jagg_scale.train import Trainer, load_config

ARMS = {
    "exact": ["jagg=null", "jagg.mode=exact"],
    "W4 frac1.0": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=1.0"],
    "W4 frac0.5": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=0.5"],
}
PHASES = ("time_rollout", "time_reward", "time_train")
TARGET_TRAIN = 1.8
COMMON = ["eval.enabled=false", "run.checkpoint_every=0", "log.progress=false", "log.wandb=false",
          "jagg.probe_every=0", "train.steps=1000", "run.resume=none"]
QUICK = {
    "sd3_tiny": ["train.prompts_per_step=2", "sampling.num_steps=8"],
    "digits": ["sampling.num_steps=8", "train.prompts_per_step=1", "train.minibatch_size=8", "sampling.chunk_size=8"],
}


def make_sd3_pipeline(out_dir: Path) -> Path:
    tools = str(ROOT / "tools")
    import sys

    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module("make_tiny_pipeline").make_tiny_sd3(out_dir, seed=0)


def bench_model(name: str, config: str, extra: list[str], work: Path, rounds: int, warmup: int,
                profile_always: bool = False) -> dict:
    trainers = {}
    for arm, overrides in ARMS.items():
        cfg = load_config(str(ROOT / config), COMMON + extra + overrides +
                          [f"run.output_dir={work / name / arm.replace(' ', '_')}"])
        trainers[arm] = Trainer(cfg)
    names = list(trainers)
    step = 0
    for _ in range(warmup):
        for arm in names:
            trainers[arm].train_step(step)
        step += 1
    records = {arm: [] for arm in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for arm in order:
            m = trainers[arm].train_step(step)
            records[arm].append({k: float(m[k]) for k in (*PHASES, "backward_passes", "per_step_equiv",
                                                           "windows", "windows_jagg", "nograd_forward_passes")})
        step += 1
        print(f"    {name} round {r + 1}/{rounds}: " + ", ".join(
            f"{a} train {records[a][-1]['time_train']:.2f}s step "
            f"{sum(records[a][-1][p] for p in PHASES):.2f}s" for a in names), flush=True)
    cfg0 = trainers["exact"].cfg
    out = {"config": config, "overrides": extra, "rounds": rounds, "warmup_steps": warmup, "arms": {},
           "setup": {"num_steps": cfg0.sampling.num_steps, "rows_per_step": cfg0.train.prompts_per_step
                     * cfg0.grpo.group_size, "train_batch": cfg0.train.minibatch_size,
                     "guidance": cfg0.sampling.guidance,
                     "model_kind": cfg0.model.kind,
                     "parameters": sum(p.numel() for p in trainers["exact"].model.parameters())}}
    base = records["exact"]
    for arm in names:
        rec = records[arm]
        step_t = [sum(x[p] for p in PHASES) for x in rec]
        out["arms"][arm] = {
            **{p: median([x[p] for x in rec]) for p in PHASES},
            "step": median(step_t),
            "all": rec,
            "backward_passes": statistics.mean(x["backward_passes"] for x in rec),
            "per_step_equiv": statistics.mean(x["per_step_equiv"] for x in rec),
            "windows_jagg": statistics.mean(x["windows_jagg"] for x in rec),
            "windows": statistics.mean(x["windows"] for x in rec),
            "speedup_train": paired_speedup([x["time_train"] for x in base], [x["time_train"] for x in rec]),
            "speedup_step": paired_speedup([sum(x[p] for p in PHASES) for x in base], step_t),
        }
        out["arms"][arm]["pass_ratio"] = out["arms"][arm]["per_step_equiv"] / out["arms"][arm]["backward_passes"]
    w4 = out["arms"]["W4 frac1.0"]
    if w4["speedup_train"] < TARGET_TRAIN or profile_always:
        print(f"  {name}: W4 training-phase speedup {w4['speedup_train']:.2f}x: profiling one step per arm", flush=True)
        out["profile"] = {arm: top_ops(lambda arm=arm, s=step: trainers[arm].train_step(s))
                          for arm in ("exact", "W4 frac1.0")}
    return out


def _quiet() -> None:
    """No progress bars from diffusers / transformers when the trainers load the pipeline."""
    try:
        from diffusers.utils import logging as dlog

        dlog.disable_progress_bar()
        dlog.set_verbosity_error()
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.set_verbosity_error()
    except Exception:
        pass


def run(quick: bool) -> dict:
    # full run: the tiny SD3 steps cost ~0.3 s, the digits ones ~3-5 s (64 rows x 16 steps)
    rounds = {"sd3_tiny": 1, "digits": 1} if quick else {"sd3_tiny": 8, "digits": 5}
    _quiet()
    models = {}
    with tempfile.TemporaryDirectory(prefix="jagg_bench_grpo_") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        pipe = make_sd3_pipeline(work / "tiny_sd3")
        print(f"  tiny SD3 pipeline written in {time.perf_counter() - t0:.1f}s", flush=True)
        specs = {
            "sd3_tiny": ("configs/sd3_tiny_cpu.yaml",
                         [f"model.pretrained={pipe}"] + (QUICK["sd3_tiny"] if quick else [])),
            "digits": ("configs/digits_cpu.yaml", QUICK["digits"] if quick else []),
        }
        for name, (config, extra) in specs.items():
            t0 = time.perf_counter()
            models[name] = bench_model(name, config, extra, work, rounds.get(name, 1), warmup=1,
                                       profile_always=quick and name == "sd3_tiny")
            models[name]["wall_seconds"] = time.perf_counter() - t0
    summary = {}
    for name, res in models.items():
        for arm in ("W4 frac1.0", "W4 frac0.5"):
            tag = arm.replace(" ", "_").replace(".", "")
            summary[f"{name}_{tag}_speedup_train"] = res["arms"][arm]["speedup_train"]
            summary[f"{name}_{tag}_speedup_step"] = res["arms"][arm]["speedup_step"]
    worst = min(models, key=lambda n: models[n]["arms"]["W4 frac1.0"]["speedup_train"])
    return {
        "models": models, "summary": summary,
        "target": {"name": "training phase >= 1.8x faster at W=4 (jagg_frac 1)", "threshold": TARGET_TRAIN,
                   "per_model": {n: models[n]["arms"]["W4 frac1.0"]["speedup_train"] for n in models},
                   "worst_model": worst, "met": all(models[n]["arms"]["W4 frac1.0"]["speedup_train"] >= TARGET_TRAIN
                                                    for n in models)},
    }


def markdown(res: dict) -> str:
    out = []
    for name, m in res["models"].items():
        s = m["setup"]
        shown = [o for o in m["overrides"] if not o.startswith("model.pretrained=")]
        out += [f"**{name}** (`{m['config']}`{' ' + ' '.join(shown) if shown else ''}): "
                f"{s['model_kind']}, {s['parameters']:,} trainable parameters, {s['num_steps']} sampling steps, "
                f"{s['rows_per_step']} rows per step, train batch {s['train_batch']}, CFG {s['guidance']}. "
                f"{m['warmup_steps']} warm-up step per arm, then medians of {m['rounds']} round-robin steps.", "",
                "| arm | rollout s | reward s | train s | whole step s | backward passes (per-step equiv) | "
                "JAGG windows | train speedup | step speedup |",
                "|---|---|---|---|---|---|---|---|---|"]
        for arm, a in m["arms"].items():
            out.append(f"| {arm} | {a['time_rollout']:.3f} | {a['time_reward']:.3f} | {a['time_train']:.3f} | "
                       f"{a['step']:.3f} | {a['backward_passes']:.0f} ({a['per_step_equiv']:.0f}) | "
                       f"{a['windows_jagg']:.0f}/{a['windows']:.0f} | "
                       + ("-" if arm == "exact" else f"{a['speedup_train']:.2f}x") + " | "
                       + ("-" if arm == "exact" else f"{a['speedup_step']:.2f}x") + " |")
        out.append("")
        if "profile" in m:
            for arm, p in m["profile"].items():
                out += [f"Profile of one whole step, {name} {arm} (profiled wall {p['wall_seconds_profiled']} s), top "
                        "ops by self CPU time:", "", ops_table(p), ""]
    return "\n".join(out)


def plot(res: dict, ax) -> None:
    labels = []
    x = 0
    colors = {"time_rollout": "C0", "time_reward": "C1", "time_train": "C2"}
    for name, m in res["models"].items():
        for arm, a in m["arms"].items():
            b = 0.0
            for p in PHASES:
                ax.bar(x, a[p] / m["arms"]["exact"]["step"], bottom=b, color=colors[p],
                       label=p.replace("time_", "") if x == 0 else None)
                b += a[p] / m["arms"]["exact"]["step"]
            labels.append(f"{name}\n{arm}")
            x += 1
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set(ylabel="step time / exact step time", title="whole GRPO step, by phase")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
