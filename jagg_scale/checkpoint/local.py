"""Crash-safe checkpoint directories, written by one rank or collectively by all: safetensors for weights,
``torch.save`` for everything else.

Why this layout: a GRPO run is long and preemptible, so a checkpoint must never *look* usable when it is
not. A save writes into a hidden temp dir ``root/.tmp_step_...``, fsyncs every file, writes
``manifest.json`` (step, byte size and sha256 of every file), writes the ``COMPLETE`` marker last (it holds
the manifest's sha256, so the manifest is covered too) and only then renames the dir to
``root/step_{step:08d}``. A rename within one filesystem is atomic, so a crash at any point leaves the old
state or a whole new checkpoint, never a half-written ``step_*`` dir. Readers still verify (marker,
manifest, sizes, hashes) because disks, copies and people break files after the fact, and
``newest_valid_checkpoint`` falls back to the newest checkpoint that passes. Across ranks, each file is hashed by
one rank, in parallel with the others (digests.py says who hashes what), on save and on verify.

Weights go to safetensors (no pickle, mmap-able, readable by other tools); optimizer and RNG state are nested
containers of tensors and numbers, written with ``torch.save`` and read back with the weights-only unpickler: no
file of a checkpoint can run code when it loads, whoever wrote it (pickles.py; the manifest cannot vouch for
that, since whoever can write the directory can recompute it). One job owns ``root`` (the run lock,
train/run_lock.py); temp dirs are named per attempt (pid and a random suffix), and stale ``.tmp_*`` dirs are
deleted after every successful save. ``save_checkpoint_dir`` is the same protocol around any writer, collective
across ranks (the engines' DCP / DeepSpeed checkpoints use it).

Manifest format 1: ``{"format_version", "step", "tensors", "objects", "world_size", "files": {relative path:
{"bytes", "sha256", "rank"}}}``; ``world_size`` and ``rank`` (who hashed the file) are newer and optional, so
older checkpoints still verify; a manifest of a higher format version is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from . import digests, pickles
from .errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
STATE = "state.json"
FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp_"
_STEP_RE = re.compile(r"^step_(\d+)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Checkpoint:
    """Everything one ``save_checkpoint`` call wrote, loaded back."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]]
    objects: dict[str, Any]
    state: dict
    path: Path


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """Final directory of ``step`` (zero-padded so names sort like steps in ``ls``)."""
    return Path(root) / f"step_{step:08d}"


def save_checkpoint(root: str | os.PathLike, step: int, *, tensors: Mapping[str, Mapping[str, torch.Tensor]],
                    objects: Mapping[str, Any], state: dict, keep_last: int | None = None) -> Path:
    """Atomically write ``root/step_{step:08d}/`` and return its path (see the module docstring for the protocol).

    ``tensors`` maps a name to a state dict (``<name>.safetensors``), ``objects`` a name to tensors, numbers and
    containers of them (``<name>.pt``; read back weights-only, so nothing else loads), ``state`` is JSON trainer
    state (``state.json``). An existing dir for the same step (e.g. from a run that crashed after this step and is
    replaying it) is replaced only once the new one is complete. ``keep_last`` then deletes the oldest complete
    checkpoints beyond that many, never this one.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last!r}")
    for name in [*tensors, *objects]:  # names become file names: keep them plain
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"invalid checkpoint entry name {name!r}: use letters, digits, '_', '.', '-'")
    json.dumps(state)  # fail on bad state before any I/O

    def write(tmp: Path) -> list[Path]:
        return ([write_tensors(tmp / f"{name}.safetensors", sd) for name, sd in tensors.items()]
                + [write_object(tmp / f"{name}.pt", obj) for name, obj in objects.items()])

    return save_checkpoint_dir(root, step, write=write, state=state, keep_last=keep_last,
                               tensors=list(tensors), objects=list(objects))


def save_checkpoint_dir(root: str | os.PathLike, step: int, *, write: Callable[[Path], Iterable[str | Path] | None],
                        state: dict, keep_last: int | None = None, tensors: Sequence[str] = (),
                        objects: Sequence[str] = (), dist=None) -> Path:
    """The atomic protocol around any writer: `write(tmp_dir)` fills a temp dir (files and sub-directories, e.g. DCP
    shards or a DeepSpeed checkpoint) and returns the files it wrote; the manifest then holds the size and sha256 of
    every file in it, the COMPLETE marker seals it and a rename publishes it.

    With a `dist` context (parallel.dist.DistContext) `write` is collective: every rank writes its part into the
    same temp dir (a shared filesystem) and hashes the files its `write` returned (digests.py: in parallel, not rank
    0 alone); rank 0 alone creates, seals, publishes and prunes. A failure on any rank (writing, hashing, sealing)
    raises the same CheckpointError on every rank instead of leaving the others waiting in a collective, and no
    rank can see a half-written checkpoint as complete.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last!r}")
    if state.get("step", step) != step:
        raise ValueError(f"state['step'] is {state['step']!r}, but the checkpoint is of step {step}")
    # fail on bad state before any I/O; the step is always in it: verification checks it against the directory
    state_bytes = json.dumps({**state, "step": step}, indent=2, sort_keys=True).encode()
    multi = dist is not None and dist.active
    main = dist is None or dist.is_main
    barrier = dist.barrier if dist is not None else (lambda: None)

    # absolute: writers report the paths they built from the temp dir, and a relative run directory (make run's
    # runs/digits_cpu) made those relative to the working directory, not to the temp dir they are read against
    root = Path(root).absolute()
    final = checkpoint_dir(root, step)
    # unique per attempt (rank 0's pid and a random suffix, sent to the other ranks): a second job or an orphaned
    # worker saving the same step never writes into this attempt's files (DCP's `.metadata.tmp` included)
    tmp_name = f"{_TMP_PREFIX}{final.name}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    tmp = root / (dist.broadcast_object(tmp_name) if multi else tmp_name)
    if main:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    barrier()
    try:
        files = _write_and_hash(tmp, final, write, dist)  # collective: also the "everyone has written" point
        problem, cause = None, None
        if main:
            try:
                _seal(tmp, final, step, files, state_bytes, tensors, objects,
                      world_size=dist.world_size if dist is not None else 1)
            except Exception as err:
                if not multi:
                    raise
                problem, cause = f"rank 0 could not seal it: {type(err).__name__}: {err}", err
        if multi:  # rank 0 says whether it published; the others wait here, not in a barrier that never ends
            problem = dist.broadcast_object(problem)
            if problem:
                raise CheckpointError(f"checkpoint {final} not saved: {problem}") from cause
    except BaseException:
        if main:
            _remove_tree(tmp)  # best effort; a hard kill leaves it for the next save's cleanup
        raise
    if main:
        _clean_stale_tmp(root)
        if keep_last is not None:
            _prune(root, keep_last, protect=final)
        log.info("saved checkpoint %s", final)
    barrier()
    return final


def _write_and_hash(tmp: Path, final: Path, write, dist) -> dict[str, dict]:
    """Every rank writes, then hashes what it wrote; the digests of all ranks, merged (collective). One process:
    any error propagates unchanged; several: every rank raises the same CheckpointError."""
    multi = dist is not None and dist.active
    rank = dist.rank if dist is not None else 0
    mine, problem, cause = {}, None, None
    try:
        mine = digests.hash_written(tmp, write(tmp) or (), rank)
    except Exception as err:
        if not multi:
            raise
        problem, cause = f"rank {rank}: {type(err).__name__}: {err}", err
    parts = dist.all_gather_object((mine, problem)) if multi else [(mine, None)]
    files, problem = digests.merge(parts)
    if problem:
        raise CheckpointError(f"checkpoint {final} not saved: {problem}") from cause
    return files


def _seal(tmp: Path, final: Path, step: int, files: dict[str, dict], state_bytes: bytes, tensors: Sequence[str],
          objects: Sequence[str], world_size: int) -> None:
    """Rank 0: state.json, the files no rank reported, the manifest, the COMPLETE marker, the rename."""
    write_bytes(tmp / STATE, state_bytes)
    files = dict(files)
    for p in sorted(p for p in tmp.rglob("*") if p.is_file()):
        name = p.relative_to(tmp).as_posix()
        if name not in files:  # state.json, or a writer that did not say (e.g. DeepSpeed's recovery scripts)
            files[name] = digests.entry(p, 0)
    manifest = {"format_version": FORMAT_VERSION, "step": step, "tensors": list(tensors), "objects": list(objects),
                "world_size": world_size, "files": files}
    manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode()
    write_bytes(tmp / MANIFEST, manifest_bytes)
    _write_complete(tmp, manifest_bytes)
    _fsync_dir(tmp)
    _publish(tmp, final)


def write_tensors(path: Path, state_dict: Mapping[str, torch.Tensor]) -> Path:
    # One contiguous CPU copy per entry: safetensors refuses tensors that share storage (tied weights)
    # and non-contiguous views, and copying also decouples the file from training that continues after.
    cpu = {}
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{path.name}: entry {key!r} is {type(t).__name__}, not a tensor; put it in objects")
        cpu[key] = t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
    save_file(cpu, str(path))
    _fsync_path(path)
    return path


def write_object(path: Path, obj: Any) -> Path:
    return _write_fsynced(path, lambda f: torch.save(obj, f))


def write_bytes(path: Path, data: bytes) -> Path:
    return _write_fsynced(path, lambda f: f.write(data))


def _write_fsynced(path: Path, write) -> Path:
    try:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # a write or fsync error names no file: name the one being written (a full disk)
        if err.filename is None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise
    return path


def _write_complete(tmp: Path, manifest_bytes: bytes) -> None:
    """The marker is the commit record: written last, it vouches for the manifest by hash."""
    write_bytes(tmp / COMPLETE, (hashlib.sha256(manifest_bytes).hexdigest() + "\n").encode())


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside first (POSIX can't replace a non-empty dir)."""
    if not final.exists():
        os.replace(tmp, final)
    else:
        aside = final.parent / f"{_TMP_PREFIX}old_{final.name}_{uuid.uuid4().hex[:8]}"
        os.replace(final, aside)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(aside, final)  # put the previous one back rather than leave no step dir at all
            raise
        _fsync_dir(final.parent)
        _remove_tree(aside)
    _fsync_dir(final.parent)


def _clean_stale_tmp(root: Path) -> None:
    for p in root.iterdir():
        if p.name.startswith(_TMP_PREFIX):
            log.info("removing stale temp checkpoint %s", p)
            _remove_tree(p)


def _prune(root: Path, keep_last: int, protect: Path) -> None:
    complete = [p for p in list_checkpoints(root) if (p / COMPLETE).is_file()]
    keep = set(complete[-keep_last:]) | {protect}
    for p in complete:
        if p not in keep:
            # Rename first so a crash mid-delete can't leave a step_* dir with a marker but missing files.
            doomed = root / f"{_TMP_PREFIX}del_{p.name}_{uuid.uuid4().hex[:8]}"
            os.replace(p, doomed)
            _remove_tree(doomed)
            log.info("deleted old checkpoint %s (keep_last=%d)", p, keep_last)


def _remove_tree(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Persist renames/creations in ``path``; not possible on every OS (e.g. Windows), hence best effort."""
    try:
        _fsync_path(path)
    except OSError:
        pass


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """All ``step_*`` dirs under ``root`` sorted by step, complete or not (temp dirs never appear)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: str | os.PathLike, dist=None) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a complete checkpoint whose files match its manifest.

    With a `dist` context this is collective and hashes each file once, on one rank (digests.py): every rank
    checks the manifest and the sizes, hashes its share, and every rank raises the same error, or none does."""
    _verify(Path(path), dist)


def _verify(path: Path, dist=None) -> dict:
    multi = dist is not None and dist.active
    rank, world = (dist.rank, dist.world_size) if multi else (0, 1)
    manifest, problem = None, None
    try:
        manifest = _read_manifest(path)
        files = {n: (int(e["bytes"]), str(e["sha256"])) for n, e in manifest["files"].items()}
        for name in digests.share({n: b for n, (b, _) in files.items()}, rank, world):
            try:
                same = digests.sha256_file(path / name) == files[name][1]
            except OSError as err:
                raise CheckpointError(f"checkpoint {path}: cannot read {name} ({err})") from err
            if not same:
                raise CheckpointError(f"checkpoint {path}: {name} sha256 mismatch (corrupted)")
            if pickles.is_pickle(name):  # the hash says nothing about what a pickle runs: pickles.py
                pickles.check_file(path / name, name)
    except (CheckpointError, OSError) as err:
        if not multi:
            raise
        problem = str(err) if isinstance(err, CheckpointError) else f"checkpoint {path}: {err}"
    if multi:
        problem = digests.first_problem(dist.all_gather_object(problem))
        if problem:
            raise CheckpointError(problem)
    return manifest


def _read_manifest(path: Path) -> dict:
    """Everything but the hashes: the marker vouches for the manifest, which lists every file at its size."""
    def fail(problem: str):
        raise CheckpointError(f"checkpoint {path}: {problem}")

    if path.is_symlink():  # a link can point anywhere: a checkpoint is read only where it was written
        fail("is a symbolic link (a checkpoint is read only in place, never through a link)")
    if not path.is_dir():
        fail("not a directory")
    links = _links_inside(path)
    if links:
        fail(f"holds symbolic links ({', '.join(links[:3])}): its files are read only in place, never through a link")
    if not (path / COMPLETE).is_file():
        fail(f"missing {COMPLETE} marker (the save did not finish)")
    if not (path / MANIFEST).is_file():
        fail(f"missing {MANIFEST}")
    raw = _read_small(path / MANIFEST, fail)
    if _read_small(path / COMPLETE, fail).decode(errors="replace").strip() != hashlib.sha256(raw).hexdigest():
        fail(f"{MANIFEST} sha256 does not match the {COMPLETE} marker")
    try:
        manifest = json.loads(raw)
        version = int(manifest.get("format_version", 1))
        step = int(manifest["step"])
        files = {n: (int(e["bytes"]), str(e["sha256"])) for n, e in manifest["files"].items()}
        listed = [f"{n}.safetensors" for n in manifest["tensors"]] + [f"{n}.pt" for n in manifest["objects"]]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        fail(f"unreadable {MANIFEST} ({type(e).__name__}: {str(e)[:200]})")
    if version > FORMAT_VERSION:
        fail(f"{MANIFEST} has format_version {version}; this code reads up to {FORMAT_VERSION} (a newer jagg_scale "
             "wrote it)")
    if not set(listed + [STATE]) <= set(files):
        fail(f"{MANIFEST} has no size/sha256 for {sorted(set(listed + [STATE]) - set(files))}")
    m = _STEP_RE.match(path.name)
    if m and int(m.group(1)) != step:
        fail(f"{MANIFEST} says step {step} but the directory name says {int(m.group(1))}")
    for name, (nbytes, _) in sorted(files.items()):
        f = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            fail(f"{MANIFEST} lists a path outside the checkpoint: {name!r}")
        if not f.is_file():
            fail(f"missing file {name}")
        if f.stat().st_size != nbytes:
            fail(f"{name} is {f.stat().st_size} bytes but {MANIFEST} says {nbytes} (truncated or overwritten)")
    _check_state(path, step, fail)
    return manifest


# manifest.json, COMPLETE and state.json are read whole and parsed: bounded, so that a file planted in a checkpoint
# cannot exhaust memory (a run's state.json is a few KB: its config and the prompt source's position)
MAX_SMALL_FILE = 64 << 20


def _read_small(path: Path, fail) -> bytes:
    size = path.stat().st_size
    if size > MAX_SMALL_FILE:
        fail(f"{path.name} is {size} bytes (at most {MAX_SMALL_FILE} are read)")
    return path.read_bytes()


def _links_inside(path: Path) -> list[str]:
    """The symbolic links anywhere under `path` (not followed), relative to it."""
    found = []
    for parent, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            if os.path.islink(os.path.join(parent, name)):
                found.append(Path(parent, name).relative_to(path).as_posix())
    return sorted(found)


def _check_state(path: Path, step: int, fail) -> None:
    """state.json is JSON holding the manifest's step (written by the same save): a step dir whose state says another
    step would resume at the wrong step and overwrite the rows and checkpoints after it."""
    try:
        state = json.loads(_read_small(path / STATE, fail))
        saved = state["step"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        fail(f"unreadable {STATE} ({type(e).__name__}: {str(e)[:200]})")
    if isinstance(saved, bool) or not isinstance(saved, int) or saved != step:
        fail(f"{STATE} says step {saved!r} but {MANIFEST} and the directory say {step}")


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> Checkpoint:
    """Verify, then load everything ``save_checkpoint`` wrote.

    The ``.pt`` files load with the weights-only unpickler (pickles.py): tensors and plain data, never code. The
    sha256 manifest cannot vouch for that (whoever can write the directory can recompute it).
    """
    path = Path(path)
    manifest = _verify(path)
    # safetensors takes a device string; torch.load also accepts dict/callable map_locations.
    device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
    tensors = {n: load_file(path / f"{n}.safetensors", device=device) for n in manifest["tensors"]}
    objects = {n: pickles.load_torch(path / f"{n}.pt", map_location=map_location,
                                     allow=pickles.allowed_globals(f"{n}.pt")) for n in manifest["objects"]}
    state = json.loads((path / STATE).read_text())
    return Checkpoint(step=int(manifest["step"]), tensors=tensors, objects=objects, state=state, path=path)


def newest_valid_checkpoint(root: str | os.PathLike, dist=None) -> tuple[Path | None, list[str]]:
    """(newest checkpoint under `root` that verifies or None, why each newer one does not): every checkpoint is
    named in the second part when none verifies, so that a caller can refuse to start over silently."""
    problems: list[str] = []
    return next(iter(valid_checkpoints(root, dist, problems)), None), problems


def valid_checkpoints(root: str | os.PathLike, dist=None, problems: list[str] | None = None) -> Iterator[Path]:
    """The checkpoints under `root` that verify, newest first, verified one at a time as the caller asks for the
    next (collective: every rank gets the same sequence); why each skipped one failed is appended to `problems`."""
    found = list_checkpoints(root)
    if dist is not None and dist.active:  # rank 0's listing, so that every rank tries the same candidates
        found = [Path(p) for p in dist.broadcast_object([str(p) for p in found])]
    for path in reversed(found):
        try:
            _verify(path, dist)
        except CheckpointError as e:
            if dist is None or dist.is_main:
                log.warning("skipping checkpoint for resume: %s", e)
            if problems is not None:
                problems.append(str(e))
            continue
        yield path
