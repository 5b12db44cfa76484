"""DiffusionNFT: its loss on the forward process (loss.py). Pure torch, beside jagg/ and grpo/ at the bottom."""

from .loss import AdvMode, NFTBatch, NFTStepLoss, optimality

__all__ = ["AdvMode", "NFTBatch", "NFTStepLoss", "optimality"]
