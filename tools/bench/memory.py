"""Part memory: peak memory of JAGG's joint 2B-row endpoint pass vs a per-step B-row pass, on CPU, with and
without activation checkpointing (diffusers `enable_gradient_checkpointing()`), on the SD3-shaped DiT.

Peak memory of one forward + backward through the SD3-shaped model: the per-step pass (B rows) and JAGG's joint
endpoint pass (2B rows), each with and without diffusers activation checkpointing, each configuration in a fresh
subprocess. The tensor peak is the maximum of the running sum of the allocator's [memory] events recorded by
`torch.profiler(profile_memory=True)`. The RSS growth is the kernel's peak-RSS high-water mark (VmHWM, reset via
/proc/self/clear_refs) minus the RSS before the pass, measured on the pass after a warm-up pass, with glibc told to
serve every allocation above 64 KiB by mmap (`MALLOC_MMAP_THRESHOLD_=65536`) so that freed memory leaves the RSS and
the warm-up cannot hide growth (with glibc's defaults the RSS growth was 1.2x to 2.3x the tensor peak, depending on
the allocation pattern). Both exclude the parameters and gradients already allocated.

Per configuration (`python -m tools.bench.memory --worker SPEC`): model built, gradients allocated (as in training,
where .grad accumulates over windows), then three forward + backward passes (v.backward(G) with a random upstream
gradient, as jagg_backward does):

    1. warm-up      lazy initialisation; its RSS growth is recorded too (first_pass)
    2. RSS growth   VmHWM reset by writing 5 to /proc/self/clear_refs (ru_maxrss of the first pass if that is
                    refused); this pass is also the one timed, ~1.4x slower under the mmap threshold (page faults)
    3. tensor peak  the profiled pass: the allocator's [memory] events (+ alloc, - free)

The tensor peak (exact, independent of malloc) is the figure used for the target, the joint pass with checkpointing
<= 1.2x the per-step pass; the RSS cross-checks it (within 1% on the full model).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = [("per-step", False), ("per-step", True), ("joint", False), ("joint", True)]
TARGET = 1.2
MB = 2**20


# ------------------------------------------------------------------------------------------------------------------
# the worker (fresh process)
# ------------------------------------------------------------------------------------------------------------------

def _status_kb(key: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return _status_kb("VmRSS") or 0


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return (_status_kb("VmHWM") or 0) <= _rss() + 4 * MB


def measure(quick: bool, rows: str, ckpt: bool, batch: int, threads: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .common import random_cond, sd3_config, SD3Shaped, tensor_peak, top_ops

    if threads:
        torch.set_num_threads(threads)
    cfg, text_tokens = sd3_config(quick)
    torch.manual_seed(0)
    model = SD3Shaped(cfg).train()
    if ckpt:
        model.transformer.enable_gradient_checkpointing()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    n = batch * (2 if rows == "joint" else 1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, *model.latent_shape, generator=gen)
    sigma = torch.rand(n, generator=gen)
    cond = random_cond(cfg, text_tokens, n, gen)
    upstream = torch.randn(n, *model.latent_shape, generator=gen)

    def step():
        v = model(x, sigma, cond)
        v.backward(upstream)

    # 1. warm-up (lazy initialisation); 2. measured and timed
    growth = []
    for _ in range(2):
        model.zero_grad(set_to_none=False)
        gc.collect()
        hwm_reset = _reset_hwm()
        base = _rss()
        t0 = time.perf_counter()
        step()
        seconds = time.perf_counter() - t0
        hwm = _status_kb("VmHWM") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        growth.append(max(0, hwm - base) if hwm_reset or not growth else None)
    rss_first, rss_growth = growth
    if rss_growth is None:  # no HWM reset: only the first pass's ru_maxrss growth is meaningful
        rss_growth = rss_first
    # 3. tensor peak from the allocator's events
    model.zero_grad(set_to_none=False)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    out = {
        "rows": rows, "checkpointing": ckpt, "batch_rows": n, "seconds": seconds,
        "tensor_peak_mb": tensor_peak(prof) / MB,
        "rss_growth_mb": rss_growth / MB,
        "rss_growth_first_pass_mb": rss_first / MB,
        "rss_method": "VmHWM reset via /proc/self/clear_refs" if hwm_reset else "ru_maxrss of the first pass",
        "rss_before_mb": base / MB, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "state_mb": sum(2 * p.numel() * p.element_size() for p in model.parameters()) / MB,  # params + grads
        "parameters": model.num_params(),
    }
    if rows == "joint" and ckpt:
        model.zero_grad(set_to_none=False)
        out["top_ops_memory"] = top_ops(step, n=8, sort_by="self_cpu_memory_usage", memory=True)
    return out


def worker_main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True, help="JSON: {quick, configs: [[rows, ckpt], ...], batch, threads}")
    spec = json.loads(p.parse_args(argv).worker)
    results = [measure(spec["quick"], rows, ckpt, spec["batch"], spec["threads"]) for rows, ckpt in spec["configs"]]
    print("RESULT " + json.dumps(results), flush=True)


# ------------------------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------------------------

def _spawn(quick: bool, configs, batch: int, threads: int) -> list[dict]:
    from .common import ROOT

    env = dict(os.environ, PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_="65536")
    spec = json.dumps({"quick": quick, "configs": configs, "batch": batch, "threads": threads})
    proc = subprocess.run([sys.executable, "-m", "tools.bench.memory", "--worker", spec], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"memory worker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def _div(a, b):
    return a / b if a is not None and b else None


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def run(quick: bool) -> dict:
    import torch

    batch, threads = 4, torch.get_num_threads()
    results = []
    if quick:  # one process for all four: fast, numbers meaningless
        results = _spawn(quick, CONFIGS, batch, threads)
    else:
        for rows, ckpt in CONFIGS:
            results += _spawn(quick, [(rows, ckpt)], batch, threads)
            r = results[-1]
            print(f"    memory {rows} ckpt={ckpt}: tensor peak {r['tensor_peak_mb']:.0f} MB, RSS growth "
                  f"{r['rss_growth_mb']:.0f} MB, {r['seconds']:.2f}s", flush=True)
    by = {(r["rows"], r["checkpointing"]): r for r in results}
    ps, ps_ck, jt, jt_ck = (by[c] for c in CONFIGS)
    state = ps["state_mb"]

    def ratios(key):
        return {
            "joint_ckpt_over_perstep": _div(jt_ck[key], ps[key]),
            "joint_ckpt_over_perstep_ckpt": _div(jt_ck[key], ps_ck[key]),
            "joint_over_perstep": _div(jt[key], ps[key]),
            "perstep_ckpt_over_perstep": _div(ps_ck[key], ps[key]),
        }

    tensor, rss = ratios("tensor_peak_mb"), ratios("rss_growth_mb")
    total = {  # what a training process holds at the peak: params + grads + the pass's peak
        "joint_ckpt_over_perstep": (state + jt_ck["tensor_peak_mb"]) / (state + ps["tensor_peak_mb"]),
        "joint_ckpt_over_perstep_ckpt": (state + jt_ck["tensor_peak_mb"]) / (state + ps_ck["tensor_peak_mb"]),
        "joint_over_perstep": (state + jt["tensor_peak_mb"]) / (state + ps["tensor_peak_mb"]),
    }
    agreement = [a for a in (_div(r["rss_growth_mb"], r["tensor_peak_mb"]) for r in results) if a is not None]
    primary = tensor["joint_ckpt_over_perstep"]
    res = {
        "batch": batch, "fresh_process_per_config": not quick, "configs": results, "state_mb": state,
        "ratios_tensor_peak": tensor, "ratios_rss_growth": rss, "ratios_total_with_state": total,
        "rss_over_tensor_peak": agreement,
        "checkpointing_time_overhead": {"per-step": ps_ck["seconds"] / ps["seconds"],
                                        "joint": jt_ck["seconds"] / jt["seconds"]},
        "summary": {"tensor_peak_joint_ckpt_over_perstep": primary,
                    "tensor_peak_joint_ckpt_over_perstep_ckpt": tensor["joint_ckpt_over_perstep_ckpt"],
                    "tensor_peak_joint_over_perstep": tensor["joint_over_perstep"],
                    "total_joint_ckpt_over_perstep": total["joint_ckpt_over_perstep"]},
        "target": {"name": "peak memory of the joint pass with activation checkpointing <= 1.2x the per-step pass",
                   "threshold": TARGET, "value": primary, "met": primary <= TARGET,
                   "like_for_like": tensor["joint_ckpt_over_perstep_ckpt"],
                   "like_for_like_met": tensor["joint_ckpt_over_perstep_ckpt"] <= TARGET},
    }
    return res


def markdown(res: dict) -> str:
    lines = ["| pass | rows | checkpointing | tensor peak MB | RSS growth MB | RSS / tensor | "
             "RSS growth MB, warm-up pass | F+B s |", "|---|---|---|---|---|---|---|---|"]
    for r in res["configs"]:
        lines.append(f"| {r['rows']} | {r['batch_rows']} | {'on' if r['checkpointing'] else 'off'} | "
                     f"{r['tensor_peak_mb']:.1f} | {r['rss_growth_mb']:.1f} | "
                     f"{_f(_div(r['rss_growth_mb'], r['tensor_peak_mb']))} | "
                     f"{_f(r['rss_growth_first_pass_mb'], '.1f')} | "
                     f"{r['seconds']:.2f} |")
    t, s, tot = res["ratios_tensor_peak"], res["ratios_rss_growth"], res["ratios_total_with_state"]
    ratio_lines = ["| ratio | tensor peak | RSS growth | incl. params + grads |", "|---|---|---|---|",
                   f"| joint + ckpt / per-step (no ckpt) | **{_f(t['joint_ckpt_over_perstep'])}** | "
                   f"{_f(s['joint_ckpt_over_perstep'])} | {_f(tot['joint_ckpt_over_perstep'])} |",
                   f"| joint + ckpt / per-step + ckpt (like for like) | {_f(t['joint_ckpt_over_perstep_ckpt'])} | "
                   f"{_f(s['joint_ckpt_over_perstep_ckpt'])} | {_f(tot['joint_ckpt_over_perstep_ckpt'])} |",
                   f"| joint / per-step (both no ckpt) | {_f(t['joint_over_perstep'])} | {_f(s['joint_over_perstep'])} "
                   f"| {_f(tot['joint_over_perstep'])} |"]
    c = res["configs"][0]
    agree = res["rss_over_tensor_peak"]
    out = [
        f"Same SD3-shaped model ({c['parameters']:,} parameters), B = {res['batch']}, float32, one forward + backward "
        f"per measurement; params + grads before the pass: {res['state_mb']:.0f} MB (not in the peaks). "
        + ("Each configuration in a fresh process. " if res["fresh_process_per_config"] else
           "Quick mode: all configurations in one process. ")
        + f"RSS method: {c['rss_method']}, MALLOC_MMAP_THRESHOLD_={c.get('malloc_mmap_threshold')} (freed tensors "
          f"leave the RSS at once). RSS growth / tensor peak ranges {_f(min(agree, default=None))} "
          f".. {_f(max(agree, default=None))} over the four configurations; the allocator-level tensor peak is the "
          "figure used for the target. F+B times are of the measured pass (mmap for every allocation slows it).",
        "",
        "\n".join(lines),
        "",
        "\n".join(ratio_lines),
        "",
        f"Checkpointing costs {res['checkpointing_time_overhead']['per-step']:.2f}x (per-step) and "
        f"{res['checkpointing_time_overhead']['joint']:.2f}x (joint) the time of the pass without it (one "
        "measurement each; the recompute is one extra forward per block).",
    ]
    jt = next((r for r in res["configs"] if r["rows"] == "joint" and r["checkpointing"]), None)
    if jt and "top_ops_memory" in jt and not res["target"]["like_for_like_met"]:
        from .common import ops_table

        out += ["", "Joint pass with checkpointing, top ops by self CPU memory (allocations minus frees inside the "
                "op):", "", ops_table(jt["top_ops_memory"])]
    return "\n".join(out)


def plot(res: dict, ax) -> None:
    labels = [f"{r['rows']}\n{'ckpt' if r['checkpointing'] else 'no ckpt'}" for r in res["configs"]]
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [r["tensor_peak_mb"] for r in res["configs"]], width=0.4, label="tensor peak")
    ax.bar([x + 0.2 for x in xs], [r["rss_growth_mb"] for r in res["configs"]], width=0.4, label="RSS growth")
    base = res["configs"][0]["tensor_peak_mb"]
    ax.axhline(TARGET * base, color="k", ls=":", label="1.2x per-step (tensor)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set(ylabel="MB above params + grads", title="peak memory of one forward + backward")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


if __name__ == "__main__":
    worker_main()
