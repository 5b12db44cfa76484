"""Write a tiny, random, fully offline diffusers pipeline (for tests and smoke runs of the adapters).

    python tools/make_tiny_pipeline.py OUT_DIR --kind sd3|flux [--seed 0]

Nothing is downloaded: every component is built from a config with seeded random weights, and the tokenizers
are built locally from a small vocabulary (no model hub). The result loads with

    StableDiffusion3Pipeline.from_pretrained(OUT_DIR, local_files_only=True)     (--kind sd3)
    FluxPipeline.from_pretrained(OUT_DIR, local_files_only=True)                 (--kind flux)

SD3 layout (sizes chosen so that the pipeline's shape bookkeeping holds):

    transformer   SD3Transformer2DModel: 8x8x4 latents, patch 2, 2 layers, 2 heads x 8 = inner dim 16,
                  joint_attention_dim 32 (= T5 d_model), caption_projection_dim 16 (= inner dim),
                  pooled_projection_dim 32 (= 16 + 16, the two CLIP projections concatenated)
    vae           AutoencoderKL, 2 blocks of 8 channels (scale factor 2: 8x8 latents <-> 16x16 images),
                  latent_channels 4, SD3-like scaling_factor / shift_factor
    scheduler     FlowMatchEulerDiscreteScheduler(shift=3.0)
    text_encoder, text_encoder_2   CLIPTextModelWithProjection, hidden 16, projection 16
    text_encoder_3                 T5EncoderModel, d_model 32
    tokenizer, tokenizer_2         CLIPTokenizer (byte-level BPE, no merges: one token per character), 32 tokens
    tokenizer_3                    T5Tokenizer (unigram over letters, digits and a few words)

FLUX layout (FLUX.1-dev-like: guidance-distilled, dynamic shifting):

    transformer   FluxTransformer2DModel: 8x8x4 latents packed into 2x2 tokens (in_channels 16 = 4 x 4,
                  16 tokens), 2 double-stream + 2 single-stream layers, 2 heads x 8 = inner dim 16,
                  rope axes (2, 2, 4) (sum = head dim), joint_attention_dim 32 (= T5 d_model),
                  pooled_projection_dim 16 (= CLIP hidden size), guidance_embeds True
    vae           AutoencoderKL as for SD3 (scale factor 2), FLUX's scaling_factor / shift_factor
    scheduler     FlowMatchEulerDiscreteScheduler with FLUX's dynamic shifting (mu from the image sequence length)
    text_encoder  CLIPTextModel, hidden 16 (its pooled output is the pooled projection)
    text_encoder_2  T5EncoderModel, d_model 32
    tokenizer, tokenizer_2   the CLIP and T5 tokenizers above

`make_tiny_sd3(out_dir, seed=0) -> Path` and `make_tiny_flux(out_dir, seed=0) -> Path` are importable
(tests put tools/ on sys.path).
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

import torch

CLIP_MAX_LENGTH = 32  # tokenizer.model_max_length: the pipeline pads CLIP prompts to this many tokens
T5_MAX_LENGTH = 32  # tokenizer_3.model_max_length: the adapter uses it as max_sequence_length
T5_WORDS = ["a", "the", "photo", "of", "cat", "dog", "red", "blue", "digit", "one", "two", "three", "on", "with"]


def _clip_tokenizer():
    """CLIP's byte-level BPE with an alphabet-only vocabulary (every byte, with and without the end-of-word
    suffix) and no merges, so any text tokenizes; ids: <|startoftext|> 0, <|endoftext|> 1 (also pad)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[], pad_token="<|endoftext|>")
    tok.model_max_length = CLIP_MAX_LENGTH
    return tok


def _t5_tokenizer():
    """T5's unigram tokenizer over a hand-made vocabulary: <pad> 0, </s> 1, <unk> 2, then pieces."""
    from transformers import T5Tokenizer

    pieces = ["▁", *[f"▁{w}" for w in T5_WORDS]]
    pieces += [c for c in string.ascii_lowercase + string.digits]
    pieces += [f"▁{c}" for c in string.ascii_lowercase + string.digits]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(p, -1.0 if len(p) > 2 else -5.0) for p in pieces]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    tok.model_max_length = T5_MAX_LENGTH
    return tok


def _tiny_vae(scaling_factor: float, shift_factor: float, latent_channels: int = 4, sample_size: int = 16):
    """AutoencoderKL with 2 blocks of 8 channels: 8x8x4 latents <-> 16x16 RGB (scale factor 2)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, sample_size=sample_size,
        block_out_channels=(8, 8), layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=scaling_factor, shift_factor=shift_factor,
    )


def _tiny_clip_config(tokenizer, projection_dim: int = 16):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, vocab_size=len(tokenizer), hidden_size=16,
        intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=projection_dim, hidden_act="gelu",
    )


def _tiny_t5(tokenizer, d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))


def _save(pipe, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(out))
    return out


TINY_SD3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=4,
                pos_embed_max_size=16)


def build_tiny_sd3(seed: int = 0, transformer: dict | None = None):
    """The tiny random StableDiffusion3Pipeline (in memory). `transformer`: another SD3Transformer2DModel config
    (the bench's SD3-shaped one); the VAE, the CLIP projections and T5's width follow it (latent channels, pooled
    projection = the two CLIP projections, T5 d_model = joint_attention_dim)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), _t5_tokenizer()
    shape = dict(TINY_SD3 if transformer is None else transformer)
    if shape["pooled_projection_dim"] % 2:
        raise ValueError("pooled_projection_dim must be even: it is the two CLIP projections concatenated")

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(**shape)
    torch.manual_seed(seed + 1)
    vae = _tiny_vae(scaling_factor=1.5035, shift_factor=0.0609,  # SD3's latent statistics
                    latent_channels=shape["in_channels"], sample_size=2 * shape["sample_size"])
    clip = _tiny_clip_config(tokenizer, projection_dim=shape["pooled_projection_dim"] // 2)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModelWithProjection(clip)
    torch.manual_seed(seed + 3)
    text_encoder_2 = CLIPTextModelWithProjection(clip)
    torch.manual_seed(seed + 4)
    text_encoder_3 = _tiny_t5(tokenizer_3, d_model=shape["joint_attention_dim"])
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder.eval(), tokenizer=tokenizer,
        text_encoder_2=text_encoder_2.eval(), tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3.eval(), tokenizer_3=tokenizer_3,
    )


def make_tiny_sd3(out_dir, seed: int = 0, transformer: dict | None = None) -> Path:
    """Build the tiny SD3 pipeline (build_tiny_sd3) and `save_pretrained` it to out_dir; returns the directory."""
    return _save(build_tiny_sd3(seed, transformer), out_dir)


def build_tiny_flux(seed: int = 0):
    """The tiny random FluxPipeline (in memory)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, out_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    torch.manual_seed(seed + 1)
    vae = _tiny_vae(scaling_factor=0.3611, shift_factor=0.1159)  # FLUX's latent statistics
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(_tiny_clip_config(tokenizer))
    torch.manual_seed(seed + 3)
    text_encoder_2 = _tiny_t5(tokenizer_2)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder.eval(), tokenizer=tokenizer,
        text_encoder_2=text_encoder_2.eval(), tokenizer_2=tokenizer_2,
    )


def make_tiny_flux(out_dir, seed: int = 0) -> Path:
    """Build the tiny FLUX pipeline and `save_pretrained` it to out_dir; returns the directory."""
    return _save(build_tiny_flux(seed), out_dir)


MAKERS = {"sd3": make_tiny_sd3, "flux": make_tiny_flux}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--kind", choices=sorted(MAKERS), default="sd3")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = MAKERS[args.kind](args.out_dir, seed=args.seed)
    print(f"wrote tiny {args.kind} pipeline to {out}")


if __name__ == "__main__":
    main()
