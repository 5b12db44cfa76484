"""The editing reward clip_direction (rewards/edit.py) on a tiny random CLIP and real input-image files: the score
against the directional similarity computed by hand from CLIP embeddings, the caption direction where a record has
captions, the preserve term, and the clear error for a prompt without an input image."""


import pytest
import torch
import torch.nn.functional as F
from extras import need
from tiny_clip import make_tiny_clip

from jagg_scale.data import EditPrompt
from jagg_scale.data.images import load_rgb
from jagg_scale.rewards import build_reward

need("transformers")


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def edits(tmp_path_factory):
    """Two edit prompts whose input images are PNG files; the outputs are other images of the same size."""
    from PIL import Image

    d = tmp_path_factory.mktemp("edits")
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for i, text in enumerate(["make it red", "add a hat"]):
        pixels = (torch.rand(24, 24, 3, generator=gen) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(d / f"in{i}.png")
        prompts.append(EditPrompt(text, str(d / f"in{i}.png")))
    outputs = torch.rand(2, 3, 24, 24, generator=gen)
    return prompts, outputs


def unit(reward, images, texts):
    """Unit CLIP embeddings of images and texts by the backbone (whose embeddings test_rewards_models.py checks
    against transformers by hand): what this file checks is the edit arithmetic on top."""
    b = reward.backbone
    return F.normalize(b.image_embeds(images), dim=-1), F.normalize(b.text_embeds(texts), dim=-1)


def test_the_score_is_the_directional_similarity_by_hand(clip_dir, edits):
    prompts, outputs = edits
    reward = build_reward("clip_direction", path=str(clip_dir), device="cpu")
    out = reward(outputs, prompts, [{}, {}])
    inputs = torch.stack([load_rgb(p.image, 24) for p in prompts])
    (i_out, t), (i_in, _) = unit(reward, outputs, [str(p) for p in prompts]), unit(reward, inputs, ["x"])
    want = F.cosine_similarity(i_out - i_in, t, dim=-1)
    assert out.scores.shape == (2,) and torch.allclose(out.scores, want, atol=1e-4)
    assert out.info["clip_direction_mean"] == pytest.approx(float(want.mean()), abs=1e-4)


def test_captions_set_the_text_direction_and_preserve_adds_the_similarity_to_the_input(clip_dir, edits):
    prompts, outputs = edits
    meta = [{"input_caption": "a plain photo", "output_caption": "a red photo"}, {}]
    reward = build_reward("clip_direction", path=str(clip_dir), preserve=0.5, device="cpu")
    out = reward(outputs, prompts, meta)
    inputs = torch.stack([load_rgb(p.image, 24) for p in prompts])
    i_out, t = unit(reward, outputs, ["a red photo", str(prompts[1])])
    i_in, t_before = unit(reward, inputs, ["a plain photo", "unused"])
    text = torch.stack([t[0] - t_before[0], t[1]])
    want = F.cosine_similarity(i_out - i_in, text, dim=-1) + 0.5 * (i_out * i_in).sum(-1)
    assert torch.allclose(out.scores, want, atol=1e-4)
    same = reward(inputs, prompts, [{}, {}])  # no edit at all: no direction, only what was kept (all of it)
    assert torch.allclose(same.scores, torch.full((2,), 0.5), atol=1e-4)


def test_a_prompt_without_an_input_image_is_refused_by_name(clip_dir):
    reward = build_reward("clip_direction", path=str(clip_dir), device="cpu")
    with pytest.raises(ValueError, match="clip_direction scores edits.*'a cat' has none"):
        reward(torch.rand(1, 3, 24, 24), ["a cat"], [{}])


def test_a_remote_judge_gets_the_input_images_and_scores_the_edit_as_locally(clip_dir, edits):
    """The real server (uvicorn on loopback) serving clip_direction, the real `remote` client: the request carries
    each prompt's input image (`input_images`), the server hands the reward edit prompts, the scores agree with local
    scoring; a request whose input_images do not pair with its images is a 400 naming the field."""
    import json
    import threading
    import urllib.error
    import urllib.request

    need("uvicorn")
    need("starlette")
    from hang_guard import WAIT_S

    from jagg_scale.rewards.server import encode_images, serve

    prompts, outputs = edits
    outputs = (outputs * 255).round() / 255  # what a PNG carries: the local score on the same pixels
    local = build_reward("clip_direction", path=str(clip_dir), device="cpu", preserve=0.3)
    srv = serve({"clip_direction": build_reward("clip_direction", path=str(clip_dir), device="cpu", preserve=0.3)},
                host="127.0.0.1", port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        remote = build_reward("remote", url=srv.url, reward="clip_direction", retries=0, timeout_s=float(WAIT_S))
        got = remote(outputs, prompts, [{}, {}])
        assert torch.allclose(got.scores, local(outputs, prompts, [{}, {}]).scores, atol=1e-5)
        body = json.dumps({"prompts": ["a", "b"], "metadata": [{}, {}], "images": encode_images(outputs),
                           "input_images": encode_images(outputs[:1])}).encode()
        req = urllib.request.Request(srv.url.rstrip("/") + "/score/clip_direction", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=WAIT_S)  # a hang guard only
        assert err.value.code == 400 and "input_images" in json.loads(err.value.read())["error"]
    finally:
        srv.shutdown()
        srv.server_close()
