"""The configuration module alone (no training): typed choices, typed containers, finite floats, every shipped
YAML, and the to_dict round trip that config.yaml and resume rely on."""

import typing
from pathlib import Path

import pytest
import yaml

from jagg_scale.jagg.backward import INTERMEDIATE_MODES, IntermediateMode
from jagg_scale.models.registry import families
from jagg_scale.jagg.knots import ErrorModel
from jagg_scale.jagg.planners import RouteBy
from jagg_scale.parallel.types import EngineName
from jagg_scale.train.config import (Config, ConfigError, JAGGConfig, ParallelConfig, config_from_dict, load_config,
                                     validate)
from stand_ins import stand_in_paths

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def _err(*overrides):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, list(overrides))
    return str(info.value)


@pytest.mark.parametrize("key,choices", [
    ("model.dtype", "float32, bfloat16, float16"),
    ("model.attention", "sdpa, xformers, cudnn, flash"),
    ("model.text_encoders", "all, no_t5"),
    ("grpo.sde_window_mode", "random, sliding, scattered"),
    ("jagg.mode", "jagg, exact"),
    ("jagg.route_by", "vcos, weighted"),
    ("jagg.intermediate", "auto, cached, interpolate, forward"),
    ("jagg.planner", "uniform, budget"),
    ("jagg.error_model", "residual, cosine"),
    ("data.source", "list, wds"),
    ("reward.aggregate", "sum, advantage, gdpo"),
    ("log.wandb_mode", "offline, online, disabled"),
    ("parallel.engine", "none, fsdp2, deepspeed"),
    ("run.device", "auto, cpu, cuda"),
    ("run.export_dtype", "auto, float32, bfloat16"),
])
def test_a_bad_choice_names_the_key_and_the_choices(key, choices):
    assert _err(f"{key}=foo") == f"config key '{key}' must be one of {choices}, got 'foo'"
    assert f"config key '{key}' must be one of {choices}, got 3" == _err(f"{key}=3")


def test_choices_have_one_source():
    hints = typing.get_type_hints(JAGGConfig)
    # planner settings are optional (null: the chosen planner's default), of the planner's own choices
    assert hints["route_by"] == typing.Optional[RouteBy] and hints["error_model"] == typing.Optional[ErrorModel]
    assert typing.get_args(hints["intermediate"]) == ("auto", *typing.get_args(IntermediateMode))
    assert typing.get_args(hints["intermediate"])[1:] == INTERMEDIATE_MODES
    assert typing.get_type_hints(ParallelConfig)["engine"] is EngineName


def test_adam_betas_is_a_typed_pair():
    cfg = load_config(TINY, ["train.adam_betas=[0.8, 0.99]"])
    assert cfg.train.adam_betas == (0.8, 0.99) and isinstance(cfg.train.adam_betas, tuple)
    assert Config().train.adam_betas == (0.9, 0.999)
    assert load_config(TINY, ["train.adam_betas=[0, 1.0e-1]"]).train.adam_betas == (0.0, 0.1)
    for bad in ("[0.9]", "[0.9, 0.99, 0.999]", "0.9", "[a, b]", "[0.9, null]", "[true, 0.9]", "{a: 1}", "[0.9, .nan]",
                "[0.9, 1.5]", "[-0.1, 0.9]"):
        assert "config key 'train.adam_betas" in _err(f"train.adam_betas={bad}")


@pytest.mark.parametrize("key", ["train.lr", "grpo.clip_range", "sampling.shift", "jagg.min_cos", "train.adam_eps",
                                 "model.dit.mlp_ratio", "model.distilled_guidance", "reward.max_fail_frac"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "inf"])
def test_non_finite_floats_are_rejected(key, value):
    assert _err(f"{key}={value}").startswith(f"config key '{key}' must be a finite number, got ")


def test_export_keys_default_to_an_export_at_the_end_in_the_published_dtype_and_are_checked_by_name():
    assert (Config().run.export_every, Config().run.export_dtype) == (0, "auto")
    cfg = load_config(TINY, ["run.export_every=50", "run.export_dtype=bfloat16"])
    assert (cfg.run.export_every, cfg.run.export_dtype) == (50, "bfloat16")
    assert _err("run.export_every=-1") == "config key 'run.export_every' must be >= 0 (0: only at the end)"
    assert _err("run.export_every=1.5").startswith("config key 'run.export_every' must be ")


def test_negative_adam_eps_and_weight_decay_are_named():
    for eps in ("-1e-8", "0"):  # 0 divides by a zero second moment: the run diverged (issue 41)
        assert _err(f"train.adam_eps={eps}").startswith("config key 'train.adam_eps' must be > 0")
    assert _err("train.weight_decay=-0.1").startswith("config key 'train.weight_decay' must be >= 0")
    assert load_config(TINY, ["train.weight_decay=0", "train.adam_eps=1e-12"]).train.weight_decay == 0


@pytest.mark.parametrize("override,key", [
    ("data.prompts=[a, 3]", "data.prompts[1]"),
    ("data.prompts=a", "data.prompts"),
    ("eval.prompts=[1]", "eval.prompts[0]"),
    ("model.lora.targets=[to_q, 2]", "model.lora.targets[1]"),
    ("grpo.sde_window_range=[a, 3]", "grpo.sde_window_range[0]"),
    ("grpo.sde_window_range=[1]", "grpo.sde_window_range"),
    ("reward.options=[1]", "reward.options"),
    ("reward.options={1: 2}", "reward.options"),
    ("reward.components={a: 3}", "reward.components.a"),
    ("reward.components={jpeg_compressibility: {weight: .nan}}", "reward.components.jpeg_compressibility.weight"),
    ("parallel.deepspeed=3", "parallel.deepspeed"),
    ("run.resume=3", "run.resume"),
    ("model=3", "model"),
])
def test_typed_containers_name_the_key(override, key):
    assert f"'{key}'" in _err(override)


def test_strings_still_read_as_floats_and_resume_stays_a_string():
    cfg = load_config(TINY, ["train.lr=1e-4", "run.resume=auto", "reward.options={quality: 50}"])
    assert cfg.train.lr == 1e-4 and cfg.run.resume == "auto" and cfg.reward.options == {"quality": 50}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads_and_round_trips(path, tmp_path):
    try:
        cfg = load_config(path)
    except ConfigError as err:  # the diffusers configs name a model directory (and prompt files) not on this machine
        assert "config key 'model.pretrained'" in str(err) or "config key 'data.prompt_file'" in str(err), err
        shipped = yaml.safe_load(path.read_text())
        assert shipped["model"]["kind"] in families()
        # a config that guides a second expert names a two-expert pipeline (Wan2.2 A14B): its stand-in is one
        cfg = load_config(path, stand_in_paths(tmp_path, experts="guidance_2" in shipped["sampling"]))
    data = cfg.to_dict()
    assert yaml.safe_load(yaml.safe_dump(data, sort_keys=False)) == data  # config.yaml holds plain types
    assert config_from_dict(data) == cfg
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(data))).to_dict() == data  # what resume compares
    validate(cfg)


def test_to_dict_is_plain_lists_and_dicts():
    data = load_config(TINY, ["train.adam_betas=[0.8, 0.99]", "grpo.sde_window=2",
                              "grpo.sde_window_range=[1, 9]"]).to_dict()
    assert data["train"]["adam_betas"] == [0.8, 0.99] and data["grpo"]["sde_window_range"] == [1, 9]
    assert type(data["model"]["dit"]) is dict and type(data["model"]["lora"]["targets"]) is list


def test_defaults_round_trip():
    cfg = config_from_dict({"data": {"prompts": ["a cat"]}})
    assert config_from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["train"]["adam_betas"] == [0.9, 0.999]


# ---------------------------------------------------------------------------------------------------------------
# issue 16: values in range, and every bad input an early error naming its key (jagg-train exits 2)
# ---------------------------------------------------------------------------------------------------------------

def _exit_code(tmp_path, *overrides, config=TINY) -> int:
    from jagg_scale.cli import train_main

    code = train_main([str(config), *overrides, f"run.output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()  # stopped before any work
    return code


@pytest.mark.parametrize("override,message", [
    ("train.lr=1e30", "config key 'train.lr' must be in (0, 1], got 1e+30"),
    ("train.lr=2", "config key 'train.lr' must be in (0, 1], got 2.0"),
    ("sampling.noise_level=1e30", "config key 'sampling.noise_level' must be in (0, 10]"),
    ("sampling.guidance=1e30", "config key 'sampling.guidance' must be in [1, 100]"),
    ("train.weight_decay=1000", "config key 'train.weight_decay' times train.lr must be < 1"),
    ("train.max_nonfinite_steps=0", "config key 'train.max_nonfinite_steps' must be >= 1, got 0"),
    ("train.lr=.inf", "config key 'train.lr' must be a finite number, got inf"),
    ("sampling.noise_level=.inf", "config key 'sampling.noise_level' must be a finite number, got inf"),
    ("reward.components={jpeg_compressibility: {weight: .nan}}",
     "config key 'reward.components.jpeg_compressibility.weight' must be a finite number, got nan"),
])
def test_out_of_range_and_non_finite_values_are_named_and_exit_2(tmp_path, override, message):
    assert _err(override).startswith(message)
    assert _exit_code(tmp_path, override) == 2


def test_a_run_stops_after_max_nonfinite_steps_by_default():
    assert Config().train.max_nonfinite_steps == 10
    assert load_config(TINY, ["train.max_nonfinite_steps=3"]).train.max_nonfinite_steps == 3


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 2\n  lr: [1e-4\nsampling: {}\n")
    with pytest.raises(ConfigError, match=rf"config file {bad} is not valid YAML at line 4, column 9"):
        load_config(bad)
    assert _exit_code(tmp_path, config=bad) == 2
    assert _err("train.lr=[1e-4").startswith("the value of override 'train.lr=[1e-4' is not valid YAML at line 1")
    assert _exit_code(tmp_path, "train.lr=[1e-4") == 2


@pytest.mark.parametrize("override,message", [
    ("reward.options={qualty: 3}",
     "config key 'reward.options': reward 'jpeg_compressibility' got unknown option(s) ['qualty']"),
    ("reward.name=jpeg_compresibility", "config key 'reward.name': unknown reward 'jpeg_compresibility'"),
    ("reward.name=remote", "config key 'reward.options': reward 'remote' needs option(s) ['reward', 'url']"),
    ("reward.components={jpeg_compressibility: {weight: 2, qualty: 3}}",
     "config key 'reward.components.jpeg_compressibility': reward 'jpeg_compressibility' got unknown option(s)"),
    ("reward.components={jpeg_compressibility: null, nope: {weight: 1}}",
     "config key 'reward.components.nope': unknown reward 'nope'"),
])
def test_reward_names_and_options_are_checked_with_the_config(tmp_path, override, message):
    assert _err(override).startswith(message)
    assert _exit_code(tmp_path, override) == 2


@pytest.mark.parametrize("key", ["data.prompt_file", "eval.prompt_file"])
def test_a_csv_or_blank_prompt_file_is_named(tmp_path, key):
    section = key.split(".")[0]
    extra = ["eval.enabled=true"] * (section == "eval") + [f"{section}.prompts=null"]  # the file is the one source
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt,category\na cat,animals\n")
    assert _err(f"{key}={csv}", *extra).startswith(f"config key '{key}' has the unsupported extension '.csv'")
    assert _exit_code(tmp_path, f"{key}={csv}", *extra) == 2
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\t\n")
    assert _err(f"{key}={blank}", *extra) == (f"config key '{key}' names a file with no prompt in it (empty or only "
                                              f"blank lines): {blank}")
    assert _exit_code(tmp_path, f"{key}={blank}", *extra) == 2


def test_pretrained_that_is_not_safetensors_is_named(tmp_path):
    from jagg_scale.models import build_model

    text = tmp_path / "weights.safetensors"
    text.write_text("these are not weights\n" * 100)
    msg = _err(f"model.pretrained={text}")
    assert msg.startswith("config key 'model.pretrained' is not a safetensors file") and str(text) in msg
    assert _exit_code(tmp_path, f"model.pretrained={text}") == 2
    cfg = load_config(TINY)
    cfg.model.pretrained = str(text)  # past the config: the loader names the file too (not "header too large")
    with pytest.raises(ValueError, match=r"model\.pretrained .*is not a safetensors file.*weights\.safetensors"):
        build_model(cfg.model)


def test_cuda_without_a_gpu_is_a_config_error(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _err("run.device=cuda").startswith("config key 'run.device' is cuda, but torch sees no CUDA device")
    assert _exit_code(tmp_path, "run.device=cuda") == 2
    load_config(TINY, ["run.device=auto"])


def test_a_jagg_window_longer_than_the_trained_steps_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="jagg_scale.train.config"):
        load_config(TINY, ["sampling.num_steps=10", "jagg.window=10"])
        assert not caplog.records
        load_config(TINY, ["sampling.num_steps=10", "grpo.timestep_fraction=0.5", "jagg.window=6"])
    assert [r.getMessage() for r in caplog.records] == [
        "config key 'jagg.window' is 6, more than the 5 steps trained per training step (sampling.num_steps, "
        "grpo.timestep_fraction, grpo.sde_window): one window of all 5 is used"]


@pytest.mark.parametrize("overrides,message", [
    (["model.max_sequence_length=128"], "is the prompt length of a diffusers pipeline"),
    (["model.kind=sd3", "model.pretrained=x", "model.max_sequence_length=0"], "must be in [1, 512] prompt tokens"),
    (["model.kind=flux", "model.pretrained=x", "model.max_sequence_length=513"], "must be in [1, 512] prompt tokens"),
    (["model.kind=qwenimage", "model.pretrained=x", "model.max_sequence_length=1025"],
     "must be in [1, 1024] prompt tokens for model.kind qwenimage"),
])
def test_the_t5_length_is_refused_where_it_cannot_act(overrides, message):
    err = _err(*overrides)
    assert err.startswith("config key 'model.max_sequence_length' ") and message in err


@pytest.mark.parametrize("overrides,key,message", [
    (["model.kind=sd3", "model.pretrained=x", "model.distilled_guidance=3.5"], "model.distilled_guidance",
     "is for the guidance-distilled FLUX kinds, not sd3"),
    (["model.kind=zimage", "model.pretrained=x", "model.distilled_guidance=3.5"], "model.distilled_guidance",
     "not zimage"),
])
def test_guidance_keys_are_refused_where_they_cannot_act(overrides, key, message):
    err = _err(*overrides)
    assert err.startswith(f"config key '{key}' ") and message in err


@pytest.mark.parametrize("installed,ok", [("0.19.8", True), ("0.19.11", True), ("0.18.2", False), ("0.20.0", False),
                                          (None, False)])
def test_deepspeed_outside_the_tested_releases_is_refused_naming_the_version(monkeypatch, installed, ok):
    """parallel.engine deepspeed calls ZeRO-3 internals verified on 0.19.8: another release (or none) is refused
    when the run starts, naming the key and the version found, before any model is built."""
    import importlib.metadata as md

    real = md.version

    def version(name):
        if name != "deepspeed":
            return real(name)
        if installed is None:
            raise md.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(md, "version", version)
    if ok:
        assert load_config(TINY, ["parallel.engine=deepspeed"]).parallel.engine == "deepspeed"
    else:
        with pytest.raises(ConfigError, match="config key 'parallel.engine' is deepspeed, but DeepSpeed "
                                              + (f"{installed} is installed" if installed else "is not installed")):
            load_config(TINY, ["parallel.engine=deepspeed"])
