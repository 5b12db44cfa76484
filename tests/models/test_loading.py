"""Loading at production scale (models/__init__.py build_model, the engines' placement, train/trainer.py), on the
tiny offline SD3 pipeline (jagg_scale/models/tiny.py):

- the frozen VAE and text encoders are loaded straight in their compute dtype (bf16 with model.dtype bfloat16),
  bit for bit what loading float32 and casting gave;
- a transformer stored in bf16 stays bf16 on the host (no float32 copy there) and is upcast to its float32 master
  weights by the engine while it is placed (whole for the none engine, unit by unit for FSDP2), bit for bit the
  float32 load, and a run trains exactly as one that loaded float32;
- the order: the engine receives the transformer on the host, nothing is on the device before it, the frozen parts
  go there after it, and FSDP2 places one unit at a time;
- the KL reference of a full fine-tune is the transformer alone (the VAE and encoders are the policy's objects),
  and a run's metrics are those of the old whole-model deepcopy;
- model.text_encoders no_t5 builds no T5, encodes zero T5 embeddings of the same shapes, trains;
- model.shard_text_encoder shards the T5 encoder with FSDP2 (DTensor parameters) and encodes what the unsharded one
  does.

The 2-process ZeRO-3 reference (1/world of its bytes per rank) is checked in tests/dist_workers/deepspeed_worker.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from torch.distributed.tensor import DTensor

from jagg_scale.models import build_model, stored_dtype
from jagg_scale.parallel.dist import DistContext
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.config_sections import ConfigError, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
SD3_CONFIG = ROOT / "configs" / "sd3_tiny_cpu.yaml"
PROMPTS = ["a red apple", "a cat", ""]
QUICK = ["sampling.num_steps=4", "jagg.window=4", "log.progress=false", "run.checkpoint_every=0",
         "eval.enabled=false"]


def _cfg(pipe_dir, tmp_path, *overrides):
    return load_config(SD3_CONFIG, [f"model.pretrained={pipe_dir}", f"run.output_dir={tmp_path}", *QUICK,
                                    *overrides])


def _fit(cfg) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(cfg)
    try:
        rows = trainer.fit()
    finally:
        trainer.close()  # FSDP2 in one process starts a trivial process group: leave none behind
    return trainer, [{k: v for k, v in r.items() if not k.startswith(("time_", "comm_"))} for r in rows]


def _model_cfg(pipe_dir, **kw) -> ModelConfig:
    return ModelConfig(kind="sd3", pretrained=str(pipe_dir), **kw)


@pytest.fixture(scope="module")
def bf16_dir(sd3_dir, tmp_path_factory):
    """The tiny SD3 pipeline with its transformer stored in bf16 (as FLUX.1-dev and SD3.5 ship theirs)."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir, local_files_only=True)
    pipe.transformer.to(torch.bfloat16)
    out = tmp_path_factory.mktemp("tiny_sd3_bf16") / "pipe"
    pipe.save_pretrained(str(out))
    return out


# ------------------------------------------------------------------------------------------ dtypes at load time


def test_frozen_parts_load_in_their_compute_dtype_bit_for_bit(sd3_dir):
    old = build_model(_model_cfg(sd3_dir))  # float32 everywhere
    new = build_model(_model_cfg(sd3_dir, dtype="bfloat16"), keep_stored_dtype=True)
    assert set(new.frozen) == {"vae", "text_encoder", "text_encoder_2", "text_encoder_3"}
    for name, module in new.frozen.items():
        want = copy.deepcopy(old.frozen[name]).to(torch.bfloat16).state_dict()  # what the old load-then-cast gave
        got = module.state_dict()
        assert set(got) == set(want)
        for k, v in got.items():
            assert v.dtype == want[k].dtype and torch.equal(v, want[k]), (name, k)
    # a float32 checkpoint: the transformer loads in float32 (bf16 would round it), nothing left to upcast
    assert stored_dtype(Path(sd3_dir) / "transformer") == torch.float32
    assert {p.dtype for p in new.transformer.parameters()} == {torch.float32} and new.master_dtype is None


def test_jagg_eval_holds_a_bf16_published_transformer_in_bf16(bf16_dir, tmp_path, monkeypatch):
    """jagg-eval has no optimizer and no fp32 master to keep: under model.dtype bfloat16 a transformer published in
    bf16 is held in bf16 (FLUX: 23.8 GB a GPU, not 47.6)."""
    from jagg_scale.train import evaluate as ev
    from jagg_scale.train import load_config

    seen = {}
    monkeypatch.setattr(ev, "evaluate", lambda model, *a, **k: seen.setdefault("model", model) and {})
    cfg = load_config(ROOT / "configs" / "sd3_tiny_cpu.yaml",
                      [f"model.pretrained={bf16_dir}", "model.dtype=bfloat16", "eval.prompts=[a cat]"])
    ev.evaluate_checkpoint(cfg, None, tmp_path)
    assert {p.dtype for p in seen["model"].transformer.parameters()} == {torch.bfloat16}


def test_a_bf16_checkpoint_stays_bf16_on_the_host_and_is_upcast_when_placed(sd3_dir, bf16_dir):
    from jagg_scale.parallel.config import ParallelConfig
    from jagg_scale.parallel.local_engine import LocalEngine
    from jagg_scale.train.config import TrainConfig

    assert stored_dtype(Path(bf16_dir) / "transformer") == torch.bfloat16
    fp32 = build_model(_model_cfg(bf16_dir, dtype="bfloat16"))  # float32 right away (keep_stored_dtype off)
    host = build_model(_model_cfg(bf16_dir, dtype="bfloat16"), keep_stored_dtype=True)
    assert {t.dtype for t in (*host.transformer.parameters(), *host.transformer.buffers())} == {torch.bfloat16}
    assert host.master_dtype == torch.float32  # no float32 copy of the transformer on the host
    ref = host.reference_copy()
    assert ref.master_dtype is None and {p.dtype for p in ref.parameters()} == {torch.bfloat16}  # frozen: not upcast
    # float32 asked for: the transformer loads float32 whatever the checkpoint stores
    assert build_model(_model_cfg(bf16_dir), keep_stored_dtype=True).master_dtype is None
    # LoRA under bf16: the frozen base in bf16 (never upcast), the adapter float32, from either checkpoint dtype
    for path in (bf16_dir, sd3_dir):
        lora = _model_cfg(path, dtype="bfloat16")
        lora.lora.enabled, lora.lora.rank = True, 2
        m = build_model(lora, keep_stored_dtype=True)
        dtypes = {n: p.dtype for n, p in m.transformer.named_parameters()}
        assert m.master_dtype is None and {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
        assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
        placed = LocalEngine(m, ParallelConfig(), TrainConfig(), DistContext()).model.transformer
        assert {n: p.dtype for n, p in placed.named_parameters()} == dtypes

    engine = LocalEngine(host, ParallelConfig(), TrainConfig(), DistContext())
    want = fp32.transformer.state_dict()
    got = engine.model.transformer.state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)


def test_fsdp2_upcasts_and_places_one_unit_at_a_time(bf16_dir, monkeypatch):
    from jagg_scale.parallel import fsdp
    from jagg_scale.parallel.config import ParallelConfig
    from jagg_scale.train.config import TrainConfig

    placed: list[int] = []  # bytes of the unsharded tensors handed to each placement
    real = fsdp.place_

    def spy(module, device, master_dtype=None):
        placed.append(sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers())
                          if not isinstance(t, DTensor)))
        return real(module, device, master_dtype)

    monkeypatch.setattr(fsdp, "place_", spy)
    want = build_model(_model_cfg(bf16_dir, dtype="bfloat16")).transformer.state_dict()
    model = build_model(_model_cfg(bf16_dir, dtype="bfloat16"), keep_stored_dtype=True)
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.transformer.transformer_blocks)
    ctx = DistContext()
    try:
        engine = fsdp.FSDP2Engine(model, ParallelConfig(engine="fsdp2"), TrainConfig(), ctx)
        assert len(placed) == len(model.transformer.transformer_blocks) + 1  # each block, then the root's rest
        assert max(placed[:-1]) == block and max(placed) < total  # never the whole transformer at once
        got = engine.full_state_dict()
    finally:
        ctx.close()
    assert all(got["transformer." + k].dtype == torch.float32 and torch.equal(got["transformer." + k], v)
               for k, v in want.items())


def test_a_bf16_checkpoint_trains_exactly_as_the_float32_load(bf16_dir, tmp_path, monkeypatch):
    over = ["model.dtype=bfloat16", "grpo.kl_beta=0.04", "train.steps=2"]
    _, new = _fit(_cfg(bf16_dir, tmp_path / "new", *over))
    import jagg_scale.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "build_model", lambda cfg, **kw: build_model(cfg))  # the old float32 load
    _, old = _fit(_cfg(bf16_dir, tmp_path / "old", *over))
    assert new == old and new[-1]["kl"] > 0


# ------------------------------------------------------------------------------------------ the order


class _Stop(Exception):
    pass


def test_the_engine_places_the_transformer_before_anything_reaches_the_device(sd3_dir, tmp_path, monkeypatch):
    """The run's device is `meta` here, so that any move is visible: the engine must get the transformer (and the
    reference its copy) still on the host, and the frozen parts must not move before the engine has run."""
    import jagg_scale.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "init_distributed",
                        lambda device, **kw: DistContext(0, 1, 0, torch.device("meta"), "none"))
    real = trainer_module.build_engine
    seen: dict = {}

    def devices(modules) -> set:
        return {p.device.type for m in modules for p in m.parameters()}

    def spy(model, parallel, optim, dist):
        seen["engine_gets"] = devices([model])
        seen["frozen_at_engine"] = devices(model.frozen.values())
        engine = real(model, parallel, optim, dist)
        seen["engine_placed"] = devices([engine.model])

        def shard_frozen(ref):
            seen["reference_gets"] = devices([ref])
            seen["frozen_after_engine"] = devices(model.frozen.values())
            seen["frozen_shared"] = ref.frozen is model.frozen
            raise _Stop

        engine.shard_frozen = shard_frozen
        return engine

    monkeypatch.setattr(trainer_module, "build_engine", spy)
    with pytest.raises(_Stop):
        Trainer(_cfg(sd3_dir, tmp_path, "grpo.kl_beta=0.04"))
    assert seen == {"engine_gets": {"cpu"}, "frozen_at_engine": {"cpu"}, "engine_placed": {"meta"},
                    "reference_gets": {"cpu"}, "frozen_after_engine": {"meta"}, "frozen_shared": True}


# ------------------------------------------------------------------------------------------ the KL reference


def test_the_reference_is_the_transformer_alone_with_the_policys_frozen_parts(sd3_dir, tmp_path, monkeypatch):
    trainer, rows = _fit(_cfg(sd3_dir, tmp_path / "new", "grpo.kl_beta=0.04", "train.steps=2"))
    model, ref = trainer.model, trainer.policy.ref_model
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(ref) == count(model.transformer) == count(model)  # a transformer's worth, no VAE / encoders
    assert ref.frozen is model.frozen and ref.pipe is model.pipe  # shared by reference, not copied
    assert all(ref.frozen[k] is model.frozen[k] for k in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"))
    assert ref.transformer is not model.transformer and not ref.owns_frozen
    assert not {id(p) for p in ref.parameters()} & {id(p) for p in model.parameters()}
    assert not any(p.requires_grad for p in ref.parameters())
    assert rows[-1]["kl"] > 0

    # the old reference: a deepcopy of the whole adapter (pipeline, VAE, every encoder) gives the same metrics
    from jagg_scale.models.diffusers_common import DiffusersVelocity

    monkeypatch.setattr(DiffusersVelocity, "reference_copy",
                        lambda self: copy.deepcopy(self).requires_grad_(False).eval())
    old_trainer, old = _fit(_cfg(sd3_dir, tmp_path / "old", "grpo.kl_beta=0.04", "train.steps=2"))
    assert old_trainer.policy.ref_model.frozen["vae"] is not model.frozen["vae"]  # the monkeypatch took
    assert len(old) == len(rows)
    for a, b in zip(rows, old):
        for key in ("reward_mean", "kl", "loss", "grad_norm", "ratio_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-12), key


# ------------------------------------------------------------------------------------------ text encoders


def test_no_t5_builds_no_t5_and_encodes_zero_t5_embeddings(sd3_dir, tmp_path):
    from transformers import T5EncoderModel

    full = build_model(_model_cfg(sd3_dir))
    no_t5 = build_model(_model_cfg(sd3_dir, text_encoders="no_t5"))
    assert "text_encoder_3" not in no_t5.frozen and no_t5.pipe.text_encoder_3 is None
    assert not any(isinstance(m, T5EncoderModel) for m in (*no_t5.frozen.values(), *vars(no_t5.pipe).values()))
    embeds, pooled = no_t5.encode_prompts(PROMPTS)
    want_embeds, want_pooled = full.encode_prompts(PROMPTS)
    assert embeds.shape == want_embeds.shape and pooled.shape == want_pooled.shape  # [B, L_clip + L_t5, D], [B, P]
    clip_len = no_t5.pipe.tokenizer_max_length
    assert embeds.shape[1] == clip_len + no_t5.max_sequence_length
    assert torch.equal(embeds[:, :clip_len], want_embeds[:, :clip_len]) and torch.equal(pooled, want_pooled)
    assert not embeds[:, clip_len:].any() and want_embeds[:, clip_len:].any()  # zeros where T5's would be

    trainer, rows = _fit(_cfg(sd3_dir, tmp_path, "model.text_encoders=no_t5", "train.steps=1"))
    assert "text_encoder_3" not in trainer.model.frozen
    assert len(rows) == 1 and rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert json.loads(json.dumps(rows[0]))["backward_passes"] > 0


def test_shard_t5_makes_dtensors_and_encodes_what_the_unsharded_encoder_does(sd3_dir):
    from jagg_scale.parallel.fsdp import build_mesh, shard_for_inference

    plain = build_model(_model_cfg(sd3_dir))
    want = plain.encode_prompts(PROMPTS)
    ctx = DistContext()
    ctx.ensure_group()
    try:
        model = build_model(_model_cfg(sd3_dir))
        mesh = build_mesh("cpu", 1)
        model.place_frozen(torch.device("cpu"), shard_t5=lambda m: shard_for_inference(m, mesh))
        t5 = model.frozen["text_encoder_3"]
        assert all(isinstance(p, DTensor) for p in t5.parameters())
        assert not any(isinstance(p, DTensor) for m in ("vae", "text_encoder") for p in model.frozen[m].parameters())
        got = model.encode_prompts(PROMPTS)
        got_again = model.encode_prompts(PROMPTS[:1])  # the root reshards after each call: callable again
    finally:
        ctx.close()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got_again[0], want[0][:1])


def test_a_text_encoder_sharded_at_its_root_still_returns_its_hidden_states(zimage_dir):
    """Z-Image's encoder is a bare Qwen3Model, so fully_shard swaps the class whose name transformers looks up for
    output_hidden_states; the sharded encoder must still hand the pipeline its hidden states, the same ones."""
    from jagg_scale.models.zimage import ZImageVelocity
    from jagg_scale.parallel.fsdp import build_mesh, shard_for_inference

    plain = ZImageVelocity.from_pretrained(zimage_dir, max_sequence_length=32, resolution=16)
    want = plain.encode_prompts(PROMPTS)
    ctx = DistContext()
    ctx.ensure_group()
    try:
        model = ZImageVelocity.from_pretrained(zimage_dir, max_sequence_length=32, resolution=16)
        model.place_frozen(torch.device("cpu"), shard_t5=lambda m: shard_for_inference(m, build_mesh("cpu", 1)))
        assert all(isinstance(p, DTensor) for p in model.frozen["text_encoder"].parameters())
        got = model.encode_prompts(PROMPTS)
    finally:
        ctx.close()
    assert torch.equal(got.embeds, want.embeds) and torch.equal(got.mask, want.mask) and got.lengths == want.lengths


def test_trainer_with_shard_t5_and_a_sharded_reference_under_fsdp2(sd3_dir, tmp_path):
    over = ["grpo.kl_beta=0.04", "train.steps=1", "parallel.engine=fsdp2"]
    trainer, rows = _fit(_cfg(sd3_dir, tmp_path / "sharded", "model.shard_text_encoder=true", *over))
    assert all(isinstance(p, DTensor) for p in trainer.model.frozen["text_encoder_3"].parameters())
    ref = trainer.policy.ref_model
    assert all(isinstance(p, DTensor) for p in ref.parameters()) and ref.frozen is trainer.model.frozen
    _, plain = _fit(_cfg(sd3_dir, tmp_path / "plain", *over))
    assert rows == plain


def test_text_encoder_options_are_checked():
    with pytest.raises(ConfigError, match="model.text_encoders"):
        ModelConfig(kind="flux", pretrained="x", text_encoders="no_t5").check("model")
    with pytest.raises(ConfigError, match="model.shard_text_encoder"):
        ModelConfig(kind="dit", shard_text_encoder=True).check("model")
    with pytest.raises(ConfigError, match="model.shard_text_encoder"):
        ModelConfig(kind="sd3", pretrained="x", text_encoders="no_t5", shard_text_encoder=True).check("model")
    ModelConfig(kind="sd3", pretrained="x", text_encoders="no_t5").check("model")
    ModelConfig(kind="flux", pretrained="x", shard_text_encoder=True).check("model")


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_lora_over_a_bf16_base_has_the_float32_bases_gradient_to_bf16_rounding(kind, sd3_dir, flux_dir):
    """The LoRA gradient over the bf16-stored base (the trainer's build under model.dtype bfloat16) against the
    float32-stored base (the old build: model.dtype float32, run under the same bf16 autocast): the matmuls autocast
    to bf16 either way, so what differs is the rounding of the base's non-matmul weights (norms, biases)."""
    from jagg_scale.models.lora import lora_parameters

    path = sd3_dir if kind == "sd3" else flux_dir

    def grads(dtype):
        cfg = ModelConfig(kind=kind, pretrained=str(path), dtype=dtype)
        cfg.lora.enabled, cfg.lora.rank = True, 4
        torch.manual_seed(0)
        m = build_model(cfg)
        params = lora_parameters(m)
        with torch.no_grad():  # a trained adapter, not the zero-B init: both A and B get a gradient
            for p in params:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(2, *m.latent_shape, generator=gen)
        target = torch.randn(2, *m.latent_shape, generator=gen)
        cond = m.encode_prompts(["a red cube", "two cats"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v = m(x, torch.tensor([0.7, 0.3]), cond)
        (v.float() * target).sum().backward()
        base = {p.dtype for n, p in m.transformer.named_parameters() if "lora_" not in n}
        return torch.cat([p.grad.flatten() for p in params]), base, {p.dtype for p in params}

    g16, base16, lora16 = grads("bfloat16")
    g32, base32, lora32 = grads("float32")
    assert (base16, base32, lora16, lora32) == ({torch.bfloat16}, {torch.float32}, {torch.float32}, {torch.float32})
    cos = torch.nn.functional.cosine_similarity(g16, g32, dim=0)
    print(f"{kind}: LoRA gradient cosine bf16 base vs float32 base {float(cos):.6f}")
    assert cos >= 0.999 and not torch.equal(g16, g32), float(cos)
