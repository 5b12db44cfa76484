"""Activation bytes: measured coefficients (measure.py), composed over a transformer's real depth.

Each quantity is fit as rows x (a x image tokens + b x text tokens + c) + d per block type and mode (grad | ckpt |
nograd): fpeak (the forward's peak above its inputs), keep (bytes left after the forward), out (the outputs, equal
to their gradients) and bpeak (the backward's peak above its start). Composed over the blocks:

    forward   peak = max over blocks of (saved so far + that block's forward peak)
    backward  peak = max over blocks, last first, of (saved so far + grad of its outputs + its backward peak
                     + FSDP2's reduce buffers of that block)

plus a root residual for the embedders and the head. The coefficients live in coefficients.json beside this file
(committed; `jagg-estimate ... --measure` adds what a config needs and the file lacks, on this CPU), or in the file
$JAGG_ESTIMATE_CACHE names, read over the committed one and written instead of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

__all__ = ["CoefficientsMissing", "cached", "compose", "cpu_model", "ev", "key", "reduce_buffers",
           "transformer_activations"]

COMMITTED = Path(__file__).resolve().parent / "coefficients.json"


class CoefficientsMissing(LookupError):
    """No measured coefficients for a component the config needs (jagg-estimate --measure measures them)."""


def key(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cache_file() -> Path:
    return Path(os.environ["JAGG_ESTIMATE_CACHE"]) if os.environ.get("JAGG_ESTIMATE_CACHE") else COMMITTED


def _table() -> dict:
    table = json.loads(COMMITTED.read_text()) if COMMITTED.is_file() else {}
    extra = _cache_file()
    if extra != COMMITTED and extra.is_file():
        table.update(json.loads(extra.read_text()))
    return table


def cached(entry: str, label: str, measure_fn, allow: bool):
    """The coefficients stored under `entry`, measured now with measure_fn() when allowed (else CoefficientsMissing)."""
    table = _table()
    if entry not in table:
        if not allow:
            raise CoefficientsMissing(f"no measured coefficients for {label} (key {entry}): run jagg-estimate with "
                                      "--measure (CPU, minutes)")
        import torch

        print(f"measuring {label} on the CPU ...", file=sys.stderr, flush=True)
        value = measure_fn()
        path = _cache_file()
        stored = json.loads(path.read_text()) if path.is_file() else {}  # re-read: others may have written
        try:
            import diffusers

            diffusers_version = diffusers.__version__
        except ImportError:
            diffusers_version = None
        stored[entry] = {"label": label, "torch": torch.__version__, "diffusers": diffusers_version,
                         "cpu_model": cpu_model(), "value": value}
        path.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        table[entry] = stored[entry]
    return table[entry]["value"]


def cpu_model() -> str:
    """The CPU's model name (recorded beside measured coefficients, and by the benchmarks)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ev(coef, n, i, t, clamp=True) -> float:
    a, b, c, d = coef[:4]
    v = n * (a * i + b * t + c) + d
    return max(0.0, v) if clamp else v


def compose(fits: dict, types: list[str], mode: str, n: int, i: int, t: int, extra=None) -> float:
    """Peak bytes of the blocks `types` in forward then backward order (module docstring); mode grad|ckpt|nograd.
    `extra[j]`: bytes that exist only during block j's backward (FSDP2's gradient reduce buffers)."""
    def q(name, k):
        return ev(fits[k][f"{name}_{mode}"], n, i, t)

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
    return compose(coef["fits"], coef["types"], mode, n, i, t, extra) + ev(coef["fits"][f"root_{mode}"], n, i, t, False)


def reduce_buffers(block_train: list[int], cdt: int) -> list[float]:
    """FSDP2's bytes during block j's backward: its unsharded gradient (compute dtype), the float32 reduce-scatter
    input copied from it, and the previous block's reduce-scatter input still in flight (the backward runs on)."""
    nxt = list(block_train[1:]) + [0]
    return [(cdt + 4) * b + 4 * b_prev for b, b_prev in zip(block_train, nxt)]
