"""Advantage Weighted Matching: its loss on the forward process (loss.py) and its config section (config.py). Pure
torch, beside jagg/, grpo/ and nft/ at the bottom."""

from .config import AWMConfig
from .loss import AWMBatch, AWMStepLoss, Weighting, weighted_log_prob

__all__ = ["AWMBatch", "AWMConfig", "AWMStepLoss", "Weighting", "weighted_log_prob"]
