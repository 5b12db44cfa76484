"""The digits task's reward: a small CNN classifier's probability that an image shows the prompted digit.

    score_i = softmax(classifier(image_i))[target_i]          target from metadata["digit"], else the prompt

The classifier (`DigitClassifier`) was trained by `tools/build_digits_assets.py` on scikit-learn's 8x8 digits
(upscaled to 16x16) with shift/noise augmentation; its weights ship with the package in
`jagg_scale/assets/digits/classifier.safetensors` (see the CARD.md there). A sample whose target digit cannot be
determined (no metadata, no digit or digit word in the prompt, or several different ones) scores NaN, which
`score_safely` masks out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data.digits import DIGIT_WORDS
from .base import Reward, RewardOutput, register

__all__ = ["DigitClassifier", "DigitMatch", "DEFAULT_CLASSIFIER", "load_classifier", "target_digit"]

DEFAULT_CLASSIFIER = Path(__file__).resolve().parent.parent / "assets" / "digits" / "classifier.safetensors"

_WORD_TO_DIGIT = {w: i for i, w in enumerate(DIGIT_WORDS)} | {str(i): i for i in range(10)}
_TOKEN = re.compile(r"[a-z0-9]+")


class DigitClassifier(nn.Module):
    """Images [N, 3, H, W] (or [N, 1, H, W]) in [0, 1] -> logits [N, 10].

    Preprocessing inside the module: grayscale = channel mean, bilinear resize to 16x16 if needed, map to [-1, 1].
    Then conv3x3(16) - conv3x3(32) - pool - conv3x3(64) - pool - linear(1024 -> 10), ReLU between.
    """

    image_size = 16

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4x4
        )
        self.dropout = nn.Dropout(0.25)
        self.head = nn.Linear(64 * 4 * 4, 10)

    @classmethod
    def preprocess(cls, images: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] in [0, 1] -> [N, 1, 16, 16] in [-1, 1] (float32, NaN -> 0)."""
        if images.ndim != 4:
            raise ValueError(f"expected images [N, C, H, W], got shape {tuple(images.shape)}")
        x = images.float().nan_to_num(0.0).mean(dim=1, keepdim=True)
        if x.shape[-2:] != (cls.image_size, cls.image_size):
            x = F.interpolate(x, size=(cls.image_size, cls.image_size), mode="bilinear", align_corners=False,
                              antialias=x.shape[-1] > cls.image_size)
        return x.clamp(0, 1) * 2 - 1

    def forward_normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, 1, 16, 16] in [-1, 1] (the training data's format) -> logits [N, 10]."""
        return self.head(self.dropout(self.features(x).flatten(1)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_normalized(self.preprocess(images))


def load_classifier(path: str | Path | None = None, device: str | torch.device = "cpu") -> DigitClassifier:
    """A DigitClassifier with weights from `path` (default: the packaged one), in eval mode without grad."""
    path = Path(path) if path is not None else DEFAULT_CLASSIFIER
    if not path.is_file():
        raise FileNotFoundError(
            f"digit classifier weights not found: {path} "
            "(build them with `python -m tools.build_digits_assets`, or pass reward.options.classifier)"
        )
    from safetensors.torch import load_file

    model = DigitClassifier()
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    model.load_state_dict(state, strict=True)
    model.eval().requires_grad_(False)
    return model.to(device)


def target_digit(prompt: str, metadata: dict | None) -> int | None:
    """metadata["digit"] (an int 0..9 or such a string) if present, else the only digit / digit word in the prompt."""
    if metadata and "digit" in metadata and metadata["digit"] is not None:
        d = metadata["digit"]
        if isinstance(d, bool):
            return None
        if isinstance(d, str) and d.strip().lower() in _WORD_TO_DIGIT:
            return _WORD_TO_DIGIT[d.strip().lower()]
        try:
            d = int(d)
        except (TypeError, ValueError):
            return None
        return d if 0 <= d <= 9 else None
    found = {_WORD_TO_DIGIT[t] for t in _TOKEN.findall(str(prompt).lower()) if t in _WORD_TO_DIGIT}
    return found.pop() if len(found) == 1 else None


@register("digit_match")
class DigitMatch(Reward):
    """Score = the classifier's softmax probability of the prompt's digit; info: accuracy (argmax == target)."""

    def __init__(self, *, classifier: str | None = None):
        self.classifier_path = Path(classifier) if classifier is not None else DEFAULT_CLASSIFIER
        self.model = load_classifier(self.classifier_path)

    @torch.no_grad()
    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """The classifier's penultimate features (the 1024 inputs of its head) [B, 1024], on the CPU."""
        if next(self.model.parameters()).device != images.device:
            self.model.to(images.device)
        return self.model.features(self.model.preprocess(images)).flatten(1).float().cpu()

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        b = int(images.shape[0])
        if len(prompts) != b or len(metadata) != b:
            raise ValueError(f"batch mismatch: {b} images, {len(prompts)} prompts, {len(metadata)} metadata entries")
        targets = [target_digit(p, m) for p, m in zip(prompts, metadata)]
        if b == 0:
            return RewardOutput(scores=torch.zeros(0), info={"accuracy": 0.0, "digit_match_mean": 0.0})
        if next(self.model.parameters()).device != images.device:
            self.model.to(images.device)
        probs = torch.softmax(self.model(images).float(), dim=-1).cpu()  # [B, 10]
        known = torch.tensor([t is not None for t in targets])
        tgt = torch.tensor([t if t is not None else 0 for t in targets], dtype=torch.long)
        scores = probs.gather(1, tgt[:, None]).squeeze(1)
        scores = torch.where(known, scores, torch.full_like(scores, float("nan")))
        correct = (probs.argmax(dim=1) == tgt) & known
        n_known = int(known.sum())
        info = {
            "accuracy": float(correct.sum()) / n_known if n_known else float("nan"),
            "digit_match_mean": float(scores[known].mean()) if n_known else float("nan"),
        }
        return RewardOutput(scores=scores.to(torch.float32), info=info)
