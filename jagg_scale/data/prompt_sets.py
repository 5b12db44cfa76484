"""Readers for the public prompt sets under `shared/prompts` (see its MANIFEST.md), each -> a `PromptSet`.

Same contract as `load_prompts`: a missing file is a `FileNotFoundError` naming it; a bad row (undecodable
bytes, invalid JSON, wrong column count, empty prompt, OCR line without quoted text) is skipped, counted in
`PromptSet.skipped` and logged as `file:line`; blank lines are layout and skipped silently; a file with no
usable prompt is a `ValueError`. Every column/field other than the prompt is kept in `metadata`.

- `read_pickapic`  flow_grpo/dataset/pickscore/{train,test}.txt, one caption per line. With `blocklist`,
  captions containing a blocked word as a whole word (case-insensitive) are dropped; those are *not* bad
  rows, so they are counted separately in the returned `FilteredPromptSet.filtered` attribute.
- `read_geneval`   GenEval jsonl (flow_grpo's test_metadata.jsonl, geneval's evaluation_metadata.jsonl);
  metadata = every field but `prompt` (tag, include, exclude, ...).
- `read_ocr`       flow_grpo/dataset/ocr/test.txt; metadata {"text": first double-quoted span}.
- `read_parti`     parti/PartiPrompts.tsv (header Prompt/Category/Challenge/Note; CRLF and LF mixed).
- `read_drawbench` drawbench/DrawBench.csv (header Prompts,Category; quoted fields with commas).
- `shared_prompts_dir()` where those files live: env `JAGG_SHARED_PROMPTS`, else `<repo>/../shared/prompts`.
"""

from __future__ import annotations

import csv
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .prompts import LineReader, PromptRecord, PromptSet, parse_jsonl_record

logger = logging.getLogger(__name__)

__all__ = [
    "FilteredPromptSet",
    "read_pickapic",
    "read_geneval",
    "read_ocr",
    "read_parti",
    "read_drawbench",
    "shared_prompts_dir",
]

_OCR_QUOTED = re.compile(r'"([^"]*)"')


@dataclass
class FilteredPromptSet(PromptSet):
    """A `PromptSet` plus `filtered`: rows dropped by a blocklist (valid rows, so not in `skipped`)."""

    filtered: int = 0


def shared_prompts_dir() -> Path:
    """`$JAGG_SHARED_PROMPTS` if set, else `shared/prompts` beside the repo. The path may not exist."""
    env = os.environ.get("JAGG_SHARED_PROMPTS")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2].parent / "shared" / "prompts"


def read_pickapic(path: str | Path, blocklist: Iterable[str] | None = None) -> FilteredPromptSet:
    """One caption per line. Blocked (whole-word, case-insensitive) captions are counted in `.filtered`."""
    words = sorted({w.strip().lower() for w in (blocklist or ()) if w and w.strip()})
    pattern = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, words)) + r")(?!\w)") if words else None
    r = LineReader(path)
    filtered = 0
    for _lineno, line in r.lines():
        text = line.strip()
        if not text:
            continue
        if pattern is not None and pattern.search(text.lower()):
            filtered += 1
            continue
        r.records.append(PromptRecord(text, {}))
    if filtered:
        logger.info("%s: %d captions dropped by blocklist", r.path, filtered)
    return r.finish(FilteredPromptSet, filtered=filtered)  # type: ignore[return-value]


def read_geneval(path: str | Path) -> PromptSet:
    """GenEval jsonl; metadata keeps tag/include/exclude and any other field."""
    r = LineReader(path)
    r.read_lines(parse_jsonl_record)
    return r.finish()


def _parse_ocr(text: str) -> PromptRecord:
    m = _OCR_QUOTED.search(text)
    if m is None or not m.group(1).strip():
        raise ValueError("no non-empty double-quoted target text")
    return PromptRecord(text, {"text": m.group(1)})


def read_ocr(path: str | Path) -> PromptSet:
    """OCR prompts; metadata {"text": first double-quoted span} (the text the image must render)."""
    r = LineReader(path)
    r.read_lines(_parse_ocr)
    return r.finish()


def _read_table(path: str | Path, prompt_cols: tuple[str, ...],
                rows: Callable[[Iterator[str]], Iterator[list[str]]]) -> PromptSet:
    """Header row + data rows; the prompt column is the first header in `prompt_cols` (case-insensitive)."""
    r = LineReader(path)
    decoded = (line for _, line in r.lines())
    reader = rows(decoded)
    header = next(reader, None)
    if header is None:
        raise ValueError(f"{r.path}: empty file, expected a header row")
    header = [h.strip() for h in header]
    lower = [h.lower() for h in header]
    idx = next((lower.index(c.lower()) for c in prompt_cols if c.lower() in lower), None)
    if idx is None:
        raise ValueError(f"{r.path}: header {header} has no prompt column (expected one of {list(prompt_cols)})")
    for row in reader:
        lineno = r.lineno  # physical line number (csv's line_num would miss undecodable lines)
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            r.bad(lineno, f"expected {len(header)} columns, got {len(row)}")
            continue
        prompt = row[idx].strip()
        if not prompt:
            r.bad(lineno, "empty prompt")
            continue
        meta = {h: c.strip() for i, (h, c) in enumerate(zip(header, row)) if i != idx}
        r.records.append(PromptRecord(prompt, meta))
    return r.finish()


def read_parti(path: str | Path) -> PromptSet:
    """PartiPrompts.tsv; metadata {"Category", "Challenge", "Note"}. Tabs only; quotes are literal text."""
    return _read_table(path, ("Prompt",), lambda lines: csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE))


def read_drawbench(path: str | Path) -> PromptSet:
    """DrawBench.csv (header `Prompts,Category`); metadata {"Category"}."""
    return _read_table(path, ("Prompts", "Prompt"), lambda lines: csv.reader(lines))
