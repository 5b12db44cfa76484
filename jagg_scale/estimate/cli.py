"""The `jagg-estimate` command (the package docstring says what it prints).

The report is of the config as shipped (its train.micro_batch_size; --micro another); with --gpu-mem it also
names the largest micro-batch that fits. On several whole nodes (--world-size over --gpus-per-node) the config runs
with the parallel.replicate slurm/jagg.sbatch would give it (estimate/layout.py launch_replicate; a
parallel.replicate= override wins), and said so. For an SDE algorithm's config, a table follows: the step and
Flow-GRPO's at 8, 32 and 64 GPUs (SCALE), each at its launcher's layout, and, where the config takes more than one
optimizer step per rollout, the step with one (train.minibatch_size = every row of the rollout).

Exit status: 0 when the config fits (or no --gpu-mem was given), 1 when it does not fit the GPU with the headroom
asked for, 2 for a bad config, an unknown model shape or missing coefficients (named on one line).
"""

from __future__ import annotations

import argparse
import json
import sys

from .activations import CoefficientsMissing
from .collectives import Links, flow_grpo_engine
from .layout import launch_replicate
from .memory import DoesNotDivide, GiB, balanced, choose_micro, estimate, fits, local_rows, prepare, report
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
    ap.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node,
                    help="GPUs a node: a collective's group within one node runs at --nvlink-gbps, else --ib-gbps")
    ap.add_argument("--nvlink-gbps", type=float, default=Links.nvlink_gbps,
                    help="NCCL bus bandwidth of an all-gather / reduce-scatter inside a node, GB/s a GPU")
    ap.add_argument("--ib-gbps", type=float, default=Links.ib_gbps,
                    help="NCCL bus bandwidth of a collective across nodes, GB/s a GPU")
    ap.add_argument("--pools", action="store_true",
                    help="price the split pipeline (pools/): the best split of each cluster size into a rollout "
                         "and a trainer pool, one step apart, against the synchronous step")
    ap.add_argument("--reward-s", type=float, default=0.0,
                    help="seconds a step waits for its rewards after sampling (a judge served elsewhere): the "
                         "synchronous step pays them, the split pipeline's rollout pool overlaps them (--pools)")
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
        launch, said = launch_layout(cfg, args.world_size, args)
        if launch:
            print(said)
            cfg = load_config(args.config, [*args.overrides, *launch], check_files=False)
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
    times = step_time(cfg, s, est, args, [*args.overrides, *launch])
    table = None if cfg.forward_process else scale_table(args)
    pools = pools_table(args, table) if args.pools and table else None
    if args.json:
        print(json.dumps({**est, "step_seconds": times[0], "flow_grpo_step_seconds": times[1], "scale": table,
                          "pools": pools}, indent=1))
    else:
        print(report(s, est, args.gpu_mem, args.headroom))
        print(steptime.report(*times))
        if table:
            print(scale_report(table))
        if pools:
            print(pools_report(pools, args.reward_s))
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


def links(args) -> Links:
    return Links(args.nvlink_gbps, args.ib_gbps, args.gpus_per_node)


def launch_layout(cfg, world: int, args) -> tuple[list[str], str]:
    """The override that gives `cfg` the parallel.replicate slurm/jagg.sbatch runs it with on `world` ranks (none
    when that is the config's, or the user set parallel.replicate), and the line that says so."""
    if any(o.startswith("parallel.replicate=") for o in args.overrides):
        return [], ""
    replicate, why = launch_replicate(cfg, world, args.gpus_per_node)
    if replicate == cfg.parallel.replicate:
        return [], ""
    return [f"parallel.replicate={replicate}"], (f"parallel.replicate {replicate}: slurm/jagg.sbatch's on "
                                                 f"{world // args.gpus_per_node} nodes of {args.gpus_per_node} ({why})")


def step_time(cfg, s: dict, est: dict, args, overrides: list[str], world: int | None = None
              ) -> tuple[dict, dict | None]:
    """The config's step seconds, and Flow-GRPO's for the same config (an SDE algorithm's config only: a
    forward-process one, DiffusionNFT's, has no such peer step), each at the estimate's micro-batch and rollout
    batch, Flow-GRPO's with its own engine's collectives (collectives.flow_grpo_engine)."""
    from ..train.config import load_config

    world = world or args.world_size
    own = steptime.step_seconds(s, est, a2a_gbps=args.a2a_gbps, links=links(args))
    if cfg.forward_process:
        return own, None
    peer_cfg = load_config(args.config, [*overrides, *steptime.flow_grpo_overrides(cfg)], check_files=False)
    peer = prepare(peer_cfg, world, args.shapes, False, args.overhead_gb, args.gpu_mem or 79.2)
    return own, steptime.step_seconds(peer, estimate(peer), cfg_rows_with_grad=True, a2a_gbps=args.a2a_gbps,
                                      links=links(args), engine=flow_grpo_engine(peer_cfg), encode_every_row=True)


SCALE = (8, 32, 64)  # the cluster sizes the table prices: one node, and 4 and 8 nodes of 8


def scale_table(args) -> list[dict]:
    """At each world size of SCALE: the rows a rank holds, the layout, the step and its exposed collectives,
    Flow-GRPO's step and the speedup; with one optimizer step per rollout too where the config takes several."""
    from ..train.config import ConfigError, load_config

    out = []
    for world in SCALE:
        row = {"gpus": world}
        try:
            cfg = load_config(args.config, args.overrides, check_files=False)
            launch, _ = launch_layout(cfg, world, args)
            overrides = [*args.overrides, *launch]
            cfg = load_config(args.config, overrides, check_files=False) if launch else cfg
            R, B = local_rows(cfg, world)
            row.update(rows=R, minibatch=B, replicate=cfg.parallel.replicate)
            s = prepare(cfg, world, args.shapes, False, args.overhead_gb, args.gpu_mem or 79.2)
            own, peer = step_time(cfg, s, estimate(s, args.micro), args, overrides, world)
            row.update(step=own["step"], collectives=own["collectives"], flow_grpo=peer["step"],
                       speedup=peer["step"] / own["step"])
            everything = cfg.train.prompts_per_step * cfg.grpo.group_size
            if (R // B) * cfg.grpo.inner_epochs > 1:  # one optimizer step per rollout: one minibatch of every row
                # nothing is refreshed without a second optimizer step: grpo.refresh_at is refused there
                one_cfg = load_config(args.config, [*overrides, f"train.minibatch_size={everything}",
                                                    "grpo.refresh_at=null"], check_files=False)
                one = prepare(one_cfg, world, args.shapes, False, args.overhead_gb, args.gpu_mem or 79.2)
                one_step = steptime.step_seconds(one, estimate(one, args.micro), a2a_gbps=args.a2a_gbps,
                                                 links=links(args))["step"]
                row.update(one_step=one_step, one_speedup=peer["step"] / one_step)
        except (ConfigError, DoesNotDivide, CoefficientsMissing) as err:
            row["error"] = str(err)
        out.append(row)
    return out


def scale_report(table: list[dict]) -> str:
    one = any("one_step" in r for r in table)
    lines = ["", "the step by cluster size, each at slurm/jagg.sbatch's layout (the step's exposed data-parallel "
             "collectives in brackets), against Flow-GRPO's step of the same config:",
             "| GPUs | rows a rank (a minibatch's) | HSDP replicas | step s | Flow-GRPO's step s | speedup |"
             + (" one optimizer step a rollout: step s | its speedup |" if one else ""),
             "|---" * (6 + 2 * one) + "|"]
    for r in table:
        if "error" in r:
            lines.append(f"| {r['gpus']} | {r['error']} |")
            continue
        line = (f"| {r['gpus']} | {r['rows']} ({r['minibatch']}) | {r['replicate']} | {r['step']:.1f} "
                f"({r['collectives']:.1f}) | {r['flow_grpo']:.1f} | {r['speedup']:.2f}x |")
        if one:
            line += f" {r['one_step']:.1f} | {r['one_speedup']:.2f}x |" if "one_step" in r else " - | - |"
        lines.append(line)
    return "\n".join(lines)


def pools_table(args, table: list[dict]) -> list[dict]:
    """At each cluster size of the scale table: every split into pools priced (estimate/pools.py, one step apart)
    and the fastest, beside the synchronous step and Flow-GRPO's, each with --reward-s added."""
    from ..train.config import ConfigError, load_config
    from .pools import price_split, splits

    try:  # the config as the pools accept it (their refusals by key: pools/config.py)
        cfg = load_config(args.config, [*args.overrides, "pools.rollout_ranks=1"], check_files=False)
    except ConfigError as err:
        return [{"gpus": row["gpus"], "error": f"pools refused: {err}"} for row in table]
    out = []
    for row in table:
        if "error" in row:
            continue
        priced = []
        for r in splits(row["gpus"]):
            try:
                priced.append(price_split(cfg, row["gpus"], r, reward_s=args.reward_s, links=links(args),
                                          a2a_gbps=args.a2a_gbps, shapes=args.shapes, overhead_gb=args.overhead_gb,
                                          gpu_gib=args.gpu_mem or 79.2))
            except (DoesNotDivide, CoefficientsMissing):
                continue
        limit = (1 - args.headroom) * (args.gpu_mem or 79.2)
        fitting = [p for p in priced if p["replica_gib"] <= limit]  # a rollout rank holds the policy whole
        if fitting:
            best = min(fitting, key=lambda p: p["step"])
            out.append({**best, "sync": row["step"] + args.reward_s, "flow_grpo": row["flow_grpo"] + args.reward_s,
                        "splits": fitting})
        elif priced:
            small = min(priced, key=lambda p: p["replica_gib"])
            out.append({"gpus": row["gpus"], "error": f"no split: a rollout rank holds {small['replica_gib']:.1f} GiB "
                        f"(the policy whole, pools/replica.py), over {limit:.1f} GiB"})
    return out


def pools_report(pools: list[dict], reward_s: float) -> str:
    lines = ["", f"the split pipeline (pools.max_staleness 1), the fastest split of each cluster size, with "
             f"{reward_s:g} s of reward latency a step (--reward-s) in every column: estimate/pools.py",
             "| GPUs | rollout + trainer ranks | rollout rank GiB | rollout pool s | trainer pool s | step s | "
             "synchronous step s | vs synchronous | vs Flow-GRPO |", "|---" * 9 + "|"]
    for p in pools:
        if "error" in p:
            lines.append(f"| {p['gpus']} | {p['error']} |")
            continue
        lines.append(f"| {p['gpus']} | {p['rollout_ranks']} + {p['trainers']} | {p['replica_gib']:.1f} | "
                     f"{p['rollout_pool']:.1f} | "
                     f"{p['trainer_pool']:.1f} | {p['step']:.1f} | {p['sync']:.1f} | {p['sync'] / p['step']:.2f}x | "
                     f"{p['flow_grpo'] / p['step']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
