"""The preemption signal's lead time per model size: docs/launchers.md's table ("How long a preemption save takes").

    python -m tools.checkpoint_rate [--node-gbps 1.0] [--hash-gbps 0.5] [--gpus 8]

Checkpoint bytes per model (parameter counts from the estimator's shapes, jagg_scale/estimate/shapes/) for a
full fine-tune (fp32 weights + AdamW's two fp32 moments: 12 bytes per parameter, 16 with train.ema_decay > 0) and a
LoRA (the same for the adapter only), and the save time on `nodes` nodes of GPUS ranks each, every rank writing and
hashing its own 1/(nodes x GPUS) of the bytes:

    t_save = B / (nodes x W_node) + B / (nodes x GPUS x H)

W_node: the filesystem's write rate per node (--node-gbps, default a conservative 1 GB/s); H: sha256 per core
(--hash-gbps, default a conservative 0.5 GB/s; about 1 GB/s measured with SHA-NI). A filesystem's own rates:
`python -m jagg_scale.estimate.preemption --measure DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys

# the lead beyond the step (2 x t_save + 30 s) and t_save itself: jagg_scale/estimate/preemption.py, which
# slurm/jagg.sbatch checks a job against
from jagg_scale.estimate.preemption import GB, HASH_GBPS, MARGIN_S, NODE_GBPS, SAFETY, save_seconds

MODELS = {"sd35_medium": "SD3.5-medium", "sd35_large": "SD3.5-large", "flux1_dev": "FLUX.1-dev"}
LORA_RANK = 32  # the shipped LoRA configs (configs/sd35m_*.yaml)
NODES = (1, 2, 4)


def checkpoint_bytes() -> dict[str, dict[str, float]]:
    """{model: {"full": bytes, "full+ema": bytes, "lora": bytes}} of the trainable state a checkpoint holds."""
    from jagg_scale.estimate.shapes import SHAPES, transformer_stats
    from jagg_scale.models.lora import lora_targets

    out = {}
    for name in MODELS:
        shapes = json.loads((SHAPES / f"{name}.json").read_text())
        st = transformer_stats(shapes["components"]["transformer"], LORA_RANK, lora_targets(shapes["kind"], ()))
        out[name] = {"params": st["params"], "lora_params": st["lora_params"], "full": 12 * st["params"],
                     "full+ema": 16 * st["params"], "lora": 12 * st["lora_params"]}
    return out


def table(sizes: dict, gpus: int, node_gbps: float, hash_gbps: float) -> str:
    head = " | ".join(f"t_save, {n} node{'s' if n > 1 else ''}" for n in NODES)
    lines = [f"| model | training | checkpoint | per rank at {NODES[1]} x {gpus} | {head} | lead beyond the step, "
             f"{NODES[1]} nodes |", "|---|---|---|---|" + "---|" * len(NODES) + "---|"]
    for name, b in sizes.items():
        for kind, label in (("full", "full fine-tune"), ("full+ema", "full + EMA"), ("lora", f"LoRA r{LORA_RANK}")):
            nbytes = b[kind]
            t = [save_seconds(nbytes, n, gpus, node_gbps, hash_gbps) for n in NODES]
            lead = SAFETY * t[1] + MARGIN_S
            cells = " | ".join(f"{x:,.0f} s" if x >= 1 else f"{x:.2f} s" for x in t)
            lines.append(f"| {MODELS[name]} | {label} | {_size(nbytes)} | {_size(nbytes / (NODES[1] * gpus))} | "
                         f"{cells} | {lead:,.0f} s |")
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:,.1f} GB" if nbytes >= GB else f"{nbytes / 1e6:,.0f} MB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--node-gbps", type=float, default=NODE_GBPS, help="filesystem write rate per node (GB/s)")
    ap.add_argument("--hash-gbps", type=float, default=HASH_GBPS, help="sha256 rate per core (GB/s)")
    ap.add_argument("--gpus", type=int, default=8, help="ranks per node")
    args = ap.parse_args(argv)
    print(f"W_node = {args.node_gbps} GB/s per node, H = {args.hash_gbps} GB/s sha256 per rank, {args.gpus} ranks "
          f"per node; lead beyond the step = {SAFETY:g} x t_save + {MARGIN_S} s\n")
    print(table(checkpoint_bytes(), args.gpus, args.node_gbps, args.hash_gbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
