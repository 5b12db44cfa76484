"""The memory estimator (jagg-estimate, jagg_scale/estimate/) against measured tensor peaks, on runs this CPU can do.

    python -m tools.bench.estimate_check [--out docs/results/estimate_check.json] [--only bench|sd3|flux]

Cases (each in a fresh process; two processes through torchrun with gloo):

    bench   the SD3-shaped 45M DiT of tools/bench/common.py: one JAGG joint pass (2 x micro rows, forward + backward
            with a random upstream), float32, 1 process (plain autograd) or 2 (FSDP2 via parallel/fsdp.py)
    sd3     jagg-train's Trainer on the tiny SD3 pipeline (tools/make_tiny_pipeline.py) at 64 px, CFG 4.5, JAGG W=4,
            two minibatches per rollout (the second off-policy), evaluation on; backend none or fsdp2
    flux    the same on the tiny FLUX pipeline: LoRA r8 with the adapter-off KL reference (beta 0.01)

each with activation checkpointing off / on and train.micro_batch_size 2 / 4 / 8.

Measured: live tensor bytes at the start (every tensor storage reachable from Python, counted once) plus the peak
of torch.profiler's allocator events over the run (tools/bench/common.py `tensor_peaks`); for the
trainer, one warm-up step (AdamW states exist afterwards, as in every later step) then one profiled step and one
profiled evaluation, the step's phases (encode, rollout, update, optimizer) told apart by record_function windows.
With two processes the larger rank is reported. Predicted: the estimator on the same config, world size and
micro-batch, without the non-tensor overhead (--overhead-gb 0).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MB = 2**20
MICRO = (2, 4, 8)
EVAL_PROMPTS = "[a red apple, a blue sky, a green field, a cat]"
COMMON = ["model.resolution=64", "sampling.num_steps=8", "sampling.eval_num_steps=4", "sampling.chunk_size=8",
          "grpo.group_size=4", "train.prompts_per_step=8", "train.minibatch_size=16", "train.steps=2",
          "eval.enabled=true", f"eval.prompts={EVAL_PROMPTS}", "eval.num_per_prompt=2", "eval.chunk_size=4",
          "eval.at_start=false", "log.progress=false", "log.wandb=false", "run.checkpoint_every=0"]


# ------------------------------------------------------------------------------------------------ measuring

def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python (DTensors by their local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    seen, total = set(), 0
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    tensors += [t.grad for t in tensors if t.grad is not None]  # .grad has no Python object until it is read
    for obj in tensors:
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        if t.device.type != "cpu" or t.is_meta:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def worker_pass(spec: dict) -> dict:
    """One joint pass of the SD3-shaped DiT: 2 x micro rows, forward + backward (2nd pass measured)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tools.bench.common import SD3Shaped, random_cond, sd3_config, tensor_peaks

    torch.set_num_threads(1)
    cfg, text = sd3_config(False)
    torch.manual_seed(0)
    model = SD3Shaped(cfg).train()
    world, ctx = int(os.environ.get("WORLD_SIZE", "1")), None
    if spec["ckpt"]:
        model.transformer.enable_gradient_checkpointing()
    if world > 1:
        from jagg_scale.parallel.dist import init_distributed
        from jagg_scale.parallel.fsdp import build_mesh, parallelize

        ctx = init_distributed("cpu")
        parallelize(model, build_mesh("cpu", world), param_dtype=None, activation_checkpointing=False)
    amp = contextlib.nullcontext()
    # FSDP2 mixed precision on CUDA, as jagg_scale/estimate/measure.py emulates it
    if spec.get("precision") == "bf16_mp":
        from jagg_scale.estimate.measure import cast_inputs_hook, cuda_autocast_numerics

        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        for mod in [model.transformer, *model.transformer.transformer_blocks]:
            mod.register_forward_pre_hook(cast_inputs_hook, with_kwargs=True)
        cuda_autocast_numerics()
        amp = torch.autocast("cpu", dtype=torch.bfloat16)
    n = 2 * spec["micro"]
    gen = torch.Generator().manual_seed(1)
    x, sigma = torch.randn(n, *model.latent_shape, generator=gen), torch.rand(n, generator=gen)
    cond, upstream = random_cond(cfg, text, n, gen), torch.randn(n, *model.latent_shape, generator=gen)
    upstream = upstream.to(next(model.parameters()).dtype)

    def step():
        with amp:
            v = model(x, sigma, cond)
        v.backward(upstream)
    step()  # warm-up: gradients exist afterwards (they accumulate over a minibatch's passes)
    base = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    out = {"baseline": base, "peaks": tensor_peaks(prof, base)}
    if ctx is not None:
        ctx.close()
    return out


def worker_train(spec: dict) -> dict:
    """Trainer: a warm-up step, then one profiled step (phases by record_function) and one profiled evaluation."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from jagg_scale.train import Trainer, load_config
    from tools.bench.common import tensor_peaks

    torch.set_num_threads(1)
    trainer = Trainer(load_config(ROOT / "configs" / spec["config"], spec["overrides"]))

    def timed(obj, name, phase):
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            with record_function("phase:" + phase):
                return fn(*a, **k)
        setattr(obj, name, wrapped)

    try:
        trainer.train_step(0)
        for obj, name, phase in ((trainer.policy, "encode", "encode"), (trainer.policy, "rollout", "rollout"),
                                 (trainer, "update", "update"), (trainer.engine, "step", "optimizer")):
            timed(obj, name, phase)
        base = live_tensor_bytes()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer.train_step(1)
        peaks = tensor_peaks(prof, base)
        base_eval = live_tensor_bytes()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("phase:eval"):
                trainer.evaluate(2)
        peaks["eval"] = max(tensor_peaks(prof, base_eval).values())
    finally:
        trainer.dist.close()
    return {"baseline": base, "peaks": peaks}


def spawn(spec: dict, nproc: int) -> dict:
    from jagg_scale.parallel.ranks import free_port, launcher_env

    env = dict(launcher_env(), PYTHONPATH=str(ROOT))
    out = Path(tempfile.mkdtemp(prefix="estimate_check_worker_"))
    args = ["-m", "tools.bench.estimate_check", "--worker", json.dumps(dict(spec, result_dir=str(out)))]
    cmd = [sys.executable, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
        str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or len(results) != nproc:
        raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    phases = set().union(*(r["peaks"] for r in results))
    return {"peaks": {ph: max(r["peaks"].get(ph, 0) for r in results) for ph in phases},
            "baseline": max(r["baseline"] for r in results)}


# ------------------------------------------------------------------------------------------------ predicting

def predict_pass(nproc: int, ckpt: bool, micro: int, precision: str = "fp32") -> dict:
    """The estimator's terms for one joint pass of the bench model (params, grads, FSDP2 buffers, activations,
    the pass's inputs); with bf16_mp the activations alone (the check of the composition under bf16 numerics)."""
    import math

    from jagg_scale.estimate import activations as A, shapes as S
    from tools.bench.common import sd3_config

    cfg, text = sd3_config(False)
    comp = {"library": "diffusers", "class": "SD3Transformer2DModel", "config": dict(cfg)}
    st = S.transformer_stats(comp)
    key = A.key("transformer", comp["class"], S.clean(cfg), precision, 0, None)
    from jagg_scale.estimate.measure import measure_transformer

    act = A.cached(key, f"bench SD3-shaped transformer, {precision}, full",
                   lambda: measure_transformer(comp, precision, 0), True)
    rows, div = 2 * micro, nproc
    lat = cfg["in_channels"] * cfg["sample_size"] ** 2
    n_img = (cfg["sample_size"] // cfg["patch_size"]) ** 2
    mode = "ckpt" if ckpt else "grad"
    activations = A.transformer_activations(act, mode, rows, n_img, text)
    reduce = A.reduce_buffers(st["block_params"], 4) if nproc > 1 else None
    parts = {"weights + buffers": 4 * st["params"] / div + st["buffers"], "gradients": 4 * st["params"] / div,
             "FSDP2 gathered + reduce": (4 * (st["root_params"] + 2 * max(st["block_params"]))
                                         + A.transformer_activations(act, mode, rows, n_img, text, reduce)
                                         - activations)
             if nproc > 1 else 0,
             "inputs": rows * 4 * (3 * lat + 1 + text * cfg["joint_attention_dim"] + cfg["pooled_projection_dim"]),
             "activations": activations}
    if precision != "fp32":
        parts = {"activations": parts["activations"]}
    return {"total": sum(parts.values()), "parts": parts, "params": st["params"], "tokens": n_img + text,
            "latent_elems": math.prod((cfg["in_channels"], cfg["sample_size"], cfg["sample_size"]))}


def train_overrides(kind: str, nproc: int, ckpt: bool, micro: int, pipe: Path, out: Path) -> list[str]:
    o = COMMON + [f"model.pretrained={pipe}", f"train.micro_batch_size={micro}", f"run.output_dir={out}"]
    o += [f"parallel.activation_checkpointing={str(ckpt).lower()}"] + (["parallel.engine=fsdp2"] if nproc > 1 else [])
    return o


def predict_train(config: str, overrides: list[str], nproc: int) -> dict:
    from jagg_scale.estimate import memory as E
    from jagg_scale.train.config import load_config

    s = E.prepare(load_config(ROOT / "configs" / config, overrides, check_files=False), nproc, measure=True,
                  overhead_gb=0)
    est = E.estimate(s)
    return {ph: est["phases"][ph]["total"] for ph in E.PHASES} | {
        "components": {ph: est["phases"][ph]["components"] for ph in E.PHASES}}


# ------------------------------------------------------------------------------------------------ the study

def run(only: str | None = None, out_json: str | None = None) -> list[dict]:
    from jagg_scale.models import tiny as make_tiny_pipeline

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="estimate_check_"))
    pipes = {"sd3": make_tiny_pipeline.make_tiny_sd3(tmp / "sd3"),
             "flux": make_tiny_pipeline.make_tiny_flux(tmp / "flux")}
    configs = {"sd3": "sd3_tiny_cpu.yaml", "flux": "flux_tiny_cpu.yaml"}
    for case in ("bench", "bench_bf16", "sd3", "flux"):
        if only and not case.startswith(only):
            continue
        for nproc in ((1,) if case == "bench_bf16" else (1, 2)):
            for ckpt in (False, True):
                for micro in MICRO:
                    if case.startswith("bench"):
                        precision = "bf16_mp" if case == "bench_bf16" else "fp32"
                        got = spawn({"kind": "pass", "ckpt": ckpt, "micro": micro, "precision": precision}, nproc)
                        pred = predict_pass(nproc, ckpt, micro, precision)
                        measured, predicted = max(got["peaks"].values()), pred["total"]
                        if precision != "fp32":  # the activation peak above the state (params, grads, inputs)
                            measured -= got["baseline"]
                        detail = {"pred_parts": pred["parts"]}
                    else:
                        out = tmp / f"{case}_{nproc}_{ckpt}_{micro}"
                        ov = train_overrides(case, nproc, ckpt, micro, pipes[case], out)
                        got = spawn({"kind": "train", "config": configs[case], "overrides": ov}, nproc)
                        pred = predict_train(configs[case], ov, nproc)
                        step = [p for p in ("encode", "rollout", "update", "optimizer")]
                        measured = max(got["peaks"].get(p, 0) for p in step + ["other"])
                        predicted = max(pred[p] for p in step)
                        detail = {"measured_phases": got["peaks"],
                                  "predicted_phases": {p: pred[p] for p in pred if p != "components"},
                                  "eval_measured": got["peaks"].get("eval"), "eval_predicted": pred["eval"],
                                  "pred_components": pred["components"]}
                    row = {"case": case, "procs": nproc, "checkpointing": ckpt, "micro": micro,
                           "measured_mb": measured / MB, "predicted_mb": predicted / MB,
                           "error": predicted / measured - 1, "baseline_mb": got["baseline"] / MB, **detail}
                    rows.append(row)
                    if out_json:
                        Path(out_json).write_text(json.dumps(rows, indent=1))
                    print(f"  {case} procs={nproc} ckpt={ckpt} micro={micro}: measured {row['measured_mb']:.1f} MB, "
                          f"predicted {row['predicted_mb']:.1f} MB ({100 * row['error']:+.1f}%)", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| case | processes | checkpointing | micro-batch | measured peak MB | predicted MB | error | "
             "eval measured MB | eval predicted MB | eval error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ev = ((f"{r['eval_measured'] / MB:.1f} | {r['eval_predicted'] / MB:.1f} | "
               f"{100 * (r['eval_predicted'] / r['eval_measured'] - 1):+.1f}%") if r.get("eval_measured")
              else "- | - | -")
        lines.append(f"| {r['case']} | {r['procs']} | {'on' if r['checkpointing'] else 'off'} | {r['micro']} | "
                     f"{r['measured_mb']:.1f} | {r['predicted_mb']:.1f} | {100 * r['error']:+.1f}% | {ev} |")
    worst = max(abs(r["error"]) for r in rows)
    lines.append(f"\nlargest |error| of the step peak: {100 * worst:.1f}% over {len(rows)} runs")
    return "\n".join(lines)


def scale_tables(gpus=((8, 79.2), (32, 79.2), (8, 139.8), (32, 139.8)), headroom: float = 0.10) -> str:
    """docs/scale.md's tables: each production config as shipped, per (GPUs, GiB): the largest micro-batch that
    fits, and the per-rank peak by component at the shipped micro-batch."""
    from jagg_scale.estimate import memory as E
    from jagg_scale.train.config import load_config

    names = ["sd35m_pickscore", "sd35m_geneval", "sd35m_ocr", "flux1_dev_hps", "qwenimage_hps", "sd35l_pickscore"]
    out = ["| config | GPUs x GiB | rows per rank (minibatch share) | shipped micro-batch | peak GiB (phase) | "
           "headroom | largest micro-batch that fits | its peak GiB |", "|---|---|---|---|---|---|---|---|"]
    details = []
    for name in names:
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", check_files=False)
        cols = {}
        for world, gib in gpus:
            s = E.prepare(cfg, world)
            est, (m, best) = E.estimate(s), E.choose_micro(s, gib, headroom)
            cols[(world, gib)] = (s, est)
            out.append(f"| {name} | {world} x {gib:g} | {est['local_rows']} ({est['local_batch']}) | "
                       f"{est['micro_batch_size']} | {est['total'] / E.GiB:.1f} ({est['peak_phase']}) | "
                       f"{100 * (1 - est['total'] / (gib * E.GiB)):.0f}% | {m} | {best['total'] / E.GiB:.1f} |")
        s8, est8 = cols[gpus[0]]
        details += ["", f"**{name}** ({s8['shapes']}, "
                    f"{'LoRA r%d' % s8['lora_rank'] if s8['lora_rank'] else 'full fine-tune'}"
                    f", {s8['image_tokens']} image + {s8['text_tokens']} text tokens), per-rank GiB at the shipped "
                    "micro-batch, each column the peak phase (the 141 GB columns are the same bytes):", "",
                    "| component | " + " | ".join(f"{w} GPUs ({cols[(w, g)][1]['peak_phase']}, micro "
                                                   f"{cols[(w, g)][1]['micro_batch_size']})" for w, g in gpus[:2])
                    + " |",
                    "|---|---|---|"]
        for c in E.COMPONENTS:
            vals = [cols[k][1]["phases"][cols[k][1]["peak_phase"]]["components"][c] / E.GiB for k in gpus[:2]]
            if any(v >= 0.005 for v in vals):
                details.append(f"| {c} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
        details.append("| **total** | " + " | ".join(f"**{cols[k][1]['total'] / E.GiB:.2f}**" for k in gpus[:2]) + " |")
        details += ["", "Every phase's total, GiB: " + "; ".join(
            f"{w} GPUs " + ", ".join(f"{ph} {cols[(w, g)][1]['phases'][ph]['total'] / E.GiB:.1f}" for ph in E.PHASES)
            for w, g in gpus[:2]) + "."]
    return "\n".join(out + details)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "estimate_check.json"))
    ap.add_argument("--only", choices=("bench", "sd3", "flux"), default=None)
    ap.add_argument("--scale-tables", action="store_true", help="print docs/scale.md's tables (no runs)")
    ap.add_argument("--table", action="store_true", help="print the table of an earlier --out JSON (no runs)")
    args = ap.parse_args(argv)
    if args.scale_tables:
        print(scale_tables())
        return
    if args.table:
        print(markdown(json.loads(Path(args.out).read_text())))
        return
    if args.worker:
        spec = json.loads(args.worker)
        res = worker_pass(spec) if spec["kind"] == "pass" else worker_train(spec)
        (Path(spec["result_dir"]) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(res))
        return
    earlier = [r for r in json.loads(Path(args.out).read_text()) if not r["case"].startswith(args.only)] \
        if args.only and Path(args.out).is_file() else []  # --only reruns those cases, keeping the others' rows
    rows = earlier + run(args.only, args.out + ".partial")
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
