"""Prompt encoding once per distinct prompt (train/policy.py Policy.encode, distinct_prompts): a rank holds each of
its prompts group_size times at most; every distinct prompt is encoded once, in order of first appearance, and its
rows are copies of that encoding (cond.index_cond), CFG's negative half per distinct input image for edits.

Bit-identical to encoding every row, for every model family's tiny pipeline (tensors, Tokens with host lengths, edit
prompts with their input images, the negative half). Sizes: 16 distinct prompts x 2 rows, because a row's numbers
depend on its batch where the CPU libraries take another kernel for a small one: on this machine (MKL 2024.2 and
oneDNN 3.12, AVX-512) sgemm gives other bits for M <= 3 rows at 1 thread and M < 12 at 2 threads (a linear layer's
first M rows alone vs in a larger batch), and Qwen-Image's 3-D VAE convolution for fewer than 16 images at 1 thread
(2 at 2 threads) against 32. Measured: 3 distinct prompts instead of 24 rows moved SD3's pooled CLIP projection
(M = prompts) by 2.4e-7 and Qwen-Image-Edit's input-image latents by 1.5e-7 (12 vs 24 images at 1 thread: 1.3e-7);
the text embeddings of every family stayed identical at every size. At 16 prompts every layer takes its large-batch
path here, so the comparison is exact; a machine whose libraries switch kernels at larger batches would differ there
by ~1e-7 (as a rank's rows already do between world sizes today: they change its encode batch).
"""

import io

import pytest
import torch
from extras import need

from jagg_scale.cond import Tokens, expand_cond
from jagg_scale.data import EditPrompt
from jagg_scale.train.policy import distinct_prompts

WORDS = ["a", "the", "photo", "of", "cat", "dog", "red", "blue", "digit", "one", "two", "three", "on", "with"]
PROMPTS = [" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(2 + i % 5)) for i in range(16)]
ORDER = torch.randperm(32, generator=torch.Generator().manual_seed(3)).tolist()  # the rows as a rank holds them


def test_distinct_prompts_in_order_of_first_appearance():
    distinct, index = distinct_prompts(["b", "a", "b", "c", "a"])
    assert distinct == ["b", "a", "c"] and index.tolist() == [0, 1, 0, 2, 1] and index.device.type == "cpu"


def test_an_edit_prompt_is_its_text_and_its_image():
    cat, dog = b"\x89PNG cat", b"\x89PNG dog"
    rows = [EditPrompt("make it blue", cat), EditPrompt("make it blue", dog), EditPrompt("make it blue", bytes(cat)),
            "make it blue", EditPrompt("make it red", cat)]
    distinct, index = distinct_prompts(rows)
    assert index.tolist() == [0, 1, 0, 2, 3]  # same text, other image: apart; same bytes: together; text alone apart
    assert [getattr(p, "image", None) for p in distinct] == [cat, dog, None, cat]


def test_unhashable_prompts_are_encoded_row_by_row():
    rows = [["a"], ["a"]]
    distinct, index = distinct_prompts(rows)
    assert index is None and distinct == rows


def _images(n: int) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (20 * i, 255 - 20 * i, (70 * i) % 256)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _every_row(policy, prompts):
    """What Policy.encode computed before: the encoders on every row (the reference)."""
    model = policy.model
    cond = model.encode_prompts(prompts)
    if policy.guidance == 1.0:
        return cond
    if getattr(prompts[0], "image", None) is not None:
        return cond, model.encode_prompts([EditPrompt(policy.negative_prompt, p.image) for p in prompts])
    return cond, expand_cond(model.encode_prompts([policy.negative_prompt]), len(prompts))


def _assert_identical(a, b, where="cond"):
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b), (where, (a - b).abs().max().item())
    elif isinstance(a, Tokens):
        assert a.lengths == b.lengths, where
        _assert_identical(a.embeds, b.embeds, where + ".embeds")
        _assert_identical(a.mask, b.mask, where + ".mask")
    else:
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")


KINDS = ["dit", "sd3", "flux", "qwenimage", "flux2", "zimage", "flux_kontext", "wan", "qwenimage_edit"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_family_encodes_each_prompt_once_as_encoding_every_row(kind, request):
    from pathlib import Path

    from jagg_scale.models import build_model
    from jagg_scale.train import load_config
    from jagg_scale.train.policy import Policy

    root = Path(__file__).resolve().parents[2]
    if kind == "dit":
        cfg = load_config(root / "configs" / "tiny_cpu.yaml", ["sampling.guidance=4.0"])
    else:
        need("diffusers")
        need("transformers")
        pipe = request.getfixturevalue(f"{kind}_dir")
        cfg = load_config(root / "configs" / f"{kind}_tiny_cpu.yaml",
                          [f"model.pretrained={pipe}", f"model.resolution={32 if kind == 'flux2' else 16}"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    policy = Policy(model, cfg, torch.device("cpu"), rollout_batch=8)
    policy.cfg.sampling.guidance = 4.0  # the negative half too, in every family (what the encoders see is checked)
    records = PROMPTS
    if kind in ("flux_kontext", "qwenimage_edit"):
        records = [EditPrompt(p, image) for p, image in zip(PROMPTS, _images(len(PROMPTS)))]
    rows = [records[i // 2] for i in ORDER]  # each prompt twice, shuffled
    seen = []
    encode = model.encode_prompts
    model.encode_prompts = lambda prompts: (seen.append(len(prompts)), encode(prompts))[1]
    policy.take_counts()
    ours = policy.encode(rows)
    del model.encode_prompts  # the class's again
    edits = kind in ("flux_kontext", "qwenimage_edit")
    assert seen == ([16, 16] if edits else [16, 1])  # each distinct prompt once (and its input image's negative)
    assert policy.take_counts() == {"encode_rows": 32, "encode_prompts": 16}
    _assert_identical(ours, _every_row(policy, rows))
