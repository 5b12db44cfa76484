"""Upper bounds of the config's size keys, checked first in `validate`, before any other check builds anything from
them (a window plan lists every sampling step; the trainer allocates rows x tokens x hidden): a value past them is a
ConfigError naming the key, not a MemoryError, an OverflowError or a step that never ends.

Two kinds of bound:

    documented maxima   MAXIMA: each key's largest value, well past any model or recipe this stack runs (the note
                        beside it says what the largest real one is); past it the value is a typo or an attack
    derived             what the values allocate together, under the stated memory of a node this stack targets
                        (HOST_BYTES: 8 x 80 GB GPUs with 2 TB of host memory; DEVICE_BYTES: one 80 GB GPU):
                        the built-in DiT's weights with their Adam state, its tokens a row (models/registry.py
                        MAX_TOKENS, as every family's check bounds a pipeline's) and activations a row (tokens x
                        hidden x depth), the step's rows (prompts x group), the rollout's stored latents

A diffusers pipeline's architecture is its directory's (model.pretrained): its shape rules are its family's check
(config.py _check_files); here only the keys the config sets are bounded (resolution, frames, prompt tokens).
"""

from __future__ import annotations

import math

from ..models.registry import MAX_TOKENS
from .config_sections import _require

__all__ = ["DEVICE_BYTES", "HOST_BYTES", "MAXIMA", "check_bounds"]

HOST_BYTES = 2 * 10**12  # a node's host memory (8 x 80 GB GPU nodes have 1-2 TB)
DEVICE_BYTES = 80 * 10**9  # one GPU's memory
WEEK_S = 7 * 24 * 3600

MAXIMA: dict[str, float] = {
    # the built-in DiT (model.kind dit): DiT-XL is 1152 wide, 28 deep, 16 heads at 256 px / 32 latent
    "model.dit.image_size": 4096,
    "model.dit.in_channels": 256,
    "model.dit.patch_size": 64,
    "model.dit.hidden_size": 16384,
    "model.dit.depth": 512,
    "model.dit.num_heads": 512,
    "model.dit.mlp_ratio": 64,
    "model.dit.vocab_size": 1_000_000,
    "model.dit.max_prompt_length": 8192,
    "model.lora.rank": 4096,  # peers train rank 32-64; a rank past the layer's width is refused when it is wrapped
    "model.resolution": 8192,  # pixels a side: FLUX and Qwen-Image train at 1024-1328
    "model.num_frames": 1025,  # Wan2.1 generates 81 frames; HunyuanVideo 129
    "model.max_sequence_length": 8192,  # T5's 512, Qwen's 1024 (each family also has its own prompt_limit)
    "sampling.num_steps": 1000,  # a flow-matching schedule's training timesteps; peers sample 10-50
    "sampling.eval_num_steps": 1000,
    "grpo.group_size": 1024,  # Flow-GRPO 24, DanceGRPO 12
    "grpo.inner_epochs": 64,  # peers 1
    "gcpo.chunk_size": 1000,
    "awm.num_train_timesteps": 1000,
    "jagg.rows_per_pass": 65536,
    "train.prompts_per_step": 65536,  # Flow-GRPO 48
    "train.minibatch_size": 1 << 20,
    "train.micro_batch_size": 1 << 20,
    "train.ema_repeat": 1000,  # EMA moves per update, each a pass over the weights (peers move once)
    "data.num_workers": 256,
    "eval.num_per_prompt": 1024,
    "eval.chunk_size": 65536,
    "eval.grid_images": 4096,
    "eval.video_fps": 240,
    "eval.seed": 2**32 - 1,  # numpy's seeds, as run.seed
    "run.threads": 4096,
    "parallel.collective_timeout_s": WEEK_S,  # timeouts: past a week a wait is a hang (Slurm jobs run <= days)
    "pools.timeout_s": WEEK_S,
    "parallel.sequence_parallel": 1024,
    "parallel.replicate": 65536,
    "pools.rollout_ranks": 65536,
    "pools.max_staleness": 64,  # steps the rollout pool runs ahead, a rollout held for each (peers run 1 ahead)
}

ROWS_MAX = 1 << 20  # rows a step: prompts_per_step x group_size (Flow-GRPO: 1,152)


def check_bounds(cfg) -> None:
    """A ConfigError naming the first key past its bound (module docstring)."""
    for key, most in MAXIMA.items():
        value = _get(cfg, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _require(value <= most, key, f"is {value:g}, over its maximum {most:g} (train/config_bounds.py MAXIMA)")
    g, t = cfg.grpo, cfg.train
    rows = t.prompts_per_step * g.group_size
    _require(rows <= ROWS_MAX, "train.prompts_per_step", f"x grpo.group_size = {rows:,} rows a step, over the "
             f"{ROWS_MAX:,} a step may hold (Flow-GRPO's is 1,152)")
    if cfg.model.kind == "dit":
        _check_dit(cfg, rows)


def _check_dit(cfg, rows: int) -> None:
    """The built-in DiT's sizes together: its weights with fp32 Adam state (4 copies) within the host, a row's
    activations (tokens x hidden x depth, float32) within a GPU, the rollout's stored latents within the host."""
    d, s = cfg.model.dit, cfg.sampling
    width = d.hidden_size * (4 + 2 * d.mlp_ratio)  # attention q, k, v, out + the MLP's two matrices, per unit width
    weights = 4 * 4 * (d.depth * d.hidden_size * width + d.vocab_size * d.hidden_size)
    _require(weights <= HOST_BYTES, "model.dit.hidden_size", f"with model.dit.depth {d.depth}: the DiT's weights and "
             f"Adam state take {weights / 1e9:,.0f} GB, over the {HOST_BYTES / 1e9:,.0f} GB of a node's host memory")
    tokens = math.ceil(d.image_size / max(d.patch_size, 1)) ** 2 + d.max_prompt_length
    _require(tokens <= MAX_TOKENS, "model.dit.image_size", f"{d.image_size} (patch {d.patch_size}) makes {tokens:,} "
             f"tokens a row with the prompt's, over the {MAX_TOKENS:,} a row may have (models/registry.py)")
    per_row = 4 * tokens * d.hidden_size * d.depth
    _require(per_row <= DEVICE_BYTES, "model.dit.image_size", f"{d.image_size} (patch {d.patch_size}, hidden "
             f"{d.hidden_size}, depth {d.depth}): one row's activations take {per_row / 1e9:,.0f} GB, over a GPU's "
             f"{DEVICE_BYTES / 1e9:,.0f} GB")
    stored = 4 * rows * (s.num_steps + 1) * d.in_channels * d.image_size ** 2
    _require(stored <= HOST_BYTES, "train.prompts_per_step", f"x grpo.group_size = {rows:,} rows of "
             f"{s.num_steps + 1} stored latents of {d.in_channels}x{d.image_size}x{d.image_size}: "
             f"{stored / 1e9:,.0f} GB, over the {HOST_BYTES / 1e9:,.0f} GB of a node's host memory")


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part, None)
    return node
