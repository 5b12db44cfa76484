"""LoRA on a diffusers transformer: the family's targets, the adapter-off KL reference, diffusers-format saving.

    lora_targets(kind, configured)              model.lora.targets, or the family's default (its velocity class's
                                                `lora_targets`): what the trainer wraps AND what the estimator counts
    target_matches(name, targets)               peft's rule for a list of targets (below)
    add_lora(transformer, targets=..., rank=32, alpha=64)   peft LoraConfig + diffusers' `add_adapter`; only LoRA
                                                params train
    check_lora_binding(model, expected, ...)    the wrapped module count against model.lora.expect_modules
    with reference_disabled(model): ...         the same transformer with the adapter off = the frozen base
                                                (the KL reference of GRPO: no second copy of the weights)
    save_lora(transformer, out_dir)             pytorch_lora_weights.safetensors, readable by a plain
                                                StableDiffusion3Pipeline(...).load_lora_weights(out_dir), read back
                                                and checked tensor by tensor against the model's adapter

Flow-GRPO (SD3.5) uses r=32, lora_alpha=64, init_lora_weights="gaussian" (A ~ N(0, 1/r), B = 0, so the adapted
model starts exactly at the base). Targets: peft (tuners_utils.check_target_module_exists) matches a LIST of targets
against a module's qualified name as the name itself or its ending after a dot, so "attn.to_q" wraps
`transformer_blocks.3.attn.to_q` but not `...attn2.to_q` (SD3.5-medium's dual-attention blocks) while a bare "to_q"
wraps both; "to_out.0" is `attn.to_out[0]` (the output Linear; [1] is the Dropout). A single STRING target is a
regular expression to peft (re.fullmatch): model.lora.targets is always a list, so that form never reaches it. Each
family's default is its cited peer's list (the velocity classes name the file and line).
The saved file carries the LoraConfig as metadata so the loader restores lora_alpha (scale alpha / r) instead of
guessing alpha = r.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import logging

import torch

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"


def lora_targets(kind: str, configured: Sequence[str] = ()) -> tuple[str, ...]:
    """The LoRA targets of a model.kind: `configured` (model.lora.targets) when given, else the family's default (its
    velocity class's `lora_targets`). The one resolution the trainer (models.build_model) and the estimator
    (estimate/memory.py, preemption.py) both use, so the modules trained and the modules counted are the same."""
    if configured:
        return tuple(configured)
    from .registry import family

    return family(kind).velocity.lora_targets


def target_matches(name: str, targets: Sequence[str]) -> bool:
    """peft's match of a module's qualified name against a list of targets: the name itself, or its ending after a
    dot (peft.tuners.tuners_utils.check_target_module_exists, the list branch)."""
    return name in targets or any(name.endswith("." + t) for t in targets)


def target_linears(module: torch.nn.Module, targets: Sequence[str]) -> list[tuple[str, torch.nn.Linear]]:
    """(name, Linear) of every module of `module` that `targets` wrap, in module order (peft would refuse a matched
    module it has no LoRA layer for; every family default matches Linears alone)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and target_matches(n, targets)]


def _transformer(model) -> torch.nn.Module:
    """The diffusers transformer of an adapter (SD3Velocity) or the transformer itself."""
    return getattr(model, "transformer", model)


def has_lora(model) -> bool:
    """True when a peft adapter is injected into the (model's) transformer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in _transformer(model).modules())


def lora_module_names(model) -> list[str]:
    """Qualified names of the modules wrapped by LoRA layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [n for n, m in _transformer(model).named_modules() if isinstance(m, BaseTunerLayer)]


def lora_a_init(name: str, shape, rank: int, seed: int) -> torch.Tensor:
    """A lora_A weight as peft's "gaussian" init draws it (normal, std 1 / r; lora_B zeros), from a generator of its
    own seeded by (seed, its name): the same values whether the adapter was made on the host or as a skeleton on the
    meta device and filled shard by shard (parallel/meta_load.py), on every rank, whatever else drew from the global
    generator before."""
    import zlib

    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    return torch.randn(tuple(shape), generator=g) / rank


def add_lora(transformer, *, targets: Sequence[str], rank: int = 32, alpha: float = 64, init: str | bool = "gaussian",
             dropout: float = 0.0, adapter_name: str = ADAPTER_NAME, dtype: torch.dtype | None = None):
    """Inject a LoRA adapter (peft LoraConfig via diffusers' PeftAdapterMixin.add_adapter) on `targets` (lora_targets)
    into `transformer` (or an adapter's `.transformer`); freezes every base weight so that only the LoRA A/B matrices
    require grad. Logs the modules wrapped and the LoRA parameters; none wrapped is refused (ValueError).
    New LoRA params take the base weights' device and `dtype` (None: the base's; float32 over a bf16 base: the
    trained weights and their optimizer state stay float32). Returns the LoraConfig."""
    from peft import LoraConfig

    tr = _transformer(transformer)
    config = LoraConfig(r=int(rank), lora_alpha=alpha, init_lora_weights=init, target_modules=list(targets),
                        lora_dropout=dropout)
    tr.requires_grad_(False)
    ref = next(tr.parameters())
    dtype = dtype or ref.dtype
    tr.add_adapter(config, adapter_name=adapter_name)
    n_lora, seed = 0, torch.initial_seed()
    for name, p in tr.named_parameters():
        is_lora = "lora_" in name
        if is_lora and (p.dtype != dtype or p.device != ref.device):
            p.data = p.data.to(device=ref.device, dtype=dtype)
        if "lora_A" in name and init == "gaussian" and not p.is_meta:
            p.data.copy_(lora_a_init(name, p.shape, int(rank), seed))
        p.requires_grad_(is_lora)
        n_lora += p.numel() if is_lora else 0
    modules = lora_module_names(tr)
    if not modules:
        raise ValueError(f"no module of {type(tr).__name__} matched the LoRA targets {list(targets)}")
    log.info("LoRA r%d: %d modules of %s wrapped, %s LoRA parameters (targets %s)", int(rank), len(modules),
             type(tr).__name__, f"{n_lora:,}", list(targets))
    return config


def check_lora_binding(model, expected: int | None, targets: Sequence[str], key: str = "model.lora.expect_modules"
                       ) -> int:
    """The number of modules the LoRA adapter wraps in the (model's) transformer; a ConfigError naming `key`, the
    count found and the targets unless it is `expected` (None: not checked). A recipe states its count so that a
    renamed module (a diffusers upgrade), an edited target list or a family default that no longer matches is
    refused at start-up instead of training a different adapter than the peer's."""
    from ..sections import ConfigError

    found = len(lora_module_names(model))
    if expected is not None and found != expected:
        raise ConfigError(f"config key '{key}' is {expected}, but the LoRA targets {list(targets)} wrap {found} "
                          f"modules of {type(_transformer(model)).__name__}")
    return found


def lora_parameters(model) -> list[torch.nn.Parameter]:
    """The trainable LoRA parameters (what the optimizer should see)."""
    return [p for n, p in _transformer(model).named_parameters() if "lora_" in n]


@contextmanager
def reference_disabled(model):
    """Run the (model's) transformer with its LoRA adapter off: the base model, i.e. the KL reference.
    Restores the previous enabled/disabled state on exit, even on error."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tr = _transformer(model)
    layers = [m for m in tr.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("reference_disabled: the transformer has no LoRA adapter (call add_lora first)")
    was_disabled = [bool(m.disable_adapters) for m in layers]
    grad_flags = [(p, p.requires_grad) for p in lora_parameters(tr)]  # peft toggles them: put them back as found
    tr.disable_adapters()
    try:
        yield model
    finally:
        for m, off in zip(layers, was_disabled):
            m.enable_adapters(not off)
        for p, flag in grad_flags:
            p.requires_grad_(flag)


def lora_layers_from_state(state: dict, adapter_name: str = ADAPTER_NAME, prefix: str = "transformer.") -> dict:
    """peft's saved-adapter layout from a full (e.g. gathered from shards) state dict of the adapter model:
    "transformer.<module>.lora_A.default.weight" -> "<module>.lora_A.weight" (what get_peft_model_state_dict gives)."""
    out = {}
    for key, value in state.items():
        if "lora_" not in key:
            continue
        key = key[len(prefix):] if key.startswith(prefix) else key
        out[key.replace(f".{adapter_name}.", ".")] = value
    return out


def save_lora(transformer, out_dir, adapter_name: str = ADAPTER_NAME, pipeline_cls=None, state: dict | None = None
              ) -> Path:
    """Write the LoRA weights in diffusers' format (out_dir/pytorch_lora_weights.safetensors, keys
    `transformer.<module>.lora_A/B.weight`, LoraConfig metadata) for `<pipeline_cls>.load_lora_weights`
    (StableDiffusion3Pipeline by default; FluxPipeline for FLUX: both use the same transformer-prefixed layout)."""
    from peft.utils import get_peft_model_state_dict

    if pipeline_cls is None:
        from diffusers import StableDiffusion3Pipeline as pipeline_cls

    tr = _transformer(transformer)
    if not has_lora(tr):
        raise ValueError("save_lora: the transformer has no LoRA adapter")
    if state is None:
        layers = get_peft_model_state_dict(tr, adapter_name=adapter_name)
    else:  # weights gathered elsewhere (FSDP2 / ZeRO-3 shards): the module's own tensors are only shards
        layers = lora_layers_from_state(state, adapter_name)
    layers = {k: v.detach().to("cpu").contiguous() for k, v in layers.items()}
    metadata = tr.peft_config[adapter_name].to_dict()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipeline_cls.save_lora_weights(str(out), transformer_lora_layers=layers,
                                               transformer_lora_adapter_metadata=metadata)
    check_saved_lora(out / LORA_FILE, tr, layers, adapter_name)
    return out


LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' name (LORA_WEIGHT_NAME_SAFE)


def check_saved_lora(file, model, layers: dict, adapter_name: str = ADAPTER_NAME) -> None:
    """ValueError in one line, naming the first tensor at fault, unless `file` (what save_lora wrote) holds exactly
    the model's adapter: `transformer.<module>.lora_A/B.weight` for every LoRA parameter of the (model's) transformer
    (its names, so a gathered state that lacks one is caught too), each equal in value and dtype to `layers`, the
    tensors handed to the writer, and nothing else."""
    from safetensors.torch import load_file

    saved = load_file(str(file))
    expected = {"transformer." + n.replace(f".{adapter_name}.", ".")
                for n, _ in _transformer(model).named_parameters() if "lora_" in n}
    missing, unexpected = sorted(expected - set(saved)), sorted(set(saved) - expected)
    if missing:
        raise ValueError(f"LoRA export {file}: the adapter tensor {missing[0]!r} is missing ({len(missing)} of "
                         f"{len(expected)} missing)")
    if unexpected:
        raise ValueError(f"LoRA export {file}: {unexpected[0]!r} is not a tensor of the model's adapter "
                         f"({len(unexpected)} such)")
    for name in sorted(expected):
        written = layers.get(name[len("transformer."):])
        if written is None or saved[name].dtype != written.dtype or not torch.equal(saved[name], written):
            raise ValueError(f"LoRA export {file}: the adapter tensor {name!r} differs from the model's")
