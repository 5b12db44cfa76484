"""OUT.md and OUT_<part>.png from the benchmark's JSON (so `--from-json` can re-render without measuring)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from . import PARTS, part as _module

TITLES = {
    "window_speed": "1. window_speed: one window of W steps on an SD3-shaped DiT",
    "memory": "2. memory: the joint 2B-row pass vs a per-step pass",
    "cfg": "3. cfg: training under classifier-free guidance",
    "time_to_reward": "4. time_to_reward: held-out reward against wall-clock (a study)",
    "whole_step": "5. whole_step: one rank's production step, phase by phase, beside Flow-GRPO's (a study)",
}


def _what(part: str) -> str:
    """The part's description on the page: the paragraph after the title in its docstring (its module's, or its
    class's in window.py), so that the page and the code say it once."""
    return inspect.getdoc(_module(part)).split("\n\n")[1].replace("\n", " ")


def write_plots(results: dict, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    for part in PARTS:
        res = results["parts"].get(part)
        if not res or "error" in res:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        _module(part).plot(res, ax)
        fig.tight_layout()
        path = out.parent / f"{out.name}_{part}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths[part] = path.name
    return paths


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def target_rows(results: dict) -> list[str]:
    """One line per target: the figure, the threshold, met or by how much it is missed and why."""
    parts = results["parts"]
    rows = []
    try:
        _target_rows(parts, rows)
    except Exception as exc:
        rows.append(f"| (targets could not be evaluated: {type(exc).__name__}: {exc}) | | |")
    return rows


def _target_rows(parts: dict, rows: list[str]) -> None:
    ws = parts.get("window_speed")
    if ws and "error" not in ws:
        t = ws["target"]
        r = next(r for r in ws["rows"] if r["W"] == t["worst_W"])
        per_pass = r["seconds"]["cached"] / (r["seconds"]["per-step"] / r["W"])
        why = "" if t["met"] else (
            f" Missed by {_pct(1 - t['worst_ratio'] / t['threshold'])} of the target at W = {t['worst_W']}: the joint "
            f"2B-row pass costs {per_pass:.2f} B-row per-step passes here (2.00 at the limit); profile in section 1.")
        rows.append(f"| backward speedup, cached, >= 0.9 x W/2 | worst {t['worst_ratio']:.2f} x W/2 "
                    f"(W = {t['worst_W']}); "
                    + ", ".join(f"W={x['W']}: {x['speedup']['cached']:.2f}x" for x in ws["rows"])
                    + f" | {'met' if t['met'] else 'MISSED'}{why} |")
    mem = parts.get("memory")
    if mem and "error" not in mem:
        t = mem["target"]
        ll = t["like_for_like"]
        extra = (f" Like for like (per-step also checkpointed): {ll:.2f}x, "
                 + ("also within 1.2x." if t["like_for_like_met"] else
                    f"over 1.2x by {_pct(ll / t['threshold'] - 1)}: with checkpointing the peak is dominated by one "
                    "block's recomputed activations, which scale with the rows (2B vs B)."))
        rows.append(f"| joint pass with checkpointing <= 1.2x the per-step pass (tensor peak above params + grads) | "
                    f"{t['value']:.2f}x the per-step pass without checkpointing | "
                    f"{'met' if t['met'] else 'MISSED by ' + _pct(t['value'] / t['threshold'] - 1)}.{extra} |")
    tr = parts.get("time_to_reward")
    if tr and "error" not in tr:
        t = tr["target"]
        frac = "never" if t["t95_frac"] is None else f"{t['t95_frac']:.2f}x"
        rows.append(f"| {t['name']} | best arm {t['best_arm']}: 95% of the gain at {frac} the wall-clock, final gain "
                    f"{t['gain_frac'][0]:.2f} +- {t['gain_frac'][1]:.2f}x | "
                    f"{'met' if t['met'] else 'MISSED: see section 4'} |")
        if {"Flow-GRPO", "JAGG W4"} <= set(tr["rows"]):  # the same trainer and steps, only the backward differs
            e, j = (tr["rows"][a]["phases"][2] for a in ("Flow-GRPO", "JAGG W4"))
            rows.append(f"| training phase >= 1.8x faster at W = 4 (section 4: JAGG W4 vs Flow-GRPO, median seconds "
                        f"per step) | {e / j:.2f}x ({e:.2f} s vs {j:.2f} s) | {'met' if e >= 1.8 * j else 'MISSED'} |")


def _merged_note(results: dict) -> str:
    old = [f"{p} ({r.get('measured_at', '?')})" for p, r in results["parts"].items()
           if r.get("measured_at", "") < results["date"]]  # same format: string order is time order
    return ("" if not old else
            "\n- Parts kept from an earlier run (`--merge`), measured at other times: " + ", ".join(old))


def report_path(out: Path) -> Path:
    """Where the report of prefix `out` goes: prose beside the results folder (docs/results/benchmarks ->
    docs/benchmarks.md: generated json and png in docs/results/, pages in docs/), elsewhere OUT.md."""
    return out.parent.parent / f"{out.name}.md" if out.parent.name == "results" else out.parent / f"{out.name}.md"


def write_markdown(results: dict, out: Path, plots: dict[str, str]) -> Path:
    m = results["machine"]
    lines = [
        "# Benchmarks: JAGG vs per-step GRPO, measured side by side",
        "",
        "Generated by `python -m tools.bench` (jagg-bench, `tools/bench/`); do not edit by hand: re-run the command "
        "below. Every figure is a ratio of measurements taken in this one run, on this one machine.",
        "",
        f"- Command: `{results['command']}`",
        f"- Date: {results['date']}"
        + (" (quick mode: toy sizes, the numbers are meaningless)" if results["quick"] else ""),
        f"- Machine: {m['cpu_model']} ({m['cpu_count']} logical CPUs"
        + (f", {m['cpu_mhz']} MHz" if m.get("cpu_mhz") else "") + f"), {m['platform']}; torch {m['torch']}"
        + (f", diffusers {m['diffusers']}" if m.get("diffusers") else "")
        + f", {m['threads']} torch threads, CPU only; "
        f"load average at start {m.get('load_average_at_start')}",
        "- Wall time per part: "
        + ", ".join(f"{p} {r.get('wall_seconds', 0):.0f} s" for p, r in results["parts"].items())
        + f"; this invocation {results['total_seconds']:.0f} s"
        + _merged_note(results),
        "",
        "## Targets",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
        *target_rows(results),
        "",
    ]
    for part in PARTS:
        res = results["parts"].get(part)
        if res is None:
            continue
        lines += [f"## {TITLES[part]}", ""]
        if "error" in res:
            lines += [f"This part failed: `{res['error']}`", ""]
            continue
        try:
            body = _module(part).markdown(res)
        except Exception as exc:
            body = f"(could not render this part's results: {type(exc).__name__}: {exc}; re-run the part)"
        lines += [_what(part), "", body, ""]
        if part in plots:
            lines += [f"![{part}]({os.path.relpath(out.parent / plots[part], report_path(out).parent)})", ""]
    gpu = out.parent / "gpu_check.json"
    if gpu.exists():  # the device check's figures (tools/gpu_check.sh), kept across CPU re-runs
        import json

        from tools.gpu_check import markdown as gpu_markdown

        lines += ["## On a GPU: tools/gpu_check.sh", "", gpu_markdown(json.loads(gpu.read_text())["runs"]), ""]
    fidelity = out.parent / "refresh_fidelity.json"
    if fidelity.exists():  # tools/knot_fidelity.py --parts refresh_at: a gradient, not a speed, kept across re-runs
        import json

        from tools.knot_fidelity import table as fidelity_table

        res = json.loads(fidelity.read_text())
        lines += ["## Gradient fidelity of the refresh at the knots (grpo.refresh_at): tools/knot_fidelity.py", "",
                  f"Command: `{res['command']}` ({res['refresh_seconds']:.0f} s on 1 torch thread; raw results in "
                  "docs/results/refresh_fidelity.json). GRPO on configs/digits_cpu.yaml under CFG 4.5 with two "
                  "minibatches per rollout; per rollout the first minibatch takes a real Adam step, then the second "
                  "minibatch's gradient through the same JAGG plan is compared with the full refresh's (unconditional "
                  "prediction at every trained step, interiors forwarded). docs/algorithm.md section 1 reads it.", "",
                  fidelity_table(res), ""]
    lines += [
        "## Caveats",
        "",
        "- One CPU VM; its speed drifts. Every timed part alternates the compared methods within rounds (order "
        "rotated) and reports medians of paired per-round ratios; the matmul probe per round is in the JSON.",
        "- CPU results do not carry over to GPUs: a small batch does not saturate a GPU, so there the 2B-row pass "
        "can cost well under 2 B-row passes (speedups above W/2), and under FSDP/ZeRO-3 the saved all-gathers "
        "are network time that this CPU run only counts.",
        "- Speed only: the quality of the JAGG gradient is in docs/parity.md and docs/algorithm.md.",
        "",
    ]
    path = report_path(out)
    path.write_text("\n".join(lines))
    return path
