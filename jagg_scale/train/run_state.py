"""A run's state on disk: checkpoints (save, verify, resume) and the exported weights.

    out/checkpoints/step_XXXXXXXX/   engine state (weights, optimizer, EMA), per-rank RNG, prompt-source position,
                                     state.json; written collectively and atomically (checkpoint/local.py)
    out/lora | out/transformer       the weights in the backbone's own format (diffusers), rank 0

Every random draw of step t is seeded by (run.seed, t[, row]), so a run resumed at step t draws exactly what the
uninterrupted run drew; the RNG state is saved for the few unseeded global draws.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, capture_rng_state, find_resume_checkpoint, restore_rng_state
from ..checkpoint.local import STATE, save_checkpoint_dir, verify_checkpoint
from .config import Config

log = logging.getLogger(__name__)


class RunState:
    def __init__(self, cfg: Config, dist, engine, out: Path):
        self.cfg, self.dist, self.engine = cfg, dist, engine
        self.out = Path(out)
        self.ckpt_root = self.out / "checkpoints"

    def save(self, next_step: int, source) -> Path:
        """A complete checkpoint of the state before step `next_step` (collective)."""
        state = {"step": next_step, "prompts": source.state_dict(), "config": self.cfg.to_dict(),
                 "world_size": self.dist.world_size}

        def write(tmp: Path) -> None:
            self.engine.save(tmp)
            torch.save(capture_rng_state(), tmp / f"rng_rank{self.dist.rank:05d}.pt")

        return save_checkpoint_dir(self.ckpt_root, next_step, write=write, state=state,
                                   keep_last=self.cfg.run.keep_last, dist=self.dist)

    def export(self, model) -> Path | None:
        """Weights in the backbone's own format beside the checkpoints: a diffusers LoRA directory
        (`pipe.load_lora_weights(dir)`) or a full `save_pretrained` transformer, the EMA weights when
        train.ema_decay > 0. Gathered from the shards (collective); written by rank 0 to a temp dir, then renamed
        over the previous export."""
        if not hasattr(model, "save_full"):
            return None
        lora = self.cfg.model.lora.enabled
        with self.engine.ema_weights():
            state = self.engine.full_state_dict()  # gathered on rank 0 when sharded (collective)
            if not self.dist.is_main:
                return None
            final = self.out / ("lora" if lora else "transformer")
            tmp = self.out / (final.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            (model.save_lora if lora else model.save_full)(tmp, state=state)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def load(self, path: Path) -> None:
        """Engine state from a verified checkpoint directory (collective). Rank 0 verifies; its error, or any
        rank's loading error, is raised on every rank at once (no rank waits for one that failed)."""
        self.dist.on_main(lambda: verify_checkpoint(path))
        self.dist.on_every_rank(lambda: self.engine.load(Path(path)))

    def resume(self, source) -> int:
        """The step to start from: run.resume none -> 0; auto -> the newest complete checkpoint, if any; a path ->
        that checkpoint. Restores the engine, the RNG state (same world size) and the prompt source."""
        setting = self.cfg.run.resume
        if setting == "none":
            return 0
        def choose() -> str | None:  # one rank reads and hashes; the others follow its choice (or its error)
            path = find_resume_checkpoint(self.ckpt_root) if setting == "auto" else Path(setting)
            return str(path) if path is not None else None

        path = self.dist.on_main(choose)
        if path is None:
            log.info("run.resume=auto: no complete checkpoint under %s, starting fresh", self.ckpt_root)
            return 0
        path = Path(path)
        state = json.loads((path / STATE).read_text())
        saved_model = state.get("config", {}).get("model")
        if saved_model is not None and saved_model != self.cfg.to_dict()["model"]:
            raise CheckpointError(f"checkpoint {path} was written for a different `model` section: {saved_model}")
        self.load(path)
        rng = path / f"rng_rank{self.dist.rank:05d}.pt"
        if state.get("world_size", 1) == self.dist.world_size and rng.is_file():
            restore_rng_state(torch.load(rng, weights_only=False))
        else:  # every draw is seeded per step/row, so only unseeded global draws (none in training) differ
            log.warning("checkpoint %s: written by %s ranks, resuming on %d: global RNG state not restored",
                        path, state.get("world_size"), self.dist.world_size)
        source.load_state_dict(state["prompts"])
        log.info("resumed from %s at step %d", path, int(state["step"]))
        return int(state["step"])
