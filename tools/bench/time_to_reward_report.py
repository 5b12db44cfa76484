"""The time_to_reward study's report (tools/bench/time_to_reward.py runs it): the markdown table with its generated
notes, and the plot; every sentence is computed from the run's rows, so the doc is never edited by hand."""

from __future__ import annotations

import math

from .common import ROOT

from jagg_scale.jagg import plan_knots, plan_uniform
from jagg_scale.train import load_config

REFERENCE = "Flow-GRPO"  # the arm every other is read against
TARGET_FRAC, TARGET_TIME, TARGET_FINAL = 0.95, 0.5, 0.95  # 95% of its gain, in <= 0.5x its time, >= 0.95x at the end


def _fmt(x, f="{:.2f}", none="never"):
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else f.format(x)


def markdown(res: dict) -> str:
    s, rows, t = res["setup"], res["rows"], res["target"]
    ref = rows[REFERENCE]
    extra = f" `{' '.join(s['overrides'])}`" if s["overrides"] else ""
    lines = [
        f"`{s['config']}`{extra}: {s['num_steps']} sampling steps, {s['samples_per_step']} samples per step, "
        f"{s['steps']} steps per arm (the same prompts for every arm), seeds {s['seeds']}; held-out reward on "
        f"{s['eval_images']} images (deterministic ODE, Euler, the config's eval) every {s['eval_every']} steps. "
        f"Whole-step wall-clock (rollout + reward + training phase); the {len(rows)} x {len(s['seeds'])} trainers "
        f"step round-robin in {_workers(s)}, so the machine's noise hits every arm alike. "
        f"Run it: `{_command(s, res.get('out'))}` "
        f"(one torch thread per worker: with other work on a 2-core machine two OpenMP threads spin at every "
        f"barrier and a step ran 6x slower).",
        "",
        "| arm | rollout forwards / sample (policy + KL reference) | backward passes / sample (per-step equiv) | "
        "step s (median: rollout + "
        "reward + train) | wall-clock s (mean +- std) | held-out final (mean +- std) | gain (mean +- seed std) | "
        f"gain / {REFERENCE}'s | s to 95% of {REFERENCE}'s gain | that / {REFERENCE}'s wall-clock | "
        "s to 95% of the best arm's gain | within-prompt diversity at the end / the base model's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a, r in rows.items():
        cfg = load_config(str(ROOT / s["config"]), s["overrides"] + s["arms"][a])
        nfe, frozen = _forwards(s["arms"][a], s["num_steps"])
        old = {"nft": " (and as many old-policy forwards)",
               "awm": " (and as many EMA-policy forwards)" if cfg.train.algorithm == "awm" and cfg.awm.uses_ema
               else ""}.get(cfg.train.algorithm, "")
        reference = frozen if cfg.uses_reference or cfg.train.algorithm == "nft" else 0
        lines.append(
            f"| {a} | {nfe} + {reference}{old} | {r['backward_passes_per_step']:.1f} "
            f"({r['per_step_equiv_per_step']:.0f}) | "
            f"{r['step_seconds']:.2f} ({r['phases'][0]:.2f} + {r['phases'][1]:.2f} + {r['phases'][2]:.2f}) | "
            f"{r['wall'][0]:.0f} +- {r['wall'][1]:.0f} | {r['final'][0]:.3f} +- {r['final'][1]:.3f} | "
            f"{r['gain'][0]:+.3f} +- {r['gain'][1]:.3f} | {r['gain_frac'][0]:.2f} +- {r['gain_frac'][1]:.2f} | "
            f"{_fmt(r['t95'], '{:.0f}')} | {_fmt(r['t95_frac'])} | "
            f"{_fmt(r['t95_best'], '{:.0f}') if 't95_best' in r else 'n/a'} | "
            f"{_fmt(r.get('diversity_ratio'), '{:.2f}', 'n/a')} |")
    ratio = ref.get("gain_over_seed_std")
    lines += [
        "",
        f"Held-out reward at step 0: {res['start_reward']:.3f}. {REFERENCE}'s gain is "
        f"{_fmt(ratio, '{:.1f}', 'n/a')}x its seed std (the study asks for >= 5x). Best arm: **{t['best_arm']}**, "
        f"95% of {REFERENCE}'s final gain at **{_fmt(t['t95_frac'])}x** its wall-clock, final gain "
        f"**{t['gain_frac'][0]:.2f} +- {t['gain_frac'][1]:.2f}x** {REFERENCE}'s: "
        + ("target met." if t["met"] else "target missed (see the notes)."),
        "",
        "Wall-clock = the sum of the arm's whole training steps (mean over seeds); the 95% time is read off the "
        "seed-mean curve, linearly interpolated between evaluations.",
    ]
    lines += [""] if res.get("comparisons") else []
    for c in res.get("comparisons", []):
        verdict = "met." if c["met"] else "missed."
        if "peer" in c:
            t = ("no peer arm reaches that line" if c["peer"] is None and c["ours"] else
                 f"time to 95% of the best arm's final gain {_fmt(c['t95_ratio'], '{:.2f}x', 'never')}")
            lines.append(f"- {c['name']}: {c['ours'] or 'none'} vs {c['peer'] or 'none'}, {t} "
                         f"(<= {c['max_t95_ratio']}x asked): {verdict}")
        else:
            lines.append(f"- {c['name']}: final gain {_fmt(c['gain_ratio'], '{:.2f}x', 'n/a')} (>= {TARGET_FINAL}x "
                         f"asked), time to 95% of the per-step arm's final gain "
                         f"{_fmt(c['t95_ratio'], '{:.2f}x', 'never')} its time (<= {c['max_t95_ratio']}x asked): "
                         + verdict)
    lines += ["", *notes(res)]
    return "\n".join(lines)


def _command(setup: dict, out: str | None = None) -> str:
    """The command that reruns this study at this size (the default arms and size as the run recorded them) into
    `out`, where this run was written (tools.bench records it; older results: by the arms)."""
    sets = [f"--set steps={setup['steps']}", f"--set eval_every={setup['eval_every']}",
            f"--set seeds={','.join(map(str, setup['seeds']))}", f"--set workers={setup.get('workers', 1)}"]
    default = list(setup["arms"]) == list(setup.get("default_arms", []))
    if not default:
        sets.append(f"--set 'arms={';'.join(setup['arms'])}'")
    full = setup.get("full", {})
    if (setup["steps"], setup["seeds"]) == (full.get("steps"), full.get("seeds")) and default:
        sets = []
    # the default study is section 4 of docs/benchmarks.md; another set of arms is a page of its own
    out = out or ("docs/results/benchmarks" if default else "docs/results/study_algorithms")
    where = f"--merge --out {out}" if out.endswith("/benchmarks") else f"--out {out}"
    return " ".join([".venv/bin/python -m tools.bench --parts time_to_reward --threads 1", *sets, where])


def _workers(setup: dict) -> str:
    n = setup.get("workers", 1)
    return "one process" if n == 1 else f"{n} worker processes (one per seed subset, all arms in each)"


def notes(res: dict) -> list[str]:
    """What the numbers say against the study's conditions, generated from them (the doc is not hand-edited)."""
    rows, t, s = res["rows"], res["target"], res["setup"]
    ref = rows[REFERENCE]
    out = ["Reading it:", ""]
    ratio = ref.get("gain_over_seed_std")
    if ratio is not None and ratio < 5:
        out.append(f"- Power: after {s['steps']} steps {REFERENCE}'s gain is {ratio:.1f}x its seed std, short of "
                   "the 5x the study asks for: differences between arms below about one seed std are not resolved.")
    elif ratio is not None:
        out.append(f"- Power: {REFERENCE}'s gain is {ratio:.1f}x its seed std after {s['steps']} steps (>= 5x asked).")
    for a, r in rows.items():
        if a == REFERENCE:
            continue
        speed = ref["step_seconds"] / r["step_seconds"]
        reach = ("never reaches 95% of it" if r["t95_frac"] is None
                 else f"reaches 95% of it at {r['t95_frac']:.2f}x {REFERENCE}'s wall-clock")
        out.append(f"- {a}: whole steps {speed:.2f}x faster than {REFERENCE}'s; final gain "
                   f"{r['gain_frac'][0]:.2f} +- {r['gain_frac'][1]:.2f}x {REFERENCE}'s at the same prompt budget; "
                   f"{reach}.")
    close = [a for a, r in rows.items() if a != REFERENCE and abs(r["gain_frac"][0] - 1) <= r["gain_frac"][1]]
    apart = [a for a, r in rows.items() if a != REFERENCE and a not in close]
    spread = [r["gain_frac"][1] for r in rows.values()]
    out.append(f"- Noise: with {len(s['seeds'])} seeds the gain fractions' seed std is "
               f"{min(spread):.2f}-{max(spread):.2f}. "
               + (f"Within one seed std of {REFERENCE}'s gain: {', '.join(close)}. " if close else "")
               + (f"Further: {', '.join(apart)}." if apart else ""))
    for a, r in rows.items():
        level = ref["start"] + TARGET_FRAC * ref["gain"][0]
        if a != REFERENCE and r["t95"] is None and r["final"][0] > ref["start"] + 0.8 * ref["gain"][0]:
            out.append(f"- {a} ends {level - r['final'][0]:.3f} below the 95% level ({r['final'][0]:.3f} vs "
                       f"{level:.3f}; its seed std {r['final'][1]:.3f}).")
    fastest = min(rows, key=lambda a: rows[a]["wall"][0])
    c, cr = rows[fastest]["curve"], ref["curve"]
    at = value_at(cr["seconds"], cr["reward"], c["seconds"][-1])
    out.append(f"- Equal wall-clock: when {fastest} has finished ({c['seconds'][-1]:.0f} s, held-out "
               f"{c['reward'][-1]:.3f}), {REFERENCE}'s curve stands at {at:.3f} (gain {at - ref['start']:+.3f} vs "
               f"{c['reward'][-1] - ref['start']:+.3f}).")
    if t["met"] and t["gain_frac"][1] > t["gain_frac"][0] - TARGET_FINAL:
        out.append(f"- The target's verdict rests on {t['best_arm']}'s mean final gain ({t['gain_frac'][0]:.2f}x), "
                   f"whose seed std ({t['gain_frac'][1]:.2f}) is larger than its margin over {TARGET_FINAL}x: met at "
                   "this power, not resolved.")
    if not t["met"]:
        why = []
        if t["t95_frac"] is None or t["t95_frac"] > TARGET_TIME:
            fastest = min((a for a in rows if a != REFERENCE), key=lambda a: rows[a]["step_seconds"])
            why.append(f"no arm that keeps {TARGET_FINAL}x of the gain is {1 / TARGET_TIME:.0f}x faster per step "
                       f"(the fastest arm, {fastest}, is {ref['step_seconds'] / rows[fastest]['step_seconds']:.2f}x "
                       f"faster but ends at {rows[fastest]['gain_frac'][0]:.2f}x the gain)")
        if t["gain_frac"][0] < TARGET_FINAL:
            why.append(f"the best arm's final gain is {t['gain_frac'][0]:.2f}x, {TARGET_FINAL - t['gain_frac'][0]:.2f} "
                       f"short of {TARGET_FINAL}x")
        out.append(f"- Target missed by the best arm ({t['best_arm']}): " + "; ".join(why) + ".")
    return out


def plot(res: dict, ax) -> None:
    for i, (a, r) in enumerate(res["rows"].items()):
        c = r["curve"]
        lo = [m - s for m, s in zip(c["reward"], c["reward_std"])]
        hi = [m + s for m, s in zip(c["reward"], c["reward_std"])]
        line, = ax.plot(c["seconds"], c["reward"], marker="o", ms=3, label=a, color=f"C{i}",
                        lw=2.2 if a == REFERENCE or a == res["target"]["best_arm"] else 1.3)
        ax.fill_between(c["seconds"], lo, hi, alpha=0.12, color=line.get_color())
    ref = res["rows"][REFERENCE]
    level = ref["start"] + TARGET_FRAC * ref["gain"][0]
    ax.axhline(level, color="gray", ls="--", lw=0.8, label=f"95% of {REFERENCE}'s gain")
    ax.set(xlabel="wall-clock of whole GRPO steps, s (mean over seeds)", ylabel="held-out reward (mean +- seed std)",
           title=f"digits: held-out reward vs wall-clock ({len(res['setup']['seeds'])} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def value_at(times: list[float], values: list[float], t: float) -> float:
    """The piecewise-linear curve at time t (its last value past its end)."""
    for i in range(1, len(times)):
        if times[i] >= t:
            return values[i - 1] + (values[i] - values[i - 1]) * (t - times[i - 1]) / (times[i] - times[i - 1])
    return values[-1]


def _forwards(overrides: list[str], num_steps: int) -> tuple[int, int]:
    """(the policy's forwards per sample in the rollout, the frozen reference's per sample: on its SDE steps, or
    for a forward-process objective at its training timesteps or their knots)."""
    kv = dict(o.split("=", 1) for o in overrides)
    algo = kv.get("train.algorithm")
    if algo in ("nft", "awm"):  # an ODE rollout; the KL reference runs at training, per timestep or at the knots
        K = ((int(kv.get("awm.num_train_timesteps", 0)) or max(1, int(num_steps * 0.9))) if algo == "awm" else
             max(1, int(num_steps * float(kv.get("grpo.timestep_fraction", 1.0)))))
        knots = kv.get("nft.old_at" if algo == "nft" else "awm.frozen_at") == "knots"
        return num_steps, len(plan_knots(plan_uniform(K, int(kv["jagg.window"])))) if knots else K
    window = int(kv.get("grpo.sde_window", 0))
    ode = int(kv.get("sampling.ode_steps", 0))
    sde = window or num_steps
    if kv.get("grpo.ref_at") == "knots":  # the reference on the JAGG windows' knots alone
        sde = len(plan_knots(plan_uniform(sde, int(kv["jagg.window"]))))
    return (window + ode if window and ode else num_steps), sde
