"""Prompt data: loading prompt files into records, and the seeded, resumable GRPO group sampler."""

from .prompts import PromptRecord, PromptSet, load_prompts
from .sampler import GroupSampler

__all__ = ["PromptRecord", "PromptSet", "load_prompts", "GroupSampler"]
