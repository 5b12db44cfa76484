"""Training: the run configuration and the GRPO loop.

    config.py, config_sections.py   typed, validated configuration (YAML + dotted overrides)
    trainer.py                      the Trainer: a step as rollout -> reward -> advantage -> update -> log, the loop
    policy.py                       the policy's velocity, KL reference, prompt encoding and rollout
    update.py                       one minibatch's knot plan and gradient (through jagg.knot_backward)
    rows.py                         which rows each rank samples and trains, seeded per row
    run_state.py                    checkpoints, resume, export
    evaluate.py                     deterministic held-out evaluation (and jagg-eval's checkpoint evaluation)
    logging.py, preemption.py       metrics.jsonl / wandb, and SIGTERM/SIGUSR1 -> checkpoint and exit
"""

from .config import Config, ConfigError, load_config
from .trainer import Trainer, summarize

__all__ = ["Config", "ConfigError", "load_config", "Trainer", "summarize"]
