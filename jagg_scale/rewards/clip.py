"""CLIP-family rewards: clip_score, pickscore, hps, aesthetic.

All four embed images with a transformers `CLIPModel`, from a local directory, a hub id in the local hub cache, or
an open_clip checkpoint file (HPS's; a LAION-trained, gelu ViT) converted on load (clip_checkpoints.py). Nothing is
downloaded at run time unless the reward's `allow_download: true`, so a missing or wrong path fails when the reward
is built, with a message naming the directory and the files it lacks (or the hub id, the cache and the command that
fetches it), not an hour into a run with a hub timeout.

Image preprocessing is done in torch on the float images we already have (no PIL round-trip, works on GPU):
shorter side resized to the model's image size (bicubic, antialiased), center crop, normalization with the
mean/std of the processor directory's preprocessor_config.json (CLIP's defaults when there is none). This mirrors
CLIPImageProcessor up to uint8 quantization, which the original pipelines apply and we skip.

    clip_score   scale * cos(image_embed, text_embed)                       any CLIPModel directory / open_clip file
    pickscore    logit_scale.exp() * cos(...)  [/ 26 with normalize=True]   yuvalkirstain/PickScore_v1 (+ processor)
    hps          cos(...)                                                   HPS_v2.1_compressed.pt (open_clip ViT-H-14)
    aesthetic    LAION aesthetic head on the L2-normalized image embedding  openai/clip-vit-large-patch14 + head file

The official files, as published (paths may be hub ids: ORG/NAME for a directory, ORG/NAME/FILE for a file):

    pickscore   path: yuvalkirstain/PickScore_v1 (a transformers CLIPModel), processor_path (default when `path`
                has no tokenizer): laion/CLIP-ViT-H-14-laion2B-s32B-b79K
    hps         path: HPS_v2.1_compressed.pt (an open_clip ViT-H-14 state dict; hub: xswu/HPSv2), processor_path
                default laion/CLIP-ViT-H-14-laion2B-s32B-b79K (HPS's tokenizer and preprocessing are ViT-H-14's)
    aesthetic   clip_path: openai/clip-vit-large-patch14, head_path: sa_0_4_vit_l_14_linear.pth (LAION-AI/
                aesthetic-predictor: one Linear(768, 1)) or the improved predictor's MLP (sac+logos+ava1-l14-linearMSE)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..hub import resolve_model_path
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
    "resolve_model",
    "aesthetic_head",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PICKSCORE_NORM = 26.0  # Flow-GRPO's divisor: puts PickScore (~18-24 for typical images) near [0, 1]
VIT_H14_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # PickScore's and HPS's tokenizer + preprocessing

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")  # a single file: an open_clip checkpoint
# the top-level files that make a cached hub snapshot a model / a tokenizer-and-preprocessor directory
_MODEL_MARKERS = ("config.json",)
_PROCESSOR_MARKERS = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "preprocessor_config.json")

# ------------------------------------------------------------------------------------------------ checks


def _missing_files(path: Path, *, weights: bool, tokenizer: bool) -> list[str]:
    missing = []
    if weights:
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any((path / f).is_file() for f in _WEIGHT_FILES):
            missing.append("model.safetensors (or pytorch_model.bin)")
    if tokenizer:
        if not ((path / "tokenizer.json").is_file()
                or ((path / "vocab.json").is_file() and (path / "merges.txt").is_file())):
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


def _fetch_model(repo_id: str, cache_dir: Path) -> None:
    """allow_download: a CLIPModel's config, tokenizer and one weights file, not the repo's other formats
    (open_clip, flax, tf copies of several GB each in the LAION repos)."""
    from huggingface_hub import snapshot_download

    snap = Path(snapshot_download(repo_id, cache_dir=str(cache_dir),
                                  allow_patterns=["*.json", "*.txt", "model.safetensors", "model-*.safetensors"]))
    if not any(snap.glob("model*.safetensors")):  # an older repo with pytorch_model.bin (or its shards) only
        snapshot_download(repo_id, cache_dir=str(cache_dir), allow_patterns=["pytorch_model*.bin"])


def _fetch_processor(repo_id: str, cache_dir: Path) -> None:
    """allow_download: tokenizer and preprocessor files only."""
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id, cache_dir=str(cache_dir), allow_patterns=["*.json", "*.txt"])


def resolve_model(reward: str, path, *, processor: bool = False, allow_download: bool = False) -> Path:
    """A reward's model path as a local Path: a local directory or file, or a hub id (ORG/NAME, ORG/NAME/FILE)
    from the local hub cache (jagg_scale/hub.py), fetched only with the reward's `allow_download: true`."""
    if path is None or str(path) == "":
        raise ValueError(f"{reward}: no model directory given (set the reward's path option to a local directory "
                         "or a hub id)")
    return resolve_model_path(path, what=reward, allow_download=allow_download,
                              markers=_PROCESSOR_MARKERS if processor else _MODEL_MARKERS,
                              fetch=_fetch_processor if processor else _fetch_model,
                              download_option=f"the {reward} reward's option allow_download: true",
                              fetch_args='--include "*.json" --include "*.txt"' if processor else "")


def resolve_dtype(reward: str, dtype: str) -> torch.dtype:
    """The weights' dtype of a reward's `dtype` option; "autocast" keeps float32 weights and runs the forwards under
    bf16 autocast (bf16 matmuls, fp32 norms and softmax: ClipBackbone)."""
    if dtype != "autocast" and dtype not in _DTYPES:
        raise ValueError(f"{reward}: dtype must be one of {sorted([*_DTYPES, 'autocast'])}, got {dtype!r}")
    return torch.float32 if dtype == "autocast" else _DTYPES[dtype]


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
    """A CLIPModel (+ tokenizer) from local directories or cached hub ids, embedding images and prompts in batches.

    `path`: a transformers CLIPModel directory, or an open_clip checkpoint file (.pt/.pth/.bin/.safetensors),
    converted on load (clip_checkpoints.py). `processor_path` holds the tokenizer and preprocessor_config.json
    (PickScore and HPS take them from the ViT-H-14 repo); by default `path` when it holds them, else
    `default_processor`. `tokenizer=False` skips the tokenizer (image-only rewards).
    """

    def __init__(
        self,
        reward: str,
        path: str | Path,
        *,
        processor_path: str | Path | None = None,
        default_processor: str | None = None,
        tokenizer: bool = True,
        allow_download: bool = False,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{reward}: batch_size must be a positive int, got {batch_size!r}")
        found = resolve_model(reward, path, allow_download=allow_download)
        open_clip = found.suffix in _CHECKPOINT_SUFFIXES and not found.is_dir()
        self.path = found if open_clip else check_model_dir(reward, found, weights=True)
        self.processor_path = self._processor(reward, processor_path, default_processor, tokenizer, open_clip,
                                              allow_download)
        self.device, self.dtype, self.batch_size = resolve_device(device), resolve_dtype(reward, dtype), batch_size
        self.autocast = dtype == "autocast"  # float32 weights, bf16 matmuls (the GPU's rate for a frozen scorer)

        from transformers import AutoTokenizer, CLIPModel  # heavy: imported only when a CLIP reward is built

        if open_clip:
            from .clip_checkpoints import clip_model_from_open_clip, load_state_file

            model = clip_model_from_open_clip(load_state_file(self.path, reward))
        else:
            model = CLIPModel.from_pretrained(str(self.path), local_files_only=True)
        self.model = model.eval().requires_grad_(False).to(device=self.device, dtype=self.dtype)
        self.tokenizer = (AutoTokenizer.from_pretrained(str(self.processor_path), local_files_only=True)
                          if tokenizer else None)
        cfg = self.model.config
        self.image_size = int(cfg.vision_config.image_size)
        self.embed_dim = int(cfg.projection_dim)
        self.max_length = min(int(getattr(self.tokenizer, "model_max_length", 77) or 77),
                              int(cfg.text_config.max_position_embeddings))
        self.mean, self.std = read_norm_stats(self.processor_path) if self.processor_path else (CLIP_MEAN, CLIP_STD)

    def _processor(self, reward, processor_path, default_processor, tokenizer, open_clip, allow_download):
        """The tokenizer / preprocessor directory (see the class docstring), checked; None when an open_clip
        file needs neither (image-only: CLIP's mean/std)."""
        if processor_path in (None, ""):
            if not open_clip and not _missing_files(self.path, weights=False, tokenizer=tokenizer):
                return self.path
            if default_processor is None:
                if not open_clip:
                    return check_model_dir(reward, self.path, weights=False, tokenizer=tokenizer)  # names what lacks
                if not tokenizer:
                    return None
                raise ValueError(f"{reward}: {self.path} is an open_clip checkpoint, which carries no tokenizer: set "
                                 "processor_path to the directory (or hub id) of its tokenizer and "
                                 "preprocessor_config.json")
            processor_path = default_processor
        found = resolve_model(reward, processor_path, processor=True, allow_download=allow_download)
        return check_model_dir(reward, found, weights=False, tokenizer=tokenizer)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """Float [B, 3, H, W] in [0, 1] -> the model's pixel_values (float32, on the CPU/input device)."""
        return preprocess_images(images, self.image_size, self.mean, self.std)

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """Projected image embeddings, float32 [B, D] on the CPU (not normalized)."""
        with self._amp():
            out = [_pooled(self.model.get_image_features(
                pixel_values=self.preprocess(c.to(self.device)).to(self.dtype))).float().cpu()
                for c in images.split(self.batch_size)]
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
            with self._amp():
                feats = self.model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
            out.append(_pooled(feats).float().cpu())
        return torch.cat(out) if out else torch.zeros(0, self.embed_dim)

    def _amp(self):
        """bf16 autocast under dtype "autocast" (thread-local: a background scoring thread's own), else nothing."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

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
    """Score = scale * cos(CLIP image embedding, CLIP text embedding) for any CLIPModel directory (or hub id) `path`,
    or an open_clip checkpoint file with `processor_path` naming its tokenizer directory.

    `scale` (default 1.0) only rescales, e.g. 100 for the "CLIPScore"-paper convention or 2.5 for its w=2.5.
    """

    def __init__(self, *, path: str, processor_path: str | None = None, scale: float = 1.0,
                 allow_download: bool = False, device: str = "auto", dtype: str = "float32", batch_size: int = 16):
        super().__init__(ClipBackbone("clip_score", path, processor_path=processor_path, allow_download=allow_download,
                                      device=device, dtype=dtype, batch_size=batch_size))
        self.scale = float(scale)

    def transform(self, cos: torch.Tensor) -> torch.Tensor:
        return self.scale * cos


@register("pickscore")
class PickScore(_ClipTextImage):
    """PickScore (Kirstain et al., 2023): logit_scale.exp() * cos(image, text) with the PickScore_v1 CLIP-H model.

    `path`: the PickScore_v1 model (yuvalkirstain/PickScore_v1: a transformers CLIPModel; a local directory or the
    hub id); `processor_path`: the directory or hub id with its tokenizer / preprocessor_config.json, by default
    `path` when it holds them, else laion/CLIP-ViT-H-14-laion2B-s32B-b79K (the processor PickScore publishes).
    `normalize=True` (default) divides by 26 as Flow-GRPO does, so rewards sit near [0, 1] and the KL/clip
    coefficients tuned there carry over; set False for raw PickScore (~18-24), e.g. to compare with the paper.
    """

    def __init__(
        self,
        *,
        path: str,
        processor_path: str | None = None,
        normalize: bool = True,
        allow_download: bool = False,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ):
        super().__init__(
            ClipBackbone("pickscore", path, processor_path=processor_path, default_processor=VIT_H14_PROCESSOR,
                         allow_download=allow_download, device=device, dtype=dtype, batch_size=batch_size)
        )
        self.normalize = bool(normalize)

    def transform(self, cos: torch.Tensor) -> torch.Tensor:
        s = self.backbone.logit_scale() * cos
        return s / PICKSCORE_NORM if self.normalize else s


@register("hps")
class HPS(_ClipTextImage):
    """HPSv2-style score: cos(image, text) of an HPS-finetuned CLIP (HPSv2 reports this raw cosine, ~0.2-0.35).

    `path`: the official checkpoint file as published (HPS_v2.1_compressed.pt or HPS_v2_compressed.pt, an
    open_clip ViT-H-14 state dict, possibly under 'state_dict'; hub id xswu/HPSv2/HPS_v2.1_compressed.pt), read
    weights-only and converted to a transformers CLIPModel on load (clip_checkpoints.py), or a CLIPModel directory
    already in the transformers layout. `processor_path`: its tokenizer / preprocessor_config.json, by default
    `path` when it is a directory holding them, else laion/CLIP-ViT-H-14-laion2B-s32B-b79K (HPS uses ViT-H-14's).
    """

    def __init__(
        self,
        *,
        path: str,
        processor_path: str | None = None,
        allow_download: bool = False,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ):
        super().__init__(ClipBackbone("hps", path, processor_path=processor_path, default_processor=VIT_H14_PROCESSOR,
                                      allow_download=allow_download, device=device, dtype=dtype,
                                      batch_size=batch_size))

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
    """State dict from a .safetensors or a weights-only .pth/.pt/.bin file (a pickle with code is refused)."""
    from .clip_checkpoints import load_state_file

    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"aesthetic: head file {p} does not exist (expected a .pth or .safetensors state dict)")
    return load_state_file(p, "aesthetic")


def aesthetic_head(state: dict[str, torch.Tensor], embed_dim: int, head_path, clip_path) -> nn.Module:
    """The head a state dict is: LAION-AI/aesthetic-predictor's linear one (sa_0_4_vit_l_14_linear.pth: 'weight'
    [1, D], 'bias' [1]) or the improved predictor's MLP (`layers.*`), checked against the CLIP's width."""
    linear = set(state) == {"weight", "bias"}
    w0 = state.get("weight" if linear else "layers.0.weight")
    if w0 is not None and w0.ndim == 2 and w0.shape[1] != embed_dim:
        raise ValueError(f"aesthetic: head {head_path} expects {w0.shape[1]}-d embeddings but the CLIP at {clip_path} "
                         f"projects to {embed_dim}")
    head = nn.Linear(embed_dim, 1) if linear else AestheticMLP(embed_dim)
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"aesthetic: {head_path} is neither a LAION aesthetic linear head (weight [1, {embed_dim}], "
                         f"bias [1]) nor an improved-aesthetic-predictor MLP state dict: {e}") from e
    return head


@register("aesthetic")
class Aesthetic(Reward):
    """LAION aesthetic score (~1-10): a head on the L2-normalized CLIP ViT-L/14 image embedding, as DDPO and
    Flow-GRPO use. The prompt is ignored.

    `clip_path`: CLIPModel directory or hub id (openai/clip-vit-large-patch14); `head_path`: the head's state dict
    (.pth or .safetensors; a hub id ORG/NAME/FILE works too): LAION-AI/aesthetic-predictor's
    sa_0_4_vit_l_14_linear.pth (one Linear(768, 1)) or the improved predictor's MLP. The head's input width is the
    CLIP projection dim (768 for ViT-L/14), so a head and a CLIP that do not belong together fail at construction
    with both widths named.
    """

    def __init__(
        self,
        *,
        clip_path: str,
        head_path: str,
        allow_download: bool = False,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ):
        self.backbone = ClipBackbone("aesthetic", clip_path, tokenizer=False, allow_download=allow_download,
                                     device=device, dtype=dtype, batch_size=batch_size)
        head_file = resolve_model_path(head_path, what="aesthetic", allow_download=allow_download,
                                       download_option="the aesthetic reward's option allow_download: true")
        head = aesthetic_head(load_head_state(head_file), self.backbone.embed_dim, head_path, clip_path)
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
