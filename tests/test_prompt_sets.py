"""Readers for shared/prompts: record counts against MANIFEST.md, metadata, blocklist, bad rows."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from jagg_scale.data import (
    FilteredPromptSet,
    PromptSet,
    read_drawbench,
    read_geneval,
    read_ocr,
    read_parti,
    read_pickapic,
    shared_prompts_dir,
)

SHARED = shared_prompts_dir()

# Expected record counts. MANIFEST.md lists `wc -l` (newline count); checked against the files:
#  - pickscore train/test, geneval_official: every line ends in "\n", no header, no blank lines -> wc -l.
#  - flow_grpo geneval: 2211 newlines + 1 last line without "\n" = 2212 records.
#  - ocr: 1017 newlines + 1 last line without "\n" = 1018 records (every line has quoted text).
#  - parti: 1633 lines = 1 header + 1632 prompts (last line ends in "\n").
#  - drawbench: 200 newlines + 1 last line without "\n" = 201 rows = 1 header + 200 prompts.
CASES = [
    ("flow_grpo/dataset/pickscore/train.txt", read_pickapic, 25432, 25432),
    ("flow_grpo/dataset/pickscore/test.txt", read_pickapic, 2048, 2048),
    ("flow_grpo/dataset/geneval/test_metadata.jsonl", read_geneval, 2211, 2211 + 1),
    ("geneval_official/prompts/evaluation_metadata.jsonl", read_geneval, 553, 553),
    ("flow_grpo/dataset/ocr/test.txt", read_ocr, 1017, 1017 + 1),
    ("parti/PartiPrompts.tsv", read_parti, 1633, 1633 - 1),
    ("drawbench/DrawBench.csv", read_drawbench, 200, (200 + 1) - 1),
]


def _shared(rel: str) -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared prompts dir absent: {SHARED}")
    return SHARED / rel


def _manifest_lines(rel: str) -> int:
    for line in (SHARED / "MANIFEST.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == rel:
            return int(cells[2])
    raise AssertionError(f"{rel} not in MANIFEST.md")


@pytest.mark.parametrize("rel,reader,wc_lines,expected", CASES, ids=[c[0] for c in CASES])
def test_counts_match_manifest(rel, reader, wc_lines, expected):
    path = _shared(rel)
    assert _manifest_lines(rel) == wc_lines
    raw = path.read_bytes()
    assert raw.count(b"\n") == wc_lines  # the file is the one the manifest describes
    ps = reader(path)
    assert isinstance(ps, PromptSet)
    assert ps.skipped == 0
    assert len(ps) == expected
    assert ps.source == path
    assert all(r.prompt and r.prompt == r.prompt.strip() for r in ps)


def test_geneval_metadata():
    for rel in ("flow_grpo/dataset/geneval/test_metadata.jsonl", "geneval_official/prompts/evaluation_metadata.jsonl"):
        ps = read_geneval(_shared(rel))
        assert all(isinstance(r.metadata.get("tag"), str) and "include" in r.metadata for r in ps)
        assert all("prompt" not in r.metadata for r in ps)
    first = read_geneval(_shared("flow_grpo/dataset/geneval/test_metadata.jsonl"))[0]
    assert first.prompt == "a photo of two wine glasses"
    assert first.metadata["exclude"] == [{"class": "wine glass", "count": 3}]


def test_ocr_metadata():
    ps = read_ocr(_shared("flow_grpo/dataset/ocr/test.txt"))
    for r in ps:
        assert r.metadata["text"] and f'"{r.metadata["text"]}"' in r.prompt
    assert ps[0].metadata == {"text": "Spring Collection 2024"}


def test_parti_metadata():
    ps = read_parti(_shared("parti/PartiPrompts.tsv"))
    assert all(set(r.metadata) == {"Category", "Challenge", "Note"} and r.metadata["Category"] for r in ps)
    assert ps[0].prompt == "bond" and ps[0].metadata["Category"] == "Abstract"
    assert not any(r.prompt.endswith("\r") or r.metadata["Note"].endswith("\r") for r in ps)  # CRLF rows
    quoted = [r for r in ps if r.prompt.startswith("Dogs playing poker")]
    assert quoted and quoted[0].metadata["Note"] == 'Description of "Dogs Playing Poker"'


def test_drawbench_metadata():
    ps = read_drawbench(_shared("drawbench/DrawBench.csv"))
    assert all(set(r.metadata) == {"Category"} and r.metadata["Category"] for r in ps)
    assert ps[0].prompt == "A red colored car." and ps[0].metadata == {"Category": "Colors"}
    assert any("," in r.prompt for r in ps)  # quoted fields with commas parsed as one column


def test_pickapic_blocklist(tmp_path):
    f = tmp_path / "captions.txt"
    f.write_text("a cat on a mat\nA NUDE statue\nnudelman portrait\n\nsome gore, dark\nrainbow\n")
    ps = read_pickapic(f, blocklist=["nude", "gore"])
    assert isinstance(ps, FilteredPromptSet)
    assert ps.prompts == ["a cat on a mat", "nudelman portrait", "rainbow"]  # whole words only
    assert ps.filtered == 2 and ps.skipped == 0
    plain = read_pickapic(f)
    assert len(plain) == 5 and plain.filtered == 0


def test_malformed_rows_skipped_and_counted(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    g = tmp_path / "g.jsonl"
    g.write_text('{"tag": "a", "prompt": "one"}\n{broken\n\n{"tag": "b"}\n{"tag": "c", "prompt": "two"}\n')
    ps = read_geneval(g)
    assert ps.prompts == ["one", "two"] and ps.skipped == 2
    assert f"{g}:2" in caplog.text and f"{g}:4" in caplog.text

    o = tmp_path / "ocr.txt"
    o.write_text('a sign saying "OPEN"\na sign with no text\n')
    ps = read_ocr(o)
    assert len(ps) == 1 and ps.skipped == 1 and f"{o}:2" in caplog.text

    p = tmp_path / "p.tsv"
    p.write_text("Prompt\tCategory\tChallenge\tNote\r\nok\tA\tB\t\r\nshort\tA\n\tA\tB\tC\n")
    ps = read_parti(p)
    assert ps.prompts == ["ok"] and ps.skipped == 2 and ps[0].metadata == {"Category": "A", "Challenge": "B", "Note": ""}
    assert f"{p}:3" in caplog.text and f"{p}:4" in caplog.text

    d = tmp_path / "d.csv"
    d.write_bytes(b'Prompts,Category\n"A car, red.",Colors\nbad\xff\xfe,X\nx,y,z\nlast,Text')
    ps = read_drawbench(d)
    assert ps.prompts == ["A car, red.", "last"] and ps.skipped == 2
    assert f"{d}:3" in caplog.text and f"{d}:4" in caplog.text

    t = tmp_path / "t.txt"
    t.write_bytes(b"good\n\xff\xfe bad bytes\nalso good")
    ps = read_pickapic(t)
    assert ps.prompts == ["good", "also good"] and ps.skipped == 1


def test_missing_and_empty_files(tmp_path):
    missing = tmp_path / "nope.txt"
    for reader in (read_pickapic, read_geneval, read_ocr, read_parti, read_drawbench):
        with pytest.raises(FileNotFoundError, match="nope.txt"):
            reader(missing)
    e = tmp_path / "empty.txt"
    e.write_text("\n\n")
    with pytest.raises(ValueError, match="no valid prompts"):
        read_pickapic(e)
    h = tmp_path / "h.csv"
    h.write_text("Text,Category\na,b\n")
    with pytest.raises(ValueError, match="no prompt column"):
        read_drawbench(h)


def test_shared_prompts_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("JAGG_SHARED_PROMPTS", str(tmp_path))
    assert shared_prompts_dir() == tmp_path
    monkeypatch.delenv("JAGG_SHARED_PROMPTS")
    assert shared_prompts_dir().parts[-2:] == ("shared", "prompts")
