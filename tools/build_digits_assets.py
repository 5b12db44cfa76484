#!/usr/bin/env python
"""Build the digits task's assets, deterministically, on CPU: a digit classifier (the reward) and a deliberately
under-trained prompt-conditioned DiT generator (the policy GRPO starts from).

    python -m tools.build_digits_assets                      # writes jagg_scale/assets/digits/ (a few minutes)
    python -m tools.build_digits_assets --out /tmp/digits    # elsewhere

Steps (all seeded; torch runs on a fixed number of threads, since CPU reductions may depend on it):

1. data      scikit-learn's bundled 8x8 digits, stratified 80/20 split (seed DIGITS_SPLIT_SEED), upscaled to
             16x16 in [-1, 1] (`jagg_scale.data.digits.load_digits_split`).
2. prompts   TRAIN templates (used to train the generator) and HELD-OUT templates (never seen by it) for the 10
             digits -> prompts_train.jsonl / prompts_heldout.jsonl. The build fails if two distinct words of any
             template collide under the DiT's HashTokenizer.
3. classifier  `DigitClassifier` trained with shift / contrast / noise augmentation; must reach >= 97% on held-out.
4. generator   the built-in DiT (1 channel, 16x16, patch 2) trained by rectified flow matching on the train split,
             prompts from the TRAIN templates, 10% dropped to "" (for CFG). It is evaluated every EVAL_EVERY steps
             by the held-out reward (mean digit_match of ODE samples, 16 steps, shift 3, fixed noise, HELD-OUT
             prompts), with the float16-rounded weights that get saved. Stopping rule: stop at the first
             evaluation with reward >= STOP_AT; of all evaluated snapshots with reward in [BAND_LO, BAND_HI], keep
             the one closest to AIM (earliest on ties). The generator is thus deliberately NOT converged.
5. report    the train-prompt SDE reward (what GRPO rollouts see) must stay below SDE_MAX; CARD.md with the
             numbers and the sha256 of every output file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import platform
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from jagg_scale.data.digits import (
    DIGIT_WORDS,
    DIGITS_SPLIT_SEED,
    HELDOUT_TEMPLATES,
    TRAIN_TEMPLATES,
    format_prompt,
    load_digits_split,
    prompt_records,
)
from jagg_scale.grpo.rollout import sample_ode, sample_sde
from jagg_scale.grpo.schedule import sigma_schedule
from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.models.dit import HashTokenizer
from jagg_scale.rewards.digits import DigitClassifier

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "jagg_scale" / "assets" / "digits"

# ------------------------------------------------------------------------------------------------ settings
THREADS = 2
CLS_SEED = 1
CLS_EPOCHS = 30
CLS_BATCH = 64
CLS_LR = 2e-3
CLS_MIN_ACC = 0.97

GEN_SEED = 2
GEN_CONFIG = DiTConfig(
    image_size=16, in_channels=1, patch_size=2, hidden_size=128, depth=4, num_heads=4, mlp_ratio=4.0,
    vocab_size=1024, max_prompt_length=16,
)
GEN_BATCH = 128
GEN_LR = 1e-3
GEN_WARMUP = 20
GEN_WEIGHT_DECAY = 0.0
GEN_GRAD_CLIP = 1.0
GEN_MAX_STEPS = 3000
PROMPT_DROPOUT = 0.1

EVAL_EVERY = 25
EVAL_STEPS = 16
EVAL_SHIFT = 3.0
EVAL_IMAGES_PER_PROMPT = 4
EVAL_SEED = 1234
SDE_NOISE_LEVEL = 0.7
SDE_IMAGES_PER_PROMPT = 2
SDE_SEED = 4321

STOP_AT = 0.5
AIM = 0.5
BAND_LO, BAND_HI = 0.3, 0.8
SDE_MAX = 0.9


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ prompts


def template_words() -> set[str]:
    words: set[str] = set()
    for t in TRAIN_TEMPLATES + HELDOUT_TEMPLATES:
        for d in range(10):
            words |= set(re.findall(r"[a-z0-9]+", format_prompt(t, d).lower()))
    return words


def check_no_collisions(config: DiTConfig) -> int:
    """Fail if two distinct template words hash to the same id; returns the number of distinct words."""
    tok = HashTokenizer(config.vocab_size, config.max_prompt_length)
    by_id: dict[int, str] = {}
    for w in sorted(template_words()):
        i = tok.word_id(w)
        if i in by_id:
            raise SystemExit(f"tokenizer collision at vocab_size={config.vocab_size}: {by_id[i]!r} and {w!r} -> id {i}")
        by_id[i] = w
    longest = max(len(re.findall(r"[a-z0-9]+", format_prompt(t, 0))) for t in TRAIN_TEMPLATES + HELDOUT_TEMPLATES)
    if longest > config.max_prompt_length:
        raise SystemExit(f"a template has {longest} words > max_prompt_length {config.max_prompt_length}")
    if set(TRAIN_TEMPLATES) & set(HELDOUT_TEMPLATES):
        raise SystemExit("train and held-out templates overlap")
    return len(by_id)


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


# ------------------------------------------------------------------------------------------------ classifier


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x [N, 1, 16, 16] in [-1, 1]: random shift of up to 2 px, contrast/offset jitter, gaussian noise; clamped."""
    n = x.shape[0]
    pad = F.pad(x, (2, 2, 2, 2), value=-1.0)
    dx = torch.randint(0, 5, (n,), generator=g)
    dy = torch.randint(0, 5, (n,), generator=g)
    rows = (dy[:, None] + torch.arange(16)[None])[:, :, None].expand(n, 16, 16)
    cols = (dx[:, None] + torch.arange(16)[None])[:, None, :].expand(n, 16, 16)
    out = pad[torch.arange(n)[:, None, None], 0, rows, cols].unsqueeze(1)
    a = 0.8 + 0.3 * torch.rand(n, 1, 1, 1, generator=g)
    b = 0.2 * torch.rand(n, 1, 1, 1, generator=g) - 0.1
    out = (out + 1) * a - 1 + b
    std = 0.3 * torch.rand(n, 1, 1, 1, generator=g)
    out = out + std * torch.randn(out.shape, generator=g)
    return out.clamp(-1, 1)


@torch.no_grad()
def classifier_accuracy(model: DigitClassifier, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model.forward_normalized(x).argmax(1) == y).float().mean())


def train_classifier(train_x, train_y, heldout_x, heldout_y) -> tuple[DigitClassifier, dict]:
    torch.manual_seed(CLS_SEED)
    g = torch.Generator().manual_seed(CLS_SEED)
    model = DigitClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=CLS_LR)
    n = train_x.shape[0]
    steps_per_epoch = math.ceil(n / CLS_BATCH)
    total = CLS_EPOCHS * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))
    t0 = time.time()
    for epoch in range(CLS_EPOCHS):
        model.train()
        perm = torch.randperm(n, generator=g)
        for i in range(steps_per_epoch):
            idx = perm[i * CLS_BATCH : (i + 1) * CLS_BATCH]
            loss = F.cross_entropy(model.forward_normalized(augment(train_x[idx], g)), train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if (epoch + 1) % 5 == 0 or epoch + 1 == CLS_EPOCHS:
            log(f"classifier epoch {epoch + 1}/{CLS_EPOCHS}: loss {loss.item():.4f}, "
                f"held-out acc {classifier_accuracy(model, heldout_x, heldout_y):.4f}")
    model.eval().requires_grad_(False)
    acc = classifier_accuracy(model, heldout_x, heldout_y)
    train_acc = classifier_accuracy(model, train_x, train_y)
    g_eval = torch.Generator().manual_seed(CLS_SEED + 100)
    aug_acc = classifier_accuracy(model, augment(heldout_x, g_eval), heldout_y)
    stats = {"heldout_acc": acc, "train_acc": train_acc, "heldout_aug_acc": aug_acc, "steps": total,
             "seconds": time.time() - t0, "params": sum(p.numel() for p in model.parameters())}
    if acc < CLS_MIN_ACC:
        raise SystemExit(f"classifier held-out accuracy {acc:.4f} < {CLS_MIN_ACC}")
    return model, stats


# ------------------------------------------------------------------------------------------------ generator


def fp16_roundtrip(model: DiT) -> DiT:
    """A float32 copy of `model` whose weights are rounded through float16 (exactly what gets saved)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.half().float())
    return m.eval().requires_grad_(False)


@torch.no_grad()
def digit_match(classifier: DigitClassifier, model: DiT, latents: torch.Tensor, digits: torch.Tensor):
    """(mean prob of the target digit, accuracy) of decoded latents."""
    probs = torch.softmax(classifier(model.decode(latents)), dim=-1)
    p = probs.gather(1, digits[:, None]).squeeze(1)
    return float(p.mean()), float((probs.argmax(1) == digits).float().mean())


def eval_batch(records: list[dict], per_prompt: int) -> tuple[list[str], torch.Tensor]:
    prompts = [r["prompt"] for r in records for _ in range(per_prompt)]
    digits = torch.tensor([r["digit"] for r in records for _ in range(per_prompt)])
    return prompts, digits


@torch.no_grad()
def ode_reward(model: DiT, classifier: DigitClassifier, records: list[dict]) -> tuple[float, float]:
    prompts, digits = eval_batch(records, EVAL_IMAGES_PER_PROMPT)
    noise = torch.randn(len(prompts), *model.latent_shape, generator=torch.Generator().manual_seed(EVAL_SEED))
    x = sample_ode(model, model.encode_prompts(prompts), noise, sigma_schedule(EVAL_STEPS, shift=EVAL_SHIFT))
    return digit_match(classifier, model, x, digits)


@torch.no_grad()
def sde_reward(model: DiT, classifier: DigitClassifier, records: list[dict]) -> tuple[float, float]:
    prompts, digits = eval_batch(records, SDE_IMAGES_PER_PROMPT)
    g = torch.Generator().manual_seed(SDE_SEED)
    noise = torch.randn(len(prompts), *model.latent_shape, generator=g)
    traj = sample_sde(model, model.encode_prompts(prompts), noise, sigma_schedule(EVAL_STEPS, shift=EVAL_SHIFT),
                      noise_level=SDE_NOISE_LEVEL, generator=g)
    return digit_match(classifier, model, traj.final, digits)


def train_generator(train_x, train_y, classifier, heldout_records, max_steps: int) -> tuple[DiT, dict]:
    torch.manual_seed(GEN_SEED)
    g = torch.Generator().manual_seed(GEN_SEED)
    model = DiT(GEN_CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=GEN_LR, weight_decay=GEN_WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / GEN_WARMUP))
    # all train-template prompts, tokenized once: [10 digits, n_templates, L]
    tokens = torch.stack([model.encode_prompts([format_prompt(t, d) for t in TRAIN_TEMPLATES]) for d in range(10)])
    null = model.encode_prompts([""])[0]
    n = train_x.shape[0]
    history, snapshots = [], {}
    t0 = time.time()
    loss_ema = None
    step = 0
    while step < max_steps:
        model.train()
        idx = torch.randint(0, n, (GEN_BATCH,), generator=g)
        x0, y = train_x[idx], train_y[idx]
        sigma = torch.sigmoid(torch.randn(GEN_BATCH, generator=g))  # logit-normal(0, 1)
        e = torch.randn(x0.shape, generator=g)
        tmpl = torch.randint(0, len(TRAIN_TEMPLATES), (GEN_BATCH,), generator=g)
        drop = torch.rand(GEN_BATCH, generator=g) < PROMPT_DROPOUT
        cond = torch.where(drop[:, None], null[None], tokens[y, tmpl])
        s = sigma.view(-1, 1, 1, 1)
        xs = (1 - s) * x0 + s * e
        loss = F.mse_loss(model(xs, sigma, cond), e - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GEN_GRAD_CLIP)
        opt.step()
        sched.step()
        step += 1
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        if step % EVAL_EVERY == 0:
            m16 = fp16_roundtrip(model)
            r, acc = ode_reward(m16, classifier, heldout_records)
            history.append({"step": step, "loss_ema": round(loss_ema, 5), "heldout_ode_reward": round(r, 5),
                            "heldout_ode_acc": round(acc, 5), "seconds": round(time.time() - t0, 1)})
            log(f"generator step {step}: loss(ema) {loss_ema:.4f}, held-out ODE reward {r:.4f} (acc {acc:.3f}), "
                f"{time.time() - t0:.0f} s")
            if BAND_LO <= r <= BAND_HI:
                snapshots[step] = (r, {k: v.clone() for k, v in m16.state_dict().items()})
            if r >= STOP_AT:
                break
    if not snapshots:
        raise SystemExit(f"no evaluated snapshot had a held-out reward in [{BAND_LO}, {BAND_HI}] "
                         f"within {step} steps; history: {history}")
    best = min(snapshots, key=lambda k: (abs(snapshots[k][0] - AIM), k))
    final = DiT(GEN_CONFIG)
    final.load_state_dict(snapshots[best][1], strict=True)
    final.eval().requires_grad_(False)
    stats = {"chosen_step": best, "stopped_at": step, "seconds": time.time() - t0, "history": history,
             "params": final.num_params()}
    return final, stats


# ------------------------------------------------------------------------------------------------ main


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_card(out: Path, info: dict) -> None:
    c, g = info["classifier"], info["generator"]
    files = ["generator.safetensors", "generator.json", "classifier.safetensors", "prompts_train.jsonl",
             "prompts_heldout.jsonl"]
    cfg = dataclasses.asdict(GEN_CONFIG)
    hist = "\n".join(
        f"| {h['step']} | {h['loss_ema']:.4f} | {h['heldout_ode_reward']:.4f} | {h['heldout_ode_acc']:.3f} |"
        for h in g["history"]
    )
    text = f"""# Digits task assets

Built by `tools/build_digits_assets.py`; the CPU-sized task on which GRPO can show learning: a prompt-conditioned
DiT that draws 16x16 handwritten digits, deliberately trained only part of the way, and a CNN classifier whose
softmax probability of the prompted digit is the reward (`digit_match`, `jagg_scale/rewards/digits.py`).

## Build

```bash
{info["command"]}
```

Wall time {info["seconds"] / 60:.1f} min on {THREADS} CPU threads ({info["platform"]}, torch {torch.__version__}).
Every random choice is seeded and torch runs on a fixed thread count, so a rebuild on the same software and CPU
reproduces the weights bit for bit; other CPUs / torch versions may differ in the last float bits (and then,
through training, somewhat more), but not in kind. The wall time in this card is informational.

## Data

scikit-learn's bundled `load_digits()`: 1797 8x8 grayscale handwritten digits (values 0..16), a copy of the UCI
"Optical Recognition of Handwritten Digits" test set (Alpaydin & Kaynak, 1998; UCI ML Repository, CC BY 4.0),
distributed with scikit-learn (BSD-3-Clause). No download is involved.

- Split: stratified 80/20 by a seeded per-class permutation (`jagg_scale.data.digits.stratified_split`,
  seed {DIGITS_SPLIT_SEED}): {info["n_train"]} train / {info["n_heldout"]} held-out images.
- Images: `/16`, bilinear upscale to 16x16 (`align_corners=False`), mapped to [-1, 1].

## Prompts

Digit words: {", ".join(DIGIT_WORDS)}. `{{word}}` is the word, `{{d}}` the numeral.

| split | templates | file |
|---|---|---|
| train (generator training, GRPO) | {"; ".join(f"`{t}`" for t in TRAIN_TEMPLATES)} | \
`prompts_train.jsonl` ({len(TRAIN_TEMPLATES) * 10} prompts) |
| held-out (never seen by the generator) | {"; ".join(f"`{t}`" for t in HELDOUT_TEMPLATES)} | \
`prompts_heldout.jsonl` ({len(HELDOUT_TEMPLATES) * 10} prompts) |

One JSON object per line: `{{"prompt": ..., "digit": int}}`. The {info["n_words"]} distinct template words have
distinct ids under `HashTokenizer(vocab_size={GEN_CONFIG.vocab_size})` (checked by the build).

## Classifier (`classifier.safetensors`, float32)

`DigitClassifier`: grayscale (channel mean) -> 16x16 -> [-1, 1]; conv3x3 16 - conv3x3 32 - maxpool - conv3x3 64 -
maxpool - linear 1024->10 (ReLU), {c["params"]:,} parameters. Adam lr {CLS_LR} (cosine), batch {CLS_BATCH},
{CLS_EPOCHS} epochs ({c["steps"]} steps, {c["seconds"]:.0f} s), seed {CLS_SEED}; augmentation: shifts up to 2 px,
contrast x[0.8, 1.1] and offset [-0.1, 0.1], gaussian noise std U(0, 0.3).

- held-out accuracy: **{c["heldout_acc"]:.4f}** (train {c["train_acc"]:.4f}; held-out with augmentation \
{c["heldout_aug_acc"]:.4f})

## Generator (`generator.safetensors` float16, loaded into a float32 model; `generator.json` = `DiTConfig`)

`DiT(DiTConfig(**json.load(open("generator.json"))))`: {json.dumps(cfg)}; 64 tokens, {g["params"]:,} parameters.

Rectified flow matching on the train split: x_s = (1 - s) x0 + s e, target v = e - x0, s ~ logit-normal(0, 1);
prompts drawn uniformly from the image's TRAIN templates, {PROMPT_DROPOUT:.0%} dropped to "" (so CFG works).
AdamW lr {GEN_LR} ({GEN_WARMUP}-step warmup, then constant), weight decay {GEN_WEIGHT_DECAY}, betas (0.9, 0.999),
grad clip {GEN_GRAD_CLIP}, batch {GEN_BATCH}, seed {GEN_SEED}.

Deliberately NOT converged. Every {EVAL_EVERY} steps the float16-rounded weights are scored by the held-out reward:
mean `digit_match` of `sample_ode` images ({EVAL_STEPS} steps, `sigma_schedule({EVAL_STEPS}, shift={EVAL_SHIFT})`,
guidance 1.0, noise from `torch.Generator().manual_seed({EVAL_SEED})`) for the {len(HELDOUT_TEMPLATES) * 10}
held-out prompts x {EVAL_IMAGES_PER_PROMPT} images. Training stops at the first evaluation with reward >= {STOP_AT};
of the evaluated snapshots with reward in [{BAND_LO}, {BAND_HI}] the one closest to {AIM} is kept.

- trained {g["stopped_at"]} steps ({g["seconds"]:.0f} s); kept the snapshot at step **{g["chosen_step"]}**
- held-out reward (ODE, held-out prompts): **{g["heldout_ode_reward"]:.4f}** (classifier accuracy \
{g["heldout_ode_acc"]:.3f})
- train-prompt reward (SDE, as GRPO rollouts: `sample_sde`, {EVAL_STEPS} steps, shift {EVAL_SHIFT}, noise_level
  {SDE_NOISE_LEVEL}, {len(TRAIN_TEMPLATES) * 10} train prompts x {SDE_IMAGES_PER_PROMPT}, seed {SDE_SEED}):
  **{g["train_sde_reward"]:.4f}** (accuracy {g["train_sde_acc"]:.3f})
- train-prompt reward (ODE, same protocol as the held-out one): {g["train_ode_reward"]:.4f}

| step | loss (EMA) | held-out ODE reward | held-out ODE accuracy |
|---|---|---|---|
{hist}

## Files (sha256)

| file | bytes | sha256 |
|---|---|---|
""" + "".join(f"| `{f}` | {(out / f).stat().st_size:,} | `{sha256(out / f)}` |\n" for f in files)
    (out / "CARD.md").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: the packaged assets)")
    ap.add_argument("--max-steps", type=int, default=GEN_MAX_STEPS, help="generator step limit")
    args = ap.parse_args(argv)
    from safetensors.torch import save_file

    t_start = time.time()
    torch.set_num_threads(THREADS)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    log("loading digits")
    train_x, train_y, heldout_x, heldout_y = load_digits_split(DIGITS_SPLIT_SEED)
    log(f"split: {len(train_y)} train / {len(heldout_y)} held-out")

    n_words = check_no_collisions(GEN_CONFIG)
    train_records, heldout_records = prompt_records(TRAIN_TEMPLATES), prompt_records(HELDOUT_TEMPLATES)
    write_jsonl(out / "prompts_train.jsonl", train_records)
    write_jsonl(out / "prompts_heldout.jsonl", heldout_records)
    log(f"prompts: {len(train_records)} train / {len(heldout_records)} held-out, {n_words} distinct words")

    classifier, cls_stats = train_classifier(train_x, train_y, heldout_x, heldout_y)
    save_file({k: v.contiguous() for k, v in classifier.state_dict().items()}, str(out / "classifier.safetensors"))
    log(f"classifier: held-out accuracy {cls_stats['heldout_acc']:.4f}")

    gen, gen_stats = train_generator(train_x, train_y, classifier, heldout_records, args.max_steps)
    state = {k: v.half().contiguous() for k, v in gen.state_dict().items()}
    save_file(state, str(out / "generator.safetensors"))
    (out / "generator.json").write_text(json.dumps(dataclasses.asdict(GEN_CONFIG), indent=2) + "\n", encoding="utf-8")

    # report with the saved weights, reloaded as a user would
    from safetensors.torch import load_file

    reloaded = DiT(GEN_CONFIG)
    reloaded.load_state_dict({k: v.float() for k, v in load_file(str(out / "generator.safetensors")).items()},
                             strict=True)
    reloaded.eval().requires_grad_(False)
    gen_stats["heldout_ode_reward"], gen_stats["heldout_ode_acc"] = ode_reward(reloaded, classifier, heldout_records)
    gen_stats["train_ode_reward"], _ = ode_reward(reloaded, classifier, train_records)
    gen_stats["train_sde_reward"], gen_stats["train_sde_acc"] = sde_reward(reloaded, classifier, train_records)
    log(f"generator: step {gen_stats['chosen_step']}, held-out ODE reward {gen_stats['heldout_ode_reward']:.4f}, "
        f"train ODE {gen_stats['train_ode_reward']:.4f}, train SDE reward {gen_stats['train_sde_reward']:.4f}")
    if not BAND_LO <= gen_stats["heldout_ode_reward"] <= BAND_HI:
        raise SystemExit(f"held-out reward {gen_stats['heldout_ode_reward']:.4f} left [{BAND_LO}, {BAND_HI}]")
    if gen_stats["train_sde_reward"] >= SDE_MAX:
        raise SystemExit(f"train SDE reward {gen_stats['train_sde_reward']:.4f} >= {SDE_MAX}: no room for RL")

    try:
        out_arg = out.resolve().relative_to(ROOT)
    except ValueError:
        out_arg = out.resolve()
    command = "python -m tools.build_digits_assets" + ("" if out.resolve() == DEFAULT_OUT else f" --out {out_arg}")
    if args.max_steps != GEN_MAX_STEPS:
        command += f" --max-steps {args.max_steps}"
    info = {"classifier": cls_stats, "generator": gen_stats, "command": command, "seconds": time.time() - t_start,
            "platform": f"{platform.machine()}, Python {platform.python_version()}",
            "n_train": len(train_y), "n_heldout": len(heldout_y), "n_words": n_words}
    write_card(out, info)
    for f in out.iterdir():  # safetensors writes owner-only files; these ship with the package
        if f.is_file():
            f.chmod(0o644)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(f"done in {info['seconds']:.0f} s; {out}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
