"""A fully offline, deterministic word-level hash tokenizer for the built-in DiT.

    words = re.findall("[a-z0-9]+", prompt.lower())
    id(word) = 1 + crc32(word) % (vocab_size - 1)        # 0 is padding
    tokens = ids[:max_length] + [0] * (max_length - len(ids))

No vocabulary file, no downloads; the same prompt gives the same ids on every machine and process
(crc32, unlike Python's `hash`, is not salted). The empty prompt "" gives all zeros: the unconditional
prompt for classifier-free guidance.
"""

from __future__ import annotations

import re
import zlib
from typing import Sequence

import torch

_WORD = re.compile(r"[a-z0-9]+")


class HashTokenizer:
    """Lowercase, split into `[a-z0-9]+` words, hash each word into [1, vocab_size), pad/truncate with 0."""

    def __init__(self, vocab_size: int = 4096, max_length: int = 16):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 (0 is padding), got {vocab_size}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.vocab_size = int(vocab_size)
        self.max_length = int(max_length)

    def word_id(self, word: str) -> int:
        return 1 + zlib.crc32(word.encode("utf-8")) % (self.vocab_size - 1)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of one prompt, padded/truncated to max_length."""
        ids = [self.word_id(w) for w in _WORD.findall(prompt.lower())][: self.max_length]
        return ids + [0] * (self.max_length - len(ids))

    def __call__(self, prompts: Sequence[str]) -> torch.Tensor:
        """LongTensor [B, max_length]; a single string is treated as a batch of one."""
        if isinstance(prompts, str):
            prompts = [prompts]
        rows = [self.encode(p) for p in prompts]
        if not rows:
            return torch.zeros(0, self.max_length, dtype=torch.long)
        return torch.tensor(rows, dtype=torch.long)

    def __repr__(self) -> str:
        return f"HashTokenizer(vocab_size={self.vocab_size}, max_length={self.max_length})"
