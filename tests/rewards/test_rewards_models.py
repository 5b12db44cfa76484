"""Model-based offline rewards: the CLIP family against by-hand transformers math on a tiny random CLIP, their
official file layouts, and their autocast dtypes (the ImageNet and OCR rewards: test_rewards_imagenet_ocr.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jagg_scale.rewards import available, build_reward
from extras import need
from tiny_clip import PROJ_DIM, make_tiny_clip

transformers = need("transformers")

MEAN, STD = [0.5, 0.4, 0.3], [0.25, 0.2, 0.3]  # not CLIP's defaults, to prove preprocessor_config.json is read


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """Directory with a random tiny CLIPModel (safetensors), its tokenizer and a preprocessor config."""
    return make_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), mean=MEAN, std=STD)


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


# ------------------------------------------------------------------------------------------------ official files

VIT_H14 = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from hub_cache import offline_hub

    return offline_hub(monkeypatch, tmp_path / "hf")


@pytest.fixture(scope="module")
def hps_clip(tmp_path_factory):
    """A tiny CLIPModel shaped like open_clip ViTs (head width 64; vision and text of different widths and depths,
    so the conversion must read each from the shapes) and the same weights as open_clip keys, saved the way the
    HPS release is: {'state_dict': ...} in HPS_v2.1_compressed.pt."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(3)
    text = dict(vocab_size=514, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=1,
                max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513, hidden_act="gelu")
    vision = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8, hidden_act="gelu")
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=PROJ_DIM)).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(80.0))
    d = tmp_path_factory.mktemp("hps")
    torch.save({"state_dict": _open_clip_layout(model)}, d / "HPS_v2.1_compressed.pt")
    return model, d / "HPS_v2.1_compressed.pt"


def _open_clip_layout(model) -> dict:
    """model's weights under open_clip's CLIP key names (open_clip/model.py, transformer.py), written from
    open_clip's side: in_proj = [q; k; v], proj / text_projection multiply from the right ([width, embed])."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    used = set()

    def take(key):
        used.add(key)
        return sd[key]

    oc = {"visual.conv1.weight": take("vision_model.embeddings.patch_embedding.weight"),
          "visual.class_embedding": take("vision_model.embeddings.class_embedding"),
          "visual.positional_embedding": take("vision_model.embeddings.position_embedding.weight"),
          "visual.proj": take("visual_projection.weight").T.contiguous(),
          "token_embedding.weight": take("text_model.embeddings.token_embedding.weight"),
          "positional_embedding": take("text_model.embeddings.position_embedding.weight"),
          "text_projection": take("text_projection.weight").T.contiguous(),
          "logit_scale": take("logit_scale"),
          "attn_mask": torch.full((77, 77), float("-inf")).triu(1)}  # saved by older open_clip versions
    for p in ("weight", "bias"):
        oc[f"visual.ln_pre.{p}"] = take(f"vision_model.pre_layrnorm.{p}")
        oc[f"visual.ln_post.{p}"] = take(f"vision_model.post_layernorm.{p}")
        oc[f"ln_final.{p}"] = take(f"text_model.final_layer_norm.{p}")
    for ours, theirs, depth in (("vision_model", "visual.transformer", 2), ("text_model", "transformer", 3)):
        for i in range(depth):
            a, b = f"{ours}.encoder.layers.{i}.", f"{theirs}.resblocks.{i}."
            for p in ("weight", "bias"):
                oc[f"{b}attn.in_proj_{p}"] = torch.cat([take(f"{a}self_attn.{x}_proj.{p}") for x in "qkv"])
                oc[f"{b}attn.out_proj.{p}"] = take(f"{a}self_attn.out_proj.{p}")
                oc[f"{b}ln_1.{p}"] = take(f"{a}layer_norm1.{p}")
                oc[f"{b}ln_2.{p}"] = take(f"{a}layer_norm2.{p}")
                oc[f"{b}mlp.c_fc.{p}"] = take(f"{a}mlp.fc1.{p}")
                oc[f"{b}mlp.c_proj.{p}"] = take(f"{a}mlp.fc2.{p}")
    assert used == set(sd), set(sd) - used  # every weight of the model went somewhere
    return oc


def _embeds(model, tokenizer_dir, pixel_values, prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    with torch.no_grad():
        img = model.get_image_features(pixel_values=pixel_values)
        txt = model.get_text_features(**tok(prompts, padding=True, return_tensors="pt"))
    pooled = lambda out: out if isinstance(out, torch.Tensor) else out.pooler_output
    return pooled(img), pooled(txt)


def _processor_files(tiny_clip):
    return {f: tiny_clip / f for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")}


def test_open_clip_conversion_reads_the_config_from_shapes(hps_clip):
    from jagg_scale.rewards.clip_checkpoints import load_state_file, open_clip_to_transformers

    model, pt = hps_clip
    config, state = open_clip_to_transformers(load_state_file(pt, "hps"))
    v, t = config.vision_config, config.text_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size, v.patch_size,
            v.image_size) == (128, 2, 2, 256, 8, 32)
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.intermediate_size, t.vocab_size,
            t.max_position_embeddings) == (64, 3, 1, 128, 514, 77)
    assert config.projection_dim == PROJ_DIM and v.hidden_act == t.hidden_act == "gelu"
    want = model.state_dict()
    assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)
    # a DistributedDataParallel checkpoint ('module.' prefix) converts the same
    ddp = {"module." + k: v for k, v in load_state_file(pt, "hps").items()}
    assert open_clip_to_transformers(ddp)[1].keys() == state.keys()


def test_hps_loads_the_official_open_clip_file(hps_clip, tiny_clip, hub):
    from jagg_scale.hub import HubModelNotFoundError
    from hub_cache import put_in_hub_cache

    model, pt = hps_clip
    r = build_reward("hps", path=str(pt), processor_path=str(tiny_clip), device="cpu", batch_size=2)
    pixels = r.backbone.preprocess(IMAGES)
    img, txt = _embeds(model, tiny_clip, pixels, PROMPTS)
    torch.testing.assert_close(r.backbone.image_embeds(IMAGES), img, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.backbone.text_embeds(PROMPTS), txt, rtol=1e-5, atol=1e-5)
    scores = r(IMAGES, PROMPTS, META).scores
    torch.testing.assert_close(scores, F.cosine_similarity(img, txt, dim=-1), rtol=1e-5, atol=1e-5)
    assert abs(r.backbone.logit_scale() - 80.0) < 1e-3
    # as published: the file from the xswu/HPSv2 repo, its processor ViT-H-14's (the default), both from the cache
    with pytest.raises(HubModelNotFoundError, match=rf"(?s)hps: .*{VIT_H14}.*hf download {VIT_H14} --include"):
        build_reward("hps", path=str(pt), device="cpu")
    put_in_hub_cache(hub, "xswu/HPSv2", {"HPS_v2.1_compressed.pt": pt})
    put_in_hub_cache(hub, VIT_H14, _processor_files(tiny_clip))
    cached = build_reward("hps", path="xswu/HPSv2/HPS_v2.1_compressed.pt", device="cpu", batch_size=2)
    torch.testing.assert_close(cached(IMAGES, PROMPTS, META).scores, scores, rtol=0, atol=0)


def test_pickscore_from_the_published_hub_layout(tiny_clip, by_hand, hub):
    from hub_cache import put_in_hub_cache

    model, image, text = by_hand
    # the model repo without a tokenizer, the processor from the ViT-H-14 repo
    put_in_hub_cache(hub, "yuvalkirstain/PickScore_v1",
                     {f: tiny_clip / f for f in ("config.json", "model.safetensors")})
    put_in_hub_cache(hub, VIT_H14, _processor_files(tiny_clip))
    r = build_reward("pickscore", path="yuvalkirstain/PickScore_v1", normalize=False, device="cpu")
    assert r.backbone.processor_path.parent.parent.name == "models--" + VIT_H14.replace("/", "--")
    cos = F.cosine_similarity(image(r.backbone.preprocess(IMAGES)), text(PROMPTS), dim=-1)
    torch.testing.assert_close(r(IMAGES, PROMPTS, META).scores, model.logit_scale.exp().item() * cos,
                               rtol=1e-5, atol=1e-4)
    explicit = build_reward("pickscore", path="yuvalkirstain/PickScore_v1", processor_path=VIT_H14, device="cpu")
    torch.testing.assert_close(explicit(IMAGES, PROMPTS, META).scores, r(IMAGES, PROMPTS, META).scores / 26.0,
                               rtol=1e-6, atol=1e-6)


def test_aesthetic_laion_linear_head(tiny_clip, by_hand, hub, tmp_path):
    from hub_cache import put_in_hub_cache

    _, image, _ = by_hand
    torch.manual_seed(4)
    linear = torch.nn.Linear(PROJ_DIM, 1)
    torch.save(linear.state_dict(), tmp_path / "sa_0_4_vit_l_14_linear.pth")  # keys 'weight', 'bias'
    put_in_hub_cache(hub, "openai/clip-vit-large-patch14",
                     {f: tiny_clip / f for f in ("config.json", "model.safetensors", "preprocessor_config.json")})
    r = build_reward("aesthetic", clip_path="openai/clip-vit-large-patch14",
                     head_path=str(tmp_path / "sa_0_4_vit_l_14_linear.pth"), device="cpu")
    emb = image(r.backbone.preprocess(IMAGES))
    with torch.no_grad():
        expect = linear(emb / emb.norm(dim=-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(r(IMAGES, PROMPTS, META).scores, expect, rtol=1e-5, atol=1e-5)
    torch.save(torch.nn.Linear(768, 1).state_dict(), tmp_path / "vitl.pth")
    with pytest.raises(ValueError, match=r"expects 768-d embeddings .* projects to 16"):
        build_reward("aesthetic", clip_path=str(tiny_clip), head_path=str(tmp_path / "vitl.pth"), device="cpu")


class _Payload:
    """Pickled as a call to Path.touch: a checkpoint that runs code when unpickled without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_checkpoints_with_code_are_refused_naming_the_file(tiny_clip, hps_clip, tmp_path):
    from jagg_scale.rewards.clip_checkpoints import CheckpointFormatError

    marker = tmp_path / "ran"
    evil_hps = tmp_path / "HPS_evil.pt"
    torch.save({"state_dict": torch.load(hps_clip[1], weights_only=True)["state_dict"], "x": _Payload(marker)},
               evil_hps)
    with pytest.raises(CheckpointFormatError, match=r"hps: refusing to load .*HPS_evil\.pt.*weights_only"):
        build_reward("hps", path=str(evil_hps), processor_path=str(tiny_clip), device="cpu")
    evil_head = tmp_path / "head_evil.pth"
    torch.save({"weight": torch.zeros(1, PROJ_DIM), "bias": _Payload(marker)}, evil_head)
    with pytest.raises(CheckpointFormatError, match=r"aesthetic: refusing to load .*head_evil\.pth"):
        build_reward("aesthetic", clip_path=str(tiny_clip), head_path=str(evil_head), device="cpu")
    assert not marker.exists()  # never executed
    with pytest.raises(FileNotFoundError, match=r"hps: no such checkpoint file .*HPS_v2\.1_compressed\.pt"):
        build_reward("hps", path=str(tmp_path / "HPS_v2.1_compressed.pt"), processor_path=str(tiny_clip))


def test_reward_allow_download_fetches_config_tokenizer_and_one_weights_file(tiny_clip, by_hand, hub, monkeypatch,
                                                                             tmp_path):
    import fnmatch

    import huggingface_hub
    from hub_cache import put_in_hub_cache

    repo = tmp_path / "repo"  # the hub repo: the CLIPModel plus a big open_clip copy a fetch must leave out
    repo.mkdir()
    for f in tiny_clip.iterdir():
        (repo / f.name).write_bytes(f.read_bytes())
    (repo / "open_clip_pytorch_model.bin").write_bytes(b"not needed")
    calls = []

    def fake_snapshot_download(repo_id, *, cache_dir, allow_patterns=None, **kw):
        calls.append((repo_id, tuple(allow_patterns or ())))
        files = {f.name: f for f in repo.iterdir()
                 if allow_patterns is None or any(fnmatch.fnmatch(f.name, p) for p in allow_patterns)}
        return str(put_in_hub_cache(Path(cache_dir), repo_id, files))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(FileNotFoundError, match="allow_download"):
        build_reward("clip_score", path="openai/clip-vit-base", device="cpu")
    assert calls == []
    r = build_reward("clip_score", path="openai/clip-vit-base", allow_download=True, device="cpu")
    assert len(calls) == 1 and not (r.backbone.path / "open_clip_pytorch_model.bin").exists()
    _, image, text = by_hand
    cos = F.cosine_similarity(image(r.backbone.preprocess(IMAGES)), text(PROMPTS), dim=-1)
    torch.testing.assert_close(r(IMAGES, PROMPTS, META).scores, cos, rtol=1e-5, atol=1e-5)
    build_reward("clip_score", path="openai/clip-vit-base", allow_download=True, device="cpu")
    assert len(calls) == 1  # cached now: not fetched again


def test_missing_reward_hub_id_names_the_id_cache_and_command(hub):
    from jagg_scale.hub import HubModelNotFoundError

    with pytest.raises(HubModelNotFoundError) as err:
        build_reward("pickscore", path="yuvalkirstain/PickScore_v1", device="cpu")
    text = str(err.value)
    for needed in ("pickscore", "yuvalkirstain/PickScore_v1", str(hub), "hf download yuvalkirstain/PickScore_v1",
                   "allow_download: true"):
        assert needed in text, (needed, text)


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "hps"])
def test_autocast_scores_rank_as_the_float32_ones(tiny_clip, name):
    """dtype autocast (float32 weights, bf16 matmuls): on a fixed set of 96 images (smooth colour fields, each a
    different mix) the scores rank as float32's (Spearman >= 0.999), though they are not equal."""
    gen = torch.Generator().manual_seed(0)
    base = torch.rand(96, 3, 1, 1, generator=gen)
    ramp = torch.linspace(0, 1, 32).view(1, 1, 1, 32) * torch.rand(96, 3, 1, 1, generator=gen)
    images = (0.6 * base + 0.4 * ramp).clamp(0, 1).expand(96, 3, 32, 32).contiguous()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(96)]
    meta = [{}] * 96
    fp32 = build_reward(name, path=str(tiny_clip), device="cpu")(images, prompts, meta).scores
    amp = build_reward(name, path=str(tiny_clip), device="cpu", dtype="autocast")(images, prompts, meta).scores
    assert not torch.equal(fp32, amp) and _spearman(fp32, amp) >= 0.999, _spearman(fp32, amp)


def test_a_bad_reward_dtype_names_the_choices(tiny_clip):
    with pytest.raises(ValueError, match=r"clip_score: dtype must be one of \['autocast', 'bfloat16', 'float16', "
                                         r"'float32'\], got 'fp8'"):
        build_reward("clip_score", path=str(tiny_clip), device="cpu", dtype="fp8")
