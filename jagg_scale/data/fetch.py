"""`jagg-prompts fetch` (`make prompts`): the peers' prompt sets that the production configs train and evaluate on,
downloaded at pinned commits into data/prompt_sets/ (git-ignored), each file checked against its pinned digest.

    jagg-prompts fetch [--dest data/prompt_sets] [--mirror URL] [--from DIR]
    jagg-prompts list

A file keeps its path in the peer's repository under a folder named after the peer (flow_grpo/dataset/pickscore/
train.txt), beside the peer's LICENSE, so a config's `prompt_file: data/prompt_sets/flow_grpo/...` names where it
came from. Licences (their LICENSE files come with the sets): Flow-GRPO's dataset/ (Pick-a-Pic captions, GenEval and
OCR prompts) is MIT; DanceGRPO's assets/prompt.txt is Apache-2.0. Pick-a-Pic holds users' own prompts, some explicit.

Each file is pinned by the sha256 of its bytes, or, for the two Flow-GRPO training files no copy of which was at hand
when they were pinned, by the git blob id its commit's tree records (the sha1 of "blob <size>\\0" + its bytes, which
pins the bytes as well). A file already there with the right digest is not fetched again; a download whose digest
differs is not written. --mirror replaces https://raw.githubusercontent.com/ (a proxy, or a local copy served over
http); --from copies from a directory of the same layout (e.g. ../shared/prompts) instead of downloading.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEST", "PROMPT_FILES", "PromptFile", "digest_ok", "fetch", "fetch_hint", "fill_from", "main",
           "missing_file_error", "prompt_sets_dir"]

DEST = Path("data/prompt_sets")  # relative to the working directory, as the configs' paths are (make runs in the repo)
RAW = "https://raw.githubusercontent.com/"
_FLOW_GRPO = ("flow_grpo", "yifan123/flow_grpo/ac4c86e8cae021841f1fde853d340e0db67690dd")  # 2025-07-18
_DANCE_GRPO = ("DanceGRPO", "XueZeyue/DanceGRPO/93ec2537d745202c23bcef0006569cadb612cad0")  # its assets/prompt.txt


@dataclass(frozen=True)
class PromptFile:
    peer: str  # the folder under DEST
    repo_at: str  # owner/name/commit on raw.githubusercontent.com
    path: str  # inside the peer's repository (and under DEST/peer)
    sha256: str | None = None
    git_blob: str | None = None  # where no sha256 was pinned: the blob id in the commit's tree

    @property
    def rel(self) -> str:
        return f"{self.peer}/{self.path}"

    def url(self, mirror: str = RAW) -> str:
        return f"{mirror.rstrip('/')}/{self.repo_at}/{self.path}"


PROMPT_FILES = (
    PromptFile(*_FLOW_GRPO, "LICENSE", "3e06de116fc36fd16e2fb4cff7faa05496533723bf8faf81776a6f51ecc5328d"),
    PromptFile(*_FLOW_GRPO, "dataset/pickscore/train.txt",
               "2f425adcbb9a6d0feee7c6c448e1cb83a1f71deca9434b803907e2578eca837f"),
    PromptFile(*_FLOW_GRPO, "dataset/pickscore/test.txt",
               "d75c025fa451866e70f7e36243f7cdd93095523cb51f5f9651f2ce3236d20262"),
    PromptFile(*_FLOW_GRPO, "dataset/ocr/train.txt", git_blob="3ce0521b77b0a9031191d66ecc36ebaaf27a3922"),
    PromptFile(*_FLOW_GRPO, "dataset/ocr/test.txt", "4dd8caf3ab6ade73bd376c7d14c6ca49b6eacfb1bd321e22c40714ae4a98d4dc"),
    PromptFile(*_FLOW_GRPO, "dataset/geneval/train_metadata.jsonl",
               git_blob="0b97e8a6802c08fc7537cd00c76ae79c851bddcb"),
    PromptFile(*_FLOW_GRPO, "dataset/geneval/test_metadata.jsonl",
               "cec4b24b9fee7bac21c8f787054ecc8dc9ff831674037713a4cd35e0f0a74a28"),
    PromptFile(*_DANCE_GRPO, "LICENSE", "5c7f173199fd7fb3cc83d86d24f3541e8ae0cb8c16e912ca519ed6a1435bd8f3"),
    PromptFile(*_DANCE_GRPO, "assets/prompt.txt", "605f0bded6965d29e45478baecd70c8f7c03ded97099dda11075faa8ee69f4c7"),
)


def digest_ok(data: bytes, f: PromptFile) -> bool:
    if f.sha256 is not None:
        return hashlib.sha256(data).hexdigest() == f.sha256
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == f.git_blob


def _present(dest: Path, f: PromptFile) -> bool:
    path = dest / f.rel
    return path.is_file() and digest_ok(path.read_bytes(), f)


def _write(dest: Path, f: PromptFile, data: bytes) -> None:
    """Atomically (a process beside this one, e.g. another test worker, reads a whole file or none)."""
    path = dest / f.rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def fill_from(source: Path, dest: Path = DEST) -> list[str]:
    """Copy into `dest` every pinned file that `source` (same layout) holds with the pinned digest and `dest` lacks;
    the files copied. A file of `source` with another digest is left where it is."""
    copied = []
    for f in PROMPT_FILES:
        src = Path(source) / f.rel
        if _present(dest, f) or not src.is_file():
            continue
        data = src.read_bytes()
        if digest_ok(data, f):
            _write(dest, f, data)
            copied.append(f.rel)
    return copied


def prompt_sets_dir() -> Path:
    """Where the configs' `data/prompt_sets/...` paths are read from: DEST, or $JAGG_PROMPT_SETS (jagg_scale.paths)."""
    from ..paths import PROMPT_SETS, resolve_path

    return resolve_path(PROMPT_SETS)


def fetch_hint(path) -> str:
    """For a missing file: how to fetch it when it is one of the pinned prompt files (else nothing)."""
    pinned = any(str(path).endswith(f"{DEST.name}/{f.rel}") for f in PROMPT_FILES)
    return " (the peers' prompt sets: make prompts, or .venv/bin/jagg-prompts fetch)" if pinned else ""


def missing_file_error(key: str, value: str | None):
    """The ConfigError for config key `key` naming a prompt file that is not there (None when it is, or no file is
    named), as jagg-train's config check words it."""
    from ..paths import resolve_path
    from ..sections import ConfigError

    if not value or resolve_path(value).is_file():
        return None
    return ConfigError(f"config key '{key}' names a file that does not exist: {value}{fetch_hint(value)}")


class FetchError(RuntimeError):
    """A download that failed or whose digest differs; the message names the file and the URL."""


def fetch(dest: Path = DEST, mirror: str = RAW, timeout_s: float = 60.0, log=print) -> list[str]:
    """Download every pinned file `dest` lacks (or holds with another digest); the files downloaded."""
    got = []
    for f in PROMPT_FILES:
        if _present(dest, f):
            continue
        url = f.url(mirror)
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                data = response.read()
        except OSError as err:  # URLError, HTTPError and timeouts are OSErrors
            raise FetchError(f"could not download {f.rel} from {url}: {err}") from None
        if not digest_ok(data, f):
            raise FetchError(f"{url} is not the pinned {f.rel} ({len(data)} bytes, sha256 "
                             f"{hashlib.sha256(data).hexdigest()[:16]}...): nothing written")
        _write(dest, f, data)
        log(f"{dest / f.rel}  ({len(data)} bytes)")
        got.append(f.rel)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg-prompts", description="the production configs' prompt sets")
    sub = ap.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download the pinned prompt files (those missing) into --dest")
    get.add_argument("--dest", type=Path, default=prompt_sets_dir(),
                     help="where the configs' data/prompt_sets/ paths are read from ($JAGG_PROMPT_SETS if set)")
    get.add_argument("--mirror", default=RAW, help=f"instead of {RAW}")
    get.add_argument("--from", dest="source", type=Path, help="copy from a directory of the same layout instead")
    sub.add_parser("list", help="the pinned files: path, digest, URL")
    args = ap.parse_args(argv)
    if args.command == "list":
        for f in PROMPT_FILES:
            digest = f"sha256:{f.sha256}" if f.sha256 else f"git-blob:{f.git_blob}"
            print(f"{f.rel}  {digest}  {f.url()}")
        return 0
    if args.source is not None:
        if not args.source.is_dir():
            print(f"jagg-prompts: --from {args.source} is not a directory", file=sys.stderr)
            return 2
        fill_from(args.source, args.dest)
    else:
        try:
            fetch(args.dest, args.mirror)
        except FetchError as err:
            print(f"jagg-prompts: {err}", file=sys.stderr)
            return 1
    missing = [f.rel for f in PROMPT_FILES if not _present(args.dest, f)]
    if missing:
        print(f"jagg-prompts: not in {args.source or args.dest} with the pinned digest: {', '.join(missing)}",
              file=sys.stderr)
        return 1
    print(f"{len(PROMPT_FILES)} prompt files in {args.dest}, each with its pinned digest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
