"""Per-rank peak memory of a jagg-scale training step, by component and phase, and the largest micro-batch that fits.

Weights, gradients, optimizer states, EMA, KL reference, frozen encoders/VAE, reward models, rollout storage:
counted from the config and the shapes (shapes.py), each term naming the code it mirrors (docs/scale.md tabulates
them). The transformer is held in fp32 master weights, bf16 in compute (model.dtype float16: fp16, the same bytes and
the same measured coefficients; its VAE float32, models/__init__.py); FSDP2 shards weights, AdamW states, EMA and
(grad_sync every) gradients, gathers the root and two blocks, and during each block's backward holds its unsharded
gradient, the fp32 reduce-scatter input and the previous block's one in flight. LoRA: only the adapter has gradients
and states, its KL reference is the adapter off. Activations: measured coefficients composed over the real depth
(activations.py). What the trainer does is read from the trainer's own pieces: the rows each rank samples and
trains (train/rows.py StepRows), the with-grad rows of a pass and the interior steps of a segment (the planner,
jagg/planners.py), whether blocks are recomputed (parallel.activation_checkpointing, on every engine). A video model
(Wan) is a row of latent frames: its tokens, stored latents, decode and frames scored grow with them.
parallel.sequence_parallel N (sequence_parallel() below): a rank holds its data-parallel group's rows (world / N
groups) whole, and runs 1 / N of every transformer pass's tokens.

Phases of a step (each a sum of components; the peak is the max):

    encode     text encoders on this rank's prompts (all at once, as Policy.encode does)
    rollout    no-grad sampling chunks (CFG: 2x rows) while the previous chunk is decoded and scored on the run's
               reward stream (its blocks beside the sampling's: rewards/multi.py ScoringLane), of a sequence-parallel
               group's chunk this rank's share; then Trajectories.cat holding the chunks and their concatenation
    update     one with-grad pass of knots_per_pass x micro_batch_size rows (a JAGG joint pass: 2 x micro)
    optimizer  AdamW step (foreach temporaries) with gradients and states
    eval       eval.chunk_size images at a time (CFG: 2x rows): encode, ODE, decode, score in turn

Not tensors, added to every phase: the overhead (CUDA context, cuBLAS/NCCL workspaces; default 1.5 GiB). A config
fits when total <= (1 - headroom) x GPU memory; the headroom covers the caching allocator's fragmentation.
parallel.engine deepspeed is approximated as fsdp2 plus ZeRO-3's bf16 parameter shard.
"""

from __future__ import annotations

import math

import torch

from ..models.lora import lora_targets
from ..train.rows import StepRows
from .activations import cached as _cached
from .activations import ev, key, reduce_buffers, transformer_activations
from ..models.registry import family
from ..jagg.planners import with_switch
from ..train.config_experts import check_experts
from .experts import expert_stats, shape_switch
from .shapes import clean, component_params, context_parallel, pipeline_shapes, reward_models, rewards_need_pixels

__all__ = ["COMPONENTS", "GiB", "PHASES", "balanced", "choose_micro", "estimate", "local_rows", "prepare", "report",
           "shard_group"]

GiB = 2**30
COMPONENTS = ["transformer weights", "transformer buffers", "FSDP2 gathered weights + reduce buffers", "gradients",
              "optimizer states", "EMA", "KL reference", "frozen encoders + VAE", "reward models",
              "prompt conditioning", "rollout storage", "minibatch copies + pass inputs", "activations",
              "encoder / sampling / decode / reward transients", "optimizer step temporaries", "eval batch",
              "CUDA context + NCCL (not tensors)"]
PHASES = ["encode", "rollout", "update", "optimizer", "eval"]


class DoesNotDivide(ValueError):
    """The config's rows cannot be split over this many ranks (the trainer would refuse it too)."""


def local_rows(cfg, world: int) -> tuple[int, int]:
    """(rows this rank samples per step, its share of a minibatch), as the trainer splits them (train/rows.py): by
    data-parallel group, the world / parallel.sequence_parallel groups whose ranks hold the same rows."""
    n = cfg.train.prompts_per_step * cfg.grpo.group_size
    try:
        rows = StepRows.draw(n, cfg.train.minibatch_size, cfg.run.seed, 0, 0, world, cfg.parallel.sequence_parallel)
    except ValueError as err:
        raise DoesNotDivide(str(err)) from None
    return len(rows.mine), rows.local_batch


def shard_group(cfg, world: int) -> int:
    """Ranks one parameter is sharded over: all of them, or world / parallel.replicate under HSDP (fsdp2 only)."""
    replicate = cfg.parallel.replicate if cfg.parallel.engine == "fsdp2" else 1
    if replicate < 1 or world % replicate:
        raise DoesNotDivide(f"parallel.replicate={replicate} must divide the world size {world}")
    return world // replicate


def eval_images(cfg) -> int:
    """Held-out images of an evaluation (none when disabled): its prompts x eval.num_per_prompt. A prompt file that
    is not there is an error naming it (the estimator's CLI says so first): a guess would misprice the evaluation."""
    from ..data import load_prompts
    from ..paths import resolve_path

    e = cfg.eval
    if not e.enabled:
        return 0
    n = len(e.prompts) if e.prompts else len(load_prompts(resolve_path(e.prompt_file))) if e.prompt_file else 0
    return n * e.num_per_prompt


def prepare(cfg, world: int, shapes_name: str | None = None, measure: bool = False, overhead_gb: float = 1.5,
            gpu_gib: float = 79.2, memory: bool = True) -> dict:
    """Everything the estimate needs that does not depend on the micro-batch size. memory=False: the shapes and
    token counts alone (what the step-time model reads), without the measured activation coefficients."""
    from . import measure as M  # its functions run only when --measure finds a coefficient missing

    def cached(k, label, fn, measure):  # the coefficients only when the memory model needs them
        return _cached(k, label, fn, measure) if memory else None

    shapes = pipeline_shapes(cfg, shapes_name)
    kind, comps = shapes["kind"], shapes["components"]
    tcomp, lora = comps["transformer"], cfg.model.lora
    rank = lora.rank if lora.enabled else 0
    targets = lora_targets(cfg.model.kind, lora.targets) if rank else ()  # the trainer's (models.build_model)
    # 16 bits (bfloat16 or float16: the same bytes, so bf16's measured coefficients) or float32
    sharded, bf16 = cfg.parallel.engine != "none", cfg.model.dtype != "float32"
    precision = ("bf16_mp" if sharded else "amp") if bf16 else "fp32"
    tc, vae = tcomp["config"], comps["vae"]["config"]
    tokens, fam, prompt = dict(shapes["text_tokens"]), family(kind), None
    qwen = fam.text in ("qwen", "qwen_lm")  # a Qwen LM's prompt tokens, every prompt padded to them (models/<kind>.py)
    if qwen:
        prompt = min(cfg.model.max_sequence_length or fam.prompt_tokens, fam.prompt_limit)
    elif cfg.model.max_sequence_length:  # the T5 length (models/diffusers_common.t5_length)
        tokens["t5"] = min(cfg.model.max_sequence_length, tokens.get("t5_limit", 512))
    # the family's geometry (its Family.geometry): the VAE's scale, the latents, the patch of a token, the
    # transformer's text tokens and a row's conditioning in float32 words (prompt embeddings and the pooled vector
    # or the int64 mask), the image tokens' copies in a pass (FLUX.1-Kontext's input image, a video's latent frames),
    # and for a family whose pass carries its rows' longest prompt (encoded lengths, cap)
    geo = fam.geometry(cfg, tc, vae, tokens, prompt)
    scale, side, latent, p, text, cond_row = (geo[k] for k in ("scale", "side", "latent", "patch", "text", "cond_row"))
    prompt_lengths, images_per_pass = geo.get("prompt_lengths"), geo.get("images_per_pass", 1)
    # a video's decode gives 4 (F - 1) + 1 frames (models/wan.py)
    frames = (latent[1], cfg.model.num_frames or 81) if len(latent) == 4 else (1, 1)
    n_img = images_per_pass * (side // p) ** 2
    # two experts (Wan2.2 A14B, experts.py): both held (stats), one computing a pass (pass_stats); refused by key where
    # the config cannot train them (train/config_experts.py), as the trainer refuses it
    stats, pass_stats = expert_stats(comps, rank, targets)
    switch = shape_switch(shapes)
    check_experts(cfg, switch is not None)
    t_key = ("transformer", tcomp["class"], clean(tc), precision, rank, sorted(targets) if rank else None)
    label = f"{shapes.get('name', tcomp['class'])} transformer, {precision}, {'LoRA r%d' % rank if rank else 'full'}"
    act = cached(key(*t_key), label, lambda: M.measure_transformer(tcomp, precision, rank, targets), measure)
    fdt = torch.bfloat16 if bf16 else torch.float32
    t5 = fam.frozen[-1]  # model.text_encoders no_t5: not loaded; model.shard_text_encoder: 1/world of it per rank
    frozen = [n for n in fam.frozen if n in comps and not (n == t5 and cfg.model.text_encoders == "no_t5")]
    encoders = {}
    for name in frozen[1:]:
        c = comps[name]
        if qwen:
            what, seq = fam.text, prompt  # the padded prompt (Qwen-Image: the template's tokens besides)
        else:
            what = "t5" if c["class"].startswith(("T5", "UMT5")) else ("clip_hidden" if kind == "sd3" else "clip")
            seq = tokens["t5" if what == "t5" else "clip"]
        # qwen_lm: measured with the LM head on the last token (models/flux2.py), not the old fit over every token
        k = key(what, c["class"], clean(c["config"]), str(fdt), seq, *(["last_token_logits"] * (what == "qwen_lm")))
        encoders[name] = {"seq": seq, "coef": cached(k, f"{name} ({c['class']}) no-grad, {fdt}, {seq} tokens",
                          lambda c=c, what=what, seq=seq: M.measure_nograd(c, what, fdt, seq), measure)}
    what = "video" if frames[0] > 1 else "vae"  # a video VAE fit over its frames too (measure.measure_nograd)
    # fp16 runs keep the VAE float32 (models/), and Wan loads it float32 whatever model.dtype (models/wan.py _build)
    vdt = torch.float32 if cfg.model.dtype == "float16" or fam.extra.get("vae_float32") else fdt
    decode = cached(key(what, clean(vae), str(vdt)), f"VAE decode{' of videos' * (what == 'video')}, {vdt}",
                    lambda: M.measure_nograd(comps["vae"], what, vdt, 0), measure)
    rewards = {}
    for name, c in reward_models(cfg).items():
        rdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(c["options"].get("dtype"), torch.float32)
        rkey = key("reward", clean(c["config"]), str(rdt))
        rewards[name] = {"params": component_params(c), "bytes": rdt.itemsize, "every": c["every"],
                         "batch": c["options"].get("batch_size", 16), "coef": cached(
            rkey, f"reward {name} CLIP no-grad, {rdt}", lambda c=c, rdt=rdt: M.measure_nograd(c, "reward", rdt, 0),
            measure)}
    return {"cfg": cfg, "world": world, "kind": kind, "shapes": shapes.get("name"), "precision": precision,
            "sharded": sharded, "bf16": bf16, "lora_rank": rank, "stats": stats, "pass_stats": pass_stats,
            "switch": switch, "experts": shapes.get("experts"),
            "frozen": {n: component_params(comps[n]) / (world if n == t5 and cfg.model.shard_text_encoder else 1)
                       for n in frozen},
            "encoders": encoders, "ref_bytes": 2 if bf16 and tcomp.get("stored_dtype") == cfg.model.dtype else 4,
            "vae_bytes": vdt.itemsize,
            "decode": decode, "rewards": rewards, "act": act, "latent": latent, "patch": p, "frames": frames,
            "image_tokens": n_img, "text_tokens": text, "prompt_lengths": prompt_lengths, "cond_row": cond_row,
            **sequence_parallel(cfg, world, tcomp, n_img, text, math.prod(latent), 2 if bf16 else 4,
                                len(pass_stats["block_params"])),
            "overhead": overhead_gb * GiB, "vae_scale": scale, "eval_images": eval_images(cfg),
            "pixels": rewards_need_pixels(cfg),
            # gpu_gib: what sampling.chunk_size auto is sized for (an 80 GB GPU unless told)
            "gpu_gib": gpu_gib, "components": comps}


def sequence_parallel(cfg, world: int, tcomp: dict, n_img: int, text: int, lat: int, cdt: int, layers: int) -> dict:
    """parallel.sequence_parallel N (parallel/sequence.py): a rank's share of each pass's tokens, and per row what the
    split adds. Ulysses splits the tokens the transformer's context-parallel plan names (the image / video tokens;
    FLUX's text tokens too, Wan's prompt stays whole on every rank as its cross-attention's keys); every attention
    layer exchanges q, k, v and its output by all-to-alls ((N - 1) / N of each is sent), and the output is gathered
    back to full rows on every rank (a row's latents, velocities, SDE, decode and reward are not split)."""
    sp = cfg.parallel.sequence_parallel
    if sp == 1:
        return {"sp": 1, "sp_text": False, "rank_tokens": (n_img, text), "a2a_row": 0.0,
                "sp_row": {"grad": 0.0, "nograd": 0.0}}
    if world % sp:
        raise DoesNotDivide(f"parallel.sequence_parallel {sp} must divide the world size {world}")
    split_text = context_parallel(tcomp)  # ShapeError for a transformer without a plan (the trainer refuses it too)
    c = tcomp["config"]
    heads, width = c["num_attention_heads"], c["num_attention_heads"] * c["attention_head_dim"]
    if heads % sp:
        raise DoesNotDivide(f"parallel.sequence_parallel {sp} must divide {tcomp['class']}'s {heads} attention heads")
    if n_img % sp or (split_text and text % sp):  # Ulysses splits evenly (parallel/sequence.py refuses the rest)
        raise DoesNotDivide(f"parallel.sequence_parallel {sp} must divide a pass's {n_img} image tokens"
                            + (f" and {text} text tokens" if split_text else ""))
    img, txt = n_img // sp, text // sp if split_text else text
    attn = img + txt * split_text  # the self-attention's tokens on a rank (one per block)
    exchange = 6 * attn * width * cdt  # at one layer: q, k, v, their contiguous copies and the all-to-all outputs
    return {"sp": sp, "sp_text": split_text, "rank_tokens": (img, txt),
            "a2a_row": layers * 4 * attn * width * cdt * (sp - 1) / sp,  # bytes a rank sends per row and forward
            # the gathered output beside its local part (with grad: its gradient too), the exchange's transient
            "sp_row": {"nograd": lat * cdt + exchange, "grad": 2 * lat * cdt + exchange}}


def estimate(s: dict, micro: int | None = None, sampling_batch: int | None = None) -> dict:
    """{phase: {component: bytes}} per rank; `micro` overrides train.micro_batch_size (0 / None: whole share),
    `sampling_batch` sampling.chunk_size (None: the config's; auto: rollout_batch on s["gpu_gib"])."""
    cfg, W = s["cfg"], s["world"]
    st, shard = s["stats"], s["sharded"]
    div = shard_group(cfg, W) if shard else 1  # HSDP: the states are sharded within a replica group only
    R, B = local_rows(cfg, W)
    m = min(micro or cfg.train.micro_batch_size or B, B)
    lora = s["lora_rank"] > 0
    planner = with_switch(cfg.jagg.make_planner(), s.get("switch"))  # cut at a two-expert model's switch
    Pt = st["lora_params"] if lora else st["params"]
    cdt = 2 if s["bf16"] else 4
    cfgg, ref, lat = cfg.sampling.guidance != 1.0, cfg.uses_reference, math.prod(s["latent"])
    fp = cfg.forward_process  # DiffusionNFT, AWM: a final-latents rollout, trained on the forward process
    cond = 4 * s["cond_row"]  # conditioning is float32 (models/sd3.py)
    n_img, T = s["rank_tokens"]  # this rank's share of a pass's tokens: all of them unless sequence parallel
    ckpt = cfg.parallel.activation_checkpointing  # every engine applies it (parallel/blocks.py)
    act = s["act"]

    def tact(mode, n, extra=None):  # a pass of n rows on this rank, and what splitting its tokens adds
        return transformer_activations(act, mode, n, n_img, T, extra) + n * s["sp_row"][
            "nograd" if mode == "nograd" else "grad"]

    static = {
        # full fine-tune: fp32 masters (+ ZeRO-3's bf16 shard); LoRA under bf16: the frozen base stored bf16
        # (models/__init__.py), the adapter fp32
        "transformer weights": (2 if lora and s["bf16"] else 4) * st["params"] / div
        + (4 * st["lora_params"] / div if lora else 0)
        + (2 * st["params"] / div if cfg.parallel.engine == "deepspeed" and not (lora and s["bf16"]) else 0),
        "transformer buffers": st["buffers"],  # not sharded (SD3's pos_embed table)
        "optimizer states": 8 * Pt / div,  # AdamW exp_avg + exp_avg_sq, fp32
        # the EMA, and the algorithm's shadows (DiffusionNFT's old policy, AWM's EMA policy): copies of the trainable
        # weights, held like them (engine.py)
        "EMA": 4 * Pt / div * ((cfg.train.ema_decay > 0) + cfg.algorithm_shadows),
        # LoRA: the adapter off; else the transformer alone in its checkpoint's dtype, sharded (Trainer, loading.md)
        "KL reference": (s["ref_bytes"] * st["params"] / div + st["buffers"]) if ref and not lora else 0,
        # compute-dtype copies on every rank (the VAE's own dtype: float32 under float16)
        "frozen encoders + VAE": sum(n * (s["vae_bytes"] if name == "vae" else cdt) for name, n in s["frozen"].items()),
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
    row, K, rdt = rollout_row(cfg, lat, cdt, planner)
    store, cond_all = R * row, R * cond * (1 + cfgg)
    steps_per_rollout = (R // B) * cfg.grpo.inner_epochs
    off_policy_cfg = cfgg and steps_per_rollout > 1  # GRPO: the uncond of later minibatches is recomputed
    # step_batch: views of the trajectory for the contiguous rows of the first inner epoch's minibatches, a gathered
    # copy of a later epoch's permuted rows (grpo/rollout.py row_index); index_cond's copies; micro-batches are views
    mb = B * row * (cfg.grpo.inner_epochs > 1) + B * cond * (1 + off_policy_cfg)
    gcpo = cfg.train.algorithm == "gcpo"
    positioned = cfg.grpo.step_selection != "first" or gcpo
    if positioned:  # grpo/steps.py positioned: 2K latents, sigmas, 2K-spaced values (in their stored dtypes)
        mb += B * 2 * cfg.trained_per_sample * (lat * (4 + cdt * (1 + cfgg) + rdt * ref) + 4 * 2)
    if fp:  # train/forward_process.py: per minibatch the clean latents, per timestep x_t and the noise, and the
        # frozen models' velocities (DiffusionNFT's old policy, AWM's EMA policy where read; the reference)
        frozen = cfg.algorithm_section.frozen_policies + ref
        mb = B * cond + B * lat * 4 * (1 + cfg.trained_per_sample * (2 + frozen))
    # Policy.fresh_uncond's float32 copy of the micro-batch's uncond (the stored range, or 2K positions)
    mb += m * lat * 4 * (2 * cfg.trained_per_sample if positioned else K) if off_policy_cfg and not gcpo else 0
    if gcpo and steps_per_rollout > 1:  # train/gcpo.py _current: the fresh velocities (and uncond) of every position
        mb += B * cdt * lat * 2 * cfg.trained_per_sample * (1 + cfgg)
    rows = planner.knots_per_pass * m
    pass_in = rows * (4 * 4 * lat + cond)  # stacked latents, v, G and its parts (float32), repeated conditioning
    mode = "ckpt" if ckpt else "grad"
    activ = tact(mode, rows)
    reduce_buf = tact(mode, rows, reduce) - activ if shard else 0.0
    trained = cfg.trained_per_sample
    interior = planner.max_interior(trained)
    forward_mode = not gcpo and (cfg.jagg.intermediate == "forward" or (cfg.jagg.intermediate == "auto"
                                                                        and steps_per_rollout > 1))
    if interior and forward_mode:  # no-grad forwards of a segment's interior steps (jagg/backward.py)
        saved = sum(ev(act["fits"][k][f"keep_{mode}"], rows, n_img, T) for k in act["types"]) \
            + ev(act["fits"][f"root_{mode}"], rows, n_img, T)  # the pass's graph, alive while the interior runs
        nograd = tact("nograd", interior * m) + interior * m * (cond + 8 * lat)
        activ = max(activ, saved + nograd)

    def encoders(n):  # Policy.encode: each encoder in turn on n prompts
        return max((ev(c["coef"], n, 0, c["seq"]) for c in s["encoders"].values()), default=0.0)

    lf, nf = s["frames"]  # latent and decoded frames of a row (1, 1 for an image)
    side = s["latent"][-1]
    px = 3 * (side * s["vae_scale"]) ** 2 * 4  # a float32 frame

    def score(n, pixels=s["pixels"]):  # decode n latents (ChunkScorer) and score them (rewards/clip.py resizes
        # float images first): a chunk's images at once; of a video every k-th frame (video_frames: a copy of them
        # beside the videos), reward.options batch_size frames at a time
        rewards = s["rewards"].values()
        frames = [n * -(-nf // r["every"]) for r in rewards]
        if not pixels:  # latent rewards alone: no decode, no frames (rewards/multi.py ChunkScorer)
            return sum(ev(r["coef"], n, 0, 1) for r in rewards)
        return ev(s["decode"], n, side * side, lf * side * side if nf > 1 else 0) \
            + sum(ev(r["coef"], k if nf == 1 else min(k, r["batch"]), 0, 1) for k, r in zip(frames, rewards)) \
            + (n * nf * px + max(frames) * px if frames else 0)

    bs = sampling_batch or cfg.sampling.chunk_size
    if bs == "auto":
        bs = rollout_batch(s, s["gpu_gib"])
    sample_rows = bs * (1 + cfgg)
    # a sequence-parallel group's ranks split a chunk's decode and reward (trainer.py; a sharded reward: every row)
    split = s["sp"] if not cfg.reward.shard else 1
    sampling = tact("nograd", sample_rows) + sample_rows * (3 * 4 * lat + cond) + score(-(-bs // split))
    e = cfg.eval.chunk_size  # train/evaluate.py: per batch encode, ODE, decode, score in turn; a grid kept (uint8)
    e_rows = e * (1 + cfgg)
    grid = min(cfg.eval.grid_images, s["eval_images"]) * nf * px / 4  # uint8 frames
    eval_batch = (e * cond * (1 + cfgg) + 2 * e * lat * 4 + grid + max(encoders(e), score(-(-e // s["sp"]), True), tact(
        "nograd", e_rows) + e_rows * (3 * 4 * lat + cond))) if cfg.eval.enabled else 0
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
        # the runner makes the next minibatch's copies while the previous ones are alive (gradients are None); a
        # step of one minibatch has no next one
        "update_switch": {"prompt conditioning": cond_all, "rollout storage": store,
                          "minibatch copies + pass inputs": 2 * mb if steps_per_rollout > 1 else mb},
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
            "pass_rows": rows, "local_rows": R, "local_batch": B, "grad_sync": sync, "checkpointing": ckpt,
            "sampling_batch": bs,
            "planner": repr(planner)}


def rollout_row(cfg, lat: int, cdt: int, planner) -> tuple[float, int, int]:
    """(bytes, K, the reference's bytes per element) of one row's rollout store (grpo/rollout.py), `lat` elements a
    latent, `cdt` bytes the compute dtype's: over the K steps of the trained range its K + 1 latents (and x_T beside
    them where the range ends before it) and log-probs in float32, the predictions (CFG's uncond too) in the compute
    dtype, the reference's in it where it is the model's own output (guidance 1, nothing filled between knots), else
    float32. A forward-process rollout keeps only the final latents (rollout_spec keep final)."""
    cfgg, ref = cfg.sampling.guidance != 1.0, cfg.uses_reference
    K, n_lat = stored_steps(cfg)
    fill = cfg.grpo.ref_at == "knots" and planner.max_interior(cfg.trained_per_sample) > 0
    rdt = cdt if not cfgg and not fill else 4
    if cfg.forward_process:
        return 4 * lat, K, rdt
    return 4 * lat * n_lat + lat * K * (cdt * (1 + cfgg) + rdt * ref) + 4 * K, K, rdt


def stored_steps(cfg) -> tuple[int, int]:
    """(K, latents): the steps a row's trajectory stores (grpo/rollout.py keep_steps: the range from the first to the
    last step of the algorithm's RolloutSpec.trained) and the latents beside them (x_first .. x_{first+K}, and x_T
    where the range ends before it); the widest over the training steps (a scattered SDE window spans its range)."""
    S, g = cfg.sampling.num_steps, cfg.grpo
    if cfg.train.algorithm == "gcpo":  # its candidates: the chunks' steps (train/gcpo.py)
        K, start = sum(cfg.gcpo.layout(S)), 0
    elif g.sde_window:
        lo, hi = g.sde_window_range or [0, S]
        K, start = (hi - lo if g.sde_window_mode == "scattered" else g.sde_window), lo
    else:  # the first timestep_fraction, or every candidate of a per-row selection
        K, start = cfg.reference_steps, 0
    return K, K + 1 + (start + K < S)


def rollout_cap(cfg, world: int) -> int:
    """The most rows sampling.chunk_size auto gives a rollout chunk: half of a rank's rows (rounded up)."""
    return -(-local_rows(cfg, world)[0] // 2)


def rollout_batch(s: dict, gpu_gib: float, headroom: float = 0.10) -> int:
    """sampling.chunk_size auto: the largest rollout chunk (rows, before CFG doubles them) whose rollout phase fits
    `gpu_gib` with `headroom`, at most half of a rank's rows (two chunks or more: the reward of one is scored while
    the next samples); 1 when none fits (the update phase then decides whether the config fits at all). Of the chunk
    sizes that cut the rank's rows into as few chunks, the smallest (even chunks): the same forwards, a lower peak."""
    limit = (1 - headroom) * gpu_gib * GiB
    for bs in range(rollout_cap(s["cfg"], s["world"]), 1, -1):
        if estimate(s, sampling_batch=bs)["phases"]["rollout"]["total"] <= limit:
            return balanced(bs, local_rows(s["cfg"], s["world"])[0])
    return 1


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


def fits(est: dict, gpu_gib: float, headroom: float = 0.10) -> bool:
    return est["total"] <= (1 - headroom) * gpu_gib * GiB


def report(s: dict, est: dict, gpu_gib: float | None = None, headroom: float = 0.10) -> str:
    cfg = s["cfg"]
    train = f"LoRA r{s['lora_rank']}" if s["lora_rank"] else "full fine-tune"
    group = shard_group(cfg, s["world"]) if s["sharded"] else s["world"]
    hsdp = f" (HSDP: {s['world'] // group} replicas of {group})" if group != s["world"] else ""
    at_most = ", at most: a pass carries its rows' longest prompt" if s["prompt_lengths"] else ""
    head = (f"{s['shapes']} ({s['kind']}), {s['precision']}, {train}, engine {cfg.parallel.engine} x {s['world']} ranks"
            f"{hsdp}, grad_sync {est['grad_sync'] if s['sharded'] else '-'}, checkpointing "
            f"{'on' if est['checkpointing'] else 'off'}\n{est['planner']}"
            f"\nrows per rank: {est['local_rows']} sampled, {est['local_batch']} per minibatch, micro-batch "
            f"{est['micro_batch_size']} -> {est['pass_rows']} rows per with-grad pass ({s['image_tokens']} image + "
            f"{s['text_tokens']} text tokens each{at_most}); rollout {est['sampling_batch']} rows per forward"
            + (" (sampling.chunk_size auto)" if cfg.sampling.chunk_size == "auto" else ""))
    if s["sp"] > 1:
        img, txt = s["rank_tokens"]
        head += (f"\nsequence parallel {s['sp']}: {s['world'] // s['sp']} data-parallel groups of {s['sp']} ranks "
                 f"holding the same rows; a rank runs {img} image + {txt} text tokens of each pass"
                 f"{'' if s['sp_text'] else ' (the prompt whole on every rank)'}, sends "
                 f"{s['a2a_row'] / 2**20:.0f} MiB a row and forward in all-to-alls; decode and reward on every rank")
    lines = [head, "", "| component (GiB) | " + " | ".join(PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]
    for c in COMPONENTS:
        vals = [est["phases"][ph]["components"][c] / GiB for ph in PHASES]
        if any(v > 0.0005 for v in vals):
            lines.append(f"| {c} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    totals = {ph: f"{est['phases'][ph]['total'] / GiB:.2f}" for ph in PHASES}
    lines.append("| **total** | " + " | ".join(f"**{v}**" if ph == est["peak_phase"] else v for ph, v in totals.items())
                 + " |")
    lines.append(f"\nper-rank peak: {est['total'] / GiB:.2f} GiB ({est['peak_phase']})")
    if gpu_gib:
        free = 1 - est["total"] / (gpu_gib * GiB)
        lines.append(f"on {gpu_gib:g} GiB: headroom {100 * free:.1f}% "
                     f"({'fits' if free >= headroom else 'DOES NOT FIT'} with >= {100 * headroom:.0f}%)")
    return "\n".join(lines)
