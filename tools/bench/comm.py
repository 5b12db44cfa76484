"""Part comm: collectives and bytes per training step under FSDP2, 2 processes (torchrun, gloo, CPU).

Collectives per training step read from `metrics.jsonl` of real 2-process runs (`torchrun --nproc_per_node 2
jagg-train configs/tiny_cpu.yaml parallel.engine=fsdp2 ...`, gloo on CPU), counted by the engine's `CommCounter`
(`engine.comm`) per phase. A gather cycle is every FSDP unit all-gathered for the forward and again for the backward
(reshard after forward).

The arms (the built-in DiT, fully_shard per transformer block + the root; the counter writes comm_<phase>_<kind>
and comm_<phase>_bytes into metrics.jsonl):

    exact           jagg.mode=exact: every trained step its own forward + backward
    JAGG cached     jagg.mode=jagg, window 4, intermediate cached: the pure count (one joint pass per window)
    JAGG auto       the trainer's default: cached on the first (on-policy) minibatch, then `forward`, whose no-grad
                    forward of the (W - 2) B intermediate rows gathers the parameters once more per window

A gather cycle is 2 x units all-gathers; units = train reduce-scatters / minibatches (one per unit at each
accumulation boundary). The exact arm's per-window numbers are per group of W consecutive trained steps. Target: 1
gather cycle per window for JAGG vs W for per-step. Counts are deterministic; the bytes depend on the model size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jagg_scale.parallel.ranks import free_port, launcher_env

from .common import ROOT

ARMS = {
    "exact": ["jagg.mode=exact"],
    "JAGG cached": ["jagg.mode=jagg", "jagg.intermediate=cached"],
    "JAGG auto": ["jagg.mode=jagg", "jagg.intermediate=auto"],
}
BASE = ["parallel.engine=fsdp2", "sampling.num_steps=8", "train.prompts_per_step=2", "train.batch_size=4",
        "jagg.window=4", "jagg.jagg_frac=1.0", "log.progress=false", "run.checkpoint_every=0", "eval.enabled=false"]
QUICK = ["model.dit.hidden_size=64", "model.dit.depth=2"]
NPROC = 2
KEYS = ("comm_train_all_gather", "comm_train_reduce_scatter", "comm_train_bytes", "comm_rollout_all_gather",
        "comm_rollout_bytes", "comm_rollout_reduce_scatter", "windows", "windows_jagg", "per_step_equiv",
        "backward_passes", "optimizer_steps", "nograd_forward_passes", "time_train", "time_rollout")



def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def start_arm(out: Path, overrides: list[str], steps: int):
    cmd = [_bin("torchrun"), "--nproc_per_node", str(NPROC), "--master_port", str(free_port()), _bin("jagg-train"),
           str(ROOT / "configs" / "tiny_cpu.yaml"), *overrides, f"train.steps={steps}", f"run.output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return proc, cmd, time.perf_counter()


def finish_arm(out: Path, started) -> tuple[list[dict], list[str], float]:
    proc, cmd, t0 = started
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, cmd, wall


def run(quick: bool) -> dict:
    arms = ["exact", "JAGG cached"] if quick else list(ARMS)
    steps = 1 if quick else 2
    extra = QUICK if quick else []
    res = {"nproc": NPROC, "backend": "fsdp2 (gloo, CPU)", "config": "configs/tiny_cpu.yaml", "overrides": BASE + extra,
           "train_steps": steps, "arms": {}}
    with tempfile.TemporaryDirectory(prefix="jagg_bench_comm_") as tmp:
        outs = {arm: Path(tmp) / arm.replace(" ", "_") for arm in arms}
        # the counts are deterministic: quick mode runs the arms concurrently (wall time only), full mode one by one
        started = {arm: start_arm(outs[arm], BASE + extra + ARMS[arm], steps) for arm in arms} if quick else {}
        for arm in arms:
            rows, cmd, wall = finish_arm(outs[arm], started.get(arm) or start_arm(outs[arm], BASE + extra + ARMS[arm],
                                                                                  steps))
            first = {k: float(rows[0].get(k, 0.0)) for k in KEYS}
            same = all({k: r.get(k) for k in KEYS if k.startswith("comm_")} ==
                       {k: rows[0].get(k) for k in KEYS if k.startswith("comm_")} for r in rows)
            res["arms"][arm] = {"per_step": first, "all_steps_identical_counts": same, "wall_seconds": wall,
                                "command": " ".join(Path(c).name if i < 1 else c for i, c in enumerate(cmd))}
            print(f"    comm {arm}: train all_gather {first['comm_train_all_gather']:.0f}, reduce_scatter "
                  f"{first['comm_train_reduce_scatter']:.0f}, {first['comm_train_bytes'] / 2**20:.1f} MiB "
                  f"({wall:.1f}s)", flush=True)
    window = 4
    for arm, a in res["arms"].items():
        p = a["per_step"]
        units = p["comm_train_reduce_scatter"] / p["optimizer_steps"]  # one reduce-scatter per unit per minibatch
        windows = p["windows"] if arm != "exact" else p["per_step_equiv"] / window
        a["units"] = units
        a["windows_per_step"] = windows
        a["per_window"] = {
            "all_gather": p["comm_train_all_gather"] / windows,
            "gather_cycles": p["comm_train_all_gather"] / windows / (2 * units),
            "reduce_scatter": p["comm_train_reduce_scatter"] / windows,
            "bytes": p["comm_train_bytes"] / windows,
        }
    ex = res["arms"]["exact"]
    ca = res["arms"]["JAGG cached"]
    res["window"] = window
    res["summary"] = {
        "gather_cycles_per_window_exact": ex["per_window"]["gather_cycles"],
        "gather_cycles_per_window_jagg_cached": ca["per_window"]["gather_cycles"],
        "train_all_gather_ratio_exact_over_jagg": ex["per_step"]["comm_train_all_gather"]
        / ca["per_step"]["comm_train_all_gather"],
        "train_bytes_ratio_exact_over_jagg": ex["per_step"]["comm_train_bytes"] / ca["per_step"]["comm_train_bytes"],
    }
    res["target"] = {"name": "collectives per window: 1 gather cycle (JAGG) vs W (per-step)",
                     "jagg": ca["per_window"]["gather_cycles"], "exact": ex["per_window"]["gather_cycles"], "W": window,
                     "met": abs(ca["per_window"]["gather_cycles"] - 1) < 1e-9
                     and abs(ex["per_window"]["gather_cycles"] - window) < 1e-9}
    return res


def markdown(res: dict) -> str:
    W = res["window"]
    lines = ["| arm | train all-gathers / step | train reduce-scatters / step | train MiB / step | rollout all-gathers "
             "/ step | rollout MiB / step | windows / step | all-gathers / window | gather cycles / window | "
             "reduce-scatters / window | train MiB / window |", "|" + "---|" * 11]
    for arm, a in res["arms"].items():
        p, w = a["per_step"], a["per_window"]
        lines.append(f"| {arm} | {p['comm_train_all_gather']:.0f} | {p['comm_train_reduce_scatter']:.0f} | "
                     f"{p['comm_train_bytes'] / 2**20:.2f} | {p['comm_rollout_all_gather']:.0f} | "
                     f"{p['comm_rollout_bytes'] / 2**20:.2f} | {a['windows_per_step']:.0f} | {w['all_gather']:.1f} | "
                     f"**{w['gather_cycles']:.2f}** | {w['reduce_scatter']:.2f} | {w['bytes'] / 2**20:.2f} |")
    ex = res["arms"]["exact"]
    s = res["summary"]
    out = [
        f"{res['nproc']} processes, {res['backend']}, `{res['config']}` with `{' '.join(res['overrides'])}`, "
        f"{res['train_steps']} training step(s) per arm (counts per step"
        + (", identical in every step" if all(a["all_steps_identical_counts"] for a in res["arms"].values()) else "")
        + f"). FSDP units (blocks + root): {ex['units']:.0f}; minibatches per step: "
          f"{ex['per_step']['optimizer_steps']:.0f}; trained steps per minibatch: "
          f"{ex['per_step']['per_step_equiv'] / ex['per_step']['optimizer_steps']:.0f}; exact's windows are groups of "
          f"W = {W} trained steps.",
        "",
        "\n".join(lines),
        "",
        f"Per training step JAGG (cached) issues {s['train_all_gather_ratio_exact_over_jagg']:.2f}x fewer parameter "
        f"all-gathers and moves {s['train_bytes_ratio_exact_over_jagg']:.2f}x fewer bytes than per-step. Gradient "
        "reduce-scatters happen once per unit per minibatch (at the accumulation boundary) in every arm. "
        "`JAGG auto` adds, on every minibatch after the first optimizer step, one no-grad forward of the "
        "intermediate rows per window (one more all-gather per unit).",
    ]
    return "\n".join(out)


def plot(res: dict, ax) -> None:
    arms = list(res["arms"])
    vals = [res["arms"][a]["per_window"]["gather_cycles"] for a in arms]
    ax.bar(range(len(arms)), vals, color=["C0", "C2", "C4"][: len(arms)])
    ax.axhline(1, color="k", ls=":", lw=1)
    ax.axhline(res["window"], color="k", ls="--", lw=1)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels(arms, fontsize=8)
    ax.set(ylabel="parameter all-gather cycles per window", title=f"FSDP2 collectives per window (W={res['window']})")
    ax.grid(alpha=0.3, axis="y")
