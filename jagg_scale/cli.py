"""Command-line entry points:

    jagg-train CONFIG [section.key=value ...]
    jagg-eval  CONFIG [--checkpoint DIR] [--output DIR] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def train_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jagg-train", description="GRPO fine-tuning with JAGG")
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=2 jagg.window=4")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from .parallel.ranks import discover
    from .train import ConfigError, Trainer, load_config, summarize
    from .train.config import validate_world
    from .train.diversity import diversity_summary

    try:
        cfg = load_config(args.config, args.overrides)
        validate_world(cfg, discover().world_size)  # the launch's process count, before any model is loaded
    except ConfigError as err:  # before any work: name the key and stop
        print(f"jagg-train: {err}", file=sys.stderr)
        return 2
    from .parallel.engine import NonFiniteError

    trainer = Trainer(cfg)
    try:
        history = trainer.fit()
    except NonFiniteError as err:  # diverged, or refused to checkpoint NaN weights: a failed run, said plainly
        print(f"jagg-train: {err}", file=sys.stderr)
        return 1
    finally:
        trainer.dist.close()
    summary = summarize(history)
    if summary and trainer.dist.is_main:
        print(
            f"\n== jagg-train summary ({cfg.run.output_dir}) ==\n"
            f"  mode {cfg.jagg.mode}, window {cfg.jagg.window}, jagg_frac {cfg.jagg.jagg_frac}\n"
            f"  reward: first {summary['reward_first']:.4f} -> last {summary['reward_last']:.4f} "
            f"(mean of first/last {min(3, summary['steps'])} steps)\n"
            f"  transformer backward passes: {summary['backward_passes']} vs {summary['backward_passes_per_step_baseline']} "
            f"per-step (Flow-GRPO), {100 * summary['backward_saved_frac']:.0f}% saved\n"
            f"  training-phase seconds: {summary['train_seconds']:.1f}"
        )
        if trainer.evals:
            first, last = min(trainer.evals), max(trainer.evals)
            e0, e1 = trainer.evals[first], trainer.evals[last]
            summary["eval_before"], summary["eval_after"] = e0["reward_mean"], e1["reward_mean"]
            diversity, line = diversity_summary(e1)  # vs the base model's (step-0) evaluation
            summary.update(diversity)
            print(f"  held-out eval ({e1['reward']}, ODE, {e1['num_images']} images): "
                  f"{e0['reward_mean']:.4f} after {first} steps -> {e1['reward_mean']:.4f} after {last} steps\n"
                  f"{line}\n"
                  f"  grids: {trainer.out / 'eval'}/step_*/grid.png")
        (trainer.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


def eval_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jagg-eval", description="deterministic ODE evaluation on held-out prompts")
    parser.add_argument("config", help="YAML config file (its eval section names the prompts)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides")
    parser.add_argument("--checkpoint", help="a checkpoint dir, or a run dir (its newest complete checkpoint); "
                                             "default: the model the config builds")
    parser.add_argument("--output", help="where eval.json and grid.png go (default: CHECKPOINT/eval or ./eval)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from pathlib import Path

    from .checkpoint import find_resume_checkpoint
    from .train import ConfigError, load_config
    from .train.evaluate import evaluate_checkpoint

    try:
        cfg = load_config(args.config, args.overrides + ["eval.enabled=true", "run.resume=none"])
    except ConfigError as err:
        print(f"jagg-eval: {err}", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else Path("eval")
    path = None
    if args.checkpoint:
        path = Path(args.checkpoint)
        if not (path / "COMPLETE").exists():
            found = find_resume_checkpoint(path / "checkpoints" if (path / "checkpoints").is_dir() else path)
            if found is None:
                print(f"jagg-eval: no complete checkpoint in {path}", file=sys.stderr)
                return 2
            path = found
        out = Path(args.output) if args.output else path / "eval"
    result = evaluate_checkpoint(cfg, path, out)  # under a launcher of N processes: each its share, rank 0 writes
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in result.items() if k not in ("per_prompt", "grid")}, indent=2))
        print(f"wrote {out / 'eval.json'}" + (f" and {out / 'grid.png'}" if cfg.eval.grid_images else ""))
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
