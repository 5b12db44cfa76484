"""LoRA on the SD3 adapter (models/lora.py) and the SD3 training options (gradient checkpointing, attention
kernel, full save), on the tiny random offline pipeline of jagg_scale/models/tiny.py."""


import pytest
import torch
from extras import need

need("diffusers")
need("transformers")
need("peft")

from jagg_scale.models.lora import (
    add_lora, lora_module_names, lora_parameters, reference_disabled, save_lora, target_matches,
)
from jagg_scale.models.sd3 import SD3Velocity


PROMPTS = ["a red cat", "two dogs on a photo"]


def _load(sd3_dir):
    return SD3Velocity.from_pretrained(sd3_dir, dtype=torch.float32)


def _inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, *model.latent_shape, generator=g)
    sigma = torch.tensor([0.9, 0.4])
    return x, sigma, model.encode_prompts(PROMPTS)


@torch.no_grad()
def _perturb_lora_b(model, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.transformer.named_parameters():
        if "lora_B" in name:
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def test_add_lora_trains_only_lora_on_the_default_targets(sd3_dir):
    model = _load(sd3_dir)
    x, sigma, cond = _inputs(model)
    with torch.no_grad():
        base = model(x, sigma, cond)
    config = model.add_lora()  # rank 32, alpha 64, gaussian init
    assert config.r == 32 and config.lora_alpha == 64 and config.init_lora_weights == "gaussian"

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert {id(p) for p in lora_parameters(model)} == {id(p) for p in model.parameters() if p.requires_grad}
    assert not any(p.requires_grad for m in model.frozen.values() for p in m.parameters())

    names, targets = lora_module_names(model), SD3Velocity.lora_targets
    matched = {t for n in names for t in targets if target_matches(n, [t])}
    assert matched == set(targets)
    assert all(target_matches(n, targets) for n in names)
    # every block's image-stream projections are adapted; nothing outside the attention
    n_blocks = len(model.transformer.transformer_blocks)
    assert sum(n.endswith("attn.to_q") for n in names) == n_blocks
    assert all(".attn." in n for n in names)

    # gaussian init: B = 0, so the adapted model starts exactly at the base
    for n, p in model.transformer.named_parameters():
        if "lora_B" in n:
            assert torch.count_nonzero(p) == 0
        if "lora_A" in n:
            assert p.abs().sum() > 0
    with torch.no_grad():
        assert torch.allclose(model(x, sigma, cond), base, atol=1e-6)


def test_reference_disabled_is_the_base_model(sd3_dir):
    model = _load(sd3_dir)
    x, sigma, cond = _inputs(model)
    with torch.no_grad():
        base = model(x, sigma, cond)
    add_lora(model.transformer, rank=4, alpha=8, targets=SD3Velocity.lora_targets)

    # one SGD step on a loss moves only LoRA params (B gets a gradient first: A is random, B = 0)
    opt = torch.optim.SGD(lora_parameters(model), lr=1.0)
    loss = (model(x, sigma, cond) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _perturb_lora_b(model)  # make the difference unmistakable

    with torch.no_grad():
        tuned = model(x, sigma, cond)
        assert (tuned - base).abs().max() > 1e-3
        with reference_disabled(model):
            ref = model(x, sigma, cond)
        assert torch.allclose(ref, base, atol=1e-6)
        assert torch.allclose(model(x, sigma, cond), tuned, atol=0)  # re-enabled on exit
    # the method form and the trainable flags survive the round trip
    with model.reference_disabled():
        with torch.no_grad():
            assert torch.allclose(model(x, sigma, cond), base, atol=1e-6)
    assert all(p.requires_grad for p in lora_parameters(model))
    # the reference has no graph to the LoRA params: a KL term computed under it is a constant
    with reference_disabled(model):
        assert not model(x, sigma, cond).requires_grad


def test_save_lora_loads_into_a_fresh_plain_pipeline(sd3_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    model = _load(sd3_dir)
    model.add_lora(rank=8, alpha=16)
    _perturb_lora_b(model, scale=0.3)
    x, sigma, cond = _inputs(model)
    out_dir = model.save_lora(tmp_path / "lora")
    assert (out_dir / "pytorch_lora_weights.safetensors").is_file()

    fresh = StableDiffusion3Pipeline.from_pretrained(sd3_dir, local_files_only=True)
    ts = sigma * 1000
    with torch.no_grad():
        kw = dict(hidden_states=x, timestep=ts, encoder_hidden_states=cond[0], pooled_projections=cond[1],
                  return_dict=False)
        before = fresh.transformer(**kw)[0]
        fresh.load_lora_weights(str(out_dir))
        after = fresh.transformer(**kw)[0]
        ours = model(x, sigma, cond)
    assert (before - ours).abs().max() > 1e-3  # the LoRA matters ...
    assert torch.allclose(after, ours, atol=1e-5)  # ... and is reproduced, scale alpha / r included

    # the pipeline's own sampling loop agrees as well (fixed generator, 2 steps, latents out)
    def sample(pipe):
        return pipe(prompt=PROMPTS[0], num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                    max_sequence_length=model.max_sequence_length,
                    generator=torch.Generator().manual_seed(7)).images
    assert torch.allclose(sample(fresh), sample(model.pipe), atol=1e-5)


def _grads(params):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_keeps_gradients(sd3_dir, lora):
    model = _load(sd3_dir)
    if lora:
        model.add_lora(rank=4, alpha=8)
        _perturb_lora_b(model, scale=0.2)
    model.train()
    x, sigma, cond = _inputs(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def grad():
        model.zero_grad(set_to_none=True)
        loss = (model(x, sigma, cond) ** 2).mean()
        loss.backward()
        return loss.detach(), _grads(params).clone()

    loss0, g0 = grad()
    model.enable_gradient_checkpointing()
    assert model.transformer.gradient_checkpointing
    calls = []
    inner = model.transformer._gradient_checkpointing_func
    model.transformer._gradient_checkpointing_func = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    loss1, g1 = grad()
    assert len(calls) == len(model.transformer.transformer_blocks)  # every block went through checkpointing
    assert g0.norm() > 0
    assert torch.allclose(loss0, loss1, rtol=1e-6)
    assert float((g1 - g0).norm() / g0.norm()) < 1e-5


def test_attention_kernels(sd3_dir):
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    model = _load(sd3_dir)
    x, sigma, cond = _inputs(model)
    with torch.no_grad():
        v0 = model(x, sigma, cond)
        model.set_attention("sdpa")
        assert torch.allclose(model(x, sigma, cond), v0, atol=0)
    assert model.attention == "sdpa"
    assert all(isinstance(p, JointAttnProcessor2_0) for p in model.transformer.attn_processors.values())
    with pytest.raises(ValueError, match="unknown attention"):
        model.set_attention("flash9")

    try:
        import xformers  # noqa: F401
        have_xformers = True
    except Exception:
        have_xformers = False
    if torch.cuda.is_available() and have_xformers:
        pytest.skip("xformers and CUDA are available here: the failure path is not reachable")
    with pytest.raises(RuntimeError, match="xformers") as err:
        model.set_attention("xformers")
    msg = str(err.value)
    if not torch.cuda.is_available():
        assert "CUDA" in msg
    if not have_xformers:
        assert "import xformers" in msg
    assert model.attention == "sdpa"  # unchanged after the refusal


def test_save_full_round_trips_and_refuses_with_lora(sd3_dir, tmp_path):
    from diffusers import SD3Transformer2DModel

    model = _load(sd3_dir)
    with torch.no_grad():
        for p in model.transformer.parameters():
            p.add_(0.01)
    out = model.save_full(tmp_path / "full")
    again = SD3Transformer2DModel.from_pretrained(out, local_files_only=True)
    for (n, p), (_, q) in zip(model.transformer.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    model.add_lora(rank=4, alpha=8)
    with pytest.raises(ValueError, match="save_lora"):
        model.save_full(tmp_path / "full2")
    # and save_lora refuses a transformer without an adapter
    with pytest.raises(ValueError, match="no LoRA"):
        save_lora(again, tmp_path / "x")
