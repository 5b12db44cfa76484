"""The diffusers Qwen-Image adapter (models/qwenimage.py) on a tiny random offline pipeline
(jagg_scale/models/tiny.py --kind qwenimage).

Checks the interface (unpacked shapes, packing round trip, frozen parts), that prompts at their encoded length
(cond.Tokens) leave the velocity the pipeline's and the one padded to max_sequence_length with a mask, that a pass
carries its rows' longest prompt and reads nothing back from the device, the sigma and sign conventions against the
pipeline's own sampling loop (and its true CFG), the GRPO log-prob round trip, JAGG W = 2 == per-step on the
transformer, two jagg-train steps (LoRA; JAGG and exact; true CFG), and that the exported LoRA loads into a plain
QwenImagePipeline to the same outputs.
"""

from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("transformers")

from adapter_checks import (PROMPTS, check_jagg_w2_equals_per_step, check_only_the_transformer_trains,
                            check_rollout_logprobs_recomputed, check_trains_and_the_lora_loads)
from jagg_scale.cond import Tokens, expand_cond, index_cond, repeat_cond
from jagg_scale.grpo import sample_ode
from jagg_scale.models.qwenimage import QwenImageVelocity
from jagg_scale.train.host_syncs import HostSyncs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(qwenimage_dir):
    torch.manual_seed(0)
    return QwenImageVelocity.from_pretrained(qwenimage_dir, dtype=torch.float32, max_sequence_length=48,
                                             resolution=16)


def test_shapes_packing_prompt_lengths_and_frozen_parts(model):
    assert model.latent_shape == (4, 8, 8) and model.image_size == 16
    cond = model.encode_prompts(PROMPTS)
    assert isinstance(cond, Tokens) and cond.mask.dtype == torch.int64 and not cond.embeds.requires_grad
    short, long = cond.lengths
    assert 0 < short < long < 48  # "two dogs on a photo" is longer; the batch is cut to it, not to 48
    assert cond.embeds.shape == (2, long, 32) and cond.mask.sum(1).tolist() == [short, long]
    assert (cond.embeds[0, short:] == 0).all() and (cond.mask[0, short:] == 0).all()
    x = torch.randn(3, *model.latent_shape)
    tokens = model.pack(x)
    assert tokens.shape == (3, 16, 16) and torch.equal(model.unpack(tokens, 8, 8), x)
    img = model.decode(x)
    assert img.shape == (3, 3, 16, 16) and img.dtype == torch.float32 and 0 <= img.min() <= img.max() <= 1
    check_only_the_transformer_trains(model, {"vae", "text_encoder"})


def _text_tokens(model) -> list:
    """The text tokens of every transformer call (a forward pre-hook), with the mask it got."""
    seen = []
    model.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((kwargs["encoder_hidden_states"].shape[1],
                                               kwargs["encoder_hidden_states_mask"])), with_kwargs=True)
    return seen


def test_prompts_at_their_length_give_the_padded_and_the_pipelines_velocity(qwenimage_dir):
    """Three prompts of different lengths in one pass: the velocity equals the one of the same prompts padded to
    max_sequence_length with their mask (the mask made padding inert), the pipeline's own (its encode_prompt and
    transformer call), and each row's alone (cut to its own length, no mask); the pass carries the longest
    prompt's tokens."""
    m = QwenImageVelocity.from_pretrained(qwenimage_dir, dtype=torch.float32, max_sequence_length=48, resolution=16)
    seen = _text_tokens(m)
    prompts = ["a cat", "two dogs on a photo in the park", "a red bicycle"]
    cond = m.encode_prompts(prompts)
    assert len(set(cond.lengths)) == 3
    x = torch.randn(3, *m.latent_shape, generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.9, 0.4, 0.6])
    padded_embeds, padded_mask = cond.to_length(48)
    embeds, mask = m.pipe.encode_prompt(prompt=prompts, device="cpu", max_sequence_length=48)

    def transformer(e, msk):
        out = m.transformer(hidden_states=m.pack(x), timestep=sigma, encoder_hidden_states=e,
                            encoder_hidden_states_mask=msk, img_shapes=[[(1, 4, 4)]] * 3, return_dict=False)[0]
        return m.unpack(out, 8, 8)

    with torch.no_grad():
        ours = m(x, sigma, cond)
        assert seen[-1][0] == max(cond.lengths) < 48
        padded, pipeline = transformer(padded_embeds, padded_mask), transformer(embeds, mask)
        alone = torch.cat([m(x[i:i + 1], sigma[i:i + 1], index_cond(cond, slice(i, i + 1))) for i in range(3)])
    assert [(n, msk) for n, msk in seen[-3:]] == [(n, None) for n in cond.lengths]  # full rows: no mask, as the pipe
    assert torch.allclose(ours, padded, atol=1e-5) and torch.allclose(ours, pipeline, atol=1e-5)
    assert torch.allclose(ours, alone, atol=1e-5)
    assert not torch.allclose(ours, transformer(padded_embeds, None), atol=1e-3)  # the mask is what makes it so


def test_a_pass_carries_its_rows_longest_prompt(qwenimage_dir):
    """Rows selected from a batch (a rollout chunk, a micro-batch: a host index), a JAGG joint pass (rows
    repeated) and CFG's conditional + unconditional rows each reach the transformer at their own rows' longest
    encoded prompt, never at max_sequence_length."""
    from jagg_scale.grpo.rollout import guided_velocity

    m = QwenImageVelocity.from_pretrained(qwenimage_dir, dtype=torch.float32, max_sequence_length=48, resolution=16)
    seen = _text_tokens(m)
    cond = m.encode_prompts(["a cat", "two dogs on a photo in the park", "a red bicycle", "a cat"])
    uncond = expand_cond(m.encode_prompts([m.negative_prompt]), 2)
    a, b, c, _ = cond.lengths
    x, s = torch.randn(2, *m.latent_shape), torch.tensor([0.5, 0.5])
    with torch.no_grad():
        for rows, longest in ((torch.tensor([0, 2]), c), (torch.tensor([0, 3]), a), (slice(1, 3), b)):
            sub = index_cond(cond, rows)
            m(x, s, sub)
            m(torch.cat([x, x]), torch.cat([s, s]), repeat_cond(sub, 2))
            guided_velocity(m, x, s, (sub, uncond), 4.0, m.guidance_rule)
            assert [n for n, _ in seen[-3:]] == [longest] * 3 and longest < 48
    assert uncond.lengths[0] < a  # " " is shorter than every prompt: the CFG pass is the prompts' length
    assert seen[-3][1] is not None and seen[-1][1] is not None  # rows of different lengths: masked


def test_a_sequence_split_pads_the_prompts_to_a_multiple_of_it(qwenimage_dir):
    """Under context parallelism (diffusers' _parallel_config, as parallel/sequence.py enables it) Ulysses splits the
    text evenly: a pass is padded up to a multiple of the split, masked, with the same velocity (the split itself
    needs several processes: tests/parallel/test_sequence_parallel.py)."""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig

    m = QwenImageVelocity.from_pretrained(qwenimage_dir, dtype=torch.float32, max_sequence_length=48, resolution=16)
    seen = _text_tokens(m)
    cond = m.encode_prompts(["a cat", "two dogs on a photo in the park"])
    rows = next(torch.tensor([i, i]) for i, n in enumerate(cond.lengths) if n % 4)  # one prompt: no mask unsplit
    x, s = torch.randn(2, *m.latent_shape), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        plain = m(x, s, index_cond(cond, rows))
        m.transformer._parallel_config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=4))
        split = m(x, s, index_cond(cond, rows))
    (n, none), (padded, mask) = seen
    assert none is None and padded == -(-n // 4) * 4 > n and mask.sum(1).tolist() == [n, n]
    assert torch.allclose(split, plain, atol=1e-5)


def test_a_forward_reads_nothing_back_from_the_device(model):
    """The prompt lengths that size a pass are the host's (cond.Tokens): the adapter reads no device value per
    forward (train/host_syncs.py counts every read on the CPU as if it were one). Rows of one length pass no mask and
    count nothing; rows of different lengths count only diffusers' own copy of the text length to the device in
    compute_text_seq_len_from_mask, which every forward made when every prompt was padded to a fixed length."""
    cond = index_cond(model.encode_prompts(["a cat", "two dogs on a photo in the park"]), torch.tensor([1, 0]))
    x, s = torch.randn(2, *model.latent_shape), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        with HostSyncs(sites=True) as full:
            model(x, s, repeat_cond(index_cond(cond, slice(0, 1)), 2))
        with HostSyncs(sites=True) as mixed:
            model(x, s, cond)
    assert full.count == 0, dict(full.by_site)
    assert mixed.count == 1 and all("transformers/transformer_qwenimage.py" in k for k in mixed.by_site), \
        dict(mixed.by_site)


def test_adapter_ode_equals_the_pipeline_sampling_loop(model):
    """The pipeline's own loop (no CFG, its dynamic-shift schedule, its Euler steps on packed latents) and ours."""
    cond = model.encode_prompts(PROMPTS)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    out = model.pipe(prompt_embeds=cond.embeds, prompt_embeds_mask=cond.mask, true_cfg_scale=1.0, num_inference_steps=4,
                     height=model.image_size, width=model.image_size, latents=model.pack(noise.clone()),
                     output_type="latent").images
    assert torch.allclose(model.pipe.scheduler.sigmas.float(), model.pipeline_sigmas(4), atol=1e-6)
    ours = sample_ode(model, cond, noise, model.pipeline_sigmas(4))
    assert torch.allclose(model.unpack(out, 8, 8), ours, atol=1e-5)


def test_true_cfg_equals_the_pipelines(model):
    """guidance 4 with the family's rule (the guided prediction rescaled per token to the conditional one's norm)
    and negative prompt " ": the pipeline's own true-CFG loop and ours land on the same latents."""
    from jagg_scale.grpo.rollout import guided_velocity

    cond, uncond = model.encode_prompts(PROMPTS), model.encode_prompts([model.negative_prompt] * 2)
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    out = model.pipe(prompt_embeds=cond.embeds, prompt_embeds_mask=cond.mask, negative_prompt_embeds=uncond.embeds,
                     negative_prompt_embeds_mask=uncond.mask, true_cfg_scale=4.0, num_inference_steps=4,
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


@pytest.mark.slow
def test_no_all_padding_text_column_reaches_the_blocks_in_a_training_step(qwenimage_dir, tmp_path):
    """One jagg-train step with prompts of different lengths, true CFG, rollout chunks of 4 rows, two minibatches
    (the second refreshes the unconditional rows) in micro-batches of 2 and JAGG joint passes: every transformer
    call's text is its rows' longest prompt (the last column holds some row's token), never the 64 padded tokens of
    model.max_sequence_length; its first minibatch rescores the rollout exactly (ratio 1)."""
    from jagg_scale.train import Trainer, load_config

    prompts = "[a cat, two dogs on a photo in the park at sunset]"
    cfg = load_config(ROOT / "configs" / "qwenimage_tiny_cpu.yaml", [
        f"model.pretrained={qwenimage_dir}", "model.resolution=16", f"data.prompts={prompts}", "sampling.guidance=3.0",
        "sampling.num_steps=4", "sampling.chunk_size=4", "train.minibatch_size=4", "train.micro_batch_size=2",
        "train.steps=1", "run.checkpoint_every=0", "log.progress=false", "eval.enabled=false",
        f"run.output_dir={tmp_path}"])
    trainer = Trainer(cfg)
    seen = _text_tokens(trainer.model)
    try:
        metrics = trainer.train_step(0)
    finally:
        trainer.close()
    assert metrics["optimizer_steps"] == 2 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    masked = [msk for _, msk in seen if msk is not None]
    assert len(seen) > 20 and masked and all(msk[:, -1].any() for msk in masked)
    assert max(n for n, _ in seen) < 64
