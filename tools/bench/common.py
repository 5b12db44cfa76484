"""Shared pieces of the benchmark parts: the machine record, the SD3-shaped DiT and its GRPO problem, paired
timing rounds, and a torch.profiler summary for cases that miss a target."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


from jagg_scale.grpo.loss import GRPOStepLoss, StepBatch
from jagg_scale.grpo.rollout import Trajectories, sample_sde
from jagg_scale.grpo.schedule import sigma_schedule
from jagg_scale.estimate.activations import cpu_model
from jagg_scale.models.sd3 import SD3TransformerVelocity

ROOT = Path(__file__).resolve().parents[2]

NOISE_LEVEL, SHIFT, CLIP = 0.7, 3.0, 1e-4

# SD3.5-medium-shaped (joint blocks, dual attention in the first layers, RMS qk-norm), shrunk to ~45M parameters:
# 8 layers of 6 heads x 64 = 384 hidden, 32x32x16 latents in 2x2 patches (256 image tokens), 32 text tokens of
# a small joint_attention_dim. Text embeddings are random: the bench times the transformer, not an encoder.
SD3_FULL = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=8, attention_head_dim=64,
                num_attention_heads=6, joint_attention_dim=256, caption_projection_dim=384,
                pooled_projection_dim=256, pos_embed_max_size=32, qk_norm="rms_norm", dual_attention_layers=(0, 1, 2))
SD3_QUICK = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
                 pos_embed_max_size=8, qk_norm="rms_norm", dual_attention_layers=(0,))
TEXT_TOKENS = {"full": 32, "quick": 8}


# ------------------------------------------------------------------------------------------------------------------
# machine
# ------------------------------------------------------------------------------------------------------------------

def quiet() -> None:
    """No progress bars from diffusers / transformers when the trainers load a pipeline."""
    try:
        from diffusers.utils import logging as dlog

        dlog.disable_progress_bar()
        dlog.set_verbosity_error()
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.set_verbosity_error()
    except Exception:
        pass


def cpu_mhz() -> float | None:
    try:
        vals = [float(line.split(":", 1)[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("cpu MHz")]
        return round(statistics.mean(vals), 1) if vals else None
    except (OSError, ValueError):
        return None


def machine_info() -> dict:
    info = {
        "cpu_model": cpu_model(), "cpu_mhz": cpu_mhz(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "device": "cpu",
        "python": platform.python_version(), "platform": platform.platform(),
    }
    try:
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except Exception:
        pass
    return info


def matmul_gflops(n: int = 1024, reps: int = 10) -> float:
    """The machine's matmul speed right now: a per-round probe that makes a disturbed round visible."""
    a = torch.randn(n, n)
    a @ a
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ a
    return round(reps * 2 * n**3 / (time.perf_counter() - t0) / 1e9, 1)


# ------------------------------------------------------------------------------------------------------------------
# the SD3-shaped DiT and its GRPO problem
# ------------------------------------------------------------------------------------------------------------------

class SD3Shaped(SD3TransformerVelocity):
    """An SD3Transformer2DModel of `cfg` (random weights) as a velocity model (models/sd3.py)."""

    def __init__(self, cfg: dict):
        from diffusers import SD3Transformer2DModel

        super().__init__(SD3Transformer2DModel(**cfg))
        self.cfg = dict(cfg)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def tokens(self, text_tokens: int) -> int:
        return (self.cfg["sample_size"] // self.cfg["patch_size"]) ** 2 + text_tokens


def sd3_config(quick: bool) -> tuple[dict, int]:
    return (SD3_QUICK, TEXT_TOKENS["quick"]) if quick else (SD3_FULL, TEXT_TOKENS["full"])


def random_cond(cfg: dict, text_tokens: int, batch: int, generator: torch.Generator):
    embeds = torch.randn(batch, text_tokens, cfg["joint_attention_dim"], generator=generator)
    pooled = torch.randn(batch, cfg["pooled_projection_dim"], generator=generator)
    return embeds, pooled


@dataclass
class Problem:
    """An SD3-shaped model and a real on-policy GRPO minibatch: SDE trajectories, random advantages."""

    model: SD3Shaped
    cond: tuple
    traj: Trajectories
    step_batch: StepBatch
    batch: int
    text_tokens: int
    rollout_seconds: float
    guidance: float = 1.0
    uncond: tuple | None = None  # with guidance != 1: the unconditional conditioning (random, like `cond`)

    def loss(self, num_trained: int, guidance: float | None = None):
        """GRPOStepLoss on this batch as the engine's step_loss(k, v); each L_k scaled by 1/num_trained (Flow-GRPO's
        mean over trained steps). With CFG it takes the conditional prediction (guidance = the problem's); pass
        guidance=1 for a loss called with the guided velocity itself."""
        g = self.guidance if guidance is None else guidance
        return GRPOStepLoss(noise_level=NOISE_LEVEL, clip_range=CLIP, scale=1.0 / num_trained,
                            guidance=g).on(self.step_batch)

    def describe(self) -> dict:
        return {"kind": "diffusers SD3Transformer2DModel (random weights)", "config": self.model.cfg,
                "parameters": self.model.num_params(), "text_tokens": self.text_tokens,
                "tokens_per_sample": self.model.tokens(self.text_tokens), "batch": self.batch,
                "num_steps": int(self.traj.velocities.shape[0]), "noise_level": NOISE_LEVEL, "shift": SHIFT,
                "clip_range": CLIP, "rollout_seconds": round(self.rollout_seconds, 2), "dtype": "float32",
                "guidance": self.guidance}


_PROBLEMS: dict = {}


def sd3_problem(quick: bool, batch: int, num_steps: int, seed: int = 0, guidance: float = 1.0) -> Problem:
    """Built once per (size, batch, steps, seed, guidance) and shared by the parts that time the same model."""
    key = (quick, batch, num_steps, seed, guidance)
    if key not in _PROBLEMS:
        cfg, text_tokens = sd3_config(quick)
        torch.manual_seed(seed)
        model = SD3Shaped(cfg).train()
        gen = torch.Generator().manual_seed(seed)
        cond = random_cond(cfg, text_tokens, batch, gen)
        uncond = random_cond(cfg, text_tokens, batch, gen) if guidance != 1.0 else None
        noise = torch.randn(batch, *model.latent_shape, generator=gen)
        sigmas = sigma_schedule(num_steps, SHIFT)
        t0 = time.perf_counter()
        traj = sample_sde(model, cond if uncond is None else (cond, uncond), noise, sigmas, noise_level=NOISE_LEVEL,
                          generator=gen, guidance=guidance)
        rollout_s = time.perf_counter() - t0
        advantages = torch.randn(batch, generator=gen)
        step_batch = traj.step_batch(torch.arange(batch), advantages, torch.ones(batch, dtype=torch.bool))
        for p in model.parameters():  # grads allocated once: every method accumulates into existing buffers
            p.grad = torch.zeros_like(p)
        _PROBLEMS[key] = Problem(model, cond, traj, step_batch, batch, text_tokens, rollout_s, guidance, uncond)
    return _PROBLEMS[key]


# ------------------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------------------

def timed(fn: Callable[[], object], model: torch.nn.Module | None = None) -> float:
    if model is not None:
        model.zero_grad(set_to_none=False)  # outside the timed region
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired_rounds(cases: dict[str, Callable[[], object]], model, repeats: int, label: str = "",
                  warmup: bool = True, groups: list[list[str]] | None = None) -> dict:
    """Time every case once per round. Cases compared with each other form a group, timed back to back, its order
    rotated between rounds so that drift hits all alike. Returns {"times": {case: [s, ...]}, "gflops": [...]}
    (a matmul probe before each round)."""
    names = list(cases)
    groups = groups or [names]
    if warmup:
        for n in names:
            timed(cases[n], model)
    times = {n: [] for n in names}
    gflops = []
    for r in range(repeats):
        gflops.append(matmul_gflops())
        order = [n for g in groups for n in g[r % len(g):] + g[: r % len(g)]]
        for n in order:
            times[n].append(timed(cases[n], model))
        print(f"    {label} round {r + 1}/{repeats} ({gflops[-1]:.0f} GFLOP/s): "
              + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names), flush=True)
    return {"times": times, "gflops": gflops}


def median(xs) -> float:
    return float(statistics.median(xs))


def paired_speedup(base: list[float], other: list[float]) -> float:
    """Median over rounds of t(base) / t(other) from the same round (cancels slow drift of the machine)."""
    return median([a / b for a, b in zip(base, other)])


# ------------------------------------------------------------------------------------------------------------------
# profiling a case that misses its target
# ------------------------------------------------------------------------------------------------------------------

def top_ops(fn: Callable[[], object], n: int = 8, sort_by: str = "self_cpu_time_total", memory: bool = False) -> dict:
    """One run of fn under torch.profiler (CPU): the top n ops by self CPU time (or self CPU memory)."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=memory) as prof:
        fn()
    wall = time.perf_counter() - t0
    avgs = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in avgs) or 1.0
    rows = sorted(avgs, key=lambda e: getattr(e, sort_by), reverse=True)[:n]
    return {
        "wall_seconds_profiled": round(wall, 3),
        "total_self_cpu_ms": round(total / 1e3, 1),
        "ops": [{"op": e.key, "calls": int(e.count), "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1),
                 "pct": round(100 * e.self_cpu_time_total / total, 1),
                 **({"self_cpu_memory_mb": round(e.self_cpu_memory_usage / 2**20, 1)} if memory else {})}
                for e in rows],
    }


def tensor_peaks(prof, baseline: int = 0) -> dict:
    """{phase: peak live tensor bytes} of a torch.profiler(profile_memory=True) run: the running sum, from
    `baseline`, of the allocator's CPU [memory] events (+ alloc, - free), each event given to the innermost
    record_function window named `phase:<name>` holding it ("other" outside them)."""
    events = list(prof.profiler.kineto_results.events())
    windows = sorted(((e.start_ns(), e.end_ns(), e.name()[6:]) for e in events if e.name().startswith("phase:")),
                     key=lambda w: w[1] - w[0])
    mem = sorted((e for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"),
                 key=lambda e: e.start_ns())
    cur, peaks = baseline, {}
    for e in mem:
        cur += e.nbytes()
        phase = next((w[2] for w in windows if w[0] <= e.start_ns() <= w[1]), "other")
        peaks[phase] = max(peaks.get(phase, baseline), cur)
    return peaks


def tensor_peak(prof) -> int:
    """The peak of live tensor bytes above the start of the profiled run."""
    return max(tensor_peaks(prof).values(), default=0)


def ops_table(prof: dict) -> str:
    mem = any("self_cpu_memory_mb" in o for o in prof["ops"])
    head = "| op | calls | self CPU ms | % |" + (" self CPU MB |" if mem else "")
    lines = [head, "|---|---|---|---|" + ("---|" if mem else "")]
    for o in prof["ops"]:
        lines.append(f"| `{o['op']}` | {o['calls']} | {o['self_cpu_ms']:.1f} | {o['pct']:.1f} |"
                     + (f" {o['self_cpu_memory_mb']:.1f} |" if mem else ""))
    return "\n".join(lines)
