"""Host memory of a rank at start-up: the transformer loaded whole on every rank's host, then sharded
(parallel.meta_init false), against a skeleton on the meta device whose shards each rank reads (true: meta_load.py).

A tiny SD3 pipeline made large (8 joint blocks of width 1024: 0.2 B parameters, 0.8 GB of float32 weights) is built
by 2 FSDP2 ranks on gloo, not trained: each rank builds its Trainer (pipeline, engine, shards, optimizer) and reports
the peaks of its own memory (RssAnon) and of the file pages it mapped (RssFile: page cache, one copy per node) while it
builds, sampled every 5 ms. On the CPU the "device" is the host too, so each rank's own shards (its half of the
float32 weights) count in both modes: the difference is the transformer each rank held whole before sharding.

    python -m tools.bench.startup_memory [--out docs/results/startup_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jagg_scale.models.tiny import TINY_SD3

ROOT = Path(__file__).resolve().parents[2]
LARGE = dict(TINY_SD3, num_layers=8, attention_head_dim=64, num_attention_heads=16, caption_projection_dim=1024)


def _status(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


class _Peaks:
    """RssAnon (the process's own memory) and RssFile (mapped file pages: the page cache, shared by a node's ranks)
    sampled every 5 ms in a thread: their peaks while the Trainer is built."""

    def __init__(self):
        import threading

        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.anon, self.file = max(self.anon, _status("RssAnon")), max(self.file, _status("RssFile"))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_anon_bytes": self.anon, "peak_file_bytes": self.file}


# the runs: a LoRA under bfloat16 over float32-stored weights (the load casts: every rank's own copy), and a full
# fine-tune in the stored float32 (diffusers maps the file: its pages are the page cache's, shared by a node's ranks)
SCENARIOS = {"lora_bf16": ["model.lora.enabled=true", "model.dtype=bfloat16"], "full_fp32": []}


def worker(pipe: str, mode: str, out: str, report: str, scenario: str) -> None:
    """One rank: build the Trainer, report its memory (JSON per rank), close."""
    from jagg_scale.train import Trainer, load_config

    peaks = _Peaks()

    cfg = load_config(str(ROOT / "configs" / "sd3_tiny_cpu.yaml"), [
        f"model.pretrained={pipe}", "parallel.engine=fsdp2", f"parallel.meta_init={mode}", "train.steps=1",
        "eval.enabled=false", "log.progress=false", f"run.output_dir={out}", *SCENARIOS[scenario]])
    trainer = Trainer(cfg)
    params = sum(p.numel() for p in trainer.model.transformer.parameters())
    rank = trainer.dist.rank
    Path(report).with_suffix(f".rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "peak_bytes": _status("VmHWM"), "rss_bytes": _status("VmRSS"), **peaks.stop(),
         "params": params}))
    trainer.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--worker", nargs=5, metavar=("PIPE", "MODE", "OUT", "REPORT", "SCENARIO"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    from jagg_scale.models.tiny import make_tiny_sd3
    from jagg_scale.parallel.ranks import free_port, launcher_env

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        pipe = make_tiny_sd3(Path(tmp) / "pipe", seed=0, transformer=LARGE)
        weights = sum(f.stat().st_size for f in (Path(pipe) / "transformer").glob("*.safetensors"))
        for scenario in SCENARIOS:
            for mode in ("false", "true"):
                report = Path(tmp) / f"report_{scenario}_{mode}"
                cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                       str(free_port()), "-m", "tools.bench.startup_memory", "--worker", str(pipe), mode,
                       str(Path(tmp) / f"run_{scenario}_{mode}"), str(report), scenario]
                subprocess.run(cmd, env={**launcher_env(), "PYTHONPATH": str(ROOT)}, cwd=ROOT, check=True,
                               timeout=1800)  # a hang guard
                results.setdefault(scenario, {})["meta" if mode == "true" else "host"] = [
                    json.loads(report.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
    summary = {"transformer_file_bytes": weights, "params": results["full_fp32"]["host"][0]["params"],
               "scenarios": {}, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    print(f"transformer {weights / 1e9:.2f} GB on disk (float32), {summary['params'] / 1e6:.0f} M parameters, 2 FSDP2 "
          "ranks; per rank, the peaks while the Trainer is built (own memory | mapped file pages):")
    for scenario, runs in results.items():
        peak = {k: {m: max(r[f"peak_{m}_bytes"] for r in runs[k]) for m in ("anon", "file")} for k in runs}
        summary["scenarios"][scenario] = {"peaks": peak, "ranks": runs,
                                          "anon_saved_bytes": peak["host"]["anon"] - peak["meta"]["anon"]}
        print(f"  {scenario}: host {peak['host']['anon'] / 1e9:.2f} | {peak['host']['file'] / 1e9:.2f} GB, meta "
              f"{peak['meta']['anon'] / 1e9:.2f} | {peak['meta']['file'] / 1e9:.2f} GB")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
