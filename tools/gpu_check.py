"""The device check: what a CPU cannot show, measured in one prepared run on one GPU (<= 8 min on an H100/H200).

    bash tools/gpu_check.sh                                   # on a CUDA machine; results in $OUT or gpu_check_out/
    python -m tools.gpu_check --tiny --device cpu --out DIR   # the same code at toy scale
                                                              # (tests/tools/test_gpu_check.py)

Sections, each in its own try block (a failing one is recorded and the next runs), results written after each:

    env      torch / CUDA / GPU, and the bf16 matmul rate (the ceiling the timings are read against)
    window   the real-shape SD3.5-medium transformer (random init, fp32 master weights, bf16 autocast, per-block
             activation checkpointing, LoRA r32 on Flow-GRPO's targets, 512 px = 64x64x16 latents + 205 text
             tokens), an on-policy rollout of `rows` rows, then ONE window of W steps trained two ways: per-step
             (exact_backward: W forwards + W backwards of B rows) and JAGG (jagg_backward, cached values: one
             joint pass of 2B rows). W = 4 and 8; seconds (median of 3 after a warm-up), speedup, peak memory
             and host syncs per window.
    memory   the production micro-batch (sd35m_pickscore: 72 rows per rank): peak memory of one per-step pass
             (72 rows) and of one joint pass (144 rows), random trajectories; compare with
             jagg-estimate
    syncs    host synchronisations in one training step (Trainer.train_step, after a warm-up step) of the
             sd35m_pickscore per-rank loop (estimate/layout.py rank_share) on the tiny SD3 pipeline: the
             training thread's reads of device tensors (HostSyncs) and, on CUDA, every real sync of the process
             (torch.cuda sync debug mode), with where they happen
    train    `jagg-train` of the tiny SD3 pipeline for 2 steps with run.device=<device>: backend none, then fsdp2
             under torchrun with one process (NCCL on a GPU)
    step     one rank's share of sd35m_pickscore's whole training step at the real shape, every pipeline component
             at its published size, Flow-GRPO's update beside the shipped and the fast recipe, phase by phase
             with achieved TFLOP/s and peak memory (tools/gpu_step.py)
    profile  device time by kernel class of one with-grad and one no-grad pass at the production micro-batch,
             eager and under parallel.compile (tools/gpu_step.py)
    families one window per step and by JAGG at each newer family's real shape, random weights: Qwen-Image's
             20.4B transformer at qwenimage_hps's 720 px + 443 prompt tokens (its longest), bf16 base + LoRA r32, B rows

By default the check runs env, step and profile (~7 min on an H200 at --step-world 16); window, memory, syncs and
train were measured on an H200 already (docs/results/gpu_check.json) and run when named:
--sections env,window,memory,...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from jagg_scale.grpo.loss import GRPOStepLoss
from jagg_scale.grpo.rollout import Trajectories
from jagg_scale.grpo.sde import sde_step_with_logprob
from jagg_scale.grpo.schedule import sigma_schedule
from jagg_scale.jagg import exact_backward, jagg_backward
from jagg_scale.train.host_syncs import CudaSyncs, HostSyncs
from tools import gpu_families, gpu_step
from tools.gpu_common import (CLIP, NOISE_LEVEL, NUM_STEPS, ROOT, SHIFT, TEXT_TOKENS, build_policy, gib,
                              micro_batch_inputs, peak_reset, random_cond, rollout_and_windows, sync)

# ------------------------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------------------------

def section_env(args, device) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
            "python": sys.version.split()[0]}
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "gpu_memory_gib": gib(props.total_memory), "sms": props.multi_processor_count}
        n = 8192
        a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device,
                                                                                   dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        end.synchronize()
        info["bf16_matmul_tflops"] = round(10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12, 1)
        del a, b
    return info


def section_window(args, device, state) -> dict:
    policy, cfg, info = build_policy(args, device)
    state["policy"], state["cfg"] = policy, cfg
    B = args.rows
    gen = torch.Generator(device).manual_seed(0)
    cond = random_cond(cfg, B, args.text_tokens, device, gen)
    noise = torch.randn(B, cfg["in_channels"], cfg["sample_size"], cfg["sample_size"], generator=gen, device=device)
    info |= rollout_and_windows(args, device, policy, cond, noise, gen)
    return info


def section_memory(args, device, state) -> dict:
    """Peak memory of one per-step pass and one joint pass at the production micro-batch (random trajectories:
    the values do not change the memory)."""
    policy, cfg, B, gen, cond = micro_batch_inputs(args, device, state, seed=1)
    shape = (cfg["in_channels"], cfg["sample_size"], cfg["sample_size"])
    sigmas = sigma_schedule(NUM_STEPS, SHIFT).to(device)
    lat = torch.randn(5, B, *shape, generator=gen, device=device)
    vel = torch.randn(4, B, *shape, generator=gen, device=device)
    with torch.no_grad():  # the log-probs of these transitions: ratio 1, the loss path is the real one
        logp = torch.stack([sde_step_with_logprob(lat[k], vel[k], sigmas[k], sigmas[k + 1], noise_level=NOISE_LEVEL,
                                                  sigma_max=float(sigmas[1]), prev_sample=lat[k + 1]).log_prob
                            for k in range(4)])
    traj = Trajectories(latents=lat, velocities=vel, log_probs=logp, sigmas=sigmas[:5])
    batch = traj.step_batch(torch.arange(B, device=device), torch.randn(B, generator=gen, device=device),
                            torch.ones(B, dtype=torch.bool, device=device))
    loss = GRPOStepLoss(noise_level=NOISE_LEVEL, clip_range=CLIP, scale=0.25).on(batch)
    lat, sigmas = lat[:4], sigmas[:4]
    out = {"rows": B, "tokens_per_row": (cfg["sample_size"] // cfg["patch_size"]) ** 2 + args.text_tokens}
    for name, fn in (("per_step_pass", lambda: exact_backward(policy, lat[:1], sigmas[:1], cond, loss)),
                     ("joint_pass", lambda: jagg_backward(policy, lat, sigmas, cond, loss, cached_velocities=vel,
                                                          intermediate="cached"))):
        policy.zero_grad(set_to_none=False)
        sync(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        peak_reset(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out[name] = {"seconds": round(time.perf_counter() - t0, 3), "resident_gib": gib(base)}
        if device.type == "cuda":
            out[name]["peak_gib"] = gib(torch.cuda.max_memory_allocated(device))
            out[name]["peak_above_resident_gib"] = gib(torch.cuda.max_memory_allocated(device) - base)
        print(f"  {name}: {out[name]}", flush=True)
    return out


def tiny_pipeline(work: Path) -> Path:
    from jagg_scale.models.tiny import make_tiny_sd3

    path = work / "tiny_sd3"
    if not path.exists():
        make_tiny_sd3(path, seed=0)
    return path


def train_overrides(pipe: Path, out: Path, device: torch.device) -> list[str]:
    return [f"model.pretrained={pipe}", f"run.output_dir={out}", f"run.device={device.type}", "train.steps=2",
            "run.checkpoint_every=0", "log.wandb=false", "log.progress=false", "run.resume=none",
            "run.overwrite=true"]  # a rerun in the same work dir measures afresh


def section_syncs(args, device, state) -> dict:
    from jagg_scale.train import Trainer, load_config

    from jagg_scale.estimate.layout import rank_share

    # sd35m_pickscore's per-rank loop (one rank of 8) on the tiny pipeline, as the CPU test runs it
    layout = [*rank_share(load_config(ROOT / "configs" / "sd35m_pickscore.yaml", check_files=False), 8),
              "model.lora.rank=4", "model.lora.alpha=8", "run.resume=none"]

    work = Path(state["work"])
    shrink = ["train.prompts_per_step=1", "train.minibatch_size=12", "train.micro_batch_size=12"] if args.tiny else []
    cfg = load_config(ROOT / "configs" / "sd3_tiny_cpu.yaml",  # --tiny: the same loop on 24 rows, not 144
                      [*layout, *shrink, *train_overrides(tiny_pipeline(work), work / "syncs_run", device)])
    trainer = Trainer(cfg)
    try:
        trainer.train_step(0)  # warm-up: allocator, kernels, lazy init
        sync(device)
        out = {}
        with HostSyncs(device=device.type if device.type == "cuda" else None, sites=True) as host:
            if device.type == "cuda":
                with CudaSyncs() as cuda:
                    metrics = trainer.train_step(1)
                    sync(device)
                out["cuda_syncs_per_step"] = cuda.count
                out["cuda_sync_calls"] = dict(cuda.by_call.most_common(8))
            else:
                metrics = trainer.train_step(1)
        out["host_syncs_per_step"] = host.count
        out["host_sync_calls"] = dict(host.by_call.most_common(12))
        out["host_sync_sites"] = dict(host.by_site.most_common(20))
        out["reward_mean"] = metrics.get("reward_mean")
        out["layout"] = "sd35m_pickscore's per-rank loop (one rank of 8, estimate/layout.py) on the tiny SD3 pipeline"
        return out
    finally:
        trainer.close()


TRAIN_CONFIG = str(ROOT / "configs" / "sd3_tiny_cpu.yaml")


def train_commands(pipe: Path, work: Path, device: torch.device) -> dict[str, list[str]]:
    """The section's two jagg-train command lines: backend none, then fsdp2 on one process."""
    return {
        "none": [sys.executable, "-m", "jagg_scale.cli", TRAIN_CONFIG,
                 *train_overrides(pipe, work / "train_none", device)],
        "fsdp2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
                  "jagg_scale.cli", TRAIN_CONFIG, *train_overrides(pipe, work / "train_fsdp2", device),
                  "parallel.engine=fsdp2"],
    }


def section_train(args, device, state) -> dict:
    work = Path(state["work"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = {}
    for name, cmd in train_commands(tiny_pipeline(work), work, device).items():
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.train_timeout)
        metrics = work / f"train_{name}" / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        out[name] = {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 1), "steps_logged": len(lines)}
        if lines:
            last = json.loads(lines[-1])
            out[name]["last"] = {k: last.get(k) for k in ("step", "reward_mean", "loss", "time_rollout", "time_train")}
        if proc.returncode:
            out[name]["stderr_tail"] = proc.stderr[-3000:]
        print(f"  {name}: rc {proc.returncode}, {out[name]['seconds']}s, {len(lines)} steps logged", flush=True)
    return out


def markdown(runs: list[dict]) -> str:
    """docs/benchmarks.md's GPU section from one or more gpu_check.json results (later runs override sections)."""
    sec: dict = {}
    for r in runs:
        sec.update({k: v for k, v in r["sections"].items() if v.get("ok")})
    env = sec.get("env", {})
    out = [f"GPU: {env.get('gpu', '?')} ({env.get('gpu_memory_gib', '?')} GiB, {env.get('sms', '?')} SMs), torch "
           f"{env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, diffusers {env.get('diffusers', '?')}; bf16 matmul "
           f"8192^3: {env.get('bf16_matmul_tflops', '?')} TFLOP/s. Command: `bash tools/gpu_check.sh` "
           f"(`tools/gpu_check.py`; raw results in docs/results/gpu_check.json).", ""]
    wins = [r["sections"]["window"] for r in runs if r["sections"].get("window", {}).get("ok")]
    if wins:
        w0 = wins[-1]
        out += [f"**One window, real-shape SD3.5-medium transformer** ({w0['parameters'] / 1e9:.2f}B parameters, "
                f"random init, fp32 weights under bf16 autocast, per-block checkpointing, LoRA r32 on the library's "
                f"SD3 targets when measured = {w0['lora_parameters'] / 1e6:.1f}M trained; 512 px: "
                f"{w0['tokens_per_row']} tokens per row; median of the timed runs):", "",
                "| B rows | W | per-step s | JAGG s | speedup | W/2 | peak above resident, per-step / JAGG (GiB) | "
                "host syncs |", "|---|---|---|---|---|---|---|---|"]
        for win in wins:
            for W, r in win["windows"].items():
                p, j = r["per_step"], r["jagg_cached"]
                out.append(f"| {win['rows']} | {W[1:]} | {p['seconds']:.3f} | {j['seconds']:.3f} | "
                           f"{r['speedup']:.2f}x | "
                           f"{r['limit']:.1f} | {p.get('peak_above_resident_gib', '-')} / "
                           f"{j.get('peak_above_resident_gib', '-')} | {p['host_syncs']} / {j['host_syncs']} |")
        out += ["", "At B = 8 rows a pass is bound by kernel launches, not arithmetic (8 x 1357 tokens): "
                "one joint pass of 2B rows costs about what one B-row pass does, so the speedup exceeds W/2; "
                "at the production micro-batch (72 rows) the passes are compute-bound and the ratio is read against "
                "W/2.", ""]
    mem = sec.get("memory")
    if mem:
        p, j = mem["per_step_pass"], mem["joint_pass"]
        out += [f"**Memory at sd35m_pickscore's micro-batch** ({mem['rows']} rows x {mem['tokens_per_row']} tokens): "
                f"one per-step pass peaks {p.get('peak_above_resident_gib')} GiB above the resident "
                f"{p['resident_gib']} GiB, one joint JAGG pass ({2 * mem['rows']} rows) "
                f"{j.get('peak_above_resident_gib')}"
                f" GiB ({p['seconds']} s / {j['seconds']} s, first use included). `jagg-estimate "
                f"configs/sd35m_pickscore.yaml --world-size 8` predicts 30.46 GiB of activations + 2.50 GiB of pass "
                f"inputs for the joint pass.", ""]
    syn = sec.get("syncs")
    if syn:
        calls = syn.get("cuda_sync_calls", {})
        # CudaSyncs names the Python line that synchronised; the training thread's calls pass through HostSyncs
        # (host_syncs.py), the reward worker's do not
        main = sum(n for site, n in calls.items() if site.startswith("host_syncs.py"))
        out += [f"**Host synchronisations per training step** ({syn.get('layout', '?')}): "
                f"{syn.get('cuda_syncs_per_step', '-')} real CUDA syncs in the process (torch sync debug mode), of "
                f"which {main} in the training thread and the rest in the reward worker on its own stream; "
                f"{syn['host_syncs_per_step']} reads of device tensors by the training thread. By line: {calls}.", ""]
    out += gpu_step.markdown(sec)
    tr = sec.get("train")
    if tr:
        out += ["**`jagg-train` on the device** (tiny SD3 pipeline, 2 steps): "
                + "; ".join(f"{k}: exit {v['rc']}, {v['steps_logged']} steps logged, {v['seconds']} s"
                            for k, v in tr.items() if isinstance(v, dict)), ""]
    return "\n".join(out)


SECTIONS = {"env": section_env, "window": section_window, "memory": section_memory, "syncs": section_syncs,
            "train": section_train, "step": gpu_step.section_step, "profile": gpu_step.section_profile,
            "families": gpu_families.section_families}
DEFAULT_SECTIONS = ("env", "step", "profile")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy shapes (the CPU smoke test)")
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), help=f"of {','.join(SECTIONS)}")
    p.add_argument("--step-world", type=int, default=16,
                   help="the step section runs one rank's share of sd35m_pickscore on this many ranks (16: 72 rows)")
    p.add_argument("--step-budget", type=float, default=330,
                   help="seconds after which the step section starts no further arm")
    p.add_argument("--rows", type=int, default=None, help="rows B of the window section (default 8; tiny 2)")
    p.add_argument("--micro-rows", type=int, default=None, help="memory section rows (default 72; tiny 2)")
    p.add_argument("--widths", default="4,8")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 3; tiny 1)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--train-timeout", type=int, default=240)
    args = p.parse_args(argv)
    args.rows = args.rows or (2 if args.tiny else 8)
    args.micro_rows = args.micro_rows or (2 if args.tiny else 72)
    args.repeats = args.repeats or (1 if args.tiny else 3)
    args.widths = [int(w) for w in args.widths.split(",")]
    args.text_tokens = 8 if args.tiny else TEXT_TOKENS
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"args": {k: v for k, v in vars(args).items()}, "sections": {}}
    state = {"work": tempfile.mkdtemp(prefix="gpu_check_")}
    for name in args.sections.split(","):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            res = {"ok": True,
                   **(SECTIONS[name](args, device) if name == "env" else SECTIONS[name](args, device, state))}
        except Exception as exc:
            traceback.print_exc()
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        res["section_seconds"] = round(time.perf_counter() - t0, 1)
        results["sections"][name] = res
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
        if name == "memory":
            state.pop("policy", None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("\n== summary")
    for name, res in results["sections"].items():
        brief = {k: v for k, v in res.items() if k not in ("traceback", "windows", "stderr_tail")}
        print(f"{name}: {json.dumps(brief, default=str)[:600]}")
        for W, r in res.get("windows", {}).items():
            print(f"  {W}: per-step {r['per_step']['seconds']}s / JAGG {r['jagg_cached']['seconds']}s = "
                  f"{r['speedup']}x (limit {r['limit']}); peak {r['per_step'].get('peak_above_resident_gib')} / "
                  f"{r['jagg_cached'].get('peak_above_resident_gib')} GiB; syncs {r['per_step']['host_syncs']} / "
                  f"{r['jagg_cached']['host_syncs']}")
    return 0 if all(r["ok"] for r in results["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
