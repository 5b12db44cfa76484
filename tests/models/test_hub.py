"""`model.pretrained` as a hub id, resolved through the local hub cache with no network (jagg_scale/hub.py,
models.pretrained_path): the tiny SD3 pipeline and a DiT state dict saved into a temporary cache laid out as
huggingface_hub lays it out (tests/hub_cache.py), every socket closed. A missing id names the id, the cache and the
command that fetches it; `model.allow_download: true` fetches it (here: a fake fetch), nothing else does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hub_cache import offline_hub, put_dir_in_hub_cache, put_in_hub_cache
from jagg_scale.hub import HubModelNotFoundError, hub_cache_dir, looks_like_hub_id, resolve_model_path
from jagg_scale.models import DiT, DiTConfig, build_model
from jagg_scale.train import load_config
from jagg_scale.train.config_sections import ConfigError, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
SD3_CONFIG = ROOT / "configs" / "sd3_tiny_cpu.yaml"
SMALL_DIT = DiTConfig(image_size=8, patch_size=4, hidden_size=32, depth=1, num_heads=2, vocab_size=64)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    return offline_hub(monkeypatch, tmp_path / "hf")


def test_hub_ids_and_cache_dir(monkeypatch, tmp_path):
    assert looks_like_hub_id("stabilityai/stable-diffusion-3.5-medium")
    assert looks_like_hub_id("xswu/HPSv2/HPS_v2.1_compressed.pt")
    for local in ("/models/sd3", "./sd3/x", "~/m/x", "sd3", "../a/b", "a/../b", "assets:digits/dit.safetensors"):
        assert not looks_like_hub_id(local), local
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))  # read at each call, not at import
    assert hub_cache_dir() == tmp_path / "cache"


def test_local_path_wins_over_hub_id(hub, tmp_path, monkeypatch):
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name", what="x", markers=("config.json",)) == Path("org/name")


def test_a_missing_relative_path_without_huggingface_hub(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "huggingface_hub", None)  # not installed
    with pytest.raises(HubModelNotFoundError, match=r"model.pretrained: 'weights/run1/dit.safetensors' is not a local "
                                                    r"path.*huggingface_hub.*not installed"):
        resolve_model_path("weights/run1/dit.safetensors", what="model.pretrained")


@pytest.mark.slow
def test_pipeline_hub_id_loads_from_the_cache_offline(sd3_dir, hub):
    snapshot = put_dir_in_hub_cache(hub, "tiny-org/tiny-sd3", sd3_dir)
    assert (snapshot / "transformer" / "config.json").is_symlink()  # the hub library's layout: links to blobs
    cfg = load_config(SD3_CONFIG, ["model.pretrained=tiny-org/tiny-sd3"])  # validation resolves it too
    assert cfg.model.allow_download is False
    model = build_model(cfg.model)
    expect = build_model(ModelConfig(kind="sd3", pretrained=str(sd3_dir)))
    got, want = model.state_dict(), expect.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert model.encode_prompts(["a cat"])[0].shape == expect.encode_prompts(["a cat"])[0].shape


def test_dit_file_in_a_hub_repo(hub, tmp_path):
    torch.manual_seed(0)
    dit = DiT(SMALL_DIT)
    dit.init_weights(zero_out=False)
    from safetensors.torch import save_file

    save_file(dit.state_dict(), tmp_path / "dit.safetensors")
    put_in_hub_cache(hub, "tiny-org/dit", {"weights/dit.safetensors": tmp_path / "dit.safetensors"})
    model = build_model(ModelConfig(kind="dit", pretrained="tiny-org/dit/weights/dit.safetensors", dit=SMALL_DIT))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), dit.state_dict().values()))


def test_missing_hub_id_names_the_id_the_cache_and_the_command(hub):
    cfg = ModelConfig(kind="sd3", pretrained="tiny-org/not-cached")
    with pytest.raises(HubModelNotFoundError) as err:
        build_model(cfg)
    text = str(err.value)
    for needed in ("model.pretrained", "'tiny-org/not-cached'", str(hub), "models--tiny-org--not-cached",
                   "hf download tiny-org/not-cached", "huggingface-cli download tiny-org/not-cached",
                   "model.allow_download: true"):
        assert needed in text, (needed, text)
    with pytest.raises(ConfigError, match=r"config key 'model.pretrained'.*tiny-org/not-cached") as err:
        load_config(SD3_CONFIG, ["model.pretrained=tiny-org/not-cached"])
    assert "hf download tiny-org/not-cached" in str(err.value)
    # a file id: the command fetches that file alone
    with pytest.raises(HubModelNotFoundError, match=r"hf download tiny-org/dit w\.safetensors"):
        build_model(ModelConfig(kind="dit", pretrained="tiny-org/dit/w.safetensors", dit=SMALL_DIT))


@pytest.mark.slow
def test_allow_download_fetches_a_missing_id_once(sd3_dir, hub, monkeypatch):
    from diffusers import DiffusionPipeline

    calls = []

    def fake_download(repo_id, cache_dir=None, **kwargs):  # what DiffusionPipeline.download leaves in the cache
        calls.append((repo_id, cache_dir))
        return str(put_dir_in_hub_cache(Path(cache_dir), repo_id, sd3_dir))

    monkeypatch.setattr(DiffusionPipeline, "download", classmethod(lambda cls, *a, **k: fake_download(*a, **k)))
    with pytest.raises(HubModelNotFoundError):
        build_model(ModelConfig(kind="sd3", pretrained="tiny-org/tiny-sd3"))
    assert calls == []  # allow_download false: never fetched
    cfg = load_config(SD3_CONFIG, ["model.pretrained=tiny-org/tiny-sd3", "model.allow_download=true"])
    assert calls == []  # validation does not download either
    build_model(cfg.model)
    build_model(cfg.model)
    assert calls == [("tiny-org/tiny-sd3", str(hub))]  # cached after the first: not fetched again
