"""CLIP-family rewards: clip_score, pickscore, hps, aesthetic.

All four embed images with a transformers `CLIPModel` loaded from a LOCAL directory (`local_files_only=True`):
nothing is downloaded at run time, so a missing or wrong path must fail when the reward is built, with a message
naming the directory and the files it lacks, not an hour into a run with a hub timeout.

Image preprocessing is done in torch on the float images we already have (no PIL round-trip, works on GPU):
shorter side resized to the model's image size (bicubic, antialiased), center crop, normalization with the
mean/std of the directory's preprocessor_config.json (CLIP's defaults when there is none). This mirrors
CLIPImageProcessor up to uint8 quantization, which the original pipelines apply and we skip.

    clip_score   scale * cos(image_embed, text_embed)                            any CLIPModel directory
    pickscore    logit_scale.exp() * cos(...)  [/ 26 with normalize=True]        PickScore_v1 (+ processor dir)
    hps          cos(...)                                                        HPSv2(.1) in transformers layout
    aesthetic    LAION improved-aesthetic-predictor MLP on the L2-normalized image embedding

`hps`: HPSv2 is distributed as an open_clip checkpoint (ViT-H-14); the user must first convert it to the
transformers CLIPModel layout (config.json + model.safetensors, plus tokenizer files) by mapping open_clip's
state-dict keys onto CLIPModel's and calling save_pretrained; this module does not read open_clip files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Reward, RewardOutput, register, resolve_device

__all__ = [
    "ClipBackbone",
    "ClipScore",
    "PickScore",
    "HPS",
    "Aesthetic",
    "AestheticMLP",
    "preprocess_images",
    "check_model_dir",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PICKSCORE_NORM = 26.0  # Flow-GRPO's divisor: puts PickScore (~18-24 for typical images) near [0, 1]

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ------------------------------------------------------------------------------------------------ checks


def _missing_files(path: Path, *, weights: bool, tokenizer: bool) -> list[str]:
    missing = []
    if weights:
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any((path / f).is_file() for f in _WEIGHT_FILES):
            missing.append("model.safetensors (or pytorch_model.bin)")
    if tokenizer:
        if not ((path / "tokenizer.json").is_file() or ((path / "vocab.json").is_file() and (path / "merges.txt").is_file())):
            missing.append("tokenizer.json (or vocab.json + merges.txt)")
    return missing


def check_model_dir(reward: str, path: str | Path | None, *, weights: bool = True, tokenizer: bool = False) -> Path:
    """Return `path` as a Path, or raise FileNotFoundError naming the reward, the directory and what is missing."""
    if path is None or str(path) == "":
        raise ValueError(f"{reward}: no model directory given (set the reward's path option to a local directory)")
    p = Path(path).expanduser()
    missing = _missing_files(p, weights=weights, tokenizer=tokenizer)
    if not p.is_dir():
        expected = " / ".join(missing) or "the model files"
        raise FileNotFoundError(f"{reward}: {p} is not a directory (expected one with {expected})")
    if missing:
        present = sorted(f.name for f in p.iterdir())[:20]
        raise FileNotFoundError(f"{reward}: {p} has no {' / '.join(missing)} (it contains: {present})")
    return p


def resolve_dtype(reward: str, dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"{reward}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def read_norm_stats(path: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) from path/preprocessor_config.json, CLIP's defaults if the file or the keys are absent."""
    cfg_file = path / "preprocessor_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    return tuple(cfg.get("image_mean", CLIP_MEAN)), tuple(cfg.get("image_std", CLIP_STD))


# ------------------------------------------------------------------------------------------------ preprocessing


def preprocess_images(
    images: torch.Tensor, size: int, mean: Sequence[float] = CLIP_MEAN, std: Sequence[float] = CLIP_STD
) -> torch.Tensor:
    """[B, 3, H, W] in [0, 1] -> [B, 3, size, size] float32, CLIP-normalized (NaN -> 0, values clipped)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [B, 3, H, W], got shape {tuple(images.shape)}")
    x = images.float().nan_to_num(0.0).clamp(0, 1)
    h, w = x.shape[-2:]
    scale = size / min(h, w)
    new = (max(size, round(h * scale)), max(size, round(w * scale)))
    if new != (h, w):
        x = F.interpolate(x, size=new, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    top, left = (new[0] - size) // 2, (new[1] - size) // 2
    x = x[..., top : top + size, left : left + size]
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - m) / s


def _pooled(out) -> torch.Tensor:
    """get_*_features returns a tensor (transformers 4) or an output object whose pooler_output is the projected
    embedding (transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


# ------------------------------------------------------------------------------------------------ backbone


class ClipBackbone:
    """A CLIPModel (+ tokenizer) from local directories, embedding images and prompts in batches.

    `processor_path` holds the tokenizer and preprocessor_config.json (PickScore keeps them in a separate
    directory from the model); it defaults to `path`. `tokenizer=False` skips the tokenizer (image-only rewards).
    """

    def __init__(
        self,
        reward: str,
        path: str | Path,
        *,
        processor_path: str | Path | None = None,
        tokenizer: bool = True,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{reward}: batch_size must be a positive int, got {batch_size!r}")
        self.path = check_model_dir(reward, path, weights=True)
        proc = processor_path if processor_path not in (None, "") else path
        self.processor_path = check_model_dir(reward, proc, weights=False, tokenizer=tokenizer)
        self.device, self.dtype, self.batch_size = resolve_device(device), resolve_dtype(reward, dtype), batch_size

        from transformers import AutoTokenizer, CLIPModel  # heavy: imported only when a CLIP reward is built

        model = CLIPModel.from_pretrained(str(self.path), local_files_only=True)
        self.model = model.eval().requires_grad_(False).to(device=self.device, dtype=self.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.processor_path), local_files_only=True) if tokenizer else None
        cfg = self.model.config
        self.image_size = int(cfg.vision_config.image_size)
        self.embed_dim = int(cfg.projection_dim)
        self.max_length = min(int(getattr(self.tokenizer, "model_max_length", 77) or 77), int(cfg.text_config.max_position_embeddings))
        self.mean, self.std = read_norm_stats(self.processor_path)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """Float [B, 3, H, W] in [0, 1] -> the model's pixel_values (float32, on the CPU/input device)."""
        return preprocess_images(images, self.image_size, self.mean, self.std)

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """Projected image embeddings, float32 [B, D] on the CPU (not normalized)."""
        out = [
            _pooled(self.model.get_image_features(pixel_values=self.preprocess(c.to(self.device)).to(self.dtype))).float().cpu()
            for c in images.split(self.batch_size)
        ]
        return torch.cat(out) if out else torch.zeros(0, self.embed_dim)

    @torch.no_grad()
    def text_embeds(self, prompts: Sequence[str]) -> torch.Tensor:
        """Projected text embeddings, float32 [B, D] on the CPU (not normalized); long prompts are truncated."""
        out = []
        for i in range(0, len(prompts), self.batch_size):
            tok = self.tokenizer(
                list(prompts[i : i + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            feats = self.model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
            out.append(_pooled(feats).float().cpu())
        return torch.cat(out) if out else torch.zeros(0, self.embed_dim)

    def cosine(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Per-pair cos(image_i, prompt_i), float32 [B]."""
        if images.shape[0] != len(prompts):
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        return F.cosine_similarity(self.image_embeds(images), self.text_embeds(prompts), dim=-1)

    def logit_scale(self) -> float:
        return float(self.model.logit_scale.detach().float().exp())


# ------------------------------------------------------------------------------------------------ text-image rewards


class _ClipTextImage(Reward):
    """Shared __call__: score = self.transform(cosine), float32 [B]; info has the mean raw cosine."""

    def __init__(self, backbone: ClipBackbone):
        self.backbone = backbone

    def transform(self, cos: torch.Tensor) -> torch.Tensor:  # pragma: no cover - overridden
        return cos

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """CLIP image embeddings (eval diversity's feature space)."""
        return self.backbone.image_embeds(images)

    def torch_modules(self) -> list[nn.Module]:
        """The modules this reward scores with (what `rewards.sharded.shard_reward` shards)."""
        return [self.backbone.model]

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        cos = self.backbone.cosine(images, prompts)
        scores = self.transform(cos).float()
        return RewardOutput(scores=scores, info={f"{self.name}_cos_mean": float(cos.mean()) if cos.numel() else 0.0})


@register("clip_score")
class ClipScore(_ClipTextImage):
    """Score = scale * cos(CLIP image embedding, CLIP text embedding) for any CLIPModel directory `path`.

    `scale` (default 1.0) only rescales, e.g. 100 for the "CLIPScore"-paper convention or 2.5 for its w=2.5.
    """

    def __init__(self, *, path: str, scale: float = 1.0, device: str = "auto", dtype: str = "float32", batch_size: int = 16):
        super().__init__(ClipBackbone("clip_score", path, device=device, dtype=dtype, batch_size=batch_size))
        self.scale = float(scale)

    def transform(self, cos: torch.Tensor) -> torch.Tensor:
        return self.scale * cos


@register("pickscore")
class PickScore(_ClipTextImage):
    """PickScore (Kirstain et al., 2023): logit_scale.exp() * cos(image, text) with the PickScore_v1 CLIP-H model.

    `path`: the PickScore_v1 model directory (yuvalkirstain/PickScore_v1 layout); `processor_path`: the directory
    with its tokenizer / preprocessor_config.json (laion/CLIP-ViT-H-14-laion2B-s32B-b79K layout), default `path`.
    `normalize=True` (default) divides by 26 as Flow-GRPO does, so rewards sit near [0, 1] and the KL/clip
    coefficients tuned there carry over; set False for raw PickScore (~18-24), e.g. to compare with the paper.
    """

    def __init__(
        self,
        *,
        path: str,
        processor_path: str | None = None,
        normalize: bool = True,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ):
        super().__init__(
            ClipBackbone("pickscore", path, processor_path=processor_path, device=device, dtype=dtype, batch_size=batch_size)
        )
        self.normalize = bool(normalize)

    def transform(self, cos: torch.Tensor) -> torch.Tensor:
        s = self.backbone.logit_scale() * cos
        return s / PICKSCORE_NORM if self.normalize else s


@register("hps")
class HPS(_ClipTextImage):
    """HPSv2-style score: cos(image, text) of an HPS-finetuned CLIP (HPSv2 reports this raw cosine, ~0.2-0.35).

    `path` must be a transformers CLIPModel directory (config.json, model.safetensors, tokenizer files). The
    official HPSv2/HPSv2.1 release is an open_clip ViT-H-14 checkpoint: convert it to the transformers layout
    yourself first (map open_clip keys onto CLIPModel and save_pretrained, with the ViT-H-14 tokenizer and
    preprocessor_config.json); open_clip files are not read here, to keep open_clip out of the dependencies.
    `processor_path` (default `path`) may point to a separate tokenizer/preprocessor directory.
    """

    def __init__(
        self,
        *,
        path: str,
        processor_path: str | None = None,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ):
        super().__init__(ClipBackbone("hps", path, processor_path=processor_path, device=device, dtype=dtype, batch_size=batch_size))

    def transform(self, cos: torch.Tensor) -> torch.Tensor:
        return cos


# ------------------------------------------------------------------------------------------------ aesthetic


class AestheticMLP(nn.Module):
    """LAION improved-aesthetic-predictor head (sac+logos+ava1-l14-linearMSE). Dropouts are inert at inference but
    keep the `layers.{0,2,4,6,7}` indices of the released state dict."""

    def __init__(self, in_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_head_state(path: str | Path) -> dict[str, torch.Tensor]:
    """State dict from a .safetensors or a (weights-only) .pth/.pt/.bin file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"aesthetic: head file {p} does not exist (expected a .pth or .safetensors state dict)")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(p))
    state = torch.load(p, map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else state


@register("aesthetic")
class Aesthetic(Reward):
    """LAION aesthetic score (~1-10): MLP head on the L2-normalized CLIP ViT-L/14 image embedding, as DDPO and
    Flow-GRPO use. The prompt is ignored.

    `clip_path`: CLIPModel directory (openai/clip-vit-large-patch14 layout); `head_path`: the head's state dict
    (.pth or .safetensors). The head's input width is the CLIP projection dim (768 for ViT-L/14), so a head and a
    CLIP that do not belong together fail at construction with both widths named.
    """

    def __init__(
        self,
        *,
        clip_path: str,
        head_path: str,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ):
        self.backbone = ClipBackbone("aesthetic", clip_path, tokenizer=False, device=device, dtype=dtype, batch_size=batch_size)
        state = load_head_state(head_path)
        head = AestheticMLP(self.backbone.embed_dim)
        w0 = state.get("layers.0.weight")
        if w0 is not None and w0.shape[1] != self.backbone.embed_dim:
            raise ValueError(
                f"aesthetic: head {head_path} expects {w0.shape[1]}-d embeddings but the CLIP at {clip_path} "
                f"projects to {self.backbone.embed_dim}"
            )
        try:
            head.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"aesthetic: {head_path} is not an improved-aesthetic-predictor head state dict: {e}") from e
        self.head = head.eval().requires_grad_(False).to(self.backbone.device)  # float32: tiny, keeps scores exact

    def torch_modules(self) -> list[nn.Module]:
        """The CLIP model, for `rewards.sharded.shard_reward`; the ~1M-parameter head stays replicated."""
        return [self.backbone.model]

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """CLIP image embeddings (eval diversity's feature space)."""
        return self.backbone.image_embeds(images)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> RewardOutput:
        emb = self.backbone.image_embeds(images)
        emb = emb / emb.norm(dim=-1, keepdim=True)
        scores = self.head(emb.to(self.backbone.device)).squeeze(-1).float().cpu()
        return RewardOutput(scores=scores, info={"aesthetic_mean": float(scores.mean()) if scores.numel() else 0.0})
