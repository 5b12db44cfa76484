"""Part 1, window_speed: the training of ONE window of W sampling steps on an SD3-shaped DiT.

A diffusers SD3Transformer2DModel (~45M parameters, 32x32x16 latents, batch 4, random text embeddings) samples a
real on-policy GRPO minibatch with the Flow-GRPO SDE; with random advantages and the real GRPOStepLoss (clip
1e-4), each method then accumulates the gradient of the window made of steps 0 .. W-1 into .grad:

    per-step     Flow-GRPO: `exact_backward`, W forwards with grad (B rows) and W backwards      ~ W (F + B)
    eff_grpo     the peer's variant, implemented here only: W no-grad forwards (B rows each) give the per-step
                 upstream gradients, INDEX-based weights a_k = k / (W - 1), then TWO separate with-grad endpoint
                 forwards, each with its own backward                                           ~ W F + 2 (F + B)
    cached       `jagg_backward(intermediate="cached")`: one forward + one backward of 2B rows   ~ 2 (F + B)
    interpolate  the same, intermediate values = cached ones moved by the endpoints' drift
    forward      the same plus one no-grad forward of (W - 2) B rows

Timing: every method warmed up once, then rounds that time every (W, method) once
with the method order rotated; gradients zeroed outside the timed region; speedup = median over rounds of the
paired ratio t(per-step) / t(method). W/2 is the limit on equal-throughput hardware; target: cached >= 0.9 W/2.
"""

from __future__ import annotations

import time

import torch

from .common import median, ops_table, paired_rounds, paired_speedup, sd3_problem, top_ops

from jagg_scale.jagg import exact_backward, jagg_backward

METHODS = ("per-step", "eff_grpo", "cached", "interpolate", "forward")
TARGET_RATIO = 0.9


def eff_grpo_backward(model_fn, latents, sigmas, cond, step_loss) -> torch.Tensor:
    """The eff_grpo-style peer: per-step upstream gradients from W separate no-grad forwards, index-based
    interpolation weights, and two with-grad endpoint passes with a backward each (2 all-gather cycles under
    sharding, where jagg_backward's joint pass needs one)."""
    W, B = latents.shape[:2]
    losses, grads = [], []
    for k in range(W):
        with torch.no_grad():
            v = model_fn(latents[k], sigmas[k].expand(B), cond)
        v = v.detach().float().requires_grad_(True)
        loss = step_loss(k, v)
        (g,) = torch.autograd.grad(loss, v)
        losses.append(loss.detach())
        grads.append(g)
    a = [k / (W - 1) for k in range(W)]  # by step index, not by sigma
    g_first = sum((1 - a[k]) * grads[k] for k in range(W))
    g_last = sum(a[k] * grads[k] for k in range(W))
    for k, g in ((0, g_first), (W - 1, g_last)):
        v = model_fn(latents[k], sigmas[k].expand(B), cond)
        v.backward(g.to(v.dtype))
    return torch.stack(losses).sum()


def make_case(problem, method: str, W: int):
    model, cond, traj = problem.model, problem.cond, problem.traj
    latents, sigmas, cached = traj.latents[:W], traj.sigmas[:W], traj.velocities[:W]

    def run():
        loss = problem.loss(W)
        if method == "per-step":
            return exact_backward(model, latents, sigmas, cond, loss)
        if method == "eff_grpo":
            return eff_grpo_backward(model, latents, sigmas, cond, loss)
        return jagg_backward(model, latents, sigmas, cond, loss, cached_velocities=cached, intermediate=method)

    return run


def run(quick: bool, repeats: int | None = None) -> dict:
    widths = [3, 4] if quick else [3, 4, 5, 8]
    repeats = repeats or (1 if quick else 5)  # full: ~45 s per round on a 2-core CPU
    batch = 4
    problem = sd3_problem(quick, batch, num_steps=6 if quick else 12)
    model = problem.model
    print(f"  model: {problem.model.num_params():,} parameters, {problem.model.tokens(problem.text_tokens)} tokens/"
          f"sample, batch {batch}; rollout {problem.rollout_seconds:.1f}s", flush=True)
    cases = {f"{m}@{W}": make_case(problem, m, W) for W in widths for m in METHODS}
    # warm-up: every method at the largest W (allocator, threads, the B, 2B and (W-2)B row shapes)
    for m in METHODS:
        cases[f"{m}@{max(widths)}"]()
        model.zero_grad(set_to_none=False)
    rounds = paired_rounds(cases, model, repeats, label="window_speed", warmup=False,
                           groups=[[f"{m}@{W}" for m in METHODS] for W in widths])
    times = rounds["times"]
    rows = []
    for W in widths:
        base = times[f"per-step@{W}"]
        row = {"W": W, "limit": W / 2, "seconds": {m: median(times[f"{m}@{W}"]) for m in METHODS},
               "all_seconds": {m: times[f"{m}@{W}"] for m in METHODS}}
        row["speedup"] = {m: paired_speedup(base, times[f"{m}@{W}"]) for m in METHODS[1:]}
        row["ratio_to_limit"] = {m: row["speedup"][m] / (W / 2) for m in METHODS[1:]}
        rows.append(row)

    worst = min(rows, key=lambda r: r["ratio_to_limit"]["cached"])
    result = {
        "model": problem.describe(), "widths": widths, "repeats": repeats, "methods": list(METHODS),
        "rows": rows, "matmul_gflops_per_round": rounds["gflops"],
        "summary": {f"speedup_cached_W{r['W']}": r["speedup"]["cached"] for r in rows}
        | {f"speedup_eff_grpo_W{r['W']}": r["speedup"]["eff_grpo"] for r in rows}
        | {f"ratio_cached_to_limit_W{r['W']}": r["ratio_to_limit"]["cached"] for r in rows},
        "target": {"name": "backward speedup with cached values >= 0.9 x W/2", "threshold": TARGET_RATIO,
                   "worst_W": worst["W"], "worst_ratio": worst["ratio_to_limit"]["cached"],
                   "met": all(r["ratio_to_limit"]["cached"] >= TARGET_RATIO for r in rows)},
    }
    if not result["target"]["met"] or quick:  # quick: exercise the profiling path too
        W = worst["W"]
        print(f"  profiling per-step and cached at W={W} (worst ratio to W/2)", flush=True)
        result["profile"] = {"W": W}
        for m in ("per-step", "cached"):
            model.zero_grad(set_to_none=False)
            result["profile"][m] = top_ops(make_case(problem, m, W))
    model.zero_grad(set_to_none=False)
    return result


def markdown(res: dict) -> str:
    mdl = res["model"]
    modes = METHODS[1:]
    head = ["W", "per-step s"] + [f"{m} s" for m in modes] + [f"speedup {m}" for m in modes] + ["W/2"]
    head += [f"{m} / (W/2)" for m in ("eff_grpo", "cached", "interpolate", "forward")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        cells = [str(r["W"]), f"{r['seconds']['per-step']:.3f}"] + [f"{r['seconds'][m]:.3f}" for m in modes]
        cells += [f"{r['speedup'][m]:.2f}x" for m in modes] + [f"{r['limit']:.1f}"]
        cells += [f"{r['ratio_to_limit'][m]:.2f}" for m in modes]
        lines.append("| " + " | ".join(cells) + " |")
    cfg = mdl["config"]
    out = [
        f"Model: diffusers `SD3Transformer2DModel` ({cfg['num_layers']} layers, {cfg['num_attention_heads']} heads x "
        f"{cfg['attention_head_dim']}, dual attention in layers {list(cfg['dual_attention_layers'])}, RMS qk-norm), "
        f"**{mdl['parameters']:,} parameters**, {cfg['sample_size']}x{cfg['sample_size']}x{cfg['in_channels']} latents "
        f"in {cfg['patch_size']}x{cfg['patch_size']} patches + {mdl['text_tokens']} random text tokens "
        f"({mdl['tokens_per_sample']} tokens/sample), batch {mdl['batch']}, float32. Rollout: {mdl['num_steps']} SDE "
        f"steps (noise {mdl['noise_level']}, shift {mdl['shift']}), random advantages, GRPOStepLoss clip "
        f"{mdl['clip_range']}, on-policy. Window = steps 0 .. W-1. Medians of {res['repeats']} rounds; speedups are "
        f"medians of paired per-round ratios. Matmul probe per round: {res['matmul_gflops_per_round']} GFLOP/s.",
        "",
        "\n".join(lines),
        "",
        "Cost models (F forward, B backward, B rows): per-step W (F + B); eff_grpo W F_nograd + 2 (F + B) (its two "
        "endpoint passes are separate B-row passes, and its weights k/(W-1) ignore the shifted sigma schedule); "
        "JAGG cached/interpolate 2 (F + B) as one 2B-row pass; forward adds (W - 2) B rows of no-grad forward.",
    ]
    if "profile" in res:
        p = res["profile"]
        out += ["", f"Profile of the worst case (W = {p['W']}), one run each, top ops by self CPU time:", ""]
        for m in ("per-step", "cached"):
            out += [f"*{m}* (profiled wall {p[m]['wall_seconds_profiled']} s):", "", ops_table(p[m]), ""]
    return "\n".join(out)


def plot(res: dict, ax) -> None:
    Ws = [r["W"] for r in res["rows"]]
    for m in METHODS[1:]:
        ax.plot(Ws, [r["speedup"][m] for r in res["rows"]], marker="o", label=m)
    ax.plot(Ws, [W / 2 for W in Ws], "k--", label="W/2 limit")
    ax.plot(Ws, [TARGET_RATIO * W / 2 for W in Ws], "k:", label="target 0.9 W/2")
    ax.set(xlabel="window W (steps)", ylabel="speedup over per-step", title="one window: speedup vs W")
    ax.set_xticks(Ws)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


if __name__ == "__main__":
    t0 = time.perf_counter()
    print(run(quick=True)["summary"], f"{time.perf_counter() - t0:.1f}s")
