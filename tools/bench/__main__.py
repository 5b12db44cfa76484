"""jagg-bench: `python -m tools.bench [--quick] [--parts a,b] [--out docs/results/benchmarks]` from the repository root.

Writes OUT.json (every number), OUT_<part>.png and the report (report.report_path: docs/benchmarks.md for
docs/results/benchmarks); prints each part's wall time. See
tools/bench/__init__.py for the parts and each part's module for what it measures and how.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from tools.bench import DEFAULT_PARTS, PARTS, part as part_api
from tools.bench.common import machine_info

# Full-run sizes were chosen from quick runs and single-pass probes so that the whole run stays under 15 minutes
# on a 2-core CPU; expected wall time per part (s), printed beside the measured one.
BUDGET_S = {"window_speed": 240, "memory": 60, "cfg": 90,
            "time_to_reward": 3600, "whole_step": 1500}


def _clean(x):
    """JSON-safe: tuples to lists, non-finite floats to None (the report never writes NaN)."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/results/benchmarks",
                   help="prefix of OUT.json, OUT_<part>.png; the report OUT.md (docs/NAME.md for docs/results/NAME)")
    p.add_argument("--quick", action="store_true", help="toy sizes, one repeat (< 1 min): a smoke test only")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma-separated subset of {','.join(PARTS)} (default: all but the studies)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default; 1 with --quick, which must survive a busy "
                        "machine)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a study's size (time_to_reward: steps=32, eval_every=8, seeds=0,1, workers=2, "
                        "arms='Flow-GRPO;NFT'); only with one part that takes it")
    p.add_argument("--merge", action="store_true", help="keep the parts of an existing OUT.json that are not re-run")
    p.add_argument("--from-json", action="store_true", help="re-render OUT.md and the plots from OUT.json only")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path = out.parent / f"{out.name}.json"

    from tools.bench.report import write_markdown, write_plots

    if args.from_json:
        results = json.loads(json_path.read_text())
        md = write_markdown(results, out, write_plots(results, out))
        print(f"re-rendered {md}")
        return 0

    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    settings = dict(kv.split("=", 1) for kv in args.set if "=" in kv)
    if len(settings) != len(args.set) or (settings and (len(parts) != 1 or not hasattr(
            part_api(parts[0]), "parse_settings"))):
        p.error(f"--set {args.set}: KEY=VALUE pairs for one part that takes them (time_to_reward)")
    import torch

    threads = args.threads or (1 if args.quick else 0)
    if threads:  # with a busy core, 2 OpenMP threads spin at every op's barrier: a quick run got 30x slower
        torch.set_num_threads(threads)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    results = {
        "command": "python -m tools.bench " + " ".join(argv_list),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick, "machine": machine_info(), "parts": {},
    }
    if args.merge and json_path.exists():
        old = json.loads(json_path.read_text())
        results["parts"] = {k: v for k, v in old.get("parts", {}).items() if k not in parts}
    print(f"machine: {results['machine']}", flush=True)
    t_all = time.perf_counter()
    failed = []
    for part in PARTS:
        if part not in parts:
            continue
        print(f"== {part}" + ("" if args.quick else f" (budget ~{BUDGET_S[part]} s)"), flush=True)
        t0 = time.perf_counter()
        try:
            mod = part_api(part)
            res = mod.run(quick=args.quick, **(mod.parse_settings(settings) if settings else {}))
        except Exception as exc:
            traceback.print_exc()
            res = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            failed.append(part)
        res["wall_seconds"] = time.perf_counter() - t0
        res["out"] = args.out  # where it was written: what its report's rerun command names
        res["measured_at"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        results["parts"][part] = _clean(res)
        print(f"== {part}: {res['wall_seconds']:.1f} s", flush=True)
    results["total_seconds"] = time.perf_counter() - t_all
    json_path.write_text(json.dumps(_clean(results), indent=1) + "\n")
    md = write_markdown(results, out, write_plots(results, out))
    print("wall time per part: " + ", ".join(f"{k} {v['wall_seconds']:.1f}s" for k, v in results["parts"].items())
          + f"; total {results['total_seconds']:.1f}s")
    print(f"wrote {md}, {json_path} and the plots")
    if failed:
        print(f"FAILED parts: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
