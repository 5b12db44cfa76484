"""Prompt data: loading prompt files into records, and where a step's prompts come from (source.py: the seeded,
resumable sampler of a list, or webdataset shards)."""

from .images import EditPrompt
from .prompts import PromptRecord, PromptSet, load_prompts
from .prompt_sets import (
    FilteredPromptSet,
    read_drawbench,
    read_geneval,
    read_ocr,
    read_parti,
    read_pickapic,
    shared_prompts_dir,
)
# webdataset prompt shards: importing is free, webdataset itself is loaded only when shards are used
from .shards import ShardPromptStream, shard_pattern, write_prompt_shards
from .source import ListPromptSource, PromptSampler, StreamPromptSource

__all__ = ["EditPrompt", "PromptRecord", "PromptSet", "load_prompts", "PromptSampler"]

__all__ += [
    "FilteredPromptSet",
    "read_pickapic",
    "read_geneval",
    "read_ocr",
    "read_parti",
    "read_drawbench",
    "shared_prompts_dir",
]

__all__ += ["ShardPromptStream", "write_prompt_shards", "shard_pattern"]

__all__ += ["ListPromptSource", "StreamPromptSource"]
