"""The model-family registry (models/registry.py): every family has what the rest reads, an unknown kind is refused
naming the known ones, a family-only key is refused on another family, and adding a family is one registration."""

import dataclasses

import pytest
import torch

from jagg_scale.models import build_model, tiny
from jagg_scale.models.registry import _FAMILIES, MODULES, Family, families, family, family_of_transformer, register
from jagg_scale.sections import ConfigError
from jagg_scale.train.config import config_from_dict as _from_dict
from jagg_scale.train.config_sections import ModelConfig

def config_from_dict(data: dict):
    return _from_dict({"data": {"prompts": ["a cat"]}, **data})


PIPELINES = [k for k, f in families().items() if f.is_pipeline]


def test_the_registry_holds_the_dit_and_every_pipeline_family():
    assert set(families()) >= {"dit", "sd3", "flux", "flux_kontext", "flux2", "qwenimage", "qwenimage_edit", "zimage",
                               "wan"}
    assert not family("dit").is_pipeline and family("dit").geometry is None
    # in MODULES' order whatever imported a family module first (error messages and first-registered lookups read it)
    assert [f.velocity.__module__.rsplit(".", 1)[1] for f in families().values()] == list(MODULES)


@pytest.mark.parametrize("kind", PIPELINES)
def test_every_pipeline_family_has_every_field(kind):
    fam = family(kind)
    assert fam.name == kind and callable(fam.build) and fam.pipeline.endswith("Pipeline")
    assert fam.transformer.endswith(("Transformer2DModel", "Transformer3DModel"))
    assert fam.frozen[0] == "vae" and fam.frozen[-1].startswith("text_encoder")
    assert fam.text in ("clip_t5", "t5", "qwen", "qwen_lm")
    assert 1 <= fam.prompt_tokens <= fam.prompt_limit
    assert fam.cfg_rule in ("plain", "token_norm") and fam.velocity.lora_targets
    assert all(callable(f) for f in (fam.geometry, fam.inputs, fam.blocks))
    assert fam.checkpoints and callable(getattr(tiny, fam.tiny))
    # the estimator's shape file for each checkpoint name exists, and names this family (or, FLUX.1's transformer
    # under Kontext, one that shares the transformer)
    from jagg_scale.estimate.shapes import SHAPES
    import json

    for shapes in fam.checkpoints.values():
        data = json.loads((SHAPES / f"{shapes}.json").read_text())
        assert data["kind"] == kind and data["components"]["transformer"]["class"] == fam.transformer
    # the first family registered with a transformer class is the one that measures it
    assert family_of_transformer(fam.transformer).transformer == fam.transformer


def test_an_unknown_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"config key 'model.kind': unknown model family 'sdxl'; known: dit, sd3"):
        config_from_dict({"model": {"kind": "sdxl", "pretrained": "x"}})
    with pytest.raises(ConfigError, match="unknown model family 'nope'"):
        build_model(ModelConfig(kind="nope"))


@pytest.mark.parametrize("key, value, kind", [
    ("distilled_guidance", 3.0, "sd3"), ("num_frames", 9, "flux"), ("text_encoders", "no_t5", "qwenimage"),
    ("attention", "xformers", "wan")])
def test_a_family_only_key_is_refused_on_another_family(key, value, kind):
    with pytest.raises(ConfigError, match=rf"config key 'model.{key}'"):
        config_from_dict({"model": {"kind": kind, "pretrained": "/nowhere", key: value}})


def test_the_prompt_limit_is_the_familys():
    with pytest.raises(ConfigError, match=r"must be in \[1, 1024\] prompt tokens for model.kind qwenimage"):
        config_from_dict({"model": {"kind": "qwenimage", "pretrained": "/nowhere", "max_sequence_length": 1025}})
    with pytest.raises(ConfigError, match=r"must be in \[1, 512\] prompt tokens for model.kind zimage"):
        config_from_dict({"model": {"kind": "zimage", "pretrained": "/nowhere", "max_sequence_length": 513}})


class _ToyVelocity(torch.nn.Module):
    """A toy pipeline family's adapter: a constant velocity."""

    frozen_names = ("vae", "text_encoder")
    guidance_rule = "plain"
    lora_targets = ("proj",)

    def __init__(self, path, dtypes):
        super().__init__()
        self.path, self.dtypes = path, dtypes
        self.proj = torch.nn.Linear(2, 2)


def test_adding_a_family_is_one_registration(tmp_path):
    """A toy family registered here is known to the config and built by build_model, with no other change."""
    (tmp_path / "model_index.json").write_text("{}")
    toy = register(Family(name="toy", velocity=_ToyVelocity, pipeline="ToyPipeline",
                          build=lambda cfg, path, dtypes: _ToyVelocity(path, dtypes), prompt_tokens=8,
                          prompt_limit=16))
    try:
        cfg = config_from_dict({"model": {"kind": "toy", "pretrained": str(tmp_path), "max_sequence_length": 16},
                                "sampling": {"shift": None}})  # the pipeline's schedule: a diffusers kind
        model = build_model(cfg.model)
        assert isinstance(model, _ToyVelocity) and model.path == tmp_path
        assert model.dtypes == {"transformer": torch.float32, "default": torch.float32}
        assert model.compute_dtype == torch.float32
        with pytest.raises(ConfigError, match=r"must be in \[1, 16\]"):
            config_from_dict({"model": {"kind": "toy", "pretrained": str(tmp_path), "max_sequence_length": 17}})
        with pytest.raises(ValueError, match="registered twice"):
            register(dataclasses.replace(toy, prompt_tokens=4))
    finally:
        del _FAMILIES["toy"]
    with pytest.raises(ConfigError, match="unknown model family 'toy'"):
        family("toy")


@pytest.mark.parametrize("name, kind", [("Qwen-Image", "qwenimage"), ("Qwen-Image-Edit-2509", "qwenimage_edit"),
                                        ("FLUX.1-Kontext-dev", "flux_kontext"), ("FLUX.1-dev", "flux")])
def test_a_checkpoint_name_picks_its_familys_shapes(name, kind):
    """The estimator's shape file of a model.pretrained not on this machine, by the families' checkpoint names: the
    longest name found wins (Qwen-Image-Edit-2509 holds Qwen-Image)."""
    from types import SimpleNamespace

    from jagg_scale.estimate.shapes import pipeline_shapes

    cfg = SimpleNamespace(model=SimpleNamespace(kind=kind, pretrained=f"/nowhere/{name}"))
    assert pipeline_shapes(cfg)["kind"] == kind
