"""Wall time of training ONE window of W sampling steps: Flow-GRPO per-step vs the JAGG joint backward.

What is measured. A built-in DiT (default: hidden 512, depth 6, heads 8, patch 2, 32x32x4 latents, ~32M
parameters) samples a real batch of B trajectories with the Flow-GRPO SDE (`sample_sde`, no grad) over a
shifted sigma schedule of max(W) steps (noise level 0.7, shift 3). With random advantages and the real
`GRPOStepLoss` (clip 1e-4, on-policy), we then time, for each window width W, the training of the window made
of the first W steps (forwards + backwards, gradients accumulated into the parameters' .grad):

    per-step     `exact_backward`: W forwards with grad (B rows) and W backwards         ~ W (F + B)
    cached       `jagg_backward(intermediate="cached")`: 1 forward + 1 backward of 2B rows ~ 2 (F + B)
    interpolate  the same, intermediate velocities = cached values moved by the endpoints' drift
    forward      the same plus one no-grad forward of (W - 2) B rows for the intermediate velocities

How it is timed. Gradients are zeroed (outside the timed region) before every run; every method runs once
untimed first (warm-up); then `--repeats` rounds, each timing every (W, method) once, with the method order
rotated between rounds so that load drift hits all methods alike. Times are medians over the rounds; a speedup
is the median over rounds of the PAIRED ratio t(per-step) / t(JAGG) of the same round, which cancels slow
drift of the machine (shared VMs can change speed several-fold within minutes). A 1024^3 matmul before each
round records the machine's speed (GFLOP/s) so that a disturbed round can be seen in the JSON.

How to read it. speedup = t(per-step) / t(JAGG). W/2 is the limit on hardware whose throughput does not
depend on the batch size (2 joint rows of work replace W); `ratio` = speedup / (W/2). The target is
ratio >= 0.9 for `cached`. A ratio above 1 means the 2B-row pass is more efficient per row than the B-row
one (the batch is too small to saturate the machine); `forward` pays (W - 2) extra no-grad forwards.

    python tools/bench_window.py --threads 2 --repeats 3 --json out.json --markdown out.md
    python tools/bench_window.py --quick     # tiny model, seconds: a smoke test of the script only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from jagg_scale.grpo.loss import GRPOStepLoss  # noqa: E402
from jagg_scale.grpo.rollout import sample_sde  # noqa: E402
from jagg_scale.grpo.schedule import sigma_schedule  # noqa: E402
from jagg_scale.jagg.backward import exact_backward, jagg_backward  # noqa: E402
from jagg_scale.models.dit import DiT, DiTConfig  # noqa: E402

METHODS = ("per-step", "cached", "interpolate", "forward")
MODES = METHODS[1:]
DEFAULT_MODEL = dict(image_size=32, in_channels=4, patch_size=2, hidden_size=512, depth=6, num_heads=8)
QUICK_MODEL = dict(image_size=16, in_channels=4, patch_size=4, hidden_size=64, depth=2, num_heads=4)


def build_problem(cfg: dict, batch: int, num_steps: int, seed: int, noise_level=0.7, shift=3.0, clip=1e-4):
    """A random-weight DiT and a real on-policy GRPO minibatch: SDE trajectories, random advantages, the loss."""
    torch.manual_seed(seed)
    model = DiT(DiTConfig(**cfg)).init_weights(zero_out=False)
    cond = model.encode_prompts([f"a photo of object {i}" for i in range(batch)])
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, *model.latent_shape, generator=gen)
    sigmas = sigma_schedule(num_steps, shift)
    traj = sample_sde(model, cond, noise, sigmas, noise_level=noise_level, generator=gen)
    advantages = torch.randn(batch, generator=gen)
    step_batch = traj.step_batch(torch.arange(batch), advantages, torch.ones(batch, dtype=torch.bool))
    return model, cond, traj, step_batch, noise_level, clip


def make_runner(model, cond, traj, step_batch, noise_level, clip):
    """run(method, W): train the window of steps 0 .. W-1 once; the step loss is the mean over the W steps."""

    def run(method: str, W: int) -> None:
        loss = GRPOStepLoss(step_batch, noise_level=noise_level, clip_range=clip, scale=1.0 / W)
        latents, sigmas = traj.latents[:W], traj.sigmas[:W]
        if method == "per-step":
            exact_backward(model, latents, sigmas, cond, loss)
        else:
            jagg_backward(model, latents, sigmas, cond, loss, cached_velocities=traj.velocities[:W], intermediate=method)

    return run


def timed(run, model, method: str, W: int) -> float:
    model.zero_grad(set_to_none=False)  # grads stay allocated: every method accumulates into existing buffers
    t0 = time.perf_counter()
    run(method, W)
    return time.perf_counter() - t0


def matmul_gflops() -> float:
    a = torch.randn(1024, 1024)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    return 10 * 2 * 1024**3 / (time.perf_counter() - t0) / 1e9


def benchmark(run, model, widths, repeats: int) -> dict:
    for method in METHODS:  # warm-up: allocator, threads, the B, 2B and (W-2)B row shapes
        run(method, max(widths))
    times = {W: {m: [] for m in METHODS} for W in widths}
    gflops = []
    for r in range(repeats):
        gflops.append(round(matmul_gflops(), 1))
        order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
        for W in widths:
            for m in order:
                times[W][m].append(timed(run, model, m, W))
        done = {W: {m: round(t[-1], 3) for m, t in d.items()} for W, d in times.items()}
        print(f"  repeat {r + 1}/{repeats} (matmul {gflops[-1]:.0f} GFLOP/s): {done}", flush=True)
    rows = []
    for W in widths:
        med = {m: statistics.median(times[W][m]) for m in METHODS}
        row = {"W": W, "limit": W / 2, "seconds": med, "all_seconds": times[W]}
        paired = {m: [a / b for a, b in zip(times[W]["per-step"], times[W][m])] for m in MODES}
        row["speedup"] = {m: statistics.median(paired[m]) for m in MODES}
        row["ratio_to_limit"] = {m: row["speedup"][m] / (W / 2) for m in MODES}
        rows.append(row)
    return {"rows": rows, "matmul_gflops_per_repeat": gflops}


def markdown_table(rows) -> str:
    head = ["W", "per-step s"] + [f"{m} s" for m in MODES] + [f"speedup {m}" for m in MODES] + ["W/2"]
    head += [f"{m} / (W/2)" for m in MODES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["W"]), f"{r['seconds']['per-step']:.3f}"] + [f"{r['seconds'][m]:.3f}" for m in MODES]
        cells += [f"{r['speedup'][m]:.2f}x" for m in MODES] + [f"{r['limit']:.1f}"]
        cells += [f"{r['ratio_to_limit'][m]:.2f}" for m in MODES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model: smoke-test the script, numbers meaningless")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--markdown", type=Path, default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    if min(args.widths) < 2:
        p.error("widths must be >= 2 (W = 1 is the per-step baseline itself)")
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = QUICK_MODEL if args.quick else DEFAULT_MODEL
    t0 = time.perf_counter()
    model, cond, traj, step_batch, noise_level, clip = build_problem(cfg, args.batch, max(args.widths), args.seed)
    n_params = model.num_params()
    tokens = (cfg["image_size"] // cfg["patch_size"]) ** 2
    machine = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "device": "cpu",
    }
    print(f"model: DiT {cfg}, {n_params:,} parameters, {tokens} tokens/sample; batch {args.batch}")
    print(f"rollout: {max(args.widths)} SDE steps (noise 0.7, shift 3) in {time.perf_counter() - t0:.1f} s")
    print(f"machine: {machine}", flush=True)

    result = benchmark(make_runner(model, cond, traj, step_batch, noise_level, clip), model, args.widths, args.repeats)
    table = markdown_table(result["rows"])
    total = time.perf_counter() - t0
    print("\n" + table + f"\n\ntotal wall time {total:.0f} s")
    result.update(
        command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        model={"config": cfg, "parameters": n_params, "tokens_per_sample": tokens, "quick": args.quick},
        batch=args.batch, repeats=args.repeats, machine=machine, total_seconds=total,
        setup={"num_steps": max(args.widths), "noise_level": noise_level, "shift": 3.0, "clip_range": clip,
               "window": "steps 0 .. W-1", "statistic": "median"},
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(
            f"Command: `{result['command']}`\n\nModel: DiT {cfg}, {n_params:,} parameters, batch {args.batch}, "
            f"median of {args.repeats}\n\nMachine: {machine}\n\n{table}\n"
        )
    return result


if __name__ == "__main__":
    main()
