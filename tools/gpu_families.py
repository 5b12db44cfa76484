"""The device check's `families` section (tools/gpu_check.py --sections families): one window per step and by JAGG
at each newer model family's real shape, random weights (issue 27 item 5, issue 28's Wan window at sp = 1). --tiny:
the same code at toy shapes on the CPU (tests/tools/test_gpu_check.py). Not in the default sections. Priced from
FLOPs per row forward (Qwen-Image ~0.1 PFLOP at 2468 tokens, Z-Image ~0.03 at 1536, Wan2.1-14B ~1.9 at 33.6k tokens
of 81 frames at 640 px) it takes about five minutes on an H200 as

    bash tools/gpu_check.sh --sections env,families --rows 1 --widths 4 --repeats 1

(Wan's row alone is ~16 s a forward and backward: keep --rows 1 inside the 8-minute budget)."""

from __future__ import annotations

import time

import torch

from tools.gpu_common import rollout_and_windows, sync

# each family at its production config's shape: (shape file, latent shape, text tokens, text width key, tiny config)
KINDS = {"qwen_image": "qwenimage", "z_image": "zimage", "wan": "wan"}  # each family's model.kind (its LoRA targets)
FAMILIES = {
    # configs/qwenimage_hps.yaml: 720 px (90 x 90 latents, 2025 packed tokens); a pass carries its rows' longest
    # prompt, here the longest of its training prompts, 443 tokens (estimate/shapes/qwen_image.json): its largest pass
    "qwen_image": ("qwen_image", (16, 90, 90), 443, "joint_attention_dim",
                   dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
                        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(2, 2, 4))),
    # configs/zimage_pickscore.yaml: 512 px (64 x 64 latents, 1024 tokens), prompts of up to 512 tokens
    "z_image": ("z_image", (16, 64, 64), 512, "cap_feat_dim",
                dict(in_channels=4, dim=16, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
                     axes_dims=[2, 2, 4], axes_lens=[256, 64, 64])),
    # configs/wan21_t2v_14b_hps.yaml: 81 frames at 640 px (21 x 80 x 80 latents, 33,600 tokens), 226 UMT5 tokens
    "wan": ("wan21_t2v_14b", (16, 21, 80, 80), 226, "text_dim",
            dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32)),
}
TINY_LATENT = {"qwen_image": (4, 8, 8), "z_image": (4, 8, 8), "wan": (4, 3, 8, 8)}


def _family(name: str, cfg: dict, latent: tuple, text: int, width: str, device, rows: int):
    """(the bare transformer in bf16 on `device`, its velocity module, the rows' conditioning)."""
    import diffusers

    from jagg_scale.models.diffusers_common import TransformerVelocity

    from jagg_scale.cond import Tokens

    gen = torch.Generator(device).manual_seed(1)
    embeds = torch.randn(rows, text, cfg[width], generator=gen, device=device)
    prompts = Tokens(embeds, torch.ones(rows, text, dtype=torch.int64, device=device), (text,) * rows)
    if name == "qwen_image":
        from jagg_scale.models.qwenimage import qwenimage_velocity as velocity

        cls, cond = diffusers.QwenImageTransformer2DModel, prompts
    elif name == "z_image":
        from jagg_scale.models.zimage import zimage_velocity as velocity

        cls, cond = diffusers.ZImageTransformer2DModel, prompts
    else:
        from jagg_scale.models.wan import wan_velocity as velocity

        cls, cond = diffusers.WanTransformer3DModel, embeds
    with torch.device(device):
        transformer = cls(**cfg).to(torch.bfloat16)  # the LoRA base in the compute dtype
    return transformer, TransformerVelocity(velocity, transformer, latent, autocast=torch.bfloat16), cond


def section_families(args, device, state) -> dict:
    """The new families at their real shape, random weights (shapes/*.json): each transformer in bf16 with LoRA r32
    (fp32) on the library's targets and per-block checkpointing, an on-policy rollout of B rows, then one window of
    each width per step and by JAGG (time_windows); one family's memory freed before the next."""
    from jagg_scale.estimate.shapes import clean, pipeline_shapes
    from jagg_scale.models.lora import add_lora, lora_targets

    state.pop("policy", None)  # the SD3.5 policy of earlier sections: its memory back before the larger weights
    info = {}
    for name, (shapes, real_latent, real_text, width, tiny) in FAMILIES.items():
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cfg = dict(tiny) if args.tiny else clean(pipeline_shapes(None, shapes)["components"]["transformer"]["config"])
        latent, text = (TINY_LATENT[name], 8) if args.tiny else (real_latent, real_text)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        transformer, policy, cond = _family(name, cfg, latent, text, width, device, args.rows)
        add_lora(transformer, rank=args.lora_rank, alpha=2 * args.lora_rank, dtype=torch.float32,
                 targets=lora_targets(KINDS[name]))
        transformer.enable_gradient_checkpointing()
        policy.train()
        for p in policy.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        sync(device)
        tokens = _tokens(latent)
        info[name] = {"parameters": sum(p.numel() for p in policy.parameters()),
                      "lora_parameters": sum(p.numel() for p in policy.parameters() if p.requires_grad),
                      "build_seconds": round(time.perf_counter() - t0, 1), "latent": list(policy.latent_shape),
                      "tokens_per_row": tokens + text, "rows": args.rows}
        gen = torch.Generator(device).manual_seed(0)
        noise = torch.randn(args.rows, *policy.latent_shape, generator=gen, device=device)
        info[name] |= rollout_and_windows(args, device, policy, cond, noise, gen)
        del policy, transformer, cond
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info


def _tokens(latent: tuple) -> int:
    """Image tokens of one row: 2x2 latent patches (every family here), per frame for a video."""
    frames = latent[1] if len(latent) == 4 else 1
    return frames * (latent[-2] // 2) * (latent[-1] // 2)
