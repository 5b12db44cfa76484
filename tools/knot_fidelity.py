"""Gradient fidelity of the frozen models evaluated at knots, of DiffusionNFT's noise draws and of the update's refresh
at the knots, on the digits task.

    python -m tools.knot_fidelity --out docs/results/knot_fidelity       # ~10 min on 2 cores; --quick: a smoke run
    python -m tools.knot_fidelity --parts refresh_at --threads 1 --steps 8 --lr-scales 1 \
        --out docs/results/refresh_fidelity                                  # 6 min on 1 core

Three measurements, each of a gradient against the one it stands in for, on real rollouts of configs/digits_cpu.yaml
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
refresh_at  GRPO under CFG (sampling.guidance 4.5; the digits generator was trained with 10% of its prompts dropped)
         with two minibatches per rollout: the first trained and stepped for real (Adam at train.lr, and at
         --lr-scales times it), then the second minibatch's gradient after that step with the refresh at the knots
         (grpo.refresh_at knots: u at the knots, moved by their drift in between; interiors interpolated) against the
         full refresh (steps: u at every trained step, interiors forwarded), through the same JAGG plan; beside it
         the parts apart (u at the knots alone, interiors alone), u as the plain sigma-blend of its fresh knots
         instead of the drift form, no refresh at all (the rollout's u and cached interiors), and Flow-GRPO's
         per-step gradient with the full refresh

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

from jagg_scale.cond import index_cond
from jagg_scale.jagg import ExactPlanner, WindowPlanner, fill_interior, plan_knots, plan_uniform, split_windows
from jagg_scale.rewards.multi import ChunkScorer, gather_components
from jagg_scale.train import Trainer, load_config
from jagg_scale.train import nft as nft_module
from jagg_scale.train import policy as policy_module
from jagg_scale.train.rows import StepRows
from jagg_scale.train.runner import backward_minibatch, plan_minibatch

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


# (name, grpo.refresh_at, the intermediate mode forced on the minibatch or None, u blended plainly, planner exact)
REFRESH_VARIANTS = [("knots (u drift, interiors interpolate)", "knots", None, False, False),
                    ("knots, u plain blend of the fresh knots", "knots", None, True, False),
                    ("u at the knots alone (interiors forwarded)", "knots", "forward", False, False),
                    ("u plain blend alone (interiors forwarded)", "knots", "forward", True, False),
                    ("interiors interpolated alone (u at every step)", "steps", "interpolate", False, False),
                    ("no refresh (rollout's u, cached interiors)", None, None, False, False),
                    ("Flow-GRPO per step, full refresh", "steps", None, False, True)]


def _plain_fill(plan, values, sigmas, *, moved=None):
    """fill_interior without the drift form: u_k = (1 - a_k) u_a' + a_k u_b' of the fresh knots alone."""
    return fill_interior(plan, values, sigmas)


@torch.no_grad()
def _value_errors(alg, mb, uncond, local) -> dict:
    """At the interior steps of the minibatch's plan, after the step: |approximation - fresh| / |fresh - rollout's|,
    summed over the interior steps, of u (drift form, plain blend of the knots) and of c (knot_backward's
    interpolate): the share of the drift since the rollout the interpolation misses."""
    batch, steps, fn = mb.batch, mb.positions, alg.policy.model_fn()
    plan = plan_minibatch(alg.runner.planner, mb).plan
    knots = set(plan_knots(plan))
    interior = [steps[q] for q in range(len(steps)) if q not in knots]
    uc = index_cond(uncond, local)
    fresh_u = alg.policy.fresh_uncond(batch, steps, uc).uncond_velocities
    drift_u = alg.policy.fresh_uncond(batch, steps, uc, plan).uncond_velocities
    at = torch.tensor(steps)
    plain_u = fresh_u.clone()
    plain_u[at] = fill_interior(plan, fresh_u[at], batch.sigmas[at])
    B = batch.latents.shape[1]
    fresh_c = batch.velocities.clone()
    for k in steps:
        fresh_c[k] = fn(batch.latents[k], batch.sigmas[k].expand(B), mb.cond).float()
    interp_c = fresh_c.clone()
    interp_c[at] = fill_interior(plan, fresh_c[at], batch.sigmas[at], moved=batch.velocities[at])

    def missed(approx, fresh, old):
        return float(sum((approx[k] - fresh[k]).norm() for k in interior)
                     / sum((fresh[k] - old[k]).norm() for k in interior))

    old_u = batch.uncond_velocities
    return {"u_drift_missed": missed(drift_u, fresh_u, old_u), "u_plain_missed": missed(plain_u, fresh_u, old_u),
            "c_interpolate_missed": missed(interp_c, fresh_c, batch.velocities)}


def refresh_at(window: int, beta: float, steps: int, lr_scales: list[float], quick: bool, work: Path) -> dict:
    """Per rollout and learning-rate scale: after a real optimizer step on the first minibatch, the second
    minibatch's gradient under each REFRESH_VARIANTS entry against the full refresh's (grpo.refresh_at steps)."""
    trainer = Trainer(load_config(CONFIG, COMMON + (QUICK if quick else []) + [
        "sampling.guidance=4.5", f"jagg.window={window}", f"grpo.kl_beta={beta}",
        f"run.output_dir={work / f'refresh_{window}_{beta}'}",
        f"train.minibatch_size={4 if quick else 32}"]))
    alg, engine, cfg = trainer.algorithm, trainer.engine, trainer.cfg
    runner, params = alg.runner, engine.params
    base_lr = [g["lr"] for g in engine.optimizer.param_groups]

    def grad_of(mb, planner) -> torch.Tensor:
        for p in params:
            p.grad = None
        backward_minibatch(alg.policy.model_fn(), mb, planner, planned=plan_minibatch(planner, mb),
                           backward=engine.backward, micro_batch_size=cfg.train.micro_batch_size)
        g = torch.cat([p.grad.detach().flatten().double() for p in params])
        for p in params:
            p.grad = None
        return g

    out = []
    for step in range(steps):
        traj, cond, adv, rows, trained = rollout(trainer, step)
        c, uc = alg.policy.split_cond(cond)
        build = alg._minibatches(traj, c, uc, adv, rows, step, trained, alg.policy.guidance)
        (l1, g1), (l2, g2), *_ = rows.minibatches(0, cfg.run.seed, step)
        # the trainer's own weights and Adam state before the step, put back after each measurement
        start = ([p.detach().clone() for p in params], copy.deepcopy(engine.optimizer.state_dict()))
        for scale in lr_scales:
            for group, lr in zip(engine.optimizer.param_groups, base_lr):
                group["lr"] = lr * scale
            # the on-policy minibatch's gradient, then a real optimizer step
            backward_minibatch(alg.policy.model_fn(), build(0, l1, g1, True), runner.planner,
                               backward=engine.backward, micro_batch_size=cfg.train.micro_batch_size)
            engine.step()
            grads = {}
            for name, at, forced, plain, exact in [("steps", "steps", None, False, False), *REFRESH_VARIANTS]:
                cfg.grpo.refresh_at = at or "steps"
                mb = build(0, l2, g2, at is None)  # None: built as on-policy, so nothing is refreshed
                mb = dataclasses.replace(mb, intermediate=forced) if forced else mb
                policy_module.fill_interior = _plain_fill if plain else fill_interior
                try:
                    grads[name] = grad_of(mb, ExactPlanner() if exact else runner.planner)
                finally:
                    policy_module.fill_interior = fill_interior
            cfg.grpo.refresh_at = "steps"
            out.append({"step": step, "lr_scale": scale, **_value_errors(alg, build(0, l2, g2, False), uc, l2),
                        **{name: _cos(grads[name], grads["steps"]) for name, *_ in REFRESH_VARIANTS},
                        "knots_vs_exact": _cos(grads[REFRESH_VARIANTS[0][0]], grads[REFRESH_VARIANTS[-1][0]])})
            with torch.no_grad():  # back to the weights before this step's measurement
                for p, w in zip(params, start[0]):
                    p.copy_(w)
            engine.optimizer.load_state_dict(copy.deepcopy(start[1]))
            print(f"  refresh_at W{window} beta {beta} step {step} lr x{scale}: "
                  + ", ".join(f"{k} {v:.4f}" for k, v in out[-1].items() if k not in ("step", "lr_scale")), flush=True)
        for group, lr in zip(engine.optimizer.param_groups, base_lr):
            group["lr"] = lr
        trainer.train_step(1000 + step)  # a real step: the next rollout is off the starting weights
    trainer.close()
    means = {f"lr_x{scale}": {k: statistics.mean(o[k] for o in out if o["lr_scale"] == scale)
                              for k in out[0] if k not in ("step", "lr_scale")} for scale in lr_scales}
    return {"window": window, "beta": beta, "guidance": 4.5, "minibatch_size": cfg.train.minibatch_size, "means": means,
            "per_step": out}


def table(res: dict) -> str:
    lines = []
    if res.get("ref_at"):
        lines += ["| KL beta | window | JAGG, reference at knots vs everywhere | JAGG vs Flow-GRPO (reference "
                  "everywhere) | JAGG with reference at knots vs Flow-GRPO |", "|---|---|---|---|---|"]
        for r in res["ref_at"]:
            lines.append(f"| {r['beta']} | {r['window']} | {r['knots_vs_steps']:.4f} | {r['steps_vs_exact']:.4f} | "
                         f"{r['knots_vs_exact']:.4f} |")
    n = res.get("nft")
    if n is not None:
        lines += ["", f"DiffusionNFT, K = {n['K']} timesteps per sample; expected gradient = the mean of {n['draws']} "
                  f"per-timestep draws (one draw's leave-one-out cosine to the rest: {n['leave_one_out_cos']:.4f}):",
                  "", "| scheme | cosine to the expected gradient (mean +- std) | training phase s (vs NFT) |",
                  "|---|---|---|"]
        base = n["schemes"][NFT_SCHEMES[0][0]]["train_seconds"]
        for name, r in n["schemes"].items():
            lines.append(f"| {name} | {r['cos_to_expected']:.4f} +- {r['cos_std']:.4f} | {r['train_seconds']:.2f} "
                         f"({r['train_seconds'] / base:.2f}x) |")
    for r in res.get("refresh_at") or []:
        scales = list(r["means"])
        lines += ["", f"GRPO under CFG {r['guidance']}, W = {r['window']}, KL beta {r['beta']}, the second minibatch "
                  f"({r['minibatch_size']} "
                  "rows) after one real Adam step: cosine to the full refresh's gradient (grpo.refresh_at steps), mean "
                  f"over {len(r['per_step']) // len(scales)} rollouts", "",
                  "| gradient | " + " | ".join(f"lr x {k[4:]}: mean (range)" for k in scales) + " |",
                  "|---|" + "---|" * len(scales)]

        def cell(k: str, key: str, r=r) -> str:  # the mean over rollouts, and its range
            got = [o[key] for o in r["per_step"] if f"lr_x{o['lr_scale']}" == k]
            return f"{r['means'][k][key]:.4f} ({min(got):.2f} to {max(got):.2f})"

        for name, *_ in REFRESH_VARIANTS:
            lines.append(f"| {name} | " + " | ".join(cell(k, name) for k in scales) + " |")
        lines.append("| knots vs Flow-GRPO per step, full refresh | "
                     + " | ".join(cell(k, "knots_vs_exact") for k in scales) + " |")
        for key, what in (("u_drift_missed", "u drift form"), ("u_plain_missed", "u plain blend"),
                          ("c_interpolate_missed", "c interpolate")):
            lines.append(f"| values: {what}, share of the drift missed at the interior steps | "
                         + " | ".join(cell(k, key) for k in scales) + " |")
    return "\n".join(lines).strip("\n")


PARTS = ("ref_at", "nft", "refresh_at")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/results/knot_fidelity")
    p.add_argument("--parts", default="ref_at,nft", help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="toy sizes: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="measured steps per ref_at / refresh_at case (3; quick 1)")
    p.add_argument("--draws", type=int, default=None, help="NFT draws for the expected gradient (8; quick 2)")
    p.add_argument("--repeats", type=int, default=None, help="draws per NFT scheme (3; quick 1)")
    p.add_argument("--lr-scales", default="1,4", help="refresh_at: the first optimizer step's lr, times train.lr")
    p.add_argument("--windows", default="4", help="refresh_at: the JAGG windows measured")
    p.add_argument("--kl-betas", default="0.01", help="refresh_at: the KL weights measured (0.01: sd35m_pickscore's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (quick: 1; else torch's default)")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        p.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}")
    steps, draws, repeats = (args.steps or (1 if args.quick else 3), args.draws or (2 if args.quick else 8),
                             args.repeats or (1 if args.quick else 3))
    torch.set_num_threads(args.threads or (1 if args.quick else torch.get_num_threads()))
    work = Path(args.out).with_suffix(".work")
    cases = [(0.04, 4)] if args.quick else [(0.01, 4), (0.04, 4), (0.2, 4), (0.2, 8)]
    res = {"command": "python -m tools.knot_fidelity " + " ".join(sys.argv[1:] if argv is None else argv),
           "config": "configs/digits_cpu.yaml", "ref_at": [], "nft": None, "refresh_at": []}
    if "ref_at" in parts:
        for beta, window in cases:
            r = ref_at(beta, window, steps, args.quick, work)
            res["ref_at"].append({"beta": beta, "window": window, **r})
            print(f"  ref_at beta {beta} W{window}: knots vs steps {r['knots_vs_steps']:.4f}, steps vs exact "
                  f"{r['steps_vs_exact']:.4f}", flush=True)
    if "nft" in parts:
        res["nft"] = nft(draws, repeats, args.quick, work)
    if "refresh_at" in parts:
        t0 = time.perf_counter()
        for window in (int(w) for w in args.windows.split(",")):
            for beta in (float(b) for b in args.kl_betas.split(",")):
                res["refresh_at"].append(refresh_at(window, beta, steps, [float(x) for x in args.lr_scales.split(",")],
                                                    args.quick, work))
        res["refresh_seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
