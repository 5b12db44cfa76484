"""FLUX.1-Kontext instruction editing (models/kontext.py) on a tiny random offline FluxKontextPipeline
(tools/make_tiny_pipeline.py --kind flux_kontext) and the committed edit set data/edits/tiny/edits.jsonl.

Checks the input image's latents against the pipeline's own preprocessing and VAE encoding, the velocity and sampling
against the pipeline's loop (its image tokens, ids and output slice), that the input image conditions the velocity,
the GRPO log-prob round trip, JAGG W = 2 == per-step, jagg-train with LoRA whose export loads into a plain
FluxKontextPipeline, and the clear error for a prompt without an image.
"""

from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from adapter_checks import (check_jagg_w2_equals_per_step, check_only_the_transformer_trains,
                            check_rollout_logprobs_recomputed, check_trains_and_the_lora_loads)
from jagg_scale.data import EditPrompt, load_prompts
from jagg_scale.grpo import sample_ode
from jagg_scale.models.kontext import FluxKontextVelocity

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "data" / "edits" / "tiny" / "edits.jsonl"


@pytest.fixture(scope="module")
def model(flux_kontext_dir):
    torch.manual_seed(0)
    return FluxKontextVelocity.from_pretrained(flux_kontext_dir, dtype=torch.float32, resolution=16)


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(EDITS).prompts[:2]


def test_edit_records_carry_their_images_and_the_latents_are_the_pipelines(model, prompts):
    from PIL import Image

    assert all(isinstance(p, EditPrompt) and Path(p.image).is_file() for p in prompts)
    assert str(prompts[0]) == "make the square blue" and model.guidance_scale == 2.5  # FluxKontextPipeline's default
    embeds, pooled, image = model.encode_prompts(prompts)
    assert embeds.shape[0] == pooled.shape[0] == 2 and image.shape == (2, *model.latent_shape)
    # a 32 px input is resized to the model's 16 px, then encoded as FluxKontextPipeline._encode_vae_image does
    pil = Image.open(prompts[0].image).convert("RGB").resize((16, 16), Image.LANCZOS)
    pixels = model.pipe.image_processor.preprocess(pil, 16, 16)
    assert torch.allclose(image[:1], model.pipe._encode_vae_image(pixels, generator=None), atol=1e-5)
    check_only_the_transformer_trains(model, {"vae", "text_encoder", "text_encoder_2"})


def test_adapter_ode_equals_the_pipeline_sampling_loop(model, prompts):
    """The pipeline's loop, given the same image latents (its [noise | image] tokens, image ids with axis 0 = 1, the
    output's noise slice, its distilled guidance and schedule) and ours land on the same latents."""
    cond = model.encode_prompts(prompts)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    out = model.pipe(image=cond[2], prompt_embeds=cond[0], pooled_prompt_embeds=cond[1],
                     guidance_scale=model.guidance_scale, num_inference_steps=4, height=16, width=16, max_area=256,
                     latents=model.pack(noise.clone()), output_type="latent").images
    assert torch.allclose(model.pipe.scheduler.sigmas.float(), model.pipeline_sigmas(4), atol=1e-6)
    ours = sample_ode(model, cond, noise, model.pipeline_sigmas(4))
    assert torch.allclose(model.unpack(out, 8, 8), ours, atol=1e-5)


def test_the_input_image_conditions_the_velocity(model, prompts):
    x, sigma = torch.randn(1, *model.latent_shape), torch.tensor([0.6])
    same_text = [EditPrompt(str(prompts[0]), prompts[0].image), EditPrompt(str(prompts[0]), prompts[1].image)]
    assert same_text[0] != same_text[1] and len({*same_text}) == 2  # one instruction, two images: two prompts
    e, p, im = model.encode_prompts(same_text)
    with torch.no_grad():
        a, b = (model(x, sigma, (e[i:i + 1], p[i:i + 1], im[i:i + 1])) for i in (0, 1))
    assert not torch.allclose(a, b, atol=1e-4)


def test_a_prompt_without_an_image_is_refused_by_name(model):
    with pytest.raises(ValueError, match="needs an input image per prompt.*'a cat'"):
        model.encode_prompts(["a cat"])


def test_rollout_logprobs_recomputed_in_training(model, prompts):
    check_rollout_logprobs_recomputed(model, model.pipeline_sigmas(4), 1.0, prompts)


def test_jagg_w2_equals_per_step_on_the_transformer(flux_kontext_dir, prompts):
    m = FluxKontextVelocity.from_pretrained(flux_kontext_dir, dtype=torch.float32, resolution=16).double()
    check_jagg_w2_equals_per_step(m, m.pipeline_sigmas(4).double()[1:3], 1.0, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jagg", "exact"])
def test_jagg_train_two_steps_and_the_lora_loads_into_a_plain_pipeline(flux_kontext_dir, prompts, tmp_path, mode):
    from diffusers import FluxKontextPipeline

    def load_plain(lora_dir):
        fresh = FluxKontextPipeline.from_pretrained(flux_kontext_dir, local_files_only=True)
        fresh.load_lora_weights(str(lora_dir))
        return FluxKontextVelocity(fresh, max_sequence_length=32, guidance_scale=2.5, latent_size=8)

    check_trains_and_the_lora_loads(ROOT / "configs" / "flux_kontext_tiny_cpu.yaml",
                                    [f"model.pretrained={flux_kontext_dir}"], tmp_path / "run", mode, load_plain,
                                    prompts)
