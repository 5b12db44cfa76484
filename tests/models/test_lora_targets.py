"""Each family's LoRA targets on its real-shape transformer (built on the meta device from estimate/shapes/*.json):
the modules peft wraps with the family's default equal the modules our matcher (the estimator's) counts, equal the
modules the cited peer's own list wraps, and their number is the recipe's (issue 34 item 1: SD3.5-medium 191 modules,
18.8M parameters at r 32, as in Flow-GRPO and DiffusionNFT; 243 / 23.9M with the bare suffixes used before)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from extras import need

need("diffusers")
need("peft")

from jagg_scale.estimate.shapes import meta_module, pipeline_shapes, transformer_stats  # noqa: E402
from jagg_scale.models.lora import lora_module_names, lora_parameters, lora_targets, target_matches  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SD3_PEER = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
            "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]

# (shape file, model.kind, the peer's list as its code writes it (file:line at the commit in the velocity class),
#  modules wrapped, LoRA parameters at r 32)
FAMILIES = {
    # yifan123/flow_grpo scripts/train_sd3.py:419-428; NVlabs/DiffusionNFT scripts/train_nft_sd3.py:420-429
    "sd35_medium": ("sd3", SD3_PEER, 191, 18_776_064),
    "sd35_large": ("sd3", SD3_PEER, 303, 47_161_344),
    # XueZeyue/DanceGRPO fastvideo/train_grpo_flux_lora.py:663
    "flux1_dev": ("flux", ["to_k", "to_q", "to_v", "to_out.0"], 190, 37_355_520),
    # X-GenGroup/Flow-Factory src/flow_factory/models/flux/flux1_kontext.py:142-146
    "flux1_kontext_dev": ("flux_kontext", [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff_context.net.0.proj", "ff.net.2", "ff_context.net.2"], 342, 89_653_248),
    # Flow-Factory src/flow_factory/models/flux/flux2_klein.py:94-104
    "flux2_klein": ("flux2", [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
        "attn.to_qkv_mlp_proj", "attn.to_out.0"], 80, 38_338_560),
    # Flow-Factory src/flow_factory/models/qwen_image/qwen_image.py:83-89
    "qwen_image": ("qwenimage", [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2.proj", "txt_mlp.net.0.proj", "txt_mlp.net.2.proj"], 600, 153_354_240),
    # Flow-Factory src/flow_factory/models/z_image/z_image.py:72-75
    "z_image": ("zimage", ["attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0",
                           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"], 238, 79_380_480),
    # Flow-Factory src/flow_factory/models/wan/wan2_t2v.py:76-85
    "wan21_t2v_14b": ("wan", ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                              "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                              "ffn.net.0.proj", "ffn.net.2"], 400, 153_354_240),
}


def _peft_wrapped(comp: dict, targets) -> tuple[list[str], int]:
    """(names peft wraps, LoRA parameters) of the real-shape transformer on the meta device at r 32."""
    from peft import LoraConfig

    model = meta_module(comp)
    with torch.device("meta"):  # the adapter's A and B on meta too: no memory, no init
        model.add_adapter(LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=list(targets)))
    return lora_module_names(model), sum(p.numel() for p in lora_parameters(model))


@pytest.mark.parametrize("shapes", [pytest.param(s, marks=[pytest.mark.slow] if s in ("qwen_image", "wan21_t2v_14b")
                                                 else []) for s in FAMILIES])  # the two largest: ~5 s each
def test_each_family_wraps_its_peers_modules_counted_alike_by_peft_and_the_estimator(shapes):
    kind, peer, modules, params = FAMILIES[shapes]
    comp = pipeline_shapes(None, shapes)["components"]["transformer"]
    targets = lora_targets(kind)
    wrapped, n_params = _peft_wrapped(comp, targets)
    stats = transformer_stats(comp, 32, targets)
    assert (len(wrapped), n_params) == (modules, params)
    assert (stats["lora_modules"], stats["lora_params"]) == (modules, params)  # the estimator counts what peft wraps
    assert sum(stats["block_lora"]) == params  # every wrapped module inside a block (the per-block sharding's share)
    assert set(_peft_wrapped(comp, peer)[0]) == set(wrapped)  # the peer's own list wraps the same modules


def test_sd35_medium_leaves_the_dual_attention_blocks_attn2_out():
    """The bare suffixes (the library's targets before issue 34) also wrapped attn2 of the 13 dual-attention
    blocks: 243 modules, 23.9M parameters. The attn.-prefixed ones do not."""
    comp = pipeline_shapes(None, "sd35_medium")["components"]["transformer"]
    bare = [t.removeprefix("attn.") for t in SD3_PEER]
    wrapped, n_params = _peft_wrapped(comp, bare)
    assert (len(wrapped), n_params) == (243, 23_887_872)
    assert sum(".attn2." in n for n in wrapped) == 13 * 4
    assert not any(".attn2." in n for n in _peft_wrapped(comp, lora_targets("sd3"))[0])


@pytest.mark.parametrize("targets", [
    ["attn.to_q"], ["to_q"], ["transformer_blocks.0.attn.to_q"], ["attn.to_out.0", "add_q_proj"], ["q"],
    ["transformer_blocks.0"], ["0.attn.to_q"],
])
def test_target_matches_is_peft_s_rule(targets):
    """target_matches against peft's own check_target_module_exists (a list: a name, or its ending after a dot) on
    every module name of SD3.5-medium; "q" and "transformer_blocks.0" are neither a name's ending after a dot nor
    substrings peft would accept."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=list(targets))
    model = meta_module(pipeline_shapes(None, "sd35_medium")["components"]["transformer"])
    names = [n for n, _ in model.named_modules()]
    ours = [n for n in names if target_matches(n, targets)]
    assert ours == [n for n in names if check_target_module_exists(config, n)]


def test_the_estimator_counts_the_configs_targets():
    """jagg-estimate sizes the LoRA the trainer builds: the family's default (191 on sd35m_pickscore), or
    model.lora.targets when the config sets them."""
    from jagg_scale.estimate.memory import prepare
    from jagg_scale.train import load_config

    config = ROOT / "configs" / "sd35m_pickscore.yaml"
    stats = prepare(load_config(config, check_files=False), 8, memory=False)["stats"]
    assert stats["lora_modules"] == 191 and stats["lora_params"] == 18_776_064
    bare = "[" + ", ".join(t.removeprefix("attn.") for t in SD3_PEER) + "]"
    stats = prepare(load_config(config, [f"model.lora.targets={bare}"], check_files=False), 8, memory=False)["stats"]
    assert stats["lora_modules"] == 243
