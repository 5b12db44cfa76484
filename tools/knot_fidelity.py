"""Gradient fidelity of the frozen models evaluated at knots, and of DiffusionNFT's noise draws, on the digits task.

    python -m tools.knot_fidelity --out docs/results/knot_fidelity       # ~10 min on 2 cores; --quick: a smoke run

Two measurements, each of a gradient against the one it stands in for, on real rollouts of configs/digits_cpu.yaml
(optimizer steps replaced by a capture of the first minibatch's gradient; between measured steps the trainer takes
real steps, so later rollouts are off the starting weights):

ref_at   GRPO with the KL reference on the JAGG plan's knots only (grpo.ref_at knots: its velocity linear in sigma
         between them) against the reference on every trained step, both through the same JAGG plan, and each
         against Flow-GRPO's per-step gradient with the reference everywhere; per KL weight and window
nft      DiffusionNFT's minibatch gradient under each way of drawing the training noise (nft.noise) and placing
         the frozen models (nft.old_at), per JAGG plan, against the EXPECTED per-timestep gradient (the mean of
         --draws independent DiffusionNFT draws of noise and timesteps on the same rollout): a draw's cosine to
         the expectation is what it says about the update, its noise and its bias together; the training
         phase's seconds per scheme are on the same machine in the same run

Writes OUT.json and prints the tables (docs/algorithm.md sections 1 and 8 cite them).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from jagg_scale.jagg import ExactPlanner, WindowPlanner, fill_interior, plan_uniform, split_windows
from jagg_scale.rewards.multi import ChunkScorer, gather_components
from jagg_scale.train import Trainer, load_config
from jagg_scale.train import nft as nft_module
from jagg_scale.train.rows import StepRows

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "digits_cpu.yaml"
COMMON = ["eval.enabled=false", "log.progress=false", "log.wandb=false", "run.checkpoint_every=0",
          "run.overwrite=true"]
QUICK = ["sampling.num_steps=8", "sampling.eval_num_steps=8", "train.prompts_per_step=1", "train.minibatch_size=8",
         "sampling.chunk_size=8"]
# (name, nft.noise, window or None for per-timestep backwards, nft.old_at)
NFT_SCHEMES = [("NFT (per-timestep noise, exact)", "per_timestep", None, "timesteps"),
               ("shared noise, exact", "per_sample", None, "timesteps"),
               ("shared noise, one window", "per_sample", "K", "timesteps"),
               ("shared noise, one window, knots", "per_sample", "K", "knots"),
               ("shared noise, W4", "per_sample", 4, "timesteps"),
               ("noise per window, W3", "per_window", 3, "timesteps"),
               ("noise per window, W3, knots", "per_window", 3, "knots"),
               ("noise per window, W4", "per_window", 4, "timesteps"),
               ("noise per window, W4, knots", "per_window", 4, "knots"),
               ("noise per window, W5", "per_window", 5, "timesteps"),
               ("noise per window, W5, knots", "per_window", 5, "knots"),
               ("noise per window, W8, knots", "per_window", 8, "knots")]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


class Capture:
    """The trainer's update phase with its optimizer steps replaced by a capture of each minibatch's gradient."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.grads = trainer, []
        self.real_step = trainer.engine.step

    def __enter__(self):
        def capture(loss=None):
            self.grads.append(torch.cat([p.grad.detach().flatten().double() for p in self.trainer.engine.params]))
            for p in self.trainer.engine.params:
                p.grad = None
            return 0.0

        self.trainer.engine.step = capture
        self.trainer.algorithm.runner.applied = lambda step: True
        return self

    def __exit__(self, *exc):
        self.trainer.engine.step = self.real_step
        del self.trainer.algorithm.runner.applied


def rollout(trainer: Trainer, step: int):
    """The trainer's rollout -> reward -> advantages of one step (train_step's first half), with the reference on
    every trained step."""
    cfg, g = trainer.cfg, trainer.cfg.grpo.group_size
    records = [r for r in trainer.source.next_prompts() for _ in range(g)]
    rows = StepRows.draw(len(records), cfg.train.minibatch_size, cfg.run.seed, step, 0, 1)
    prompts, meta = [records[i].prompt for i in rows.mine.tolist()], [records[i].metadata for i in rows.mine.tolist()]
    spec = trainer.algorithm.rollout_spec(step)
    cond, steps = trainer.policy.encode(prompts), list(spec.trained or ())
    if spec.keep == "trajectory":  # GRPO: the reference on every trained step, nothing filled in
        spec = dataclasses.replace(spec, ref_steps=frozenset(steps), ref_plan=None)
    scorer = ChunkScorer(trainer.reward, trainer.model.decode, background=False, device=trainer.device)
    trainer.model.eval()
    traj = trainer.policy.rollout(cond, rows.mine, step, spec=spec, prompts=prompts,
                                  on_chunk=lambda c, final: scorer.add(final, prompts[c], meta[c]))
    parts = gather_components(scorer.finish(), rows.all_rows, len(records), lambda t: t)
    adv = trainer.algorithm.advantages(parts, trainer.reward.weights, [i // g for i in range(len(records))])
    trainer.model.train()
    return traj, cond, adv, rows, steps


def ref_at(beta: float, window: int, steps: int, quick: bool, work: Path) -> dict:
    """cos(JAGG with the reference at knots, JAGG with it everywhere), and each against Flow-GRPO's gradient."""
    trainer = Trainer(load_config(CONFIG, COMMON + (QUICK if quick else []) + [
        f"grpo.kl_beta={beta}", f"jagg.window={window}", f"run.output_dir={work / f'ref_{beta}_{window}'}"]))
    out = []
    for step in range(steps):
        traj, cond, adv, rows, trained = rollout(trainer, step)
        filled = copy.copy(traj)
        # float32: the blends between the knots are float32 math (the rollout may store the reference in bf16)
        filled.ref_velocities = traj.ref_velocities.to(torch.float32, copy=True)
        plan, at = plan_uniform(len(trained), window), traj.positions(trained)  # positions in what it stores
        filled.ref_velocities[at] = fill_interior(plan, filled.ref_velocities[at], traj.sigmas[at])
        grads = {}
        with Capture(trainer) as cap:
            for name, t, planner in (("knots", filled, None), ("steps", traj, None), ("exact", traj, ExactPlanner())):
                cap.grads.clear()
                runner = trainer.algorithm.runner
                saved = runner.planner
                runner.planner = planner or saved
                trainer.algorithm.update(t, cond, adv, rows, step)
                runner.planner = saved
                grads[name] = cap.grads[0]  # the first minibatch: the rollout's own weights
        out.append({"knots_vs_steps": _cos(grads["knots"], grads["steps"]),
                    "steps_vs_exact": _cos(grads["steps"], grads["exact"]),
                    "knots_vs_exact": _cos(grads["knots"], grads["exact"])})
        trainer.train_step(1000 + step)  # a real step: the next rollout is off the starting weights
    trainer.close()
    return {k: statistics.mean(o[k] for o in out) for k in out[0]} | {"per_step": out}


def nft(draws: int, repeats: int, quick: bool, work: Path) -> dict:
    """Each scheme's minibatch gradient against the expected per-timestep NFT gradient on one rollout."""
    from tools.bench.time_to_reward import RECIPE, arm_overrides

    trainer = Trainer(load_config(CONFIG, COMMON + (QUICK if quick else []) + RECIPE + arm_overrides(
        "NFT", 8 if quick else 16) + [f"run.output_dir={work / 'nft'}"]))
    traj, cond, adv, rows, trained = rollout(trainer, 0)
    up, K = trainer.algorithm, trainer.algorithm.K
    streams = (nft_module.NOISE_STREAM, nft_module.TIMESTEP_STREAM)

    def configure(noise: str, window, old_at: str) -> None:
        w = K if window == "K" else window
        trainer.cfg.nft.noise = noise
        up.runner.planner = ExactPlanner() if w is None else WindowPlanner(window=w)
        groups = {"per_timestep": [[k] for k in range(K)], "per_sample": [list(range(K))],
                  "per_window": split_windows(range(K), w or K)}[noise]
        up.draw_of = torch.tensor([i for i, grp in enumerate(groups) for _ in grp])
        up.frozen_plan = plan_uniform(K, w) if old_at == "knots" else None

    def gradient(draw: int) -> tuple[torch.Tensor, float]:
        nft_module.NOISE_STREAM, nft_module.TIMESTEP_STREAM = 1000 + 2 * draw, 1001 + 2 * draw  # independent draws
        with Capture(trainer) as cap:
            t0 = time.perf_counter()
            up.update(traj, cond, adv, rows, 0)
            return torch.stack(cap.grads).sum(0), time.perf_counter() - t0

    try:
        configure("per_timestep", None, "timesteps")
        ref = [gradient(10_000 + i)[0] for i in range(draws)]
        expected = torch.stack(ref).mean(0)
        loo = statistics.mean(_cos(r, (expected * draws - r) / (draws - 1)) for r in ref)
        schemes = {}
        for name, noise, window, old_at in NFT_SCHEMES:
            configure(noise, window, old_at)
            got = [gradient(i) for i in range(repeats)]
            cos = [_cos(g, expected) for g, _ in got]
            schemes[name] = {"cos_to_expected": statistics.mean(cos),
                             "cos_std": statistics.stdev(cos) if len(cos) > 1 else 0.0,
                             "train_seconds": statistics.median(t for _, t in got)}
            print(f"  nft {name}: cos {schemes[name]['cos_to_expected']:.4f} +- {schemes[name]['cos_std']:.4f}, "
                  f"{schemes[name]['train_seconds']:.2f} s", flush=True)
    finally:
        nft_module.NOISE_STREAM, nft_module.TIMESTEP_STREAM = streams
        trainer.close()
    return {"K": K, "draws": draws, "repeats": repeats, "leave_one_out_cos": loo, "schemes": schemes}


def table(res: dict) -> str:
    lines = ["| KL beta | window | JAGG, reference at knots vs everywhere | JAGG vs Flow-GRPO (reference everywhere) | "
             "JAGG with reference at knots vs Flow-GRPO |", "|---|---|---|---|---|"]
    for r in res["ref_at"]:
        lines.append(f"| {r['beta']} | {r['window']} | {r['knots_vs_steps']:.4f} | {r['steps_vs_exact']:.4f} | "
                     f"{r['knots_vs_exact']:.4f} |")
    n = res["nft"]
    lines += ["", f"DiffusionNFT, K = {n['K']} timesteps per sample; expected gradient = the mean of {n['draws']} "
              f"per-timestep draws (one draw's leave-one-out cosine to the rest: {n['leave_one_out_cos']:.4f}):", "",
              "| scheme | cosine to the expected gradient (mean +- std) | training phase s (vs NFT) |", "|---|---|---|"]
    base = n["schemes"][NFT_SCHEMES[0][0]]["train_seconds"]
    for name, r in n["schemes"].items():
        lines.append(f"| {name} | {r['cos_to_expected']:.4f} +- {r['cos_std']:.4f} | {r['train_seconds']:.2f} "
                     f"({r['train_seconds'] / base:.2f}x) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/results/knot_fidelity")
    p.add_argument("--quick", action="store_true", help="toy sizes: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="measured steps per ref_at case (3; quick 1)")
    p.add_argument("--draws", type=int, default=None, help="NFT draws for the expected gradient (8; quick 2)")
    p.add_argument("--repeats", type=int, default=None, help="draws per NFT scheme (3; quick 1)")
    args = p.parse_args(argv)
    steps, draws, repeats = (args.steps or (1 if args.quick else 3), args.draws or (2 if args.quick else 8),
                             args.repeats or (1 if args.quick else 3))
    torch.set_num_threads(1 if args.quick else torch.get_num_threads())
    work = Path(args.out).with_suffix(".work")
    cases = [(0.04, 4)] if args.quick else [(0.01, 4), (0.04, 4), (0.2, 4), (0.2, 8)]
    res = {"command": "python -m tools.knot_fidelity " + " ".join(sys.argv[1:] if argv is None else argv),
           "config": "configs/digits_cpu.yaml", "ref_at": [], "nft": None}
    for beta, window in cases:
        r = ref_at(beta, window, steps, args.quick, work)
        res["ref_at"].append({"beta": beta, "window": window, **r})
        print(f"  ref_at beta {beta} W{window}: knots vs steps {r['knots_vs_steps']:.4f}, steps vs exact "
              f"{r['steps_vs_exact']:.4f}", flush=True)
    res["nft"] = nft(draws, repeats, args.quick, work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
