"""A choice owns its keys (issue 35 item 2): `key=null` unsets a key, `section=null` resets a section, and a key
that the choice made elsewhere leaves without effect is refused naming it. Config loading only, no training."""

from pathlib import Path

import pytest

from jagg_scale.train.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
SD35M = ROOT / "configs" / "sd35m_pickscore.yaml"


def _load(*overrides, path=TINY):
    return load_config(path, list(overrides), check_files=False)


def test_null_unsets_a_key_to_its_default():
    cfg = _load("train.steps=3", "train.steps=null", "jagg.window=2", "jagg.window=null")
    assert cfg.train.steps == 20 and cfg.jagg.window is None  # TrainConfig's and JAGGConfig's defaults
    assert not cfg.is_set("train.steps") and not cfg.is_set("jagg.window")
    assert _load("train.steps=3").is_set("train.steps")


def test_null_is_a_value_where_it_means_one():
    # sampling.shift null is the pipeline's own schedule, a value beside its default 3.0: not an unset
    cfg = _load("model.kind=sd3", "model.pretrained=x", "sampling.shift=null")
    assert cfg.sampling.shift is None and cfg.is_set("sampling.shift")


def test_a_key_at_its_default_counts_as_unset():
    # a saved config.yaml names every key: reloading it must not read as a user's choice of each
    assert not _load("train.steps=20").is_set("train.steps")


def test_section_null_resets_the_section_then_keys_set_in_it():
    base = _load(path=SD35M)
    assert base.jagg.window == 4 and base.jagg.jagg_frac == 1.0
    cfg = _load("jagg=null", "jagg.mode=exact", "grpo.ref_at=steps", path=SD35M)
    assert cfg.jagg.mode == "exact" and cfg.jagg.window is None and cfg.jagg.jagg_frac is None
    assert cfg.jagg.route_by is None and not cfg.is_set("jagg.window")


def test_null_for_a_key_of_a_mapping_keeps_the_mapping():
    cfg = _load("reward.components={jpeg_compressibility: null}")
    assert cfg.reward.components == {"jpeg_compressibility": None}


def test_a_section_given_a_scalar_is_refused():
    with pytest.raises(ConfigError, match="cannot set 'jagg.mode': 'jagg' is not a section"):
        _load("jagg=3", "jagg.mode=exact")
