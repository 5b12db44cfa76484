"""Where a run reports: metrics.jsonl (one line per step), a progress bar with the live reward, and wandb
(offline by default, so a cluster node without internet never blocks on it): the run config, the step scalars,
and per evaluation its scalars, its grid and one panel per prompt, captioned with the prompt and its scores (a
reward mean cannot show a collapse of the samples; the images can).

metrics.jsonl survives the ways a run ends. A kill or a full disk in the middle of a write leaves a torn last line:
reading the file (a resume, `read_metrics`) drops it with a warning naming the file and the line, and a resume
rewrites the file without it (atomically: a crash while rewriting leaves the old file). A line that does not parse
with lines after it is not a torn write but damage: MetricsFileError names it, and nothing is rewritten.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm

from .run_lock import write_run_file

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"


class MetricsFileError(RuntimeError):
    """metrics.jsonl is damaged before its last line; the message names the file and the line."""


class RunLogger:
    def __init__(self, output_dir: Path, *, total_steps: int, start_step: int, progress: bool, wandb_cfg: dict | None,
                 config: dict):
        self.path = Path(output_dir) / METRICS
        self._truncate_after(start_step)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="jagg-train", disable=not progress,
                        file=sys.stderr, dynamic_ncols=True)
        self.wandb = None
        if wandb_cfg is not None:
            import wandb

            self.wandb = wandb.init(project=wandb_cfg["project"], mode=wandb_cfg["mode"], dir=str(output_dir),
                                    config=config, resume="allow")

    def _truncate_after(self, start_step: int) -> None:
        """A resumed run rewrites the steps after its checkpoint: drop lines a crashed run wrote past it (and a
        torn last line); a fresh run (step 0) starts an empty file."""
        if not self.path.exists():
            return
        keep = [row for row in parse_metrics(self.path) if row["step"] < start_step] if start_step > 0 else []
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(row) + "\n" for row in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def log(self, metrics: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        write_run_file(self.path, json.dumps(clean) + "\n", append=True)  # never through a planted link
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics['reward_mean']:.4f}", loss=f"{metrics['loss']:.2e}",
                             bwd=f"{metrics['backward_passes']}/{metrics['per_step_equiv']}")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=metrics["step"])

    def log_eval(self, step: int, result: dict, eval_dir: Path) -> None:
        """wandb only (eval.json already holds the evaluation): eval/ scalars, eval/grid and eval/prompts, and a video
        model's eval/videos (its GIFs as wandb.Video)."""
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
            with Image.open(grid_file) as png:
                grid = png.convert("RGB")  # a copy in memory: the file is closed here
            data["eval/grid"] = wandb.Image(grid, caption=f"step {step}: {_caption(result)}")
            rows = grid_rows(grid, len(result["grid"]["rows"]))
            data["eval/prompts"] = [wandb.Image(row, caption=f"{p['prompt']}: {_caption(p)}")
                                    for row, p in zip(rows, result["per_prompt"])]
            videos = [Path(eval_dir) / name for name in result["grid"].get("videos", [])]  # a video model's GIFs
            if videos:
                data["eval/videos"] = [wandb.Video(str(path), caption=f"{p['prompt']}: {_caption(p)}", format="gif")
                                       for path, p in zip(videos, result["per_prompt"]) if path.is_file()]
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
    """The rows of a run's metrics.jsonl (a torn last line dropped with a warning)."""
    return parse_metrics(Path(output_dir) / METRICS)


def parse_metrics(path: Path, *, warn: bool = True) -> list[dict]:
    """Every row of a metrics file. The last line may be torn (a kill mid-write: no newline, or not JSON): dropped
    with a warning. Any other line that is not a JSON object with a "step" raises MetricsFileError naming it."""
    lines = path.read_bytes().split(b"\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip(b" \t\r")]
    rows = []
    for k, (lineno, raw) in enumerate(numbered):
        row = _row(raw)
        if row is not None:
            rows.append(row)
        elif k == len(numbered) - 1:
            if warn:
                log.warning("%s: line %d is torn (a write cut short: the run was killed or the disk was full); "
                            "dropped: %r", path, lineno, raw[:80])
        else:
            raise MetricsFileError(f"{path}: line {lineno} is not a metrics row ({raw[:80]!r}) and "
                                   f"{len(numbered) - k - 1} line(s) follow it: the file is damaged, not torn by a "
                                   "crash. Repair or remove that line (or move the file away) and start again")
    return rows


def _row(raw: bytes) -> dict | None:
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    step = row.get("step") if isinstance(row, dict) else None
    # a number (distributed runs before issue 17 logged it averaged over ranks, as a float)
    return row if isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step) else None
