"""The built-in small DiT: a pixel-space (or latent-space) velocity model with adaLN-Zero blocks.

In the style of facebookresearch/DiT `models.py`, one file, the math visible:

    tokens = PatchEmbed(x) + pos_embed                       x [N, C, H, W] -> [N, T, D], T = (H / p)^2
    c      = TimestepEmbedder(1000 sigma) + PromptEmbedder(cond)                             c [N, D]
    block:   shift, scale, gate = adaLN(c)   (one triple for attention, one for the MLP)
             h = h + gate_msa * Attn(LN(h) * (1 + scale_msa) + shift_msa)
             h = h + gate_mlp * MLP (LN(h) * (1 + scale_mlp) + shift_mlp)
    final:   v = unpatchify(Linear(LN(h) * (1 + scale) + shift))                          v [N, C, H, W]

adaLN-Zero: the modulation and the final linear layer start at zero, so the model outputs exactly 0 at
init. `init_weights(zero_out=False)` gives an all-random model with nonzero velocities (tests, benchmarks).

Prompt conditioning: hashed word tokens (HashTokenizer, below), a token embedding with padding_idx 0,
masked mean pooling over the non-pad tokens and an MLP; the all-pad prompt "" (the unconditional one of
classifier-free guidance) maps to a learned null embedding.

No dtype is hardcoded: buffers follow `.to()` / `.double()`, and the frequency embedding of sigma is computed
in sigma's dtype (at least float32), so a float32 sigma is fine under bf16 autocast and float64 works end to end.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .base import VelocityModel
from .registry import Family, register


#################################################################################
#                The prompt tokenizer: word hashes, offline                     #
#################################################################################
# A fully offline, deterministic word-level hash tokenizer: words = re.findall("[a-z0-9]+", prompt.lower()),
# id(word) = 1 + crc32(word) % (vocab_size - 1) (0 is padding), tokens = ids[:max_length] + [0] * (max_length - n).
# No vocabulary file, no downloads; the same prompt gives the same ids on every machine and process (crc32, unlike
# Python's `hash`, is not salted). The empty prompt "" gives all zeros: the unconditional prompt of CFG.

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


@dataclass
class DiTConfig:
    image_size: int = 32
    in_channels: int = 3
    patch_size: int = 4
    hidden_size: int = 128
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    vocab_size: int = 4096
    max_prompt_length: int = 16


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


#################################################################################
#               Embedding Layers for Timesteps and Prompts                      #
#################################################################################


class TimestepEmbedder(nn.Module):
    """Embeds scalar timesteps into vectors: sinusoidal frequencies, then a 2-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        """[cos(t f_i), sin(t f_i)] with f_i = max_period^(-i / half), computed in t's dtype. t [N] -> [N, dim]."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=t.dtype, device=t.device) / half)
        args = t[:, None] * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class PromptEmbedder(nn.Module):
    """Token ids [N, L] -> [N, D]: masked mean of token embeddings + MLP; all-pad prompts -> learned null embedding."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_size, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        self.null_embedding = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        emb = self.embedding(tokens)  # [N, L, D]
        mask = (tokens != 0).to(emb.dtype)  # [N, L]
        count = mask.sum(dim=1, keepdim=True)  # [N, 1]
        pooled = (emb * mask.unsqueeze(-1)).sum(dim=1) / count.clamp(min=1)
        out = self.mlp(pooled)
        null = self.null_embedding.to(out.dtype).expand_as(out)
        return torch.where(count > 0, out, null)


#################################################################################
#                                 Core DiT Model                                #
#################################################################################


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        assert hidden_size % num_heads == 0, "hidden_size must be divisible by num_heads"
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, T, D = x.shape
        qkv = self.qkv(x).reshape(N, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [N, heads, T, head_dim]
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(N, T, D))


class Mlp(nn.Module):
    def __init__(self, hidden_size: int, mlp_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, mlp_hidden)
        self.fc2 = nn.Linear(mlp_hidden, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """A DiT block with adaptive layer norm zero (adaLN-Zero) conditioning."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """The final layer of DiT: adaLN, then a linear map to p * p * C values per token."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(VelocityModel):
    """Diffusion transformer velocity model v_theta(x, sigma, prompt tokens)."""

    def __init__(self, config: DiTConfig | None = None):
        super().__init__()
        config = config if config is not None else DiTConfig()
        c = self.config = config
        if c.image_size % c.patch_size:
            raise ValueError(f"image_size {c.image_size} is not divisible by patch_size {c.patch_size}")
        self.latent_shape = (c.in_channels, c.image_size, c.image_size)
        self.tokenizer = HashTokenizer(c.vocab_size, c.max_prompt_length)
        self.grid_size = c.image_size // c.patch_size

        self.x_embedder = nn.Conv2d(c.in_channels, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size)
        self.t_embedder = TimestepEmbedder(c.hidden_size)
        self.y_embedder = PromptEmbedder(c.vocab_size, c.hidden_size)
        pos = get_2d_sincos_pos_embed(c.hidden_size, self.grid_size)  # fixed, follows .to() / .double()
        self.register_buffer("pos_embed", pos.to(torch.get_default_dtype()).unsqueeze(0), persistent=False)
        self.blocks = nn.ModuleList([DiTBlock(c.hidden_size, c.num_heads, c.mlp_ratio) for _ in range(c.depth)])
        self.final_layer = FinalLayer(c.hidden_size, c.patch_size, c.in_channels)
        self.gradient_checkpointing = False
        self.init_weights(zero_out=True)

    def enable_gradient_checkpointing(self) -> "DiT":
        """Recompute each block in backward (non-reentrant torch.utils.checkpoint, as diffusers' transformers do):
        the same gradients, the activations of one block. Active in train mode with grad enabled."""
        self.gradient_checkpointing = True
        return self

    @torch.no_grad()
    def init_weights(self, zero_out: bool = True) -> "DiT":
        """DiT's initialize_weights. zero_out=True: adaLN-Zero (output exactly 0); False: all weights random."""

        def _basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        # patch embedding like nn.Linear (not Conv2d)
        w = self.x_embedder.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.bias)
        # timestep and prompt embedding MLPs, token table and null embedding
        for mlp in (self.t_embedder.mlp, self.y_embedder.mlp):
            nn.init.normal_(mlp[0].weight, std=0.02)
            nn.init.normal_(mlp[2].weight, std=0.02)
        nn.init.normal_(self.y_embedder.embedding.weight, std=0.02)
        self.y_embedder.embedding.weight[0].zero_()  # padding row
        nn.init.normal_(self.y_embedder.null_embedding, std=0.02)
        if zero_out:
            for block in self.blocks:
                nn.init.zeros_(block.adaLN_modulation[-1].weight)
                nn.init.zeros_(block.adaLN_modulation[-1].bias)
            nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
            nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
            nn.init.zeros_(self.final_layer.linear.weight)
            nn.init.zeros_(self.final_layer.linear.bias)
        else:  # small random modulation biases too, so gates/shifts are nonzero even for c = 0
            for block in self.blocks:
                nn.init.normal_(block.adaLN_modulation[-1].bias, std=0.02)
            nn.init.normal_(self.final_layer.adaLN_modulation[-1].bias, std=0.02)
            nn.init.normal_(self.final_layer.linear.bias, std=0.02)
        return self

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """[N, T, p * p * C] -> [N, C, H, W]."""
        p, h, C = self.config.patch_size, self.grid_size, self.config.in_channels
        x = x.reshape(x.shape[0], h, h, p, p, C)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], C, h * p, h * p)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """x [N, C, H, W], sigma [N] (or scalar) in [0, 1], cond LongTensor [N, L] -> v [N, C, H, W] in x's dtype."""
        N = x.shape[0]
        sigma = torch.as_tensor(sigma, device=x.device)
        if not sigma.is_floating_point():
            sigma = sigma.to(torch.get_default_dtype())
        sigma = sigma.reshape(-1).expand(N) if sigma.numel() == 1 else sigma.reshape(N)
        if sigma.dtype in (torch.float16, torch.bfloat16):
            sigma = sigma.float()  # sin/cos of 1000 sigma need at least float32
        h = self.x_embedder(x).flatten(2).transpose(1, 2)  # [N, T, D]
        h = h + self.pos_embed.to(h.dtype)
        c = self.t_embedder(sigma * 1000) + self.y_embedder(cond.to(x.device))
        checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, c, use_reentrant=False) if checkpointed else block(h, c)
        h = self.final_layer(h, c)
        return self.unpatchify(h).to(x.dtype)

    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """LongTensor [B, max_prompt_length] of hashed word ids on the parameters' device; "" -> all zeros."""
        return self.tokenizer(prompts).to(next(self.parameters()).device)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Pixel-space model: data in [-1, 1] -> float32 images [N, 3, H, W] in [0, 1]."""
        img = ((x.float() + 1) / 2).clamp(0, 1)
        if img.shape[1] == 1:
            img = img.repeat(1, 3, 1, 1)
        elif img.shape[1] > 3:
            img = img[:, :3]
        return img

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


#################################################################################
#                   Sine/Cosine Positional Embedding Functions                  #
#################################################################################


def get_1d_sincos_pos_embed(embed_dim: int, pos: torch.Tensor) -> torch.Tensor:
    """pos [M] -> [M, embed_dim]: [sin(pos w_i), cos(pos w_i)], w_i = 10000^(-2i / embed_dim)."""
    assert embed_dim % 2 == 0
    omega = 1.0 / 10000 ** (torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0))
    out = pos.reshape(-1, 1).to(torch.float64) * omega[None]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def get_2d_sincos_pos_embed(embed_dim: int, grid_size: int) -> torch.Tensor:
    """[grid_size^2, embed_dim]: half the channels encode the row, half the column (computed in float64)."""
    assert embed_dim % 4 == 0, "hidden_size must be divisible by 4 for the 2D sin-cos embedding"
    coords = torch.arange(grid_size, dtype=torch.float64)
    grid_w, grid_h = torch.meshgrid(coords, coords, indexing="xy")  # as DiT: np.meshgrid(grid_w, grid_h)
    emb_h = get_1d_sincos_pos_embed(embed_dim // 2, grid_w)
    emb_w = get_1d_sincos_pos_embed(embed_dim // 2, grid_h)
    return torch.cat([emb_h, emb_w], dim=1)


FAMILY = register(Family(name="dit", velocity=DiT))  # built in models/__init__.py: no pipeline directory
