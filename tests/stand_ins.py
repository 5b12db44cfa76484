"""Small shared test helpers: config stand-ins and a simulated preemption."""

from __future__ import annotations

import signal
from pathlib import Path


def stand_in_paths(tmp_path: Path, prompts: str = "a red apple\na dog\n", experts: bool = False) -> list[str]:
    """Overrides pointing the paths a config names at stand-ins the config checks accept (an empty pipeline
    directory, with `experts` one whose index names Wan2.2's transformer_2; a prompt file): no model weights are
    read."""
    pipe = tmp_path / "pipe"
    pipe.mkdir(exist_ok=True)
    (pipe / "model_index.json").write_text('{"transformer_2": ["diffusers", "WanTransformer3DModel"]}' if experts
                                           else "{}")
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text(prompts)
    return [f"model.pretrained={pipe}", f"data.prompt_file={prompt_file}", f"eval.prompt_file={prompt_file}",
            "data.prompts=null", "eval.prompts=null"]  # the file replaces any inline list (one prompt source)


def sigterm_at_step(trainer, at: int) -> None:
    """Make `trainer` see a SIGTERM at the end of training step `at` (as the signal handler would record it): the
    step is done, the checkpoint after it is the preemption's."""
    real_step = trainer.train_step

    def step_then_signal(step):
        metrics = real_step(step)
        if step == at:
            trainer.preemption.signal_number = signal.SIGTERM
        return metrics

    trainer.train_step = step_then_signal


def signal_in_step(trainer, at: int, phase: str, nth: int = 1, sig: int = signal.SIGTERM) -> None:
    """Send this process a real `sig` inside training step `at`: before the `nth` transformer forward of its `phase`
    (rollout | update, the trainer's StopPoints phase), as its reward wait begins (`phase` "reward"), or, `phase`
    "optimizer", right after its first optimizer step (the state has moved: the step must run to its end)."""
    import os

    seen = {"step": None, "forwards": 0, "sent": False}
    real_step, real_point = trainer.train_step, trainer.policy.stop_point

    def send():
        seen["sent"] = True
        os.kill(os.getpid(), sig)  # the handler runs in the main thread before the next bytecode

    def step(s):
        seen["step"] = s
        return real_step(s)

    def point():
        if not seen["sent"] and seen["step"] == at and trainer.stops.phase == phase:
            seen["forwards"] += 1
            if seen["forwards"] == nth:
                send()
        real_point()

    trainer.train_step, trainer.policy.stop_point = step, point
    if phase == "reward":
        real_rename = trainer.stops.rename

        def rename(name):
            real_rename(name)
            if name == "reward" and not seen["sent"] and seen["step"] == at:
                send()

        trainer.stops.rename = rename
    if phase == "optimizer":
        real_engine_step = trainer.engine.step

        def engine_step(*args, **kwargs):
            out = real_engine_step(*args, **kwargs)
            if not seen["sent"] and seen["step"] == at:
                send()
            return out

        trainer.engine.step = engine_step
