"""`ocr`: how well an image renders the prompt's quoted text, read back by an OCR model (Flow-GRPO's OCR reward).

    rec    = all recognized text in reading order, concatenated, whitespace removed, lowercased
    target = metadata["text"] (what `read_ocr` stores), else the prompt's first "double-quoted" span, same cleanup
    score  = 1 - min(levenshtein(rec, target), len(target)) / len(target)        in [0, 1]

As in Flow-GRPO, a target found verbatim inside `rec` scores 1 (extra text elsewhere in the image is not
penalized); `substring_full_credit=False` turns that off and scores the plain edit distance. A sample without a
target scores NaN (masked by `score_safely`): giving it 0 would push the policy away from images that did
nothing wrong.

OCR engine: rapidocr-onnxruntime, which ships the PP-OCR (v4) detector/recognizer ONNX files inside the wheel,
so nothing is downloaded; it is imported when the reward is built, keeping `import jagg_scale.rewards` light.
The Levenshtein distance is a small DP here rather than another dependency.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import torch

from .base import Reward, RewardOutput, register
from .jpeg import to_uint8_hwc

__all__ = ["OcrReward", "levenshtein", "ocr_target", "normalize_text", "text_reward"]

_QUOTED = re.compile(r'"([^"]*)"')
_SPACE = re.compile(r"\s+")


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1); O(len(a) * len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def normalize_text(text: str) -> str:
    """Whitespace removed, lowercased: OCR spacing and case are too unreliable to reward or punish."""
    return _SPACE.sub("", text).lower()


def ocr_target(prompt: str, meta: dict | None) -> str | None:
    """The text the image should show: metadata["text"], else the prompt's first double-quoted span; None if
    neither gives a non-blank string."""
    text = (meta or {}).get("text")
    if text is None:
        m = _QUOTED.search(prompt)
        text = m.group(1) if m else None
    if text is None or not normalize_text(str(text)):
        return None
    return str(text)


def text_reward(recognized: str, target: str, substring_full_credit: bool = True) -> tuple[float, int]:
    """(score, edit distance) for one sample; both strings are normalized here. Distance 0 when the target is a
    substring of the recognized text and `substring_full_credit` is set."""
    rec, tgt = normalize_text(recognized), normalize_text(target)
    if not tgt:
        raise ValueError("empty target text")
    dist = 0 if (substring_full_credit and tgt in rec) else levenshtein(rec, tgt)
    return 1.0 - min(dist, len(tgt)) / len(tgt), dist


@register("ocr")
class OcrReward(Reward):
    """Score in [0, 1]: 1 - normalized edit distance between the OCR'd text and the target text (see module doc).

    Options: `min_confidence` drops recognized pieces scored at or below it (Flow-GRPO keeps any score > 0);
    `use_cls` runs the 180-degree text-direction classifier (off, as in Flow-GRPO); `num_threads` caps
    onnxruntime's threads (None = its default, all cores); `substring_full_credit` as in the module doc.
    Info: mean edit distance and mean recognized length over the scored samples.
    """

    def __init__(
        self,
        *,
        min_confidence: float = 0.0,
        use_cls: bool = False,
        num_threads: int | None = None,
        substring_full_credit: bool = True,
    ):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("ocr: needs rapidocr-onnxruntime (pip install 'jagg-scale[rewards]')") from e
        kwargs = {"print_verbose": False}
        if num_threads is not None:
            if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
                raise ValueError(f"ocr: num_threads must be a positive int or None, got {num_threads!r}")
            kwargs.update(intra_op_num_threads=num_threads, inter_op_num_threads=1)
        self.engine = RapidOCR(**kwargs)
        self.min_confidence = float(min_confidence)
        self.use_cls = bool(use_cls)
        self.substring_full_credit = bool(substring_full_credit)

    def recognize(self, image_hwc: np.ndarray) -> str:
        """All text in one uint8 RGB [H, W, 3] image, concatenated in the engine's reading order."""
        bgr = np.ascontiguousarray(image_hwc[..., ::-1])  # RapidOCR treats 3-channel arrays as OpenCV BGR
        result, _ = self.engine(bgr, use_cls=self.use_cls)
        if not result:
            return ""
        return "".join(text for _box, text, score in result if float(score) > self.min_confidence)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        if not images.shape[0] == len(prompts) == len(metadata):
            raise ValueError(f"ocr: {images.shape[0]} images, {len(prompts)} prompts, {len(metadata)} metadata entries")
        arrays = to_uint8_hwc(images)
        scores, dists, rec_lens = [], [], []
        for arr, prompt, meta in zip(arrays, prompts, metadata):
            target = ocr_target(prompt, meta)
            if target is None:
                scores.append(float("nan"))
                continue
            rec = self.recognize(arr)
            score, dist = text_reward(rec, target, self.substring_full_credit)
            scores.append(score)
            dists.append(dist)
            rec_lens.append(len(normalize_text(rec)))
        info: dict[str, float | list] = {"ocr_no_target": len(scores) - len(dists)}
        if dists:
            info["ocr_edit_distance_mean"] = float(np.mean(dists))
            info["ocr_rec_len_mean"] = float(np.mean(rec_lens))
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32), info=info)
