"""The README and docs/ hold together for a newcomer: every relative link and every repository path they quote exists,
every docs page is reachable from docs/index.md, the README stays a five-minute read, and the make commands it
quotes are targets of the Makefile."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

# a markdown link's or an <img>'s target
LINK = re.compile(r"\]\(([^)\s]+)\)|<img[^>]*\bsrc=\"([^\"]+)\"")
# a path of this repository quoted in prose or code: starts at one of its top-level folders, ends in a file name with
# an extension or a slash (run outputs such as runs/... are not files of the repository)
TOP = ("jagg_scale", "configs", "docs", "tools", "tests", "launchers", "slurm", "data")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w(?:\.\w+|/))" % "|".join(TOP))


def _links(text: str) -> list[str]:
    return [a or b for a, b in LINK.findall(text)]


def _local(target: str) -> str | None:
    """The file part of a relative link (None: a web address, a mail address or an anchor on the same page)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return None
    return target.split("#", 1)[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    dead = [t for t in _links(page.read_text()) if (f := _local(t)) and not (page.parent / f).exists()]
    assert not dead, f"{page.relative_to(ROOT)}: links to missing files: {dead}"


def _glob_free(path: str) -> bool:
    """Not a pattern or a placeholder (configs/*.yaml, step_XXXXXXXX, configs/NAME.yaml)."""
    return not any(c in path for c in "*{}<>") and not re.search(r"(?:^|[/_])[A-Z]{3,}", path)


def _fetched() -> list[str]:
    """The repository's git-ignored folders (.gitignore's rooted entries, e.g. /data/prompt_sets/): what a command
    fills after cloning, so a page may name them before they exist."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return [ln.strip("/") + "/" for ln in lines if ln.startswith("/") and ln.endswith("/")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_repository_path_exists(page):
    """`configs/x.yaml`, `jagg_scale/train/update.py`, `docs/results/...`: a renamed or moved file shows up here."""
    quoted = {m.rstrip(".") for m in PATH.findall(page.read_text()) if _glob_free(m)}
    fetched = _fetched()
    missing = sorted(p for p in quoted if not (ROOT / p).exists() and not any(p.startswith(f) for f in fetched))
    assert not missing, f"{page.relative_to(ROOT)} quotes paths that do not exist: {missing}"


def test_every_docs_page_is_linked_from_the_index():
    index = DOCS / "index.md"
    linked = {(DOCS / f).resolve() for t in _links(index.read_text()) if (f := _local(t))}
    orphans = [p.name for p in DOCS.glob("*.md") if p != index and p.resolve() not in linked]
    assert not orphans, f"docs pages not linked from docs/index.md: {orphans}"
    assert "docs/index.md" in _links(README.read_text())


def test_generated_results_live_apart_from_the_prose():
    stray = [p.name for p in DOCS.iterdir() if p.is_file() and p.suffix != ".md"]
    assert not stray, f"generated files beside the prose (they belong in docs/results/): {stray}"


def test_the_readme_is_a_short_read():
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes; the limit is 12 KB (the rest belongs in docs/)"


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):(?!=)", text, re.M))


def test_the_make_commands_the_readme_quotes_are_targets():
    quoted = set(re.findall(r"(?<![\w/.-])make ([a-z][\w-]*)", README.read_text()))
    assert {"run", "test", "test-fast"} <= quoted
    unknown = sorted(quoted - _make_targets())
    assert not unknown, f"README quotes make targets the Makefile lacks: {unknown}"
