"""Tests of the built-in DiT velocity model and the hash tokenizer."""

from __future__ import annotations

import pytest
import torch

from jagg_scale.models.dit import DiT, DiTConfig, get_2d_sincos_pos_embed
from jagg_scale.models.dit import HashTokenizer

SMALL = DiTConfig(image_size=16, in_channels=3, patch_size=4, hidden_size=64, depth=2, num_heads=4)
PROMPTS = ["a red cat", "a blue dog on the grass", "", "Red CAT"]


def _random_model(config: DiTConfig = SMALL, seed: int = 0) -> DiT:
    torch.manual_seed(seed)
    return DiT(config).init_weights(zero_out=False).eval()


def _inputs(model: DiT, n: int, seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *model.latent_shape, generator=g, dtype=dtype)
    sigma = torch.rand(n, generator=g, dtype=dtype)
    return x, sigma


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_deterministic_and_padding():
    tok = HashTokenizer(vocab_size=4096, max_length=8)
    a = tok(["A red cat!", "a  RED cat", ""])
    assert a.dtype == torch.long and a.shape == (3, 8)
    assert torch.equal(a[0], a[1])  # case and punctuation insensitive
    assert torch.equal(a[2], torch.zeros(8, dtype=torch.long))  # unconditional prompt
    assert (a[0, :3] > 0).all() and (a[0, 3:] == 0).all()
    assert (a < 4096).all()
    # same ids from a fresh tokenizer (no salted hashing / state)
    assert torch.equal(HashTokenizer(4096, 8)(["A red cat!"])[0], a[0])
    import zlib

    assert a[0, 0].item() == 1 + zlib.crc32(b"a") % 4095
    # truncation
    long = tok([" ".join(f"w{i}" for i in range(20))])
    assert long.shape == (1, 8) and (long > 0).all()
    assert torch.equal(long[0], torch.tensor([tok.word_id(f"w{i}") for i in range(8)]))


# ----------------------------------------------------------------------------- model


def test_shapes_and_encode_decode():
    model = _random_model()
    assert model.latent_shape == (3, 16, 16)
    cond = model.encode_prompts(PROMPTS)
    assert cond.shape == (4, SMALL.max_prompt_length) and cond.dtype == torch.long
    x, sigma = _inputs(model, 4)
    with torch.no_grad():
        v = model(x, sigma, cond)
    assert v.shape == x.shape and v.dtype == x.dtype
    img = model.decode(x)
    assert img.shape == (4, 3, 16, 16) and img.dtype == torch.float32
    assert img.min() >= 0 and img.max() <= 1

    for channels, expect in ((1, 3), (4, 3)):
        m = DiT(DiTConfig(image_size=8, in_channels=channels, patch_size=2, hidden_size=32, depth=1, num_heads=2))
        xs = torch.randn(2, *m.latent_shape)
        assert m(xs, torch.rand(2), m.encode_prompts(["x", ""])).shape == xs.shape
        assert m.decode(xs).shape == (2, expect, 8, 8)


def test_zero_init_outputs_zero_and_random_init_nonzero():
    torch.manual_seed(0)
    model = DiT(SMALL)
    x, sigma = _inputs(model, 3)
    cond = model.encode_prompts(PROMPTS[:3])
    with torch.no_grad():
        assert torch.count_nonzero(model(x, sigma, cond)) == 0
        model.init_weights(zero_out=False)
        v = model(x, sigma, cond)
    assert v.abs().min() > 0 and v.abs().mean() > 1e-3


def test_prompt_sigma_and_unconditional_change_output():
    model = _random_model()
    x, sigma = _inputs(model, 1)
    outs = []
    with torch.no_grad():
        for p in ["a red cat", "a blue dog", ""]:
            v = model(x, sigma, model.encode_prompts([p]))
            assert torch.isfinite(v).all()
            outs.append(v)
        assert not torch.allclose(outs[0], outs[1])
        assert not torch.allclose(outs[0], outs[2])  # null embedding differs from any prompt
        assert not torch.allclose(outs[1], outs[2])
        cat = model.encode_prompts(["a red cat"])
        assert not torch.allclose(model(x, sigma, cat), model(x, sigma * 0.5, cat))
        # word order does not matter (mean pooling: the same tokens summed in another order, so equal up to float
        # rounding, which depends on the CPU's vector width), case does not either
        assert torch.allclose(model(x, sigma, model.encode_prompts(["cat red a"])), outs[0], rtol=1e-5, atol=1e-6)


def test_batch_consistency():
    model = _random_model()
    x, sigma = _inputs(model, 4)
    cond = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        batched = model(x, sigma, cond)
        single = torch.cat([model(x[i : i + 1], sigma[i : i + 1], cond[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)


def test_scalar_sigma_broadcast():
    model = _random_model()
    x, _ = _inputs(model, 2)
    cond = model.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        a = model(x, torch.tensor(0.3), cond)
        b = model(x, torch.full((2,), 0.3), cond)
    torch.testing.assert_close(a, b)


def test_float64():
    model = _random_model().double()
    x, sigma = _inputs(model, 4, dtype=torch.float64)
    cond = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        v = model(x, sigma, cond)
        single = torch.cat([model(x[i : i + 1], sigma[i : i + 1], cond[i : i + 1]) for i in range(4)])
        v32 = _random_model()(x.float(), sigma.float(), cond)
    assert v.dtype == torch.float64 and model.pos_embed.dtype == torch.float64
    torch.testing.assert_close(v, single, atol=1e-9, rtol=0)
    torch.testing.assert_close(v.float(), v32, atol=1e-4, rtol=1e-4)
    # autograd in float64 (gradcheck on the input x, tiny model)
    tiny = DiT(DiTConfig(image_size=4, in_channels=1, patch_size=2, hidden_size=16, depth=1, num_heads=2))
    tiny.init_weights(zero_out=False).double()
    xt = torch.randn(1, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    st = torch.tensor([0.4], dtype=torch.float64)
    ct = tiny.encode_prompts(["hello world"])
    assert torch.autograd.gradcheck(lambda inp: tiny(inp, st, ct), (xt,))


def test_bf16_autocast_accepts_float32_sigma():
    model = _random_model()
    x, sigma = _inputs(model, 2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        v = model(x, sigma, model.encode_prompts(PROMPTS[:2]))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_gradients_reach_all_parameters():
    model = _random_model().train()
    x, sigma = _inputs(model, 4)
    cond = model.encode_prompts(PROMPTS)  # includes "" so the null embedding is used
    (model(x, sigma, cond) ** 2).sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or torch.count_nonzero(p.grad) == 0]
    assert not missing, f"parameters without gradient: {missing}"
    # justified exception inside a parameter: the padding row of the token table never gets a gradient
    assert torch.count_nonzero(model.y_embedder.embedding.weight.grad[0]) == 0


def test_zero_init_gradients_still_flow_to_output_layers():
    torch.manual_seed(0)
    model = DiT(SMALL)
    x, sigma = _inputs(model, 2)
    (model(x, sigma, model.encode_prompts(PROMPTS[:2])) - x).pow(2).sum().backward()
    assert torch.count_nonzero(model.final_layer.linear.weight.grad) > 0


def test_pos_embed_matches_dit_formula():
    import math

    emb = get_2d_sincos_pos_embed(8, 3)  # [9, 8]; token t = (row i, col j) = (t // 3, t % 3)
    t = 5
    i, j = divmod(t, 3)
    omega = [1.0, 0.01]  # 1 / 10000^(k / 2) for k = 0, 1 (embed_dim 4 per axis)
    expect = [math.sin(j * w) for w in omega] + [math.cos(j * w) for w in omega]
    expect += [math.sin(i * w) for w in omega] + [math.cos(i * w) for w in omega]
    torch.testing.assert_close(emb[t], torch.tensor(expect, dtype=torch.float64))


def test_large_config_param_count():
    cfg = DiTConfig(image_size=32, in_channels=4, patch_size=2, hidden_size=512, depth=6, num_heads=8)
    model = DiT(cfg)
    n = model.num_params()
    print(f"DiT(hidden 512, depth 6, heads 8, patch 2): {n / 1e6:.2f}M parameters")
    assert n >= 20_000_000
    assert n == model.num_params(trainable_only=True)


@pytest.mark.parametrize("bad", [dict(image_size=30, patch_size=4)])
def test_bad_config(bad):
    with pytest.raises(ValueError):
        DiT(DiTConfig(**bad))
