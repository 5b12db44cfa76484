"""GCPO, chunk-level GRPO (arXiv 2510.21583): its config (config.py), chunk draws and slot layout (chunks.py) and
its chunk loss as per-step terms knot_backward runs (loss.py). Pure torch, beside grpo/ and nft/ at the bottom."""

from .config import GCPOConfig, chunk_sizes, trained_chunks
from .loss import ChunkBatch, GCPOStepLoss, chunk_factor

__all__ = ["ChunkBatch", "GCPOConfig", "GCPOStepLoss", "chunk_factor", "chunk_sizes", "trained_chunks"]
