"""Deterministic evaluation: ODE sampling from fixed noise on held-out prompts, reward statistics, an image grid.

The noise is drawn from `eval.seed` alone, so evaluations of different checkpoints (and of exact vs JAGG runs)
differ only by the weights: a reward difference is the model's, not the sampler's luck.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..cond import index_cond
from ..data import PromptSet, load_prompts
from ..grpo import model_schedule, sample_ode
from ..paths import resolve_path
from ..rewards import score_safely
from .config import Config


def eval_prompts(cfg: Config) -> PromptSet:
    e = cfg.eval
    return load_prompts(resolve_path(e.prompt_file)) if e.prompt_file else PromptSet.from_list(e.prompts)


def image_grid(images: torch.Tensor, ncols: int, min_size: int = 64) -> Image.Image:
    """[N, 3, H, W] in [0, 1] -> one PIL image, ncols per row; small images are upscaled (nearest) for viewing."""
    n, _, h, w = images.shape
    scale = max(1, min_size // max(h, w))
    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    arr = arr.repeat(scale, axis=1).repeat(scale, axis=2)
    nrows = (n + ncols - 1) // ncols
    h, w, pad = h * scale, w * scale, 2
    grid = np.full((nrows * (h + pad) + pad, ncols * (w + pad) + pad, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, ncols)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = arr[i]
    return Image.fromarray(grid)


@torch.no_grad()
def evaluate(model, velocity_fn, encode, reward, cfg: Config, prompts: PromptSet, out_dir: Path | None) -> dict:
    """Sample eval.num_per_prompt images per prompt with the ODE, score them, write eval.json and grid.png."""
    e = cfg.eval
    records = [r for r in prompts.records for _ in range(e.num_per_prompt)]
    texts = [r.prompt for r in records]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(e.seed)
    noise = torch.randn(len(records), *model.latent_shape, generator=gen)
    sigmas = model_schedule(model, cfg.sampling.eval_num_steps, cfg.sampling.shift).to(device)
    cond = encode(texts)
    was_training = model.training
    model.eval()
    finals = []
    for rows in torch.arange(len(records)).split(e.batch_size):
        finals.append(sample_ode(velocity_fn, index_cond(cond, rows.to(device)), noise[rows].to(device), sigmas))
    model.train(was_training)
    images = model.decode(torch.cat(finals))
    scores, valid, n_failed = score_safely(reward, images, texts, [r.metadata for r in records], max_fail_frac=1.0)
    ok = scores[valid]
    result = {
        "reward": getattr(reward, "name", type(reward).__name__),
        "reward_mean": float(ok.mean()) if len(ok) else float("nan"),
        "reward_std": float(ok.std(unbiased=False)) if len(ok) > 1 else 0.0,
        "num_images": len(records),
        "num_prompts": len(prompts),
        "num_failed": n_failed,
        "num_steps": cfg.sampling.eval_num_steps,
        "seed": e.seed,
        "per_prompt": [
            {"prompt": prompts.records[i].prompt,
             "scores": [float(s) for s in scores[i * e.num_per_prompt:(i + 1) * e.num_per_prompt]]}
            for i in range(len(prompts))
        ],
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        image_grid(images, ncols=e.num_per_prompt * max(1, 16 // e.num_per_prompt)).save(out_dir / "grid.png")
        (out_dir / "eval.json").write_text(json.dumps(result, indent=2))
    return result


def evaluate_checkpoint(cfg: Config, checkpoint: Path | None, out_dir: Path) -> dict:
    """`jagg-eval`: the model the config builds, with a verified checkpoint's trained weights (its EMA when
    train.ema_decay > 0) when given, evaluated on one process: model weights only, no engine, no optimizer."""
    from ..checkpoint import verify_checkpoint
    from ..models import build_model
    from ..parallel.dist import init_distributed
    from ..parallel.weights import load_trained_weights
    from ..rewards.multi import build_reward_mix
    from .policy import Policy

    prompts, reward = eval_prompts(cfg), build_reward_mix(cfg.reward)  # inputs first: fail before a model is built
    dist = init_distributed(cfg.run.device)
    try:
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model).to(dist.device)
        if checkpoint is not None:
            verify_checkpoint(checkpoint)
            load_trained_weights(model, checkpoint, ema=cfg.train.ema_decay > 0)
        policy = Policy(model, cfg, dist.device)
        return evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, prompts, out_dir)
    finally:
        dist.close()
