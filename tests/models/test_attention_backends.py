"""model.attention cudnn | flash: diffusers' attention backends that take part in context parallelism without the
native backend's extra attention forward in the backward (models/diffusers_common.py set_attention_backend). They
need CUDA (and flash the flash-attn package), so on this machine: the refusals, one line naming the key, and the
wiring on real tiny transformers (every dispatching processor set; SD3's, which call SDPA themselves, refused)."""

from pathlib import Path

import pytest
import torch

from jagg_scale.models import build_model
from jagg_scale.models.diffusers_common import set_attention_backend
from jagg_scale.train import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")  # the check reads the device's type; nothing is placed on it here


def test_a_backend_is_for_the_diffusers_kinds_and_is_checked_by_key():
    with pytest.raises(ConfigError, match=r"'model.attention' cudnn is for sd3, .* only"):
        load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), ["model.attention=cudnn"])
    with pytest.raises(ConfigError, match=r"model.attention"):
        load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), ["model.attention=triton"])


@pytest.fixture(autouse=True)
def _process_backend():
    """diffusers' set_attention_backend also sets the process's active backend: every later model in this test
    process would dispatch to cuDNN. Put back after each test."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry.get_active_backend()
    yield
    _AttentionBackendRegistry.set_active_backend(active[0] if isinstance(active, tuple) else active)


def test_wans_processors_take_the_backend_and_the_cpu_is_refused(wan_dir):
    cfg = load_config(str(ROOT / "configs" / "wan_tiny_cpu.yaml"), [f"model.pretrained={wan_dir}"])
    transformer = build_model(cfg.model).transformer
    with pytest.raises(ValueError, match=r"'model.attention' cudnn is a CUDA attention kernel; this run is on cpu"):
        set_attention_backend(transformer, "cudnn", torch.device("cpu"))
    n = set_attention_backend(transformer, "cudnn", CUDA)
    backends = [m.processor._attention_backend for m in transformer.modules()
                if hasattr(getattr(m, "processor", None), "_attention_backend")]
    assert n == len(backends) == 2 * len(transformer.blocks)  # self- and cross-attention of every block
    assert {getattr(b, "value", b) for b in backends} == {"_native_cudnn"}
    assert set_attention_backend(transformer, "sdpa", CUDA) == 0  # the adapters' own: nothing to set


def test_flash_without_its_package_and_sd3s_own_processors_are_refused(sd3_dir, wan_dir):
    import importlib.util

    wan = build_model(load_config(str(ROOT / "configs" / "wan_tiny_cpu.yaml"),
                                  [f"model.pretrained={wan_dir}"]).model).transformer
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match=r"'model.attention' flash needs the flash-attn package"):
            set_attention_backend(wan, "flash", CUDA)
    sd3 = build_model(load_config(str(ROOT / "configs" / "sd3_tiny_cpu.yaml"),
                                  [f"model.pretrained={sd3_dir}"]).model).transformer
    with pytest.raises(ValueError, match=r"SD3Transformer2DModel's attention does not go through diffusers' "):
        set_attention_backend(sd3, "cudnn", CUDA)


def test_jagg_train_on_the_cpu_refuses_a_cuda_backend_in_one_line(wan_dir, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([str(Path(sys.executable).parent / "jagg-train"), str(ROOT / "configs" / "wan_tiny_cpu.yaml"),
                        f"model.pretrained={wan_dir}", "model.attention=cudnn", f"run.output_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=600)  # a hang guard only
    assert r.returncode == 2, r.stderr[-2000:]
    assert "'model.attention' cudnn is a CUDA attention kernel" in r.stderr and "Traceback" not in r.stderr
