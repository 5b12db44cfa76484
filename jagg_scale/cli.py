"""Command-line entry points: `jagg-train CONFIG [section.key=value ...]`."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def train_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jagg-train", description="GRPO fine-tuning with JAGG")
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=2 jagg.window=4")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from .train import ConfigError, Trainer, load_config, summarize

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:  # before any work: name the key and stop
        print(f"jagg-train: {err}", file=sys.stderr)
        return 2
    trainer = Trainer(cfg)
    history = trainer.fit()
    summary = summarize(history)
    if summary:
        print(
            f"\n== jagg-train summary ({cfg.run.output_dir}) ==\n"
            f"  mode {cfg.jagg.mode}, window {cfg.jagg.window}, jagg_frac {cfg.jagg.jagg_frac}\n"
            f"  reward: first {summary['reward_first']:.4f} -> last {summary['reward_last']:.4f} "
            f"(mean of first/last {min(3, summary['steps'])} steps)\n"
            f"  transformer backward passes: {summary['backward_passes']} vs {summary['backward_passes_per_step_baseline']} "
            f"per-step (Flow-GRPO), {100 * summary['backward_saved_frac']:.0f}% saved\n"
            f"  training-phase seconds: {summary['train_seconds']:.1f}"
        )
        (trainer.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
