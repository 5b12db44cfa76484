"""Deterministic evaluation: ODE sampling from fixed noise on held-out prompts, reward statistics, an image grid.

The noise is drawn from `eval.seed` alone, so evaluations of different checkpoints (and of exact vs JAGG runs)
differ only by the weights: a reward difference is the model's, not the sampler's luck.

At scale (thousands of held-out images, several ranks):

    split      image i of the N eval images (prompt-major, num_per_prompt each) belongs to rank i // S, S = ceil(N /
               world size): a contiguous share. Every rank runs ceil(S / eval.chunk_size) batches of the same sizes
               (a sharded model needs every rank in each forward, a sharded reward in each call): a rank short of S
               images pads its share with copies of the last image, sampled, decoded, scored and dropped
    bounded    per rank, eval.chunk_size images at a time are encoded, sampled, decoded and scored: memory does not
               grow with N (only the scores, a feature row per image and the first eval.grid_images images are kept)
    noise      image i starts from row i of torch.randn(N, *latent_shape) drawn from a generator seeded by
               eval.seed (the tensor this evaluation has always used), produced in chunks of about eval.chunk_size
               rows (`EvalNoise`): the same noise for image i whatever the rank or the world size, never the whole
               tensor at once
    sp groups  a sequence-parallel group samples the same images (its ranks split every forward's tokens); its
               ranks then split the decode, the reward and the features: image j of a batch is rank j % sp's
               (one copy of the work per group, not sp)
    gather     the scores are all-gathered (every rank returns the same result), each image's from the rank that
               scored it; the grid's images are streamed through the run directory, not gathered: each rank writes
               the ones it holds to grid_parts/, rank 0 reads them one file at a time and writes eval.json and
               grid.png (under NCCL a gather would move every video through rank 0's GPU)
    diversity  per image a feature row (the reward backbone's features, else pooled pixels: diversity.py) is kept
               and all-gathered like the scores; each prompt's diversity is the mean pairwise distance of its rows

The grid has one row per prompt, labelled with the prompt, its mean reward and its diversity (grid.py); eval.json
lists the rows' prompts under "grid". An edit set's rows are input | before | after: the prompt's input image, the
base model's edits (the step-0 evaluation's images, kept in its grid.safetensors) and this evaluation's. A video
model's rows show each video's frames left to right, and each prompt's first video is written as video_NNN.gif.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from safetensors.torch import save_file

from ..data import PromptSet
from ..data.images import load_rgb
from ..grpo import model_schedule, sample_ode
from ..rewards import score_safely
from .config import Config, ConfigError, load_prompt_file
from .diversity import compare_to_base, diversity_features, mean_pairwise_distance
from .grid import edit_rows, image_grid, to_uint8, video_frames_row, write_gifs

GRID_TENSORS = "grid.safetensors"  # the grid's images, uint8, beside grid.png

__all__ = ["EvalInterrupted", "EvalNoise", "eval_prompts", "eval_share", "evaluate", "evaluate_checkpoint",
           "image_grid", "load_eval", "load_grid"]


class EvalInterrupted(Exception):
    """`stop()` said so between two batches: `partial` holds this rank's batches so far (pass it back as `resume`
    to the same evaluation on the same world size to continue where it stopped)."""

    def __init__(self, partial: dict):
        super().__init__(f"evaluation interrupted after {partial['batches']} batch(es)")
        self.partial = partial


def eval_prompts(cfg: Config) -> PromptSet:
    e = cfg.eval
    return load_prompt_file("eval.prompt_file", e.prompt_file) if e.prompt_file else PromptSet.from_list(e.prompts)


class EvalNoise:
    """Row i of `torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))`, without that tensor.

    The rows are drawn in order, in chunks of about `chunk_rows`, from the one seeded generator, and only the
    current chunk is held. torch's CPU normal sampler fills a float tensor from consecutive uniforms in blocks of 16
    values (redrawing the last block when the size is not a multiple of 16; tensors under 16 values take another
    path), so consecutive draws whose sizes are multiples of 16 values, the last one taking the remainder (and at
    least 16 values), reproduce the single draw exactly (tests/train/test_eval_scale.py checks it). Whatever the
    chunking, the rows depend only on (seed, shape, n): never on the rank or the number of ranks.

    `rows(index)` takes global row indices in non-decreasing order over all calls (repeats allowed)."""

    def __init__(self, seed: int, shape: tuple[int, ...], n: int, chunk_rows: int):
        self.shape, self.n = tuple(shape), n
        numel = math.prod(self.shape)
        align = 16 // math.gcd(numel, 16)  # rows per multiple of 16 values
        chunk = max(align, -(-max(1, chunk_rows) // align) * align)
        bounds = list(range(0, n, chunk)) + [n]
        if len(bounds) > 2 and (bounds[-1] - bounds[-2]) * numel < 16:
            bounds.pop(-2)  # a remainder under 16 values joins the previous chunk
        self.bounds = bounds
        self.gen = torch.Generator().manual_seed(seed)
        self.chunk_index = -1
        self.chunk = torch.empty(0, *self.shape)
        self.start = 0

    def rows(self, index) -> torch.Tensor:
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        out = torch.empty(len(index), *self.shape)
        for k, i in enumerate(index.tolist()):
            if not 0 <= i < self.n:
                raise IndexError(f"eval noise row {i} out of range [0, {self.n})")
            if i < self.start:
                raise ValueError(f"eval noise row {i} requested after row {self.start}: rows must be non-decreasing")
            while i >= self.start + len(self.chunk):
                self.chunk_index += 1
                lo, hi = self.bounds[self.chunk_index], self.bounds[self.chunk_index + 1]
                self.chunk = torch.randn(hi - lo, *self.shape, generator=self.gen)
                self.start = lo
            out[k] = self.chunk[i - self.start]
        return out


def eval_share(n: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(image indices, real mask) of a rank's share: ceil(n / world_size) rows, the global images rank * S ... in
    order, padded at the end with copies of image n - 1 (mask False), so every rank has the same number of rows."""
    share = -(-n // world_size)
    index = torch.arange(rank * share, (rank + 1) * share)
    return index.clamp(max=n - 1), index < n


GRID_PARTS = "grid_parts"  # beside eval.json while an evaluation of several ranks collects its grid


def _grid_on_main(dist, out_dir: Path | None, index: list[torch.Tensor], images: list[torch.Tensor]
                  ) -> torch.Tensor | None:
    """The grid's images in image order on rank 0 (None elsewhere): each rank writes the ones it holds into
    out_dir/grid_parts (a shared run directory), rank 0 reads them one file at a time (safetensors: no code runs)
    and removes them. One process: its own, sorted."""
    from safetensors.torch import load_file

    held = (torch.cat(index), torch.cat(images)) if images else None
    if dist is None or not dist.active:
        return None if held is None else held[1][held[0].argsort()]
    parts = Path(out_dir) / GRID_PARTS
    if dist.is_main:
        parts.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if held is not None:
        save_file({"index": held[0].contiguous(), "images": held[1].contiguous()},
                  str(parts / f"rank_{dist.rank:05d}.safetensors"))
    dist.barrier()  # every part written
    if not dist.is_main:
        return None
    index, images = [], []
    for f in sorted(parts.glob("rank_*.safetensors")):
        part = load_file(str(f))
        index.append(part["index"])
        images.append(part["images"])
        f.unlink()
    parts.rmdir()
    return torch.cat(images)[torch.cat(index).argsort()] if images else None


@torch.no_grad()
def evaluate(model, velocity_fn, encode, reward, cfg: Config, prompts: PromptSet, out_dir: Path | None,
             dist=None, base: dict | None = None, stop=None, resume: dict | None = None,
             base_grid: torch.Tensor | None = None) -> dict:
    """Sample eval.num_per_prompt images per prompt with the ODE, score them, measure each prompt's diversity, write
    eval.json and grid.png.

    With a DistContext `dist` of several ranks each samples its share (module docstring); every rank must call this
    (the same number of forwards), every rank returns the same result, and rank 0 writes `out_dir` (given on every
    rank, or on none: the grid's images pass through it). `base`: the base model's result of the same protocol (the
    step-0 evaluation), reported beside this one with the diversity ratio.

    Preemption: `stop()`, called before every batch (on every rank: it must return the same everywhere, the trainer
    agrees on it across ranks), ends the evaluation with EvalInterrupted carrying this rank's batches so far;
    `resume` (that `partial`, of the same world size and images) skips them. The noise of image i is the same
    either way (EvalNoise), so an interrupted and resumed evaluation is the uninterrupted one."""
    e = cfg.eval
    active = dist is not None and dist.active
    # a sequence-parallel group evaluates the same images (parallel/sequence.py): shares by data rank
    sp = dist.sequence_parallel if active else 1
    rank, world = (dist.data_rank, dist.data_world) if active else (0, 1)
    part = dist.rank % sp if active else 0  # of a batch, this rank decodes and scores images j with j % sp == part
    records = [r for r in prompts.records for _ in range(e.num_per_prompt)]
    n = len(records)
    index, real = eval_share(n, rank, world)
    device = next(model.parameters()).device
    noise = EvalNoise(e.seed, model.latent_shape, n, e.chunk_size)
    sigmas = model_schedule(model, cfg.sampling.eval_num_steps, cfg.sampling.shift).to(device)
    grid_n = min(e.grid_images, n)
    scores, valid, feats, grid, grid_index = [], [], [], [], []
    space, done = None, 0
    kept = ("scores", "valid", "feats", "grid", "grid_index")
    if resume is not None:
        if (resume["world"], resume["images"]) != (world, n):
            raise ValueError(f"an evaluation of {resume['images']} images on {resume['world']} ranks resumes only "
                             f"there, not with {n} images on {world}")
        scores, valid, feats, grid, grid_index = (list(resume[k]) for k in kept)
        space, done = resume["space"], resume["batches"]
    was_training = model.training
    model.eval()
    try:
        for b, (rows, mine) in enumerate(zip(index.split(e.chunk_size), real.split(e.chunk_size))):
            if b < done:
                continue
            if stop is not None and stop():
                raise EvalInterrupted({"batches": b, "world": world, "images": n, "space": space,
                                       **dict(zip(kept, (scores, valid, feats, grid, grid_index)))})
            batch = [records[i] for i in rows.tolist()]
            texts = [r.prompt for r in batch]
            final = sample_ode(velocity_fn, encode(texts), noise.rows(rows).to(device), sigmas)
            own = torch.arange(len(rows)) % sp == part  # this rank's images of the batch (all, without sp)
            at = own.nonzero().flatten()
            s_b, v_b, f_b = torch.zeros(len(rows)), torch.zeros(len(rows), dtype=torch.bool), None
            if len(at):
                final = final[at.to(final.device)]
                images = model.decode(final)
                mine_batch = [batch[i] for i in at.tolist()]
                s, v, _ = score_safely(reward, images, [r.prompt for r in mine_batch],
                                       [r.metadata for r in mine_batch], max_fail_frac=1.0,
                                       latents=final if hasattr(reward, "needs_pixels") else None)  # a mix's latent
                s_b[at], v_b[at] = s.cpu().float(), v.cpu()
                f, space = diversity_features(reward, images)
                f_b = f.new_zeros(len(rows), *f.shape[1:])
                f_b[at] = f
                shown = (mine[at] & (rows[at] < grid_n)).nonzero().flatten()
                if len(shown):
                    grid.append(to_uint8(images[shown.to(images.device)]))
                    grid_index.append(rows[at][shown])
                del images
            scores.append(s_b)
            valid.append(v_b)
            feats.append(f_b)
            del final
    finally:
        model.train(was_training)
    width = next((f.shape[1:] for f in feats if f is not None), None)
    if sp > 1:  # a rank that scored none of a batch has no features of it to size its zeros by: the group's
        width = torch.Size(dist.all_gather_object(None if width is None else tuple(width))[rank * sp])
    feats = [torch.zeros(len(s_), *width) if f is None else f for f, s_ in zip(feats, scores)]
    scores_t, valid_t, feats_t = torch.cat(scores), torch.cat(valid), torch.cat(feats)
    if active:  # every rank's share; within a group each image from the rank that scored it (the others hold 0)
        def once(t: torch.Tensor) -> torch.Tensor:
            whole = dist.all_gather_tensor(t.to(dist.device)).cpu().view(world, sp, -1, *t.shape[1:])
            return (whole.any(1) if t.dtype == torch.bool else whole.sum(1)).flatten(0, 1)

        scores_t, valid_t, feats_t = once(scores_t), once(valid_t), once(feats_t)
    # rank-major shares: the gathered rows are the images in order
    scores_t, valid_t, feats_t = scores_t[:n], valid_t[:n], feats_t[:n]
    ok = scores_t[valid_t].double()  # float32 sums overflow for rewards on a 1e38 scale
    k = e.num_per_prompt
    per_prompt = [{"prompt": prompts.records[i].prompt,
                   "scores": [float(s) for s in scores_t[i * k:(i + 1) * k]],
                   "diversity": mean_pairwise_distance(feats_t[i * k:(i + 1) * k], space)}
                  for i in range(len(prompts))]
    diversities = [p["diversity"] for p in per_prompt if p["diversity"] is not None]
    result = {
        "reward": getattr(reward, "name", type(reward).__name__),
        "reward_mean": float(ok.mean()) if len(ok) else float("nan"),
        "reward_std": float(ok.std(unbiased=False)) if len(ok) > 1 else 0.0,
        "num_images": n,
        "num_prompts": len(prompts),
        "num_failed": int(n - int(valid_t.sum())),
        "num_steps": cfg.sampling.eval_num_steps,
        "seed": e.seed,
        "diversity": sum(diversities) / len(diversities) if diversities else None,
        "diversity_space": space,
        "per_prompt": per_prompt,
    }
    compare_to_base(result, base)
    if grid_n:  # grid.png's legend: row r shows the images of prompt r
        shown = per_prompt[:-(-grid_n // k)]
        result["grid"] = {"file": "grid.png", "images_per_row": k, "rows": [p["prompt"] for p in shown]}
        edits = [prompts.records[i].prompt for i in range(len(shown))]
        if not all(getattr(p, "image", None) is not None for p in edits):
            edits = None
        elif base_grid is not None and base_grid.shape[0] != grid_n:
            base_grid = None  # the base's grid showed other images: no "before" column
        if edits is not None:
            result["grid"]["columns"] = ["input", *(["before"] * k if base_grid is not None else []), *["after"] * k]
    shown_images = _grid_on_main(dist, out_dir, grid_index, grid) if grid_n and out_dir is not None else None
    if out_dir is not None and (not active or dist.is_main):
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if shown_images is not None:
            labels = [_row_label(p) for p in per_prompt]
            save_file({"images": shown_images.contiguous()}, str(out_dir / GRID_TENSORS))  # a later eval's "before"
            ncols = k
            if edits is not None:  # instruction editing: input | before (the base's edits) | after, per row
                size = shown_images.shape[-1]
                inputs = to_uint8(torch.stack([load_rgb(p.image, size) for p in edits]))
                shown_images, ncols = edit_rows(inputs, base_grid, shown_images, k)
            if shown_images.ndim == 5:  # videos: a GIF of each prompt's first, and the grid shows every frame
                result["grid"]["videos"] = write_gifs(shown_images[::k], out_dir, cfg.eval.video_fps)
                shown_images, ncols = video_frames_row(shown_images), k * shown_images.shape[2]
            image_grid(shown_images, ncols=ncols, labels=labels).save(out_dir / "grid.png")
        (out_dir / "eval.json").write_text(json.dumps(result, indent=2))
    return result


def _row_label(p: dict) -> str:
    """A grid row's label: the prompt, then its mean reward and diversity (grid.py wraps the prompt)."""
    mean = sum(p["scores"]) / len(p["scores"])
    diversity = "-" if p["diversity"] is None else f"{p['diversity']:.3f}"
    return f"{p['prompt']}\nreward {mean:.3f}\ndiversity {diversity}"


def load_grid(out_dir: Path) -> torch.Tensor | None:
    """The uint8 grid images [N, 3, H, W] a written evaluation kept (its GRID_TENSORS file), or None: the base
    model's edits, the "before" column of an editing run's later grids. Read with safetensors (no code runs)."""
    from safetensors.torch import load_file

    path = Path(out_dir) / GRID_TENSORS
    if not path.is_file():
        return None
    images = load_file(str(path)).get("images")
    return images if images is not None and images.dtype == torch.uint8 and images.ndim == 4 else None


def load_eval(out_dir: Path) -> dict | None:
    """A written evaluation's eval.json (None when there is none): e.g. the base model's, for a resumed run."""
    path = Path(out_dir) / "eval.json"
    return json.loads(path.read_text()) if path.is_file() else None


def evaluate_checkpoint(cfg: Config, checkpoint: Path | None, out_dir: Path) -> dict:
    """`jagg-eval`: the model the config builds, with a verified checkpoint's trained weights (its EMA when
    train.ema_decay > 0) when given: model weights only, no engine, no optimizer, the transformer in its published
    dtype (bf16 for SD3.5 / FLUX under model.dtype bfloat16). Under a launcher of N processes (torchrun, Slurm)
    every rank holds the whole model (read into it one rank at a time) and evaluates its share of the images; rank
    0 writes."""
    from ..checkpoint import verify_checkpoint
    from ..models import build_model
    from ..models.diffusers_common import ATTENTION_BACKENDS, set_attention_backend
    from ..parallel.dist import init_distributed
    from ..parallel.weights import load_trained_weights
    from ..rewards.multi import build_reward_mix
    from .policy import Policy

    prompts = eval_prompts(cfg)  # inputs first: fail before a model is built
    dist = init_distributed(cfg.run.device, timeout_s=cfg.parallel.collective_timeout_s)
    try:
        reward = build_reward_mix(cfg.reward)  # after the rank's device is set: a reward's "auto" is that device
        torch.manual_seed(cfg.run.seed)
        # no optimizer, no fp32 master: a transformer published in bf16 is held in bf16 under model.dtype bfloat16
        # (the forwards autocast to bf16 either way; FLUX: 23.8 GB a GPU, not 47.6)
        model = build_model(cfg.model, keep_stored_dtype=True).to(dist.device)
        if cfg.model.attention in ATTENTION_BACKENDS:
            try:
                set_attention_backend(model.transformer, cfg.model.attention, dist.device)
            except ValueError as err:
                raise ConfigError(str(err)) from err
        if checkpoint is not None:
            verify_checkpoint(checkpoint, dist)  # collective: each rank hashes its share, all fail alike
            # one rank at a time: each reads the trained weights whole (a full fine-tune's fp32 state: FLUX 47.6 GB
            # of host memory) and copies them into its model; all ranks of a node at once would hold N copies
            for turn in range(dist.world_size):  # a rank's error raised on every rank at its turn, none waits
                dist.on_every_rank(lambda turn=turn: load_trained_weights(
                    model, checkpoint, ema=cfg.train.ema_decay > 0) if turn == dist.rank else None)
        policy = Policy(model, cfg, dist.device)
        return evaluate(model, policy.velocity_fn(), policy.encode, reward, cfg, prompts, out_dir, dist)
    finally:
        dist.close()
