"""JSON from someone else, parsed within bounds: nesting depth (Python's parser recurses per level, so 100k `[`
raise RecursionError, which no caller expected) and, for line-based sources, the line's length (read before any
parsing: one 400 MB line took 8.2 GB and minutes). Shared by the prompt files, the prompt shards and the reward
server."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_LINE_BYTES", "loads"]

MAX_DEPTH = 32  # nesting of arrays/objects; real metadata (GenEval's, OCR's, a request's) is a few levels deep
MAX_LINE_BYTES = 1 << 20  # one prompt record (prompt + metadata); GenEval's longest is ~300 bytes


def loads(text: str | bytes, what: str = "JSON", max_depth: int = MAX_DEPTH) -> Any:
    """json.loads(text), or a ValueError naming `what`: invalid JSON, or nested deeper than `max_depth` (checked
    without recursion)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # deeper than the interpreter's stack: far beyond max_depth
        raise ValueError(f"{what} nests arrays/objects deeper than the limit of {max_depth} levels") from None
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > max_depth:
                raise ValueError(f"{what} nests arrays/objects deeper than the limit of {max_depth} levels")
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return value
