"""CPU measurement of the activation coefficients activations.py composes (see its docstring).

    jagg-estimate CONFIG ... --measure      measures what the config needs and coefficients.json lacks

One real block of each type of a transformer runs at its true width on a few hundred tokens, in three modes
(with grad, with per-block checkpointing as diffusers does it, without grad); torch.profiler's memory events give
the tensor peak. Per block type and mode four quantities are recorded and fit as rows x (a x image tokens + b x
text tokens + c) + d over six (rows, image tokens, text tokens) points (POINTS):

    fpeak   peak during the forward, above its inputs        keep    bytes left after the forward (saved + outputs)
    out     bytes of the outputs (= their gradients)         bpeak   peak during the backward, above its start

The whole transformer with one block of each type is measured too; what the composition of its blocks does not
explain is the root residual (embedders, head, their saved tensors), fit the same way. Frozen components (text
encoders, VAE decoder, reward CLIP) are measured without grad as the pipeline calls them.

bf16 runs emulate the GPU: bf16 parameters and inputs cast to bf16 at the root and every block (FSDP2's
MixedPrecisionPolicy), CPU autocast, and layer_norm / group_norm in float32 (CUDA autocast's float32 list; CPU
autocast keeps them in bf16). Block inputs are captured from a no-grad forward of the model, so their dtypes are
the model's.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from ..models.registry import family, family_of_transformer
from .activations import compose
from .shapes import block_lists, clean, meta_module

# (rows, image patches h x w, text tokens): image tokens 64 / 256, text 32 / 128, rows 1 / 2 / 4 (six points, four
# coefficients: a least-squares fit whose worst relative residual is recorded)
POINTS = [(1, 8, 8, 32), (1, 16, 16, 32), (1, 8, 8, 128), (2, 8, 8, 32), (4, 8, 8, 32), (2, 16, 16, 128)]
MODES = ("grad", "ckpt", "nograd")


def _profile(fn):
    """(peak, end) of live tensor bytes above the start while fn runs, from the allocator's events; fn's result."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type().name == "CPU"), key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak, cur, out


def cuda_autocast_numerics():
    """CUDA autocast runs layer_norm / group_norm in float32 (CPU autocast keeps bf16): emulate it on the CPU."""
    import torch.nn.functional as F

    def fp32(func):
        def wrapped(*args, **kwargs):
            if not torch.is_autocast_enabled("cpu"):
                return func(*args, **kwargs)
            up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            with torch.autocast("cpu", enabled=False):
                return func(*map(up, args), **{k: up(v) for k, v in kwargs.items()})
        wrapped.jagg_fp32 = True
        return wrapped

    for name in ("layer_norm", "group_norm"):
        if not getattr(getattr(F, name), "jagg_fp32", False):
            setattr(F, name, fp32(getattr(F, name)))


def _to_bf16(x):
    if isinstance(x, torch.Tensor):
        return x.to(torch.bfloat16) if x.is_floating_point() else x
    return type(x)(_to_bf16(v) for v in x) if isinstance(x, (tuple, list)) else x


def cast_inputs_hook(module, args, kwargs):  # FSDP2 MixedPrecisionPolicy(cast_forward_inputs=True)
    return _to_bf16(args), {k: _to_bf16(v) for k, v in kwargs.items()}


def model_inputs(kind: str, cfg: dict, n: int, h: int, w: int, t: int, device: str = "cpu", frames: int = 1) -> dict:
    """The transformer's forward arguments for n rows of h x w image tokens (Wan: frames x h x w) and t text tokens, as
    the family's adapter (models/<family>.py) calls it (its Family.inputs): random on the CPU (the measurement) or on
    the meta device (FLOPs, steptime.py)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device)
    u = lambda n: torch.rand(n, generator=g).to(device)
    return family(kind).inputs(cfg, n, h, w, t, r, u, device, frames)


def _min_transformer(comp: dict) -> tuple[torch.nn.Module, list[str]]:
    """The transformer at its real width with one block of each type; the real depth's block types in order."""
    cfg = clean(comp["config"])
    lib = importlib.import_module("diffusers")
    types, small = _family(comp).blocks(cfg, max(POINTS[-1][1:3]))  # the family's block layout
    torch.manual_seed(0)
    return getattr(lib, comp["class"])(**small), types


def measure_transformer(comp: dict, precision: str, lora_rank: int, targets=()) -> dict:
    """Fit coefficients of every measured quantity of each block type and of the root residual (module docstring);
    with LoRA of `lora_rank` on `targets` (models/lora.py lora_targets)."""
    from torch.utils.checkpoint import checkpoint

    kind = transformer_kind(comp)
    model, types = _min_transformer(comp)
    if lora_rank:
        from peft import LoraConfig

        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=list(targets)))
    blocks = [b for bl in block_lists(model) for b in bl]
    kinds = list(dict.fromkeys(types))
    if precision == "bf16_mp":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        for mod in [model, *blocks]:
            mod.register_forward_pre_hook(cast_inputs_hook, with_kwargs=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    cuda_autocast_numerics()
    amp = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
    cfg = clean(comp["config"])

    def run(fn, args, mode):
        """(forward peak, saved after forward, output bytes, backward peak) of fn(*args) in mode."""
        with amp():
            if mode == "nograd":
                with torch.no_grad():
                    peak, end, out = _profile(lambda: fn(*args))
                return peak, end, end, 0
            call = (lambda: checkpoint(fn, *args, use_reentrant=False)) if mode == "ckpt" else (lambda: fn(*args))
            fpeak, keep, out = _profile(call)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
            ups = [torch.randn_like(o) for o in outs]
            bpeak, _, _ = _profile(lambda: torch.autograd.backward(outs, ups))
            return fpeak, keep, sum(o.numel() * o.element_size() for o in outs), bpeak

    samples = {k: {} for k in kinds + ["model"]}
    for pt in POINTS:
        n, h, w, t = pt
        inputs = model_inputs(kind, cfg, n, h, w, t)
        captured = {}
        hooks = [b.register_forward_pre_hook(lambda m, a, kw, i=i, captured=captured: captured.setdefault(i, (a, kw)),
                                             with_kwargs=True)
                 for i, b in enumerate(blocks)]
        with torch.no_grad(), amp():
            model(**inputs)
        for hk in hooks:
            hk.remove()
        for i, b in enumerate(blocks):
            call = inspect.signature(b.forward).bind(*captured[i][0], **captured[i][1])
            call.apply_defaults()  # every argument in the forward's order, passed or not
            block = functools.partial(b, **call.kwargs)
            for mode in MODES:
                fresh = [x.detach().requires_grad_(bool(trainable))  # as inside the model: they depend on weights
                         if isinstance(x, torch.Tensor) and x.is_floating_point() and k != "image_rotary_emb" else x
                         for k, x in zip(call.arguments, call.args)]
                if pt == POINTS[0]:
                    run(block, fresh, mode)  # warm-up (lazy initialisation)
                samples[kinds[i]].setdefault(mode, []).append((pt, run(block, fresh, mode)))
        fn = lambda **kw: model(**kw)[0]
        for mode in MODES:
            model.disable_gradient_checkpointing() if mode != "ckpt" else model.enable_gradient_checkpointing()
            call = lambda *a, fn=fn, inputs=inputs: fn(**inputs)
            if pt == POINTS[0]:
                run(call, [], "grad" if mode == "ckpt" else mode)
            samples["model"].setdefault(mode, []).append((pt, run(call, [], "grad" if mode == "ckpt" else mode)))
    fits, worst = {}, 0.0
    names = ("fpeak", "keep", "out", "bpeak")
    for k in kinds:
        fits[k] = {f"{q}_{mode}": _fit([(pt, v[j]) for pt, v in samples[k][mode]])
                   for mode in MODES for j, q in enumerate(names)}
    for mode in MODES:  # root residual: whole model minus the composed blocks of the min model
        resid = []
        for pt, v in samples["model"][mode]:
            whole = v[0] if mode == "nograd" else max(v[0], v[1] + v[2] + v[3])
            resid.append((pt, whole - compose(fits, kinds, mode, *_tok(pt))))
        # the root's tensors do not shrink as rows and tokens grow: where a constant transient of the root (its weight
        # gradients) outweighs the blocks at the small measured sizes, an unconstrained fit's negative slope would
        # extrapolate to a negative root at production sizes (Wan2.1-14B: -23 GB at 33k tokens)
        fits[f"root_{mode}"] = _fit(resid, nonneg=True)
    for k in kinds:
        for _q, coef in fits[k].items():
            worst = max(worst, coef[4])
    return {"types": types, "fits": fits, "max_rel_fit_residual": worst}


def _family(comp: dict):
    """The family whose transformer the component is (the first registered one: FLUX.1 before Kontext)."""
    fam = family_of_transformer(comp["class"])
    if fam is None or fam.blocks is None:
        raise ValueError(f"{comp['class']}: no registered model family measures this transformer (models/registry.py)")
    return fam


def transformer_kind(comp: dict) -> str:
    """The family of a transformer component, from its class."""
    return _family(comp).name


def _tok(pt):
    n, h, w, t = pt
    return n, h * w, t


def _fit(samples, nonneg: bool = False) -> list[float]:
    """Least squares bytes = rows x (a image tokens + b text tokens + c) + d; [a, b, c, d, max relative residual].
    nonneg: a, b, c >= 0 (the best fit over the ways of holding some of them at 0)."""
    import itertools

    X = torch.tensor([[n * i, n * t, n, 1.0] for (n, i, t) in (_tok(pt) for pt, _ in samples)], dtype=torch.float64)
    y = torch.tensor([float(v) for _, v in samples], dtype=torch.float64)
    best = None
    for zero in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in range(4 if nonneg else 1)):
        keep = [j for j in range(4) if j not in zero]
        coef = torch.zeros(4, dtype=torch.float64)
        # minimum norm where a variable does not vary (a fixed sequence length)
        coef[keep] = torch.linalg.pinv(X[:, keep]) @ y
        err = float(((X @ coef - y) ** 2).sum())
        if (coef[:3] >= 0).all() or not nonneg:
            best = min(best or (err, coef), (err, coef), key=lambda e: e[0])
    coef = best[1]
    rel = ((X @ coef - y).abs() / y.abs().clamp_min(1.0)).max()
    return [*coef.tolist(), float(rel)]


def measure_nograd(comp: dict, what: str, dtype: torch.dtype, seq: int) -> list[float]:
    """Fit of the no-grad forward peak of a frozen component: a text encoder on `seq` tokens, the VAE decoder
    (per latent pixel; a video VAE, what "video": per latent pixel of a frame and of the video) or a reward CLIP (per
    224 px image), as the pipeline / reward calls them."""
    config = clean(comp["config"])
    if what == "t5":
        config["num_layers"] = min(2, config["num_layers"])  # the peak does not grow with depth (no hidden states kept)
    layers_kept = per_token = 0
    if what in ("qwen", "qwen_lm"):  # a Qwen LM as the pipelines run it: output_hidden_states keeps every layer's
        # output; qwen (QwenImagePipeline's Qwen2.5-VL, ZImagePipeline's Qwen3Model) at the model's default use_cache,
        # so each layer's K/V too; qwen_lm (Flux2KleinPipeline's Qwen3ForCausalLM) with use_cache=False and the LM
        # head on the last token alone (models/flux2.py last_token_logits)
        nested = "text_config" in config  # Qwen2.5-VL nests its language model's config; Qwen3's is flat
        text = config["text_config"] if nested else config
        layers_kept = text["num_hidden_layers"] - 2  # measured on 2 layers; the other layers' tensors added below
        head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        cache = what == "qwen" and text.get("use_cache", True)
        per_token = text["hidden_size"] + (2 * text["num_key_value_heads"] * head if cache else 0)
        small = dict(text, num_hidden_layers=2)
        config = dict(config, text_config=small) if nested else small
        if "vision_config" in config:
            config["vision_config"] = dict(config["vision_config"], depth=1, fullatt_block_indexes=[0])
    if what == "reward":
        config["text_config"] = dict(config["text_config"], num_hidden_layers=2)
        config["vision_config"] = dict(config["vision_config"], num_hidden_layers=2)
    torch.manual_seed(0)
    module = meta_module(dict(comp, config=config), "cpu").to(dtype).eval()
    samples = []
    # the VAE from 2 images up: with one image the CPU convolution takes an im2col path (9x its input, +56 KB per
    # latent pixel) that 2+ images and cuDNN do not; from 2 up the peak is linear, 96 KB per latent pixel and image
    grid = ((2, 16), (3, 16), (2, 32), (3, 32), (2, 48)) if what == "vae" else ((1, 0), (2, 0), (3, 0))
    if what == "video":  # (images, latent side, latent frames): Wan's decoder runs a latent frame at a time with a
        # cache (a working set per frame, larger than the first frame's from the second on, which decodes 4) and
        # concatenates the frames; from 4 latent frames up the peak grows slowly and linearly with the frames (a
        # frame's working set dominates the video's output at production sizes), measured up to 12; sides 16 and 24
        # (below them a frame's borders weigh more: the working set per latent pixel is lower at side 8)
        grid = ((2, 16, 4), (3, 16, 4), (2, 16, 8), (2, 16, 12), (2, 24, 4), (3, 24, 6))
    for n, size, *frames in grid:
        if what == "video":  # fit as images x (a x side^2 + b x frames x side^2 + c) + d (models/wan.py decode)
            x = torch.randn(n, config["z_dim"], frames[0], size, size, dtype=dtype)
            fn = lambda x=x: ((module.decode(x, return_dict=False)[0].float() + 1) / 2).clamp(0, 1)
            pt = (n, size, size, frames[0] * size * size)
        elif what == "vae":
            video = "z_dim" in config  # Qwen-Image's VAE decodes [N, C, 1, H, W] (models/qwenimage.py)
            x = torch.randn(n, config["z_dim"] if video else config["latent_channels"], *([1] if video else []), size,
                            size, dtype=dtype)
            fn = lambda x=x: ((module.decode(x, return_dict=False)[0].float() + 1) / 2).clamp(0, 1)
            pt = (n, size, size, 0)
        elif what == "reward":
            img = config["vision_config"]["image_size"]
            x = torch.randn(n, 3, img, img, dtype=dtype)
            fn = lambda x=x: module.get_image_features(pixel_values=x)
            pt = (n, 0, 0, 1)
        else:
            x = torch.randint(0, 100, (n, seq)) % module.config.vocab_size
            # SD3 takes CLIP's penultimate hidden state, the Qwen pipelines some of the LM's: every output is kept
            hidden = {"clip_hidden": {}, "qwen": {}, "qwen_lm": {"use_cache": False, "logits_to_keep": 1}}.get(what)
            fn = lambda x=x, hidden=hidden: module(x, output_hidden_states=True, **hidden) if hidden is not None \
                else module(x)[0]
            pt = (n, 0, 0, seq)
        with torch.no_grad():
            fn()
            kept = layers_kept * n * seq * per_token * dtype.itemsize
            samples.append((pt, _profile(fn)[0] + kept))
    return _fit(samples, nonneg=what == "video")  # a longer video does not decode in less memory


