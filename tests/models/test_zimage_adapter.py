"""The diffusers Z-Image adapter (models/zimage.py) on a tiny random offline pipeline
(jagg_scale/models/tiny.py --kind zimage).

Checks the interface (variable-length prompts as a cond.Tokens at their longest, shapes, frozen parts; a forward
reads no device value), the
sign, time and CFG against the pipeline's own sampling loop, the GRPO log-prob round trip, JAGG W = 2 == per-step on
the transformer, jagg-train with LoRA (JAGG and exact; the export loads into a plain ZImagePipeline) and a full
fine-tune that resumes exactly and whose exported transformer loads into a plain pipeline to the trained outputs.
"""

import json
from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from adapter_checks import (PROMPTS, check_jagg_w2_equals_per_step, check_only_the_transformer_trains,
                            check_rollout_logprobs_recomputed, check_trains_and_the_lora_loads)
from jagg_scale.cond import index_cond
from jagg_scale.grpo import sample_ode
from jagg_scale.grpo.rollout import guided_velocity
from jagg_scale.models.zimage import ZImageVelocity
from jagg_scale.train.host_syncs import HostSyncs

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "zimage_tiny_cpu.yaml"


@pytest.fixture(scope="module")
def model(zimage_dir):
    torch.manual_seed(0)
    return ZImageVelocity.from_pretrained(zimage_dir, dtype=torch.float32, max_sequence_length=48, resolution=16)


def unpadded(cond):
    """The pipeline's own form of a conditioning: one [L_i, D] tensor per prompt."""
    return [e[m.bool()] for e, m in zip(cond.embeds, cond.mask)]


def test_shapes_padding_decoding_and_frozen_parts(model):
    assert model.latent_shape == (4, 8, 8) and model.image_size == 16
    cond = model.encode_prompts(PROMPTS)
    lengths = list(cond.lengths)
    assert cond.embeds.shape == (2, lengths[1], 16) and cond.mask.dtype == torch.int64
    assert cond.mask.sum(1).tolist() == lengths
    assert 0 < lengths[0] < lengths[1] < 48 and (cond.embeds[0, lengths[0]:] == 0).all()
    assert not cond.embeds.requires_grad
    theirs, _ = model.pipe.encode_prompt(prompt=list(PROMPTS), device="cpu", do_classifier_free_guidance=False,
                                         max_sequence_length=48)
    assert [t.shape[0] for t in theirs] == lengths
    assert all(torch.equal(a, b) for a, b in zip(unpadded(cond), theirs))
    x = torch.randn(3, *model.latent_shape)
    v = model(x, torch.tensor([1.0, 0.5, 0.1]), model.encode_prompts(PROMPTS + [""]))
    assert v.shape == x.shape and v.abs().sum() > 0
    img = model.decode(x)
    assert img.shape == (3, 3, 16, 16) and img.dtype == torch.float32 and 0 <= img.min() <= img.max() <= 1
    check_only_the_transformer_trains(model, {"vae", "text_encoder"})


def test_a_rows_velocity_does_not_depend_on_the_other_rows_prompts(model):
    """Rows of different prompt lengths share a transformer call (masked padding): each row's velocity is the one it
    gets alone, so the JAGG joint batch and the rollout's chunks change nothing."""
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(4))
    sigma, cond = torch.tensor([0.7, 0.2]), model.encode_prompts(PROMPTS)
    with torch.no_grad():
        both = model(x, sigma, cond)
        alone = torch.cat([model(x[i:i + 1], sigma[i:i + 1], index_cond(cond, slice(i, i + 1))) for i in (0, 1)])
    assert torch.allclose(both, alone, atol=1e-5)


def test_a_forward_reads_nothing_back_from_the_device(model):
    """Each prompt's length rides on the host in the conditioning (cond.Tokens): splitting the batch into the
    transformer's per-prompt list reads no device value (it read the mask back once per forward before)."""
    cond = model.encode_prompts(PROMPTS)
    with torch.no_grad(), HostSyncs(sites=True) as syncs:
        model(torch.randn(2, *model.latent_shape), torch.tensor([0.7, 0.2]), cond)
    assert syncs.count == 0, dict(syncs.by_site)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_adapter_ode_equals_the_pipeline_sampling_loop(model, guidance):
    """The pipeline's loop (t = 1 - sigma, the negated output, its mu-shifted schedule, its CFG v_c + g (v_c - v_u)
    with g = guidance - 1) and ours land on the same latents."""
    cond, uncond = model.encode_prompts(PROMPTS), model.encode_prompts([model.negative_prompt] * 2)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    out = model.pipe(prompt_embeds=unpadded(cond), negative_prompt_embeds=unpadded(uncond),
                     guidance_scale=guidance - 1, num_inference_steps=4, height=model.image_size,
                     width=model.image_size, latents=noise.clone(), output_type="latent").images
    assert torch.allclose(model.pipe.scheduler.sigmas.float(), model.pipeline_sigmas(4), atol=1e-6)
    fn = lambda x, s, c: guided_velocity(model, x, s, c, guidance, model.guidance_rule)
    ours = sample_ode(fn, cond if guidance == 1.0 else (cond, uncond), noise, model.pipeline_sigmas(4))
    assert torch.allclose(out, ours, atol=1e-5)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_rollout_logprobs_recomputed_in_training(model, guidance):
    check_rollout_logprobs_recomputed(model, model.pipeline_sigmas(4), guidance)


def test_jagg_w2_equals_per_step_on_the_transformer(zimage_dir):
    m = ZImageVelocity.from_pretrained(zimage_dir, dtype=torch.float32, max_sequence_length=48, resolution=16).double()
    check_jagg_w2_equals_per_step(m, m.pipeline_sigmas(4).double()[1:3], 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jagg", "exact"])
def test_jagg_train_two_steps_and_the_lora_loads_into_a_plain_pipeline(zimage_dir, tmp_path, mode):
    from diffusers import ZImagePipeline

    def load_plain(lora_dir):
        fresh = ZImagePipeline.from_pretrained(zimage_dir, local_files_only=True)
        fresh.load_lora_weights(str(lora_dir))
        return ZImageVelocity(fresh, max_sequence_length=64, latent_size=8)

    check_trains_and_the_lora_loads(CONFIG, [f"model.pretrained={zimage_dir}"], tmp_path / "run", mode, load_plain)


@pytest.mark.slow
def test_a_full_fine_tune_resumes_exactly_and_its_export_loads_into_a_plain_pipeline(zimage_dir, tmp_path):
    """Full weights (no LoRA, the KL reference a frozen copy): two steps, a checkpoint, a resumed third step give
    the metrics of an uninterrupted 3-step run, bit for bit; the exported transformer directory, put into a plain
    ZImagePipeline, gives the trained model's velocity."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    from jagg_scale.train import Trainer, load_config

    def fit(out, *extra, probe=False):
        cfg = load_config(CONFIG, [f"model.pretrained={zimage_dir}", "model.lora.enabled=false", "train.lr=1e-3",
                                   "log.progress=false", "run.checkpoint_every=1", f"run.output_dir={out}", *extra])
        trainer = Trainer(cfg)
        try:
            trainer.fit()
            if probe:
                with torch.no_grad():
                    v = trainer.model(x, sigma, trainer.model.encode_prompts(PROMPTS))
        finally:
            trainer.close()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        kept = [{k: v for k, v in r.items() if not k.startswith(("time_", "comm_"))} for r in rows]
        return kept, (v if probe else None)

    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.8, 0.3])
    whole, _ = fit(tmp_path / "whole", "train.steps=3")
    fit(tmp_path / "split", "train.steps=2")
    resumed, trained = fit(tmp_path / "split", "train.steps=3", "run.resume=auto", probe=True)
    assert len(whole) == 3 and resumed == whole and whole[-1]["grad_norm"] > 0

    transformer = ZImageTransformer2DModel.from_pretrained(tmp_path / "split" / "transformer", local_files_only=True)
    plain = ZImageVelocity(ZImagePipeline.from_pretrained(zimage_dir, transformer=transformer, local_files_only=True),
                           max_sequence_length=64, latent_size=8)
    with torch.no_grad():
        assert torch.allclose(plain(x, sigma, plain.encode_prompts(PROMPTS)), trained, atol=1e-5)
