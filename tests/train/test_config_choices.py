"""A choice owns its keys (issue 35 item 2): `key=null` unsets a key, `section=null` resets a section, and a key
that the choice made elsewhere leaves without effect is refused naming it. Config loading only, no training."""

import re
from pathlib import Path

import pytest

from jagg_scale.train.config import RENAMED, ConfigError, load_config

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


def _refused(*overrides, path=TINY):
    with pytest.raises(ConfigError) as info:
        _load(*overrides, path=path)
    return str(info.value)


@pytest.mark.parametrize("key", ["jagg.window", "jagg.planner", "jagg.speedup", "jagg.share_knots", "jagg.jagg_frac"])
def test_jagg_mode_exact_refuses_the_planner_keys(key):
    value = {"jagg.planner": "budget", "jagg.speedup": "2", "jagg.share_knots": "true", "jagg.jagg_frac": "0.5"}
    msg = _refused("jagg.mode=exact", f"{key}={value.get(key, '3')}")
    assert msg.startswith(f"config key '{key}' is set, but jagg.mode is exact") and msg.endswith(f"({key}=null)")


def test_jagg_intermediate_with_exact_is_refused():
    msg = _refused("jagg.mode=exact", "jagg.intermediate=forward")
    assert msg.startswith("config key 'jagg.intermediate' is set, but jagg.mode is exact") and "interpolated" in msg
    assert _load("jagg.mode=exact", "jagg.intermediate=null").jagg.intermediate == "auto"


def test_a_prompt_file_with_inline_prompts_is_refused(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    for section in ("data", "eval"):  # eval's two prompt sources are the same choice
        msg = _refused(f"{section}.prompt_file={prompts}", f"{section}.prompts=[a dog]")
        assert msg.startswith(f"config key '{section}.prompts' is set, but {section}.prompt_file is set too")
    assert _load(f"data.prompt_file={prompts}", "data.prompts=null").data.prompts == []


@pytest.mark.parametrize("key,value", [("prompts", "[a dog]"), ("prompt_file", "p.txt")])
def test_source_wds_refuses_the_prompt_list_keys(key, value):
    msg = _refused("data.source=wds", "data.shards=s-{0..1}.tar", "data.prompts=null", f"data.{key}={value}")
    assert msg.startswith(f"config key 'data.{key}' is set, but data.source is wds")


@pytest.mark.parametrize("key,value", [("shards", "s-{0..1}.tar"), ("num_workers", "2"), ("allow_pipe", "true")])
def test_source_list_refuses_the_shard_keys(key, value):
    msg = _refused(f"data.{key}={value}")
    assert msg.startswith(f"config key 'data.{key}' is set, but data.source is list")


@pytest.mark.parametrize("key,value", [("options", "{bogus: 1}"), ("name", "aesthetic")])
def test_reward_components_refuse_the_single_reward_keys(key, value):
    msg = _refused("reward.components={jpeg_compressibility: {weight: 1}}", f"reward.{key}={value}")
    assert msg.startswith(f"config key 'reward.{key}' is set, but reward.components names the rewards")


def test_aggregate_advantage_needs_two_components():
    one = "reward.components={jpeg_compressibility: {weight: 1}}"
    for overrides in ([one], []):  # one component, or the single reward.name
        msg = _refused(*overrides, "reward.aggregate=advantage")
        assert msg.startswith("config key 'reward.aggregate' is advantage") and "two or more" in msg
    two = "reward.components={jpeg_compressibility: {weight: 1}, jpeg_incompressibility: {weight: 1}}"
    assert _load(two, "reward.aggregate=advantage").reward.aggregate == "advantage"


def test_a_reward_deadline_without_the_background_scorer_is_refused():
    msg = _refused("reward.background=false", "reward.deadline_s=60")
    assert msg.startswith("config key 'reward.deadline_s' is set, but reward.background is false")
    # sharded scoring on several ranks runs inline too: refused once the world size is known
    from jagg_scale.train.config import validate_world

    cfg = _load("reward.shard=true", "reward.deadline_s=60", "parallel.engine=fsdp2", "jagg.probe_every=0")
    validate_world(cfg, 1)
    with pytest.raises(ConfigError, match="'reward.deadline_s' is set, but reward.shard on 2 ranks"):
        validate_world(cfg, 2)


@pytest.mark.parametrize("key,value", [("sde_window_range", "[1, 5]"), ("sde_window_mode", "sliding"),
                                       ("sde_window_every", "2")])
def test_sde_window_keys_need_a_window(key, value):
    msg = _refused(f"grpo.{key}={value}")
    assert msg.startswith(f"config key 'grpo.{key}' is set, but grpo.sde_window is 0")
    assert _load("grpo.sde_window=2", f"grpo.{key}={value}").grpo.sde_window == 2


@pytest.mark.parametrize("key,value", [("sde_window_range", "[1, 5]"), ("sde_window_mode", "sliding"),
                                       ("sde_window_every", "2")])
def test_sde_window_keys_under_nft_are_refused(key, value):
    msg = _refused("train.algorithm=nft", "grpo.kl_beta=null", f"grpo.{key}={value}")
    assert re.match(rf"config key 'grpo.{key}' belongs to train.algorithm grpo(, \w+)*; this run is nft", msg)
    assert "gcpo" not in msg.split(";")[0]  # GCPO does not read the SDE window's keys


def test_every_shipped_config_sets_no_idle_key():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert _load(path=path).train.steps >= 1  # loads: none of the refusals above fires on a shipped config


@pytest.mark.parametrize("key,value", [("nft.mix", "0.5"), ("nft.kl_beta", "0"), ("nft.noise", "per_sample")])
def test_an_nft_key_on_a_grpo_run_is_refused(key, value):
    assert _refused(f"{key}={value}") == (f"config key '{key}' belongs to train.algorithm nft; this run is grpo: "
                                          f"unset it ({key}=null)")


@pytest.mark.parametrize("key,value", [("grpo.clip_range", "0.2"), ("grpo.kl_beta", "0.01"), ("grpo.ref_at", "knots"),
                                       ("grpo.onpolicy_tolerance", "0.1")])
def test_a_grpo_only_key_on_an_nft_run_is_refused(key, value):
    msg = _refused("train.algorithm=nft", f"{key}={value}")
    assert re.match(rf"config key '{key}' belongs to train.algorithm grpo(, \w+)*; this run is nft", msg)
    assert ("gcpo" in msg.split(";")[0]) == (key in ("grpo.clip_range", "grpo.onpolicy_tolerance"))  # what GCPO reads
    assert msg.endswith(f"unset it ({key}=null)")


def test_nft_reads_the_shared_grpo_keys():
    shared = ["grpo.group_size=8", "grpo.adv_clip_max=3", "grpo.global_std=true", "grpo.timestep_fraction=0.8",
              "grpo.inner_epochs=2"]  # the group advantages and the trained steps: both algorithms read them
    cfg = _load("train.algorithm=nft", "train.minibatch_size=32", *shared)
    assert cfg.grpo.group_size == 8 and cfg.grpo.inner_epochs == 2


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_a_renamed_key_names_its_new_name(old, new):
    assert _refused(f"{old}=1") == f"config key '{old}' is now '{new}' (same values): rename it"
    assert load_config(TINY, [f"{new}=null"], check_files=False).is_set(new) is False  # the new name is live


def test_a_remote_rewards_retries_beyond_the_reward_deadline_are_refused_naming_both_keys():
    """A `remote` reward's worst case (every attempt timing out, the longest backoffs) ends inside reward.deadline_s:
    sd35m_geneval's 300 s x 4 attempts (+ 7 s of backoff) overran the 900 s deadline it runs under."""
    remote = ["reward.name=remote", "reward.options.url=http://127.0.0.1:9", "reward.options.reward=geneval"]
    msg = _refused(*remote, "reward.options.timeout_s=300", "parallel.collective_timeout_s=1800")
    assert msg.startswith("config key 'reward.options' remote: timeout_s 300 x 4 attempts + up to 7 s of backoff = "
                          "1207 s, beyond reward.deadline_s = 900 s"), msg
    _load(*remote, "reward.options.timeout_s=300", "reward.deadline_s=1300", "parallel.collective_timeout_s=1800")
    _load(*remote, "reward.options.timeout_s=200", "parallel.collective_timeout_s=1800")  # 807 s
    # the defaults (60 s x 4 + 7 s) inside the tiny config's own deadline; a judge's long backoff is counted too
    _load(*remote)
    assert "+ up to 60 s of backoff" in _refused(*remote, "reward.options.backoff_s=20", "reward.options.retries=2",
                                                  "reward.deadline_s=200")
