"""Within-prompt diversity of real handwritten digits, the yardstick beside the digits job's eval numbers.

    python -m tools.digits_diversity_reference [--groups 20] [--size 8] [--seed 0]

The digits eval reports diversity in the digit classifier's feature space (jagg_scale/train/diversity.py): the mean
pairwise cosine distance between the 8 images of one prompt. That space shrinks as images become recognisable, so a
model that draws the prompted digit every time cannot keep the base model's diversity, which counts wrong digits
too. This script measures what real data scores in the same space: groups of `size` scikit-learn digits (the data
the generator and the classifier were trained on, upscaled to 16x16 as they were) drawn from one class ("one
prompt"), and from all classes (a model that ignores its prompt), averaged over `groups` groups per class.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


from jagg_scale.rewards.digits import DigitMatch
from jagg_scale.train.diversity import FEATURES, mean_pairwise_distance


def real_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 3, 16, 16] in [0, 1], labels [N]) from scikit-learn's bundled 8x8 digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images / 16.0, dtype=torch.float32)[:, None]
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False).clamp(0, 1)
    return x.repeat(1, 3, 1, 1), torch.tensor(data.target)


def reference(groups: int = 20, size: int = 8, seed: int = 0) -> dict:
    images, labels = real_digit_images()
    feats = DigitMatch().image_features(images)
    gen = torch.Generator().manual_seed(seed)
    one_class, any_class = [], []
    for c in range(10):
        idx = torch.nonzero(labels == c).flatten()
        for _ in range(groups):
            one_class.append(mean_pairwise_distance(feats[idx[torch.randperm(len(idx), generator=gen)[:size]]],
                                                    FEATURES))
            any_class.append(mean_pairwise_distance(feats[torch.randperm(len(feats), generator=gen)[:size]],
                                                    FEATURES))
    return {"space": FEATURES, "group_size": size, "groups": len(one_class),
            "one_class": sum(one_class) / len(one_class), "any_class": sum(any_class) / len(any_class)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=20, help="groups per class")
    ap.add_argument("--size", type=int, default=8, help="images per group (the eval's num_per_prompt)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(reference(args.groups, args.size, args.seed), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
