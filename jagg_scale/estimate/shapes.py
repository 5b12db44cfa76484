"""Model shapes for the estimate: a pipeline's components as {library, class, config}, instantiated on the meta
device (no memory, no download) and counted.

    pipeline_shapes(cfg, name=None)   a local pipeline directory's config.json files, or shapes/NAME.json for a
                                      model.pretrained that is not here (matched by name, or NAME given)
    meta_module(comp)                 the component on the meta device
    transformer_stats(comp, r, targets)   parameters, buffers, per-block and root parameters, LoRA parameters and
                                      modules of rank r on `targets` (models/lora.py lora_targets: the trainer's)
    reward_models(cfg)                the CLIP reward models the config scores with, as components

shapes/README.md says where each file's values come from.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
from pathlib import Path

import torch

from ..models.diffusers_common import T5_DEFAULT
from ..models.qwenimage import PROMPT_TOKENS_DEFAULT
from ..models.wan import PROMPT_TOKENS_DEFAULT as WAN_TOKENS_DEFAULT
from ..models.lora import target_linears
from ..paths import resolve_path
from ..train.config_sections import PROMPT_TOKEN_LIMITS

__all__ = ["FROZEN", "KNOWN", "QWEN_TEXT", "SHAPES", "block_lists", "clean", "component_params", "context_parallel",
           "counts", "meta_module", "named_block_lists", "pipeline_shapes", "reward_models", "transformer_stats"]

SHAPES = Path(__file__).resolve().parent / "shapes"
KNOWN = {"stable-diffusion-3.5-medium": "sd35_medium", "stable-diffusion-3.5-large": "sd35_large",
         "flux.1-dev": "flux1_dev", "flux1-dev": "flux1_dev", "qwen-image": "qwen_image",
         "flux.2-klein-4b": "flux2_klein", "flux.2-klein-base-4b": "flux2_klein", "z-image": "z_image",
         "flux.1-kontext-dev": "flux1_kontext_dev", "wan2.1-t2v-14b": "wan21_t2v_14b"}
# a family's frozen components, the VAE first and the large (shardable: model.shard_text_encoder) text encoder last
FROZEN = {"sd3": ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"),
          "flux": ("vae", "text_encoder", "text_encoder_2"), "flux_kontext": ("vae", "text_encoder", "text_encoder_2"),
          "qwenimage": ("vae", "text_encoder"), "flux2": ("vae", "text_encoder"), "zimage": ("vae", "text_encoder"),
          "wan": ("vae", "text_encoder")}

# the families whose text encoder is a Qwen LM run with every hidden state kept (measure.measure_nograd): qwen at the
# model's default use_cache (its K/V kept too), qwen_lm Flux2KleinPipeline's causal LM (use_cache=False, logits)
QWEN_TEXT = {"qwenimage": "qwen", "zimage": "qwen", "flux2": "qwen_lm"}


class ShapeError(ValueError):
    """A config whose model shapes cannot be found; the message says how to give them."""


def clean(config: dict) -> dict:
    """A config.json without its private `_...` keys."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def pipeline_shapes(cfg, name: str | None = None) -> dict:
    """{kind, components: {name: {class, library, config}}, text_tokens} from a pipeline directory or a shape file."""
    if cfg is not None and cfg.model.kind not in FROZEN:
        raise ShapeError(f"model.kind {cfg.model.kind}: the estimator sizes {' and '.join(FROZEN)} pipelines; this "
                         "family's shapes and activation coefficients are not in it yet")
    if name is None:
        path = resolve_path(cfg.model.pretrained)
        if (path / "model_index.json").is_file():
            return _from_directory(path, cfg.model.kind)
        name = next((v for k, v in KNOWN.items() if k in path.name.lower()), None)
        if name is None:
            raise ShapeError(f"model.pretrained {path} is not a pipeline directory here and not a known checkpoint "
                             f"({', '.join(KNOWN)}): pass --shapes NAME ({SHAPES}/NAME.json)")
    file = SHAPES / f"{name}.json"
    if not file.is_file():
        raise ShapeError(f"--shapes {name}: no {file} "
                         f"(known: {', '.join(sorted(p.stem for p in SHAPES.glob('*.json')))})")
    return json.loads(file.read_text())


def _from_directory(path: Path, kind: str) -> dict:
    from ..models import stored_dtype

    index = json.loads((path / "model_index.json").read_text())
    if kind == "flux2" and index.get("_class_name") == "Flux2Pipeline":
        raise ShapeError(f"model.pretrained {path} is FLUX.2 [dev] (Flux2Pipeline, a Mistral3 text encoder): the "
                         "estimator sizes FLUX.2 [klein]'s Qwen3 encoder only; [dev]'s shapes are not in it yet")
    comps = {n: {"library": index[n][0], "class": index[n][1],
                 "config": json.loads((path / n / "config.json").read_text())}
             for n in ("transformer",) + FROZEN[kind] if n in index and index[n][0] is not None}
    comps["transformer"]["stored_dtype"] = str(stored_dtype(path / "transformer")).replace("torch.", "")

    def limit(tok, cap):
        f = path / tok / "tokenizer_config.json"
        return min(cap, int(json.loads(f.read_text()).get("model_max_length", cap)) if f.is_file() else cap)

    if kind in QWEN_TEXT:  # the Qwen prompt tokens every prompt is padded to (models/<kind>.py)
        text = {"prompt": PROMPT_TOKENS_DEFAULT, "prompt_limit": PROMPT_TOKEN_LIMITS[kind]}
        return {"name": path.name, "kind": kind, "components": comps, "text_tokens": text}
    if kind == "wan":  # UMT5 alone, every prompt padded to WanPipeline's 512
        t5 = limit("tokenizer", 512)
        text = {"t5": min(WAN_TOKENS_DEFAULT, t5), "t5_limit": t5}
        return {"name": path.name, "kind": kind, "components": comps, "text_tokens": text}
    t5 = limit("tokenizer_3" if kind == "sd3" else "tokenizer_2", 512)  # what model.max_sequence_length can reach
    text = {"clip": limit("tokenizer", 77), "t5": min(T5_DEFAULT["sd3" if kind == "sd3" else "flux"], t5),
            "t5_limit": t5}
    return {"name": path.name, "kind": kind, "components": comps, "text_tokens": text}


def meta_module(comp: dict, device: str = "meta") -> torch.nn.Module:
    lib = importlib.import_module(comp["library"])
    cls, config = getattr(lib, comp["class"]), dict(comp["config"])
    with torch.device(device):
        if comp["library"] == "diffusers":
            return cls.from_config(config)
        return cls(cls.config_class(**clean(config)))


def named_block_lists(module: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """(name, list) of the transformer's block lists in forward order (the FSDP2 units of parallel/blocks.py
    block_slots)."""
    return [(n, m) for n, m in module.named_children() if isinstance(m, torch.nn.ModuleList)]


def block_lists(module: torch.nn.Module) -> list[torch.nn.ModuleList]:
    return [m for _, m in named_block_lists(module)]


def transformer_stats(comp: dict, lora_rank: int = 0, targets=()) -> dict:
    """`targets`: the LoRA targets (models/lora.py lora_targets), needed when lora_rank > 0."""
    if lora_rank and not targets:
        raise ValueError("transformer_stats: LoRA rank %d without targets (models.lora.lora_targets)" % lora_rank)
    return _stats(json.dumps(comp, sort_keys=True), lora_rank, tuple(targets))


@functools.lru_cache(maxsize=None)
def _stats(comp_json: str, lora_rank: int, targets: tuple) -> dict:
    m = meta_module(json.loads(comp_json))
    blocks = [(f"{name}.{i}.", b) for name, bl in named_block_lists(m) for i, b in enumerate(bl)]

    def n(mod):
        return sum(p.numel() for p in mod.parameters())

    # A (in x r) and B (r x out) of every Linear the targets wrap, matched on the model's qualified names as peft
    # matches them (models/lora.py), then attributed to the block that holds it
    wrapped = [(name, lora_rank * (x.in_features + x.out_features)) for name, x in target_linears(m, targets)
               ] if lora_rank else []
    return {"params": n(m), "buffers": sum(b.numel() * b.element_size() for b in m.buffers()),
            "block_params": [n(b) for _, b in blocks], "root_params": n(m) - sum(n(b) for _, b in blocks),
            "lora_params": sum(k for _, k in wrapped), "lora_modules": len(wrapped),
            "block_lora": [sum(k for name, k in wrapped if name.startswith(prefix)) for prefix, _ in blocks]
            if lora_rank else []}


def component_params(comp: dict) -> int:
    return _params(json.dumps({k: comp[k] for k in ("library", "class", "config")}, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _params(comp_json: str) -> int:
    return sum(p.numel() for p in meta_module(json.loads(comp_json)).parameters())


def context_parallel(comp: dict) -> bool:
    """Whether the transformer's context-parallel plan (diffusers' _cp_plan, what parallel.sequence_parallel splits)
    splits the text tokens too (FLUX's and SD3's joint attention) or the image / video tokens alone (Wan's prompt is
    whole on every rank); a ShapeError for a transformer without a plan (Z-Image: the trainer refuses it too)."""
    from ..parallel.sequence import sd3_plan

    plan = getattr(getattr(importlib.import_module(comp["library"]), comp["class"]), "_cp_plan", None)
    if plan is None and comp["class"] == "SD3Transformer2DModel":  # none in diffusers: the trainer's own
        plan = sd3_plan()
    if plan is None:
        raise ShapeError(f"config key 'parallel.sequence_parallel': {comp['class']} has no context-parallel plan in "
                         "diffusers (its _cp_plan), so its sequence cannot be split; use 1")

    def keys(d):
        return {k for k, v in d.items() for k in (k, *(keys(v) if isinstance(v, dict) else ()))}

    return "encoder_hidden_states" in keys(plan)


def reward_models(cfg) -> dict[str, dict]:
    """{reward name: CLIPModel component} of the GPU reward models the config scores with; video_frames' image reward
    with the frames it scores a video (every: every k-th frame, rewards/video.py), 1 for an image reward."""
    table = json.loads((SHAPES / "rewards.json").read_text())
    spec = cfg.reward.components or {cfg.reward.name: cfg.reward.options}
    out = {}
    for name, opts in spec.items():
        opts, every = opts or {}, 1
        if name == "video_frames":
            name, every, opts = opts["reward"], opts.get("every", 1), opts.get("options") or {}
        path = opts.get("path") or opts.get("clip_path")
        if path and (resolve_path(path) / "config.json").is_file():
            out[name] = {"library": "transformers", "class": "CLIPModel", "every": every,
                         "config": json.loads((resolve_path(path) / "config.json").read_text()), "options": opts}
        elif table["models"].get(name):
            out[name] = dict(table["models"][name], options=opts, every=every)
        elif name not in table["gpu_free"]:
            print(f"note: reward {name!r} not estimated (no shape; 0 bytes assumed)", file=sys.stderr)
    return out


def counts() -> str:
    """The parameter counts of every shape file's components (a markdown table)."""
    lines = ["| shapes | component | class | parameters |", "|---|---|---|---|"]
    for f in sorted(SHAPES.glob("*.json")):
        data = json.loads(f.read_text())
        for name, comp in (data.get("components") or {k: v for k, v in data["models"].items() if v}).items():
            lines.append(f"| {f.stem} | {name} | {comp['class']} | {component_params(comp) / 1e6:,.1f} M |")
    return "\n".join(lines)
