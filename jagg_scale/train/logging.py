"""Where a run reports: metrics.jsonl (one line per step), a progress bar with the live reward, and wandb
(offline by default, so a cluster node without internet never blocks on it): the run config, the step scalars,
and per evaluation its scalars, its grid and one panel per prompt, captioned with the prompt and its scores (a
reward mean cannot show a collapse of the samples; the images can)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm


class RunLogger:
    def __init__(self, output_dir: Path, *, total_steps: int, start_step: int, progress: bool, wandb_cfg: dict | None,
                 config: dict):
        self.path = Path(output_dir) / "metrics.jsonl"
        self._truncate_after(start_step)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="jagg-train", disable=not progress,
                        file=sys.stderr, dynamic_ncols=True)
        self.wandb = None
        if wandb_cfg is not None:
            import wandb

            self.wandb = wandb.init(project=wandb_cfg["project"], mode=wandb_cfg["mode"], dir=str(output_dir),
                                    config=config, resume="allow")

    def _truncate_after(self, start_step: int) -> None:
        """A resumed run rewrites the steps after its checkpoint: drop lines a crashed run wrote past it."""
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start_step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, metrics: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics['reward_mean']:.4f}", loss=f"{metrics['loss']:.2e}",
                             bwd=f"{metrics['backward_passes']}/{metrics['per_step_equiv']}")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=metrics["step"])

    def log_eval(self, step: int, result: dict, eval_dir: Path) -> None:
        """wandb only (eval.json already holds the evaluation): eval/ scalars, eval/grid and eval/prompts."""
        if self.wandb is None:
            return
        import wandb
        from PIL import Image

        from .grid import grid_rows

        data = {f"eval/{k}": result.get(k) for k in ("reward_mean", "reward_std", "diversity", "diversity_ratio")}
        data["eval/diversity_base"] = (result.get("base") or {}).get("diversity")
        data = {k: v for k, v in data.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        grid_file = Path(eval_dir) / "grid.png"
        if result.get("grid") and grid_file.is_file():
            with Image.open(grid_file) as grid:
                grid.load()
            data["eval/grid"] = wandb.Image(grid, caption=f"step {step}: {_caption(result)}")
            rows = grid_rows(grid, len(result["grid"]["rows"]))
            data["eval/prompts"] = [wandb.Image(row, caption=f"{p['prompt']}: {_caption(p)}")
                                    for row, p in zip(rows, result["per_prompt"])]
        self.wandb.log(data, step=step)

    def close(self) -> None:
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def _caption(scored: dict) -> str:
    """'reward 0.812, diversity 0.214' for an evaluation or one of its prompts."""
    if "reward_mean" in scored:
        reward = scored["reward_mean"]
    else:
        reward = sum(scored["scores"]) / len(scored["scores"])
    diversity = scored.get("diversity")
    return f"reward {reward:.3f}, diversity " + ("-" if diversity is None else f"{diversity:.3f}")


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
