"""Tiny, random, fully offline diffusers pipelines, one per model family (its Family.tiny names the builder here):
the test fixtures of the adapters (tests/conftest.py) and smoke runs (configs/*_tiny_cpu.yaml).

    python -m tools.make_tiny_pipeline OUT_DIR --kind sd3|flux|flux_kontext|qwenimage|flux2|zimage|wan|wan22 [--seed 0]

Nothing is downloaded: every component is built from a config with seeded random weights, and the tokenizers
are built locally from a small vocabulary (no model hub). The result loads with its family's pipeline class
(`<Pipeline>.from_pretrained(OUT_DIR, local_files_only=True)`, the class its Family record names).

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

Qwen-Image, FLUX.2 [klein] and Z-Image layouts: the docstrings of build_tiny_qwenimage, build_tiny_flux2 and
build_tiny_zimage.

`build_tiny_<kind>(seed=0)` returns the pipeline in memory; `make_tiny_<kind>(out_dir, seed=0) -> Path` saves it.
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


def build_tiny_flux(seed: int = 0, pipeline: str = "FluxPipeline"):
    """The tiny random FluxPipeline (in memory); pipeline="FluxKontextPipeline": the same components as FLUX.1-Kontext
    (Kontext is FLUX.1's architecture, its input image entering as more image tokens)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
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
    return getattr(diffusers, pipeline)(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder.eval(), tokenizer=tokenizer,
        text_encoder_2=text_encoder_2.eval(), tokenizer_2=tokenizer_2,
    )


def make_tiny_flux(out_dir, seed: int = 0) -> Path:
    """Build the tiny FLUX pipeline and `save_pretrained` it to out_dir; returns the directory."""
    return _save(build_tiny_flux(seed), out_dir)


def build_tiny_flux_kontext(seed: int = 0):
    """The tiny random FluxKontextPipeline: FLUX.1's components (build_tiny_flux)."""
    return build_tiny_flux(seed, pipeline="FluxKontextPipeline")


def make_tiny_flux_kontext(out_dir, seed: int = 0) -> Path:
    """Build the tiny FLUX.1-Kontext pipeline and `save_pretrained` it to out_dir; returns the directory."""
    return _save(build_tiny_flux_kontext(seed), out_dir)


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # what QwenImagePipeline's prompt template uses
# The words of the template's system part, whole: QwenImagePipeline drops the template's first 34 tokens (what
# Qwen2.5-VL's tokenizer makes of "<|im_start|>system\nDescribe the image by detailing ... background:<|im_end|>
# \n<|im_start|>user\n"), so the tiny tokenizer must make 34 of them too, or the user's prompt would be cut away.
QWEN_TEMPLATE_WORDS = ["system", "\n", "Describe", " the", " image", " by", " detailing", " color", " shape", " size",
                       " texture", " quantity", " text", " spatial", " relationships", " of", " objects", " and",
                       " background", "user"]


def _qwen_tokenizer(words=QWEN_TEMPLATE_WORDS, specials=QWEN_SPECIALS):
    """Qwen2's byte-level BPE with an alphabet-only vocabulary (every byte) and no merges, plus the chat template's
    special tokens and system words: any text tokenizes, one token per byte outside them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in specials:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    tok.add_tokens([AddedToken(w, normalized=False) for w in words])
    return Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              unk_token=None, model_max_length=2048)


def _tiny_qwen_parts(seed: int, tokenizer):
    """Qwen-Image's transformer, VAE, Qwen2.5-VL text encoder and scheduler at tiny sizes (build_tiny_qwenimage)."""
    """The tiny random QwenImagePipeline (in memory): 8x8x4 latents packed into 2x2 tokens (in_channels 16),
    2 double-stream layers of 2 heads x 8, rope axes (2, 2, 4), joint_attention_dim 32 (= the text encoder's
    hidden size); a 2-level AutoencoderKLQwenImage (scale factor 2, z_dim 4, its per-channel latents mean/std); a
    2-layer Qwen2.5-VL text model (its vision tower one block, unused for text); dynamic shifting with an
    exponential time shift and a terminal shift, as Qwen-Image's scheduler uses them."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
           "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"), "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(2, 2, 4))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
                                 latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0])
    torch.manual_seed(seed + 2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, **ids),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        **{k: tokenizer.convert_tokens_to_ids(t) for k, t in VISION_TOKENS.items() if t in tokenizer.get_vocab()},
        **ids))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                                time_shift_type="exponential")
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer,
                transformer=transformer)


def build_tiny_qwenimage(seed: int = 0):
    """The tiny random QwenImagePipeline (in memory): 8x8x4 latents packed into 2x2 tokens (in_channels 16),
    2 double-stream layers of 2 heads x 8, rope axes (2, 2, 4), joint_attention_dim 32 (= the text encoder's
    hidden size); a 2-level AutoencoderKLQwenImage (scale factor 2, z_dim 4, its per-channel latents mean/std); a
    2-layer Qwen2.5-VL text model (its vision tower one block, unused for text); dynamic shifting with an
    exponential time shift and a terminal shift, as Qwen-Image's scheduler uses them."""
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**_tiny_qwen_parts(seed, _qwen_tokenizer()))


# QwenImageEditPlusPipeline's template: it drops the first 64 tokens (its system part, as Qwen2.5-VL's tokenizer
# splits it, and "<|im_start|>user\n"), so the tiny tokenizer makes 64 of them: its words whole, but for " (color,",
# " key" and " a", which it spells out byte by byte
QWEN_EDIT_SPECIALS = QWEN_SPECIALS + ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
QWEN_EDIT_WORDS = ["system", "\n", "Describe", "user", *(" " + w for w in (
    "the features of input image shape, size, texture, objects, background), then explain how user's text "
    "instruction should alter or modify image. Generate new that meets requirements while maintaining "
    "consistency with original where appropriate.").split())]
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "image_token_id": "<|image_pad|>",
                 "vision_end_token_id": "<|vision_end|>"}


def build_tiny_qwenimage_edit(seed: int = 0):
    """The tiny random QwenImageEditPlusPipeline: Qwen-Image's tiny parts (its text encoder reading the vision
    tokens), a tokenizer with the edit template's words and the vision tokens, and the processor without its video
    half (models/qwenimage_edit.py image_processor): Qwen2.5-VL's PIL image processor, 14 px patches merged 2x2."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .qwenimage_edit import processor_class

    tokenizer = _qwen_tokenizer(QWEN_EDIT_WORDS, QWEN_EDIT_SPECIALS)
    processor = processor_class()(Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=16 * 28 * 28), tokenizer)
    return QwenImageEditPlusPipeline(processor=processor, **_tiny_qwen_parts(seed, tokenizer))


def make_tiny_qwenimage(out_dir, seed: int = 0) -> Path:
    """Build the tiny Qwen-Image pipeline and `save_pretrained` it to out_dir; returns the directory."""
    return _save(build_tiny_qwenimage(seed), out_dir)


def make_tiny_qwenimage_edit(out_dir, seed: int = 0) -> Path:
    """Build the tiny Qwen-Image-Edit pipeline and save it; model_index.json names its processor as the published
    pipelines do (transformers' Qwen2VLProcessor; models/qwenimage_edit.py builds it without the video half)."""
    import json

    out = _save(build_tiny_qwenimage_edit(seed), out_dir)
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps(dict(index, processor=["transformers", "Qwen2VLProcessor"]),
                                                     indent=2))
    return out


# Qwen3's chat template, reduced to what Flux2KleinPipeline renders (one user turn, the generation prompt)
QWEN3_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_flux2_parts(seed: int, guidance_embeds: bool):
    """The FLUX.2 transformer, VAE and scheduler both tiny FLUX.2 pipelines share (build_tiny_flux2's docstring)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=48,
                                          guidance_embeds=guidance_embeds, axes_dims_rope=(2, 2, 2, 2))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                             latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False,
                             use_post_quant_conv=False)
    with torch.no_grad():  # batch-norm statistics that are not the identity, so that decode's use of them shows
        vae.bn.running_mean.uniform_(-0.2, 0.2)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return dict(transformer=transformer, vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0))


def _qwen3_config(tokenizer, layers: int):
    """A Qwen3 text model of hidden 16 over the Qwen tokenizer above (FLUX.2 [klein]'s and Z-Image's encoder)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                       bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                       eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)


def build_tiny_flux2(seed: int = 0):
    """The tiny random Flux2KleinPipeline (FLUX.2 [klein], not guidance-distilled): 16x16x4 VAE latents patchified
    2x2 into 8x8x16 tokens (in_channels 16), 1 double + 1 single stream layer of 2 heads x 8, rope axes (2, 2, 2, 2),
    joint_attention_dim 48 (= 3 x the text encoder's hidden 16: the pipeline concatenates Qwen3's layers 9, 18 and
    27, so the text model has 28 tiny layers); a 2-level AutoencoderKLFlux2 (scale factor 2) with its batch-norm
    statistics; the Qwen tokenizer above with a chat template."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    tokenizer = _qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT
    parts = _tiny_flux2_parts(seed, guidance_embeds=False)
    torch.manual_seed(seed + 2)
    text_encoder = Qwen3ForCausalLM(_qwen3_config(tokenizer, layers=28))
    return Flux2KleinPipeline(**parts, text_encoder=text_encoder.eval(), tokenizer=tokenizer, is_distilled=False)


def make_tiny_flux2(out_dir, seed: int = 0) -> Path:
    """Build the tiny FLUX.2 [klein] pipeline and `save_pretrained` it to out_dir; returns the directory."""
    return _save(build_tiny_flux2(seed), out_dir)


# Mistral's chat markers, reduced to what Flux2Pipeline renders: the system message, then the user's prompt
MISTRAL_CHAT = ("{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{% else %}[INST]{% endif %}"
                "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
                "{% if m['role'] == 'system' %}[/SYSTEM_PROMPT]{% else %}[/INST]{% endif %}{% endfor %}")


def build_tiny_flux2_dev(seed: int = 0):
    """The tiny random Flux2Pipeline (FLUX.2 [dev], guidance-distilled: guidance_embeds True): build_tiny_flux2's
    transformer, VAE and scheduler; a 30-layer Mistral3 text model of hidden 16 (the pipeline concatenates its layers
    10, 20 and 30: 3 x 16 = joint_attention_dim 48) with a one-block Pixtral vision tower (unused for text); the Qwen
    byte tokenizer with Mistral's chat markers and FLUX.2's whole system message as single tokens, so a prompt is not
    cut away by a short max_sequence_length (the published pipeline's tokenizer is a PixtralProcessor, whose
    apply_chat_template renders the same messages over Mistral's tokenizer)."""
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = _qwen_tokenizer()
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in
                          ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", SYSTEM_MESSAGE)])
    tokenizer.chat_template = MISTRAL_CHAT
    parts = _tiny_flux2_parts(seed, guidance_embeds=True)
    torch.manual_seed(seed + 2)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=16),
        image_token_index=len(tokenizer) - 1, spatial_merge_size=1))
    return Flux2Pipeline(**parts, text_encoder=text_encoder.eval(), tokenizer=tokenizer)


def make_tiny_flux2_dev(out_dir, seed: int = 0) -> Path:
    """Build the tiny FLUX.2 [dev] pipeline and `save_pretrained` it to out_dir; returns the directory."""
    return _save(build_tiny_flux2_dev(seed), out_dir)


def build_tiny_zimage(seed: int = 0):
    """The tiny random ZImagePipeline: 8x8x4 VAE latents the transformer patchifies 2x2 itself (in_channels 4),
    1 main + 1 refiner layer (of each kind) of 2 heads x 8, rope axes (2, 2, 4) (sum = head dim), cap_feat_dim 16
    (= the text model's hidden size: the pipeline takes Qwen3's second-to-last hidden states); the AutoencoderKL of
    the SD3/FLUX pipelines above with FLUX's scaling/shift (Z-Image's VAE is FLUX.1's); a 2-layer Qwen3 text model;
    dynamic shifting (the pipeline passes mu from the image tokens)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    tokenizer = _qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(in_channels=4, dim=16, n_layers=1, n_refiner_layers=1, n_heads=2,
                                           n_kv_heads=2, cap_feat_dim=16, axes_dims=[2, 2, 4], axes_lens=[256, 64, 64])
    torch.manual_seed(seed + 1)
    vae = _tiny_vae(scaling_factor=0.3611, shift_factor=0.1159)
    torch.manual_seed(seed + 2)
    text_encoder = Qwen3Model(_qwen3_config(tokenizer, layers=2))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer,
                          transformer=transformer)


def make_tiny_zimage(out_dir, seed: int = 0) -> Path:
    """Build the tiny Z-Image pipeline and `save_pretrained` it to out_dir; returns the directory."""
    return _save(build_tiny_zimage(seed), out_dir)


def build_tiny_wan(seed: int = 0, experts: bool = False):
    """The tiny random WanPipeline (Wan2.1 T2V layout): a WanTransformer3DModel of 1 layer, 2 heads x 8, patch
    (1, 2, 2), in/out 4 channels, text_dim 32 (= UMT5's d_model); an AutoencoderKLWan of 2 levels (factors 2: 5 frames
    of 16 px <-> 3 x 8 x 8 latents), per-channel latents mean / std; UMT5; FlowMatchEulerDiscreteScheduler(shift=3)
    (the adapter reads the pipeline's). experts: Wan2.2 A14B's, a second transformer below boundary_ratio 0.875."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _t5_tokenizer()
    torch.manual_seed(seed)
    shape = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
    transformer = WanTransformer3DModel(**shape)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0],
                           scale_factor_temporal=2, scale_factor_spatial=2)
    torch.manual_seed(seed + 2)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    torch.manual_seed(seed + 3)  # after the others: the one-expert pipeline's weights are as before
    two = dict(transformer_2=WanTransformer3DModel(**shape), boundary_ratio=0.875) if experts else {}
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **two)


def make_tiny_wan(out_dir, seed: int = 0, experts: bool = False) -> Path:
    """Build the tiny Wan pipeline (experts: Wan2.2 A14B's two) and `save_pretrained` it to out_dir."""
    return _save(build_tiny_wan(seed, experts), out_dir)


MAKERS = {"sd3": make_tiny_sd3, "flux": make_tiny_flux, "qwenimage": make_tiny_qwenimage, "flux2": make_tiny_flux2,
          "zimage": make_tiny_zimage, "flux_kontext": make_tiny_flux_kontext, "flux2_dev": make_tiny_flux2_dev,
          "wan": make_tiny_wan, "qwenimage_edit": make_tiny_qwenimage_edit,
          "wan22": lambda out_dir, seed=0: make_tiny_wan(out_dir, seed, experts=True)}


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
