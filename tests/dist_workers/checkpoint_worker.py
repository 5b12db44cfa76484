"""2-process FSDP2 worker for tests/checkpoint/test_checkpoint_ranks.py: who hashes what when a run's checkpoints are
saved and resumed (train/run_state.py over checkpoint/local.py), and how a bad checkpoint or a failed write fails
the ranks.

    torchrun --nproc_per_node 2 checkpoint_worker.py OUT_DIR TIMEOUT_S

Every call of checkpoint.digests.sha256_file is recorded with the rank that made it. Each rank writes
OUT_DIR/result_rank<r>.json:

  save          the files this rank hashed while saving step 1, and the manifest's rank of every file
  resume        the files this rank hashed during resume (auto), and whether the resumed engine holds the saved
                model, optimizer and EMA state bit for bit, and the optimizer step count it derived
  ema_rule      Flow-GRPO's EMA rule on the shards (warm-up, an interval of 3, 2 moves per update) over 20 steps,
                against the float64 transcription of its code (tests/flow_grpo_ema.py) on the gathered weights
  corrupt       a same-size corruption of one shard that only rank 1 hashes: the error each rank raised and how
                long it took; then resume auto falls back to the previous checkpoint on both ranks
  truncated     a truncated shard: the error each rank raised and the hashes computed (none: sizes come first)
  planted       a pickle that runs code, planted in rank 1's RNG file with the manifest recomputed: the error each
                rank raised, and whether the code ran
  write_fails   rank 1's write raises: the error each rank raised, and nothing was published

TIMEOUT_S is the process group's timeout: a rank left waiting in a collective fails after it instead of hanging.
"""

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from jagg_scale.checkpoint import CheckpointError, digests
from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.dist import init_distributed, leave_launch
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.train.config import TrainConfig
from jagg_scale.parallel.fsdp import FSDP2Engine
from jagg_scale.train.config import load_config
from jagg_scale.train.run_state import RunState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' shared helpers
from flow_grpo_ema import flow_grpo_ema  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CFG = DiTConfig(image_size=8, in_channels=3, patch_size=2, hidden_size=64, depth=2, num_heads=4, vocab_size=64,
                max_prompt_length=4)


class Source:
    """The prompt source's checkpoint interface."""

    def __init__(self):
        self.state = {"index": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def engine_for(ctx, seed: int) -> FSDP2Engine:
    torch.manual_seed(seed)
    return FSDP2Engine(DiT(CFG).init_weights(zero_out=False),
                       ParallelConfig(engine="fsdp2"), TrainConfig(lr=1e-2, ema_decay=0.9), ctx)


def train_step(engine: FSDP2Engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, s = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g)
    c = torch.randint(1, 64, (2, 4), generator=g)
    engine.backward(engine.model(x, s, c).pow(2).mean())
    engine.step()


def snapshot(engine: FSDP2Engine) -> dict:
    """This rank's model, optimizer and EMA shards as plain tensors."""
    model, optim = engine._dcp_state()["model"], engine._dcp_state()["optimizer"]
    flat = {f"model.{k}": v for k, v in model.items()}
    for pid, st in optim["state"].items():
        flat.update({f"optim.{pid}.{k}": v for k, v in st.items()})
    flat.update({f"ema.{k}": v for k, v in engine.ema.items()})
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in flat.items()}


def main(out: Path, timeout_s: int) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=timeout_s)
    rank = ctx.rank
    calls: list[str] = []
    real = digests.sha256_file

    def counting(path):
        calls.append(str(path))
        return real(path)

    digests.sha256_file = counting  # local.py calls it through the module: every hash is seen here
    result: dict = {}

    def run_state(resume: str) -> RunState:
        cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", [f"run.output_dir={out / 'run'}", "run.keep_last=5",
                                                               f"run.resume={resume}"])
        return RunState(cfg, ctx, engine, out / "run")

    def rel(paths: list[str]) -> list[str]:  # inside the checkpoint dir (its temp name while saving)
        root = out / "run" / "checkpoints"
        return sorted(Path(*Path(p).relative_to(root).parts[1:]).as_posix() for p in paths)

    # save: step 1 and step 2 (a training step between them), each rank hashing its own files
    engine = engine_for(ctx, 0)
    train_step(engine, 1)
    calls.clear()
    run_state("none").save(1, Source())
    result["save_hashed"] = rel(calls)
    train_step(engine, 2)
    saved = snapshot(engine)
    step2 = run_state("none").save(2, Source())
    result["manifest_ranks"] = {n: e.get("rank") for n, e in json.loads((step2 / "manifest.json").read_text())[
        "files"].items()}
    result["world_size"] = json.loads((step2 / "manifest.json").read_text()).get("world_size")

    # resume (auto): a fresh engine with other weights; each file hashed once, on one rank
    engine = engine_for(ctx, 123)
    calls.clear()
    start = run_state("auto").resume(Source())
    result["resume_step"] = start
    result["resume_hashed"] = rel(calls)
    restored = snapshot(engine)
    result["bit_identical"] = (saved.keys() == restored.keys()
                               and all(torch.equal(saved[k], restored[k]) for k in saved))
    result["resume_optimizer_steps"] = engine.optimizer_steps  # 2 steps of one minibatch each (tiny_cpu.yaml)

    # corrupt one shard (same size: only its hash tells) that rank 1 verifies, on a copy of step 2
    bad = out / "run" / "checkpoints" / "step_00000003"
    sizes = {n: e["bytes"] for n, e in json.loads((step2 / "manifest.json").read_text())["files"].items()}
    victim = next(n for n in digests.share(sizes, 1, 2) if n.endswith(".distcp"))
    if rank == 0:
        shutil.copytree(step2, bad)
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["step"] = 3  # a consistent step 3 (manifest, state.json, directory) whose shard then rots
        state = json.loads((bad / "state.json").read_text())
        (bad / "state.json").write_text(json.dumps({**state, "step": 3}))
        manifest["files"]["state.json"].update(bytes=(bad / "state.json").stat().st_size,
                                               sha256=digests.sha256_file(bad / "state.json"))
        raw = json.dumps(manifest, indent=2, sort_keys=True).encode()
        (bad / "manifest.json").write_bytes(raw)
        (bad / "COMPLETE").write_text(hashlib.sha256(raw).hexdigest() + "\n")
        data = bytearray((bad / victim).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (bad / victim).write_bytes(bytes(data))
    ctx.barrier()
    result["victim"] = victim
    result["corrupt"] = expect_error(lambda: run_state(str(bad)).resume(Source()))
    calls.clear()
    result["fallback_step"] = run_state("auto").resume(Source())

    # truncated: every rank sees the size first, nobody hashes
    if rank == 0:
        f = bad / victim
        f.write_bytes(f.read_bytes()[:-100])
    ctx.barrier()
    calls.clear()
    result["truncated"] = expect_error(lambda: run_state(str(bad)).resume(Source()))
    result["truncated_hashed"] = len(calls)

    # a pickle planted in rank 1's RNG file, the manifest and marker recomputed: refused on both ranks, never run
    planted, marker = out / "run" / "checkpoints" / "step_00000004", out / "PWNED"
    if rank == 0:
        shutil.copytree(step2, planted)
        torch.save({"payload": Payload(marker)}, planted / "rng_rank00001.pt")
        reseal(planted, step=4)
    ctx.barrier()
    result["planted"] = expect_error(lambda: run_state(str(planted)).resume(Source()))
    result["planted_ran"] = marker.exists()

    # a write that fails on rank 1 only: both ranks raise the same error, nothing is published
    state = run_state("none")
    real_save = engine.save

    def failing_save(directory):
        files = real_save(directory)
        if rank == 1:
            raise OSError("simulated full disk")
        return files

    engine.save = failing_save
    result["write_fails"] = expect_error(lambda: state.save(9, Source()))
    engine.save = real_save
    ctx.barrier()
    result["published_9"] = (out / "run" / "checkpoints" / "step_00000009").exists()

    result.update(ema_rule(ctx))
    (out / f"result_rank{rank}.json").write_text(json.dumps(result, indent=1))
    ctx.barrier()
    ctx.close()


def ema_rule(ctx) -> dict:
    """The sharded EMA after 20 optimizer steps against the transcription of Flow-GRPO's (every rank computes it)."""
    torch.manual_seed(7)
    engine = FSDP2Engine(DiT(CFG).init_weights(zero_out=False), ParallelConfig(engine="fsdp2"),
                         TrainConfig(lr=1e-2, ema_decay=0.9, ema_every=3, ema_warmup=True, ema_repeat=2), ctx)

    def gathered() -> dict:  # collective: the full weights on every rank
        return {n: p.full_tensor().detach().clone() for n, p in engine.model.named_parameters()}

    weights = [gathered()]
    for seed in range(20):
        train_step(engine, 100 + seed)
        weights.append(gathered())
    want = flow_grpo_ema(weights, 0.9, 3, True, accumulation=2)
    got = {n: t.full_tensor().double() for n, t in engine.ema.items()}
    return {"ema_rule_close": all(torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-6) for n in want),
            "ema_rule_maxdiff": max(float((got[n] - want[n]).abs().max()) for n in want),
            "ema_rule_behind": sum(float((want[n] - weights[-1][n].double()).abs().sum()) for n in want)}


class Payload:
    """Unpickled by the general unpickler, it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def reseal(ckpt: Path, step: int) -> None:
    """A tamperer's manifest: every file's size and sha256, its hash in COMPLETE."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["step"] = step
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "step": step}))  # consistent: only the planted file is bad
    files = [p for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name not in ("manifest.json", "COMPLETE")]
    manifest["files"] = {p.relative_to(ckpt).as_posix(): {"bytes": p.stat().st_size,
                                                          "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in files}
    raw = json.dumps(manifest, indent=2, sort_keys=True).encode()
    (ckpt / "manifest.json").write_bytes(raw)
    (ckpt / "COMPLETE").write_text(hashlib.sha256(raw).hexdigest() + "\n")


def expect_error(fn) -> dict:
    t0 = time.perf_counter()
    try:
        fn()
    except CheckpointError as err:
        return {"type": "CheckpointError", "message": str(err), "seconds": time.perf_counter() - t0}
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err), "seconds": time.perf_counter() - t0}
    return {"type": None, "message": None, "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
    leave_launch(0)  # no interpreter teardown under the launcher (jagg_scale/parallel/dist.py)
