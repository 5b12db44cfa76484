"""FLUX.1-Kontext instruction editing (models/kontext.py) on a tiny random offline FluxKontextPipeline
(jagg_scale/models/tiny.py --kind flux_kontext) and the committed edit set data/edits/tiny/edits.jsonl.

Checks the input image's latents against the pipeline's own preprocessing and VAE encoding, the velocity and sampling
against the pipeline's loop (its image tokens, ids and output slice), that the input image conditions the velocity,
the GRPO log-prob round trip, JAGG W = 2 == per-step, jagg-train with LoRA whose export loads into a plain
FluxKontextPipeline, and the clear error for a prompt without an image.
"""

import json
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
@pytest.mark.parametrize("mode, guidance", [("jagg", 1.0), ("exact", 1.0), ("jagg", 2.0)])
def test_jagg_train_two_steps_and_the_lora_loads_into_a_plain_pipeline(flux_kontext_dir, prompts, tmp_path, mode,
                                                                        guidance):
    from diffusers import FluxKontextPipeline

    def load_plain(lora_dir):
        fresh = FluxKontextPipeline.from_pretrained(flux_kontext_dir, local_files_only=True)
        fresh.load_lora_weights(str(lora_dir))
        return FluxKontextVelocity(fresh, max_sequence_length=32, guidance_scale=2.5, latent_size=8)

    check_trains_and_the_lora_loads(ROOT / "configs" / "flux_kontext_tiny_cpu.yaml",
                                    [f"model.pretrained={flux_kontext_dir}", f"sampling.guidance={guidance}"],
                                    tmp_path / "run", mode, load_plain,
                                    prompts)


@pytest.mark.slow
def test_the_eval_grid_shows_input_before_and_after(flux_kontext_dir, tmp_path):
    """An editing run's evaluations: at step 0 each row is input | the base model's edits; after training, input |
    before (the step-0 images, kept in grid.safetensors) | after. The cells hold those very pixels."""
    import numpy as np
    from PIL import Image

    from jagg_scale.data.images import load_rgb
    from jagg_scale.train import Trainer, load_config
    from jagg_scale.train.evaluate import load_grid
    from jagg_scale.train.grid import LABEL_WIDTH, PAD, to_uint8

    cfg = load_config(ROOT / "configs" / "flux_kontext_tiny_cpu.yaml",
                      [f"model.pretrained={flux_kontext_dir}", "train.steps=1", "eval.enabled=true",
                       "eval.num_per_prompt=2", "eval.grid_images=4", "log.progress=false",
                       f"run.output_dir={tmp_path / 'run'}"])
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        first, last = trainer.eval_dir(0), trainer.eval_dir(1)
    finally:
        trainer.close()
    before, after = load_grid(first), load_grid(last)
    assert before.shape == after.shape == (4, 3, 16, 16) and before.dtype == torch.uint8
    assert json.loads((first / "eval.json").read_text())["grid"]["columns"] == ["input", "after", "after"]
    assert json.loads((last / "eval.json").read_text())["grid"]["columns"] == ["input", "before", "before",
                                                                               "after", "after"]
    grid = np.asarray(Image.open(last / "grid.png"))
    cell = 64 + PAD  # 16 px images upscaled 4x for viewing
    assert grid.shape[1] == LABEL_WIDTH + 5 * cell + PAD

    def at(row, col):  # the cell's image, back at 16 px (nearest upscaling: every 4th pixel)
        y, x = PAD + row * cell, LABEL_WIDTH + PAD + col * cell
        return torch.from_numpy(grid[y:y + 64:4, x:x + 64:4].copy()).permute(2, 0, 1)

    edits = load_prompts(EDITS).prompts
    assert torch.equal(at(1, 0), to_uint8(load_rgb(edits[1].image, 16)))
    assert torch.equal(at(1, 1), before[2]) and torch.equal(at(1, 4), after[3])


def test_true_cfg_with_the_negative_prompt_on_the_same_image_equals_the_pipelines(model, prompts):
    """sampling.guidance 2: the policy's (cond, uncond) pair, the negative prompt encoded on each row's own input image,
    through the plain rule, against FluxKontextPipeline's true_cfg_scale 2 loop given the same embeddings."""
    from jagg_scale.grpo.rollout import guided_velocity
    from jagg_scale.train.policy import Policy

    class Encoder(Policy):  # the policy's encode alone: no config, schedule or device
        guidance = 2.0

        def __init__(self, model):
            self.model, self.negative_prompt, self._uncond, self._counts = model, model.negative_prompt, None, {}

    cond, uncond = Encoder(model).encode( prompts)
    assert torch.equal(uncond[2], cond[2])  # the same input images in both halves
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    out = model.pipe(image=cond[2], prompt_embeds=cond[0], pooled_prompt_embeds=cond[1],
                     negative_prompt_embeds=uncond[0], negative_pooled_prompt_embeds=uncond[1], true_cfg_scale=2.0,
                     guidance_scale=model.guidance_scale, num_inference_steps=4, height=16, width=16, max_area=256,
                     latents=model.pack(noise.clone()), output_type="latent").images
    fn = lambda x, s, c: guided_velocity(model, x, s, c, 2.0, model.guidance_rule)
    ours = sample_ode(fn, (cond, uncond), noise, model.pipeline_sigmas(4))
    assert torch.allclose(model.unpack(out, 8, 8), ours, atol=1e-5)
