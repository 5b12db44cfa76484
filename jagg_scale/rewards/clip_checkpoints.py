"""Reward checkpoints published outside the transformers layout, read without their original libraries.

    load_state_file(path, what)       a state dict from .safetensors or a weights-only torch pickle (.pt/.pth/.bin)
    open_clip_to_transformers(state)  an open_clip ViT CLIP state dict (HPS v2 / v2.1: HPS_v2.1_compressed.pt, a
                                      ViT-H-14) -> (transformers CLIPConfig, CLIPModel state dict)
    clip_model_from_open_clip(state)  the CLIPModel itself, weights loaded strictly

open_clip is not a dependency: its key names are stable and map one to one onto transformers' CLIPModel, and the
config (widths, depths, heads, patch and image size, vocabulary, context length, projection width) is read from
the tensors' shapes. What shapes cannot say is an argument: the head width (64 in every open_clip ViT config) and
the activation (gelu for the LAION-trained ViT-H-14 that HPS fine-tunes; quick_gelu for OpenAI's weights).

Key map (open_clip -> transformers), N = block index:

    visual.conv1.weight                          vision_model.embeddings.patch_embedding.weight
    visual.class_embedding                       vision_model.embeddings.class_embedding
    visual.positional_embedding                  vision_model.embeddings.position_embedding.weight
    visual.ln_pre / visual.ln_post               vision_model.pre_layrnorm / vision_model.post_layernorm
    visual.transformer.resblocks.N.ln_1 / ln_2   vision_model.encoder.layers.N.layer_norm1 / layer_norm2
    ....attn.in_proj_weight / in_proj_bias       ....self_attn.{q,k,v}_proj (split in three along dim 0)
    ....attn.out_proj                            ....self_attn.out_proj
    ....mlp.c_fc / mlp.c_proj                    ....mlp.fc1 / mlp.fc2
    visual.proj [width, embed]                   visual_projection.weight [embed, width] (transposed)
    token_embedding / positional_embedding       text_model.embeddings.token_embedding / position_embedding
    transformer.resblocks.N...                   text_model.encoder.layers.N... (as for the vision blocks)
    ln_final                                     text_model.final_layer_norm
    text_projection [width, embed]               text_projection.weight [embed, width] (transposed)
    logit_scale                                  logit_scale (both store the log)

Text pooling: open_clip takes the features at the highest token id (its end-of-text token, the last of the
vocabulary); a transformers CLIP text config with eos_token_id 2 does exactly that (argmax of the ids), so the
converted config says 2, as the hub's own conversions of the LAION models do.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import re
from pathlib import Path

import torch

__all__ = ["CheckpointFormatError", "load_state_file", "open_clip_to_transformers", "clip_model_from_open_clip"]


class CheckpointFormatError(ValueError):
    """A checkpoint file that cannot be read as the state dict it should be (names the file)."""


def load_state_file(path: str | Path, what: str) -> dict[str, torch.Tensor]:
    """The state dict in a .safetensors file or a torch pickle, unwrapped from a {'state_dict': ...} checkpoint.

    Pickles are read with `weights_only=True`: one that holds anything but tensors and plain containers (a pickle
    that would run code when loaded) is refused with CheckpointFormatError naming the file, never executed."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: no such checkpoint file {p}")
    if p.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except SafetensorError as err:
            raise CheckpointFormatError(f"{what}: {p} could not be read as safetensors: {err}") from err
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointFormatError(
            f"{what}: refusing to load {p}: it is not a weights-only checkpoint (torch.load(weights_only=True) "
            f"failed: {first}). A pickle that holds code or arbitrary Python objects is never executed here; "
            f"re-save its state dict alone (torch.save(model.state_dict(), ...)) or as .safetensors") from err
    except (RuntimeError, EOFError, OSError) as err:  # not a torch file at all, or truncated
        raise CheckpointFormatError(f"{what}: {p} could not be read as a torch checkpoint: {err}") from err
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointFormatError(f"{what}: {p} does not hold a state dict (a dict of tensors, or one under "
                                    f"'state_dict'); found {type(state).__name__}")
    return state


# ------------------------------------------------------------------------------------------------ open_clip


_BLOCK = {  # inside a residual block, open_clip -> transformers (in_proj is split separately)
    "ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
}
_IGNORED = {"attn_mask", "visual.attn_mask"}  # the causal mask buffer older open_clip versions saved: rebuilt


def _strip_module_prefix(state: dict) -> dict:
    """Checkpoints saved from a DistributedDataParallel wrapper prefix every key with 'module.'."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def _depth(state: dict, prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {int(m.group(1)) for k in state if (m := pattern.match(k))}
    if found != set(range(len(found))):
        raise CheckpointFormatError(f"open_clip checkpoint: blocks {sorted(found)} under {prefix} are not 0..n-1")
    return len(found)


def _tower(state: dict, src: str, dst: str, depth: int, out: dict) -> None:
    """The residual blocks src{N}.* -> dst{N}.* (q/k/v split out of in_proj)."""
    for n in range(depth):
        s, d = f"{src}{n}.", f"{dst}{n}."
        for name, weight in (("weight", state[s + "attn.in_proj_weight"]), ("bias", state[s + "attn.in_proj_bias"])):
            q, k, v = weight.chunk(3, dim=0)
            out[d + f"self_attn.q_proj.{name}"] = q
            out[d + f"self_attn.k_proj.{name}"] = k
            out[d + f"self_attn.v_proj.{name}"] = v
        for a, b in _BLOCK.items():
            for p in ("weight", "bias"):
                out[d + f"{b}.{p}"] = state[s + f"{a}.{p}"]


def _heads(width: int, head_dim: int, where: str) -> int:
    if width % head_dim:
        raise CheckpointFormatError(f"open_clip checkpoint: {where} width {width} is not a multiple of the head "
                                    f"width {head_dim}")
    return width // head_dim


def open_clip_to_transformers(state: dict[str, torch.Tensor], *, head_dim: int = 64, hidden_act: str = "gelu"):
    """(CLIPConfig, state dict for CLIPModel) from an open_clip ViT CLIP state dict (see the module docstring).
    Raises CheckpointFormatError naming missing or unknown keys: a checkpoint of another architecture (a
    CustomTextCLIP, layer scale, attention pooling) is refused rather than loaded wrong."""
    from transformers import CLIPConfig

    state = _strip_module_prefix(dict(state))
    needed = ["visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding", "visual.proj",
              "token_embedding.weight", "positional_embedding", "text_projection", "logit_scale"]
    missing = [k for k in needed if k not in state]
    if missing:
        raise CheckpointFormatError(f"not an open_clip ViT CLIP state dict: no {missing} "
                                    f"(it has e.g. {sorted(state)[:5]})")
    v_depth, t_depth = _depth(state, "visual.transformer.resblocks."), _depth(state, "transformer.resblocks.")

    out: dict[str, torch.Tensor] = {}
    _tower(state, "visual.transformer.resblocks.", "vision_model.encoder.layers.", v_depth, out)
    _tower(state, "transformer.resblocks.", "text_model.encoder.layers.", t_depth, out)
    same = {
        "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
        "visual.class_embedding": "vision_model.embeddings.class_embedding",
        "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
        "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
        "positional_embedding": "text_model.embeddings.position_embedding.weight",
        "logit_scale": "logit_scale",
    }
    for ln_src, ln_dst in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post",
                           "vision_model.post_layernorm"), ("ln_final", "text_model.final_layer_norm")):
        same |= {f"{ln_src}.{p}": f"{ln_dst}.{p}" for p in ("weight", "bias")}
    for a, b in same.items():
        if a not in state:
            raise CheckpointFormatError(f"not an open_clip ViT CLIP state dict: no {a!r}")
        out[b] = state[a]
    # open_clip multiplies x @ proj ([width, embed]); a Linear stores [embed, width]
    out["visual_projection.weight"] = state["visual.proj"].t()
    out["text_projection.weight"] = state["text_projection"].t()
    out["logit_scale"] = state["logit_scale"].reshape(())

    used = set(same) | {"visual.proj", "text_projection"} | _IGNORED
    used |= {k for k in state if k.startswith(("visual.transformer.resblocks.", "transformer.resblocks."))
             and _block_key_known(k)}
    unknown = sorted(set(state) - used)
    if unknown:
        raise CheckpointFormatError(f"open_clip checkpoint has keys this conversion does not map (another "
                                    f"architecture?): {unknown[:8]}")

    conv = state["visual.conv1.weight"]  # [width, 3, patch, patch]
    v_width, patch = conv.shape[0], conv.shape[-1]
    grid = math.isqrt(state["visual.positional_embedding"].shape[0] - 1)  # grid^2 patches + the class token
    t_width = state["token_embedding.weight"].shape[1]
    embed = state["text_projection"].shape[1]
    if state["visual.proj"].shape[1] != embed:
        raise CheckpointFormatError(f"open_clip checkpoint: image projection to {state['visual.proj'].shape[1]} "
                                    f"but text projection to {embed}")
    vision = dict(hidden_size=v_width, num_hidden_layers=v_depth,
                  num_attention_heads=_heads(v_width, head_dim, "vision"),
                  intermediate_size=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                  patch_size=patch, image_size=grid * patch, hidden_act=hidden_act)
    text = dict(hidden_size=t_width, num_hidden_layers=t_depth,
                num_attention_heads=_heads(t_width, head_dim, "text"),
                intermediate_size=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                vocab_size=state["token_embedding.weight"].shape[0],
                max_position_embeddings=state["positional_embedding"].shape[0], hidden_act=hidden_act,
                eos_token_id=2)  # 2: pool at the argmax token id, open_clip's end-of-text (module docstring)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=embed,
                        logit_scale_init_value=float(out["logit_scale"]))
    return config, out


def _block_key_known(key: str) -> bool:
    rest = key.split(".resblocks.", 1)[1].split(".", 1)[1]  # after "N."
    known = {"attn.in_proj_weight", "attn.in_proj_bias"} | {f"{a}.{p}" for a in _BLOCK for p in ("weight", "bias")}
    return rest in known


@contextlib.contextmanager
def _no_weight_init():
    """Skip the random initialisation every weight is about to be overwritten by (seconds for a ViT-H on CPU).
    transformers keeps this helper in a module that moved between versions; without it, construction is slower."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            no_init_weights = contextlib.nullcontext
    with no_init_weights():
        yield


def clip_model_from_open_clip(state: dict[str, torch.Tensor], *, head_dim: int = 64, hidden_act: str = "gelu"):
    """A transformers CLIPModel holding an open_clip checkpoint's weights (float32, eval mode)."""
    from transformers import CLIPModel

    config, converted = open_clip_to_transformers(state, head_dim=head_dim, hidden_act=hidden_act)
    with _no_weight_init():
        model = CLIPModel(config)
    try:
        model.load_state_dict(converted, strict=True)
    except RuntimeError as err:  # a shape the inferred config got wrong: say so rather than load garbage
        raise CheckpointFormatError(f"open_clip checkpoint does not fit the CLIP config read from its shapes: {err}"
                                    ) from err
    return model.float().eval()
