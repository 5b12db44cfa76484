"""The pools benchmark (issue 38): the same training on the same process count, synchronous and split into a trainer
and a rollout pool, with a reward of stated latency served by the real reward server.

    python -m tools.bench.pools [--steps 24] [--latency 0.5] [--seeds 0] [--out docs/results/pools_bench.json]

Every arm trains configs/digits_cpu.yaml (the digits study's settings) for `--steps` steps on 2 processes with one
torch thread each, its reward `digit_match` behind `jagg-reward-server` with tools/bench/slow_reward.py holding each
request for `--latency` seconds (a judge served elsewhere):

    sync        torchrun 2 ranks, FSDP2: every rank samples, waits for its rewards, trains, in turn
    pools k=0   1 trainer + 1 rollout rank (pools.rollout_ranks 1): the split pipeline with nothing overlapped
    pools k=1   the same, the rollout one step ahead (pools.max_staleness 1)
    pools k=1 decoupled   and the stale rollout trained by decoupled PPO (pools.importance_cap 2)

Throughput is read from when each step's metrics row appears (polled): seconds per step over the steps after the
first two (start-up and the first steps' warm-up left out), a ratio within one run of this script. The held-out
gain is the deterministic evaluation's reward after the steps minus before (the config's 160 held-out images)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ARMS = {"sync": ["parallel.engine=fsdp2"], "pools k=0": ["pools.rollout_ranks=1"],
        "pools k=1": ["pools.rollout_ranks=1", "pools.max_staleness=1"],
        "pools k=1 decoupled": ["pools.rollout_ranks=1", "pools.max_staleness=1", "pools.importance_cap=2.0"]}


def serve(latency: float) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    spec = json.dumps({"reward": "digit_match", "latency_s": latency})
    proc = subprocess.Popen([str(BIN / "jagg-reward-server"), "--plugin", "tools.bench.slow_reward", "--reward",
                             f"slow:{spec}", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    first = proc.stdout.readline()
    if not first.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"reward server did not start: {first!r}")
    return proc, first.split()[-1]


def run_arm(name: str, url: str, steps: int, seed: int, out: Path) -> dict:
    from jagg_scale.parallel.ranks import free_port, launcher_env

    args = [str(ROOT / "configs" / "digits_cpu.yaml"), f"train.steps={steps}", f"run.seed={seed}",
            "run.checkpoint_every=0", "log.progress=false", "reward.name=remote",
            f"reward.options={{url: {url}, reward: slow}}", f"run.output_dir={out}", *ARMS[name]]
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(BIN / "jagg-train"),
           *args]
    metrics, seen, arrived = out / "metrics.jsonl", 0, []
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=launcher_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        n = metrics.read_text().count("\n") if metrics.exists() else 0
        arrived += [time.monotonic()] * (n - seen)
        seen = n
        time.sleep(0.02)
    err = proc.stderr.read()
    if proc.returncode:
        raise RuntimeError(f"{name}: jagg-train exited {proc.returncode}: {err[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = {int(p.parent.name.split("_")[1]): json.loads(p.read_text())
             for p in (out / "eval").glob("step_*/eval.json")}
    steady = arrived[2:]
    return {"arm": name, "seed": seed, "steps": steps, "wall_s": time.monotonic() - started,
            "s_per_step": (steady[-1] - steady[0]) / (len(steady) - 1),
            "eval_before": evals[0]["reward_mean"], "eval_after": evals[steps]["reward_mean"],
            "gain": evals[steps]["reward_mean"] - evals[0]["reward_mean"],
            "reward_last": rows[-1]["reward_mean"], "staleness": [r.get("staleness", 0) for r in rows][-1],
            "behaviour_log_ratio": max((r.get("behaviour_log_ratio") or 0.0) for r in rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.pools", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--latency", type=float, default=0.5, help="seconds the reward server holds each request")
    p.add_argument("--seeds", default="0")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", default="docs/results/pools_bench.json")
    p.add_argument("--work", default="/tmp/pools_bench")
    args = p.parse_args(argv)
    server, url = serve(args.latency)
    results = []
    try:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for arm in args.arms.split(","):
                out = Path(args.work) / f"{arm.replace(' ', '_').replace('=', '')}_s{seed}"
                subprocess.run(["rm", "-rf", str(out)], check=True)
                r = run_arm(arm, url, args.steps, seed, out)
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        server.terminate()
    base = {r["seed"]: r for r in results if r["arm"] == "sync"}
    for r in results:
        b = base.get(r["seed"])
        if b:
            r["throughput_vs_sync"] = b["s_per_step"] / r["s_per_step"]
            r["gain_vs_sync"] = r["gain"] / b["gain"] if b["gain"] else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"latency_s": args.latency, "steps": args.steps, "runs": results},
                                         indent=1) + "\n")
    print("| arm | seed | s / step | throughput vs sync | held-out gain | gain vs sync |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['arm']} | {r['seed']} | {r['s_per_step']:.2f} | {r.get('throughput_vs_sync', float('nan')):.2f}x "
              f"| {r['gain']:+.4f} | {r.get('gain_vs_sync') or float('nan'):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
