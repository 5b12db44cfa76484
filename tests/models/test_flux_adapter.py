"""The diffusers FLUX adapter (models/flux.py) on a tiny random offline pipeline (jagg_scale/models/tiny.py).

Checks the interface (unpacked shapes, packing round trip, frozen parts), the sigma/timestep and sign conventions
against diffusers' own scheduler and sampling loop, the GRPO log-prob round trip (rollout vs training pass) and
JAGG W = 2 == per-step.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from adapter_checks import (PROMPTS, check_jagg_w2_equals_per_step, check_only_the_transformer_trains,
                            check_rollout_logprobs_recomputed)
from jagg_scale.grpo import sample_ode
from jagg_scale.grpo.sde import ode_step
from jagg_scale.models.flux import FluxVelocity


@pytest.fixture(scope="module")
def model(flux_dir):
    torch.manual_seed(0)
    return FluxVelocity.from_pretrained(flux_dir, dtype=torch.float32)


def test_pipeline_saves_and_loads_offline(flux_dir):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    assert (flux_dir / "model_index.json").is_file()
    pipe = FluxPipeline.from_pretrained(flux_dir, local_files_only=True)
    assert isinstance(pipe.transformer, FluxTransformer2DModel)
    assert pipe.transformer.config.guidance_embeds
    assert pipe.text_encoder_2 is not None and pipe.tokenizer_2 is not None
    assert pipe.scheduler.config.use_dynamic_shifting
    ids = pipe.tokenizer(["a cat", ""], padding="max_length", max_length=pipe.tokenizer_max_length).input_ids
    assert len(ids[0]) == pipe.tokenizer_max_length
    again = FluxTransformer2DModel.from_pretrained(flux_dir / "transformer", local_files_only=True)
    for (n, p), (_, q) in zip(pipe.transformer.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


def test_shapes_packing_and_frozen_parts(model):
    assert model.latent_shape == (4, 8, 8) and model.image_size == 16
    embeds, pooled = model.encode_prompts(PROMPTS)
    assert embeds.shape == (2, model.max_sequence_length, 32) and pooled.shape == (2, 16)
    u_embeds, u_pooled = model.encode_prompts([""])
    assert u_embeds.shape[1:] == embeds.shape[1:] and not torch.allclose(u_pooled, pooled[:1])
    assert not embeds.requires_grad and not pooled.requires_grad

    x = torch.randn(3, *model.latent_shape)
    tokens = model.pack(x)
    assert tokens.shape == (3, 16, 16) and torch.equal(model.unpack(tokens, 8, 8), x)
    cond = model.encode_prompts(PROMPTS + [""])
    v = model(x, torch.tensor([1.0, 0.5, 0.1]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and v.abs().sum() > 0
    # the distilled guidance value is an input of the transformer
    v_g = FluxVelocity(model.pipe, model.max_sequence_length, guidance_scale=1.0)(x, torch.tensor([1.0, 0.5, 0.1]),
                                                                                    cond)
    assert not torch.allclose(v, v_g)
    img = model.decode(x)
    assert img.shape == (3, 3, 16, 16) and img.dtype == torch.float32
    assert img.min() >= 0 and img.max() <= 1

    check_only_the_transformer_trains(model, {"vae", "text_encoder", "text_encoder_2"})


def test_sigma_timestep_and_sign_match_the_scheduler(model):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    # FluxPipeline's schedule: linspace(1, 1/n, n) shifted with mu from the packed sequence length (16 tokens)
    mu = calculate_shift(16, 256, 4096, 0.5, 1.15)
    scheds = [FlowMatchEulerDiscreteScheduler.from_config(model.pipe.scheduler.config) for _ in range(2)]
    for sc in scheds:  # the oracle has its own step counter: scheduler.step advances an internal index
        sc.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=mu)
    sched, oracle_sched = scheds
    sigmas = sched.sigmas
    assert torch.allclose(sigmas.float(), model.pipeline_sigmas(4))
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (sigmas[1:] < sigmas[:-1]).all()
    assert torch.allclose(sched.timesteps, sigmas[:-1] * 1000)  # the pipeline feeds timesteps / 1000 = sigma
    cond = model.encode_prompts(PROMPTS)
    g = torch.Generator().manual_seed(0)
    x0, e = torch.randn(2, 2, *model.latent_shape, generator=g)
    x = e.clone()
    for k, t in enumerate(sched.timesteps):
        s, s_next = sigmas[k], sigmas[k + 1]
        v = model(x, s.expand(2), cond)
        # the scheduler steps FLUX's packed latents
        x_sched = model.unpack(sched.step(model.pack(v), t, model.pack(x), return_dict=False)[0], 8, 8)
        assert torch.allclose(x_sched, x + v * (s_next - s), atol=1e-6)
        assert torch.allclose(x_sched, ode_step(x, v, s, s_next), atol=1e-6)
        # sign: with the oracle velocity e - x0 the scheduler moves along x_s = (1 - s) x0 + s e
        x_s = (1 - s) * x0 + s * e
        oracle = oracle_sched.step(model.pack(e - x0), t, model.pack(x_s), return_dict=False)[0]
        assert torch.allclose(model.unpack(oracle, 8, 8), (1 - s_next) * x0 + s_next * e, atol=1e-5)
        x = x_sched


def test_adapter_ode_equals_the_pipeline_sampling_loop(model):
    cond = model.encode_prompts(PROMPTS)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    out = model.pipe(prompt_embeds=cond[0], pooled_prompt_embeds=cond[1], guidance_scale=model.guidance_scale,
                     num_inference_steps=4, height=model.image_size, width=model.image_size,
                     latents=model.pack(noise.clone()), output_type="latent",
                     max_sequence_length=model.max_sequence_length).images
    assert torch.allclose(model.pipe.scheduler.sigmas.float(), model.pipeline_sigmas(4), atol=1e-6)
    ours = sample_ode(model, cond, noise, model.pipeline_sigmas(4))
    assert torch.allclose(model.unpack(out, 8, 8), ours, atol=1e-5)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_rollout_logprobs_recomputed_in_training(model, guidance):
    check_rollout_logprobs_recomputed(model, model.pipeline_sigmas(4), guidance)


@pytest.fixture(scope="module")
def model64(flux_dir):
    return FluxVelocity.from_pretrained(flux_dir, dtype=torch.float32).double()


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_jagg_w2_equals_per_step_on_the_transformer(model64, guidance):
    m = model64
    c = m.encode_prompts(PROMPTS)
    assert c[0].dtype == torch.float64 and m.frozen["vae"].dtype == torch.float64
    check_jagg_w2_equals_per_step(m, m.pipeline_sigmas(4).double()[1:3], guidance)


def test_jagg_train_two_steps_on_the_tiny_flux_pipeline(flux_dir, tmp_path):
    from jagg_scale.train import Trainer, load_config

    config = Path(__file__).resolve().parents[2] / "configs" / "flux_tiny_cpu.yaml"
    cfg = load_config(config, [f"model.pretrained={flux_dir}", "train.steps=2", f"run.output_dir={tmp_path / 'run'}",
                               "log.progress=false"])
    rows = Trainer(cfg).fit()
    assert len(rows) == 2
    for r in rows:
        assert r["windows_jagg"] == 2 and r["backward_passes"] == 4 and r["per_step_equiv"] == 8
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    # the config trains a LoRA (KL to the adapter-off model): the export is a diffusers LoRA file
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_flux_lora_saved_loads_into_a_plain_flux_pipeline(flux_dir, tmp_path):
    """LoRA on FLUX (same peft path as SD3): only adapter weights train, adapter-off is the base model, and the
    saved file is read by a plain FluxPipeline.load_lora_weights to the same transformer outputs."""
    from diffusers import FluxPipeline

    m = FluxVelocity.from_pretrained(flux_dir, dtype=torch.float32)
    x = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.8, 0.3])
    cond = m.encode_prompts(PROMPTS)
    with torch.no_grad():
        base = m(x, sigma, cond)
    m.add_lora(rank=4, alpha=8)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in m.transformer.named_parameters():
            if "lora_B" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        ours = m(x, sigma, cond)
        with m.reference_disabled():
            off = m(x, sigma, cond)
    assert (ours - base).abs().max() > 1e-3
    assert torch.equal(off, base)

    out = m.save_lora(tmp_path / "lora")
    fresh = FluxPipeline.from_pretrained(flux_dir, local_files_only=True)
    fresh.load_lora_weights(str(out))
    plain = FluxVelocity(fresh, max_sequence_length=m.max_sequence_length)
    with torch.no_grad():
        assert torch.allclose(plain(x, sigma, cond), ours, atol=1e-5)


def test_resolution_and_pipeline_schedule_from_the_config(flux_dir, tmp_path):
    """model.resolution sets the latent size; sampling.shift null samples with the pipeline's dynamic shift
    (which depends on that size), and the trainer uses exactly those sigmas."""
    from jagg_scale.train import ConfigError, Trainer, load_config

    config = Path(__file__).resolve().parents[2] / "configs" / "flux_tiny_cpu.yaml"
    over = [f"model.pretrained={flux_dir}", f"run.output_dir={tmp_path / 'run'}", "log.progress=false"]
    small = Trainer(load_config(config, over))
    big = Trainer(load_config(config, over + ["model.resolution=32"]))
    assert small.model.latent_shape == (4, 8, 8) and big.model.latent_shape == (4, 16, 16)
    assert torch.allclose(small.policy.sigmas.cpu(), small.model.pipeline_sigmas(8))
    assert torch.allclose(big.policy.sigmas.cpu(), big.model.pipeline_sigmas(8))
    # more tokens -> a larger mu -> a different schedule
    assert not torch.allclose(small.policy.sigmas, big.policy.sigmas)
    assert small.policy.sigmas[0] == 1.0 and small.policy.sigmas[-1] == 0.0
    with pytest.raises(ConfigError, match="'model.resolution' 22 must be a multiple of 4"):  # at config time
        load_config(config, over + ["model.resolution=22"])  # tiny VAE factor 2 x FLUX's 2x2 packing
