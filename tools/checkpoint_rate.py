"""Checkpoint save rate, and the preemption signal's lead time per model size (docs/launchers.md, "How long a
preemption save takes").

    python -m tools.checkpoint_rate [--gb 2] [--repeats 3] [--dir DIR] [--out docs/results/checkpoint_rate.json]
    python -m tools.checkpoint_rate --table-only [--node-gbps 1.0] [--hash-gbps 0.5] [--gpus 8]

Measure (skipped with --table-only): GB of fp32 tensors saved as a DCP checkpoint through the trainer's own protocol
(checkpoint/local.py `save_checkpoint_dir` around the FSDP2 engine's DCP writer, fsync included), one process,
REPEATS times, in DIR (put it on the filesystem to measure; default: a temp dir). Reported, median over repeats:
the write (DCP save + fsync), the sha256 of the files just written (what each rank does on save), the whole save,
and a verify (what a resume does, page cache warm), in GB/s (1 GB = 1e9 bytes).

Table: checkpoint bytes per model (parameter counts from the estimator's shapes, jagg_scale/estimate/shapes/) for a
full fine-tune (fp32 weights + AdamW's two fp32 moments: 12 bytes per parameter, 16 with train.ema_decay > 0) and a
LoRA (the same for the adapter only), and the save time on `nodes` nodes of GPUS ranks each, every rank writing and
hashing its own 1/(nodes x GPUS) of the bytes:

    t_save = B / (nodes x W_node) + B / (nodes x GPUS x H)

W_node: the filesystem's write rate per node (--node-gbps, default a conservative 1 GB/s); H: sha256 per core
(--hash-gbps, default a conservative 0.5 GB/s; about 1 GB/s measured with SHA-NI).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# the lead beyond the step (2 x t_save + 30 s) and t_save itself: jagg_scale/estimate/preemption.py, which
# slurm/jagg.sbatch checks a job against
from jagg_scale.estimate.preemption import MARGIN_S, SAFETY, save_seconds

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
MODELS = {"sd35_medium": "SD3.5-medium", "sd35_large": "SD3.5-large", "flux1_dev": "FLUX.1-dev"}
LORA_RANK = 32  # the shipped LoRA configs (configs/sd35m_*.yaml)
NODES = (1, 2, 4)


def measure(gb: float, repeats: int, directory: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    from jagg_scale.checkpoint import digests, verify_checkpoint
    from jagg_scale.checkpoint.local import save_checkpoint_dir
    from jagg_scale.parallel.fsdp import _ListingWriter

    numel = 1 << 24  # 64 MB fp32 tensors, the size of a large weight's shard
    state = {f"w{i}": torch.randn(numel) for i in range(max(1, round(gb * GB / (4 * numel))))}
    nbytes = sum(t.numel() * 4 for t in state.values())
    hash_s = [0.0]
    real = digests.sha256_file

    def timed_hash(path):
        t0 = time.perf_counter()
        try:
            return real(path)
        finally:
            hash_s[0] += time.perf_counter() - t0

    def write(tmp: Path) -> list[Path]:
        writer = _ListingWriter(tmp / "dcp")
        dcp.save({"model": state}, storage_writer=writer)
        return [tmp / "dcp" / n for n in writer.written]

    runs = []
    digests.sha256_file = timed_hash
    try:
        for i in range(repeats):
            root = directory / f"rate_{i}"
            hash_s[0] = 0.0
            t0 = time.perf_counter()
            path = save_checkpoint_dir(root, 1, write=write, state={})
            total = time.perf_counter() - t0
            hashed = hash_s[0]
            hash_s[0] = 0.0
            t0 = time.perf_counter()
            verify_checkpoint(path)
            verify = time.perf_counter() - t0
            runs.append({"save_s": total, "hash_s": hashed, "write_s": total - hashed, "verify_s": verify})
            shutil.rmtree(root)
    finally:
        digests.sha256_file = real
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"bytes": nbytes, "repeats": repeats, "directory": str(directory), "runs": runs,
            "write_gbps": nbytes / med["write_s"] / GB, "hash_gbps": nbytes / med["hash_s"] / GB,
            "save_gbps": nbytes / med["save_s"] / GB, "verify_gbps": nbytes / med["verify_s"] / GB}


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
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size to measure (GB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (the filesystem to measure)")
    ap.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    ap.add_argument("--table-only", action="store_true", help="no measurement: the table from the rates given")
    ap.add_argument("--node-gbps", type=float, default=1.0, help="filesystem write rate per node (GB/s)")
    ap.add_argument("--hash-gbps", type=float, default=0.5, help="sha256 rate per core (GB/s)")
    ap.add_argument("--gpus", type=int, default=8, help="ranks per node")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = {"command": "python -m tools.checkpoint_rate " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                          "torch": torch.__version__}}
    if not args.table_only:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            m = result["measured"] = measure(args.gb, args.repeats, Path(tmp))
        m["directory"] = str(args.dir or Path(tempfile.gettempdir()))
        where = args.dir or "a temp dir"
        print(f"{m['bytes'] / GB:.2f} GB DCP checkpoint, 1 process, median of {m['repeats']} in {where}:"
              f" write {m['write_gbps']:.2f} GB/s, sha256 {m['hash_gbps']:.2f} GB/s, whole save {m['save_gbps']:.2f}"
              f" GB/s, verify {m['verify_gbps']:.2f} GB/s")
    sizes = checkpoint_bytes()
    result["sizes"] = sizes
    result["assumed"] = {"node_gbps": args.node_gbps, "hash_gbps": args.hash_gbps, "gpus": args.gpus}
    print(f"\nW_node = {args.node_gbps} GB/s per node, H = {args.hash_gbps} GB/s sha256 per rank, {args.gpus} ranks "
          f"per node; lead beyond the step = {SAFETY:g} x t_save + {MARGIN_S} s\n")
    result["table"] = table(sizes, args.gpus, args.node_gbps, args.hash_gbps)
    print(result["table"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
