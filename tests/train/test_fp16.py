"""model.dtype float16: Flow-GRPO's and DiffusionNFT's fp16 mixed precision (their config/base.py:21-23
mixed_precision "fp16") on the real SD3 code path. The parts take the peers' dtypes (text encoders fp16, VAE fp32 as
Flow-GRPO's scripts/train_sd3.py:410-413 keep them; the LoRA base fp16 and its adapter float32 masters), the policy
runs the transformer under fp16 autocast in the rollout, the KL reference and training, a tiny SD3 LoRA run trains
with the loss scaler in its checkpoints and resumes bit for bit, and the combinations that cannot be right are
refused by key. (The engines' loss scaling: tests/parallel/test_loss_scale.py.)"""

from pathlib import Path

import pytest
import torch
from extras import need
from safetensors.torch import load_file

need("diffusers")
need("peft")

from jagg_scale.models import build_model  # noqa: E402
from jagg_scale.train import load_config  # noqa: E402
from jagg_scale.train.config import ConfigError  # noqa: E402
from jagg_scale.train.policy import Policy  # noqa: E402
from stand_ins import stand_in_paths  # noqa: E402
from train_runs import fit_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SD3 = ROOT / "configs" / "sd3_tiny_cpu.yaml"
FP16 = ["model.dtype=float16", "model.lora.enabled=true"]


def test_the_parts_take_the_peers_fp16_dtypes_and_the_transformer_runs_under_fp16_autocast(sd3_dir):
    cfg = load_config(SD3, [f"model.pretrained={sd3_dir}", *FP16, "grpo.kl_beta=0.04"])
    model = build_model(cfg.model, keep_stored_dtype=True)
    assert model.compute_dtype == torch.float16  # what the engines read: a loss scaler, fp16 gathers
    assert {n: next(m.parameters()).dtype for n, m in model.frozen.items()} == {
        "vae": torch.float32, "text_encoder": torch.float16, "text_encoder_2": torch.float16,
        "text_encoder_3": torch.float16}
    dtypes = {(name.split(".")[-3] if "lora_" in name else "base", p.dtype, p.requires_grad)
              for name, p in model.transformer.named_parameters()}
    assert dtypes == {("base", torch.float16, False), ("lora_A", torch.float32, True), ("lora_B", torch.float32, True)}
    seen = []
    block = model.transformer.transformer_blocks[0]
    block.register_forward_hook(lambda m, args, out: seen.append(out[-1].dtype))
    policy = Policy(model, cfg, torch.device("cpu"))
    cond = policy.encode(["a red apple"])
    x = torch.randn(1, *model.latent_shape)
    # what training differentiates (the conditional rows), the rollout's guided velocity, the KL reference's
    for fn, c in ((policy.model_fn(), policy.split_cond(cond)[0]), (policy.velocity_fn(), cond),
                  (policy.reference_fn(), cond)):
        with torch.no_grad():
            v = fn(x, torch.tensor([0.5]), c)
        assert v.dtype == torch.float32 and torch.isfinite(v).all()  # the SDE math gets float32
    assert len(seen) == 3 and set(seen) == {torch.float16}  # one pass each (CFG: both halves in one)
    with torch.no_grad():
        images = model.decode(x)
    assert images.dtype == torch.float32 and torch.isfinite(images).all()


def test_a_tiny_sd3_lora_run_trains_in_float16_and_resumes_bit_for_bit(sd3_dir, tmp_path, monkeypatch):
    """Three steps, a checkpoint, the third resumed: the uninterrupted run's metrics bit for bit. The scaler grows
    after every clean step here (growth interval 1), so a resume that lost its state would scale the third step by
    2^16 instead of its grown scale and log it."""
    import jagg_scale.parallel.local_engine as engines

    make = engines.make_scaler

    def growing(*args, **kwargs):
        scaler = make(*args, **kwargs)
        scaler.load_state_dict({**scaler.state_dict(), "growth_interval": 1})
        return scaler

    monkeypatch.setattr(engines, "make_scaler", growing)
    run = [f"model.pretrained={sd3_dir}", *FP16, "grpo.kl_beta=0.04", "sampling.num_steps=4", "jagg.window=2",
           "run.checkpoint_every=1"]
    whole = fit_metrics(SD3, [*run, "train.steps=3"], tmp_path / "whole")
    fit_metrics(SD3, [*run, "train.steps=2"], tmp_path / "split")
    resumed = fit_metrics(SD3, [*run, "train.steps=3", "run.resume=auto"], tmp_path / "split")
    assert len(whole) == 3 and resumed == whole
    assert all(r["nonfinite_steps"] == 0 and r["loss_scale_skips"] == 0 and r["kl"] >= 0 for r in whole)
    assert [r["loss_scale"] for r in whole] == [2.0**16, 2.0**17, 2.0**18]  # one optimizer step per training step
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in whole)
    ckpts = [tmp_path / "whole" / "checkpoints" / f"step_{s:08d}" for s in (2, 3)]  # keep_last 2
    assert [(c / "loss_scale.json").is_file() for c in ckpts] == [True, True]
    first, second = (load_file(str(c / "model.safetensors")) for c in ckpts)
    assert set(first) == set(second) and all(v.dtype == torch.float32 for v in first.values())  # the fp32 adapter
    assert any(not torch.equal(first[k], second[k]) for k in first)  # the weights moved


@pytest.mark.parametrize("override, key", [
    ({"bf16": {"enabled": True}}, "parallel.deepspeed.bf16"),
    ({"fp16": {"enabled": False}}, "parallel.deepspeed.fp16"),
])
def test_deepspeed_precision_against_float16_is_refused_by_key(tmp_path, override, key):
    import json

    with pytest.raises(ConfigError, match=rf"^config key '{key}' is DeepSpeed's .* mode, set from model\.dtype"):
        load_config(ROOT / "configs" / "sd35m_pickscore.yaml",
                     [*stand_in_paths(tmp_path), "model.dtype=float16", "parallel.engine=deepspeed",
                      f"parallel.deepspeed={json.dumps(override)}"], check_files=False)


def test_deepspeed_fp16_tuning_is_its_own_and_the_cpu_has_none(tmp_path):
    import json

    tune = f"parallel.deepspeed={json.dumps({'fp16': {'loss_scale_window': 500}})}"
    base = [*stand_in_paths(tmp_path), "parallel.engine=deepspeed", "run.device=cpu", tune]
    with pytest.raises(ConfigError, match=r"^config key 'parallel\.deepspeed\.fp16' .* leave it out"):
        load_config(ROOT / "configs" / "sd35m_pickscore.yaml", [*base, "model.dtype=bfloat16"], check_files=False)
    load_config(ROOT / "configs" / "sd35m_pickscore.yaml", [*base, "model.dtype=float16"], check_files=False)
    with pytest.raises(ConfigError, match=r"^config key 'model\.dtype' float16 with parallel\.engine deepspeed "
                                          r"needs a GPU"):
        load_config(ROOT / "configs" / "sd35m_pickscore.yaml", [*base, "model.dtype=float16"])
