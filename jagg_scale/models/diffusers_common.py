"""What the diffusers adapters (sd3.py, flux.py) share: the transformer is the policy, the rest is frozen.

Only the transformer is a registered submodule, so `.parameters()`, `.state_dict()` and the optimizer see it alone.
The VAE and the text encoders live in a plain dict (`self.frozen`) with requires_grad False, and follow the
adapter through `.to()` / `.double()` / `.cuda()` (`_apply` is overridden). The pipeline object is kept as
`self.pipe` for its `encode_prompt`, tokenizers and scheduler config.

Placement (train/trainer.py): the training engine shards and places the transformer (the registered parameters);
`place_frozen(device, shard_t5=)` moves the VAE and text encoders to the device in their own dtype, the T5 encoder
sharded for inference when asked (model.shard_text_encoder). `reference_copy()` is the KL reference of a full fine-tune:
`with_transformer(copy of the transformer)`, an adapter around the copy that shares this one's pipeline, VAE,
encoders and settings by reference, so the reference velocity is the policy's latent and prompt handling around
the frozen starting weights, at the cost of one transformer.
"""

from __future__ import annotations

import contextvars
import copy
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .base import VelocityModel

log = logging.getLogger(__name__)


_ON_META = contextvars.ContextVar("transformers_on_meta", default=False)
POLICY_COMPONENTS = ("transformer", "transformer_2")  # the pipeline components the policy trains (both experts)


@contextmanager
def transformers_on_meta():
    """Within it, load_pipeline builds the policy's transformer(s) as skeletons: parameters on the meta device (no
    weight read, no host memory), buffers real (computed by their modules, as a load computes them); the training
    engine fills each rank's shards from the files (parallel/meta_load.py)."""
    token = _ON_META.set(True)
    try:
        yield
    finally:
        _ON_META.reset(token)


def load_pipeline(pipeline_cls, path, dtype, *, local_files_only: bool = True, **components):
    """`pipeline_cls.from_pretrained(path, dtype=..., ...)`, every family's one way to load its pipeline; under
    transformers_on_meta() its transformer(s) are skeletons (module docstring of meta_load)."""
    if _ON_META.get():
        import json

        import diffusers
        from accelerate import init_empty_weights

        index = json.loads((Path(path) / "model_index.json").read_text())
        for name in POLICY_COMPONENTS:
            spec = index.get(name)
            if name in components or not isinstance(spec, list) or spec[-1] is None:
                continue
            cls = getattr(diffusers, spec[-1])
            with init_empty_weights(include_buffers=False):
                module = cls.from_config(cls.load_config(str(Path(path) / name)))
            want = dtype.get(name, dtype.get("default", torch.float32)) if isinstance(dtype, dict) else dtype
            components[name] = module.to(want).eval()  # as from_pretrained leaves it
    return pipeline_cls.from_pretrained(str(Path(path)), dtype=dtype, local_files_only=local_files_only, **components)


# model.attention -> diffusers' attention backend (attention_dispatch.AttentionBackendName): both support context
# parallelism and save the softmax's logsumexp for the backward (diffusers 0.42 attention_dispatch.py: the native
# backend's `_native_attention_backward_op` runs scaled_dot_product_attention again under sequence parallelism)
ATTENTION_BACKENDS = {"cudnn": "_native_cudnn", "flash": "flash"}


def set_attention_backend(transformer: nn.Module, name: str, device: torch.device) -> int:
    """model.attention `name` on every attention processor of `transformer` (of each expert, for a module of several)
    that dispatches through diffusers' attention backends; sdpa and xformers are the adapters' own (no-op here).
    Returns the processors set. ValueError naming the key when the backend cannot run: not on CUDA, flash without
    the flash-attn package, or a transformer none of whose processors dispatch (SD3's call SDPA themselves)."""
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        return 0
    key = f"config key 'model.attention' {name}"
    if device.type != "cuda":
        raise ValueError(f"{key} is a CUDA attention kernel; this run is on {device.type}: use sdpa")
    if name == "flash":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError(f"{key} needs the flash-attn package (import flash_attn failed): install it, or use cudnn")
    set_n = 0
    for model in getattr(transformer, "experts", None) or [transformer]:
        takes = [m for m in model.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
        if not takes:
            raise ValueError(f"{key}: {type(model).__name__}'s attention does not go through diffusers' attention "
                             "backends (its processors call the kernel themselves): use sdpa")
        model.set_attention_backend(backend)
        set_n += len(takes)
    return set_n


def t5_length(tokenizer, configured: int | None, default: int) -> int:
    """The T5 prompt length in tokens: `configured` (model.max_sequence_length) or the pipeline's own default,
    never past the tokenizer's limit (the tiny test pipelines' T5 tokenizer stops at 32)."""
    limit = int(getattr(tokenizer, "model_max_length", default)) if tokenizer is not None else default
    if configured is not None and configured > limit:
        log.warning("model.max_sequence_length %d is past this pipeline's T5 tokenizer limit %d: %d tokens are used",
                    configured, limit, limit)
    return min(configured or default, limit)


def latent_stats(vae, device, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A video VAE's per-channel latents mean and std as [1, C, 1, 1, 1] (Wan's AutoencoderKLWan and Qwen-Image's,
    which normalise latents per channel) in the VAE's dtype on `device`, copied there once per (device, dtype)."""
    key = (str(device), vae.dtype)
    if key not in cache:
        c = vae.config
        cache[key] = tuple(torch.tensor(v, dtype=vae.dtype).view(1, c.z_dim, 1, 1, 1).to(device)
                           for v in (c.latents_mean, c.latents_std))
    return cache[key]


def row_sigmas(sigma, x: torch.Tensor) -> torch.Tensor:
    """sigma (a number, a 0-d or an [N] tensor) as one noise level per row of x, on x's device."""
    sigma = torch.as_tensor(sigma, device=x.device)
    return sigma.expand(x.shape[0]) if sigma.ndim == 0 else sigma


def token_problem(tokens: int) -> tuple[str, str] | None:
    """model.resolution (and frames) making more than MAX_TOKENS latent tokens a row: a problem, else None."""
    from .registry import MAX_TOKENS

    if tokens > MAX_TOKENS:
        return "model.resolution", f"makes {tokens:,} latent tokens a row, over the {MAX_TOKENS:,} a row may have"
    return None


def resolution_check(patch: Callable[[dict], int] = lambda tc: 2) -> Callable:
    """A family's `check` (models/registry.py): model.resolution a multiple of the VAE's factor x the patch
    (`patch(transformer config)`; FLUX-style packing: 2), read from the pipeline's configs before anything loads: the
    rule `latent_size_for` applies after the load. The factor as diffusers' pipelines compute it: 2 per
    `temperal_downsample` level (Qwen-Image's video VAE), else 2 ** (len(block_out_channels) - 1)."""
    import json

    def check(cfg, path) -> tuple[str, str] | None:
        vae_file, tc_file = Path(path) / "vae" / "config.json", Path(path) / "transformer" / "config.json"
        if cfg.resolution is None or not (vae_file.is_file() and tc_file.is_file()):
            return None  # not a whole pipeline: its load says what is missing
        vae, tc = json.loads(vae_file.read_text()), json.loads(tc_file.read_text())
        f = 2 ** len(vae["temperal_downsample"]) if "temperal_downsample" in vae else \
            2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
        multiple = f * patch(tc)
        if cfg.resolution % multiple:
            return "model.resolution", f"{cfg.resolution} must be a multiple of {multiple} (VAE factor {f} x patch " \
                                       f"{patch(tc)})"
        return token_problem((cfg.resolution // multiple) ** 2)

    return check

class TransformerVelocity(nn.Module):
    """v(x, sigma, cond) of a bare diffusers transformer through its family's velocity function (qwenimage_velocity,
    zimage_velocity, wan_velocity), without a pipeline (no encoders, no VAE): what the GPU check trains at a family's
    real shape with random weights (tools/gpu_families.py). `autocast` (e.g. torch.bfloat16): the forward under that
    autocast, as the trainer's policy runs it."""

    def __init__(self, velocity: Callable, transformer: nn.Module, latent_shape: tuple[int, ...],
                 autocast: torch.dtype | None = None):
        super().__init__()
        self.velocity, self.transformer, self.autocast = velocity, transformer, autocast
        self.latent_shape = tuple(latent_shape)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            return self.velocity(self.transformer, x, sigma, cond)


class DiffusersVelocity(VelocityModel):
    #: pipeline components that are frozen (set by each adapter)
    frozen_names: tuple[str, ...] = ()
    #: the pipeline component that is the T5 text encoder (set by each adapter)
    t5_name: str = ""
    #: False on an adapter made by `with_transformer`: the frozen parts are the policy's, it does not move them
    owns_frozen: bool = True
    #: the family's default LoRA targets (models/lora.py lora_targets; peft's match), each its cited peer's list
    lora_targets: tuple[str, ...] = ()

    def __init__(self, pipe, max_sequence_length: int):
        super().__init__()
        self.pipe = pipe  # not an nn.Module: not registered
        self.transformer = pipe.transformer
        self.frozen = {}
        for name in self.frozen_names:
            module = getattr(pipe, name, None)
            if module is not None:
                module.requires_grad_(False).eval()
                self.frozen[name] = module
        self.max_sequence_length = max_sequence_length
        self.num_train_timesteps = pipe.scheduler.config.num_train_timesteps

    @staticmethod
    def latent_size_for(pipe, resolution: int | None, multiple: int) -> int | None:
        """Pixels -> latent size (resolution / vae_scale_factor), checked against the patching multiple."""
        if resolution is None:
            return None
        f = pipe.vae_scale_factor
        if resolution % (f * multiple):
            raise ValueError(f"model.resolution {resolution} must be a multiple of {f * multiple} "
                             f"(VAE factor {f} x patch {multiple})")
        return resolution // f

    # ------------------------------------------------------------------ device / dtype of the frozen parts
    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.owns_frozen:
            for module in self.frozen.values():
                module._apply(fn)
        return self

    def place_frozen(self, device: torch.device, shard_t5: Callable[[nn.Module], nn.Module] | None = None
                     ) -> "DiffusersVelocity":
        """Move the VAE and text encoders to `device`, each in its own dtype (the transformer is the engine's).
        `shard_t5(module)`, when given, places the T5 encoder instead (parallel.fsdp.shard_for_inference moves each
        rank's shard of it to the device)."""
        for name, module in self.frozen.items():
            if shard_t5 is not None and name == self.t5_name:
                shard_t5(module)
            else:
                module.to(device)
        return self

    # ------------------------------------------------------------------ the KL reference
    def with_transformer(self, transformer: nn.Module) -> "DiffusersVelocity":
        """This adapter around another transformer of the same architecture: the pipeline, the frozen parts (the
        same objects, not copies) and every setting are shared; only `transformer` is registered. The result does
        not move the shared frozen parts (`.to()` moves its transformer alone)."""
        other = type(self).__new__(type(self))
        nn.Module.__init__(other)
        own = set(other.__dict__)  # nn.Module's bookkeeping: parameters, buffers, submodules, hooks, mode
        for key, value in self.__dict__.items():
            if key not in own:
                other.__dict__[key] = value
        other.transformer = transformer
        other.owns_frozen = False
        other.train(self.training)
        return other

    def reference_copy(self) -> "DiffusersVelocity":
        """The KL reference of a full fine-tune: a frozen copy of the transformer alone (on the host, before the
        engine places anything), in this adapter's pipeline (see with_transformer)."""
        ref = self.with_transformer(copy.deepcopy(self.transformer).requires_grad_(False).eval())
        ref.master_dtype = None  # frozen: kept in the dtype it was loaded in (the checkpoint's), never upcast
        return ref.eval()

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    # ------------------------------------------------------------------ training options
    def enable_gradient_checkpointing(self):
        """Recompute each transformer block in backward (diffusers' non-reentrant checkpointing): same
        gradients, activation memory of one block. Active only in train mode with grad enabled."""
        self.transformer.enable_gradient_checkpointing()
        return self

    def disable_gradient_checkpointing(self):
        self.transformer.disable_gradient_checkpointing()
        return self

    # ------------------------------------------------------------------ LoRA (models/lora.py)
    def add_lora(self, *, targets=(), **kwargs):
        """Inject LoRA into the transformer (see lora.add_lora) on `targets`, or on the family's `lora_targets`;
        only the LoRA params stay trainable."""
        from .lora import add_lora

        return add_lora(self.transformer, targets=tuple(targets) or self.lora_targets, **kwargs)

    def reference_disabled(self):
        """Context manager: this model with the LoRA adapter off (the KL reference)."""
        from .lora import reference_disabled

        return reference_disabled(self)

    def save_lora(self, out_dir, state: dict | None = None) -> Path:
        """Diffusers LoRA file; `state` = this adapter's full state dict when the live weights are sharded."""
        from .lora import save_lora

        return save_lora(self.transformer, out_dir, pipeline_cls=type(self.pipe), state=state)

    def save_full(self, out_dir, state: dict | None = None) -> Path:
        """transformer.save_pretrained(out_dir): a full transformer directory (SD3Transformer2DModel /
        FluxTransformer2DModel). With a LoRA adapter attached this refuses (the peft-wrapped state dict is not a plain
        transformer); use save_lora."""
        from .lora import has_lora

        if has_lora(self.transformer):
            raise ValueError("save_full: the transformer carries a LoRA adapter; save it with save_lora(out_dir)")
        out = Path(out_dir)
        if state is None:
            self.transformer.save_pretrained(str(out))
            return out
        # gathered weights of a sharded run: the same files save_pretrained writes (config + one safetensors)
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        self.transformer.save_config(str(out))
        prefix = "transformer."
        weights = {k[len(prefix):]: v.detach().cpu().contiguous() for k, v in state.items() if k.startswith(prefix)}
        save_file(weights, str(out / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        return out

    # ------------------------------------------------------------------ the pipeline's own sigma schedule
    def _pipeline_sigma_grid(self, num_steps: int):
        """The unshifted sigma grid the pipeline passes to `set_timesteps`, or None to let the scheduler make it
        (StableDiffusion3Pipeline); FLUX overrides this."""
        return None

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """float32 [num_steps + 1]: the sigmas the diffusers pipeline would sample with at this latent size
        (static shift from the scheduler config, or dynamic shift mu from the image sequence length), trailing 0.
        Used when `sampling.shift` is null, so a run samples exactly like the pipeline it was loaded from."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        sched = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        c = sched.config
        kwargs = {}
        if c.get("use_dynamic_shifting", False):
            seq_len = (self.latent_shape[1] // self.patch_size) * (self.latent_shape[2] // self.patch_size)
            kwargs["mu"] = calculate_shift(seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                           c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        grid = self._pipeline_sigma_grid(num_steps)
        if grid is None:
            sched.set_timesteps(num_steps, **kwargs)
        else:
            sched.set_timesteps(sigmas=grid, **kwargs)
        return sched.sigmas.float().cpu()

    # ------------------------------------------------------------------ decoding for the rewards
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [N, C, H, W] -> float32 images [N, 3, H, W] in [0, 1]: unscale (scaling_factor, shift_factor),
        VAE decode, [-1, 1] -> [0, 1]."""
        vae = self.frozen["vae"]
        latents = x.to(vae.dtype) / vae.config.scaling_factor
        if getattr(vae.config, "shift_factor", None) is not None:
            latents = latents + vae.config.shift_factor
        img = vae.decode(latents, return_dict=False)[0]
        return ((img.float() + 1) / 2).clamp(0, 1)
