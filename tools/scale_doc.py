"""docs/scale.md's two tables, printed from `jagg-estimate CONFIG --world-size W --gpu-mem 79.2 --json` per production
config (W: 8, Wan2.1-14B 32): the shipped configs on 8 GPUs (peak and phase, headroom, the largest micro-batch that
fits, the step, the peer's step, the speedup) and the step at 8 / 32 / 64 GPUs. The recipes whose peer is not the
estimator's whole-trajectory Flow-GRPO (PEER) get that peer's step from the estimator with its overrides. A config the
estimator refuses (an edit set that is absent) is said on its own line. Paste the rows over the tables' rows.

    python -m tools.scale_doc [config,config,...]      # ~5 minutes for every production config on one core
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2 ** 30
GPU_GIB = 79.2
CONFIGS = ["sd35m_pickscore", "sd35m_geneval", "sd35m_ocr", "sd35m_pickscore_nocfg", "sd35m_geneval_nocfg",
           "sd35m_nft_pickscore", "sd35m_gcpo_pickscore", "sd35m_dppo_pickscore", "sd35m_awm_pickscore",
           "sd35m_pickscore_fast",
           "sd35l_pickscore", "flux1_dev_hps", "flux1_dev_1024_hps", "flux1_kontext_pickscore", "qwenimage_hps",
           "qwenimage_edit_pickscore", "flux2_klein_pickscore", "zimage_pickscore", "wan21_t2v_14b_hps",
           "wan22_t2v_a14b_hps"]
# the peer a recipe names, run as that peer runs it (docs/scale.md says why each): its tag and overrides
PER_STEP_9 = ["jagg=null", "jagg.mode=exact", "sampling.chunk_size=9", "train.micro_batch_size=9",
              "parallel.activation_checkpointing=false"]
PEER = {"sd35m_pickscore_nocfg": ("Fast", PER_STEP_9), "sd35m_geneval_nocfg": ("Fast", PER_STEP_9),
        "sd35m_dppo_pickscore": ("UniRL", ["jagg=null", "jagg.mode=exact", "sampling.chunk_size=8"]),
        "sd35m_gcpo_pickscore": ("GCPO", [])}


def estimate(config: str, world: int, overrides: list[str] = ()) -> tuple[str, dict]:
    """(what the estimator printed before its JSON, the JSON)."""
    r = subprocess.run([sys.executable, "-m", "jagg_scale.estimate.cli", f"configs/{config}.yaml", "--world-size",
                        str(world), "--gpu-mem", str(GPU_GIB), "--json", *overrides], capture_output=True, text=True,
                       cwd=ROOT)
    if "{\n" not in r.stdout:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
    cut = r.stdout.index("{\n")
    return r.stdout[:cut], json.loads(r.stdout[cut:])


def rows(config: str) -> tuple[str, str | None]:
    world = 32 if config.startswith("wan") else 8
    head, d = estimate(config, world)
    largest = next((ln.split(": ")[1] for ln in head.splitlines() if ln.startswith("largest")), "?")
    phase = max(d["phases"], key=lambda p: d["phases"][p]["total"])
    peak, step = d["phases"][phase]["total"] / GiB, d["step_seconds"]["step"]
    peer = (d.get("flow_grpo_step_seconds") or {}).get("step")
    tag = ""
    if config in PEER:
        tag, overrides = PEER[config]
        if overrides:
            peer = estimate(config, world, overrides)[1]["step_seconds"]["step"]
        tag = f" ({tag})"
    name = config + (" (sequence parallel 2)" if config.startswith("wan") else "")
    first = (f"| {name} | {world} | {d['micro_batch_size']} | {peak:.2f} ({phase}) | {100 * (1 - peak / GPU_GIB):.1f}% "
             f"| {largest} | {step:.1f} | {f'{peer:.1f}{tag}' if peer else '-'} | "
             f"{f'{peer / step:.2f}x' if peer else '-'} |")
    if not d.get("scale"):
        return first, None
    cells = ["does not divide" if "divide" in r.get("error", "") else r["error"] if "error" in r else
             f"{r['step']:.1f} ({r['collectives']:.2f}) / {r['flow_grpo']:.1f} / **{r['speedup']:.2f}x**"
             for r in d["scale"]]
    ones = " / ".join(f"{r['one_speedup']:.2f}x" if "one_speedup" in r else "-" for r in d["scale"])
    return first, f"| {config} | {' | '.join(cells)} | {ones} |"


def main(argv: list[str]) -> int:
    configs = argv[0].split(",") if argv else CONFIGS
    firsts, scales = [], []
    for config in configs:
        try:
            first, scale = rows(config)
        except RuntimeError as err:
            print(f"{config}: {err}", flush=True)
            continue
        print(first, flush=True)
        firsts.append(first)
        scales += [scale] if scale else []
    print("\n" + "\n".join(scales))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
