"""Command-line entry points:

    jagg-train CONFIG [section.key=value ...]
    jagg-eval  CONFIG [--checkpoint DIR] [--output DIR] [section.key=value ...]

Overrides may come before, between or after the options. A configuration error (a bad key or value, a file that
is not there, a run directory that already holds a run) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def train_main(argv: list[str] | None = None) -> int:
    """The `jagg-train` console script (argv None: the command line), or a call from Python with argv."""
    rc = _train(argv)
    if argv is None:
        from .parallel.dist import leave_launch

        leave_launch(rc)  # one rank of several: no interpreter teardown (parallel/dist.py says why)
    return rc


def _train(argv: list[str] | None) -> int:
    started = time.perf_counter()  # the summary's wall time: set-up included, as a user waits for it
    launcher = os.getppid()  # before the slow imports: the agent (under torchrun) for follow_launcher
    parser = argparse.ArgumentParser(prog="jagg-train", description="GRPO fine-tuning with JAGG")
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=2 jagg.window=4")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from .parallel.ranks import discover
    from .train import ConfigError, Trainer, load_config
    from .train.config import validate_world
    from .train.preemption import follow_launcher

    follow_launcher(launcher)  # under torchrun: SIGTERM (checkpoint, exit) when the agent dies, never an orphan
    try:
        cfg = load_config(args.config, args.overrides)
        validate_world(cfg, discover().world_size)  # the launch's process count, before any model is loaded
    except ConfigError as err:  # before any work: name the key and stop
        return _failed(err, 2)
    from .checkpoint import CheckpointError
    from .data.shards import ShardReadError
    from .parallel.engine import NonFiniteError
    from .pools.bridge import PoolError
    from .train.invariants import InvariantError
    from .train.run_lock import RunDirLocked

    dist = None
    if cfg.pools.enabled:  # the launch split into a trainer and a rollout pool (pools/)
        from .parallel.dist import init_distributed

        dist = init_distributed(cfg.run.device, timeout_s=cfg.parallel.collective_timeout_s, pools=cfg.pools)
        if dist.pool.role == "rollout":
            return _rollout(cfg, dist)
    try:
        trainer = Trainer(cfg, dist=dist)
    except ImportError as err:  # a package of an optional extra the core install leaves out: name the extra
        return _failed(_extra_or_raise(err), 2)
    except (ConfigError, RunDirLocked, CheckpointError) as err:
        # found once the run directory is read: an earlier run there, another job on it, no checkpoint that resumes
        return _failed(err, 2)
    except OSError as err:  # the machine, not the input (a full disk, a read-only mount): one line naming the path
        return _failed(err, 1)
    try:
        history = trainer.fit()
        if trainer.is_main:
            _summary(trainer, cfg, history, time.perf_counter() - started)
    except ShardReadError as err:  # the data is broken (a truncated shard, none with a valid record): no retry
        return _failed(err, 2)  # fixes it, and FAILED tells the launcher so
    except (NonFiniteError, InvariantError, PoolError, OSError) as err:  # diverged, an invariant broke, the other
        return _failed(err, 1)  # pool failed; the disk: said plainly
    finally:
        trainer.close()  # the process group, then the run lock (after the last write into the run directory)
    return 0


def _rollout(cfg, dist) -> int:
    """A rank of the rollout pool (pools/rollout_pool.py): its loop until the trainers have the last rollout."""
    from .pools.bridge import PoolError
    from .pools.rollout_pool import RolloutWorker
    from .train import ConfigError

    try:
        try:
            worker = RolloutWorker(cfg, dist)
        except ImportError as err:
            return _failed(_extra_or_raise(err), 2)
        except (ConfigError, FileNotFoundError, ValueError) as err:  # a reward's model path or option: the input's
            return _failed(err, 2)
        return worker.run()
    except PoolError as err:
        return _failed(err, 1)
    finally:
        dist.close()


def _failed(err: Exception, code: int) -> int:
    """A failure no retry can fix: one line on stderr, and (rank 0) the same line in the file JAGG_FAILED_FILE names
    when it is set: slurm/jagg.sbatch sets it to OUTPUT_DIR/FAILED, which tells it not to requeue the job."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under a launcher every rank says it: which one is which
    who = f" [rank {os.environ.get('RANK', '0')}/{world}]" if world > 1 else ""
    print(f"jagg-train{who}: {_one_line(err)}", file=sys.stderr)
    marker = os.environ.get("JAGG_FAILED_FILE")
    if marker and os.environ.get("RANK", "0") == "0":
        try:
            with open(marker, "w") as f:
                f.write(f"jagg-train exit {code}: {_one_line(err)}\n")
        except OSError as oserr:  # the message above is the report
            print(f"jagg-train: could not write JAGG_FAILED_FILE={marker}: {oserr}", file=sys.stderr)
    return code


def _extra_or_raise(err: ImportError) -> Exception:
    """The one-line error naming the optional extra that installs the missing package; any other ImportError is a
    bug, raised with its traceback."""
    from .extras import missing_extra

    extra = missing_extra(err)
    if extra is None:
        raise err
    return extra


def _one_line(err: BaseException) -> str:
    """The error's message on one line (a list of checkpoints and their problems becomes '; '-separated)."""
    return "; ".join(part.strip(" -") for part in str(err).splitlines() if part.strip(" -")) or type(err).__name__


def _summary(trainer, cfg, history: list[dict], wall_s: float) -> None:
    """Rank 0: the run's summary on stdout and in summary.json, rebuilt from the run's files (every step of
    metrics.jsonl, every eval/step_*/eval.json), so a rerun with nothing left to train prints and writes the same
    summary as the run that trained. `wall_s`: this jagg-train's wall time, recorded when it trained a step."""
    from .train import summarize
    from .train.diversity import diversity_summary

    path = trainer.out / "summary.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    rows = _run_history(trainer.out) or history
    summary = summarize(rows)
    if not summary:
        return
    for phase in ("rollout", "reward"):  # beside summarize's train_seconds: where the rest of a step's time went
        summary[f"{phase}_seconds"] = sum(r.get(f"time_{phase}", 0.0) for r in rows)
    steps = summary["steps"]
    # the wall time is no file's: the jagg-train that trained measured it; a rerun that trained nothing keeps it
    summary["wall_seconds"] = wall_s if history else old.get("wall_seconds")
    wall = summary["wall_seconds"]
    print(
        f"\n== jagg-train summary ({cfg.run.output_dir}) ==\n"
        f"  {getattr(getattr(trainer.algorithm, 'runner', None), 'planner', None) or cfg.jagg.make_planner()}\n"
        f"  reward: first {summary['reward_first']:.4f} -> last {summary['reward_last']:.4f} "
        f"(mean of first/last {min(3, steps)} steps)\n"
        f"  transformer backward passes: {summary['backward_passes']} vs "
        f"{summary['backward_passes_per_step_baseline']} "
        f"per-step (Flow-GRPO), {100 * summary['backward_saved_frac']:.0f}% saved\n"
        f"  seconds over the {steps} steps: policy update {summary['train_seconds']:.1f} (forward + backward + "
        f"optimizer: the phase JAGG shortens), rollout {summary['rollout_seconds']:.1f}, reward wait "
        f"{summary['reward_seconds']:.1f}\n"
        f"  wall time: {'-' if wall is None else _clock(wall)} (the jagg-train that trained the last step: set-up, "
        "evaluations and checkpoints included)"
    )
    evals = _run_evals(trainer.out)
    if evals:
        first, last = min(evals), max(evals)
        e0, e1 = evals[first], evals[last]
        summary["eval_before"], summary["eval_after"] = e0["reward_mean"], e1["reward_mean"]
        diversity, line = diversity_summary(e1)  # vs the base model's (step-0) evaluation
        summary.update(diversity)
        print(f"  held-out eval ({e1['reward']}, ODE, {e1['num_images']} images): "
              f"{e0['reward_mean']:.4f} after {first} steps -> {e1['reward_mean']:.4f} after {last} steps\n"
              f"{line}\n"
              f"  grids: {trainer.out / 'eval'}/step_*/grid.png")
    kept = {k: v for k, v in old.items() if k not in summary}
    if kept:  # never rewrite the file with less than it held (e.g. a rerun under eval.enabled=false)
        logging.getLogger(__name__).warning("summary.json: keeping %s from the earlier summary (not rebuilt from "
                                            "this run's files)", ", ".join(sorted(kept)))
    path.write_text(json.dumps({**summary, **kept}, indent=2))


def _clock(seconds: float) -> str:
    """h:mm:ss (or m:ss under an hour), as the progress bar shows time."""
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _run_evals(out) -> dict[int, dict]:
    """The run's held-out evaluations by step, read back from out/eval/step_XXXXXXXX/eval.json."""
    from .train.evaluate import load_eval

    found = {}
    for d in sorted((out / "eval").glob("step_*")) if (out / "eval").is_dir() else []:
        if d.name[5:].isdigit() and (result := load_eval(d)) is not None:
            found[int(d.name[5:])] = result
    return found


def _run_history(out) -> list[dict]:
    """Every step of the run from its metrics.jsonl (earlier attempts' too), non-finite values (null there) as
    NaN again, as the trainer returned them."""
    from .train.logging import METRICS, read_metrics

    if not (out / METRICS).is_file():
        return []
    return [{k: float("nan") if v is None else v for k, v in row.items()} for row in read_metrics(out)]


def eval_main(argv: list[str] | None = None) -> int:
    """The `jagg-eval` console script (argv None: the command line), or a call from Python with argv."""
    rc = _eval(argv)
    if argv is None:
        from .parallel.dist import leave_launch

        leave_launch(rc)  # one rank of several: no interpreter teardown (parallel/dist.py says why)
    return rc


def _eval(argv: list[str] | None) -> int:
    launcher = os.getppid()
    parser = argparse.ArgumentParser(prog="jagg-eval", description="deterministic ODE evaluation on held-out prompts")
    parser.add_argument("config", help="YAML config file (its eval section names the prompts)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.prompt_file=heldout.txt")
    parser.add_argument("--checkpoint", help="a checkpoint dir, or a run dir (its newest complete checkpoint); "
                                             "default: the model the config builds")
    parser.add_argument("--output", help="where eval.json and grid.png go (default: RUN/jagg-eval/step_XXXXXXXX "
                                         "beside the checkpoints, or ./eval without --checkpoint)")
    args = parser.parse_intermixed_args(argv)  # overrides anywhere, as jagg-train takes them
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from pathlib import Path

    from .checkpoint import newest_valid_checkpoint
    from .train import ConfigError, load_config
    from .train.evaluate import evaluate_checkpoint
    from .train.preemption import follow_launcher

    follow_launcher(launcher)  # under torchrun: ends with its agent (SIGTERM), never an orphan
    try:
        # a training config may have no eval section: say how to give prompts, not that eval.prompt_file is required
        # by an eval.enabled the user never set (jagg-eval sets it)
        plain = load_config(args.config, args.overrides + ["eval.enabled=false", "run.resume=none"])
        if not plain.eval.prompt_file and not plain.eval.prompts:
            print(f"jagg-eval: {args.config} names no held-out prompts (no eval.prompt_file or eval.prompts): give "
                  "them on the command line, e.g. eval.prompt_file=heldout.txt (.txt or .jsonl, one prompt a line) "
                  "or eval.prompts='[\"a red car\", \"a cat\"]'", file=sys.stderr)
            return 2
        cfg = load_config(args.config, args.overrides + ["eval.enabled=true", "run.resume=none"])
    except ConfigError as err:
        print(f"jagg-eval: {err}", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else Path("eval")
    path = None
    if args.checkpoint:
        path = Path(args.checkpoint)
        if not path.is_dir():
            print(f"jagg-eval: --checkpoint {path} is not a directory (a run directory or a checkpoint in its "
                  "checkpoints/)", file=sys.stderr)
            return 2
        if not (path / "COMPLETE").exists():
            found, problems = newest_valid_checkpoint(path / "checkpoints" if (path / "checkpoints").is_dir() else path)
            if found is None:
                why = "".join(f"\n  - {p}" for p in problems)
                print(f"jagg-eval: no complete checkpoint in {path}{why}", file=sys.stderr)
                return 2
            path = found
        out = Path(args.output) if args.output else eval_dir_beside(path)
    from .checkpoint import CheckpointError

    try:
        result = evaluate_checkpoint(cfg, path, out)  # under a launcher of N processes: each its share, rank 0 writes
    except (ConfigError, CheckpointError) as err:  # a prompt file of bad records; a checkpoint that fails its checks
        print(f"jagg-eval: {_one_line(err)}", file=sys.stderr)
        return 2
    except ImportError as err:  # a package of an optional extra the core install leaves out
        print(f"jagg-eval: {_extra_or_raise(err)}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in result.items() if k not in ("per_prompt", "grid")}, indent=2))
        print(f"wrote {out / 'eval.json'}" + (f" and {out / 'grid.png'}" if cfg.eval.grid_images else ""))
    return 0


def eval_dir_beside(checkpoint):
    """jagg-eval's default output for a checkpoint: RUN/jagg-eval/<checkpoint name> for RUN/checkpoints/<name>
    (else a jagg-eval/ beside the checkpoint). Never inside the checkpoint: run.keep_last deletes checkpoint
    directories whole, and a verified checkpoint's files are its manifest's."""
    parent = checkpoint.parent
    run = parent.parent if parent.name == "checkpoints" else parent
    return run / "jagg-eval" / checkpoint.name


if __name__ == "__main__":
    sys.exit(train_main())
