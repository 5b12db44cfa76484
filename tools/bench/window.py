"""Parts window_speed and cfg (a class each, its docstring the page's description): the training of one window on
the SD3-shaped DiT of common.py.

Both share one loop: a real on-policy GRPO minibatch (Flow-GRPO SDE rollout, random advantages, the real
GRPOStepLoss, clip 1e-4), a set of cases that each accumulate a gradient into .grad, every case warmed up, then
paired rounds (common.paired_rounds: order rotated, gradients zeroed outside the timed region) and speedups as medians
of per-round ratios. Targets: window_speed cached >= 0.9 W/2; cfg's arms also report their tensor peak
(torch.profiler memory events, as the memory part).
"""

from __future__ import annotations

import torch

from jagg_scale.cond import cat_cond
from jagg_scale.grpo.rollout import cfg_predictions, guide
from jagg_scale.jagg import exact_backward, jagg_backward

from .common import median, ops_table, paired_rounds, paired_speedup, sd3_problem, tensor_peak, top_ops

BATCH = 4


def _time(problem, cases: dict, repeats: int, label: str, warm: list[str], groups=None) -> tuple[dict, list]:
    """Warm `warm` up (the row shapes the cases use), then time every case in paired rounds: (times, gflops)."""
    for name in warm:
        cases[name]()
        problem.model.zero_grad(set_to_none=False)
    rounds = paired_rounds(cases, problem.model, repeats, label=label, warmup=False, groups=groups)
    problem.model.zero_grad(set_to_none=False)
    return rounds["times"], rounds["gflops"]


def _barh(ax, labels: list[str], values: list[float], xlabel: str, title: str, colors: list[int]) -> None:
    ax.barh(range(len(values)), values, color=[f"C{i}" for i in colors])
    ax.set_yticks(range(len(values)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel=xlabel, title=title)
    ax.grid(alpha=0.3, axis="x")


# ------------------------------------------------------------------------------------------------------------------
# window_speed
# ------------------------------------------------------------------------------------------------------------------

class WindowSpeed:
    """window_speed: one window of W steps on the SD3-shaped DiT.

    Training of ONE window of W consecutive sampling steps (forwards, backwards, gradients accumulated into
    `.grad`), steps 0 .. W-1 of a real on-policy GRPO minibatch with the real `GRPOStepLoss`. **per-step** is
    Flow-GRPO (`exact_backward`: W forward+backward passes of B rows). **eff_grpo** is the peer method, implemented
    in the bench only: W no-grad forwards for the per-step upstream gradients, interpolation weights by step index
    k/(W-1) (not sigma), then two separate with-grad endpoint forwards, each with its own backward. **cached /
    interpolate / forward** are `jagg_backward` with those intermediate modes: one forward + one backward of the 2B
    stacked endpoint rows (forward mode adds one no-grad forward of the (W-2)B intermediate rows). Speedup =
    t(per-step) / t(method); W/2 is the limit on hardware whose throughput does not depend on the batch; `/ (W/2)`
    is the speedup as a fraction of that limit.
    """
    METHODS = ("per-step", "eff_grpo", "cached", "interpolate", "forward")
    TARGET_RATIO = 0.9

    @staticmethod
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

    @classmethod
    def case(cls, problem, method: str, W: int):
        model, cond, traj = problem.model, problem.cond, problem.traj
        latents, sigmas, cached = traj.latents[:W], traj.sigmas[:W], traj.velocities[:W]

        def run():
            loss = problem.loss(W)
            if method == "per-step":
                return exact_backward(model, latents, sigmas, cond, loss)
            if method == "eff_grpo":
                return cls.eff_grpo_backward(model, latents, sigmas, cond, loss)
            return jagg_backward(model, latents, sigmas, cond, loss, cached_velocities=cached, intermediate=method)

        return run

    @classmethod
    def run(cls, quick: bool, repeats: int | None = None) -> dict:
        M = cls.METHODS
        widths = [3, 4] if quick else [3, 4, 5, 8]
        repeats = repeats or (1 if quick else 5)  # full: ~45 s per round on a 2-core CPU
        problem = sd3_problem(quick, BATCH, num_steps=6 if quick else 12)
        print(f"  model: {problem.model.num_params():,} parameters, {problem.model.tokens(problem.text_tokens)} "
              f"tokens/sample, batch {BATCH}; rollout {problem.rollout_seconds:.1f}s", flush=True)
        cases = {f"{m}@{W}": cls.case(problem, m, W) for W in widths for m in M}
        # warm-up: every method at the largest W (allocator, threads, the B, 2B and (W-2)B row shapes)
        times, gflops = _time(problem, cases, repeats, "window_speed", [f"{m}@{max(widths)}" for m in M],
                              groups=[[f"{m}@{W}" for m in M] for W in widths])
        rows = []
        for W in widths:
            base = times[f"per-step@{W}"]
            row = {"W": W, "limit": W / 2, "seconds": {m: median(times[f"{m}@{W}"]) for m in M},
                   "all_seconds": {m: times[f"{m}@{W}"] for m in M}}
            row["speedup"] = {m: paired_speedup(base, times[f"{m}@{W}"]) for m in M[1:]}
            row["ratio_to_limit"] = {m: row["speedup"][m] / (W / 2) for m in M[1:]}
            rows.append(row)
        worst = min(rows, key=lambda r: r["ratio_to_limit"]["cached"])
        result = {
            "model": problem.describe(), "widths": widths, "repeats": repeats, "methods": list(M),
            "rows": rows, "matmul_gflops_per_round": gflops,
            "summary": {f"speedup_cached_W{r['W']}": r["speedup"]["cached"] for r in rows}
            | {f"speedup_eff_grpo_W{r['W']}": r["speedup"]["eff_grpo"] for r in rows}
            | {f"ratio_cached_to_limit_W{r['W']}": r["ratio_to_limit"]["cached"] for r in rows},
            "target": {"name": "backward speedup with cached values >= 0.9 x W/2", "threshold": cls.TARGET_RATIO,
                       "worst_W": worst["W"], "worst_ratio": worst["ratio_to_limit"]["cached"],
                       "met": all(r["ratio_to_limit"]["cached"] >= cls.TARGET_RATIO for r in rows)},
        }
        if not result["target"]["met"] or quick:  # quick: exercise the profiling path too
            W = worst["W"]
            print(f"  profiling per-step and cached at W={W} (worst ratio to W/2)", flush=True)
            result["profile"] = {"W": W}
            for m in ("per-step", "cached"):
                problem.model.zero_grad(set_to_none=False)
                result["profile"][m] = top_ops(cls.case(problem, m, W))
        problem.model.zero_grad(set_to_none=False)
        return result

    @classmethod
    def markdown(cls, res: dict) -> str:
        mdl, modes = res["model"], cls.METHODS[1:]
        head = ["W", "per-step s"] + [f"{m} s" for m in modes] + [f"speedup {m}" for m in modes] + ["W/2"]
        head += [f"{m} / (W/2)" for m in modes]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in res["rows"]:
            cells = [str(r["W"]), f"{r['seconds']['per-step']:.3f}"] + [f"{r['seconds'][m]:.3f}" for m in modes]
            cells += [f"{r['speedup'][m]:.2f}x" for m in modes] + [f"{r['limit']:.1f}"]
            cells += [f"{r['ratio_to_limit'][m]:.2f}" for m in modes]
            lines.append("| " + " | ".join(cells) + " |")
        cfg = mdl["config"]
        out = [
            f"Model: diffusers `SD3Transformer2DModel` ({cfg['num_layers']} layers, {cfg['num_attention_heads']} heads"
            f" x {cfg['attention_head_dim']}, dual attention in layers {list(cfg['dual_attention_layers'])}, RMS "
            f"qk-norm), **{mdl['parameters']:,} parameters**, {cfg['sample_size']}x{cfg['sample_size']}x"
            f"{cfg['in_channels']} latents in {cfg['patch_size']}x{cfg['patch_size']} patches + {mdl['text_tokens']} "
            f"random text tokens ({mdl['tokens_per_sample']} tokens/sample), batch {mdl['batch']}, float32. Rollout: "
            f"{mdl['num_steps']} SDE steps (noise {mdl['noise_level']}, shift {mdl['shift']}), random advantages, "
            f"GRPOStepLoss clip {mdl['clip_range']}, on-policy. Window = steps 0 .. W-1. Medians of {res['repeats']} "
            f"rounds; speedups are medians of paired per-round ratios. Matmul probe per round: "
            f"{res['matmul_gflops_per_round']} GFLOP/s.",
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

    @classmethod
    def plot(cls, res: dict, ax) -> None:
        Ws = [r["W"] for r in res["rows"]]
        for m in cls.METHODS[1:]:
            ax.plot(Ws, [r["speedup"][m] for r in res["rows"]], marker="o", label=m)
        ax.plot(Ws, [W / 2 for W in Ws], "k--", label="W/2 limit")
        ax.plot(Ws, [cls.TARGET_RATIO * W / 2 for W in Ws], "k:", label="target 0.9 W/2")
        ax.set(xlabel="window W (steps)", ylabel="speedup over per-step", title="one window: speedup vs W")
        ax.set_xticks(Ws)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


# ------------------------------------------------------------------------------------------------------------------
# cfg
# ------------------------------------------------------------------------------------------------------------------

class Cfg:
    """cfg: training under classifier-free guidance.

    Training of one window of W = 4 steps of an on-policy rollout under CFG 4.5 on the SD3-shaped model. Flow-GRPO
    detaches the unconditional prediction, so it needs no backward: (a) is Flow-GRPO's own step (the unconditional
    and conditional rows in one forward with grad, u detached), (b) and (c) train the conditional rows alone with u
    taken from the rollout (per-step, and JAGG's joint pass), (d) is the previous path of this project (the guided
    velocity through JAGG's joint pass, u with grad: 4B rows and a different gradient). The trainer-level CFG
    figures are whole_step's (CFG 4.5 through the trainer).
    """
    GUIDANCE, W = 4.5, 4
    # arm: (label, its with-grad rows)
    ARMS = {
        "flow_grpo": ("(a) Flow-GRPO: per step, cond+uncond 2B rows with grad, uncond detached", "2B x W"),
        "perstep_cached": ("(b) per step, cond rows only (B), uncond from the rollout", "B x W"),
        "jagg_cached": ("(c) JAGG W=4, cond rows only: one joint pass of 2B rows", "2B"),
        "jagg_4b": ("(d) before: JAGG through the guided velocity, 4B rows, uncond with grad", "4B"),
    }

    @classmethod
    def case(cls, problem, arm: str):
        model, c, uc, traj, W, G = problem.model, problem.cond, problem.uncond, problem.traj, cls.W, cls.GUIDANCE
        latents, sigmas = traj.latents[:W], traj.sigmas[:W]
        B = latents.shape[1]

        def run():
            if arm == "flow_grpo":
                loss = problem.loss(W, guidance=1.0)  # called with the guided velocity
                for k in range(W):
                    x, s = latents[k], sigmas[k].expand(B)
                    out = model(torch.cat([x, x]), torch.cat([s, s]), cat_cond([uc, c]))
                    u, cond_pred = out[:B].detach(), out[B:]
                    loss(k, guide(cond_pred, u, G).float()).backward()
            elif arm == "perstep_cached":
                exact_backward(model, latents, sigmas, c, problem.loss(W))
            elif arm == "jagg_cached":
                jagg_backward(model, latents, sigmas, c, problem.loss(W), cached_velocities=traj.velocities[:W])
            else:  # the guided velocity with grad through both halves, the joint pass over 4B rows
                def guided(x, s, cond):
                    return guide(*cfg_predictions(model, x, s, cond), G)

                cached = guide(traj.velocities[:W], traj.uncond_velocities[:W], G)
                jagg_backward(guided, latents, sigmas, (c, uc), problem.loss(W, guidance=1.0),
                              cached_velocities=cached)

        return run

    @staticmethod
    def peak_mb(fn, model) -> float:
        from torch.profiler import ProfilerActivity, profile

        from .memory import MB

        model.zero_grad(set_to_none=False)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return tensor_peak(prof) / MB

    @classmethod
    def run(cls, quick: bool, repeats: int | None = None) -> dict:
        repeats = repeats or (1 if quick else 5)
        problem = sd3_problem(quick, BATCH, num_steps=6 if quick else 12, guidance=cls.GUIDANCE)
        cases = {arm: cls.case(problem, arm) for arm in cls.ARMS}
        times, gflops = _time(problem, cases, repeats, "cfg", list(cls.ARMS))  # every row shape (B, 2B, 4B)
        peaks = {arm: cls.peak_mb(cases[arm], problem.model) for arm in cls.ARMS}
        problem.model.zero_grad(set_to_none=False)
        base = times["flow_grpo"]
        rows = {arm: {"seconds": median(times[arm]), "all_seconds": times[arm], "tensor_peak_mb": peaks[arm],
                      "speedup_vs_flow_grpo": paired_speedup(base, times[arm]) if arm != "flow_grpo" else 1.0}
                for arm in cls.ARMS}
        return {
            "model": problem.describe(), "W": cls.W, "guidance": cls.GUIDANCE, "repeats": repeats, "rows": rows,
            "matmul_gflops_per_round": gflops,
            "summary": {f"speedup_{arm}_vs_flow_grpo": rows[arm]["speedup_vs_flow_grpo"] for arm in list(cls.ARMS)[1:]}
            | {"peak_jagg_cached_over_flow_grpo": peaks["jagg_cached"] / peaks["flow_grpo"],
               "peak_jagg_4b_over_jagg_cached": peaks["jagg_4b"] / peaks["jagg_cached"]},
        }

    @classmethod
    def markdown(cls, res: dict) -> str:
        lines = ["| arm | with-grad rows | s per window | speedup vs (a) | tensor peak over the window, MB |",
                 "|---|---|---|---|---|"]
        for arm, (label, rows) in cls.ARMS.items():
            r = res["rows"][arm]
            lines.append(f"| {label} | {rows} | {r['seconds']:.3f} | "
                         + ("-" if arm == "flow_grpo" else f"{r['speedup_vs_flow_grpo']:.2f}x")
                         + f" | {r['tensor_peak_mb']:.0f} |")
        s = res["summary"]
        return "\n".join([
            f"SD3-shaped model of window_speed, batch {res['model']['batch']}, CFG {res['guidance']}, a window of "
            f"W = {res['W']} steps of a real on-policy CFG rollout; medians of {res['repeats']} paired rounds. (a), "
            "(b) and (c) compute Flow-GRPO's gradient ((c) with JAGG's interpolation); (d) is the previous, different "
            "one.",
            "",
            "\n".join(lines),
            "",
            f"The unconditional branch alone (b vs a): **{s['speedup_perstep_cached_vs_flow_grpo']:.2f}x**; with JAGG "
            f"W = 4 (c vs a): **{s['speedup_jagg_cached_vs_flow_grpo']:.2f}x** on the training of the window. The "
            f"joint pass with CFG peaks at {s['peak_jagg_cached_over_flow_grpo']:.2f}x Flow-GRPO's per-step pass (both "
            f"2B rows); through the guided velocity it was {s['peak_jagg_4b_over_jagg_cached']:.2f}x that.",
        ])

    @classmethod
    def plot(cls, res: dict, ax) -> None:
        _barh(ax, [label.split(":")[0] for label, _ in cls.ARMS.values()],
              [res["rows"][a]["seconds"] for a in cls.ARMS], "training seconds per window (W=4)",
              f"CFG {res['guidance']}: training one window", [0, 1, 2, 3])


PARTS = {"window_speed": WindowSpeed, "cfg": Cfg}
