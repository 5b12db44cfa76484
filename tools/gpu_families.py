"""The device check's `families` section (tools/gpu_check.py --sections families): one window per step and by JAGG
at each newer model family's real shape, random weights (issue 27 item 5). --tiny: the same code at toy shapes on
the CPU (tests/tools/test_gpu_check.py). Not in the default sections; priced from FLOPs (~0.1 PFLOP per Qwen-Image
row forward at 2537 tokens) it takes about a minute on an H200 as

    bash tools/gpu_check.sh --sections env,families --rows 4 --widths 4 --repeats 1

(at the defaults, 8 rows and widths 4 and 8 with 3 repeats, several minutes: leave room in the 8-minute budget)."""

from __future__ import annotations

import time

import torch

from gpu_timing import rollout_and_windows, sync  # noqa: E402 - tools/ is on the path

# Qwen-Image at configs/qwenimage_hps.yaml's shape: 720 px (90 x 90 latents, 2025 packed tokens), 512 prompt tokens
QWEN_LATENT, QWEN_TEXT = 90, 512
TINY_QWEN = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(2, 2, 4))


def section_families(args, device, state) -> dict:
    """Issue 27's new families at their real shape, random weights: Qwen-Image's 20.4B transformer (shapes/
    qwen_image.json) in bf16 with LoRA r32 (fp32) on the library's targets and per-block checkpointing, an on-policy
    rollout of B rows, then one window of each width per step and by JAGG (time_windows)."""
    from diffusers import QwenImageTransformer2DModel

    from jagg_scale.estimate.shapes import clean, pipeline_shapes
    from jagg_scale.models.lora import add_lora
    from jagg_scale.models.qwenimage import QwenImageTransformerVelocity

    state.pop("policy", None)  # the SD3.5 policy of earlier sections: its memory back before 41 GB of weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cfg = dict(TINY_QWEN) if args.tiny else clean(pipeline_shapes(None, "qwen_image")["components"]["transformer"]
                                                  ["config"])
    side, text = (8, 8) if args.tiny else (QWEN_LATENT, QWEN_TEXT)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        transformer = QwenImageTransformer2DModel(**cfg).to(torch.bfloat16)  # the LoRA base in the compute dtype
    add_lora(transformer, rank=args.lora_rank, alpha=2 * args.lora_rank, dtype=torch.float32)
    transformer.enable_gradient_checkpointing()
    policy = QwenImageTransformerVelocity(transformer, side, autocast=torch.bfloat16).train()
    for p in policy.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    sync(device)
    info = {"qwen_image": {"parameters": sum(p.numel() for p in policy.parameters()),
                           "lora_parameters": sum(p.numel() for p in policy.parameters() if p.requires_grad),
                           "build_seconds": round(time.perf_counter() - t0, 1), "latent": list(policy.latent_shape),
                           "tokens_per_row": (side // 2) ** 2 + text, "rows": args.rows}}
    gen = torch.Generator(device).manual_seed(0)
    cond = (torch.randn(args.rows, text, cfg["joint_attention_dim"], generator=gen, device=device),
            torch.ones(args.rows, text, dtype=torch.int64, device=device))
    noise = torch.randn(args.rows, *policy.latent_shape, generator=gen, device=device)
    info["qwen_image"] |= rollout_and_windows(args, device, policy, cond, noise, gen)
    del policy, transformer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info
