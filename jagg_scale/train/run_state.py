"""A run's state on disk: checkpoints (save, verify, resume) and the exported weights.

    out/checkpoints/step_XXXXXXXX/   engine state (weights, optimizer, EMA), per-rank RNG, prompt-source position,
                                     state.json; written collectively and atomically (checkpoint/local.py), each
                                     rank hashing its own files
    out/lora | out/transformer       the weights in the backbone's own format (diffusers), rank 0, in
                                     run.export_dtype (auto: the published dtype), with jagg_export.json
                                     ({"step", "dtype"}) inside

When (`after_step`, called by the trainer after every step): a checkpoint every run.checkpoint_every steps, at the
last step and on preemption; an export at the last step and every run.export_every steps, never on preemption: a
preemption has only the signal's lead time (docs/launchers.md), and the export of a full fine-tune (FLUX: 47.6 GB
in fp32) is the checkpoint's weights again in another format. `finish` writes the final export when the loop did
not (a run preempted at its last step, resumed with nothing left to train).

A fresh start (run.resume none) into a directory that already holds a run (metrics rows, checkpoints, an export) is
refused, naming what is there (`check_fresh_start`, RunDirExistsError, a ConfigError: jagg-train exits 2): starting
over would replace its metrics.jsonl and, in time, its checkpoints. run.overwrite=true says to replace it: the
earlier run's outputs are deleted when training starts (`clear_earlier_run`), so none of its checkpoints can be
taken for the new run's by a later run.resume=auto.

Resume (run.resume): none starts at step 0; auto takes the newest checkpoint that verifies, starts at 0 when
there is none, and refuses to start when there are some but none verifies (each named with its problem: starting
over would silently rewrite the run's metrics); a path resumes that checkpoint. A checkpoint past train.steps is
refused too (nothing to train). Every file is loaded as data only (checkpoint/pickles.py): resuming someone
else's checkpoint runs none of their code.

Every random draw of step t is seeded by (run.seed, t[, row]), so a run resumed at step t draws exactly what the
uninterrupted run drew; the RNG state (tensors and numbers) is saved for the few unseeded global draws.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, capture_rng_state, restore_rng_state
from ..checkpoint.local import (COMPLETE, STATE, checkpoint_dir, save_checkpoint_dir, valid_checkpoints,
                                verify_checkpoint, write_bytes, write_object)
from ..checkpoint.pickles import allowed_globals, load_torch
from .config import Config, ConfigError
from .logging import METRICS, MetricsFileError, parse_metrics

log = logging.getLogger(__name__)

EXPORT_RECORD = "jagg_export.json"  # inside the export directory: which step and dtype it holds
# what a run writes into its directory (jagg-eval's default output too): what run.overwrite replaces
RUN_OUTPUTS = (METRICS, "summary.json", "checkpoints", "eval", "jagg-eval", "lora", "transformer", "PREEMPTED")


class RunDirExistsError(ConfigError):
    """run.resume is none but run.output_dir holds an earlier run; the message names it and the ways on."""


def earlier_run(out: Path) -> list[str]:
    """What an earlier run left in `out` that a fresh start would replace (empty: nothing worth keeping)."""
    out, found = Path(out), []
    metrics = out / METRICS
    rows = [line for line in metrics.read_bytes().splitlines() if line.strip()] if metrics.is_file() else []
    if rows:
        found.append(f"{METRICS} ({len(rows)} rows)")
    steps = sorted(p.name for p in (out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
    if steps:
        found.append(f"checkpoints/{steps[0]}" + (f" .. {steps[-1]} ({len(steps)})" if len(steps) > 1 else ""))
    found += [f"{name}/ (export)" for name in ("lora", "transformer") if (out / name).is_dir()]
    return found


def check_run_dir(out: Path) -> None:
    """Before the lock is taken: a directory holding a config.yaml but no run's lock file is someone's own directory
    (a configs folder, another tool's output), not a run dir: refused, naming the file, instead of overwriting it."""
    from .run_lock import LOCK_FILE

    foreign = Path(out) / "config.yaml"
    if (foreign.exists() or foreign.is_symlink()) and not (Path(out) / LOCK_FILE).exists():
        raise RunDirExistsError(f"config key 'run.output_dir': {out} holds a config.yaml that no run wrote (there is "
                                f"no {LOCK_FILE}): a run would overwrite {foreign}. Train into a new run.output_dir")


def check_fresh_start(cfg: Config, out: Path) -> None:
    """run.resume none into a directory holding a run: RunDirExistsError unless run.overwrite (then a warning)."""
    found = earlier_run(out) if cfg.run.resume == "none" else []
    if not found:
        return
    if cfg.run.overwrite:
        log.warning("run.overwrite=true: the earlier run in %s (%s) is replaced", out, ", ".join(found))
        return
    raise RunDirExistsError(
        f"config key 'run.output_dir': {out} already holds a run ({', '.join(found)}) and run.resume is none: "
        "starting over would replace it. Continue it with run.resume=auto, train into a new run.output_dir, or "
        "replace it with run.overwrite=true")


def clear_earlier_run(out: Path) -> None:
    """run.overwrite: delete what an earlier run wrote into `out` (RUN_OUTPUTS; nothing else in it)."""
    for name in RUN_OUTPUTS:
        path = Path(out) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


class RunState:
    def __init__(self, cfg: Config, dist, engine, out: Path):
        self.cfg, self.dist, self.engine = cfg, dist, engine
        self.out = Path(out)
        self.ckpt_root = self.out / "checkpoints"
        self.exported_step: int | None = None  # the step of the export this process wrote, if any
        self.saved_step: int | None = None  # the step of the newest checkpoint this process wrote, if any
        # more state a checkpoint holds (the pools' earlier policy versions): save_into(tmp, next_step) -> the files
        # this rank wrote, load_from(path) on resume
        self.parts: list = []

    @functools.cached_property
    def export_dtype(self) -> str:
        """Resolved on first use (an export, or the check that one is done): a run that only loads reads no headers."""
        return export_dtype(self.cfg)

    # ------------------------------------------------------------------ after a training step
    def after_step(self, next_step: int, source, model, *, last: bool, preempted: bool) -> None:
        """The checkpoint and the export due after the step before `next_step` (collective)."""
        every = self.cfg.run.checkpoint_every
        if last or preempted or (every and next_step % every == 0):
            self.save(next_step, source)
        if self.export_due(next_step, last=last, preempted=preempted):
            self.export(model, next_step)

    def export_due(self, next_step: int, *, last: bool, preempted: bool) -> bool:
        if preempted:  # the lead time is the checkpoint's; the resumed run exports when due
            return False
        every = self.cfg.run.export_every
        return last or bool(every and next_step % every == 0)

    def finish(self, model, steps: int) -> None:
        """The final export, unless this run or an earlier one already wrote it (collective)."""
        if not hasattr(model, "save_full") or self.exported_step == steps:
            return
        done = None
        if self.dist.is_main:  # one reader: the others might race rank 0's rename
            record = self._export_dir() / EXPORT_RECORD
            done = json.loads(record.read_text()) if record.is_file() else None
        done = self.dist.broadcast_object(done)
        if done != {"step": steps, "dtype": self.export_dtype}:
            self.export(model, steps)

    # ------------------------------------------------------------------ checkpoints
    def save(self, next_step: int, source, *, prompts: dict | None = None, rng: dict | None = None) -> Path:
        """A complete checkpoint of the state before step `next_step` (collective). `prompts`, `rng`: the prompt
        source's position and the global RNG state taken at that step's start (an abandoned step: trainer.py), in
        place of their state now."""
        state = {"step": next_step, "prompts": source.state_dict() if prompts is None else prompts,
                 "config": self.cfg.to_dict(), "world_size": self.dist.world_size}
        rng = capture_rng_state() if rng is None else rng

        def write(tmp: Path) -> list[Path]:  # the files this rank wrote: it hashes them itself
            files = self.engine.save(tmp)
            files += [f for part in self.parts for f in part.save_into(tmp, next_step)]
            return [*files, write_object(tmp / f"rng_rank{self.dist.rank:05d}.pt", rng)]

        path = save_checkpoint_dir(self.ckpt_root, next_step, write=write, state=state,
                                   keep_last=self.cfg.run.keep_last, dist=self.dist)
        self.saved_step = next_step
        return path

    def has_checkpoint(self, step: int) -> bool:
        """Whether the run's checkpoints hold a complete one of step `step` (this process's, or the one it resumed
        from); the same answer on every rank."""
        if self.saved_step == step:
            return True
        return self.dist.on_main(lambda: (checkpoint_dir(self.ckpt_root, step) / COMPLETE).is_file())

    def load(self, path: Path) -> None:
        """Engine state from a checkpoint directory, verified first (collective: each file hashed once, on one
        rank; a problem raises the same CheckpointError on every rank), then loaded on every rank: any rank's
        loading error is raised on every rank at once (no rank waits for one that failed)."""
        verify_checkpoint(path, self.dist)
        self._load_engine(Path(path))

    def _load_engine(self, path: Path) -> None:
        self.dist.on_every_rank(lambda: self.engine.load(path))  # shapes, dtypes checked before any copy
        self.engine.check_loaded(path)  # and every weight finite, in every engine's format (collective)

    def resume(self, source) -> int:
        """The step to start from: run.resume none -> 0; auto -> the newest checkpoint that verifies and loads
        (weights that fit the model and are finite), falling back to the one before, 0 when there is none,
        CheckpointError (naming each one and why) when there are some but none can be resumed; a path -> that
        checkpoint. Verified once, by all ranks together; restores the engine, the RNG state (same world size) and
        the prompt source."""
        setting = self.cfg.run.resume
        if setting == "none":
            return 0
        if setting != "auto":
            path = Path(setting)
            verify_checkpoint(path, self.dist)
            return self._resume_from(path, source)
        problems: list[str] = []
        for path in valid_checkpoints(self.ckpt_root, self.dist, problems):  # each verified (collective)
            try:
                return self._resume_from(path, source)
            except CheckpointError as err:  # the same error on every rank: all try the previous one together
                if self.dist.is_main:
                    log.warning("skipping checkpoint for resume: %s", err)
                problems.append(str(err))
        if problems:
            raise CheckpointError(no_valid_checkpoint(self.ckpt_root, problems))
        log.info("run.resume=auto: no checkpoint under %s, starting fresh", self.ckpt_root)
        return 0

    def _resume_from(self, path: Path, source) -> int:
        """Resume from verified checkpoint `path` (its state.json's step equals its directory's: verification)."""
        state = json.loads((path / STATE).read_text())
        saved_model = state.get("config", {}).get("model")
        if saved_model is not None and saved_model != self.cfg.to_dict()["model"]:
            raise CheckpointError(f"checkpoint {path} was written for a different `model` section: {saved_model}")
        step, steps = int(state["step"]), self.cfg.train.steps
        if step > steps:
            raise ConfigError(f"config key 'train.steps' is {steps}, but the checkpoint resumed ({path}) is at step "
                              f"{step}: there is nothing to train, and its later steps would be dropped from "
                              f"metrics.jsonl. Raise train.steps to at least {step}, or resume an earlier checkpoint")
        self._check_metrics()
        self._load_engine(path)  # verified above: not hashed again
        for part in self.parts:
            self.dist.on_every_rank(lambda part=part: part.load_from(path))
        self.engine.optimizer_steps = step * self.cfg.optimizer_steps_per_step  # the EMA rule's count (ema.py)
        if state.get("world_size", 1) == self.dist.world_size:  # the same decision on every rank
            self.dist.on_every_rank(lambda: self._restore_rng(path))
        else:  # every draw is seeded per step/row, so only unseeded global draws (none in training) differ
            log.warning("checkpoint %s: written by %s ranks, resuming on %d: global RNG state not restored",
                        path, state.get("world_size"), self.dist.world_size)
        source.load_state_dict(state["prompts"])
        log.info("resumed from %s at step %d", path, step)
        return step

    def _restore_rng(self, path: Path) -> None:
        rng = path / f"rng_rank{self.dist.rank:05d}.pt"
        if rng.is_file():
            restore_rng_state(load_torch(rng, allow=allowed_globals(rng.name)))  # weights-only (pickles.py)
        else:
            log.warning("checkpoint %s has no %s: this rank's global RNG state not restored", path, rng.name)

    def _check_metrics(self) -> None:
        """A resumed run keeps metrics.jsonl's rows before its step (rank 0 rewrites it when training starts):
        damage there fails every rank now, not rank 0 alone once the others wait in the first step's collective."""
        problem = None
        if self.dist.is_main and (self.out / METRICS).is_file():
            try:
                parse_metrics(self.out / METRICS, warn=False)  # a torn last line is the logger's, with its warning
            except MetricsFileError as err:
                problem = str(err)
        problem = self.dist.broadcast_object(problem)
        if problem:
            raise MetricsFileError(problem)

    # ------------------------------------------------------------------ export
    def _export_dir(self) -> Path:
        return self.out / ("lora" if self.cfg.model.lora.enabled else "transformer")

    def export(self, model, step: int | None = None) -> Path | None:
        """Weights in the backbone's own format beside the checkpoints: a diffusers LoRA directory
        (`pipe.load_lora_weights(dir)`) or a full `save_pretrained` transformer, the EMA weights when
        train.ema_decay > 0, floating tensors in run.export_dtype. Gathered from the shards (collective); written by
        rank 0 to a temp dir, then renamed over the previous export."""
        if not hasattr(model, "save_full"):
            return None
        lora = self.cfg.model.lora.enabled
        dtype = self.export_dtype
        with self.engine.ema_weights():
            state = self.engine.full_state_dict()  # gathered on rank 0 when sharded (collective)
            if not self.dist.is_main:
                self.exported_step = step
                return None
            _cast_floats_(state, getattr(torch, dtype))
            final = self._export_dir()
            tmp = self.out / (final.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            (model.save_lora if lora else model.save_full)(tmp, state=state)
            del state
        write_bytes(tmp / EXPORT_RECORD, json.dumps({"step": step, "dtype": dtype}).encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self.exported_step = step
        log.info("exported %s weights of step %s to %s", dtype, step, final)
        return final


def export_dtype(cfg) -> str:
    """run.export_dtype, with auto resolved: the dtype model.pretrained's transformer is stored in when that is
    bfloat16 (the published SD3.5 and FLUX weights), else float32 (read from the safetensors headers alone)."""
    if cfg.run.export_dtype != "auto":
        return cfg.run.export_dtype
    if cfg.model.kind == "dit" or not cfg.model.pretrained:
        return "float32"
    from ..models import pretrained_path, stored_dtype

    try:
        stored = stored_dtype(pretrained_path(cfg.model, allow_download=False) / "transformer")
    except Exception:  # noqa: BLE001 - not readable here (a hub id not cached): the safe full precision
        return "float32"
    return "bfloat16" if stored == torch.bfloat16 else "float32"


def no_valid_checkpoint(root: Path, problems: list[str]) -> str:
    """Why run.resume=auto refuses to start: every checkpoint under `root` and what is wrong with it. Starting over
    would rewrite metrics.jsonl and, in time, the checkpoints: the user decides that, not a fallback."""
    listed = "\n".join(f"  - {p}" for p in problems)
    return (f"run.resume=auto: {len(problems)} checkpoint{'s' if len(problems) > 1 else ''} under {root}, none "
            f"valid:\n{listed}\nNothing was resumed or overwritten. To start over from step 0, set run.resume=none "
            "run.overwrite=true (this run directory's metrics.jsonl and checkpoints are then replaced) or move the "
            "checkpoints away.")


def _cast_floats_(state: dict, dtype: torch.dtype) -> None:
    """Floating tensors of `state` to `dtype`, entry by entry (each full-precision copy is freed as it goes: rank 0
    holds the whole gathered model on the host)."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            state[key] = value.to(dtype)
