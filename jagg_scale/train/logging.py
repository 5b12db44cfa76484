"""Where a run reports: metrics.jsonl (one line per step), a progress bar with the live reward, and wandb
(offline by default, so a cluster node without internet never blocks on it)."""

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

    def close(self) -> None:
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
