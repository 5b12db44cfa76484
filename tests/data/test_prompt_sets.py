"""The prompt-set readers on real files: record counts against each set's MANIFEST.md, metadata, blocklist, bad rows.

They run on the samples committed in data/prompts/ (tools/make_prompt_samples.py: licensed excerpts of the sets,
and a DrawBench-format file written for this repository), so in any clone; and on the full sets as well when they
are present (`shared_prompts_dir()`, optional).
"""

from __future__ import annotations

import hashlib
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

SAMPLES = Path(__file__).resolve().parents[2] / "data" / "prompts"
SHARED = shared_prompts_dir()
ROOTS = {"samples": SAMPLES, **({"shared": SHARED} if SHARED.is_dir() else {})}

# name -> reader, (file, records) in the full sets, (file, records) in the samples. MANIFEST.md lists `wc -l`
# (newline count); records, checked against the files:
#  - pickscore train/test, geneval_official: every line ends in "\n", no header, no blank lines -> wc -l.
#  - flow_grpo geneval and ocr: the last line has no "\n" (the samples keep that): wc -l + 1 records.
#  - parti: 1 header line, the last line ends in "\n": wc -l - 1.
#  - drawbench: 1 header, the last line without "\n": wc -l + 1 - 1. The samples' file is not DrawBench's prompts
#    (their licence is unknown) but one in its layout, written for this repository.
FILES = {
    "pickscore-train": (read_pickapic, ("flow_grpo/dataset/pickscore/train.txt", 25432),
                        ("flow_grpo/dataset/pickscore/train.txt", 40)),
    "pickscore-test": (read_pickapic, ("flow_grpo/dataset/pickscore/test.txt", 2048),
                       ("flow_grpo/dataset/pickscore/test.txt", 30)),
    "geneval-flow_grpo": (read_geneval, ("flow_grpo/dataset/geneval/test_metadata.jsonl", 2211 + 1),
                          ("flow_grpo/dataset/geneval/test_metadata.jsonl", 29 + 1)),
    "geneval-official": (read_geneval, ("geneval_official/prompts/evaluation_metadata.jsonl", 553),
                         ("geneval_official/prompts/evaluation_metadata.jsonl", 20)),
    "ocr": (read_ocr, ("flow_grpo/dataset/ocr/test.txt", 1017 + 1), ("flow_grpo/dataset/ocr/test.txt", 29 + 1)),
    "parti": (read_parti, ("parti/PartiPrompts.tsv", 1633 - 1), ("parti/PartiPrompts.tsv", 27 - 1)),
    "drawbench": (read_drawbench, ("drawbench/DrawBench.csv", 200 + 1 - 1),
                  ("drawbench_format/example.csv", 8 + 1 - 1)),
}
CASES = [pytest.param(root, name, id=f"{root}-{name}") for root in ROOTS for name in FILES]


def _file(root: str, name: str) -> tuple[Path, int]:
    reader, full, sample = FILES[name]
    rel, records = full if root == "shared" else sample
    return ROOTS[root] / rel, records


def _manifest_row(root: str, path: Path) -> list[str]:
    rel = path.relative_to(ROOTS[root]).as_posix()
    for line in (ROOTS[root] / "MANIFEST.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == rel:
            return cells
    raise AssertionError(f"{rel} not in {ROOTS[root] / 'MANIFEST.md'}")


@pytest.mark.parametrize("root,name", CASES)
def test_counts_match_manifest(root, name):
    path, expected = _file(root, name)
    _, size, wc_lines, sha = _manifest_row(root, path)
    raw = path.read_bytes()
    assert (len(raw), raw.count(b"\n"), hashlib.sha256(raw).hexdigest()[:16]) == (int(size), int(wc_lines), sha)
    ps = FILES[name][0](path)
    assert isinstance(ps, PromptSet)
    assert ps.skipped == 0
    assert len(ps) == expected
    assert ps.source == path
    assert all(r.prompt and r.prompt == r.prompt.strip() for r in ps)


def test_samples_carry_their_licences():
    for source in ("flow_grpo", "geneval_official", "parti"):
        assert (SAMPLES / source / "LICENSE").is_file(), source
        assert f"- {source}/ :" in (SAMPLES / "MANIFEST.md").read_text()


@pytest.mark.parametrize("root", ROOTS)
def test_geneval_metadata(root):
    for name in ("geneval-flow_grpo", "geneval-official"):
        ps = read_geneval(_file(root, name)[0])
        assert all(isinstance(r.metadata.get("tag"), str) and "include" in r.metadata for r in ps)
        assert all("prompt" not in r.metadata for r in ps)
    first = read_geneval(_file(root, "geneval-flow_grpo")[0])[0]
    assert first.prompt == "a photo of two wine glasses"
    assert first.metadata["exclude"] == [{"class": "wine glass", "count": 3}]


@pytest.mark.parametrize("root", ROOTS)
def test_ocr_metadata(root):
    ps = read_ocr(_file(root, "ocr")[0])
    for r in ps:
        assert r.metadata["text"] and f'"{r.metadata["text"]}"' in r.prompt
    assert ps[0].metadata == {"text": "Spring Collection 2024"}


@pytest.mark.parametrize("root", ROOTS)
def test_parti_metadata(root):
    ps = read_parti(_file(root, "parti")[0])
    assert all(set(r.metadata) == {"Category", "Challenge", "Note"} and r.metadata["Category"] for r in ps)
    assert ps[0].prompt == "bond" and ps[0].metadata["Category"] == "Abstract"
    assert not any(r.prompt.endswith("\r") or r.metadata["Note"].endswith("\r") for r in ps)  # CRLF rows
    quoted = [r for r in ps if r.prompt.startswith("Dogs playing poker")]
    assert quoted and quoted[0].metadata["Note"] == 'Description of "Dogs Playing Poker"'


@pytest.mark.parametrize("root", ROOTS)
def test_drawbench_metadata(root):
    ps = read_drawbench(_file(root, "drawbench")[0])
    assert all(set(r.metadata) == {"Category"} and r.metadata["Category"] for r in ps)
    first = "A red colored car." if root == "shared" else "A yellow kite above a green hill."
    assert ps[0].prompt == first and ps[0].metadata == {"Category": "Colors"}
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
    assert ps.prompts == ["ok"] and ps.skipped == 2
    assert ps[0].metadata == {"Category": "A", "Challenge": "B", "Note": ""}
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
