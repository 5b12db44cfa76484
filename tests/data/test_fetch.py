"""`jagg-prompts fetch` (jagg_scale/data/fetch.py) against a real local HTTP server (the suite never goes online):
files land at their paths with the pinned digests, a second fetch downloads nothing, a wrong or failed download
writes nothing and names the file; the production configs read only pinned files; the pins match the local copy
of the peers' sets when there is one."""

from __future__ import annotations

import functools
import hashlib
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from jagg_scale.data import fetch as F
from jagg_scale.data import shared_prompts_dir

ROOT = Path(__file__).resolve().parents[2]
TRAIN, LICENCE = b"a red apple\na blue sky\n", b"MIT License\n"


class _Quiet(SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args):  # the test's output, not the server's
        pass

    def do_GET(self):
        _Quiet.requests.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """A directory served over http on localhost, laid out as raw.githubusercontent.com: (folder, base URL)."""
    root = tmp_path / "served"
    root.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Quiet.requests = []
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    thread.join()


@pytest.fixture
def pinned(monkeypatch):
    """Two pinned files of a made-up peer, one by sha256 and one by git blob id."""
    blob = hashlib.sha1(b"blob %d\0" % len(LICENCE) + LICENCE).hexdigest()
    files = (F.PromptFile("peer", "o/r/c0ffee", "dataset/train.txt", hashlib.sha256(TRAIN).hexdigest()),
             F.PromptFile("peer", "o/r/c0ffee", "LICENSE", git_blob=blob))
    monkeypatch.setattr(F, "PROMPT_FILES", files)
    return files


def _serve(root: Path, rel: str, data: bytes) -> None:
    (root / "o/r/c0ffee" / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / "o/r/c0ffee" / rel).write_bytes(data)


def test_fetch_downloads_the_pinned_files_once(server, pinned, tmp_path, capsys):
    root, url = server
    _serve(root, "dataset/train.txt", TRAIN)
    _serve(root, "LICENSE", LICENCE)
    dest = tmp_path / "prompt_sets"
    assert F.main(["fetch", "--dest", str(dest), "--mirror", url]) == 0
    assert (dest / "peer/dataset/train.txt").read_bytes() == TRAIN and (dest / "peer/LICENSE").read_bytes() == LICENCE
    assert sorted(_Quiet.requests) == ["/o/r/c0ffee/LICENSE", "/o/r/c0ffee/dataset/train.txt"]
    assert F.main(["fetch", "--dest", str(dest), "--mirror", url]) == 0  # all there: nothing downloaded
    assert len(_Quiet.requests) == 2
    (dest / "peer/LICENSE").write_bytes(b"edited\n")  # a file with another digest is fetched again
    assert F.main(["fetch", "--dest", str(dest), "--mirror", url]) == 0
    assert (dest / "peer/LICENSE").read_bytes() == LICENCE and len(_Quiet.requests) == 3


def test_a_download_with_another_digest_or_none_writes_nothing(server, pinned, tmp_path, capsys):
    root, url = server
    _serve(root, "dataset/train.txt", TRAIN + b"one more line\n")
    dest = tmp_path / "prompt_sets"
    assert F.main(["fetch", "--dest", str(dest), "--mirror", url]) == 1
    err = capsys.readouterr().err
    assert "is not the pinned peer/dataset/train.txt" in err and len(err.strip().splitlines()) == 1
    assert not (dest / "peer/dataset/train.txt").exists()
    _serve(root, "dataset/train.txt", TRAIN)  # now right, but LICENSE is not served: a 404
    assert F.main(["fetch", "--dest", str(dest), "--mirror", url]) == 1
    err = capsys.readouterr().err
    assert f"could not download peer/LICENSE from {url}o/r/c0ffee/LICENSE" in err
    assert (dest / "peer/dataset/train.txt").read_bytes() == TRAIN and not (dest / "peer/LICENSE").exists()


def test_fill_from_copies_only_files_with_the_pinned_digest(pinned, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "peer/dataset").mkdir(parents=True)
    (src / "peer/dataset/train.txt").write_bytes(TRAIN)
    (src / "peer/LICENSE").write_bytes(b"another licence\n")
    assert F.fill_from(src, dest) == ["peer/dataset/train.txt"]
    assert not (dest / "peer/LICENSE").exists()
    assert F.main(["fetch", "--from", str(src), "--dest", str(dest)]) == 1  # one pinned file still missing


def test_the_production_configs_read_pinned_files_only():
    pinned = {f"{F.DEST}/{f.rel}" for f in F.PROMPT_FILES}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        for section in ("data", "eval"):
            value = (cfg.get(section) or {}).get("prompt_file") or ""
            assert "shared/prompts" not in value, f"{path.name} {section}.prompt_file: {value} is in no clone"
            if value.startswith(str(F.DEST)):
                assert value in pinned, f"{path.name} {section}.prompt_file: {value} is not a pinned file"


@pytest.mark.skipif(not shared_prompts_dir().is_dir(), reason="no local copy of the peers' prompt sets")
def test_the_pins_match_the_local_copy_of_the_peers_sets():
    held = [f for f in F.PROMPT_FILES if (shared_prompts_dir() / f.rel).is_file()]
    assert len(held) >= 7  # all but the two training files pinned by git blob id
    assert all(F.digest_ok((shared_prompts_dir() / f.rel).read_bytes(), f) for f in held)
