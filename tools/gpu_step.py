"""The device check's whole-step and profile sections (tools/gpu_check.py --sections step,profile).

step     one rank's share of configs/sd35m_pickscore.yaml's training step (estimate/layout.py rank_share at
         --step-world ranks) at the real shape: every pipeline component at its published size, built offline from
         its config with random weights (estimate/shapes/sd35_medium.json: the SD3.5-medium transformer, its VAE,
         CLIP-L, OpenCLIP-bigG, T5-XXL; estimate/shapes/rewards.json: PickScore's ViT-H/14 CLIPModel), saved as a
         pipeline directory and a reward directory and loaded by jagg_scale.train.Trainer itself; the tokenizers are
         the tiny pipelines' (their ids index the real vocabularies: the FLOPs do not depend on the ids). Three arms
         one after another (tools/bench/whole_step.py: Flow-GRPO's train_sd3.py update with its own 9-row batch,
         the shipped recipe, the fast recipe), each one warm-up pass and one timed step, phase by phase
         (whole_step.PhaseClock, every timed call closed by a CUDA synchronize): seconds, the achieved TFLOP/s of
         each phase (the step-time model's arithmetic count over the measured seconds), the step's peak memory.
profile  torch.profiler over one with-grad pass and one no-grad forward of the production micro-batch through the
         real-shape policy (LoRA r32, checkpointing, bf16 autocast): device time by kernel class (matmul,
         attention, normalization and elementwise, copies and casts, other), the top kernels, and the same pass
         under parallel.compile's per-block torch.compile

--tiny: the same code on the tiny SD3 pipeline and a tiny CLIP on the CPU (tests/tools/test_gpu_check.py).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from tools.gpu_common import sync

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red apple on a table", "a blue sky over the sea", "a green field at noon", "a cat on a sofa",
           "a city street at night", "a bowl of fruit", "a mountain lake", "a portrait of a dog"]
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


# ------------------------------------------------------------------------------------------------------------------
# the components, written where the Trainer loads them from
# ------------------------------------------------------------------------------------------------------------------

def write_components(work: Path, device: torch.device, tiny: bool) -> tuple[Path, Path, dict]:
    """(pipeline directory, reward directory, what was built): SD3.5-medium and PickScore at published size, or the
    tiny pipeline and a tiny CLIP."""
    from transformers import CLIPConfig, CLIPModel

    from jagg_scale.models.tiny import _clip_tokenizer, _t5_tokenizer, make_tiny_sd3

    pipe_dir, reward_dir = work / "pipeline", work / "reward"
    t0 = time.perf_counter()
    if tiny:
        make_tiny_sd3(pipe_dir, seed=0)
        clip = CLIPConfig(text_config=dict(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, max_position_embeddings=77),
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=32, patch_size=8), projection_dim=16)
        crop = 32
    else:
        _write_sd35_medium(pipe_dir, device, _clip_tokenizer, _t5_tokenizer)
        spec = json.loads((ROOT / "jagg_scale/estimate/shapes/rewards.json").read_text())["models"]["pickscore"]
        clip, crop = CLIPConfig(**spec["config"]), spec["config"]["vision_config"].get("image_size", 224)
    with torch.device(device):
        reward = CLIPModel(clip)
    reward.save_pretrained(reward_dir)
    tok = _clip_tokenizer()
    tok.model_max_length = 77
    tok.save_pretrained(reward_dir)
    (reward_dir / "preprocessor_config.json").write_text(json.dumps({"image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                                                                     "crop_size": crop}))
    built = {"seconds": round(time.perf_counter() - t0, 1),
             "reward_parameters": sum(p.numel() for p in reward.parameters())}
    del reward
    return pipe_dir, reward_dir, built


def _write_sd35_medium(out: Path, device: torch.device, clip_tokenizer, t5_tokenizer) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers import StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from jagg_scale.estimate.shapes import pipeline_shapes

    comps = pipeline_shapes(None, "sd35_medium")["components"]
    built = {}
    with torch.device(device):  # random init on the device: seconds for 8B parameters, not minutes
        built["transformer"] = SD3Transformer2DModel(**comps["transformer"]["config"])
        built["vae"] = AutoencoderKL(**comps["vae"]["config"])
        for name in ("text_encoder", "text_encoder_2"):
            built[name] = CLIPTextModelWithProjection(CLIPTextConfig(**comps[name]["config"]))
        built["text_encoder_3"] = T5EncoderModel(T5Config(**comps["text_encoder_3"]["config"]))
    tokenizers = {"tokenizer": clip_tokenizer(), "tokenizer_2": clip_tokenizer(), "tokenizer_3": t5_tokenizer()}
    for name in ("tokenizer", "tokenizer_2"):
        tokenizers[name].model_max_length = 77
    tokenizers["tokenizer_3"].model_max_length = 256
    pipe = StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    **{k: v.to(torch.bfloat16).eval() for k, v in built.items()}, **tokenizers)
    pipe.save_pretrained(str(out))


# ------------------------------------------------------------------------------------------------------------------
# step
# ------------------------------------------------------------------------------------------------------------------

def arm_config(arm: str, args, pipe: Path, reward: Path, out: Path):
    from tools.bench.whole_step import CONFIGS, own_overrides

    from jagg_scale.estimate.layout import rank_share
    from jagg_scale.train import load_config

    config = ROOT / CONFIGS.get(arm, "configs/sd35m_pickscore.yaml")
    world = args.step_world
    share = rank_share(load_config(config, check_files=False), world)
    tiny = ["train.prompts_per_step=1", "train.minibatch_size=12", "train.micro_batch_size=12", "grpo.group_size=24",
            "model.max_sequence_length=16", "model.resolution=16", "model.lora.rank=4",
            "model.lora.alpha=8"] if args.tiny else []
    rows = 24 if args.tiny else 48 // world * 24
    own = own_overrides(arm, rows)
    if arm == "Flow-GRPO":  # its own 9-row batch, not a scaled one (or the whole share when smaller)
        fg = min(9, rows // 2)
        own = [o for o in own if not o.startswith(("sampling.chunk_size", "train.micro_batch_size"))]
        own += [f"sampling.chunk_size={fg}", f"train.micro_batch_size={fg}"]
    # model.lora.expect_modules: the recipe's count is its real model's, not the bench model's
    return load_config(config, [*share, *tiny, f"model.pretrained={pipe}", "model.lora.expect_modules=null",
                                f"reward.options.path={reward}",
                                f"reward.options.processor_path={reward}", "data.prompt_file=null",
                                f"data.prompts={json.dumps(PROMPTS)}", "eval.enabled=false", "reward.background=false",
                                "parallel.engine=none", "log.wandb=false", "log.progress=false",
                                "run.checkpoint_every=0", "run.resume=none", "run.overwrite=true",
                                f"run.device={args.device}", f"run.output_dir={out}", *own])


def section_step(args, device, state) -> dict:
    from tools.bench.whole_step import ARMS, FlowGRPOUpdater, PhaseClock

    from jagg_scale.estimate import memory as E
    from jagg_scale.estimate import steptime as T
    from jagg_scale.train import Trainer

    work = Path(state["work"])
    pipe, reward, built = write_components(work / "real", device, args.tiny)
    out = {"layout": f"sd35m_pickscore, one rank of {args.step_world} (estimate/layout.py rank_share), one process",
           "components": built, "arms": {}}
    print(f"  components written in {built['seconds']} s", flush=True)
    t_section = time.perf_counter()
    for arm in ("shipped", "Flow-GRPO", "fast recipe"):  # the ratio's two arms first
        assert arm in ARMS
        if time.perf_counter() - t_section > args.step_budget:  # the device's minutes are counted: stop in time
            out["arms"][arm] = {"skipped": f"the section had run {args.step_budget} s (--step-budget)"}
            continue
        cfg = arm_config(arm, args, pipe, reward, work / f"step_{arm.replace(' ', '_').replace('+', 'plus')}")
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        if arm == "Flow-GRPO":
            trainer.algorithm = FlowGRPOUpdater(cfg, trainer.policy, trainer.engine, trainer.dist)
        load_s = time.perf_counter() - t0
        try:
            _warm(trainer, device)
            clock = PhaseClock(trainer, sync=lambda: sync(device))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            phases = clock.step(trainer, 0)
            s = E.prepare(cfg, 1, memory=False)
            R, B = E.local_rows(cfg, 1)
            shares = {"local_rows": R, "local_batch": B, "sampling_batch": trainer.policy.rollout_batch,
                      "micro_batch_size": min(cfg.train.micro_batch_size or B, B)}
            model = T.step_seconds(s, shares, cfg_rows_with_grad=arm == "Flow-GRPO")
            rates = {p: round(model["tflop"][q] / phases[p], 1) for p, q in
                     (("sampling", "rollout"), ("reference", "reference"), ("train", "train"),
                      ("train_nograd", "train_nograd")) if phases[p] > 0 and model["tflop"][q]}
            out["arms"][arm] = {"seconds": {k: round(v, 3) for k, v in phases.items()}, "tflops": rates,
                                "load_seconds": round(load_s, 1), "rows": R, "model_seconds_h200":
                                    {k: round(v, 2) for k, v in model.items() if not isinstance(v, dict)}}
            if device.type == "cuda":
                out["arms"][arm]["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            print(f"  {arm}: step {phases['step']:.1f} s, " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()
                                                                        if k != "step") + f"; TFLOP/s {rates}",
                  flush=True)
        finally:
            trainer.close()
            del trainer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    steps = {a: r["seconds"]["step"] for a, r in out["arms"].items() if "seconds" in r}
    out["speedup_vs_flow_grpo"] = {a: round(steps["Flow-GRPO"] / t, 3) for a, t in steps.items()
                                   if "Flow-GRPO" in steps}
    return out


def _warm(trainer, device) -> None:
    """One with-grad pass of two rows through the policy: kernels chosen and the allocator grown before timing (a
    whole warm-up step would double the section's time)."""
    predict = trainer.policy.model_fn()
    c, _ = trainer.policy.split_cond(trainer.policy.encode(PROMPTS[:2]))
    x = torch.randn(2, *trainer.model.latent_shape, device=device)
    predict(x, torch.rand(2, device=device), c).float().square().mean().backward()
    for p in trainer.engine.params:
        p.grad = None
    sync(device)


# ------------------------------------------------------------------------------------------------------------------
# profile
# ------------------------------------------------------------------------------------------------------------------

KERNEL_CLASSES = (("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention")),
                  ("matmul", ("gemm", "matmul", "cutlass", "sm90_xmma", "nvjet", "addmm", "mm", "bmm", "linear")),
                  ("copy / cast", ("copy", "to_copy", "cast", "convert", "contiguous", "cat")),
                  ("norm / elementwise", ("norm", "elementwise", "vectorized", "reduce", "mul", "add", "silu", "gelu",
                                          "softmax", "exp", "pow", "rsqrt", "mean")))


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profile_pass(fn, device) -> dict:
    """Device (CUDA) or CPU self time by kernel class and the top kernels of one call of fn, after one warm-up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    times = Counter()
    classes = Counter()
    for e in prof.key_averages():
        t = getattr(e, attr, 0) or 0
        if t <= 0 or (device.type == "cuda" and e.device_type != torch.autograd.DeviceType.CUDA):
            continue
        times[e.key] += t
        classes[kernel_class(e.key)] += t
    total = sum(classes.values()) or 1
    return {"device_ms": round(total / 1e3, 2),
            "by_class": {k: round(100 * v / total, 1) for k, v in classes.most_common()},
            "top": [[k[:90], round(v / 1e3, 2)] for k, v in times.most_common(12)]}


def section_profile(args, device, state) -> dict:
    from jagg_scale.parallel.blocks import compile_blocks
    from tools.gpu_common import micro_batch_inputs

    policy, cfg, B, gen, cond = micro_batch_inputs(args, device, state, seed=2)
    x = torch.randn(B, cfg["in_channels"], cfg["sample_size"], cfg["sample_size"], generator=gen, device=device)
    s = torch.rand(B, generator=gen, device=device)

    def grad_pass():
        policy(x, s, cond).float().square().mean().backward()

    def nograd_pass():
        with torch.no_grad():
            policy(x, s, cond)

    out = {"rows": B, "eager": {"grad": profile_pass(grad_pass, device), "nograd": profile_pass(nograd_pass, device)}}
    for name, fn in (("grad", grad_pass), ("nograd", nograd_pass)):
        out["eager"][name]["seconds"] = _seconds(fn, device)
    if args.tiny:  # compiling on a 2-core CPU costs more than the rest of the check: the device run does it
        out["compiled"] = {"error": "not run at --tiny"}
        return out
    t0 = time.perf_counter()
    compile_blocks(policy)
    try:
        first = _seconds(grad_pass, device, repeats=1)  # compiles
        out["compiled"] = {"compile_seconds": round(time.perf_counter() - t0, 1), "first_seconds": first,
                           "grad_seconds": _seconds(grad_pass, device), "nograd_seconds": _seconds(nograd_pass, device)}
        out["compiled"]["speedup_grad"] = round(out["eager"]["grad"]["seconds"] / out["compiled"]["grad_seconds"], 3)
    except Exception as exc:  # noqa: BLE001 - a compile failure is a finding of the check, not its end
        out["compiled"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    for p in policy.parameters():
        p.grad = None
    print(f"  profile: eager grad {out['eager']['grad']['seconds']} s {out['eager']['grad']['by_class']}; "
          f"compiled {out['compiled']}", flush=True)
    return out


def _seconds(fn, device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2], 4)


# ------------------------------------------------------------------------------------------------------------------
# docs/benchmarks.md
# ------------------------------------------------------------------------------------------------------------------

def markdown(sec: dict) -> list[str]:
    """The step and profile sections' lines of the GPU section (gpu_check.markdown)."""
    out = []
    step = sec.get("step")
    if step:
        out += [f"**One rank's whole training step at the real shape** ({step['layout']}; every component at its "
                "published size, random weights; one warm-up pass, one timed step per arm; seconds, achieved TFLOP/s "
                "of the phase's arithmetic, peak memory):", "",
                "| arm | step s | sampling | reference | train (grad) | train (no grad) | encode | decode | reward | "
                "TFLOP/s sampling / train | peak GiB | vs Flow-GRPO |", "|---" * 12 + "|"]
        for arm, r in step["arms"].items():
            if "seconds" not in r:
                out.append(f"| {arm} | {r.get('skipped', '-')} |" + " |" * 10)
                continue
            t, f = r["seconds"], r["tflops"]
            out.append(f"| {arm} | {t['step']:.1f} | " + " | ".join(f"{t[p]:.1f}" for p in (
                "sampling", "reference", "train", "train_nograd", "encode", "decode", "reward")) +
                f" | {f.get('sampling', '-')} / {f.get('train', '-')} | {r.get('peak_gib', '-')} | "
                f"{step['speedup_vs_flow_grpo'].get(arm, float('nan')):.2f}x |")
        out.append("")
    prof = sec.get("profile")
    if prof:
        e, c = prof["eager"], prof.get("compiled", {})
        out += [f"**Profile of one pass at the production micro-batch** ({prof['rows']} rows): with grad "
                f"{e['grad']['seconds']} s, device time by kernel class {e['grad']['by_class']}; no grad "
                f"{e['nograd']['seconds']} s, {e['nograd']['by_class']}. parallel.compile: "
                + (f"with grad {c.get('grad_seconds')} s ({c.get('speedup_grad')}x), no grad {c.get('nograd_seconds')}"
                   f" s, compiled in {c.get('compile_seconds')} s" if "error" not in c else c["error"]) + ".", ""]
    return out
