"""The diffusers FLUX.2 [klein] and [dev] adapter (models/flux2.py) on tiny random offline pipelines
(jagg_scale/models/tiny.py --kind flux2, --kind flux2_dev).

Checks the interface (shapes, frozen parts, decoding through the VAE's batch-norm statistics), the schedule, sign and
CFG against the pipeline's own sampling loop, the GRPO log-prob round trip, JAGG W = 2 == per-step on the
transformer, and two jagg-train steps (LoRA; JAGG and exact) whose exported LoRA loads into a plain
Flux2KleinPipeline to the same outputs; for [dev] its own pipeline class, distilled guidance and sampling loop.
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
from jagg_scale.grpo.rollout import guided_velocity
from jagg_scale.models.flux2 import Flux2Velocity

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(flux2_dir):
    torch.manual_seed(0)
    return Flux2Velocity.from_pretrained(flux2_dir, dtype=torch.float32, max_sequence_length=48, resolution=32)


def test_shapes_decoding_and_frozen_parts(model):
    assert model.latent_shape == (16, 8, 8) and model.image_size == 32
    embeds = model.encode_prompts(PROMPTS)
    assert embeds.shape == (2, 48, 48) and not embeds.requires_grad
    x = torch.randn(3, *model.latent_shape)
    v = model(x, torch.tensor([1.0, 0.5, 0.1]), model.encode_prompts(PROMPTS + [""]))
    assert v.shape == x.shape and v.abs().sum() > 0
    img = model.decode(x)
    assert img.shape == (3, 3, 32, 32) and img.dtype == torch.float32 and 0 <= img.min() <= img.max() <= 1
    check_only_the_transformer_trains(model, {"vae", "text_encoder"})


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_adapter_ode_equals_the_pipeline_sampling_loop(model, guidance):
    """The pipeline's own loop (its empirical-mu schedule, its Euler steps on packed tokens, its CFG with the empty
    negative prompt) and ours land on the same latents."""
    cond, uncond = model.encode_prompts(PROMPTS), model.encode_prompts([""] * 2)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    out = model.pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, guidance_scale=guidance,
                     num_inference_steps=4, height=model.image_size, width=model.image_size,
                     latents=noise.clone(), output_type="latent", max_sequence_length=48).images
    assert torch.allclose(model.pipe.scheduler.sigmas.float(), model.pipeline_sigmas(4), atol=1e-6)
    fn = lambda x, s, c: guided_velocity(model, x, s, c, guidance, model.guidance_rule)
    ours = sample_ode(fn, cond if guidance == 1.0 else (cond, uncond), noise, model.pipeline_sigmas(4))
    vae = model.frozen["vae"]  # the pipeline's "latent" output: batch-norm statistics undone, unpatchified
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    assert torch.allclose(out, model.pipe._unpatchify_latents(ours * std + vae.bn.running_mean.view(1, -1, 1, 1)),
                          atol=1e-5)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_rollout_logprobs_recomputed_in_training(model, guidance):
    check_rollout_logprobs_recomputed(model, model.pipeline_sigmas(4), guidance)


def test_jagg_w2_equals_per_step_on_the_transformer(flux2_dir):
    m = Flux2Velocity.from_pretrained(flux2_dir, dtype=torch.float32, max_sequence_length=48, resolution=32).double()
    check_jagg_w2_equals_per_step(m, m.pipeline_sigmas(4).double()[1:3], 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jagg", "exact"])
def test_jagg_train_two_steps_and_the_lora_loads_into_a_plain_pipeline(flux2_dir, tmp_path, mode):
    from diffusers import Flux2KleinPipeline

    def load_plain(lora_dir):
        fresh = Flux2KleinPipeline.from_pretrained(flux2_dir, local_files_only=True)
        fresh.load_lora_weights(str(lora_dir))
        return Flux2Velocity(fresh, max_sequence_length=64, latent_size=16)

    check_trains_and_the_lora_loads(ROOT / "configs" / "flux2_tiny_cpu.yaml",
                                    [f"model.pretrained={flux2_dir}", "model.resolution=32"], tmp_path / "run", mode,
                                    load_plain)


# ------------------------------------------------------------------------------------- FLUX.2 [dev] (Flux2Pipeline)


@pytest.fixture(scope="module")
def dev(flux2_dev_dir):
    return Flux2Velocity.from_pretrained(flux2_dev_dir, dtype=torch.float32, max_sequence_length=48, resolution=32)


def test_dev_loads_its_own_pipeline_and_feeds_its_distilled_guidance(dev, flux2_dev_dir, flux2_dir):
    from diffusers import Flux2Pipeline

    assert isinstance(dev.pipe, Flux2Pipeline) and dev.guidance_scale == 4.0  # Flux2Pipeline's default
    assert dev.latent_shape == (16, 8, 8) and dev.encode_prompts(PROMPTS).shape == (2, 48, 48)
    x, sigma, cond = torch.randn(1, *dev.latent_shape), torch.tensor([0.5]), dev.encode_prompts(PROMPTS[:1])
    other = Flux2Velocity.from_pretrained(flux2_dev_dir, max_sequence_length=48, resolution=32, guidance_scale=2.0)
    with torch.no_grad():
        assert not torch.allclose(dev(x, sigma, cond), other(x, sigma, cond), atol=1e-5)  # the guidance is fed
    with pytest.raises(ValueError, match="distilled_guidance 2.0 is for a guidance-distilled FLUX.2"):
        Flux2Velocity.from_pretrained(flux2_dir, max_sequence_length=48, resolution=32, guidance_scale=2.0)


def test_dev_ode_equals_the_pipeline_sampling_loop(dev):
    """Flux2Pipeline's own loop (Mistral3 prompt embeddings, guidance embedding 4.0, no CFG) and ours."""
    cond = dev.encode_prompts(PROMPTS)
    noise = torch.randn(2, *dev.latent_shape, generator=torch.Generator().manual_seed(1))
    out = dev.pipe(prompt_embeds=cond, guidance_scale=dev.guidance_scale, num_inference_steps=4,
                   height=dev.image_size, width=dev.image_size, latents=noise.clone(), output_type="latent",
                   max_sequence_length=48).images
    ours = sample_ode(dev, cond, noise, dev.pipeline_sigmas(4))
    assert torch.allclose(out, dev.pipe._pack_latents(ours), atol=1e-5)  # Flux2Pipeline's "latent": its tokens


def test_dev_rollout_logprobs_recomputed_in_training(dev):
    check_rollout_logprobs_recomputed(dev, dev.pipeline_sigmas(4), 1.0)


@pytest.mark.slow
def test_dev_trains_and_its_lora_loads_into_a_plain_pipeline(flux2_dev_dir, tmp_path):
    from diffusers import Flux2Pipeline

    def load_plain(lora_dir):
        fresh = Flux2Pipeline.from_pretrained(flux2_dev_dir, local_files_only=True)
        fresh.load_lora_weights(str(lora_dir))
        return Flux2Velocity(fresh, max_sequence_length=64, latent_size=16)

    check_trains_and_the_lora_loads(ROOT / "configs" / "flux2_tiny_cpu.yaml",
                                    [f"model.pretrained={flux2_dev_dir}", "model.resolution=32",
                                     "sampling.guidance=1.0"], tmp_path / "run", "jagg", load_plain)


@pytest.mark.parametrize("kind", ["klein", "dev"])
def test_the_encoder_runs_without_the_lm_head_over_every_token_and_embeds_the_same(model, dev, kind):
    """encode_prompts calls the causal LM with logits_to_keep=1: the hidden states the pipeline concatenates are
    bit-identical to its own encode_prompt's (every token's logits), and the LM head sees one token a row."""
    m = model if kind == "klein" else dev
    seen = []
    hook = m.pipe.text_encoder.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))
    try:
        ours = m.encode_prompts(PROMPTS)
        theirs, _ = m.pipe.encode_prompt(prompt=list(PROMPTS), device=m.device, max_sequence_length=48)
    finally:
        hook.remove()
    assert torch.equal(ours, theirs.to(m.dtype))
    vocab = seen[1][-1]
    assert seen == [(2, 1, vocab), (2, 48, vocab)]  # ours: the last token only; the pipeline's own call: all 48
