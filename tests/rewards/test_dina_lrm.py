"""`dina_lrm` (jagg_scale/rewards/dina_lrm.py) on a tiny SD3: a checkpoint in DiNa-LRM's own layout (a peft adapter
saved by peft, the head's state dict saved by torch) loads; the merged LoRA computes what peft's runtime LoRA computes;
the score is a function of the latents; what the port does not implement, a LoRA naming no target and a head file
holding code are refused; a run trains on it without decoding. (Against the reference's own code, on the same tiny
SD3: scores equal to 1.2e-7; docs/rewards.md.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from extras import need

need("diffusers")
need("peft")

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


class Backbone(nn.Module):
    """DiNa-LRM's backbone module layout (its adapter's keys are relative to it): the embedders and the first n
    blocks."""

    def __init__(self, transformer, n: int):
        super().__init__()
        self.pos_embed, self.time_text_embed = transformer.pos_embed, transformer.time_text_embed
        self.context_embedder = transformer.context_embedder
        self.transformer_blocks = nn.ModuleList(transformer.transformer_blocks[:n])


def make_checkpoint(sd3_dir, out: Path, *, lora_scale: float = 0.2, **model) -> tuple[Path, nn.Module]:
    """A DiNa-LRM directory for the tiny SD3 (every LoRA and head weight random), and the peft-wrapped backbone."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model

    from jagg_scale.rewards.dina_lrm import RewardHead

    transformer = SD3Transformer2DModel.from_pretrained(Path(sd3_dir) / "transformer", local_files_only=True)
    n = len(transformer.transformer_blocks) - 1  # the last block outputs no text tokens (as SD3.5's 24th)
    cfg = {"num_transformer_layers": n, "visual_head_idx": sorted({1, n}), "text_head_idx": sorted({1, n}),
           "use_t_embed": True, "use_lora": True, "use_logistic": False,
           "lora_config": {"r": 4, "lora_alpha": 8, "init_lora_weights": "gaussian"},
           "reward_head": {"use_proj_in": False, "width": -1, "out_dim": 1, "num_queries": 4, "num_attn_heads": 2,
                           "dropout": 0.0}, **model}
    torch.manual_seed(0)
    peft_backbone = get_peft_model(Backbone(transformer, n), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    dim = transformer.inner_dim
    head = RewardHead(dim, len(cfg["visual_head_idx"]), len(cfg["text_head_idx"]), dim, num_attn_heads=2)
    with torch.no_grad():
        for name, p in peft_backbone.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * lora_scale)
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    (out / "checkpoint").mkdir(parents=True)
    peft_backbone.save_pretrained(out / "checkpoint" / "backbone_lora")
    torch.save(head.state_dict(), out / "checkpoint" / "rm_head.pt")
    (out / "config.json").write_text(json.dumps({"model": cfg, "training": {"add_noise": True}}))
    return out, peft_backbone


def reward(path, sd3_dir, **kw):
    from jagg_scale.rewards import build_reward

    return build_reward("dina_lrm", path=str(path), pipeline=str(sd3_dir), dtype="float32", device="cpu",
                        max_sequence_length=32, **kw)


def latents(n: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(seed))  # the tiny SD3's latents


def test_the_merged_lora_computes_what_peft_computes_and_the_score_follows_the_latents(sd3_dir, tmp_path):
    ckpt, peft_backbone = make_checkpoint(sd3_dir, tmp_path / "drm")
    r = reward(ckpt, sd3_dir, sigma=0.4)
    x = latents()
    cond, _, pooled, _ = r.encoder.encode_prompt(prompt=["a cat", "a dog"], prompt_2=None, prompt_3=None,
                                                device="cpu", do_classifier_free_guidance=False,
                                                max_sequence_length=32)
    ours = r.features(x, cond, pooled)
    peft_backbone.eval()
    with torch.no_grad():  # peft's LoRA at run time through the same blocks: the features the head reads
        bb = peft_backbone.base_model.model
        t = torch.full((2,), r.timestep)
        h, temb, ctx = bb.pos_embed(x), bb.time_text_embed(t, pooled), bb.context_embedder(cond)
        for block in bb.transformer_blocks:
            ctx, h = block(hidden_states=h, encoder_hidden_states=ctx, temb=temb)
    assert torch.allclose(ours[0][-1], h, atol=1e-5) and torch.allclose(ours[1][-1], ctx, atol=1e-5)
    assert torch.equal(ours[2], temb)
    a = r(x, ["a cat", "a dog"], [{}] * 2).scores
    assert torch.equal(a, r(x, ["a cat", "a dog"], [{}] * 2).scores)  # its noise is the latents' own
    assert not torch.equal(a, r(latents(seed=4), ["a cat", "a dog"], [{}] * 2).scores)
    assert not torch.equal(a, reward(ckpt, sd3_dir, sigma=0.1)(x, ["a cat", "a dog"], [{}] * 2).scores)
    shifted = reward(ckpt, sd3_dir, sigma=0.4, offset=10.0, scale=0.1)(x, ["a cat", "a dog"], [{}] * 2).scores
    assert torch.allclose(shifted, (a + 10.0) * 0.1)  # README's (raw + 10) / 10
    assert abs(r.sigma - 0.4) < 0.01 and math.isclose(r.timestep, r.sigma * 1000, rel_tol=1e-3)
    no_lora, _ = make_checkpoint(sd3_dir, tmp_path / "zero", lora_scale=0.0)
    assert not torch.allclose(a, reward(no_lora, sd3_dir, sigma=0.4)(x, ["a cat", "a dog"], [{}] * 2).scores)


def test_what_the_port_does_not_implement_and_files_that_do_not_fit_are_refused(sd3_dir, tmp_path):
    from jagg_scale.checkpoint import UnsafeCheckpointError
    from jagg_scale.rewards import build_reward

    logistic, _ = make_checkpoint(sd3_dir, tmp_path / "logistic", use_logistic=True)
    with pytest.raises(ValueError, match="use_logistic on"):
        reward(logistic, sd3_dir)
    ckpt, _ = make_checkpoint(sd3_dir, tmp_path / "drm")
    adapter = ckpt / "checkpoint" / "backbone_lora" / "adapter_model.safetensors"
    from safetensors.torch import load_file, save_file

    state = load_file(adapter)
    key = next(k for k in state if k.endswith("attn.to_q.lora_A.weight"))
    state[key.replace("to_q", "norm_q")] = state.pop(key)
    save_file(state, adapter)
    with pytest.raises(ValueError, match="names no LoRA target of the backbone"):
        reward(ckpt, sd3_dir)
    ckpt, _ = make_checkpoint(sd3_dir, tmp_path / "pickled")

    class Planted:
        def __reduce__(self):
            return (print, ("planted",))

    torch.save({"x": Planted()}, ckpt / "checkpoint" / "rm_head.pt")
    with pytest.raises(UnsafeCheckpointError, match="rm_head.pt was refused"):
        reward(ckpt, sd3_dir)
    with pytest.raises(ValueError, match=r"option pipeline='/nowhere' holds no model_index.json"):
        reward(ckpt, "/nowhere")
    with pytest.raises(ValueError, match=r"option path=.* holds no checkpoint/rm_head.pt"):
        reward(tmp_path, sd3_dir)
    for bad in ({"dtype": "fp8"}, {"batch_size": 0}, {"sigma": 1.0}):
        with pytest.raises(ValueError, match=r"dina_lrm: (dtype|sigma)"):
            build_reward("dina_lrm", path=str(ckpt), pipeline=str(sd3_dir), **bad)


def test_a_run_trains_on_it_without_decoding(sd3_dir, tmp_path, monkeypatch):
    from jagg_scale.models import diffusers_common
    from train_runs import fit_metrics

    ckpt, _ = make_checkpoint(sd3_dir, tmp_path / "drm")
    calls: list = []
    monkeypatch.setattr(diffusers_common.DiffusersVelocity, "decode",
                        lambda self, x: calls.append(len(x)) or pytest.fail("decoded"))
    options = {"path": str(ckpt), "pipeline": str(sd3_dir), "dtype": "float32", "device": "cpu",
               "max_sequence_length": 32, "sigma": 0.4}
    rows = fit_metrics(ROOT / "configs" / "sd3_tiny_cpu.yaml", [
        f"model.pretrained={sd3_dir}", "train.steps=1", "sampling.num_steps=4", "reward.name=dina_lrm",
        f"reward.options={json.dumps(options)}", "eval.enabled=false", "run.checkpoint_every=0"], tmp_path / "run")
    assert len(rows) == 1 and calls == [] and rows[0]["reward_std"] > 0
