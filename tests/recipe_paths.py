"""The overrides that point a production recipe at a tiny pipeline and local files (tests/train's recipe tests)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recipe_paths(pipe_dir, tmp_path: Path) -> list[str]:
    """model.pretrained at `pipe_dir`, four prompts written under `tmp_path` for training and evaluation, the run
    directory there; model.lora.expect_modules off (the recipe's count is its real model's, not the tiny one's)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat holding a sign that says \"hello\"\na red apple\na dog\na blue car\n")
    return [f"model.pretrained={pipe_dir}", f"data.prompt_file={prompts}", f"eval.prompt_file={prompts}",
            f"run.output_dir={tmp_path / 'run'}", "model.lora.expect_modules=null"]
