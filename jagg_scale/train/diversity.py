"""Within-prompt diversity of evaluation samples: the mean pairwise distance between the images of one prompt.

GRPO sharpens a policy towards its best mode; pushed too far, the images of one prompt become nearly the same
image while the reward still rises (mode collapse). The reward mean cannot see that, so the evaluation reports

    diversity(prompt) = mean over pairs i < j of d(f_i, f_j)          its eval.num_per_prompt images
    diversity         = mean over prompts                             (None with one image per prompt)

in the feature space of the reward's own backbone where it has one (`Reward.image_features`: the digit classifier's
penultimate features, CLIP's image embedding), with the cosine distance 1 - cos(f_i, f_j): what the reward
model itself tells apart. A reward without a backbone (JPEG size, a remote scorer) falls back to pixels: the RMS
difference of the images average-pooled to at most 32x32, in [0, 1].

A number alone says little (it depends on the space), so it is read against the base model's: eval at step 0
is the base model, and `compare_to_base` adds `diversity_ratio` = diversity / the base's diversity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["FEATURES", "PIXELS", "compare_to_base", "diversity_features", "diversity_summary",
           "mean_pairwise_distance"]

FEATURES = "reward features (cosine distance)"
PIXELS = "pixels (RMS distance, pooled to <= 32x32)"
_POOL = 32


def diversity_features(reward, images: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(float32 [B, D] on the CPU, the space's name) for a batch of images [B, 3, H, W] in [0, 1]."""
    hook = getattr(reward, "image_features", None)  # test doubles and plain callables have none
    feats = hook(images) if callable(hook) else None
    if feats is not None:
        return feats.detach().float().cpu().reshape(len(images), -1), FEATURES
    x = images.detach().float().nan_to_num(0.0).clamp(0, 1)
    x = x.flatten(1, x.ndim - 3)  # a video's frames as channels: [B, 3 F, H, W]
    h, w = x.shape[-2:]
    x = F.adaptive_avg_pool2d(x, (min(h, _POOL), min(w, _POOL)))
    return x.cpu().reshape(len(images), -1), PIXELS


def mean_pairwise_distance(feats: torch.Tensor, space: str) -> float | None:
    """Mean distance over the pairs of rows of `feats` [K, D]; None when K < 2 (no pair)."""
    k = len(feats)
    if k < 2:
        return None
    f = feats.double()
    if space == FEATURES:
        f = F.normalize(f, dim=1)
        dist = (1.0 - f @ f.T).clamp(min=0.0)  # rounding can make a self-similar pair slightly negative
    else:
        dist = torch.cdist(f, f) / math.sqrt(f.shape[1])
    i, j = torch.triu_indices(k, k, offset=1)
    return float(dist[i, j].mean())


def compare_to_base(result: dict, base: dict | None) -> None:
    """Add the base model's reward and diversity beside `result`'s, and diversity_ratio = result / base (None when
    either diversity is missing or the base's is 0). The base must come from the same evaluation protocol."""
    if base is None:
        return
    result["base"] = {"reward_mean": base.get("reward_mean"), "diversity": base.get("diversity")}
    ours, theirs = result.get("diversity"), base.get("diversity")
    result["diversity_ratio"] = ours / theirs if ours is not None and theirs else None


def diversity_summary(last: dict) -> tuple[dict, str]:
    """(summary.json keys, the printed line) for a run's last evaluation: its diversity beside the base model's."""
    base = (last.get("base") or {}).get("diversity")
    ratio = last.get("diversity_ratio")
    keys = {"diversity_base": base, "diversity_after": last.get("diversity"), "diversity_ratio": ratio}
    fmt = lambda v: "-" if v is None else f"{v:.4f}"
    line = (f"  within-prompt diversity ({last.get('diversity_space')}): base {fmt(base)} -> "
            f"{fmt(last.get('diversity'))}, ratio {fmt(ratio)}")
    return keys, line
