"""Prompt files -> a list of (prompt, metadata) records.

Prompt sets come from public dumps (flow_grpo's pickscore/geneval files) that occasionally contain a
broken line. One bad line should not stop a run, but it must not vanish either: bad records are skipped,
counted in `PromptSet.skipped`, and logged with file and line number. A file with no usable prompt at all
is an error, since training on nothing would only surface much later.

Formats (by extension): `.txt` one prompt per line; `.jsonl` one JSON object per line with a non-empty
string `prompt` field, every other field kept as metadata (e.g. geneval's tag/include for its scorer). A jsonl
record's `image` field makes it an edit prompt (data.images.EditPrompt): a path relative to the prompt file's
folder, which it may not leave (no absolute paths, no `..` or links out), and which must be an image file (decoded
whole as the file loads, within data.images' bounds, the file's images in threads).
Blank lines are layout, not records, and are skipped silently in both formats.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from . import bounded_json
from .images import EditPrompt, check_images

logger = logging.getLogger(__name__)

__all__ = ["PromptRecord", "PromptSet", "load_prompts", "prompt_file_problem"]

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


def parse_jsonl_record(text: str, folder: Path | None = None) -> PromptRecord:
    """One JSON object with a non-empty string `prompt`; every other field becomes metadata, but `image` (with
    `folder`, the prompt file's): the input image of an edit prompt (module docstring)."""
    obj = bounded_json.loads(text, "the record")
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    prompt = obj.pop("prompt", None)
    if not isinstance(prompt, str):
        raise ValueError("missing 'prompt' field" if prompt is None else f"'prompt' is {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("empty 'prompt'")
    if folder is not None and "image" in obj:
        return PromptRecord(EditPrompt(prompt.strip(), input_image_path(obj.pop("image"), folder)), obj)
    return PromptRecord(prompt.strip(), obj)


def input_image_path(image, folder: Path) -> str:
    """A jsonl record's `image` as a path inside `folder` (resolved, links followed), or a ValueError naming it."""
    if not isinstance(image, str) or not image:
        raise ValueError(f"'image' must be a non-empty path string, got {image!r}")
    root = folder.resolve()
    path = (root / image).resolve()
    if Path(image).is_absolute() or not path.is_relative_to(root):
        raise ValueError(f"'image' {image!r} leaves the prompt file's folder {root}")
    if not path.is_file():
        raise ValueError(f"'image' {image!r} is not a file in {root}")
    return str(path)  # decoded by LineReader.read_lines with the file's other images


_PARSERS = {".txt": _parse_txt, ".jsonl": parse_jsonl_record}


class LineReader:
    """Reads a prompt file line by line: one bad line (undecodable, or rejected by the parser) costs one
    record, counted and logged with file:line; `finish` builds the set and fails when nothing is left."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"prompt file not found: {self.path}")
        self.records: list[PromptRecord] = []
        self.skipped = 0
        self.lineno = 0  # last physical line read by lines()

    def bad(self, lineno: int, why: object) -> None:
        self.skipped += 1
        if self.skipped <= _MAX_LINE_WARNINGS:
            logger.warning("%s:%d: skipping bad prompt record: %s", self.path, lineno, why)

    def lines(self) -> Iterator[tuple[int, str]]:
        """(lineno, decoded line with its line ending); undecodable lines and lines over bounded_json.MAX_LINE_BYTES
        (read no further than the limit: the rest is skipped in chunks) are counted as bad."""
        limit = bounded_json.MAX_LINE_BYTES
        with self.path.open("rb") as f:
            lineno = 0
            while raw := f.readline(limit + 1):
                lineno += 1
                self.lineno = lineno
                if len(raw) > limit and not raw.endswith(b"\n"):
                    while (rest := f.readline(limit)) and not rest.endswith(b"\n"):
                        pass
                    self.bad(lineno, f"line longer than the limit of {limit} bytes")
                    continue
                try:
                    yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    self.bad(lineno, e)

    def read_lines(self, parse: Callable[[str], PromptRecord]) -> None:
        start, linenos = len(self.records), []
        for lineno, line in self.lines():
            text = line.strip()
            if not text:
                continue
            try:
                self.records.append(parse(text))
                linenos.append(lineno)
            except ValueError as e:
                self.bad(lineno, e)
        self._check_images(start, linenos)

    def _check_images(self, start: int, linenos: list[int]) -> None:
        """Decode the input image of every edit record read since `start` (all at once, in threads: check_images),
        now rather than at the run's first step: a bad one costs its record, logged with its line."""
        edits = [i for i in range(start, len(self.records)) if isinstance(self.records[i].prompt, EditPrompt)]
        if not edits:
            return
        folder = self.path.parent.resolve()
        errors = check_images([(self.records[i].prompt.image,
                                f"'image' {os.path.relpath(self.records[i].prompt.image, folder)!r}") for i in edits])
        bad = {i: err for i, err in zip(edits, errors) if err is not None}
        for i, err in bad.items():
            self.bad(linenos[i - start], err)
        if bad:
            self.records[start:] = [r for i, r in enumerate(self.records[start:], start) if i not in bad]

    def finish(self, cls: type[PromptSet] = PromptSet, **extra) -> PromptSet:
        if self.skipped > _MAX_LINE_WARNINGS:
            logger.warning("%s: %d more bad records skipped (not shown)", self.path, self.skipped - _MAX_LINE_WARNINGS)
        if not self.records:
            raise ValueError(f"no valid prompts in {self.path} ({self.skipped} bad records skipped)")
        if self.skipped:
            logger.warning("%s: loaded %d prompts, skipped %d bad records", self.path, len(self.records), self.skipped)
        return cls(records=self.records, skipped=self.skipped, source=self.path, **extra)


def prompt_file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be a prompt file (an unsupported extension, no non-blank line), or None: the cheap checks
    the config runs before any work (train.config.validate); bad lines are still found by `load_prompts`."""
    path = Path(path)
    if path.suffix.lower() not in _PARSERS:
        return (f"has the unsupported extension {path.suffix!r} ({path}); prompt files are "
                f"{' or '.join(sorted(_PARSERS))} (CSV/TSV sets: jagg_scale.data.prompt_sets)")
    with path.open("rb") as f:
        if any(line.strip() for line in f):
            return None
    return f"names a file with no prompt in it (empty or only blank lines): {path}"


def load_prompts(path: str | Path) -> PromptSet:
    """Load a `.txt` or `.jsonl` prompt file; see the module docstring for the rules."""
    reader = LineReader(path)
    parser = _PARSERS.get(reader.path.suffix.lower())
    if parser is None:
        raise ValueError(f"unsupported prompt file extension {reader.path.suffix!r} for {reader.path}; "
                         f"expected one of {sorted(_PARSERS)}")
    if parser is parse_jsonl_record:
        parser = functools.partial(parse_jsonl_record, folder=reader.path.parent)
    reader.read_lines(parser)
    return reader.finish()
