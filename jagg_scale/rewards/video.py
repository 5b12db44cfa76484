"""Video rewards: a video model (models/wan.py) decodes to frames [N, 3, F, H, W]; these score them offline.

    video_frames           any image reward on the frames, averaged per video: {reward: NAME, options: {...},
                           every: k (every k-th frame, the first always)}; a frame whose score failed is left out
                           of its video's mean, a video with no valid frame fails
    temporal_consistency   the mean CLIP cosine between adjacent frames' image embeddings (CLIPModel directory or
                           cached hub id, as clip_score): 1 for a still video, lower the more frames jump

The `remote` reward sends a video batch as `videos` (each video's frames as PNGs) to a judge behind jagg-reward-server
(VideoAlign-style), which gets them back as [N, 3, F, H, W]. Image rewards given a video fail at config validation
(train.config), naming video_frames.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .base import Reward, RewardOutput, build_reward, register
from .clip import ClipBackbone

__all__ = ["VIDEO_ONLY", "VIDEO_REWARDS", "TemporalConsistency", "VideoFrames", "frames_of"]

VIDEO_ONLY = ("video_frames", "temporal_consistency")  # rewards of videos alone
VIDEO_REWARDS = (*VIDEO_ONLY, "remote")  # what scores a video model's output (a remote judge takes either)


def frames_of(videos: torch.Tensor, name: str) -> torch.Tensor:
    """Videos [N, 3, F, H, W] -> frames [N, F, 3, H, W]; anything else is an error naming the reward."""
    if videos.ndim != 5 or videos.shape[1] != 3:
        raise ValueError(f"{name} scores videos [N, 3, F, H, W], got a tensor of shape {tuple(videos.shape)}")
    return videos.transpose(1, 2)


@register("video_frames")
class VideoFrames(Reward):
    """An image reward on a video's frames, averaged per video (module docstring)."""

    inputs = "videos"

    def __init__(self, *, reward: str, options: dict | None = None, every: int = 1):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"video_frames: every must be a positive int, got {every!r}")
        if reward in VIDEO_ONLY:
            raise ValueError(f"video_frames: its reward scores frames (an image reward), not {reward!r}")
        self.inner = build_reward(reward, **(options or {}))
        self.every = every

    def torch_modules(self) -> list:
        return getattr(self.inner, "torch_modules", lambda: [])()

    def image_features(self, videos: torch.Tensor):
        """The inner reward's features of each video's frames, averaged (eval diversity's space), or None."""
        frames = frames_of(videos, self.name)[:, ::self.every]
        n, f = frames.shape[:2]
        feats = self.inner.image_features(frames.flatten(0, 1))
        return None if feats is None else feats.view(n, f, -1).mean(dim=1)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        frames = frames_of(videos, self.name)[:, ::self.every]
        n, f = frames.shape[:2]
        out = self.inner(frames.flatten(0, 1), [p for p in prompts for _ in range(f)],
                         [m for m in metadata for _ in range(f)])  # raising fails the videos (score_safely)
        info = out.info if isinstance(out, RewardOutput) else {}
        scores = torch.as_tensor(out.scores if isinstance(out, RewardOutput) else out).float().reshape(n, f)
        valid = torch.isfinite(scores)  # a non-finite frame is left out of its video's mean
        kept = valid.sum(dim=1)
        mean = torch.where(valid, scores, 0).sum(dim=1) / kept.clamp(min=1)
        mean = torch.where(kept > 0, mean, torch.nan)  # no valid frame: the video's reward failed
        return RewardOutput(scores=mean, info={f"frames_{k}": v for k, v in (info or {}).items()})


@register("temporal_consistency")
class TemporalConsistency(Reward):
    """Mean cosine similarity of adjacent frames' CLIP image embeddings, per video."""

    inputs = "videos"

    def __init__(self, *, path: str, processor_path: str | None = None, allow_download: bool = False,
                 device: str = "auto", dtype: str = "float32", batch_size: int = 16):
        self.backbone = ClipBackbone("temporal_consistency", path, processor_path=processor_path, tokenizer=False,
                                     allow_download=allow_download, device=device, dtype=dtype, batch_size=batch_size)

    def torch_modules(self) -> list:
        return [self.backbone.model]

    def image_features(self, videos: torch.Tensor) -> torch.Tensor:
        frames = frames_of(videos, self.name)
        n, f = frames.shape[:2]
        return self.backbone.image_embeds(frames.flatten(0, 1)).view(n, f, -1).mean(dim=1)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        frames = frames_of(videos, self.name)
        n, f = frames.shape[:2]
        if f < 2:
            raise ValueError(f"temporal_consistency needs videos of >= 2 frames, got {f}")
        emb = F.normalize(self.backbone.image_embeds(frames.flatten(0, 1)), dim=-1).view(n, f, -1)
        scores = (emb[:, 1:] * emb[:, :-1]).sum(-1).mean(dim=1).float()
        return RewardOutput(scores=scores, info={"temporal_consistency_mean": float(scores.mean())})
