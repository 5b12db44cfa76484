"""Small shared test helpers: config stand-ins and a simulated preemption."""

from __future__ import annotations

import signal
from pathlib import Path


def stand_in_paths(tmp_path: Path, prompts: str = "a red apple\na dog\n") -> list[str]:
    """Overrides pointing the paths a config names at stand-ins the config checks accept (an empty pipeline
    directory, a prompt file): no model weights are read."""
    pipe = tmp_path / "pipe"
    pipe.mkdir(exist_ok=True)
    (pipe / "model_index.json").write_text("{}")
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text(prompts)
    return [f"model.pretrained={pipe}", f"data.prompt_file={prompt_file}", f"eval.prompt_file={prompt_file}",
            "data.prompts=null", "eval.prompts=null"]  # the file replaces any inline list (one prompt source)


def sigterm_at_step(trainer, at: int) -> None:
    """Make `trainer` see a SIGTERM during training step `at` (as the signal handler would record it)."""
    real_step = trainer.train_step

    def step_then_signal(step):
        if step == at:
            trainer.preemption.signal_number = signal.SIGTERM
        return real_step(step)

    trainer.train_step = step_then_signal
