"""The diffusers Qwen-Image adapter (models/qwenimage.py) on a tiny random offline pipeline
(tools/make_tiny_pipeline.py --kind qwenimage).

Checks the interface (unpacked shapes, packing round trip, frozen parts), that padding every prompt to
max_sequence_length leaves the velocity the pipeline's, the sigma and sign conventions against the pipeline's own
sampling loop (and its true CFG), the GRPO log-prob round trip, JAGG W = 2 == per-step on the transformer, two
jagg-train steps (LoRA; JAGG and exact; true CFG), and that the exported LoRA loads into a plain QwenImagePipeline
to the same outputs.
"""

from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from adapter_checks import (PROMPTS, check_jagg_w2_equals_per_step, check_only_the_transformer_trains,
                            check_rollout_logprobs_recomputed, check_trains_and_the_lora_loads)
from jagg_scale.grpo import sample_ode
from jagg_scale.models.qwenimage import QwenImageVelocity

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(qwenimage_dir):
    torch.manual_seed(0)
    return QwenImageVelocity.from_pretrained(qwenimage_dir, dtype=torch.float32, max_sequence_length=48,
                                             resolution=16)


def test_shapes_packing_padding_and_frozen_parts(model):
    assert model.latent_shape == (4, 8, 8) and model.image_size == 16
    embeds, mask = model.encode_prompts(PROMPTS)
    assert embeds.shape == (2, 48, 32) and mask.shape == (2, 48) and mask.dtype == torch.int64
    lengths = mask.sum(1).tolist()
    assert 0 < lengths[0] < lengths[1] < 48  # "two dogs on a photo" is longer; both padded to 48
    assert not embeds.requires_grad and (embeds[0, lengths[0]:] == 0).all()
    x = torch.randn(3, *model.latent_shape)
    tokens = model.pack(x)
    assert tokens.shape == (3, 16, 16) and torch.equal(model.unpack(tokens, 8, 8), x)
    img = model.decode(x)
    assert img.shape == (3, 3, 16, 16) and img.dtype == torch.float32 and 0 <= img.min() <= img.max() <= 1
    check_only_the_transformer_trains(model, {"vae", "text_encoder"})


def test_padding_to_a_fixed_length_keeps_the_pipelines_velocity(model):
    """The pipeline pads a batch to its longest prompt; the adapter to max_sequence_length: same velocity."""
    embeds, mask = model.pipe.encode_prompt(prompt=PROMPTS, device="cpu", max_sequence_length=48)
    assert embeds.shape[1] < 48
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        ours = model(x, sigma, model.encode_prompts(PROMPTS))
        tokens = model.transformer(hidden_states=model.pack(x), timestep=sigma, encoder_hidden_states=embeds,
                                   encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]
        theirs = model.unpack(tokens, 8, 8)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_adapter_ode_equals_the_pipeline_sampling_loop(model):
    """The pipeline's own loop (no CFG, its dynamic-shift schedule, its Euler steps on packed latents) and ours."""
    embeds, mask = model.encode_prompts(PROMPTS)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    out = model.pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, true_cfg_scale=1.0, num_inference_steps=4,
                     height=model.image_size, width=model.image_size, latents=model.pack(noise.clone()),
                     output_type="latent").images
    assert torch.allclose(model.pipe.scheduler.sigmas.float(), model.pipeline_sigmas(4), atol=1e-6)
    ours = sample_ode(model, (embeds, mask), noise, model.pipeline_sigmas(4))
    assert torch.allclose(model.unpack(out, 8, 8), ours, atol=1e-5)


def test_true_cfg_equals_the_pipelines(model):
    """guidance 4 with the family's rule (the guided prediction rescaled per token to the conditional one's norm)
    and negative prompt " ": the pipeline's own true-CFG loop and ours land on the same latents."""
    from jagg_scale.grpo.rollout import guided_velocity

    cond, uncond = model.encode_prompts(PROMPTS), model.encode_prompts([model.negative_prompt] * 2)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    out = model.pipe(prompt_embeds=cond[0], prompt_embeds_mask=cond[1], negative_prompt_embeds=uncond[0],
                     negative_prompt_embeds_mask=uncond[1], true_cfg_scale=4.0, num_inference_steps=4,
                     height=model.image_size, width=model.image_size, latents=model.pack(noise.clone()),
                     output_type="latent").images
    guided = lambda x, s, c: guided_velocity(model, x, s, c, 4.0, model.guidance_rule)
    ours = sample_ode(guided, (cond, uncond), noise, model.pipeline_sigmas(4))
    assert torch.allclose(model.unpack(out, 8, 8), ours, atol=1e-5)
    plain = sample_ode(lambda x, s, c: guided_velocity(model, x, s, c, 4.0), (cond, uncond), noise,
                       model.pipeline_sigmas(4))
    assert not torch.allclose(plain, ours, atol=1e-3)  # the rule matters: plain CFG samples elsewhere


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_rollout_logprobs_recomputed_in_training(model, guidance):
    check_rollout_logprobs_recomputed(model, model.pipeline_sigmas(4), guidance)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_jagg_w2_equals_per_step_on_the_transformer(qwenimage_dir, guidance):
    m = QwenImageVelocity.from_pretrained(qwenimage_dir, dtype=torch.float32, max_sequence_length=48,
                                          resolution=16).double()
    check_jagg_w2_equals_per_step(m, m.pipeline_sigmas(4).double()[1:3], guidance)


@pytest.mark.slow
@pytest.mark.parametrize("mode, guidance", [("jagg", 1.0), ("exact", 1.0), ("jagg", 3.0)])
def test_jagg_train_two_steps_and_the_lora_loads_into_a_plain_pipeline(qwenimage_dir, tmp_path, mode, guidance):
    from diffusers import QwenImagePipeline

    def load_plain(lora_dir):
        fresh = QwenImagePipeline.from_pretrained(qwenimage_dir, local_files_only=True)
        fresh.load_lora_weights(str(lora_dir))
        return QwenImageVelocity(fresh, max_sequence_length=64, latent_size=8)

    check_trains_and_the_lora_loads(ROOT / "configs" / "qwenimage_tiny_cpu.yaml",
                                    [f"model.pretrained={qwenimage_dir}", "model.resolution=16",
                                     f"sampling.guidance={guidance}"], tmp_path / "run", mode, load_plain)


@pytest.mark.slow
def test_a_resumed_run_continues_exactly(qwenimage_dir, tmp_path):
    """Two steps, a checkpoint, then a resumed third step: the metrics of an uninterrupted 3-step run, bit for bit
    (the rollout's noise, the prompts, the adapter and its optimizer state all come back)."""
    from train_runs import fit_metrics

    def fit(out, *extra):
        return fit_metrics(ROOT / "configs" / "qwenimage_tiny_cpu.yaml",
                           [f"model.pretrained={qwenimage_dir}", "model.resolution=16", "run.checkpoint_every=1",
                            *extra], out)

    whole = fit(tmp_path / "whole", "train.steps=3")
    fit(tmp_path / "split", "train.steps=2")
    resumed = fit(tmp_path / "split", "train.steps=3", "run.resume=auto")
    assert len(whole) == 3 and resumed == whole
