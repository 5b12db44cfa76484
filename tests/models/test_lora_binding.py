"""The LoRA binding invariant (issue 34 item 2) on the tiny random SD3 pipeline: the wrapped modules are counted and
logged when the model is built, `model.lora.expect_modules` refuses any other count in one line, and a LoRA export
is read back and must hold every adapter tensor of the model by name and value, and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")
need("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

from jagg_scale.models import build_model  # noqa: E402
from jagg_scale.models.lora import lora_parameters  # noqa: E402
from jagg_scale.models.sd3 import SD3Velocity  # noqa: E402
from jagg_scale.train import ConfigError, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "sd3_tiny_cpu.yaml"
TINY_MODULES = 15  # 2 joint blocks x 8 projections, the last block without its context output (context_pre_only)


def _model_cfg(sd3_dir, *overrides):
    return load_config(CONFIG, [f"model.pretrained={sd3_dir}", "model.lora.enabled=true", "model.lora.rank=4",
                                "model.lora.alpha=8", *overrides]).model


def test_the_build_logs_the_wrapped_count_and_expect_modules_refuses_another(sd3_dir, caplog):
    with caplog.at_level("INFO", logger="jagg_scale.models.lora"):
        model = build_model(_model_cfg(sd3_dir, f"model.lora.expect_modules={TINY_MODULES}"))
    n_params = sum(p.numel() for p in lora_parameters(model))
    assert f"{TINY_MODULES} modules of SD3Transformer2DModel wrapped, {n_params:,} LoRA parameters" in caplog.text
    with pytest.raises(ConfigError) as err:
        build_model(_model_cfg(sd3_dir, f"model.lora.expect_modules={TINY_MODULES + 1}"))
    msg = str(err.value)
    assert "\n" not in msg and "'model.lora.expect_modules'" in msg and f"wrap {TINY_MODULES} modules" in msg
    assert "attn.to_q" in msg  # the targets it counted with
    # explicit targets are counted as well: the image stream's q alone, one per block
    with pytest.raises(ConfigError, match="wrap 2 modules"):
        build_model(_model_cfg(sd3_dir, "model.lora.targets=[attn.to_q]", f"model.lora.expect_modules={TINY_MODULES}"))


@pytest.mark.parametrize("override,message", [
    ("model.lora.expect_modules=0", "must be >= 1"),
    ("model.lora.enabled=false", "set model.lora.enabled true"),
])
def test_expect_modules_is_refused_where_it_cannot_act(sd3_dir, override, message):
    with pytest.raises(ConfigError) as err:
        _model_cfg(sd3_dir, "model.lora.expect_modules=3", override)
    assert "'model.lora.expect_modules'" in str(err.value) and message in str(err.value)


@pytest.fixture
def adapted(sd3_dir):
    model = SD3Velocity.from_pretrained(sd3_dir, dtype=torch.float32)
    model.add_lora(rank=4, alpha=8)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model


def _tampering(monkeypatch, change):
    """save_lora's writer, followed by `change` to the file it wrote (what a faulty writer or conversion would do)."""
    from diffusers import StableDiffusion3Pipeline

    write = StableDiffusion3Pipeline.save_lora_weights

    def tampered(out, **kwargs):
        write(out, **kwargs)
        file = Path(out) / "pytorch_lora_weights.safetensors"
        tensors = load_file(str(file))
        change(tensors)
        save_file(tensors, str(file))

    monkeypatch.setattr(StableDiffusion3Pipeline, "save_lora_weights", tampered)


NAME = "transformer.transformer_blocks.1.attn.to_q.lora_B.weight"


def test_an_untampered_export_holds_every_adapter_tensor(adapted, tmp_path):
    saved = load_file(str(adapted.save_lora(tmp_path / "lora") / "pytorch_lora_weights.safetensors"))
    live = {"transformer." + n.replace(".default.", "."): p for n, p in adapted.transformer.named_parameters()
            if "lora_" in n}
    assert len(saved) == 2 * TINY_MODULES and set(saved) == set(live)
    assert all(torch.equal(saved[k], live[k]) for k in saved)


@pytest.mark.parametrize("case,message", [
    ("dropped", f"the adapter tensor '{NAME}' is missing (1 of {2 * TINY_MODULES} missing)"),
    ("changed", f"the adapter tensor '{NAME}' differs from the model's"),
    ("halved", f"the adapter tensor '{NAME}' differs from the model's"),
    ("extra", "'transformer.extra.lora_A.weight' is not a tensor of the model's adapter"),
])
def test_a_tampered_export_is_refused_naming_the_tensor(adapted, tmp_path, monkeypatch, case, message):
    def change(tensors):
        if case == "dropped":
            del tensors[NAME]
        elif case == "changed":
            tensors[NAME] = tensors[NAME] + 1e-3
        elif case == "halved":
            tensors[NAME] = tensors[NAME].to(torch.bfloat16)
        else:
            tensors["transformer.extra.lora_A.weight"] = torch.zeros(2, 2)

    _tampering(monkeypatch, change)
    with pytest.raises(ValueError) as err:
        adapted.save_lora(tmp_path / "lora")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_gathered_state_without_an_adapter_tensor_is_refused(adapted, tmp_path):
    """The sharded engines export from a gathered state dict: a tensor it lacks is named, by the model's names."""
    state = {"transformer." + n: p.detach().clone() for n, p in adapted.transformer.named_parameters()
             if "lora_" in n}
    del state["transformer.transformer_blocks.0.attn.add_k_proj.lora_A.default.weight"]
    with pytest.raises(ValueError, match="'transformer.transformer_blocks.0.attn.add_k_proj.lora_A.weight' is missing"):
        adapted.save_lora(tmp_path / "lora", state=state)
