"""Flow-DPPO: its per-step loss (loss.py) on GRPO's SDE rollout, and its config section (config.py). Pure torch,
beside jagg/ and grpo/ at the bottom."""

from .loss import DPPOStepLoss, DPPOTerms, dppo_terms

__all__ = ["DPPOStepLoss", "DPPOTerms", "dppo_terms"]
