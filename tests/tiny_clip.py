"""A tiny random CLIPModel directory (weights, tokenizer, preprocessor config) built offline, for the CLIP-family
reward tests (tests/rewards/)."""

import json
import math
from pathlib import Path

import torch

PROJ_DIM = 16


def tiny_clip_tokenizer():
    """Byte-level CLIP tokenizer with no merges: 256 byte symbols, their end-of-word forms, bos, eos."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": i + 256 for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": 512, "<|endoftext|>": 513}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def make_tiny_clip(d: Path, mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711)) -> Path:
    """Write a seeded random tiny CLIPModel (32 px, patch 8, projection PROJ_DIM, logit scale 50), its tokenizer and
    a preprocessor_config.json with `mean` / `std` into `d`; returns `d`."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = dict(vocab_size=514, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=PROJ_DIM))
    with torch.no_grad():
        model.logit_scale.fill_(math.log(50.0))
    model.save_pretrained(d)
    tiny_clip_tokenizer().save_pretrained(d)
    (Path(d) / "preprocessor_config.json").write_text(json.dumps({"image_mean": list(mean), "image_std": list(std),
                                                                  "crop_size": 32}))
    return Path(d)
