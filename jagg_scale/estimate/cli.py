"""The `jagg-estimate` command (the package docstring says what it prints).

The report is of the config as shipped (its train.micro_batch_size; --micro another); with --gpu-mem it also
names the largest micro-batch that fits. Exit status: 0 when the config fits (or no --gpu-mem was given), 1 when it
does not fit the GPU with the headroom asked for, 2 for a bad config, an unknown model shape or missing
coefficients (named on one line).
"""

from __future__ import annotations

import argparse
import json
import sys

from .activations import CoefficientsMissing
from .memory import DoesNotDivide, GiB, balanced, choose_micro, estimate, fits, prepare, report
from . import steptime
from .shapes import ShapeError, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg-estimate", description="per-rank peak memory of a jagg-scale config")
    ap.add_argument("config", nargs="?")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, as jagg-train takes them")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--gpu-mem", type=float, default=None, help="device memory per GPU in GiB (choose the micro-batch)")
    ap.add_argument("--headroom", type=float, default=0.10)
    ap.add_argument("--micro", type=int, default=None, help="estimate this micro-batch instead of choosing one")
    ap.add_argument("--overhead-gb", type=float, default=1.5, help="non-tensor memory per GPU (CUDA context, NCCL)")
    ap.add_argument("--shapes", default=None, help="shapes/NAME.json instead of model.pretrained's own configs")
    ap.add_argument("--measure", action="store_true", help="measure missing activation coefficients on this CPU")
    ap.add_argument("--counts", action="store_true", help="print the parameter counts of the shape files")
    ap.add_argument("--a2a-gbps", type=float, default=steptime.A2A_GBPS,
                    help="GB/s a rank sends in sequence parallelism's all-to-alls (default: inside a node, NVLink)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_intermixed_args(argv)
    if args.counts:
        print(counts())
        return 0
    if not args.config:
        ap.error("CONFIG is required (or --counts)")
    from ..train.config import ConfigError, load_config

    try:
        # the production paths (model, prompts) need not exist here: the shapes say what the model is
        cfg = load_config(args.config, args.overrides, check_files=False)
        check_prompt_files(cfg)
        s = prepare(cfg, args.world_size, args.shapes, args.measure, args.overhead_gb, args.gpu_mem or 79.2)
        est = estimate(s, args.micro)  # as shipped (train.micro_batch_size) unless --micro says otherwise
        if args.micro is None and args.gpu_mem:
            m, best = choose_micro(s, args.gpu_mem, args.headroom)
            print(f"largest train.micro_batch_size that fits: {m if m else 'none (even 1 does not fit)'}")
            if m and balanced(m, best["local_batch"]) < m:
                b = balanced(m, best["local_batch"])
                print(f"micro-batch {b} runs the same {-(-best['local_batch'] // m)} chunks of the "
                      f"{best['local_batch']}-row share with less memory: {estimate(s, b)['total'] / GiB:.2f} GiB")
    except (ConfigError, ShapeError, CoefficientsMissing, DoesNotDivide) as err:
        print(f"jagg-estimate: {err}", file=sys.stderr)
        return 2
    times = step_time(cfg, s, est, args)
    if args.json:
        print(json.dumps({**est, "step_seconds": times[0], "flow_grpo_step_seconds": times[1]}, indent=1))
    else:
        print(report(s, est, args.gpu_mem, args.headroom))
        print(steptime.report(*times))
    if args.gpu_mem and not fits(est, args.gpu_mem, args.headroom):
        print(f"jagg-estimate: {args.config} does not fit {args.gpu_mem:g} GiB per GPU with "
              f"{100 * args.headroom:.0f}% headroom on {args.world_size} ranks", file=sys.stderr)
        return 1
    return 0


def check_prompt_files(cfg) -> None:
    """The held-out prompt file must be there even though no model is: its prompt count prices the evaluation's
    share of the step (sd35m_pickscore without its 2,048 held-out prompts: 0.2 s of 5.1 s), so a missing one is an
    error naming it. The training prompts price nothing: a missing file is said on stderr (jagg-train refuses it)."""
    from ..data.fetch import missing_file_error

    error = missing_file_error("eval.prompt_file", cfg.eval.prompt_file if cfg.eval.enabled else None)
    if error is not None:
        raise error
    error = missing_file_error("data.prompt_file", cfg.data.prompt_file)
    if error is not None:
        print(f"jagg-estimate: not needed for the estimate, but jagg-train will refuse it: {error}", file=sys.stderr)


def step_time(cfg, s: dict, est: dict, args) -> tuple[dict, dict | None]:
    """The config's step seconds, and Flow-GRPO's for the same config (an SDE algorithm's config only: a
    forward-process one, DiffusionNFT's, has no such peer step), each at the estimate's micro-batch and rollout
    batch."""
    from ..train.config import load_config

    own = steptime.step_seconds(s, est, a2a_gbps=args.a2a_gbps)
    if cfg.forward_process:
        return own, None
    peer_cfg = load_config(args.config, [*args.overrides, *steptime.flow_grpo_overrides(cfg)], check_files=False)
    peer = prepare(peer_cfg, args.world_size, args.shapes, False, args.overhead_gb, args.gpu_mem or 79.2)
    return own, steptime.step_seconds(peer, estimate(peer), cfg_rows_with_grad=True, a2a_gbps=args.a2a_gbps)


if __name__ == "__main__":
    sys.exit(main())
