"""Velocity models behind one interface (base.py): v = model(x, sigma, cond), encode_prompts, decode.

    registry.py           a model family (model.kind) is one module ending with its Family record: what the
                          config, the estimator, sequence parallelism and build_model read; an unknown kind is refused
    dit.py                the built-in DiT (one readable file), with its hash tokenizer
    sd3.py, flux.py,      diffusers SD3/SD3.5, FLUX.1, Qwen-Image, FLUX.2 [dev, klein] and Z-Image pipelines as
    qwenimage.py,         velocity models (diffusers_common.py: what they share); kontext.py and qwenimage_edit.py:
    flux2.py, zimage.py,  FLUX.1-Kontext and Qwen-Image-Edit instruction editing (the input image's latents as
    kontext.py, wan.py,   conditioning tokens); wan.py: Wan2.1/2.2 text-to-video, latents [N, C, F, H, W]
    qwenimage_edit.py
    lora.py               peft LoRA on the diffusers transformers; adapter off is the KL reference
    tiny.py               each family's tiny random pipeline, built locally (tests, smoke runs)

`build_model(cfg.model)` is the one way the trainer and jagg-eval make a model, on the host. The trainer asks for
`keep_stored_dtype=True` and leaves placement to the training engine (docs/loading.md): a bf16 checkpoint's
transformer stays bf16 on the host (peak host copy: one transformer in its stored dtype, plus the frozen parts in
their compute dtype, plus with beta > 0 the reference transformer), and is upcast to fp32 master weights shard by
shard on the device.
"""

from __future__ import annotations

from ..hub import resolve_model_path
from ..paths import resolve_path
from .base import VelocityModel
from .dit import DiT, DiTConfig, HashTokenizer
from .registry import Family, families, family


def build_model(cfg, *, keep_stored_dtype: bool = False, meta: bool = False) -> VelocityModel:
    """A velocity model from the `model` config section (train.config.ModelConfig), on the host (CPU).

    keep_stored_dtype (sd3/flux, the trainer): the transformer is loaded in the dtype its checkpoint stores when
    that is model.dtype's 16-bit dtype (bfloat16 or float16: lossless), and `model.master_dtype` (float32) tells the
    training engine to upcast it while it places the shards on the device, so the host never holds a float32 copy.
    False (jagg-eval, tests): the transformer is float32 right away, as before.

    meta (a diffusers pipeline under FSDP2: parallel.meta_init): the transformer(s) a skeleton on the meta device,
    its weights read by the engine into each rank's shards (parallel/meta_load.py); `model.meta_weights` names the
    files."""
    import torch

    if family(cfg.kind).is_pipeline:  # an unknown kind: a ConfigError naming the known ones
        model = _build_diffusers(cfg, keep_stored_dtype=keep_stored_dtype, meta=meta)
    else:  # the built-in DiT
        model = DiT(cfg.dit)
        if cfg.pretrained:
            load_pretrained(model, str(pretrained_path(cfg)))
        else:
            # GRPO needs a policy that already draws something; with no weights given we start from a random
            # (not zero-output) DiT so velocities, and therefore rewards, vary between samples from step 0.
            model.init_weights(zero_out=False)
    model.compute_dtype = getattr(torch, cfg.dtype)  # float32 | bfloat16 | float16: what the engines read
    return model


def pretrained_path(cfg, *, allow_download: bool | None = None):
    """`model.pretrained` as a local path: the path itself, or a hub id (ORG/NAME for an sd3/flux pipeline,
    ORG/NAME/FILE.safetensors for the dit) from the local hub cache (jagg_scale/hub.py), downloaded only with
    `model.allow_download: true` (`allow_download` overrides it: config validation looks without downloading)."""
    download = cfg.allow_download if allow_download is None else allow_download
    pipeline = family(cfg.kind).is_pipeline
    return resolve_model_path(cfg.pretrained, what="model.pretrained", allow_download=download,
                              markers=("model_index.json",) if pipeline else (),
                              fetch=_fetch_pipeline if pipeline else None,
                              download_option="model.allow_download: true")


def _fetch_pipeline(repo_id: str, cache_dir) -> None:
    """A pipeline's own files only: diffusers reads model_index.json and skips what the repo holds besides the
    components (single-file checkpoints of 10-24 GB next to them in FLUX.1-dev and SD3.5)."""
    from diffusers import DiffusionPipeline

    DiffusionPipeline.download(repo_id, cache_dir=str(cache_dir))


def _build_diffusers(cfg, *, keep_stored_dtype: bool = False, meta: bool = False) -> VelocityModel:
    """A family's adapter (Family.build) from a local pipeline directory (or a hub id in the local hub cache:
    pretrained_path), with the config's LoRA, attention and text-encoder options. Every component is loaded straight
    in the dtype it will be used in (diffusers' per-component `dtype=` at from_pretrained time, never float32 then
    cast): the frozen VAE and text encoders in model.dtype's 16-bit dtype (they never feed a gradient), float32
    under float32; the transformer in float32 (master weights; 16 bits is autocast), with LoRA under a 16-bit dtype
    its frozen base in it (the adapter and its optimizer state float32: the matmuls autocast to 16 bits either way,
    so the base's fp32 copy was only memory and a cast per forward), or with `keep_stored_dtype` in its checkpoint's
    16-bit dtype when that is the compute dtype (see build_model). Under float16 the VAE stays float32, as Flow-GRPO
    (scripts/train_sd3.py:410) and DiffusionNFT (scripts/train_nft_sd3.py:412) keep it in their fp16 runs: it
    decodes in float32, where an fp16 VAE can overflow."""
    import contextlib

    import torch

    from .diffusers_common import transformers_on_meta

    path = pretrained_path(cfg)
    compute = getattr(torch, cfg.dtype)
    half = compute != torch.float32
    transformer = torch.float32
    if half and cfg.lora.enabled:  # the frozen base in the compute dtype; the adapter float32 (add_lora below)
        transformer = compute
    elif keep_stored_dtype and half and stored_dtype(path / "transformer") == compute:
        transformer = compute
    dtypes = {"transformer": transformer, "default": compute}
    if compute == torch.float16:
        dtypes["vae"] = torch.float32
    with transformers_on_meta() if meta else contextlib.nullcontext():
        model = family(cfg.kind).build(cfg, path, dtypes)  # the family's adapter (models/registry.py)
    if meta:  # a skeleton: the engine reads each rank's shards from these (parallel/meta_load.py)
        parts = getattr(model.transformer, "components", {"": "transformer"})  # two experts name theirs
        model.meta_weights = {f"transformer.{prefix}": path / name for prefix, name in parts.items()}
    if transformer != torch.float32 and not cfg.lora.enabled:
        model.master_dtype = torch.float32  # upcast by the engine, shard by shard, on the device
    if cfg.lora.enabled:
        from .lora import check_lora_binding, lora_targets

        targets = lora_targets(cfg.kind, cfg.lora.targets)
        model.add_lora(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dtype=torch.float32, targets=targets)
        model.lora_rank, model.lora_seed = cfg.lora.rank, torch.initial_seed()  # its lora_A draws (lora.lora_a_init)
        check_lora_binding(model, cfg.lora.expect_modules, targets)  # the recipe's count, refused otherwise
    return model


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def safetensors_header(path) -> dict:
    """A safetensors file's header ({name: {dtype, shape, data_offsets}}, "__metadata__"): its 8-byte length, then
    that much JSON, the length bounded by the file's size before it is read."""
    import json
    import os
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > os.path.getsize(path) - 8:
            raise ValueError(f"{path}: a safetensors header of {n} bytes in a file of {os.path.getsize(path)}")
        return json.loads(f.read(n))


def stored_dtype(directory):
    """The one floating dtype every tensor of the safetensors files in `directory` is stored in (read from their
    headers, no weights loaded), or None when they mix dtypes or there are none."""
    from pathlib import Path

    import torch

    seen = set()
    for file in sorted(Path(directory).glob("*.safetensors")):
        header = safetensors_header(file)
        seen |= {v["dtype"] for k, v in header.items() if k != "__metadata__" and v["dtype"] in _SAFETENSORS_DTYPES}
    if len(seen) != 1:
        return None
    return getattr(torch, _SAFETENSORS_DTYPES[seen.pop()])


def safetensors_problem(path) -> str | None:
    """Why `path` is not a safetensors file, read from its header alone (8 bytes of length, then that much JSON),
    or None. safetensors' own error for, say, a text file is "header too large", naming no file."""
    import json
    import os
    import struct

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is not a safetensors file ({size} bytes: too short for a header): {path}"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return (f"is not a safetensors file (its first 8 bytes give a header of {n} bytes, the file has "
                    f"{size}): {path}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        return f"is not a safetensors file (its header is not a JSON object): {path}"
    return None


def load_pretrained(model: VelocityModel, path: str) -> None:
    """Load a safetensors state dict, naming the file and the mismatching keys on failure."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = resolve_path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model.pretrained: no such file {p}")
    problem = safetensors_problem(p)
    if problem:
        raise ValueError(f"model.pretrained {problem}")
    try:
        state = load_file(str(p))
    except SafetensorError as err:  # a damaged file past its header: name it
        raise ValueError(f"model.pretrained {p} could not be read as safetensors: {err}") from err
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"model.pretrained {p} does not fit the configured model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


__all__ = ["Family", "VelocityModel", "DiT", "DiTConfig", "HashTokenizer", "build_model", "families", "family",
           "load_pretrained", "pretrained_path", "safetensors_problem", "stored_dtype"]
