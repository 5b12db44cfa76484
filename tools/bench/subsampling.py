"""Part 5, subsampling: JAGG composed with step subsampling, at the backward level, on the SD3-shaped DiT.

Flow-GRPO-Fast trains only a window of k SDE steps out of T (the rest of the trajectory is sampled with the ODE and
not trained); MixGRPO slides such a window of k SDE steps along the trajectory from one iteration to the next. The
trainer does not sample mixed ODE/SDE trajectories yet, so this part measures the cost that matters, the training
phase of one minibatch, directly: the gradient of the trained subset with `exact_backward` / `jagg_backward` on
that subset of an SDE rollout of T steps (the subset's losses scaled by 1 / its size, as the trainer does):

    (a) per-step, all T steps                  Flow-GRPO                         T (F + B)
    (b) per-step, a k-step SDE window          Flow-GRPO-Fast / MixGRPO          k (F + B)
    (c) JAGG (W = k, cached) on that window    JAGG + Fast / MixGRPO             2 (F + B)
    (d) JAGG (W = 4, cached) on all T steps    JAGG alone                        T/2 (F + B)

(b) and (c) are timed at two window positions: the start of the trajectory (Flow-GRPO-Fast's high-noise window)
and the end (the last position of MixGRPO's sliding window); the cost should not depend on the position.
Reported: seconds per sample (time / B) and the speedup of each over (a) and of (c) over (b).
"""

from __future__ import annotations

from .common import median, paired_rounds, paired_speedup, sd3_problem

from jagg_scale.jagg import exact_backward, jagg_backward, split_windows


def subset_backward(problem, steps: list[int], how: str, window: int) -> None:
    model, cond, traj = problem.model, problem.cond, problem.traj
    loss = problem.loss(len(steps))
    groups = [steps] if how == "jagg_window" else split_windows(steps, window)
    for group in groups:
        idx = list(group)
        latents, sigmas = traj.latents[idx], traj.sigmas[idx]

        def step_loss(j, v, idx=idx):
            return loss(idx[j], v)

        if how == "per-step":
            exact_backward(model, latents, sigmas, cond, step_loss)
        else:
            jagg_backward(model, latents, sigmas, cond, step_loss, cached_velocities=traj.velocities[idx],
                          intermediate="cached")


def run(quick: bool, repeats: int | None = None) -> dict:
    T, k, W = (6, 3, 3) if quick else (12, 4, 4)
    repeats = repeats or (1 if quick else 3)  # full: ~20 s per round on a 2-core CPU
    batch = 4
    problem = sd3_problem(quick, batch, num_steps=T)
    all_steps = list(range(T))
    first, last = list(range(k)), list(range(T - k, T))
    cases = {
        "a_perstep_all": lambda: subset_backward(problem, all_steps, "per-step", W),
        "b_perstep_window_first": lambda: subset_backward(problem, first, "per-step", W),
        "c_jagg_window_first": lambda: subset_backward(problem, first, "jagg_window", W),
        "b_perstep_window_last": lambda: subset_backward(problem, last, "per-step", W),
        "c_jagg_window_last": lambda: subset_backward(problem, last, "jagg_window", W),
        "d_jagg_all": lambda: subset_backward(problem, all_steps, "jagg", W),
    }
    # warm-up: the per-step B-row and the joint 2B-row shapes (window_speed may have warmed this model up already)
    for name in ("b_perstep_window_first", "c_jagg_window_first"):
        cases[name]()
    rounds = paired_rounds(cases, problem.model, repeats, label="subsampling", warmup=False)
    times = rounds["times"]
    base = times["a_perstep_all"]
    rows = {}
    passes = {"a_perstep_all": T, "b_perstep_window_first": k, "c_jagg_window_first": 2,
              "b_perstep_window_last": k, "c_jagg_window_last": 2, "d_jagg_all": 2 * len(split_windows(all_steps, W))}
    for name, ts in times.items():
        rows[name] = {"seconds": median(ts), "seconds_per_sample": median(ts) / batch, "all_seconds": ts,
                      "speedup_vs_a": paired_speedup(base, ts) if name != "a_perstep_all" else 1.0,
                      "trained_steps": T if name.endswith("_all") else k, "row_passes": passes[name]}
    c_over_b = {pos: paired_speedup(times[f"b_perstep_window_{pos}"], times[f"c_jagg_window_{pos}"])
                for pos in ("first", "last")}
    problem.model.zero_grad(set_to_none=False)
    return {
        "model": problem.describe(), "T": T, "k": k, "W_all": W, "repeats": repeats, "rows": rows,
        "jagg_over_perstep_on_window": c_over_b, "matmul_gflops_per_round": rounds["gflops"],
        "sigmas": [round(float(s), 4) for s in problem.traj.sigmas],
        "summary": {"seconds_per_sample_a": rows["a_perstep_all"]["seconds_per_sample"],
                    "seconds_per_sample_c_first": rows["c_jagg_window_first"]["seconds_per_sample"],
                    "speedup_c_over_b_first": c_over_b["first"], "speedup_c_over_b_last": c_over_b["last"],
                    "speedup_d_over_a": rows["d_jagg_all"]["speedup_vs_a"],
                    "speedup_c_over_a": rows["c_jagg_window_first"]["speedup_vs_a"]},
    }


LABELS = {
    "a_perstep_all": "(a) per-step, all T steps (Flow-GRPO)",
    "b_perstep_window_first": "(b) per-step, k-step window at the start (Flow-GRPO-Fast)",
    "c_jagg_window_first": "(c) JAGG W=k on that window",
    "b_perstep_window_last": "(b') per-step, k-step window at the end (MixGRPO, last slide)",
    "c_jagg_window_last": "(c') JAGG W=k on that window",
    "d_jagg_all": "(d) JAGG W={W}, all T steps",
}
SHORT = {"a_perstep_all": "(a) per-step, all T", "b_perstep_window_first": "(b) per-step, window start",
         "c_jagg_window_first": "(c) JAGG, window start", "b_perstep_window_last": "(b') per-step, window end",
         "c_jagg_window_last": "(c') JAGG, window end", "d_jagg_all": "(d) JAGG, all T"}


def markdown(res: dict) -> str:
    T, k = res["T"], res["k"]
    s = res["sigmas"]
    lines = ["| configuration | trained steps | transformer passes (B-row units) | s per minibatch | s per sample | "
             "speedup vs (a) |", "|---|---|---|---|---|---|"]
    for name, label in LABELS.items():
        r = res["rows"][name]
        lines.append(f"| {label.format(W=res['W_all'])} | {r['trained_steps']} | {r['row_passes']} | "
                     f"{r['seconds']:.3f} | "
                     f"{r['seconds_per_sample']:.3f} | {r['speedup_vs_a']:.2f}x |")
    c = res["jagg_over_perstep_on_window"]
    return "\n".join([
        f"Same SD3-shaped model as window_speed, batch {res['model']['batch']}; an SDE rollout of T = {T} steps "
        f"(sigmas {s[0]:.2f} .. {s[T - 1]:.3f}); SDE window of k = {k} steps at the start (steps 0..{k - 1}, sigma "
        f"{s[0]:.2f}..{s[k - 1]:.2f}) and at the end (steps {T - k}..{T - 1}, sigma {s[T - k]:.2f}..{s[T - 1]:.3f}). "
        f"Medians of {res['repeats']} rounds, paired ratios.",
        "",
        "\n".join(lines),
        "",
        f"JAGG on the SDE window vs per-step on the same window: **{c['first']:.2f}x** (start), **{c['last']:.2f}x** "
        f"(end); limit k/2 = {k / 2:.1f}. The savings multiply: subsampling cuts the trained steps from T to k, "
        f"JAGG cuts the passes per trained window from k to 2.",
    ])


def plot(res: dict, ax) -> None:
    names = list(LABELS)
    vals = [res["rows"][n]["seconds_per_sample"] for n in names]
    ax.barh(range(len(names)), vals, color=["C0", "C1", "C2", "C1", "C2", "C3"])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([SHORT[n] for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="training-phase seconds per sample", title=f"subsampling: T={res['T']}, SDE window k={res['k']}")
    ax.grid(alpha=0.3, axis="x")
