"""The digits task's data: scikit-learn's bundled 8x8 handwritten digits, split and upscaled deterministically.

    images, labels = sklearn.datasets.load_digits()          1797 images, 8x8, values 0..16 (UCI optdigits)
    split          = per class, a seeded permutation; the first round(0.2 n_c) go to held-out, the rest to train
    x              = bilinear_upscale(images / 16, 16x16) * 2 - 1                        float32 [N, 1, 16, 16]

The split is computed here with torch's seeded generator (not sklearn's splitters), so it does not depend on the
installed scikit-learn version; sklearn is only needed for the bundled data and is imported lazily.
`tools/build_digits_assets.py` and the tests both call `load_digits_split(DIGITS_SPLIT_SEED)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "DIGITS_SPLIT_SEED",
    "HELDOUT_FRACTION",
    "IMAGE_SIZE",
    "DIGIT_WORDS",
    "TRAIN_TEMPLATES",
    "HELDOUT_TEMPLATES",
    "load_digits_raw",
    "stratified_split",
    "upscale_digits",
    "load_digits_split",
    "format_prompt",
    "prompt_records",
]

DIGITS_SPLIT_SEED = 20240531
HELDOUT_FRACTION = 0.2
IMAGE_SIZE = 16

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

#: templates used to train the generator ({word}: "seven", {d}: "7")
TRAIN_TEMPLATES = (
    "a handwritten digit {word}",
    "the number {d}",
    "a picture of the digit {d}",
    "handwritten {word}",
    "the numeral {word}",
)
#: templates never seen while training the generator (held-out evaluation)
HELDOUT_TEMPLATES = (
    "an image of the number {word}",
    "a drawing of a {d}",
)


def format_prompt(template: str, digit: int) -> str:
    return template.format(word=DIGIT_WORDS[digit], d=str(digit))


def prompt_records(templates: tuple[str, ...] | list[str]) -> list[dict]:
    """[{"prompt": ..., "digit": d}] for every template and digit, template-major."""
    return [{"prompt": format_prompt(t, d), "digit": d} for t in templates for d in range(10)]


def load_digits_raw() -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 [1797, 8, 8] with values 0..16, labels int64 [1797]) from scikit-learn's bundled copy."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the digits task needs scikit-learn (pip install -c constraints.txt scikit-learn)") from e
    d = load_digits()
    return torch.as_tensor(d.images, dtype=torch.float32), torch.as_tensor(d.target, dtype=torch.int64)


def stratified_split(labels: torch.Tensor, seed: int, heldout_fraction: float = HELDOUT_FRACTION):
    """(train_idx, heldout_idx), sorted int64 tensors: per class a seeded permutation, round(frac * n_c) held out."""
    g = torch.Generator().manual_seed(int(seed))
    train, heldout = [], []
    for c in sorted(set(labels.tolist())):
        idx = torch.nonzero(labels == c).flatten()
        perm = idx[torch.randperm(idx.numel(), generator=g)]
        k = int(round(heldout_fraction * idx.numel()))
        heldout.append(perm[:k])
        train.append(perm[k:])
    return torch.sort(torch.cat(train)).values, torch.sort(torch.cat(heldout)).values


def upscale_digits(images: torch.Tensor, size: int = IMAGE_SIZE) -> torch.Tensor:
    """[N, 8, 8] values 0..16 -> float32 [N, 1, size, size] in [-1, 1] (bilinear, align_corners=False)."""
    x = (images.float() / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return (x.clamp(0, 1) * 2 - 1).contiguous()


def load_digits_split(seed: int = DIGITS_SPLIT_SEED):
    """(train_x, train_y, heldout_x, heldout_y); x float32 [N, 1, 16, 16] in [-1, 1], y int64 [N]."""
    images, labels = load_digits_raw()
    tr, ho = stratified_split(labels, seed)
    x = upscale_digits(images)
    return x[tr], labels[tr], x[ho], labels[ho]
