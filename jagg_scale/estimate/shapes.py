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

from ..models.lora import target_linears
from ..models.registry import families, family, family_of_transformer
from ..paths import resolve_path

__all__ = ["SHAPES", "known_checkpoints", "block_lists", "clean", "component_params", "context_parallel",
           "counts", "meta_module", "named_block_lists", "pipeline_shapes", "reward_models", "transformer_stats"]

SHAPES = Path(__file__).resolve().parent / "shapes"


def known_checkpoints() -> dict[str, str]:
    """{checkpoint name (lower case) found in model.pretrained: shapes file}, every family's (Family.checkpoints)."""
    return {k: v for f in families().values() for k, v in f.checkpoints.items()}


class ShapeError(ValueError):
    """A config whose model shapes cannot be found; the message says how to give them."""


def clean(config: dict) -> dict:
    """A config.json without its private `_...` keys."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def pipeline_shapes(cfg, name: str | None = None) -> dict:
    """{kind, components: {name: {class, library, config}}, text_tokens} from a pipeline directory or a shape file."""
    sized = [k for k, f in families().items() if f.geometry is not None]
    if cfg is not None and cfg.model.kind not in sized:
        raise ShapeError(f"model.kind {cfg.model.kind}: the estimator sizes {' and '.join(sized)} pipelines; this "
                         "family's shapes and activation coefficients are not in it yet")
    if name is None:
        path = resolve_path(cfg.model.pretrained)
        if (path / "model_index.json").is_file():
            return _from_directory(path, cfg.model.kind)
        known = known_checkpoints()
        # the longest name found wins: "qwen-image-edit-2509" holds "qwen-image" too
        name = max(((k, v) for k, v in known.items() if k in path.name.lower()), key=lambda kv: len(kv[0]),
                   default=(None, None))[1]
        if name is None:
            raise ShapeError(f"model.pretrained {path} is not a pipeline directory here and not a known checkpoint "
                             f"({', '.join(known)}): pass --shapes NAME ({SHAPES}/NAME.json)")
    file = SHAPES / f"{name}.json"
    if not file.is_file():
        raise ShapeError(f"--shapes {name}: no {file} "
                         f"(known: {', '.join(sorted(p.stem for p in SHAPES.glob('*.json')))})")
    return json.loads(file.read_text())


def _from_directory(path: Path, kind: str) -> dict:
    from ..models import stored_dtype

    fam = family(kind)
    index = json.loads((path / "model_index.json").read_text())
    if kind == "flux2" and index.get("_class_name") == "Flux2Pipeline":
        raise ShapeError(f"model.pretrained {path} is FLUX.2 [dev] (Flux2Pipeline, a Mistral3 text encoder): the "
                         "estimator sizes FLUX.2 [klein]'s Qwen3 encoder only; [dev]'s shapes are not in it yet")
    comps = {n: {"library": index[n][0], "class": index[n][1],
                 "config": json.loads((path / n / "config.json").read_text())}
             for n in ("transformer", "transformer_2") + fam.frozen
             if isinstance(index.get(n), list) and index[n][0] is not None}
    for n in ("transformer", "transformer_2"):
        if n in comps:
            comps[n]["stored_dtype"] = str(stored_dtype(path / n)).replace("torch.", "")
    # two experts (Wan2.2 A14B): their switch and the scheduler that sets the sigmas it is read at (experts.py)
    experts = None
    if "transformer_2" in comps:
        scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        experts = {"boundary_ratio": index.get("boundary_ratio"),
                   "scheduler": {"class": index["scheduler"][1], "config": scheduler}}

    def limit(tok, cap):
        f = path / tok / "tokenizer_config.json"
        return min(cap, int(json.loads(f.read_text()).get("model_max_length", cap)) if f.is_file() else cap)

    if fam.text in ("qwen", "qwen_lm"):  # its prompt tokens: the family's (Family.prompt_tokens)
        return {"name": path.name, "kind": kind, "components": comps, "text_tokens": {}}
    extra = {"experts": experts} if experts else {}
    # the T5 tokens (its tokenizer's limit: what model.max_sequence_length can reach); Wan's UMT5 alone, every prompt
    # padded to WanPipeline's 512; CLIP's beside it for SD3 and FLUX.1
    t5 = limit(fam.frozen[-1].replace("text_encoder", "tokenizer"), 512)
    text = {"t5": min(fam.prompt_tokens, t5), "t5_limit": t5}
    if fam.text == "clip_t5":
        text = {"clip": limit("tokenizer", 77), **text}
    return {"name": path.name, "kind": kind, "components": comps, "text_tokens": text, **extra}


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
    plan = getattr(getattr(importlib.import_module(comp["library"]), comp["class"]), "_cp_plan", None)
    fam = family_of_transformer(comp["class"])
    if fam is not None and fam.context_parallel is not None:  # none in diffusers: the trainer's own (SD3)
        plan = fam.context_parallel(None)
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


def rewards_need_pixels(cfg) -> bool:
    """Whether any reward of the config scores decoded images: a config of latent rewards alone (Reward.on_latents)
    skips the VAE decode, in the trainer (rewards/multi.py ChunkScorer) and so in the estimate."""
    from .. import rewards  # noqa: F401  (registers the built-in rewards)
    from ..rewards.base import check_reward
    from ..rewards.multi import reward_specs

    return any(not check_reward(n, options).on_latents for n, _, options in reward_specs(cfg.reward))


def counts() -> str:
    """The parameter counts of every shape file's components (a markdown table)."""
    lines = ["| shapes | component | class | parameters |", "|---|---|---|---|"]
    for f in sorted(SHAPES.glob("*.json")):
        data = json.loads(f.read_text())
        for name, comp in (data.get("components") or {k: v for k, v in data["models"].items() if v}).items():
            lines.append(f"| {f.stem} | {name} | {comp['class']} | {component_params(comp) / 1e6:,.1f} M |")
    return "\n".join(lines)
