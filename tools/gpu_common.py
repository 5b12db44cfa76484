"""What the device check's sections share (tools/gpu_check.py and its sections in gpu_step.py and gpu_families.py,
which import this module and never each other): the SD3.5-medium-shaped policy, device syncs, peak memory, host-sync
counters, a timed case, and one window trained per step and by JAGG."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from jagg_scale.grpo.loss import GRPOStepLoss
from jagg_scale.grpo.rollout import sample_sde
from jagg_scale.grpo.schedule import sigma_schedule
from jagg_scale.jagg import exact_backward, jagg_backward
from jagg_scale.train.host_syncs import CudaSyncs, HostSyncs

ROOT = Path(__file__).resolve().parents[1]
NOISE_LEVEL, SHIFT, CLIP, NUM_STEPS = 0.7, 3.0, 1e-4, 10
# CLIP 77 + sd35m_pickscore's model.max_sequence_length T5 tokens (Flow-GRPO's 128), as the SD3 adapter encodes them
TEXT_TOKENS = 77 + 128
TINY_CFG = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
                pos_embed_max_size=8, qk_norm="rms_norm", dual_attention_layers=(0,))


# ------------------------------------------------------------------------------------------------------------------
# the SD3.5-medium-shaped policy
# ------------------------------------------------------------------------------------------------------------------

def make_policy(cfg: dict, device: torch.device, lora_rank: int) -> torch.nn.Module:
    """The SD3 transformer of `cfg` as a velocity model (models/sd3.py SD3TransformerVelocity) with LoRA on the
    library's targets and per-block checkpointing, randomly initialised on the device (seconds, not minutes, for
    2.5B parameters), called under bf16 autocast."""
    from diffusers import SD3Transformer2DModel

    from jagg_scale.models.lora import add_lora, lora_targets
    from jagg_scale.models.sd3 import SD3TransformerVelocity

    with torch.device(device):
        transformer = SD3Transformer2DModel(**cfg)
    add_lora(transformer, rank=lora_rank, alpha=2 * lora_rank, targets=lora_targets("sd3"))
    transformer.enable_gradient_checkpointing()
    return SD3TransformerVelocity(transformer, autocast=torch.bfloat16)


def model_config(tiny: bool) -> dict:
    if tiny:
        return dict(TINY_CFG)
    from jagg_scale.estimate.shapes import pipeline_shapes

    shapes = pipeline_shapes(None, "sd35_medium")
    cfg = dict(shapes["components"]["transformer"]["config"])
    cfg["sample_size"] = 64  # 512 px / VAE factor 8
    return cfg


def random_cond(cfg: dict, rows: int, tokens: int, device: torch.device, gen: torch.Generator):
    embeds = torch.randn(rows, tokens, cfg["joint_attention_dim"], generator=gen, device=device)
    pooled = torch.randn(rows, cfg["pooled_projection_dim"], generator=gen, device=device)
    return embeds, pooled


def build_policy(args, device):
    cfg = model_config(args.tiny)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    policy = make_policy(cfg, device, lora_rank=args.lora_rank).train()
    sync(device)
    built = time.perf_counter() - t0
    n_all = sum(p.numel() for p in policy.parameters())
    n_lora = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    for p in policy.parameters():  # gradients allocated once: every case accumulates into existing buffers
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return policy, cfg, {"parameters": n_all, "lora_parameters": n_lora, "build_seconds": round(built, 1),
                         "latent": [cfg["in_channels"], cfg["sample_size"], cfg["sample_size"]],
                         "tokens_per_row": (cfg["sample_size"] // cfg["patch_size"]) ** 2 + args.text_tokens}


def micro_batch_inputs(args, device, state, seed: int):
    """(policy, its config, B = the production micro-batch's rows, a seeded generator, their conditioning): the
    window section's policy when it ran, else a new one."""
    policy, cfg = state.get("policy"), state.get("cfg")
    if policy is None:
        policy, cfg, _ = build_policy(args, device)
    gen = torch.Generator(device).manual_seed(seed)
    return policy, cfg, args.micro_rows, gen, random_cond(cfg, args.micro_rows, args.text_tokens, device, gen)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gib(n: float) -> float:
    return round(n / 2**30, 3)


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"allocated_gib": gib(torch.cuda.memory_allocated(device)),
            "peak_gib": gib(torch.cuda.max_memory_allocated(device))}


def syncs_counter(device: torch.device):
    return CudaSyncs() if device.type == "cuda" else HostSyncs()


def time_case(fn, policy, device, repeats: int) -> dict:
    """Warm-up once, then `repeats` timed runs (median); peak memory above the resident state; host syncs of one run."""
    policy.zero_grad(set_to_none=False)
    fn()
    times = []
    for _ in range(repeats):
        policy.zero_grad(set_to_none=False)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    policy.zero_grad(set_to_none=False)
    sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    peak_reset(device)
    with syncs_counter(device) as counter:
        fn()
        sync(device)
    out = {"seconds": round(statistics.median(times), 4), "all_seconds": [round(t, 4) for t in times],
           "host_syncs": counter.count, "sync_calls": dict(counter.by_call.most_common(6))}
    if device.type == "cuda":
        out["peak_above_resident_gib"] = gib(torch.cuda.max_memory_allocated(device) - base)
    return out


def time_windows(args, device, policy, traj, cond, gen) -> dict:
    """ONE window of each width W of the rollout `traj`, trained per step (W passes of B rows) and by JAGG (one
    joint pass of 2B rows, cached values): seconds, speedup against W / 2, peak memory and host syncs."""
    B = traj.latents.shape[1]
    adv = torch.randn(B, generator=gen, device=device)
    batch = traj.step_batch(torch.arange(B, device=device), adv, torch.ones(B, dtype=torch.bool, device=device))
    windows = {}
    for W in args.widths:
        loss = GRPOStepLoss(noise_level=NOISE_LEVEL, clip_range=CLIP, scale=1.0 / W).on(batch)
        lat, sig, vel = traj.latents[:W], traj.sigmas[:W], traj.velocities[:W]
        per_step = time_case(lambda lat=lat, sig=sig, loss=loss: exact_backward(policy, lat, sig, cond, loss),
                             policy, device, args.repeats)
        joint = time_case(lambda lat=lat, sig=sig, loss=loss, vel=vel: jagg_backward(policy, lat, sig, cond, loss,
                                                                                      cached_velocities=vel,
                                                                                      intermediate="cached"),
                          policy, device, args.repeats)
        windows[f"W{W}"] = {"per_step": per_step, "jagg_cached": joint,
                            "speedup": round(per_step["seconds"] / joint["seconds"], 3), "limit": W / 2}
        print(f"  W={W}: per-step {per_step['seconds']:.3f}s, JAGG {joint['seconds']:.3f}s, "
              f"speedup {windows[f'W{W}']['speedup']:.2f}x (limit {W / 2:.1f}x)", flush=True)
    return windows


def rollout_and_windows(args, device, policy, cond, noise, gen) -> dict:
    """An on-policy rollout of noise's rows (timed), then one window of each width trained both ways (time_windows)."""
    sigmas = sigma_schedule(NUM_STEPS, SHIFT).to(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        traj = sample_sde(policy, cond, noise, sigmas, noise_level=NOISE_LEVEL,
                          generator=torch.Generator().manual_seed(0))
    sync(device)
    out = {"rollout_seconds": round(time.perf_counter() - t0, 3), "rows": noise.shape[0],
           "memory_resident": memory(device)}
    out["windows"] = time_windows(args, device, policy, traj, cond, gen)
    return out
