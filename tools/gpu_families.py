"""The device check's `families` section (tools/gpu_check.py --sections families): one window per step and by JAGG
at each newer model family's real shape, random weights (issue 27 item 5). --tiny: the same code at toy shapes on
the CPU (tests/tools/test_gpu_check.py). Not in the default sections; priced from FLOPs (~0.1 PFLOP per Qwen-Image
row forward at 2537 tokens, ~0.03 per Z-Image row at 1536) it takes about two minutes on an H200 as

    bash tools/gpu_check.sh --sections env,families --rows 4 --widths 4 --repeats 1

(at the defaults, 8 rows and widths 4 and 8 with 3 repeats, several minutes: leave room in the 8-minute budget)."""

from __future__ import annotations

import time

import torch

from gpu_timing import rollout_and_windows, sync  # noqa: E402 - tools/ is on the path

# each family at its production config's shape: (shape file, latent side, text tokens, tiny transformer config)
FAMILIES = {
    # configs/qwenimage_hps.yaml: 720 px (90 x 90 latents, 2025 packed tokens), 512 prompt tokens
    "qwen_image": ("qwen_image", 90, 512, dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                               attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                               axes_dims_rope=(2, 2, 4))),
    # configs/zimage_pickscore.yaml: 512 px (64 x 64 latents, 1024 tokens), prompts of up to 512 tokens
    "z_image": ("z_image", 64, 512, dict(in_channels=4, dim=16, n_layers=1, n_refiner_layers=1, n_heads=2,
                                         n_kv_heads=2, cap_feat_dim=16, axes_dims=[2, 2, 4], axes_lens=[256, 64, 64])),
}


def _family(name: str, cfg: dict, side: int, text: int, device, rows: int):
    """(bare transformer, its velocity module, the rows' conditioning) of one family, in bf16 on `device`."""
    gen = torch.Generator(device).manual_seed(1)
    if name == "qwen_image":
        from diffusers import QwenImageTransformer2DModel

        from jagg_scale.models.qwenimage import QwenImageTransformerVelocity as Velocity

        cls, width = QwenImageTransformer2DModel, cfg["joint_attention_dim"]
    else:
        from diffusers import ZImageTransformer2DModel

        from jagg_scale.models.zimage import ZImageTransformerVelocity as Velocity

        cls, width = ZImageTransformer2DModel, cfg["cap_feat_dim"]
    with torch.device(device):
        transformer = cls(**cfg).to(torch.bfloat16)  # the LoRA base in the compute dtype
    cond = (torch.randn(rows, text, width, generator=gen, device=device),
            torch.ones(rows, text, dtype=torch.int64, device=device))
    return transformer, Velocity, cond


def section_families(args, device, state) -> dict:
    """Issue 27's new families at their real shape, random weights (shapes/*.json): each transformer in bf16 with
    LoRA r32 (fp32) on the library's targets and per-block checkpointing, an on-policy rollout of B rows, then one
    window of each width per step and by JAGG (time_windows); one family's memory freed before the next."""
    from jagg_scale.estimate.shapes import clean, pipeline_shapes
    from jagg_scale.models.lora import add_lora

    state.pop("policy", None)  # the SD3.5 policy of earlier sections: its memory back before the larger weights
    info = {}
    for name, (shapes, real_side, real_text, tiny) in FAMILIES.items():
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cfg = dict(tiny) if args.tiny else clean(pipeline_shapes(None, shapes)["components"]["transformer"]["config"])
        side, text = (8, 8) if args.tiny else (real_side, real_text)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        transformer, Velocity, cond = _family(name, cfg, side, text, device, args.rows)
        add_lora(transformer, rank=args.lora_rank, alpha=2 * args.lora_rank, dtype=torch.float32)
        transformer.enable_gradient_checkpointing()
        policy = Velocity(transformer, side, autocast=torch.bfloat16).train()
        for p in policy.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        sync(device)
        tokens = (side // 2) ** 2 + text
        info[name] = {"parameters": sum(p.numel() for p in policy.parameters()),
                      "lora_parameters": sum(p.numel() for p in policy.parameters() if p.requires_grad),
                      "build_seconds": round(time.perf_counter() - t0, 1), "latent": list(policy.latent_shape),
                      "tokens_per_row": tokens, "rows": args.rows}
        gen = torch.Generator(device).manual_seed(0)
        noise = torch.randn(args.rows, *policy.latent_shape, generator=gen, device=device)
        info[name] |= rollout_and_windows(args, device, policy, cond, noise, gen)
        del policy, transformer, cond
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info
