"""Qwen-Image-Edit instruction editing (models/qwenimage_edit.py) on a tiny random offline QwenImageEditPlusPipeline
(jagg_scale/models/tiny.py build_tiny_qwenimage_edit, built from configs: no hub) and the committed edit set
data/edits/tiny/edits.jsonl, beside FLUX.1-Kontext's (test_kontext_adapter.py).

Checks the processor built without torchvision, the input image's latents against the pipeline's own encoding, the
sampling loop and true CFG against the pipeline's (its [noise | image] tokens, both grids, the vision tokens of the
prompt), that the input image conditions the velocity, the GRPO log-prob round trip and JAGG W = 2 == per-step.
"""

from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from adapter_checks import (check_jagg_w2_equals_per_step, check_only_the_transformer_trains,
                            check_rollout_logprobs_recomputed)
from jagg_scale.data import EditPrompt, load_prompts
from jagg_scale.grpo import sample_ode
from jagg_scale.models.qwenimage_edit import QwenImageEditVelocity

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "data" / "edits" / "tiny" / "edits.jsonl"


@pytest.fixture(scope="module")
def model(qwenimage_edit_dir):
    torch.manual_seed(0)
    return QwenImageEditVelocity.from_pretrained(qwenimage_edit_dir, dtype=torch.float32, resolution=16)


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(EDITS).prompts[:2]


@pytest.fixture
def pipeline_at_16px(monkeypatch):
    """The pipeline encodes its VAE image at VAE_IMAGE_SIZE's area (1024 x 1024) whatever the output; the adapter at
    the model's size: that one size set to 16 x 16 (its calculate_dimensions rounds to 32 px), the pipeline's loop is
    the adapter's."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as P

    dims = P.calculate_dimensions
    monkeypatch.setattr(P, "calculate_dimensions",
                        lambda area, ratio: (16, 16) if area == P.VAE_IMAGE_SIZE else dims(area, ratio))


def test_the_processor_is_built_without_its_video_half(model):
    proc = model.pipe.processor
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert getattr(proc, "video_processor", None) is None and proc.image_token == "<|image_pad|>"
    # the edit template's system part is 64 tokens, what the pipeline drops (prompt_template_encode_start_idx)
    prefix = model.pipe.prompt_template_encode.split("{}")[0]
    assert len(model.pipe.tokenizer(prefix)["input_ids"]) == model.pipe.prompt_template_encode_start_idx == 64


def test_the_input_images_latents_are_the_pipelines_and_its_vision_tokens_are_in_the_prompt(model, prompts):
    from PIL import Image

    assert all(isinstance(p, EditPrompt) and Path(p.image).is_file() for p in prompts)
    tokens, image = model.encode_prompts(prompts)
    assert image.shape == (2, *model.latent_shape) and len(tokens) == 2
    pil = Image.open(prompts[0].image).convert("RGB")
    pixels = model.pipe.image_processor.preprocess(pil, 16, 16).unsqueeze(2)
    assert torch.allclose(image[:1], model.pipe._encode_vae_image(pixels, generator=None)[:, :, 0], atol=1e-5)
    # the prompt read with its image: "Picture 1: <|vision_start|>" + the image's merged patches + the instruction
    embeds, _ = model.pipe.encode_prompt(prompt=[str(prompts[0])], image=[model.condition_image(prompts[0].image)])
    text_only, _ = model.pipe.encode_prompt(prompt=[str(prompts[0])], image=None)
    assert tokens.lengths[0] == embeds.shape[1] > text_only.shape[1]
    assert torch.equal(tokens.embeds[0, :tokens.lengths[0]], embeds[0])
    check_only_the_transformer_trains(model, {"vae", "text_encoder"})


def test_adapter_ode_equals_the_pipeline_sampling_loop(model, prompts, pipeline_at_16px):
    """The pipeline's own loop from the prompt and its input image ([noise | image] tokens, both grids, the noisy
    slice of the output, its schedule) and ours land on the same latents (the pipeline takes one prompt a call)."""
    from PIL import Image

    cond = model.encode_prompts(prompts[:1])
    noise = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    out = model.pipe(image=Image.open(prompts[0].image).convert("RGB"), prompt=str(prompts[0]), height=16, width=16,
                     num_inference_steps=4, latents=model.pack(noise.clone()), output_type="latent").images
    assert torch.allclose(model.pipe.scheduler.sigmas.float(), model.pipeline_sigmas(4), atol=1e-6)
    ours = sample_ode(model, cond, noise, model.pipeline_sigmas(4))
    assert torch.allclose(model.unpack(out, 8, 8), ours, atol=1e-5)


@pytest.mark.slow
def test_true_cfg_with_the_negative_prompt_on_the_same_image_equals_the_pipelines(model, prompts, pipeline_at_16px):
    """sampling.guidance 2: the policy's (cond, uncond) pair, the negative prompt " " read with the row's own input
    image, through Qwen-Image's token_norm rule, against the pipeline's true_cfg_scale 2 loop."""
    from PIL import Image

    from jagg_scale.grpo.rollout import guided_velocity
    from jagg_scale.train.policy import Policy

    class Encoder(Policy):  # the policy's encode alone: no config, schedule or device
        guidance = 2.0

        def __init__(self, model):
            self.model, self.negative_prompt, self._uncond, self._counts = model, model.negative_prompt, None, {}

    cond, uncond = Encoder(model).encode( prompts[:1])
    assert torch.equal(uncond[1], cond[1]) and model.guidance_rule == "token_norm"
    noise = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    out = model.pipe(image=Image.open(prompts[0].image).convert("RGB"), prompt=str(prompts[0]), negative_prompt=" ",
                     true_cfg_scale=2.0, height=16, width=16, num_inference_steps=4,
                     latents=model.pack(noise.clone()), output_type="latent").images
    fn = lambda x, s, c: guided_velocity(model, x, s, c, 2.0, model.guidance_rule)
    ours = sample_ode(fn, (cond, uncond), noise, model.pipeline_sigmas(4))
    assert torch.allclose(model.unpack(out, 8, 8), ours, atol=1e-5)


def test_the_input_image_conditions_the_velocity(model, prompts):
    x, sigma = torch.randn(1, *model.latent_shape), torch.tensor([0.6])
    same_text = [EditPrompt(str(prompts[0]), prompts[0].image), EditPrompt(str(prompts[0]), prompts[1].image)]
    tokens, image = model.encode_prompts(same_text)
    with torch.no_grad():
        a, b = (model(x, sigma, (tokens.rows(slice(i, i + 1)), image[i:i + 1])) for i in (0, 1))
    assert not torch.allclose(a, b, atol=1e-4)


def test_a_prompt_without_an_image_is_refused_by_name(model):
    with pytest.raises(ValueError, match="qwenimage_edit needs an input image per prompt.*'a cat'"):
        model.encode_prompts(["a cat"])


def test_rollout_logprobs_recomputed_in_training(model, prompts):
    check_rollout_logprobs_recomputed(model, model.pipeline_sigmas(4), 1.0, prompts)


@pytest.mark.slow
def test_jagg_w2_equals_per_step_on_the_transformer(qwenimage_edit_dir, prompts):
    m = QwenImageEditVelocity.from_pretrained(qwenimage_edit_dir, dtype=torch.float32, resolution=16).double()
    check_jagg_w2_equals_per_step(m, m.pipeline_sigmas(4).double()[1:3], 1.0, prompts)


@pytest.mark.slow
def test_jagg_train_two_steps_and_the_lora_loads_into_a_plain_pipeline(qwenimage_edit_dir, prompts, tmp_path):
    """configs/qwenimage_edit_tiny_cpu.yaml trains (the rollout rescored, JAGG's backwards) and its exported LoRA,
    loaded into a plain QwenImageEditPlusPipeline, gives the trained velocities."""
    from adapter_checks import check_trains_and_the_lora_loads
    from diffusers import QwenImageEditPlusPipeline

    from jagg_scale.models.qwenimage_edit import image_processor

    def load_plain(lora_dir):
        fresh = QwenImageEditPlusPipeline.from_pretrained(qwenimage_edit_dir, processor=image_processor(
            qwenimage_edit_dir), local_files_only=True)
        fresh.load_lora_weights(str(lora_dir))
        return QwenImageEditVelocity(fresh, latent_size=8)

    check_trains_and_the_lora_loads(ROOT / "configs" / "qwenimage_edit_tiny_cpu.yaml",
                                    [f"model.pretrained={qwenimage_edit_dir}"], tmp_path / "run", "jagg", load_plain,
                                    prompts)
