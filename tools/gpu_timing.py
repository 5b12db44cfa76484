"""The device check's timing helpers (tools/gpu_check.py and its sections in gpu_step.py and gpu_families.py): device
syncs, peak memory, host-sync counters, a timed case, and one window trained per step and by JAGG."""

from __future__ import annotations

import statistics
import time

import torch

from jagg_scale.grpo.loss import GRPOStepLoss
from jagg_scale.grpo.rollout import sample_sde
from jagg_scale.grpo.schedule import sigma_schedule
from jagg_scale.jagg import exact_backward, jagg_backward
from jagg_scale.train.host_syncs import CudaSyncs, HostSyncs

NOISE_LEVEL, SHIFT, CLIP, NUM_STEPS = 0.7, 3.0, 1e-4, 10


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
