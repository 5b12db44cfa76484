"""Part 6, cfg: training under classifier-free guidance (CFG 4.5) on the SD3-shaped DiT, one window of W = 4 steps.

The gradient is Flow-GRPO's in every arm but (d): the unconditional prediction u_k is a constant for it.

    (a) flow_grpo       Flow-GRPO's step, as scripts/train_sd3.py runs it: per trained step ONE forward of the
                        unconditional and conditional rows together (2B rows) WITH grad, u detached, a backward
    (b) perstep_cached  per-step (exact_backward) on the conditional rows alone (B rows), u_k from the rollout
    (c) jagg_cached     jagg_backward (W = 4, cached values) on the conditional rows: one joint pass of 2B rows
    (d) jagg_4b         what this project did before: the guided velocity through the joint pass, u with grad
                        (4B rows, and a different gradient: cosine ~0.9 at CFG 4.5 on the tiny DiT)

Timed in paired rounds (order rotated), medians of per-round ratios; the tensor peak of each arm's largest pass
(torch.profiler memory events, as the memory part) shows the joint pass at 2B rows with CFG, not 4B.
"""

from __future__ import annotations

import torch

from .common import median, paired_rounds, paired_speedup, sd3_problem

from jagg_scale.cond import cat_cond
from jagg_scale.grpo.rollout import cfg_predictions, guide
from jagg_scale.jagg import exact_backward, jagg_backward

GUIDANCE, W = 4.5, 4
ARMS = ("flow_grpo", "perstep_cached", "jagg_cached", "jagg_4b")


def make_case(problem, arm: str):
    model, c, uc, traj = problem.model, problem.cond, problem.uncond, problem.traj
    latents, sigmas = traj.latents[:W], traj.sigmas[:W]
    B = latents.shape[1]

    def run():
        if arm == "flow_grpo":
            loss = problem.loss(W, guidance=1.0)  # called with the guided velocity
            for k in range(W):
                x, s = latents[k], sigmas[k].expand(B)
                out = model(torch.cat([x, x]), torch.cat([s, s]), cat_cond([uc, c]))
                u, cond_pred = out[:B].detach(), out[B:]
                loss(k, guide(cond_pred, u, GUIDANCE).float()).backward()
        elif arm == "perstep_cached":
            exact_backward(model, latents, sigmas, c, problem.loss(W))
        elif arm == "jagg_cached":
            jagg_backward(model, latents, sigmas, c, problem.loss(W), cached_velocities=traj.velocities[:W])
        else:  # the guided velocity with grad through both halves, the joint pass over 4B rows
            def guided(x, s, cond):
                return guide(*cfg_predictions(model, x, s, cond), GUIDANCE)

            cached = guide(traj.velocities[:W], traj.uncond_velocities[:W], GUIDANCE)
            jagg_backward(guided, latents, sigmas, (c, uc), problem.loss(W, guidance=1.0), cached_velocities=cached)

    return run


def _peak_mb(fn, model) -> float:
    from torch.profiler import ProfilerActivity, profile

    from .memory import MB, _tensor_peak

    model.zero_grad(set_to_none=False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _tensor_peak(prof) / MB


def run(quick: bool, repeats: int | None = None) -> dict:
    repeats = repeats or (1 if quick else 5)
    batch = 4
    problem = sd3_problem(quick, batch, num_steps=6 if quick else 12, guidance=GUIDANCE)
    cases = {arm: make_case(problem, arm) for arm in ARMS}
    for arm in ARMS:  # warm-up: every row shape (B, 2B, 4B)
        cases[arm]()
    rounds = paired_rounds(cases, problem.model, repeats, label="cfg", warmup=False)
    times = rounds["times"]
    peaks = {arm: _peak_mb(cases[arm], problem.model) for arm in ARMS}
    problem.model.zero_grad(set_to_none=False)
    base = times["flow_grpo"]
    rows = {arm: {"seconds": median(times[arm]), "all_seconds": times[arm], "tensor_peak_mb": peaks[arm],
                  "speedup_vs_flow_grpo": paired_speedup(base, times[arm]) if arm != "flow_grpo" else 1.0}
            for arm in ARMS}
    return {
        "model": problem.describe(), "W": W, "guidance": GUIDANCE, "repeats": repeats, "rows": rows,
        "matmul_gflops_per_round": rounds["gflops"],
        "summary": {f"speedup_{arm}_vs_flow_grpo": rows[arm]["speedup_vs_flow_grpo"] for arm in ARMS[1:]}
        | {"peak_jagg_cached_over_flow_grpo": peaks["jagg_cached"] / peaks["flow_grpo"],
           "peak_jagg_4b_over_jagg_cached": peaks["jagg_4b"] / peaks["jagg_cached"]},
    }


LABELS = {
    "flow_grpo": "(a) Flow-GRPO: per step, cond+uncond 2B rows with grad, uncond detached",
    "perstep_cached": "(b) per step, cond rows only (B), uncond from the rollout",
    "jagg_cached": "(c) JAGG W=4, cond rows only: one joint pass of 2B rows",
    "jagg_4b": "(d) before: JAGG through the guided velocity, 4B rows, uncond with grad",
}
ROWS = {"flow_grpo": "2B x W", "perstep_cached": "B x W", "jagg_cached": "2B", "jagg_4b": "4B"}


def markdown(res: dict) -> str:
    lines = ["| arm | with-grad rows | s per window | speedup vs (a) | tensor peak over the window, MB |",
             "|---|---|---|---|---|"]
    for arm, label in LABELS.items():
        r = res["rows"][arm]
        lines.append(f"| {label} | {ROWS[arm]} | {r['seconds']:.3f} | "
                     + ("-" if arm == "flow_grpo" else f"{r['speedup_vs_flow_grpo']:.2f}x")
                     + f" | {r['tensor_peak_mb']:.0f} |")
    s = res["summary"]
    return "\n".join([
        f"SD3-shaped model of window_speed, batch {res['model']['batch']}, CFG {res['guidance']}, a window of "
        f"W = {res['W']} steps of a real on-policy CFG rollout; medians of {res['repeats']} paired rounds. (a), (b) "
        "and (c) compute Flow-GRPO's gradient ((c) with JAGG's interpolation); (d) is the previous, different one.",
        "",
        "\n".join(lines),
        "",
        f"The unconditional branch alone (b vs a): **{s['speedup_perstep_cached_vs_flow_grpo']:.2f}x**; with JAGG "
        f"W = 4 (c vs a): **{s['speedup_jagg_cached_vs_flow_grpo']:.2f}x** on the training of the window. The joint "
        f"pass with CFG peaks at {s['peak_jagg_cached_over_flow_grpo']:.2f}x Flow-GRPO's per-step pass (both 2B "
        f"rows); through the guided velocity it was {s['peak_jagg_4b_over_jagg_cached']:.2f}x that.",
    ])


def plot(res: dict, ax) -> None:
    vals = [res["rows"][a]["seconds"] for a in ARMS]
    ax.barh(range(len(ARMS)), vals, color=["C0", "C1", "C2", "C3"])
    ax.set_yticks(range(len(ARMS)))
    ax.set_yticklabels([LABELS[a].split(":")[0] for a in ARMS], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="training seconds per window (W=4)", title=f"CFG {res['guidance']}: training one window")
    ax.grid(alpha=0.3, axis="x")
