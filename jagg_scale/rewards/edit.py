"""Editing rewards: how well an output image carries out an instruction on its input image (FLUX.1-Kontext runs).

    clip_direction   CLIP directional similarity (StyleGAN-NADA's direction loss, InstructPix2Pix's metric):
                     cos(I(output) - I(input), T(output_caption) - T(input_caption)) with unit-normalised CLIP
                     embeddings I and T, when the record's metadata has `output_caption` (and `input_caption`,
                     default ""); else cos(I(output) - I(input), T(instruction)). Plus `preserve` x cos(I(output),
                     I(input)): weight > 0 rewards keeping what the instruction did not ask to change.

The input image is the prompt's (`data.EditPrompt.image`), read with the one bounded loader at the output's size.
Any reward can score the output itself beside it (reward.components), and the `remote` reward sends the input
image to a VLM judge. Runs offline from a local CLIPModel directory (or cached hub id), as clip_score does.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..data.images import load_rgb
from .base import Reward, RewardOutput, register
from .clip import ClipBackbone

__all__ = ["ClipDirection", "input_images"]


def input_images(prompts: Sequence[str], size: int, reward: str) -> torch.Tensor:
    """The edit prompts' input images as float [B, 3, size, size] in [0, 1]; a prompt without one is an error."""
    missing = [p for p in prompts if getattr(p, "image", None) is None]
    if missing:
        raise ValueError(f"{reward} scores edits: every prompt needs an input image (an edit set: a jsonl 'image' "
                         f"field or a shard's image member); {str(missing[0])!r} has none")
    return torch.stack([load_rgb(p.image, size) for p in prompts])


@register("clip_direction")
class ClipDirection(Reward):
    """CLIP directional similarity of an edit, plus `preserve` x the output's similarity to its input."""

    def __init__(self, *, path: str, processor_path: str | None = None, preserve: float = 0.0,
                 allow_download: bool = False, device: str = "auto", dtype: str = "float32", batch_size: int = 16):
        self.backbone = ClipBackbone("clip_direction", path, processor_path=processor_path,
                                     allow_download=allow_download, device=device, dtype=dtype, batch_size=batch_size)
        self.preserve = float(preserve)

    def torch_modules(self) -> list:
        return [self.backbone.model]

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone.image_embeds(images)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        b = self.backbone
        inputs = input_images(prompts, images.shape[-1], self.name)
        out_emb = F.normalize(b.image_embeds(images), dim=-1)
        in_emb = F.normalize(b.image_embeds(inputs), dim=-1)
        captions = [isinstance(m, dict) and isinstance(m.get("output_caption"), str) for m in metadata]
        after = [m["output_caption"] if c else str(p) for p, m, c in zip(prompts, metadata, captions)]
        text = F.normalize(b.text_embeds(after), dim=-1)
        if any(captions):  # the caption direction where the record has captions: T(after) - T(before)
            before = [str(m.get("input_caption", "")) if c else "" for m, c in zip(metadata, captions)]
            has = torch.tensor(captions).unsqueeze(1)
            text = torch.where(has, text - F.normalize(b.text_embeds(before), dim=-1), text)
        direction = F.cosine_similarity(out_emb - in_emb, text, dim=-1)
        kept = (out_emb * in_emb).sum(-1)
        scores = (direction + self.preserve * kept).float()
        return RewardOutput(scores=scores, info={"clip_direction_mean": float(direction.mean()),
                                                 "clip_direction_kept_mean": float(kept.mean())})
