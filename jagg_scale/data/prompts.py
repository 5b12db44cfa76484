"""Prompt files -> a list of (prompt, metadata) records.

Prompt sets come from public dumps (flow_grpo's pickscore/geneval files) that occasionally contain a
broken line. One bad line should not stop a run, but it must not vanish either: bad records are skipped,
counted in `PromptSet.skipped`, and logged with file and line number. A file with no usable prompt at all
is an error, since training on nothing would only surface much later.

Formats (by extension): `.txt` one prompt per line; `.jsonl` one JSON object per line with a non-empty
string `prompt` field, every other field kept as metadata (e.g. geneval's tag/include for its scorer).
Blank lines are layout, not records, and are skipped silently in both formats.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

logger = logging.getLogger(__name__)

__all__ = ["PromptRecord", "PromptSet", "load_prompts"]

#: per-line warnings logged for one file before the rest are summarized in a single line
_MAX_LINE_WARNINGS = 20


@dataclass
class PromptRecord:
    """One prompt and whatever else its source line carried (passed to the rewards as metadata)."""

    prompt: str
    metadata: dict = field(default_factory=dict)


@dataclass
class PromptSet:
    """Loaded prompts plus how many bad records were skipped; `source` is the file (None if inline)."""

    records: list[PromptRecord]
    skipped: int = 0
    source: Path | None = None

    @classmethod
    def from_list(cls, prompts: Sequence[str]) -> "PromptSet":
        """Inline prompts (e.g. from a config). These are written by hand, so a bad entry is an error."""
        if isinstance(prompts, str):
            raise TypeError("from_list expects a list of prompts, not a single string")
        records = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p.strip():
                raise ValueError(f"inline prompt #{i} must be a non-empty string, got {p!r}")
            records.append(PromptRecord(p.strip(), {}))
        if not records:
            raise ValueError("inline prompt list is empty")
        return cls(records=records)

    @property
    def prompts(self) -> list[str]:
        return [r.prompt for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self.records)


def _parse_txt(text: str) -> PromptRecord:
    return PromptRecord(text, {})


def _parse_jsonl(text: str) -> PromptRecord:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    prompt = obj.pop("prompt", None)
    if not isinstance(prompt, str):
        raise ValueError("missing 'prompt' field" if prompt is None else f"'prompt' is {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("empty 'prompt'")
    return PromptRecord(prompt.strip(), obj)


_PARSERS = {".txt": _parse_txt, ".jsonl": _parse_jsonl}


def load_prompts(path: str | Path) -> PromptSet:
    """Load a `.txt` or `.jsonl` prompt file; see the module docstring for the rules."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    parser = _PARSERS.get(path.suffix.lower())
    if parser is None:
        raise ValueError(f"unsupported prompt file extension {path.suffix!r} for {path}; expected one of {sorted(_PARSERS)}")

    records: list[PromptRecord] = []
    skipped = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                # decode per line so one bad byte costs one record, not the file; utf-8-sig drops a BOM
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
                if not text:
                    continue
                records.append(parser(text))
            except (UnicodeDecodeError, ValueError) as e:
                skipped += 1
                if skipped <= _MAX_LINE_WARNINGS:
                    logger.warning("%s:%d: skipping bad prompt record: %s", path, lineno, e)

    if skipped > _MAX_LINE_WARNINGS:
        logger.warning("%s: %d more bad records skipped (not shown)", path, skipped - _MAX_LINE_WARNINGS)
    if not records:
        raise ValueError(f"no valid prompts in {path} ({skipped} bad records skipped)")
    if skipped:
        logger.warning("%s: loaded %d prompts, skipped %d bad records", path, len(records), skipped)
    return PromptSet(records=records, skipped=skipped, source=path)
