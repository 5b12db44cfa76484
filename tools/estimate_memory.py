"""Per-rank peak memory of a jagg-scale training step, by component, and the largest train.micro_batch_size that fits.

    python tools/estimate_memory.py CONFIG [key=value ...] --world-size N --gpu-mem GIB [--headroom 0.1]
    python tools/estimate_memory.py --counts                 parameter counts of the shapes in tools/model_shapes
    python tools/estimate_memory.py CONFIG ... --measure     measure missing activation coefficients on this CPU

Shapes: a pipeline directory's config.json files, or tools/model_shapes/NAME.json for a model.pretrained that is not
here (matched by name, or --shapes NAME); components are instantiated on the meta device and counted.

Weights, gradients, optimizer states, EMA, KL reference, frozen encoders/VAE, reward models, rollout storage: counted
from the config and the shapes, each term naming the code it mirrors (docs/scale.md tabulates them). The transformer
is held in fp32 master weights, bf16 in compute; FSDP2 shards weights, AdamW states, EMA and (grad_sync every)
gradients, gathers the root and two blocks, and during each block's backward holds its unsharded gradient, the fp32
reduce-scatter input and the previous block's one in flight. LoRA: only the adapter has gradients and states, its
KL reference is the adapter off. Activations are measured (tools/model_shapes/measure.py): per block type, at the
true width, on the CPU, fit linear in rows and tokens, composed over the real depth:

    forward   peak = max over blocks of (saved so far + that block's forward peak)
    backward  peak = max over blocks, last first, of (saved so far + grad of its outputs + its backward peak
                     + FSDP2's reduce buffers of that block)

plus a residual for the embedders and the head. Phases of a step (each a sum of components; the peak is the max):

    encode     text encoders on this rank's prompts (all at once, as Policy.encode does)
    rollout    no-grad sampling chunks (CFG: 2x rows) while the previous chunk is decoded and scored; then
               Trajectories.cat holding the chunks and their concatenation
    update     one with-grad pass of rows_per_pass x micro_batch_size rows (a JAGG joint pass: 2 x micro)
    optimizer  AdamW step (foreach temporaries) with gradients and states
    eval       eval.batch_size images at a time (CFG: 2x rows): encode, ODE, decode, score in turn

Not tensors, added to every phase: --overhead-gb (CUDA context, cuBLAS/NCCL workspaces; default 1.5 GiB). A config
fits when total <= (1 - headroom) x GPU memory; the headroom covers the caching allocator's fragmentation.
parallel.backend deepspeed is approximated as fsdp2 plus ZeRO-3's bf16 parameter shard.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
SHAPES = ROOT / "tools" / "model_shapes"
MEASURED = Path(os.environ.get("JAGG_ESTIMATE_CACHE", SHAPES / "measured.json"))  # the coefficient cache
GiB = 2**30
KNOWN = {"stable-diffusion-3.5-medium": "sd35_medium", "stable-diffusion-3.5-large": "sd35_large",
         "flux.1-dev": "flux1_dev", "flux1-dev": "flux1_dev"}
FROZEN = {"sd3": ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"),
          "flux": ("vae", "text_encoder", "text_encoder_2")}
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def load_run_config(path, overrides=()):
    """The run config with its own checks, without the file checks (the production paths do not exist here)."""
    import yaml

    from jagg_scale.train import config as C

    data = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        C._set_dotted(data, *C.parse_override(item))
    cfg = C._build(C.Config, data, "")
    for name in cfg.__dataclass_fields__:
        getattr(cfg, name).check(name)
    return cfg


def pipeline_shapes(cfg, name: str | None = None) -> dict:
    """{kind, components: {name: {class, library, config}}, text_tokens} from a pipeline directory or a shape file."""
    from jagg_scale.paths import resolve_path

    if name is None:
        path = resolve_path(cfg.model.pretrained)
        if (path / "model_index.json").is_file():
            return _from_directory(path, cfg.model.kind)
        name = next((v for k, v in KNOWN.items() if k in path.name.lower()), None)
        if name is None:
            raise SystemExit(f"model.pretrained {path} is not a pipeline directory here and not a known checkpoint "
                             f"({', '.join(KNOWN)}): pass --shapes NAME (tools/model_shapes/NAME.json)")
    return json.loads((SHAPES / f"{name}.json").read_text())


def _from_directory(path: Path, kind: str) -> dict:
    from jagg_scale.models import stored_dtype

    index = json.loads((path / "model_index.json").read_text())
    comps = {n: {"library": index[n][0], "class": index[n][1], "config": json.loads((path / n / "config.json").read_text())}
             for n in ("transformer",) + FROZEN[kind] if n in index and index[n][0] is not None}
    comps["transformer"]["stored_dtype"] = str(stored_dtype(path / "transformer")).replace("torch.", "")

    def max_len(tok, cap):
        f = path / tok / "tokenizer_config.json"
        return min(cap, int(json.loads(f.read_text()).get("model_max_length", cap)) if f.is_file() else cap)

    text = ({"clip": max_len("tokenizer", 77), "t5": max_len("tokenizer_3", 256)} if kind == "sd3"
            else {"clip": max_len("tokenizer", 77), "t5": max_len("tokenizer_2", 512)})
    return {"name": path.name, "kind": kind, "components": comps, "text_tokens": text}


def meta_module(comp: dict, device: str = "meta") -> torch.nn.Module:
    lib = importlib.import_module(comp["library"])
    cls, config = getattr(lib, comp["class"]), dict(comp["config"])
    with torch.device(device):
        if comp["library"] == "diffusers":
            return cls.from_config(config)
        return cls(cls.config_class(**{k: v for k, v in config.items() if not k.startswith("_")}))


def block_lists(module: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The transformer's block lists in forward order (the FSDP2 units of parallel/fsdp.py block_slots)."""
    return [m for n, m in module.named_children() if isinstance(m, torch.nn.ModuleList)]


def transformer_stats(comp: dict, lora_rank: int = 0, targets=LORA_TARGETS) -> dict:
    return _stats(json.dumps(comp, sort_keys=True), lora_rank, tuple(targets))


@functools.lru_cache(maxsize=None)
def _stats(comp_json: str, lora_rank: int, targets: tuple) -> dict:
    m = meta_module(json.loads(comp_json))
    n = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    blocks = [b for bl in block_lists(m) for b in bl]

    def lora(mod):
        return sum(lora_rank * (x.in_features + x.out_features) for name, x in mod.named_modules()
                   if isinstance(x, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))

    return {"params": n(m), "buffers": sum(b.numel() * b.element_size() for b in m.buffers()),
            "block_params": [n(b) for b in blocks], "root_params": n(m) - sum(n(b) for b in blocks),
            "lora_params": lora(m) if lora_rank else 0, "block_lora": [lora(b) for b in blocks] if lora_rank else []}


def component_params(comp: dict) -> int:
    return _params(json.dumps({k: comp[k] for k in ("library", "class", "config")}, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _params(comp_json: str) -> int:
    return sum(p.numel() for p in meta_module(json.loads(comp_json)).parameters())


def reward_models(cfg) -> dict[str, dict]:
    """{reward name: CLIPModel component} of the GPU reward models the config scores with."""
    from jagg_scale.paths import resolve_path

    table = json.loads((SHAPES / "rewards.json").read_text())
    spec = cfg.reward.components or {cfg.reward.name: cfg.reward.options}
    out = {}
    for name, opts in spec.items():
        opts = opts or {}
        path = opts.get("path") or opts.get("clip_path")
        if path and (resolve_path(path) / "config.json").is_file():
            out[name] = {"library": "transformers", "class": "CLIPModel",
                         "config": json.loads((resolve_path(path) / "config.json").read_text()), "options": opts}
        elif table["models"].get(name):
            out[name] = dict(table["models"][name], options=opts)
        elif name not in table["gpu_free"]:
            print(f"note: reward {name!r} not estimated (no shape; 0 bytes assumed)", file=sys.stderr)
    return out


def _key(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _clean(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _ev(coef, n, i, t, clamp=True) -> float:
    a, b, c, d = coef[:4]
    v = n * (a * i + b * t + c) + d
    return max(0.0, v) if clamp else v


def compose(fits: dict, types: list[str], mode: str, n: int, i: int, t: int, extra=None) -> float:
    """Peak bytes of the blocks `types` in forward then backward order (module docstring); mode grad|ckpt|nograd.
    `extra[j]`: bytes that exist only during block j's backward (FSDP2's gradient reduce buffers)."""
    q = lambda name, k: _ev(fits[k][f"{name}_{mode}"], n, i, t)  # noqa: E731
    if mode == "nograd":
        return max(q("fpeak", k) for k in set(types)) + q("out", types[-1])
    level = peak = 0.0
    for k in types:
        peak = max(peak, level + q("fpeak", k))
        level += q("keep", k)
    for j in reversed(range(len(types))):
        k = types[j]
        peak = max(peak, level + q("out", k) + q("bpeak", k) + (extra[j] if extra else 0.0))
        level -= q("keep", k)
    return peak


def transformer_activations(coef: dict, mode: str, n: int, i: int, t: int, extra=None) -> float:
    if n <= 0:
        return 0.0
    return compose(coef["fits"], coef["types"], mode, n, i, t, extra) + _ev(coef["fits"][f"root_{mode}"], n, i, t, False)


def reduce_buffers(block_train: list[int], cdt: int) -> list[float]:
    """FSDP2's bytes during block j's backward: its unsharded gradient (compute dtype), the float32 reduce-scatter
    input copied from it, and the previous block's reduce-scatter input still in flight (the backward runs on)."""
    nxt = list(block_train[1:]) + [0]
    return [(cdt + 4) * b + 4 * b_prev for b, b_prev in zip(block_train, nxt)]


def cached(key: str, label: str, measure_fn, allow: bool):
    table = json.loads(MEASURED.read_text()) if MEASURED.is_file() else {}
    if key not in table:
        if not allow:
            raise SystemExit(f"no measured coefficients for {label} (key {key}): run with --measure (CPU, minutes)")
        from tools.bench.common import machine_info

        print(f"measuring {label} on the CPU ...", file=sys.stderr, flush=True)
        value = measure_fn()
        table = json.loads(MEASURED.read_text()) if MEASURED.is_file() else {}  # re-read: others may have written
        m = machine_info()
        table[key] = {"label": label, **{k: m.get(k) for k in ("torch", "diffusers", "cpu_model")}, "value": value}
        MEASURED.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table[key]["value"]


COMPONENTS = ["transformer weights", "transformer buffers", "FSDP2 gathered weights + reduce buffers", "gradients",
              "optimizer states", "EMA", "KL reference", "frozen encoders + VAE", "reward models",
              "prompt conditioning", "rollout storage", "minibatch copies + pass inputs", "activations",
              "encoder / sampling / decode / reward transients", "optimizer step temporaries", "eval batch",
              "CUDA context + NCCL (not tensors)"]
PHASES = ["encode", "rollout", "update", "optimizer", "eval"]


def prepare(cfg, world: int, shapes_name: str | None = None, measure: bool = False, overhead_gb: float = 1.5) -> dict:
    """Everything the estimate needs that does not depend on the micro-batch size."""
    from tools.model_shapes.measure import measure_nograd, measure_transformer  # only run when --measure

    shapes = pipeline_shapes(cfg, shapes_name)
    kind, comps = shapes["kind"], shapes["components"]
    tcomp, lora = comps["transformer"], cfg.model.lora
    rank, targets = (lora.rank if lora.enabled else 0), (tuple(lora.targets) or LORA_TARGETS)
    sharded, bf16 = cfg.parallel.backend != "none", cfg.model.dtype == "bfloat16"
    precision = ("bf16_mp" if sharded else "amp") if bf16 else "fp32"
    tc, vae = tcomp["config"], comps["vae"]["config"]
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    if kind == "sd3":
        side = cfg.model.resolution // scale if cfg.model.resolution else tc["sample_size"]
        latent, p = (tc["in_channels"], side, side), tc["patch_size"]
        text = shapes["text_tokens"]["clip"] + shapes["text_tokens"]["t5"]
    else:
        side = (cfg.model.resolution or vae["sample_size"]) // scale
        latent, p = (tc["in_channels"] // 4, side, side), 2
        text = shapes["text_tokens"]["t5"]
    t_key = ("transformer", tcomp["class"], _clean(tc), precision, rank, sorted(targets) if rank else None)
    label = f"{shapes.get('name', tcomp['class'])} transformer, {precision}, {'LoRA r%d' % rank if rank else 'full'}"
    act = cached(_key(*t_key), label, lambda: measure_transformer(tcomp, precision, rank), measure)
    fdt = torch.bfloat16 if bf16 else torch.float32
    t5 = FROZEN[kind][-1]  # model.text_encoders no_t5: not loaded; model.shard_t5: 1/world of it per rank
    frozen = [n for n in FROZEN[kind] if n in comps and not (n == t5 and cfg.model.text_encoders == "no_t5")]
    encoders = {}
    for name in frozen[1:]:
        c = comps[name]
        what = "t5" if c["class"].startswith("T5") else ("clip_hidden" if kind == "sd3" else "clip")
        seq = shapes["text_tokens"]["t5" if what == "t5" else "clip"]
        key = _key(what, c["class"], _clean(c["config"]), str(fdt), seq)
        encoders[name] = {"seq": seq, "coef": cached(key, f"{name} ({c['class']}) no-grad, {fdt}, {seq} tokens",
                          lambda c=c, what=what, seq=seq: measure_nograd(c, what, fdt, seq), measure)}
    vkey = _key("vae", _clean(vae), str(fdt))
    decode = cached(vkey, f"VAE decode, {fdt}", lambda: measure_nograd(comps["vae"], "vae", fdt, 0), measure)
    rewards = {}
    for name, c in reward_models(cfg).items():
        rdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(c["options"].get("dtype"), torch.float32)
        rkey = _key("reward", _clean(c["config"]), str(rdt))
        rewards[name] = {"params": component_params(c), "bytes": rdt.itemsize, "coef": cached(
            rkey, f"reward {name} CLIP no-grad, {rdt}", lambda c=c, rdt=rdt: measure_nograd(c, "reward", rdt, 0), measure)}
    return {"cfg": cfg, "world": world, "kind": kind, "shapes": shapes.get("name"), "precision": precision,
            "sharded": sharded, "bf16": bf16, "lora_rank": rank, "stats": transformer_stats(tcomp, rank, targets),
            "frozen": {n: component_params(comps[n]) / (world if n == t5 and cfg.model.shard_t5 else 1) for n in frozen},
            "encoders": encoders, "ref_bytes": 2 if bf16 and tcomp.get("stored_dtype") == "bfloat16" else 4,
            "decode": decode, "rewards": rewards, "act": act, "latent": latent, "image_tokens": (side // p) ** 2,
            "text_tokens": text, "cond_row": text * tc["joint_attention_dim"] + tc["pooled_projection_dim"],
            "overhead": overhead_gb * GiB, "vae_scale": scale, "eval_images": eval_images(cfg)}


def eval_images(cfg) -> int:
    """Held-out images of an evaluation; eval.grid_images (the most the grid keeps) when the prompt file is absent."""
    from jagg_scale.data import load_prompts
    from jagg_scale.paths import resolve_path

    e, path = cfg.eval, resolve_path(cfg.eval.prompt_file) if cfg.eval.prompt_file else None
    n = len(e.prompts) if e.prompts else len(load_prompts(path)) if path and path.is_file() else None
    return e.grid_images if n is None else n * e.num_per_prompt


def local_rows(cfg, world: int) -> tuple[int, int]:
    """(rows this rank samples per step, its share of a minibatch): train/rows.py StepRows."""
    rows, bs = cfg.train.prompts_per_step * cfg.grpo.group_size, cfg.train.batch_size
    if bs % world or rows % bs:
        raise SystemExit(f"train.batch_size {bs} must be a multiple of the {world} ranks and divide the {rows} rows")
    return rows // world, bs // world


def rows_per_pass(cfg) -> int:
    """With-grad rows per pass in units of the micro-batch: a JAGG joint pass stacks 2 knots (jagg/plans.py)."""
    j, uniform = cfg.jagg, cfg.jagg.plan == "uniform" and not cfg.jagg.share_knots
    if j.mode == "exact" or (uniform and (j.jagg_frac == 0 or j.window <= 1)):
        return 1
    return 2 if uniform else j.rows_per_pass


def shard_group(cfg, world: int) -> int:
    """Ranks one parameter is sharded over: all of them, or world / parallel.replicate under HSDP (fsdp2 only)."""
    replicate = cfg.parallel.replicate if cfg.parallel.backend == "fsdp2" else 1
    if replicate < 1 or world % replicate:
        raise SystemExit(f"parallel.replicate={replicate} must divide the world size {world}")
    return world // replicate


def estimate(s: dict, micro: int | None = None) -> dict:
    """{phase: {component: bytes}} per rank; `micro` overrides train.micro_batch_size (0 / None: whole share)."""
    cfg, W = s["cfg"], s["world"]
    st, shard = s["stats"], s["sharded"]
    div = shard_group(cfg, W) if shard else 1  # HSDP: the states are sharded within a replica group only
    R, B = local_rows(cfg, W)
    m = min(micro or cfg.train.micro_batch_size or B, B)
    lora = s["lora_rank"] > 0
    Pt = st["lora_params"] if lora else st["params"]
    cdt = 2 if s["bf16"] else 4
    cfgg, ref, lat, S = cfg.sampling.guidance != 1.0, cfg.grpo.beta > 0, math.prod(s["latent"]), cfg.sampling.num_steps
    I, T, cond = s["image_tokens"], s["text_tokens"], 4 * s["cond_row"]  # conditioning is float32 (models/sd3.py)
    ckpt = cfg.parallel.activation_checkpointing if shard else cfg.model.gradient_checkpointing
    act = s["act"]

    static = {
        "transformer weights": 4 * st["params"] / div + (4 * st["lora_params"] / div if lora else 0)
        + (2 * st["params"] / div if cfg.parallel.backend == "deepspeed" else 0),  # fp32 master (+ ZeRO-3 bf16 shard)
        "transformer buffers": st["buffers"],  # not sharded (SD3's pos_embed table)
        "optimizer states": 8 * Pt / div,  # AdamW exp_avg + exp_avg_sq, fp32
        "EMA": 4 * Pt / div if cfg.train.ema_decay > 0 else 0,
        # LoRA: the adapter off; else the transformer alone in its checkpoint's dtype, sharded (Trainer, loading.md)
        "KL reference": (s["ref_bytes"] * st["params"] / div + st["buffers"]) if ref and not lora else 0,
        "frozen encoders + VAE": sum(s["frozen"].values()) * cdt,  # compute-dtype copies on every rank
        "reward models": sum(r["params"] * r["bytes"] for r in s["rewards"].values())
        / (W if cfg.reward.shard else 1),
        "CUDA context + NCCL (not tensors)": s["overhead"],
    }
    gather = 0.0
    if shard:  # root unsharded through forward + backward (fp32: parallel/fsdp.py), current + prefetched block
        gather = 4 * st["root_params"] + cdt * 2 * max(st["block_params"])
    reduce = reduce_buffers(st["block_lora"] if lora else st["block_params"], cdt) if shard else None
    sync = cfg.parallel.grad_sync if cfg.parallel.grad_sync != "auto" else ("boundary" if lora else "every")
    grads = 4 * Pt if not shard or sync == "boundary" else 4 * Pt / div
    if shard and sync == "boundary":
        grads += 4 * Pt / div  # the reduced shard next to the unsharded accumulation at the boundary
    row = 4 * lat * ((S + 1) + S * (1 + cfgg + ref)) + 4 * S  # latents, velocities, uncond, ref, log-probs
    store, cond_all = R * row, R * cond * (1 + cfgg)
    steps_per_rollout = (R // B) * cfg.grpo.inner_epochs
    off_policy_cfg = cfgg and steps_per_rollout > 1  # Trainer.update: the uncond of later minibatches is recomputed
    mb = B * row + B * cond * (1 + off_policy_cfg)  # step_batch and index_cond copies; micro-batches are views
    mb += m * S * lat * 4 if off_policy_cfg else 0  # Policy.fresh_uncond's clone, per micro-batch
    rows = rows_per_pass(cfg) * m
    pass_in = rows * (4 * 4 * lat + cond)  # stacked latents, v, G and its parts (float32), repeated conditioning
    mode = "ckpt" if ckpt else "grad"
    activ = transformer_activations(act, mode, rows, I, T)
    reduce_buf = transformer_activations(act, mode, rows, I, T, reduce) - activ if shard else 0.0
    interior = max(0, cfg.jagg.window - 2)
    forward_mode = cfg.jagg.intermediate == "forward" or (cfg.jagg.intermediate == "auto" and steps_per_rollout > 1)
    if rows_per_pass(cfg) > 1 and interior and forward_mode:  # no-grad forwards of the interior steps (jagg/backward.py)
        saved = sum(_ev(act["fits"][k][f"keep_{mode}"], rows, I, T) for k in act["types"]) \
            + _ev(act["fits"][f"root_{mode}"], rows, I, T)  # the pass's graph, alive while the interior runs
        nograd = transformer_activations(act, "nograd", interior * m, I, T) + interior * m * (cond + 8 * lat)
        activ = max(activ, saved + nograd)

    def encoders(n):  # Policy.encode: each encoder in turn on n prompts
        return max((_ev(c["coef"], n, 0, c["seq"]) for c in s["encoders"].values()), default=0.0)

    def score(n):  # decode n latents (ChunkScorer) and score them (rewards/clip.py resizes float images first)
        side = s["latent"][1]
        img = n * 3 * (side * s["vae_scale"]) ** 2 * 4
        return _ev(s["decode"], n, side * side, 0) + sum(_ev(r["coef"], n, 0, 1) for r in s["rewards"].values()) \
            + (2 * img if s["rewards"] else 0)

    bs = cfg.sampling.batch_size
    sample_rows = bs * (1 + cfgg)
    sampling = transformer_activations(act, "nograd", sample_rows, I, T) + sample_rows * (3 * 4 * lat + cond) + score(bs)
    e = cfg.eval.batch_size  # train/evaluate.py: per batch encode, ODE, decode, score in turn; a grid kept (uint8)
    e_rows = e * (1 + cfgg)
    grid = min(cfg.eval.grid_images, s["eval_images"]) * 3 * (s["latent"][1] * s["vae_scale"]) ** 2
    eval_batch = (e * cond * (1 + cfgg) + 2 * e * lat * 4 + grid + max(encoders(e), score(e), transformer_activations(
        act, "nograd", e_rows, I, T) + e_rows * (3 * 4 * lat + cond))) if cfg.eval.enabled else 0
    eval_batch += 4 * Pt / div if cfg.train.ema_decay > 0 and cfg.eval.enabled else 0  # ema_weights' live copy
    dyn = {
        "encode": {"prompt conditioning": cond_all, "encoder / sampling / decode / reward transients": encoders(R)},
        "rollout": {"FSDP2 gathered weights + reduce buffers": gather, "prompt conditioning": cond_all,
                    # the last chunk's sampling, or Trajectories.cat holding the chunks and their concatenation
                    "rollout storage": store + R * lat * 4 + (store if store > sampling else 0),
                    "encoder / sampling / decode / reward transients": sampling if sampling >= store else 0},
        "update": {"FSDP2 gathered weights + reduce buffers": gather + reduce_buf, "gradients": grads,
                   "prompt conditioning": cond_all, "rollout storage": store,
                   "minibatch copies + pass inputs": mb + pass_in, "activations": activ},
        # Trainer.update makes the next minibatch's copies while the previous ones are alive (gradients are None)
        "update_switch": {"prompt conditioning": cond_all, "rollout storage": store, "minibatch copies + pass inputs": 2 * mb},
        "optimizer": {"gradients": grads, "prompt conditioning": cond_all, "rollout storage": store,
                      "minibatch copies + pass inputs": mb, "optimizer step temporaries": 4 * Pt / div},
        "eval": {"FSDP2 gathered weights + reduce buffers": gather, "eval batch": eval_batch},
    }
    out = {}
    for ph in PHASES:
        comp = {c: static.get(c, 0.0) + dyn[ph].get(c, 0.0) for c in COMPONENTS}
        if ph == "update" and sum(dyn["update_switch"].values()) > sum(dyn["update"].values()):
            comp = {c: static.get(c, 0.0) + dyn["update_switch"].get(c, 0.0) for c in COMPONENTS}
        out[ph] = {"components": comp, "total": sum(comp.values())}
    peak = max(PHASES, key=lambda ph: out[ph]["total"])
    return {"phases": out, "peak_phase": peak, "total": out[peak]["total"], "micro_batch_size": m,
            "pass_rows": rows, "local_rows": R, "local_batch": B, "grad_sync": sync, "checkpointing": ckpt}


def balanced(m: int, share: int) -> int:
    """The smallest micro-batch that cuts a minibatch share into as few chunks as `m` does (even chunks)."""
    return -(-share // -(-share // m))


def choose_micro(s: dict, gpu_gib: float, headroom: float = 0.10) -> tuple[int | None, dict]:
    """The largest micro-batch (rows per chunk of the rank's minibatch share) that fits, or None (then micro 1's)."""
    limit = (1 - headroom) * gpu_gib * GiB
    _, B = local_rows(s["cfg"], s["world"])
    for m in range(B, 0, -1):
        est = estimate(s, m)
        if est["total"] <= limit:
            return m, est
    return None, est


def report(s: dict, est: dict, gpu_gib: float | None = None, headroom: float = 0.10) -> str:
    cfg = s["cfg"]
    train = f"LoRA r{s['lora_rank']}" if s["lora_rank"] else "full fine-tune"
    group = shard_group(cfg, s["world"]) if s["sharded"] else s["world"]
    hsdp = f" (HSDP: {s['world'] // group} replicas of {group})" if group != s["world"] else ""
    head = (f"{s['shapes']} ({s['kind']}), {s['precision']}, {train}, backend {cfg.parallel.backend} x {s['world']} ranks{hsdp}, "
            f"grad_sync {est['grad_sync'] if s['sharded'] else '-'}, checkpointing {'on' if est['checkpointing'] else 'off'}"
            f"\nrows per rank: {est['local_rows']} sampled, {est['local_batch']} per minibatch, micro-batch "
            f"{est['micro_batch_size']} -> {est['pass_rows']} rows per with-grad pass ({s['image_tokens']} image + "
            f"{s['text_tokens']} text tokens each)")
    lines = [head, "", "| component (GiB) | " + " | ".join(PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]
    for c in COMPONENTS:
        vals = [est["phases"][ph]["components"][c] / GiB for ph in PHASES]
        if any(v > 0.0005 for v in vals):
            lines.append(f"| {c} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    totals = {ph: f"{est['phases'][ph]['total'] / GiB:.2f}" for ph in PHASES}
    lines.append("| **total** | " + " | ".join(f"**{v}**" if ph == est["peak_phase"] else v for ph, v in totals.items()) + " |")
    lines.append(f"\nper-rank peak: {est['total'] / GiB:.2f} GiB ({est['peak_phase']})")
    if gpu_gib:
        free = 1 - est["total"] / (gpu_gib * GiB)
        lines.append(f"on {gpu_gib:g} GiB: headroom {100 * free:.1f}% ({'fits' if free >= headroom else 'DOES NOT FIT'} "
                     f"with >= {100 * headroom:.0f}%)")
    return "\n".join(lines)


def counts() -> str:
    lines = ["| shapes | component | class | parameters |", "|---|---|---|---|"]
    for f in sorted(set(SHAPES.glob("*.json")) - {MEASURED}):
        data = json.loads(f.read_text())
        for name, comp in (data.get("components") or {k: v for k, v in data["models"].items() if v}).items():
            lines.append(f"| {f.stem} | {name} | {comp['class']} | {component_params(comp) / 1e6:,.1f} M |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, as jagg-train takes them")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--gpu-mem", type=float, default=None, help="device memory per GPU in GiB (choose the micro-batch)")
    ap.add_argument("--headroom", type=float, default=0.10)
    ap.add_argument("--micro", type=int, default=None, help="estimate this micro-batch instead of choosing one")
    ap.add_argument("--overhead-gb", type=float, default=1.5, help="non-tensor memory per GPU (CUDA context, NCCL)")
    ap.add_argument("--shapes", default=None, help="tools/model_shapes/NAME.json instead of model.pretrained")
    ap.add_argument("--measure", action="store_true", help="measure missing activation coefficients on this CPU")
    ap.add_argument("--counts", action="store_true", help="print the parameter counts of the shape files")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.counts:
        print(counts())
        return
    if not args.config:
        ap.error("CONFIG is required (or --counts)")
    cfg = load_run_config(args.config, args.overrides)
    s = prepare(cfg, args.world_size, args.shapes, args.measure, args.overhead_gb)
    if args.micro is None and args.gpu_mem:
        m, est = choose_micro(s, args.gpu_mem, args.headroom)
        print(f"largest train.micro_batch_size that fits: {m if m else 'none (even 1 does not fit)'}")
        if m and balanced(m, est["local_batch"]) < m:
            b = balanced(m, est["local_batch"])
            print(f"micro-batch {b} runs the same {-(-est['local_batch'] // m)} chunks of the {est['local_batch']}-row "
                  f"share with less memory: {estimate(s, b)['total'] / GiB:.2f} GiB")
    else:
        est = estimate(s, args.micro)
    print(json.dumps(est, indent=1) if args.json else report(s, est, args.gpu_mem, args.headroom))


if __name__ == "__main__":
    main()
