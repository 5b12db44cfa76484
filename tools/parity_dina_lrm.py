"""jagg_scale.rewards.dina_lrm against DiNa-LRM's own code (HKUST-C4G/diffusion-rm at af485b4) on the tiny SD3:
their SD3RewardModel with every LoRA and head weight random, saved in their layout, scored by their DRMInferencer
and by ours from the same files, their unseeded noise made ours.

    PYTHONPATH=REFERENCE_CHECKOUT:EXTRA_SITE python -m tools.parity_dina_lrm

REFERENCE_CHECKOUT: a checkout of HKUST-C4G/diffusion-rm (its `diffusion_rm` package importable); EXTRA_SITE: a
directory holding omegaconf (their config reader; not a dependency of this project). Prints both scores and their
largest difference (2026-12-07: 0.0)."""
import json
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf  # noqa: E402
from diffusers import StableDiffusion3Pipeline  # noqa: E402
from jagg_scale.models.tiny import make_tiny_sd3  # noqa: E402
from diffusion_rm.models.sd3_rm import SD3RewardModel  # noqa: E402
from diffusion_rm.infer.inference import DRMInferencer  # noqa: E402
from jagg_scale.rewards import build_reward  # noqa: E402

work = Path(tempfile.mkdtemp(prefix="parity_dina_lrm_"))
pipe_dir = make_tiny_sd3(work / "pipe")
pipe = StableDiffusion3Pipeline.from_pretrained(pipe_dir, torch_dtype=torch.float32)
L = len(pipe.transformer.transformer_blocks) - 1  # the last block is context_pre_only (no text out), as in SD3.5's 24th
print("layers", L, "inner", pipe.transformer.inner_dim)
model_cfg = {"num_transformer_layers": L, "freeze_backbone": False, "use_lora": True, "use_text_features": True,
             "lora_config": {"r": 4, "lora_alpha": 8, "init_lora_weights": "gaussian"},
             "use_logistic": False, "visual_head_idx": sorted({1, L}), "text_head_idx": sorted({1, L}),
             "use_t_embed": True,
             "reward_head": {"use_proj_in": False, "width": -1, "out_dim": 1, "num_queries": 4, "num_attn_heads": 2,
                             "dropout": 0.0}}
cfg = OmegaConf.create({"model": model_cfg, "training": {"add_noise": True}})
torch.manual_seed(0)
ref = SD3RewardModel(pipe, cfg.model, "cpu", torch.float32)
with torch.no_grad():  # every LoRA and head weight random (their inits zero B and the gates: a trivial check)
    for n, p in ref.backbone.named_parameters():
        if "lora_" in n:
            p.copy_(torch.randn_like(p) * 0.2)
    for p in ref.reward_head.parameters():
        p.copy_(torch.randn_like(p) * 0.2)
ckpt = work / "drm"
(ckpt / "checkpoint").mkdir(parents=True, exist_ok=True)
ref.backbone.save_pretrained(ckpt / "checkpoint" / "backbone_lora")
torch.save(ref.reward_head.state_dict(), ckpt / "checkpoint" / "rm_head.pt")
(ckpt / "config.json").write_text(json.dumps({"model": model_cfg, "training": {"add_noise": True}}))
print(sorted((ckpt / "checkpoint" / "backbone_lora").iterdir()))

ours = build_reward("dina_lrm", path=str(ckpt), pipeline=str(pipe_dir), sigma=0.4, dtype="float32", device="cpu",
                    max_sequence_length=32)
pipe2 = StableDiffusion3Pipeline.from_pretrained(pipe_dir, torch_dtype=torch.float32)
theirs = DRMInferencer(pipe2, str(ckpt / "config.json"), str(ckpt / "checkpoint"), load_from_disk=True, device="cpu",
                       model_dtype=torch.float32)
prompts = ["a red cube on a table", "two cats"]
latents = torch.randn(2, pipe.transformer.config.in_channels, 16, 16, generator=torch.Generator().manual_seed(3))
noise = ours._noise(latents)
real_randn_like = torch.randn_like
torch.randn_like = lambda x, *a, **k: noise.to(x.dtype)  # their unseeded draw, made ours
# their encode_prompt pads CLIP to 77 tokens (the tiny CLIP has 32 positions): the conditioning from diffusers'
# StableDiffusion3Pipeline.encode_prompt, what ours encodes with
pe, _, pooled, _ = pipe2.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device="cpu",
                                       do_classifier_free_guidance=False, max_sequence_length=32)
with torch.no_grad():
    t_score = theirs.reward({"encoder_hidden_states": pe, "pooled_projections": pooled}, latents, u=0.4)
torch.randn_like = real_randn_like
o_score = ours(latents, prompts, [{}] * 2).scores
print("theirs", t_score.flatten().tolist())
print("ours  ", o_score.tolist())
print("max abs diff", (t_score.flatten() - o_score).abs().max().item())
