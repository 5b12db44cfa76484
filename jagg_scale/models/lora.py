"""LoRA on a diffusers transformer (SD3, FLUX): Flow-GRPO's adapter, the adapter-off KL reference, diffusers-format
saving.

    add_lora(transformer, rank=32, alpha=64)    peft LoraConfig + diffusers' `add_adapter`; only LoRA params train
    with reference_disabled(model): ...         the same transformer with the adapter off = the frozen base
                                                (the KL reference of GRPO: no second copy of the weights)
    save_lora(transformer, out_dir)             pytorch_lora_weights.safetensors, readable by a plain
                                                StableDiffusion3Pipeline(...).load_lora_weights(out_dir)

Flow-GRPO (SD3.5) uses r=32, lora_alpha=64, init_lora_weights="gaussian" (A ~ N(0, 1/r), B = 0, so the adapted
model starts exactly at the base) on the joint-attention projections listed in DEFAULT_TARGETS. peft matches
targets as suffixes of module names, so "to_out.0" is `attn.to_out[0]` (the output Linear; [1] is the Dropout).
The saved file carries the LoraConfig as metadata so the loader restores lora_alpha (scale alpha / r) instead of
guessing alpha = r.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch

DEFAULT_TARGETS: tuple[str, ...] = (  # SD3 and FLUX name their attention projections alike
    "to_q", "to_k", "to_v", "to_out.0",  # image-stream attention projections
    "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",  # context-stream (text) projections
)

ADAPTER_NAME = "default"


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


def add_lora(transformer, rank: int = 32, alpha: float = 64, targets: Sequence[str] = DEFAULT_TARGETS,
             init: str | bool = "gaussian", dropout: float = 0.0, adapter_name: str = ADAPTER_NAME,
             dtype: torch.dtype | None = None):
    """Inject a LoRA adapter (peft LoraConfig via diffusers' PeftAdapterMixin.add_adapter) into `transformer`
    (or an adapter's `.transformer`); freezes every base weight so that only the LoRA A/B matrices require grad.
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
    n_lora = 0
    for name, p in tr.named_parameters():
        is_lora = "lora_" in name
        if is_lora and (p.dtype != dtype or p.device != ref.device):
            p.data = p.data.to(device=ref.device, dtype=dtype)
        p.requires_grad_(is_lora)
        n_lora += is_lora
    if n_lora == 0:
        raise ValueError(f"no module of {type(tr).__name__} matched the LoRA targets {list(targets)}")
    return config


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
    return out
