"""Model paths that may be Hugging Face hub ids, resolved through the local hub cache, offline by default.

    /models/sd3.5-medium                           a local path: used as it is
    stabilityai/stable-diffusion-3.5-medium        a hub id: its snapshot directory in the local hub cache
    xswu/HPSv2/HPS_v2.1_compressed.pt              a hub id and a file in it: that file of the snapshot

A local path that exists always wins, so a relative directory named like an id still loads. The cache is the one
the hub library writes (`hf download ID` fills it): $HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub, laid out as models--ORG--NAME/{refs/main, snapshots/REVISION/...}; the revision is the
one refs/main names. Nothing is downloaded unless the caller allows it (`model.allow_download: true`, a reward's
`allow_download: true`): a run must not start an hour-long download, or hang on a hub timeout, by accident. A
missing id fails at once with HubModelNotFoundError naming the id, the cache directory and the command that
fetches it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Sequence

from .paths import resolve_path

__all__ = ["HubModelNotFoundError", "hub_cache_dir", "looks_like_hub_id", "resolve_model_path"]

# ORG/NAME, optionally followed by /path/inside/the/repo (hub names: letters, digits, '-', '_', '.')
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:/(?P<file>[^\s]+))?$")

Fetch = Callable[[str, Path], object]  # (repo_id, cache_dir) -> anything; puts the repo's files into the cache


class HubModelNotFoundError(FileNotFoundError):
    """A hub id that is not in the local hub cache (and was not, or could not be, downloaded)."""


def hub_cache_dir() -> Path:
    """The hub cache directory, read from the environment at each call (huggingface_hub reads it once, at import)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def looks_like_hub_id(value: str) -> bool:
    """ORG/NAME[/FILE], not an absolute, home or ./ path."""
    return _HUB_ID.match(str(value)) is not None and ".." not in str(value).split("/")


def _cached(repo_id: str, filename: str, cache: Path) -> Path | None:
    """The cached copy of `filename` in the revision refs/main names, or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename, cache_dir=str(cache))
    return Path(found) if isinstance(found, str) else None  # None, or the "known not to exist" sentinel


def _locate(repo_id: str, file: str | None, markers: Sequence[str], cache: Path) -> Path | None:
    """The file, or the snapshot directory holding one of `markers` (the snapshot's top-level files that make
    it the kind of directory the caller loads), or None."""
    if file:
        return _cached(repo_id, file, cache)
    for marker in markers:
        found = _cached(repo_id, marker, cache)
        if found is not None:
            return found.parent
    return None


def _download(repo_id: str, file: str | None, cache: Path, fetch: Fetch | None) -> None:
    if file:
        from huggingface_hub import hf_hub_download

        hf_hub_download(repo_id, file, cache_dir=str(cache))
    elif fetch is not None:
        fetch(repo_id, cache)
    else:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, cache_dir=str(cache))


def resolve_model_path(value, *, what: str, allow_download: bool = False, markers: Sequence[str] = (),
                       fetch: Fetch | None = None, download_option: str = "allow_download: true",
                       fetch_args: str = "") -> Path:
    """`value` as a local Path: itself when it exists (or is not shaped like a hub id: the caller's own checks then
    say what is missing), else the hub id's cached file or snapshot directory (see the module docstring).

    what: the config key or reward named in errors. markers: files one of which the snapshot directory must hold
    (model_index.json for a pipeline, config.json for a transformers model); with none, only ORG/NAME/FILE ids are
    resolved. allow_download: fetch a missing id (`fetch(repo_id, cache_dir)`, default the whole snapshot; a file
    id fetches that file alone) instead of failing; a cached id is never re-downloaded. download_option: the
    setting named in the error that allows downloading. fetch_args: appended to the `hf download ID` the error
    suggests (e.g. --include patterns that leave out the weights a tokenizer directory does not need)."""
    path = resolve_path(value)
    text = str(value)
    if path.exists() or not looks_like_hub_id(text):
        return path
    match = _HUB_ID.match(text)
    repo_id, file = match["repo"], match["file"]
    if not file and not markers:
        return path  # only a file makes sense here: the caller names the missing path
    try:
        import huggingface_hub  # noqa: F401  (the models extra brings it)
    except ImportError:
        raise HubModelNotFoundError(f"{what}: {text!r} is not a local path; as a hub id it needs huggingface_hub, "
                                    "which is not installed (pip install 'jagg-scale[models]')") from None
    cache = hub_cache_dir()
    found = _locate(repo_id, file, markers, cache)
    if found is None and allow_download:
        try:
            _download(repo_id, file, cache, fetch)
        except Exception as err:  # offline, no such repo, gated, disk full: say which id and where
            raise HubModelNotFoundError(f"{what}: downloading {text!r} into the hub cache {cache} failed: "
                                        f"{type(err).__name__}: {err}") from err
        found = _locate(repo_id, file, markers, cache)
    if found is None:
        raise HubModelNotFoundError(_not_found(what, text, repo_id, file, markers, cache, allow_download,
                                               download_option, fetch_args))
    return found


def _not_found(what, text, repo_id, file, markers, cache, allow_download, download_option, fetch_args) -> str:
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    target = f"file {file!r}" if file else f"snapshot holding {' / '.join(markers)}"
    lines = [f"{what}: {text!r} is not a local path, and the hub cache {cache} has no {target} for hub id "
             f"{repo_id!r} (looked in {repo_dir}, revision refs/main)."]
    if allow_download:
        lines.append("It was downloaded, but is still missing: check the id and the file name.")
    else:
        lines.append(f"Nothing is downloaded at run time unless {download_option}.")
    # the cache named on the command line: the machine that fetches may not share this run's environment
    args = repo_id + (f" {file}" if file else "")
    extra = f" {fetch_args}" if fetch_args and not file else ""
    lines.append(f"Fetch it with:  HF_HUB_CACHE={cache} hf download {args}{extra}   (older huggingface_hub: "
                 f"huggingface-cli download {args})")
    return "\n".join(lines)
