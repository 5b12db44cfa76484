"""Seconds per phase of one training step on one rank: the step-time model beside the memory model (memory.py).

Every model call of a step is a pass of some rows; a pass of n rows costs n x F forward FLOPs, F the model's
forward FLOPs per row at the config's tokens (torch's FlopCounterMode on the meta device: nothing is allocated; a
family whose pass carries its rows' longest prompt, Qwen-Image, at that pass's expected longest: prompt_tokens.py),
and runs at an achieved rate read off passes measured on a GPU (passes.json: tools/gpu_check.py on an H200, the
SD3.5-medium transformer with LoRA r32 and activation checkpointing). The rate is a function of a pass's work,
rows x F: small passes are launch-bound (an 8-row with-grad pass runs at half the rate of a 72-row one), large
ones compute-bound. A with-grad pass is calibrated as measured (forward + recomputed forward + backward of a LoRA
model: ~3 forwards); a full fine-tune's backward also computes the weight gradients (x 4/3), and without
checkpointing there is no recompute (x 2/3).

    rollout    policy forwards: sampling.num_steps per sample (an SDE window with a compressed ODE: the window's
               steps + sampling.ode_steps), in chunks of the rollout batch, doubled rows under CFG; with
               sampling.same_initial_noise the steps before the SDE window on one row per prompt group of a chunk
    reference  the KL reference's forwards on the trained steps, or on the plan's knots (grpo.ref_at; GRPO with
               beta > 0)
    train      the planner's with-grad passes over every minibatch in micro-batches (a JAGG joint pass holds
               2 x micro rows), the interior forwards of a forward-mode window, CFG's refresh of the unconditional
               predictions after the first minibatch (at every trained step, or at the plan's knots with
               grpo.refresh_at knots: no interior forwards then, jagg.intermediate auto is interpolate);
               DiffusionNFT, AWM: the frozen models' forwards (the old or EMA policy, the reference) at the K
               timesteps (or the knots: nft.old_at, awm.frozen_at), then the
               plan's with-grad passes
    encode     the text encoders on the rank's distinct prompts (Policy.encode: once each, its rows copies;
               Flow-GRPO's peer on every row)
    decode     the VAE decoder and the reward models on the rank's samples
    eval       an evaluation's forwards and decodes, shared over eval.every steps (0 when eval.every is 0)

    sp_all_to_all  parallel.sequence_parallel N: each rank runs its group's rows at 1/N of every pass's tokens (the
               FLOPs above are a rank's: 1/N of the attention, the rest at its tokens), and every attention layer's
               Ulysses all-to-alls send (N - 1)/N of the rank's q, k, v and output: 4 per layer and forward, the
               same again in a with-grad pass's backward (and its recomputed forward), at A2A_GBPS a rank (an sp
               group inside one node: NVLink; --a2a-gbps for another link), not overlapped with compute. Under
               model.attention sdpa a with-grad pass's backward also runs its attention forward again (diffusers'
               native backend), counted in `train`. A group's ranks split the decode and the reward of its rows
               (and an evaluation's); the encoders run on the group's prompts on every rank of it.

    collectives  the data-parallel collectives of every transformer pass (collectives.py): FSDP2's all-gathers of
               each block in forward and again in a with-grad pass's backward, its reduce-scatters of the trained
               gradients (every backward, or a minibatch's last: parallel.grad_sync), HSDP's all-reduce across
               replicas; Flow-GRPO's LoRA step runs DDP (one all-reduce of the adapter's gradient per optimizer
               step). Bytes from the transformer's units and dtypes, seconds at a stated bus bandwidth per link
               (NVLink inside a node, InfiniBand across), and only what FSDP2's prefetch cannot hide behind the
               pass's compute is added: head + max(0, comm - head - compute) per pass and direction.

Not counted: the optimizer step and host work. So on a GPU not like the calibration's, or with NCCL slower than the
stated links, the model is optimistic; `compare()` reads every config at the same rates, so ratios between configs
(the knobs: rollout batch, micro-batch, window, SDE window, dpm2) hold better than seconds.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from ..grpo.rollout import prefix_forwards
from ..jagg.planners import with_switch
from ..jagg.plans import interpolate_forwards, pass_groups, plan_knots
from . import collectives as C
from .collectives import LINKS, Links
from .experts import plan_sigmas
from .flops import count as count_flops, count_blocks
from .measure import model_inputs
from .prompt_tokens import distinct_prompts, expected_longest
from .shapes import meta_module

PASSES = Path(__file__).with_name("passes.json")
# GB/s a rank sends in an all-to-all inside one 8-GPU node: an assumption, not measured here (NVLink 4: 450 GB/s a GPU
# each way; NCCL's all-to-all over NVSwitch reaches well under that at the 10-100 MB messages of one layer)
A2A_GBPS = 200.0


@functools.lru_cache(maxsize=None)
def calibration() -> dict:
    return json.loads(PASSES.read_text())


def rate(kind: str, work: float, calib: dict | None = None) -> float:
    """Achieved forward-FLOP rate (FLOP/s) of a pass of `work` forward FLOPs: piecewise linear in the work between
    the measured passes, constant past the ends (a bigger pass is no faster per FLOP than the biggest measured).
    `calib`: passes measured elsewhere in passes.json's format (the CPU benchmark's own); default passes.json."""
    c = calib or calibration()
    pts = [(n * c["forward_tflop_per_row"] * 1e12, n * c["forward_tflop_per_row"] * 1e12 / s) for n, s in c[kind]]
    if work <= pts[0][0]:
        return pts[0][1]
    for (w0, r0), (w1, r1) in zip(pts, pts[1:]):
        if work <= w1:
            return r0 + (r1 - r0) * (work - w0) / (w1 - w0)
    return pts[-1][1]


def pass_seconds(rows: float, flops_per_row: float, grad: bool = False, factor: float = 1.0,
                 calib: dict | None = None) -> float:
    work = rows * flops_per_row
    return 0.0 if rows <= 0 else factor * work / rate("grad" if grad else "nograd", work, calib)


@functools.lru_cache(maxsize=8)
def _meta(comp_json: str) -> torch.nn.Module:
    """The component on the meta device, built once per shape (a 60-block Qwen-Image took 0.8 s a build, 13 builds
    a jagg-estimate call); counting FLOPs runs it and changes nothing in it."""
    return meta_module(json.loads(comp_json))


@functools.lru_cache(maxsize=None)
def _transformer_flops(comp_json: str, kind: str, latent: tuple, patch: int, text_tokens: int, sp: int = 1,
                       split_text: bool = False, attention_only: bool = False) -> float:
    """Forward FLOPs of one row of latents [C, H, W] (a video's [C, F, H, W]) in patch x patch tokens through the
    transformer, called as its family's adapter calls it (the measurement's inputs, measure.model_inputs, on the meta
    device), on one rank of a sequence-parallel group of `sp`: its attention (all tokens of 1 / sp of the heads) is
    1 / sp of the row's, everything else is counted at the rank's share of the tokens (the text tokens too where the
    plan splits them: FLUX; Wan's prompt embedding and cross-attention keys are computed whole on every rank)."""
    comp = json.loads(comp_json)
    *_, H, W = latent
    m = _meta(comp_json)

    def count(w: int, t: int) -> tuple[float, float]:
        args = model_inputs(kind, comp["config"], 1, H // patch, w, t, device="meta",
                            frames=latent[1] if len(latent) == 4 else 1)
        return count_blocks(m, lambda: m(**args))

    total, attention = count(W // patch, text_tokens)
    if attention_only:  # the rank's share of the attention kernels alone
        return attention / sp
    if sp == 1:
        return total
    local, local_attention = count(-(-(W // patch) // sp), -(-text_tokens // sp) if split_text else text_tokens)
    return attention / sp + local - local_attention


@functools.lru_cache(maxsize=None)
def _frozen_flops(comp_json: str, what: str, arg: int) -> float:
    """Forward FLOPs of one prompt through a text encoder (`arg` tokens) or of one image through the VAE decoder
    (`arg` latent pixels a side; a video: (latent frames, side)); 0 when the component does not run on the meta
    device."""
    comp = json.loads(comp_json)
    frames, side = arg if isinstance(arg, tuple) else (1, arg)
    if what == "vae" and frames > 2:
        # Wan's decoder runs a latent frame at a time, a causal cache carried between them: every frame after the
        # first is the same work, so F frames cost the first + (F - 1) x the second (exact: test_steptime.py). Counting
        # Wan2.1's 21 frames op by op: a Wan2.1 estimate (and sbatch's start) 10.1 s, now 8.8 s on a 2-core CPU.
        one, two = (_frozen_flops(comp_json, what, (f, side)) for f in (1, 2))
        return one + (frames - 1) * (two - one)
    try:
        m = _meta(comp_json)
        if what == "vae":
            video = "z_dim" in comp["config"]  # Qwen-Image's VAE decodes [N, C, 1, H, W], Wan's [N, C, F, H, W]
            z = torch.zeros(1, comp["config"]["z_dim" if video else "latent_channels"], *([frames] if video else []),
                            side, side, device="meta")
            return count_flops(lambda: m.decode(z, return_dict=False))
        ids = torch.zeros(1, arg, dtype=torch.long, device="meta")
        return count_flops(lambda: m(ids))
    except Exception:  # noqa: BLE001 - an encoder the meta device cannot run counts nothing; said in the report
        return 0.0


def step_seconds(s: dict, est: dict, cfg_rows_with_grad: bool = False, calib: dict | None = None,
                 a2a_gbps: float = A2A_GBPS, links: Links = LINKS, engine: str | None = None,
                 encode_every_row: bool = False) -> dict:
    """{phase: seconds} of one training step on one rank and their sum ("step"), for the prepared config `s`
    (memory.prepare) at the estimate `est` (memory.estimate: its micro-batch and rollout batch).
    cfg_rows_with_grad: train the conditional and unconditional rows of CFG together with grad, as Flow-GRPO's
    train_sd3.py does (this stack trains the conditional rows and reuses the rollout's unconditional ones).
    calib: the measured passes to price with (rate()); default passes.json, the H200's. a2a_gbps: the GB/s a rank
    sends in sequence parallelism's all-to-alls (A2A_GBPS: within a node). links: the bandwidths the data-parallel
    collectives run at (collectives.py); engine: another engine's collectives than the config's (ddp: Flow-GRPO's
    LoRA layout, collectives.flow_grpo_engine); encode_every_row: the text encoders on every row's prompt, as
    Flow-GRPO's train_sd3.py runs them (this stack's Policy.encode: each distinct prompt once)."""
    cfg, comps = s["cfg"], s["components"]
    smp, g = cfg.sampling, cfg.grpo
    S, R, B, m = smp.num_steps, est["local_rows"], est["local_batch"], est["micro_batch_size"]
    cfgg = 1 + (smp.guidance != 1.0)
    fp = cfg.forward_process  # DiffusionNFT, AWM: their frozen models run at training time
    factor = (4 / 3 if s["lora_rank"] == 0 else 1.0) * (1.0 if cfg.parallel.activation_checkpointing else 2 / 3)

    def flops(rows: int, group: int = g.group_size, prompts: int = cfg.train.prompts_per_step) -> float:
        """A row's forward FLOPs in a pass of `rows` rows drawn from `prompts` prompts x `group` rows each."""
        text = s["text_tokens"]
        if s["prompt_lengths"]:  # the pass's longest prompt on average, up to a multiple of the sequence split
            distinct = distinct_prompts(rows, prompts, group)
            text = math.ceil(round(expected_longest(*s["prompt_lengths"], rows, distinct)) / s["sp"]) * s["sp"]
        return _transformer_flops(json.dumps(comps["transformer"], sort_keys=True), s["kind"], tuple(s["latent"]),
                                  s["patch"], text, s["sp"], s["sp_text"])

    # the data-parallel collectives of a transformer pass (collectives.py), and what compute leaves of them exposed
    lay = C.layout(cfg, s["world"], engine)
    # a pass gathers and reduces the blocks of the expert that computes it (estimate/experts.py: pass_stats)
    comm = C.pass_comm(*C.units(s.get("pass_stats", s["stats"]), s["lora_rank"] > 0, s["bf16"]), lay, links)
    exposed = dict.fromkeys(("rollout", "reference", "train", "train_nograd", "eval"), 0.0)
    busy = dict.fromkeys(exposed, 0.0)  # the collectives' own seconds, hidden or not

    def fwd(rows_per_pass: list, frozen: float | None = None, x: int = 1, times: float = 1.0,
            phase: str | None = None, **draw) -> float:
        """`times` x the no-grad passes of the transformer (or of `frozen`, FLOPs per row: a replicated model, no
        collectives), `x` times the rows each (CFG's unconditional rows: their prompt shorter than the conditional
        ones); a transformer pass's exposed collectives go to `phase`."""
        total = 0.0
        for n in rows_per_pass:
            t = pass_seconds(n * x, flops(n, **draw) if frozen is None else frozen, calib=calib)
            total += t
            if frozen is None:
                exposed[phase] += times * comm.nograd(t)
                busy[phase] += times * comm.gather
        return times * total

    bs = est["sampling_batch"]
    chunks = [min(bs, R - i) for i in range(0, R, bs)]
    sde_window = cfg.grpo.sde_window
    forwards = (sde_window + smp.ode_steps) if sde_window and smp.ode_steps else S
    trained = cfg.trained_per_sample
    if cfg.train.algorithm == "gcpo" and cfg_rows_with_grad:  # GCPO's own step: a chunk's real steps, no slot pads
        trained = round(cfg.gcpo.expected_steps(smp.num_steps))
    planner = with_switch(cfg.jagg.make_planner(), s.get("switch"))
    # the trained steps' sigmas: what a two-expert model's switch cuts at (estimate/experts.py); else any decreasing
    sigmas = plan_sigmas(cfg, s["experts"], trained) if s.get("switch") else torch.linspace(1, 0, trained + 1)
    plan = planner.plan(torch.randn(trained, 2, 4), sigmas, grad_norms=lambda: torch.ones(trained)).plan
    knots = len(plan_knots(plan))
    # sampling.same_initial_noise: the deterministic steps before the SDE window once per prompt group in a chunk (its
    # lead rows: Policy.sample's shared prefix), the rest on every row
    prefix = expected_prefix(cfg) if smp.same_initial_noise else 0.0
    leads = [distinct_prompts(n, cfg.train.prompts_per_step, g.group_size) for n in chunks] if prefix else chunks
    out = {"rollout": fwd(chunks, x=cfgg, times=forwards - prefix, phase="rollout")
           + (fwd(leads, x=cfgg, times=prefix, phase="rollout", group=1) if prefix else 0.0)}
    ref_runs = knots if g.ref_at == "knots" else cfg.reference_steps  # on the trained (or candidate) steps, or knots
    out["reference"] = (fwd(chunks, x=cfgg, times=ref_runs, phase="reference") if cfg.uses_reference and not fp
                        else 0.0)
    minibatches = (R // B) * g.inner_epochs
    micro = [min(m, B - i) for i in range(0, B, m)]
    groups = pass_groups(plan, planner.rows_per_pass)
    rows_x = cfgg if cfg_rows_with_grad else 1
    grad_passes = [pass_seconds(len(k) * n * rows_x, flops(n), True, factor, calib=calib)
                   for k in groups for n in micro]
    train = sum(grad_passes)
    if s["sp"] > 1 and cfg.model.attention == "sdpa":  # diffusers' native context-parallel backward runs the
        # attention forward again (attention_dispatch._native_attention_backward_op); cudnn / flash keep its statistics
        attn = _transformer_flops(json.dumps(comps["transformer"], sort_keys=True), s["kind"], tuple(s["latent"]),
                                  s["patch"], s["text_tokens"], s["sp"], s["sp_text"], attention_only=True)
        train += sum(pass_seconds(len(k) * n * rows_x, attn, calib=calib) for k in groups for n in micro)
    # a minibatch's backwards reduce their gradients each (grad_sync every) or at its last (boundary: runner.py's last)
    reduces = [lay.grad_sync == "every" or i == len(grad_passes) - 1 for i in range(len(grad_passes))]
    exposed["train"] = minibatches * sum(comm.grad(t, 1 / (3 * factor), lay.backward_gathers, r)
                                         for t, r in zip(grad_passes, reduces))
    busy["train"] = minibatches * sum((1 + lay.backward_gathers) * comm.gather + r * comm.reduce for r in reduces)
    interior = sum(b - a - 1 for a, b in plan if b > a + 1)
    if fp:  # the frozen models' forwards (the old or EMA policy, the reference) at every timestep (or the knots)
        own = cfg.algorithm_section
        frozen = (own.frozen_policies + cfg.uses_reference) * (knots if own.frozen_at_knots else trained)
        nograd_passes = frozen + (interior if cfg.jagg.intermediate == "forward" else 0)
    elif cfg.train.algorithm == "gcpo":  # train/gcpo.py: after the first minibatch every position's velocity (and
        # CFG's unconditional one) at the current weights, for the chunk factors; GCPO's own step (the peer, CFG rows
        # with grad) takes a chunk's log-probabilities from its with-grad pass instead
        # (each row's real chunk steps: n_train x the mean chunk size in expectation, the slots' pads skipped)
        nograd_passes = 0 if cfg_rows_with_grad else ((minibatches - 1) / minibatches
                                                      * cfg.gcpo.expected_steps(smp.num_steps) * cfgg)
    else:
        # per minibatch on average; the first is on-policy (no optimizer step yet): its cached values are exact
        after_step = (minibatches - 1) / minibatches
        # after an optimizer step (grpo.refresh_at): every trained step recomputed (steps: auto runs `forward`), or
        # the knots alone and the rest moved by their drift (knots: auto runs `interpolate`); train/update.py
        at_knots = g.refresh_at == "knots"
        share = {"forward": 1.0, "interpolate": 1.0, "auto": after_step}.get(cfg.jagg.intermediate, 0.0)
        forward = cfg.jagg.intermediate == "forward" or (cfg.jagg.intermediate == "auto" and not at_knots)
        # a forward-mode window's interior; interpolate's lookup of a right knot in a later pass (runner.py)
        nograd_passes = share * (interior if forward else interpolate_forwards(plan, planner.rows_per_pass))
        if cfgg > 1 and not cfg_rows_with_grad:  # the uncond refresh of every minibatch after the first
            nograd_passes += after_step * (knots if at_knots else trained)
    out["train"] = minibatches * train
    out["train_nograd"] = fwd(micro, times=minibatches * nograd_passes, phase="train_nograd")
    enc = sum(_frozen_flops(json.dumps(comps[n], sort_keys=True), "text", e["seq"]) for n, e in s["encoders"].items()
              if n in comps)
    # Policy.encode: each distinct prompt of the rank's rows once, the rows copies of its conditioning
    out["encode"] = fwd([R if encode_every_row else distinct_prompts(R, cfg.train.prompts_per_step, g.group_size)],
                        enc)
    lf = s["frames"][0]
    vae = _frozen_flops(json.dumps(comps["vae"], sort_keys=True), "vae", (lf, s["latent"][-1]) if lf > 1
                        else s["latent"][-1])
    # a sequence-parallel group's ranks split the decode of their rows (trainer.py: each row scored once), unless a
    # sharded reward needs every rank in each call; latent rewards alone: no decode (memory.prepare)
    split = s["sp"] if not cfg.reward.shard else 1
    out["decode"] = fwd(group_share(chunks, split), vae) if s["pixels"] else 0.0
    e = cfg.eval
    if e.enabled and e.every > 0:
        per = math.ceil(s["eval_images"] / (s["world"] // s["sp"]))  # an sp group evaluates the same images
        ev = [min(e.chunk_size, per - i) for i in range(0, per, e.chunk_size)]
        eval_draw = {"group": e.num_per_prompt, "prompts": -(-per // e.num_per_prompt)}  # its own prompts
        out["eval"] = (fwd(ev, x=cfgg, times=smp.eval_num_steps / e.every, phase="eval", **eval_draw)
                       + fwd(group_share(ev, s["sp"]), vae, times=1 / e.every))  # its decode split too
        eval_rows = smp.eval_num_steps * per * cfgg / e.every
    else:
        out["eval"], eval_rows = 0.0, 0
    # sequence parallelism: every pass's all-to-alls (q, k, v and the output of each attention layer; a with-grad
    # pass's backward and recomputed forward again), not overlapped with compute (diffusers' Ulysses waits on them)
    grad_rows = minibatches * sum(len(k) for k in groups) * B * rows_x
    rows = {"rollout": ((forwards - prefix) * R + prefix * sum(leads)) * cfgg,
            "reference": (ref_runs * R * cfgg) if out["reference"] else 0,
            "train": grad_rows, "train_nograd": minibatches * nograd_passes * B}
    passes = sum(rows.values()) + eval_rows + rows["train"] * (2 if cfg.parallel.activation_checkpointing else 1)
    out["sp_all_to_all"] = passes * s["a2a_row"] / (a2a_gbps * 1e9)
    out["collectives"] = sum(exposed.values())  # the data-parallel ones compute leaves exposed
    out["step"] = sum(out.values())
    out["comm"] = {"engine": lay.engine, "shard": lay.shard, "replicate": lay.replicate, "grad_sync": lay.grad_sync,
                   "gathered_gb_per_forward": comm.gathered_bytes / 1e9, "busy": busy, "exposed": exposed,
                   "nvlink_gbps": links.nvlink_gbps, "ib_gbps": links.ib_gbps, "gpus_per_node": links.gpus_per_node}
    out["forward_tflop_per_row"], out["a2a_gbps"] = flops(m) / 1e12, a2a_gbps  # at the training micro-batch
    # the arithmetic of each phase (TFLOP), to read a measured phase's achieved rate: a with-grad pass is ~3
    # forwards with checkpointing (forward, recomputed forward, backward of a LoRA model), `factor` of that otherwise
    per_row = {"rollout": flops(bs), "reference": flops(bs), "train": flops(m), "train_nograd": flops(m)}
    out["tflop"] = {p: (3 * factor if p == "train" else 1) * n * per_row[p] / 1e12 for p, n in rows.items()}
    return out


def group_share(chunks: list[int], sp: int) -> list[int]:
    """Of a rank's rows in `chunks`, the ones the first rank of its sequence-parallel group decodes and scores (row i
    is rank i % sp's: trainer.py, evaluate.py), chunk by chunk: the group's most."""
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    return [len(range(a + (-a % sp), a + n, sp)) for a, n in zip(starts, chunks)]


def expected_prefix(cfg) -> float:
    """The model calls before the SDE window (grpo/rollout.py prefix_forwards: the ODE steps, or the compressed
    grid's before it), averaged over the window's starts (train/update.py trained_steps_at: uniform over the range's
    starts, cycled through by `sliding`, the first of `scattered`'s steps); 0 without a window (SDE from step 0)."""
    g, T = cfg.grpo, cfg.sampling.num_steps
    if not g.sde_window:
        return 0.0
    lo, hi = g.sde_window_range or [0, T]
    if g.sde_window_mode == "scattered":  # Euler (config.py refuses the compressed ODE): its first step's index,
        n, k = hi - lo, g.sde_window  # E[min of k of n] = sum_j P(min >= j)
        return lo + sum(math.comb(n - j, k) for j in range(1, n)) / math.comb(n, k)
    sigmas = [1 - i / T for i in range(T + 1)]  # the grids' sizes depend on the step counts alone
    starts = range(lo, hi - g.sde_window + 1)
    return sum(prefix_forwards(sigmas, frozenset(range(a, a + g.sde_window)), cfg.sampling.ode_solver,
                               cfg.sampling.ode_steps) for a in starts) / len(starts)


def flow_grpo_overrides(cfg) -> list[str]:
    """The config as Flow-GRPO's train_sd3.py would run it (see step_seconds' cfg_rows_with_grad): per-step
    backward over its first 0.99 of the steps, the KL reference on each of them, its 9-row sampling and training
    batch per GPU, no activation checkpointing, no SDE window, nothing refreshed at knots (yifan123/flow_grpo
    config/grpo.py pickscore_sd3, commit ac4c86e: lines 118 sample.train_batch_size 9, 124 train.batch_size = it, 127
    train.timestep_fraction 0.99)."""
    return ["jagg=null", "jagg.mode=exact", "grpo.ref_at=steps", "grpo.refresh_at=null", "sampling.chunk_size=9",
            "train.micro_batch_size=9",
            *([] if cfg is not None and cfg.train.algorithm == "gcpo" else ["grpo.timestep_fraction=0.99"]),  # gcpo:
            # its own chunks (GCPO's own step is its peer)
            "parallel.activation_checkpointing=false", "grpo.sde_window=0", "sampling.ode_steps=0",
            "sampling.ode_solver=euler", "grpo.sde_window_range=null", "grpo.sde_window_mode=null",
            "grpo.sde_window_every=null"]


def report(t: dict, flow_grpo: dict | None = None) -> str:
    c = calibration()
    phases = ("rollout", "reference", "train", "train_nograd", "encode", "decode", "eval", "sp_all_to_all",
              "collectives")
    line = ", ".join(f"{p} {t[p]:.1f}" for p in phases if t[p] > 0.05)
    out = (f"step time per rank: {t['step']:.1f} s ({line}), at the passes measured on an {c['gpu']} "
           f"(estimate/passes.json; the optimizer step not counted"
           f"{'; all-to-alls at %g GB/s' % t['a2a_gbps'] if t['sp_all_to_all'] else ''})\n{comm_line(t)}")
    if flow_grpo is not None:
        out += (f"\nFlow-GRPO's step of the same config (per step, 9-row passes, CFG rows trained with grad, no "
                f"checkpointing; {flow_grpo['comm']['engine']}): {flow_grpo['step']:.1f} s: this config "
                f"{flow_grpo['step'] / t['step']:.2f}x faster")
    return out


def comm_line(t: dict) -> str:
    """The data-parallel collectives of a priced step: layout, bytes, seconds and what compute leaves exposed."""
    c = t["comm"]
    if c["engine"] == "none":
        return "data-parallel collectives: none (one rank, or parallel.engine none)"
    hsdp = f" x {c['replicate']} replicas" if c["replicate"] > 1 else ""
    return (f"data-parallel collectives ({c['engine']}, parameters sharded over {c['shard']} ranks{hsdp}, gradients "
            f"reduced at {'every backward' if c['grad_sync'] == 'every' else 'the minibatch boundary'}): "
            f"{c['gathered_gb_per_forward']:.2f} GB gathered a forward, {sum(c['busy'].values()):.1f} s of "
            f"collectives a step, {t['collectives']:.2f} s of them not hidden behind compute (NVLink "
            f"{c['nvlink_gbps']:g}, across nodes {c['ib_gbps']:g} GB/s a GPU, {c['gpus_per_node']} GPUs a node: "
            f"estimate/collectives.py)")
