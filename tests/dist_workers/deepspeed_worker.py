"""Run by tests/parallel/test_deepspeed_engine.py under `torchrun --nproc_per_node 2` (gloo on CPU): the DeepSpeed
ZeRO-3 engine against the single-process reference `LocalEngine`, in one launch.

  accumulate  a JAGG window backward (W=3, cached intermediates) + an exact window backward (W=2), each rank on
              half the rows, accumulated into ONE optimizer step: the weights equal the reference's on the full
              batch (allclose, fp32), and differ from a step on the last backward alone (the check is sensitive)
  boundary    backward(out, grad, last=False) runs DeepSpeed's backward off the accumulation boundary, last=True on it
  resume      save after step 1 -> a fresh engine (other init weights) loads it -> steps 2 and 3 equal an
              uninterrupted run bit for bit
  ema         train.ema_decay > 0 (the EMA of each rank's fp32 partitions, moved every 2 optimizer steps with the
              warm-up: parallel/ema.py): ema_weights() exports the reference's EMA, leaves the live weights bit
              for bit as they were, and resumes bit for bit; with persistent (unpartitioned) parameters too, and
              training after an EMA export still matches the reference
  export      full_state_dict() on rank 0: the plain model's keys, the reference's weights; {} on rank 1
  bf16        (smoke) a bf16 engine steps under autocast and exports bfloat16 weights
  offload     `offload_optimizer: cpu` (ZeRO-Offload, torch AdamW on the CPU partitions) gives the reference step
  module      forward through the bare module (`engine.module`) instead of the DeepSpeed engine still accumulates
  reference   shard_frozen(frozen copy): an inference-only ZeRO-3 engine holding 1/world of the copy's bytes per
              rank (as the policy engine does), whose forward equals the unsharded copy's

`python deepspeed_worker.py <out> --single` (no launcher): one process, the engine's own trivial process group;
and a ZeRO-2 engine's checkpoint resumes exactly (its optimizer state holds DeepSpeed's own records); and fp16
(model.dtype float16): fp16 partitions, DeepSpeed's dynamic loss scale, an overflow skipped as the scale's search
with the scale halved and the weights kept, the scale resumed from the checkpoint, an overflow at its floor
non-finite.

Writes <out>/result.json on rank 0: {check: true/false, ...details}.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from jagg_scale.jagg import exact_backward, jagg_backward
from jagg_scale.models.dit import DiT, DiTConfig
from jagg_scale.parallel.deepspeed_engine import DeepSpeedEngine
from jagg_scale.parallel.dist import DistContext, init_distributed, leave_launch
from jagg_scale.parallel.config import ParallelConfig
from jagg_scale.parallel.engine import Engine
from jagg_scale.parallel.local_engine import LocalEngine
from jagg_scale.train.config import Config

B, W1, W2 = 4, 3, 2  # rows of the full batch, the JAGG window, the exact window
DIT = DiTConfig(image_size=8, in_channels=3, patch_size=4, hidden_size=32, depth=2, num_heads=2, vocab_size=64,
                max_prompt_length=4)


EMA = 0.5
STEP_ATOL = 1e-5  # weights after an Adam step against the reference's (see main's comment)


def make_spec(dtype: str = "float32", ema: float = 0.0, persistent: bool = False, **deepspeed) -> Config:
    cfg = Config()
    cfg.model.dtype = dtype
    cfg.train.lr, cfg.train.grad_clip, cfg.train.weight_decay, cfg.train.ema_decay = 1e-3, 1.0, 0.01, ema
    if ema > 0:  # moved after optimizer steps 1 and 3 by the warm-up's 2 / 11 and 4 / 13 (parallel/ema.py)
        cfg.train.ema_every, cfg.train.ema_warmup = 2, True
    cfg.parallel.engine = "deepspeed"
    # partition every parameter (the tiny model is below the default persistence threshold), unless `persistent`
    partition_all = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    cfg.parallel.deepspeed = {**({} if persistent else partition_all), **deepspeed}
    return cfg


def ds_engine(model: DiT, cfg: Config, ctx) -> DeepSpeedEngine:
    """The engine of the run config `cfg`: its parallel and train sections; the compute dtype is the model's."""
    model.compute_dtype = getattr(torch, cfg.model.dtype)
    return DeepSpeedEngine(model, cfg.parallel, cfg.train, ctx)


def make_model(seed: int) -> DiT:
    torch.manual_seed(seed)
    return DiT(DIT).init_weights(zero_out=False)


def make_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    shape = (B, 3, 8, 8)
    return dict(lat1=torch.randn(W1, *shape, generator=g), sig1=torch.tensor([0.9, 0.8, 0.7]),
                cached=torch.randn(W1, *shape, generator=g), lat2=torch.randn(W2, *shape, generator=g),
                sig2=torch.tensor([0.6, 0.5]), target=torch.randn(W1 + W2, *shape, generator=g),
                cond=torch.randint(1, 64, (B, 4), generator=g))


def minibatch(engine: Engine, batch: dict, rows: slice, scale: float, last_only: bool = False,
              boundary: list | None = None) -> float:
    """Two backward calls (JAGG window, exact window) into one optimizer step; returns the grad norm.
    The loss of a row is mean((v - target)^2); the minibatch loss is their mean over the B rows of the full batch,
    times `scale` (the world size under DeepSpeed, which averages gradients over ranks). `boundary` collects
    DeepSpeed's accumulation boundary as seen during each backward."""
    fn = engine.model
    if boundary is not None:
        def fn(x, s, c):
            v = engine.model(x, s, c)
            v.register_hook(lambda g: boundary.append(engine.ds.is_gradient_accumulation_boundary()))
            return v
    cond = batch["cond"][rows]

    def loss_fn(offset):
        def step_loss(k, v):
            return scale * ((v.float() - batch["target"][offset + k][rows]) ** 2).mean(dim=(1, 2, 3)).sum() / B
        return step_loss

    def off_boundary(out, grad, last):  # not the minibatch's last backward, whatever the engine call says
        engine.backward(out, grad, last=False)

    def to_engine(out, grad, last):  # every backward of knot_backward goes through engine.backward(out, grad, last=)
        engine.backward(out, grad, last=last)

    if not last_only:
        jagg_backward(fn, batch["lat1"][:, rows], batch["sig1"], cond, loss_fn(0),
                      cached_velocities=batch["cached"][:, rows], intermediate="cached", backward=off_boundary)
    exact_backward(fn, batch["lat2"][:, rows], batch["sig2"], cond, loss_fn(W1), backward=to_engine)
    return float(engine.step())


def reference(init: dict, steps: int, last_only: bool = False) -> tuple[dict, list, dict]:
    """The single-process engine on the full batch: weights, grad norms and EMA (decay EMA) after `steps`."""
    model = make_model(0)
    model.load_state_dict(init)
    ref = LocalEngine(model, ParallelConfig(), make_spec(ema=EMA).train, DistContext())
    norms = [minibatch(ref, make_batch(s), slice(0, B), 1.0, last_only) for s in range(steps)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, dict(ref.ema)


def ema_export(engine: DeepSpeedEngine) -> tuple[dict, bool]:
    """full_state_dict() with the EMA swapped in, and whether the live export is bit for bit the same after."""
    before = engine.full_state_dict()
    with engine.ema_weights():
        ema = engine.full_state_dict()
    return ema, close(engine.full_state_dict(), before, exact=True)


def maxdiff_of(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b) if set(a) == set(b) else float("inf")


def close(a: dict, b: dict, exact: bool = False, atol: float = 1e-6) -> bool:
    if set(a) != set(b):
        return False
    return all(torch.equal(a[k], b[k]) if exact else torch.allclose(a[k], b[k], rtol=1e-4, atol=atol) for k in a)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    assert ctx.world_size == 2, ctx
    rank, world = ctx.rank, ctx.world_size
    half = B // world
    rows = slice(rank * half, (rank + 1) * half)
    result: dict = {}

    model = make_model(0)
    init = copy.deepcopy(model.state_dict())
    plain_keys = set(init)
    engine = ds_engine(model, make_spec(ema=EMA), ctx)
    result["attributes"] = (engine.model.latent_shape == (3, 8, 8)
                            and engine.model.encode_prompts(["a b", ""]).shape == (2, 4))

    # step 1: one JAGG + one exact backward accumulated into one step
    boundary: list = []
    norm1 = minibatch(engine, make_batch(0), rows, float(world), boundary=boundary)
    sd1 = engine.full_state_dict()
    ema1, ema1_restored = ema_export(engine)
    written = ctx.all_gather_object(sorted(p.relative_to(out / "ckpt").as_posix() for p in engine.save(out / "ckpt")))
    norm2 = minibatch(engine, make_batch(1), rows, float(world))
    norm3 = minibatch(engine, make_batch(2), rows, float(world))
    sd3 = engine.full_state_dict()
    ema3, ema3_restored = ema_export(engine)

    # resume: a fresh engine over a differently initialised model loads the step-1 checkpoint
    fresh = ds_engine(make_model(1), make_spec(ema=EMA), ctx)
    fresh.load(out / "ckpt")
    fresh.optimizer_steps = 1  # what a resumed run derives from its step (train/run_state.py)
    sd1_loaded = fresh.full_state_dict()
    ema1_loaded, _ = ema_export(fresh)
    minibatch(fresh, make_batch(1), rows, float(world))
    minibatch(fresh, make_batch(2), rows, float(world))
    sd3_resumed = fresh.full_state_dict()
    ema3_resumed, _ = ema_export(fresh)

    # EMA with persistent parameters (every tensor of the tiny model is below the default threshold: gathered on
    # every rank, re-gathered around the swap); a step after the EMA export still trains the live weights
    pers = ds_engine(make_model(0), make_spec(ema=EMA, persistent=True), ctx)
    minibatch(pers, make_batch(0), rows, float(world))
    ema_pers1, pers_restored = ema_export(pers)
    minibatch(pers, make_batch(1), rows, float(world))
    sd_pers2 = pers.full_state_dict()
    ema_pers2, _ = ema_export(pers)

    # bf16 smoke: bf16 weights, autocast forward, one step, bf16 export
    bf = ds_engine(make_model(0), make_spec("bfloat16"), ctx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norm_bf = minibatch(bf, make_batch(0), rows, float(world))
    sd_bf = bf.full_state_dict()

    # ZeRO-Offload of the optimizer (torch AdamW on CPU partitions): the boundary decides what reaches it
    off = ds_engine(make_model(0), make_spec(offload_optimizer="cpu"), ctx)
    minibatch(off, make_batch(0), rows, float(world))
    sd_off = off.full_state_dict()

    # forward through the bare module (bypassing DeepSpeedEngine.forward) still accumulates every backward
    mod = ds_engine(make_model(0), make_spec(), ctx)
    mod.model = mod.ds.module
    minibatch(mod, make_batch(0), rows, float(world))
    sd_mod = mod.full_state_dict()

    # the KL reference of a full fine-tune: a frozen copy (made on the host) as an inference-only ZeRO-3 engine
    frozen = make_model(0).requires_grad_(False).eval()
    plain = copy.deepcopy(frozen)
    ref_engine = engine.shard_frozen(frozen)
    batch = make_batch(0)
    with torch.no_grad():
        ref_v = ref_engine(batch["lat1"][0], batch["sig1"][:1].expand(B), batch["cond"])
        want_v = plain(batch["lat1"][0], batch["sig1"][:1].expand(B), batch["cond"])
    part_bytes = lambda m: sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in m.parameters())
    ref_bytes = ctx.all_gather_object(part_bytes(ref_engine.module))
    policy_bytes = ctx.all_gather_object(part_bytes(engine.module))
    full_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    unavailable = all(p.numel() == 0 for p in ref_engine.module.parameters())  # nothing gathered between forwards
    ref_ok = ctx.all_gather_object(torch.allclose(ref_v, want_v, rtol=1e-5, atol=1e-6) and unavailable
                                   and not any(p.requires_grad for p in ref_engine.module.parameters()))

    empty = ctx.all_gather_object(all(sd == {} for sd in (sd1, sd3, sd_bf, sd_off, sd_mod, ema1, ema_pers2)))
    if rank != 0:
        ctx.barrier()
        ctx.close()
        return
    result["rank1_empty"] = empty[1] and not empty[0]
    ref1, ref_norms, ref_ema1 = reference(init, 1)
    ref2, _, ref_ema2 = reference(init, 2)
    ref3, ref_norms3, ref_ema3 = reference(init, 3)
    last_only, _, _ = reference(init, 1, last_only=True)
    maxdiff = max((sd1[k] - ref1[k]).abs().max().item() for k in ref1)
    # Adam's first step moves every weight by about lr x sign(g): the ~1e-9 float-order noise of a gradient whose
    # true value is 0 (the attention key bias) can come out as ~1e-6 differences (seen on AMD EPYC), hence atol
    # 1e-5 against the reference; the step on the last backward alone differs by orders of magnitude more
    # (sensitive_margin), so the check still tells the accumulated step from a wrong one
    margin = maxdiff_of(sd1, last_only)
    result.update(
        accumulate=close(sd1, ref1, atol=STEP_ATOL),
        accumulate_maxdiff=maxdiff,
        sensitive=margin > 100 * STEP_ATOL and not close(sd1, init),
        sensitive_margin=margin,
        grad_norm=abs(norm1 - ref_norms[0]) < 1e-4 * ref_norms[0],
        norms=[norm1, norm2, norm3, ref_norms3],
        # 3 steps: Adam turns the ~1e-9 numerical noise of the attention key bias (whose true gradient is 0) into
        # ~1e-6 differences, hence the looser atol
        three_steps=close(sd3, ref3, atol=1e-5),
        offload=close(sd_off, ref1, atol=STEP_ATOL),
        module_forward=close(sd_mod, ref1, atol=STEP_ATOL),
        export_keys=set(sd1) == plain_keys and all(v.dtype == torch.float32 for v in sd1.values()),
        resume_load=close(sd1_loaded, sd1, exact=True),
        resume=close(sd3_resumed, sd3, exact=True),
        checkpoint_files=sorted(str(p.relative_to(out / "ckpt")) for p in (out / "ckpt").rglob("*") if p.is_file()),
        written_by_rank=written,
        boundary=boundary == [False, False, True],  # only the minibatch's last backward is on the boundary
        boundary_seen=boundary,
        ema=close(ema1, ref_ema1, atol=STEP_ATOL) and close(ema3, ref_ema3, atol=1e-5) and not close(ema1, sd1),
        ema_restored=ema1_restored and ema3_restored and pers_restored,
        ema_resume=close(ema1_loaded, ema1, exact=True) and close(ema3_resumed, ema3, exact=True),
        # after 2 steps: the ~1e-6 Adam noise explained at three_steps, hence its atol
        ema_persistent=(close(ema_pers1, ref_ema1, atol=STEP_ATOL) and close(sd_pers2, ref2, atol=1e-5)
                        and close(ema_pers2, ref_ema2, atol=1e-5)),
        ema_persistent_maxdiff=[maxdiff_of(ema_pers1, ref_ema1), maxdiff_of(sd_pers2, ref2),
                                maxdiff_of(ema_pers2, ref_ema2)],
        ema_files=sorted(p.name for p in (out / "ckpt").glob("ema_rank*")),
        reference=all(ref_ok),
        reference_bytes={"per_rank": ref_bytes, "policy_per_rank": policy_bytes, "full": full_bytes,
                         "tensors": sum(1 for _ in plain.parameters())},
        bf16=(set(sd_bf) == plain_keys and all(v.dtype == torch.bfloat16 for v in sd_bf.values())
              and norm_bf == norm_bf
              and all(torch.allclose(sd_bf[k].float(), ref1[k], atol=2e-2, rtol=2e-2) for k in ref1)),
    )
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    ctx.barrier()
    ctx.close()


def single(out: Path) -> None:
    """One process, no launcher: the engine sets up its own trivial process group and matches the reference."""
    torch.set_num_threads(1)
    model = make_model(0)
    init = copy.deepcopy(model.state_dict())
    engine = ds_engine(model, make_spec(), DistContext())
    minibatch(engine, make_batch(0), slice(0, B), 1.0)
    ref1, _, _ = reference(init, 1)
    result = {"single": close(engine.full_state_dict(), ref1, atol=STEP_ATOL)}
    # a non-finite gradient: ZeRO-3 skips the update (step_applied False), the weights stay as they were
    applied = engine.step_applied
    minibatch(engine, make_batch(1), slice(0, B), float("nan"))
    result["nonfinite_skipped"] = applied and not engine.step_applied and close(engine.full_state_dict(), ref1,
                                                                                 exact=True)
    # and a non-finite partition is refused by save before any file is written
    from jagg_scale.parallel.engine import NonFiniteError

    engine.params[0].ds_tensor.data.view(-1)[0] = float("nan")
    (out / "ckpt").mkdir()
    try:
        engine.save(out / "ckpt")
        result["nonfinite_refused"] = False
    except NonFiniteError as err:
        result["nonfinite_refused"] = "refusing to save" in str(err) and not any((out / "ckpt").iterdir())
    # ZeRO-2 (a parallel.deepspeed override): its optimizer state pickles DeepSpeed's fragment records, which the
    # weights-only load admits; the round trip is exact
    zero2 = ds_engine(make_model(0), make_spec(zero_optimization={"stage": 2}), DistContext())
    minibatch(zero2, make_batch(0), slice(0, B), 1.0)
    zero2.save(out / "zero2")
    weights = lambda e: {k: v.detach().clone() for k, v in e.module.state_dict().items()}
    saved = weights(zero2)
    fresh = ds_engine(make_model(1), make_spec(zero_optimization={"stage": 2}), DistContext())
    fresh.load(out / "zero2")
    result["zero2_resume"] = close(weights(fresh), saved, exact=True)
    result.update(fp16(out))
    (out / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))


def fp16(out: Path) -> dict:
    """model.dtype float16 on one process. DeepSpeed's CPU accelerator reports no fp16 (its engine refuses it, and
    the config refuses float16 with deepspeed off a GPU), so its capability check is waived here: the arithmetic
    is torch's fp16 on the CPU, what is checked is the engine's use of DeepSpeed's fp16 path."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True
    engine = ds_engine(make_model(0), make_spec("float16"), DistContext())
    zero = engine.ds.optimizer
    res = {"fp16_partitions": all(p.ds_tensor.dtype == torch.float16 for p in engine.params),
           "fp16_scale": zero.cur_scale == 2.0**16}
    with torch.autocast("cpu", dtype=torch.float16):
        minibatch(engine, make_batch(0), slice(0, B), 1.0)
        res["fp16_applied"] = engine.step_applied and not engine.scale_skipped and engine.loss_scale == 2.0**16
        before = {k: v.clone() for k, v in engine.full_state_dict().items()}
        zero.cur_scale = 2.0**40  # no fp16 gradient survives it
        minibatch(engine, make_batch(1), slice(0, B), 1.0)
    res["fp16_overflow"] = (not engine.step_applied and engine.scale_skipped and engine.loss_scale == 2.0**40
                            and zero.cur_scale == 2.0**39 and close(engine.full_state_dict(), before, exact=True))
    engine.save(out / "fp16")
    fresh = ds_engine(make_model(1), make_spec("float16"), DistContext())
    fresh.load(out / "fp16")
    res["fp16_resume"] = fresh.ds.optimizer.cur_scale == 2.0**39 and close(fresh.full_state_dict(), before,
                                                                               exact=True)
    # at the scale's floor (1) an overflow is a non-finite step, not DeepSpeed's bare "cannot decrease" Exception
    fresh.ds.optimizer.cur_scale = 1.0
    with torch.autocast("cpu", dtype=torch.float16):
        minibatch(fresh, make_batch(2), slice(0, B), float("nan"))
    res["fp16_floor"] = not fresh.step_applied and not fresh.scale_skipped and fresh.ds.optimizer.cur_scale == 1.0
    return res


if __name__ == "__main__":
    (single if "--single" in sys.argv[2:] else main)(Path(sys.argv[1]))
    leave_launch(0)  # no interpreter teardown under the launcher (jagg_scale/parallel/dist.py)
