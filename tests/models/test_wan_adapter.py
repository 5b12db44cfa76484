"""Wan2.1 text-to-video (models/wan.py) on a tiny random offline WanPipeline (jagg_scale/models/tiny.py --kind wan).

The algorithm on 5-D latents [N, C, F, H, W]: the adapter against the pipeline's own sampling loop (its scheduler's
sigmas, timestep 1000 sigma, its CFG), decoding to frames, the GRPO log-prob round trip, JAGG W = 2 == per-step on the
transformer, and jagg-train end to end (LoRA; JAGG and exact) with a per-frame reward, an eval that writes a frame
grid and GIFs, and an exported LoRA that loads into a plain WanPipeline to the trained outputs.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from adapter_checks import (PROMPTS, check_jagg_w2_equals_per_step, check_only_the_transformer_trains,
                            check_rollout_logprobs_recomputed, check_trains_and_the_lora_loads)
from jagg_scale.grpo import sample_ode
from jagg_scale.grpo.rollout import guided_velocity
from jagg_scale.models.wan import WanVelocity

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "wan_tiny_cpu.yaml"


@pytest.fixture(scope="module")
def model(wan_dir):
    torch.manual_seed(0)
    return WanVelocity.from_pretrained(wan_dir, dtype=torch.float32, max_sequence_length=32, resolution=16,
                                       num_frames=5)


def test_video_shapes_decoding_and_frozen_parts(model):
    assert model.latent_shape == (4, 3, 8, 8) and model.image_size == 16  # 5 frames -> 3 latent frames
    cond = model.encode_prompts(PROMPTS)
    assert cond.shape == (2, 32, 32) and not cond.requires_grad
    x = torch.randn(3, *model.latent_shape)
    v = model(x, torch.tensor([1.0, 0.5, 0.1]), model.encode_prompts(PROMPTS + [""]))
    assert v.shape == x.shape and v.abs().sum() > 0
    video = model.decode(x)
    assert video.shape == (3, 3, 5, 16, 16) and 0 <= video.min() <= video.max() <= 1
    check_only_the_transformer_trains(model, {"vae", "text_encoder"})


def test_bad_frame_counts_and_sizes_are_refused(wan_dir):
    with pytest.raises(ValueError, match="num_frames 4 must be 1 \\+ a multiple of the VAE's temporal factor 2"):
        WanVelocity.from_pretrained(wan_dir, resolution=16, num_frames=4)
    with pytest.raises(ValueError, match="model.resolution 18 must be a multiple of 4"):
        WanVelocity.from_pretrained(wan_dir, resolution=18, num_frames=5)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_adapter_ode_equals_the_pipeline_sampling_loop(model, guidance):
    """WanPipeline's loop (its scheduler's sigmas and steps, timestep = 1000 sigma, CFG with the empty negative
    prompt) and ours land on the same video latents."""
    cond, uncond = model.encode_prompts(PROMPTS), model.encode_prompts([""] * 2)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    out = model.pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, guidance_scale=guidance,
                     num_inference_steps=4, height=16, width=16, num_frames=5, latents=noise.clone(),
                     output_type="latent").frames
    assert torch.allclose(model.pipe.scheduler.sigmas.float(), model.pipeline_sigmas(4), atol=1e-6)
    fn = lambda x, s, c: guided_velocity(model, x, s, c, guidance, model.guidance_rule)
    ours = sample_ode(fn, cond if guidance == 1.0 else (cond, uncond), noise, model.pipeline_sigmas(4))
    assert torch.allclose(out, ours, atol=1e-5)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_rollout_logprobs_recomputed_in_training(model, guidance):
    check_rollout_logprobs_recomputed(model, model.pipeline_sigmas(4), guidance)


def test_jagg_w2_equals_per_step_on_5d_latents(wan_dir):
    m = WanVelocity.from_pretrained(wan_dir, max_sequence_length=32, resolution=16, num_frames=5).double()
    check_jagg_w2_equals_per_step(m, m.pipeline_sigmas(4).double()[1:3], 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jagg", "exact"])
def test_jagg_train_two_steps_and_the_lora_loads_into_a_plain_pipeline(wan_dir, tmp_path, mode):
    from diffusers import WanPipeline

    def load_plain(lora_dir):
        fresh = WanPipeline.from_pretrained(wan_dir, local_files_only=True)
        fresh.load_lora_weights(str(lora_dir))
        return WanVelocity(fresh, max_sequence_length=32, latent_size=8, num_frames=5)

    check_trains_and_the_lora_loads(CONFIG, [f"model.pretrained={wan_dir}", "eval.enabled=false"], tmp_path / "run",
                                    mode, load_plain)


@pytest.mark.slow
def test_the_eval_of_a_video_model_writes_a_frame_grid_and_gifs(wan_dir, tmp_path, monkeypatch):
    """The shipped tiny config's evaluation: per-frame rewards, the grid with every frame of each video (5 frames x
    2 videos a row), one looping GIF a prompt, named in eval.json, and sent to wandb as wandb.Video."""
    from PIL import Image

    from jagg_scale.train import Trainer, load_config
    from jagg_scale.train.grid import LABEL_WIDTH, PAD

    cfg = load_config(CONFIG, [f"model.pretrained={wan_dir}", "train.steps=1", "log.progress=false",
                               f"run.output_dir={tmp_path / 'run'}"])
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        out = trainer.eval_dir(1)
    finally:
        trainer.close()
    result = json.loads((out / "eval.json").read_text())
    assert result["num_images"] == 4 and result["grid"]["videos"] == ["video_000.gif", "video_001.gif"]
    assert result["diversity"] is not None and len(result["per_prompt"]) == 2
    grid = Image.open(out / "grid.png")
    assert grid.size == (LABEL_WIDTH + 10 * (64 + PAD) + PAD, 2 * (64 + PAD) + PAD)
    gif = Image.open(out / "video_001.gif")
    assert gif.n_frames == 5 and gif.size == (64, 64) and gif.info["loop"] == 0

    import sys
    import types

    from jagg_scale.train.logging import RunLogger

    sent = {}
    video = lambda path, caption=None, format=None: ("video", path, caption, format)  # noqa: E731
    run = types.SimpleNamespace(log=lambda data, step=None: sent.update(data), finish=lambda: None)
    fake = types.SimpleNamespace(Image=lambda data, caption=None: ("image", caption), Video=video,
                                 init=lambda **kw: run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = RunLogger(tmp_path / "log", total_steps=1, start_step=0, progress=False,
                       wandb_cfg={"project": "p", "mode": "offline"}, config={})
    logger.log_eval(1, result, out)
    logger.close()
    assert [v[1] for v in sent["eval/videos"]] == [str(out / "video_000.gif"), str(out / "video_001.gif")]
    assert all(v[3] == "gif" and v[2].startswith(p["prompt"]) for v, p in zip(sent["eval/videos"],
                                                                              result["per_prompt"]))


@pytest.mark.parametrize("override, message", [
    # the tiny pipeline's factors (its VAE's temporal 2, spatial x patch 4 x 2): read from its configs
    ("model.num_frames=4", "config key 'model.num_frames' 4 must be 1 + a multiple of the VAE's temporal factor 2"),
    ("model.resolution=17", "config key 'model.resolution' 17 must be a multiple of"),
])
def test_wans_shape_rules_are_config_errors_before_anything_loads(wan_dir, tmp_path, override, message, capsys):
    """Issue 41: they were checked after the pipeline loaded (a traceback, exit 1); now the config check reads the
    pipeline's VAE and transformer configs: one line, exit 2, no weights read (jagg-train's entry point, in this
    process)."""
    from jagg_scale.cli import train_main
    from jagg_scale.train import ConfigError, load_config

    args = [f"model.pretrained={wan_dir}", override, f"run.output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(ROOT / "configs" / "wan_tiny_cpu.yaml"), args)
    assert train_main([str(ROOT / "configs" / "wan_tiny_cpu.yaml"), *args]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith("jagg-train") and message in said[0], said
