"""Training runs the tests compare, read back as their metrics rows: in this process (`fit_metrics`) or as the real
jagg-train command, on 1 process or N under torchrun (`launch_metrics`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hang_guard import RUN_S

BIN = Path(sys.executable).parent


def metrics(out: Path, *, timing: bool = True) -> list[dict]:
    """The rows of out/metrics.jsonl; timing=False drops the wall-clock and communication keys (they differ
    between two runs of the same steps)."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows if timing else [{k: v for k, v in r.items() if not k.startswith(("time_", "comm_"))} for r in rows]


def fit_metrics(config, overrides: list[str], out: Path, *, timing: bool = False) -> list[dict]:
    """A Trainer of `config` with `overrides` fitted into `out` in this process: its metrics rows, timing dropped
    unless asked for. The 1-process reference of a multi-process test runs here: what jagg-train adds around the
    Trainer (argument parsing, exit codes) is tested by the launches, and a process start with diffusers' and
    transformers' imports costs 3-8 s of a 2-core machine."""
    from jagg_scale.train import Trainer, load_config

    trainer = Trainer(load_config(config, [*overrides, "log.progress=false", f"run.output_dir={out}"]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return metrics(out, timing=timing)


def launch_metrics(args: list[str], nproc: int, out: Path) -> list[dict]:
    """`jagg-train ARGS run.output_dir=OUT` as a user runs it (torchrun with `nproc` > 1): its metrics rows."""
    return launch(args, nproc, out)[0]


def launch(args: list[str], nproc: int, out: Path) -> tuple[list[dict], str]:
    """launch_metrics's run: its metrics rows and what the processes wrote to stderr (their warnings)."""
    from jagg_scale.parallel.ranks import free_port, launcher_env

    args = [*args, f"run.output_dir={out}"]
    cmd = ([str(BIN / "jagg-train"), *args] if nproc == 1 else
           [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
            str(BIN / "jagg-train"), *args])
    proc = subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True, timeout=RUN_S)  # a hang guard
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return metrics(out), proc.stderr


TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")  # the built-in DiT's smoke job


def small_dit(num_steps: int, batch_size: int) -> list[str]:
    """Overrides of TINY for a very small DiT run: 8 px, two blocks, two prompts in groups of 3, `num_steps` sampling
    steps and minibatches of `batch_size` samples, no progress bar, no checkpoints."""
    return ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
            "model.dit.num_heads=2", f"sampling.num_steps={num_steps}", "train.prompts_per_step=2",
            "grpo.group_size=3", f"train.minibatch_size={batch_size}", "log.progress=false", "run.checkpoint_every=0"]


# The 2-process FSDP2 reference of tests/parallel/test_distributed.py (and of the split pipeline's k = 0 run,
# tests/pools): a small DiT, 2 minibatches a step (the second after an optimizer step), the sharded EMA
SMALL = ["model.dit.hidden_size=64", "model.dit.depth=2", "sampling.num_steps=8", "train.prompts_per_step=2",
         "train.minibatch_size=4", "log.progress=false", "jagg.window=4"]
# the sharded EMA goes through the DCP checkpoints too, moved by Flow-GRPO's rule (parallel/ema.py): 2 optimizer steps
# a training step, updates after optimizer steps 2 and 5, so a resumed run needs the count it derives from its step
EMA = ("train.ema_decay=0.9", "train.ema_every=3", "train.ema_warmup=true", "train.ema_repeat=2")
FSDP2_RUN = [TINY, *SMALL, "parallel.engine=fsdp2", "train.steps=3", "run.checkpoint_every=1", "run.keep_last=3",
             *EMA]


def fsdp2_reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """FSDP2_RUN on 2 processes, once a test session (tests/once.py): its run directory (read-only) and metrics."""
    from once import once

    d, rows = once(tmp_path_factory, "fsdp2_run", lambda d: launch_metrics(FSDP2_RUN, 2, d / "run"))
    return d / "run", rows


def dcp_entries(ckpt: Path, section: str) -> dict:
    """The `section` entries ("model": the trained weights, "ema") of an FSDP2 checkpoint, read whole in one
    process."""
    import torch

    from jagg_scale.checkpoint.dcp_reader import dcp_load, read_metadata

    saved = read_metadata(ckpt / "dcp").state_dict_metadata
    prefix = f"{section}."
    out = {k[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()
           if k.startswith(prefix)}
    assert out, f"{ckpt} holds no {section!r} entries"
    dcp_load({section: out}, ckpt / "dcp", no_dist=True)
    return out
