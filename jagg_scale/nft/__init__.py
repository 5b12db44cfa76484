"""DiffusionNFT: its loss on the forward process (loss.py). Pure torch, beside jagg/ and grpo/ at the bottom."""

from .loss import NFTBatch, NFTStepLoss, optimality

__all__ = ["NFTBatch", "NFTStepLoss", "optimality"]
