"""Quality parity of JAGG against exact (Flow-GRPO per-step) training, from the same seeds.

Every arm trains the same config for the same number of steps with each seed; the held-out reward is the
deterministic ODE evaluation (`eval` section) every `--eval-every` steps. JAGG arms also run the fidelity probe
(`jagg.probe_every`): the exact per-step gradient beside the JAGG one on the same minibatch, whose cosine says how
well the window approximation holds and where (per window, i.e. per sigma range). Probe time is not counted
as training time.

    python tools/parity.py --config configs/digits_cpu.yaml --seeds 0 1 2 --steps 80 --out docs/parity

writes OUT.json (every run), OUT_table.md (the table) and OUT_reward.png (reward vs step and vs training seconds);
`--from-json OUT.json` re-makes the table and plot without training. docs/parity.md holds the measured result.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jagg_scale.grpo import sigma_schedule
from jagg_scale.jagg import split_windows, trained_steps
from jagg_scale.train import Trainer, load_config

ARMS = {
    "exact": ["jagg=null", "jagg.mode=exact"],
    "W4": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=1.0"],
    "W4 frac0.75 vcos": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=0.75", "jagg.route_by=vcos"],
    "W4 frac0.75 weighted": ["jagg.mode=jagg", "jagg.window=4", "jagg.jagg_frac=0.75", "jagg.route_by=weighted"],
    "W8": ["jagg.mode=jagg", "jagg.window=8", "jagg.jagg_frac=1.0"],
    # the knot planner (issue 8) against uniform windows and routing at the same transformer rows per sample
    "budget S2": ["jagg.mode=jagg", "jagg.plan=budget", "jagg.window=null", "jagg.speedup=2"],
    "W6 frac0.67 vcos": ["jagg.mode=jagg", "jagg.window=6", "jagg.jagg_frac=0.67", "jagg.route_by=vcos"],
    "shared W4": ["jagg.mode=jagg", "jagg.window=4", "jagg.share_knots=true"],
    "budget S2.67": ["jagg.mode=jagg", "jagg.plan=budget", "jagg.window=null", "jagg.speedup=2.67"],
}


def run_arm(config: str, name: str, seed: int, out: Path, args) -> dict:
    overrides = ARMS[name] + [
        f"run.seed={seed}", f"run.output_dir={out}", "run.checkpoint_every=0", "log.progress=false",
        "run.overwrite=true",  # each arm is measured from scratch: a rerun replaces the previous one's directory
        "eval.enabled=true", f"eval.every={args.eval_every}",
        f"jagg.probe_every={0 if name == 'exact' else args.probe_every}",
    ] + (["train.steps=" + str(args.steps)] if args.steps else []) + args.set
    cfg = load_config(config, overrides)
    trainer = Trainer(cfg)
    t0 = time.perf_counter()
    history = trainer.fit()
    wall = time.perf_counter() - t0
    train_s = [r["time_train"] for r in history]
    probes = [r for r in history if "probe_cos" in r]
    n_windows = max((len([k for k in r if k.startswith("probe_cos_w")]) for r in probes), default=0)
    return {
        "arm": name, "seed": seed,
        "eval_steps": sorted(trainer.evals),
        "eval_reward": [trainer.evals[s]["reward_mean"] for s in sorted(trainer.evals)],
        "train_reward": [r["reward_mean"] for r in history],
        "train_seconds": sum(train_s),
        "train_seconds_cum": [sum(train_s[: i + 1]) for i in range(len(train_s))],
        "backward_passes": sum(r["backward_passes"] for r in history),
        "per_step_equiv": sum(r["per_step_equiv"] for r in history),
        "probe_cos": [r["probe_cos"] for r in probes],
        "probe_norm_ratio": [r["probe_norm_ratio"] for r in probes],
        "probe_cos_windows": [statistics.mean(r[f"probe_cos_w{i}"] for r in probes) for i in range(n_windows)],
        "windows_jagg": statistics.mean(r["windows_jagg"] for r in history),
        "knots": [r["knots"] for r in history if "knots" in r][-1:],  # the last plan the run used
        "wall_seconds": wall,
    }


def _median_step(run: dict) -> float:
    cum = run["train_seconds_cum"]
    return statistics.median([b - a for a, b in zip([0.0] + cum[:-1], cum)])


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict], cfg) -> tuple[list[dict], str]:
    exact_runs = [r for r in runs if r["arm"] == "exact"]
    exact_s = statistics.mean(_median_step(r) * len(r["train_seconds_cum"]) for r in exact_runs) if exact_runs else None
    rows = []
    for name in ARMS:
        rs = [r for r in runs if r["arm"] == name]
        if not rs:
            continue
        final = mean_std([r["eval_reward"][-1] for r in rs])
        start = mean_std([r["eval_reward"][0] for r in rs])
        secs = statistics.mean(r["train_seconds"] for r in rs)
        # median step time x steps: robust to other work sharing the CPU for part of a run
        robust = statistics.mean(_median_step(r) * len(r["train_seconds_cum"]) for r in rs)
        probe = [c for r in rs for c in r["probe_cos"]]
        wins = [statistics.mean(ws) for ws in zip(*[r["probe_cos_windows"] for r in rs])] if probe else []
        rows.append({
            "arm": name, "start": start, "final": final, "gain": final[0] - start[0],
            "backward_passes": statistics.mean(r["backward_passes"] for r in rs),
            "per_step_equiv": statistics.mean(r["per_step_equiv"] for r in rs),
            "train_seconds": secs, "train_seconds_robust": robust,
            "speedup": (exact_s / robust) if exact_s else None,
            "probe_cos": statistics.mean(probe) if probe else None,
            "probe_cos_min": min(probe) if probe else None,
            "probe_norm_ratio": statistics.mean(c for r in rs for c in r["probe_norm_ratio"]) if probe else None,
            "probe_cos_windows": wins,
            "windows_jagg": statistics.mean(r["windows_jagg"] for r in rs),
            "knots": [k for r in rs for k in r.get("knots", [])],
        })
    sig = sigma_schedule(cfg.sampling.num_steps, cfg.sampling.shift)
    lines = ["| arm | held-out reward start | final (mean +- std over seeds) | gain | "
             "backward passes (per-step equiv) | "
             "training s (sum) | training s (median step x steps) | speedup vs exact (median-based) | "
             "probe cos mean (min) | probe norm ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        probe = "1 (exact)" if r["probe_cos"] is None else f"{r['probe_cos']:.3f} ({r['probe_cos_min']:.3f})"
        ratio = "-" if r["probe_norm_ratio"] is None else f"{r['probe_norm_ratio']:.3f}"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {r['arm']} | {r['start'][0]:.3f} | {r['final'][0]:.3f} +- {r['final'][1]:.3f} | "
                     f"{r['gain']:+.3f} | "
                     f"{r['backward_passes']:.0f} ({r['per_step_equiv']:.0f}) | {r['train_seconds']:.1f} | "
                     f"{r['train_seconds_robust']:.1f} | {speed} | "
                     f"{probe} | {ratio} |")
    lines += ["", "Probe cosine per window (mean over probes and seeds), with the window's sigma range:", ""]
    steps = trained_steps(cfg.sampling.num_steps, cfg.grpo.timestep_fraction)
    for r in rows:
        if not r["probe_cos_windows"]:
            continue
        window = 8 if r["arm"].startswith("W8") else 6 if r["arm"].startswith("W6") else 4
        wins = split_windows(steps, window)
        cells = [f"w{i} s={float(sig[w[0]]):.2f}..{float(sig[w[-1]]):.2f}: {c:.3f}"
                 for i, (w, c) in enumerate(zip(wins, r["probe_cos_windows"]))]
        lines.append(f"- {r['arm']}: " + "; ".join(cells))
    planned = [r for r in rows if r["knots"]]
    if planned:
        lines += ["", "Knot plans (trained steps computed exactly; the last plan of each seed):", ""]
        lines += [f"- {r['arm']}: " + " | ".join(r["knots"]) for r in planned]
    return rows, "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ARMS:
        rs = [r for r in runs if r["arm"] == name]
        if not rs:
            continue
        steps = rs[0]["eval_steps"]
        vals = torch.tensor([r["eval_reward"] for r in rs])
        mean, std = vals.mean(0), (vals.std(0) if len(rs) > 1 else torch.zeros(len(steps)))
        line, = ax1.plot(steps, mean, marker="o", label=name)
        ax1.fill_between(steps, mean - std, mean + std, alpha=0.15, color=line.get_color())
        cum = torch.tensor([[0.0] + [r["train_seconds_cum"][s - 1] for s in steps[1:]] for r in rs]).mean(0)
        ax2.plot(cum, mean, marker="o", label=name, color=line.get_color())
    ax1.set(xlabel="training step", ylabel="held-out reward (ODE eval)", title="reward vs step")
    ax2.set(xlabel="training-phase seconds (mean over seeds)", ylabel="held-out reward",
            title="reward vs training time")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/digits_cpu.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--steps", type=int, default=0, help="override train.steps (0: the config's)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra config overrides for every arm")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--probe-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--work", default="runs/parity", help="run directories")
    p.add_argument("--out", default="docs/parity", help="prefix of the .json/.md/_reward.png outputs")
    p.add_argument("--from-json", help="re-make the table and plot from an earlier run's OUT.json (no training)")
    args = p.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        args.set, machine = saved["args"].get("set", []), saved["machine"]
        write_outputs(saved["runs"], load_config(args.config, args.set), machine, Path(args.out), saved["args"])
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    for seed in args.seeds:  # seeds outermost: a partial run still compares every arm
        for name in args.arms:
            out = Path(args.work) / f"{name.replace(' ', '_')}_seed{seed}"
            print(f"== {name}, seed {seed}", flush=True)
            runs.append(run_arm(args.config, name, seed, out, args))
            r = runs[-1]
            print(f"   held-out {r['eval_reward'][0]:.3f} -> {r['eval_reward'][-1]:.3f}, "
                  f"train {r['train_seconds']:.1f}s, "
                  f"probe cos {statistics.mean(r['probe_cos']) if r['probe_cos'] else 1.0:.3f}", flush=True)
    machine = f"{platform.platform()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    write_outputs(runs, load_config(args.config, args.set), machine, Path(args.out), vars(args))


def write_outputs(runs: list[dict], cfg, machine: str, out: Path, args: dict) -> None:
    rows, table = summarize(runs, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.with_suffix(".json")).write_text(json.dumps({"machine": machine, "args": args, "rows": rows,
                                                      "runs": runs}, indent=1))
    (out.parent / (out.name + "_table.md")).write_text(f"Machine: {machine}\n\n{table}\n")
    plot(runs, out.parent / (out.name + "_reward.png"))
    print(table)


if __name__ == "__main__":
    main()
