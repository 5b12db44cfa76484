"""Prompt shards (webdataset tars) and `ShardPromptStream`, the endless per-rank prompt stream read from them.

Why: a large prompt corpus should not be loaded by every rank (the in-memory PromptSet + GroupSampler path).
With shards each rank and DataLoader worker reads only its own files, and a prompt's metadata (e.g. OCR's
`text`) travels with it to the rewards.

Layout: `{prefix}-000000.tar`, ...; sample `<key>.txt` = prompt (utf-8), `<key>.json` = metadata object,
`<key>.png` / `.jpg` / `.webp` = an edit prompt's input image (encoded bytes, at most data.images.MAX_IMAGE_BYTES;
the record's prompt is then an `EditPrompt` carrying them), key = the record's 9-digit input index. Shards are
written under a temporary name and renamed when complete, so a crashed write never leaves a plausible truncated
shard.

Split: reader `slot = rank * num_workers + worker_id` of `world_size * num_workers` (0 workers = one in-process
reader) reads `urls[slot::num_slots]`: no two readers share a shard. A slot draws its shards with replacement
(`wds.ResampledShards`, seed `seed + slot`, independent of RANK/worker env) and reads each drawn shard in order:
endless, no epochs, no rank runs dry (records of a short shard are drawn a bit more often).

Order and resume: in-order DataLoader output takes item i from worker i % num_workers, so the sequence is a pure
function of (urls, seed, rank, world_size, num_workers). `load_state_dict()` rebuilds the readers; each skips in
its worker the items it had produced (whole shards by their once-counted size, so resuming is cheap), with
worker roles rotated so the next item comes from the worker that was due. A state saved with other settings is
an error naming the setting.

Bad records (missing/empty `.txt`, undecodable utf-8, `.json` invalid or not an object, an input image that does not
decode within data.images' bounds, checked as the record is read) are skipped and counted
per reason in `stream.skipped`, each time they are read; the first `max_warnings` distinct ones are logged with
shard and key, then one line says the rest are only counted; `close()` logs a summary. No `.json` = `{}`.

Bad shards: a local shard missing at construction is a FileNotFoundError naming it; one that cannot be read
later (deleted, truncated, not a tar) raises `ShardReadError` naming it, in the main process (a worker hands it
over as an item, not a traceback). We raise rather
than skip: our shards are written atomically, so a broken one is a broken copy to fix, and skipping it would
silently shift the prompt distribution. A slot with no valid record at all raises too, instead of spinning.
webdataset is optional (`pip install jagg-scale[data]`) and imported only when used.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from . import bounded_json
from .images import MAX_IMAGE_BYTES, EditPrompt, check_image
from .prompts import PromptRecord

logger = logging.getLogger(__name__)

__all__ = ["ShardPromptStream", "ShardReadError", "write_prompt_shards", "shard_pattern", "expand_shard_urls"]

_REMOTE = re.compile(r"^(pipe:|[A-Za-z][A-Za-z0-9+.-]*://)")  # pipe:, http://, s3://...: not checked to exist
_STATE_KEYS = ("urls", "seed", "rank", "world_size", "num_workers")


class ShardReadError(RuntimeError):
    """A prompt shard could not be opened or read; the message names the shard."""


def _wds():
    try:
        import webdataset
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("prompt shards need webdataset: pip install 'jagg-scale[data]'") from e
    return webdataset


# ------------------------------------------------------------------------------------------------- writing


def shard_pattern(out_dir: str | Path, prefix: str, num_shards: int) -> str:
    """The brace pattern naming shards 0..num_shards-1 (a plain path for a single shard)."""
    if num_shards == 1:
        return str(Path(out_dir) / f"{prefix}-000000.tar")
    return str(Path(out_dir) / f"{prefix}-{{000000..{num_shards - 1:06d}}}.tar")


def write_prompt_shards(
    records: Iterable[PromptRecord], out_dir: str | Path, shard_size: int = 1000, prefix: str = "prompts",
    *, overwrite: bool = False,
) -> list[Path]:
    """Write records into `out_dir/{prefix}-NNNNNN.tar`, `shard_size` per shard; returns the shard paths.

    Existing `{prefix}-NNNNNN.tar` files in `out_dir` are an error unless `overwrite` (then they are removed
    first): a stale extra shard from an earlier, longer write would otherwise be picked up by a glob.
    A record without a non-empty prompt or with metadata that is not a JSON object is an error (the readers
    already dropped bad input rows; anything left is a bug worth stopping for)."""
    wds = _wds()
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive int, got {shard_size!r}")
    if not prefix or "/" in prefix or os.sep in prefix:
        raise ValueError(f"prefix must be a plain file name prefix, got {prefix!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(out.glob(glob.escape(prefix) + "-" + "[0-9]" * 6 + ".tar"))
    if stale and not overwrite:
        raise FileExistsError(f"{out} already holds {len(stale)} shards named {prefix}-*.tar (e.g. {stale[0].name}); "
                              "pass overwrite=True (--overwrite) or use another directory or prefix")
    for p in stale:
        p.unlink()
    paths: list[Path] = []
    f = writer = None

    def finish() -> None:
        writer.close()
        f.close()
        os.replace(f.name, paths[-1])

    try:
        for i, rec in enumerate(records):
            prompt, meta = getattr(rec, "prompt", None), getattr(rec, "metadata", None)
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"record #{i} has no non-empty prompt: {rec!r}")
            if not isinstance(meta, dict):
                raise ValueError(f"record #{i}: metadata must be a dict, got {type(meta).__name__}")
            try:
                meta_bytes = json.dumps(meta, ensure_ascii=False).encode("utf-8")
            except (TypeError, ValueError) as e:
                raise ValueError(f"record #{i}: metadata is not JSON-serializable: {e}") from None
            if i % shard_size == 0:
                if writer is not None:
                    finish()
                paths.append(out / f"{prefix}-{len(paths):06d}.tar")
                f = open(paths[-1].with_name(paths[-1].name + ".part"), "wb")
                writer = wds.TarWriter(f, encoder=False, mtime=0)  # mtime 0: identical input, identical bytes
            sample = {"__key__": f"{i:09d}", "txt": prompt.strip().encode("utf-8"), "json": meta_bytes}
            image = getattr(prompt, "image", None)  # an EditPrompt's input image, stored as its encoded file
            if image is not None:
                data = image if isinstance(image, bytes) else Path(image).read_bytes()
                sample[_image_format(data)] = data
            writer.write(sample)
        if writer is not None:
            finish()
    except BaseException:
        if f is not None and not f.closed:  # drop the partial shard
            try:
                writer.close()
            finally:
                f.close()
                Path(f.name).unlink(missing_ok=True)
        raise
    if not paths:
        raise ValueError("no records to write")
    return paths


# ------------------------------------------------------------------------------------------------- reading


def expand_shard_urls(urls: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """A brace pattern (`dir/prompts-{000000..000009}.tar`) or an explicit list -> the list of shard URLs.
    Local paths must exist (FileNotFoundError naming the first missing one); duplicates are an error, since
    they would break the disjoint split."""
    if isinstance(urls, (str, os.PathLike)):
        out = list(_wds().shardlists.expand_urls(os.fspath(urls)))
    else:
        out = [os.fspath(u) for u in urls]
    if not out:
        raise ValueError("no prompt shards given")
    dup = [u for u, c in Counter(out).items() if c > 1]
    if dup:
        raise ValueError(f"prompt shard listed more than once: {dup[0]}")
    for u in out:
        if not _REMOTE.match(u) and not Path(u).is_file():
            raise FileNotFoundError(f"prompt shard not found: {u}")
    return out


def _zero_worker_seed() -> int:
    """ResampledShards mixes a 'worker seed' into its RNG; ours is 0 because the slot is already in `seed`
    (its default reads RANK/WORLD_SIZE and the worker id, which would tie the order to the environment)."""
    return 0


IMAGE_MEMBERS = {"png": b"\x89PNG", "jpg": b"\xff\xd8\xff", "webp": b"RIFF"}  # the image formats a shard carries


def _image_format(data: bytes) -> str:
    """The member extension of encoded image bytes (by their magic number), or a ValueError."""
    for ext, magic in IMAGE_MEMBERS.items():
        if data.startswith(magic):
            return ext
    raise ValueError(f"an input image must be PNG, JPEG or WebP to go into a shard (starts {data[:8]!r})")


def _decode(sample: dict) -> tuple:
    """One tar sample -> ("r", prompt, metadata) or ("s", reason, shard, key, detail)."""
    url, key = sample.get("__url__"), sample.get("__key__")
    raw = sample.get("txt")
    if raw is None:
        return ("s", "missing_txt", url, key, f"no .txt member (has {sorted(k for k in sample if k[0] != '_')})")
    if len(raw) > bounded_json.MAX_LINE_BYTES or len(sample.get("json", b"")) > bounded_json.MAX_LINE_BYTES:
        return ("s", "too_long", url, key, f"a .txt or .json member over {bounded_json.MAX_LINE_BYTES} bytes")
    try:
        prompt = raw.decode("utf-8").strip()
        meta = bounded_json.loads(sample["json"].decode("utf-8"), "its .json") if "json" in sample else {}
    except UnicodeDecodeError as e:
        return ("s", "bad_utf8", url, key, str(e))
    except ValueError as e:
        return ("s", "bad_json", url, key, str(e))
    if not prompt:
        return ("s", "empty_txt", url, key, "empty prompt")
    if not isinstance(meta, dict):
        return ("s", "json_not_object", url, key, f".json is a {type(meta).__name__}, expected an object")
    images = [ext for ext in IMAGE_MEMBERS if ext in sample]
    if len(images) > 1:
        return ("s", "two_images", url, key, f"{len(images)} image members ({', '.join(images)}), expected one")
    if images:
        data = sample[images[0]]
        try:  # decoded whole here, in the reader: a bad image costs its record, named by shard and key
            check_image(data, f"its .{images[0]}")
        except ValueError as e:
            return ("s", "bad_image", url, key, str(e))
        prompt = EditPrompt(prompt, data)
    return ("r", prompt, meta)


def _samples(url: str) -> Iterator[dict]:
    """The raw samples of one shard; any failure to read it is a ShardReadError naming it. A local shard is checked
    whole first (_check_complete): a tar cut at a member boundary reads as a shorter valid one."""
    try:
        if not _REMOTE.match(url):
            _check_complete(url)
        yield from _wds().tarfile_samples([dict(url=url)])
    except ShardReadError:
        raise
    except Exception as e:
        raise ShardReadError(f"cannot read prompt shard {url}: {type(e).__name__}: {e.args[0] if e.args else e}") from e


_COMPLETE: dict[tuple, bool] = {}  # (path, size, mtime) of local shards found complete: checked once per version


def _check_complete(path: str) -> None:
    """ShardReadError unless the tar at `path` ends with its end-of-archive marker (two zero blocks) right after
    the last member's data: tarfile (and webdataset over it) read a truncated file silently up to the cut, and
    unless every member is at most MAX_IMAGE_BYTES (webdataset reads a member whole into memory: a hostile shard's
    10 GB member would be read before any check of ours). Reads the headers alone (data is skipped by seeking)."""
    import tarfile

    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    if key in _COMPLETE:
        return
    with tarfile.open(path, mode="r:") as tar:
        end = 0
        for member in tar:
            if member.size > MAX_IMAGE_BYTES:
                raise ShardReadError(f"prompt shard {path}: member {member.name} is {member.size} bytes, over the "
                                     f"{MAX_IMAGE_BYTES} a prompt, its metadata or its input image may take")
            end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        with open(path, "rb") as f:
            f.seek(end)
            marker = f.read(2 * tarfile.BLOCKSIZE)
    if len(marker) < 2 * tarfile.BLOCKSIZE or any(marker):
        raise ShardReadError(f"prompt shard {path} is truncated or damaged: no end-of-archive marker after its last "
                             f"complete member (byte {end} of {st.st_size}); re-copy it")
    _COMPLETE[key] = True


def _slot_items(urls: list[str], seed: int, skip: int = 0) -> Iterator[tuple]:
    """Endless items of one slot: resampled shards, every sample of a drawn shard in order, one item per
    sample. The first `skip` items are passed over, whole shards by their (once counted) size: a resume
    costs one read per distinct shard, not one decode per consumed record."""
    barren: set[str] = set()  # shards read completely without one valid record
    sizes: dict[str, int] = {}
    for src in _wds().ResampledShards(urls, seed=seed, deterministic=True, worker_seed=_zero_worker_seed):
        url, good, whole = src["url"], 0, skip == 0
        if skip:
            if url not in sizes:
                sizes[url] = sum(1 for _ in _samples(url))
            if skip >= sizes[url]:
                skip -= sizes[url]
                continue
        for sample in islice(_samples(url), skip, None):
            item = _decode(sample)
            good += item[0] == "r"
            yield item
        skip = 0
        if whole and not good:
            barren.add(url)
            if len(barren) == len(urls):
                raise ShardReadError(f"no valid prompt record in any shard of this reader: {urls}")


def _identity(x):
    return x


class _SlotDataset(IterableDataset):
    """The DataLoader side: worker w reads slot `slots[(w + rotate) % n]`, skipping that role's first items."""

    def __init__(self, subsets: list[list[str]], seeds: list[int], skips: list[int], rotate: int):
        self.subsets, self.seeds, self.skips, self.rotate = subsets, seeds, skips, rotate

    def __iter__(self):
        info = get_worker_info()
        role = ((info.id if info is not None else 0) + self.rotate) % len(self.subsets)
        try:
            yield from _slot_items(self.subsets[role], self.seeds[role], self.skips[role])
        except ShardReadError as e:  # handed over as an item: raised from a worker it would arrive as a traceback
            yield ("e", str(e))


class ShardPromptStream:
    """Endless, deterministic, resumable PromptRecords for one rank; see the module docstring.

    `next_records(n)` draws the next n records; `state_dict()` / `load_state_dict()` resume exactly;
    `skipped` counts bad records per reason; `slot_shards(w)` lists the shards worker w of this rank reads.
    Call `close()` (or use `with`) to stop the DataLoader workers."""

    def __init__(self, urls, *, seed: int = 0, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 max_warnings: int = 20, multiprocessing_context=None):
        for name, v, lo in (("seed", seed, 0), ("rank", rank, 0), ("world_size", world_size, 1),
                            ("num_workers", num_workers, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"ShardPromptStream: {name} must be an int >= {lo}, got {v!r}")
        if rank >= world_size:
            raise ValueError(f"ShardPromptStream: rank {rank} is not below world_size {world_size}")
        self.urls = expand_shard_urls(urls)
        self.seed, self.rank, self.world_size, self.num_workers = seed, rank, world_size, num_workers
        self.max_warnings = max_warnings
        self.multiprocessing_context = multiprocessing_context
        self.num_slots = world_size * max(num_workers, 1)
        if len(self.urls) < self.num_slots:
            raise ValueError(
                f"{len(self.urls)} prompt shards are too few for {self.num_slots} readers (world_size={world_size} "
                f"x num_workers={max(num_workers, 1)}): each rank/worker needs a shard of its own; "
                "write smaller shards or use fewer workers")
        self.records = 0  # records handed out so far
        self.skipped: Counter = Counter()
        self._items = 0  # loader items consumed (records + skip events): what a resume replays
        self._logged: set = set()
        self._capped = False
        self._it = None

    @property
    def _readers(self) -> int:
        return max(self.num_workers, 1)

    def slot_shards(self, worker_id: int = 0) -> list[str]:
        """The shards read by worker `worker_id` of this rank (disjoint from every other rank/worker)."""
        if not 0 <= worker_id < self._readers:
            raise ValueError(f"worker_id {worker_id} out of range for {self._readers} readers")
        slot = self.rank * self._readers + worker_id
        return self.urls[slot::self.num_slots]

    def _start(self):
        w, t = self._readers, self._items
        rotate = t % w  # the next item is due from role t % w; the DataLoader starts at worker 0
        ds = _SlotDataset([self.slot_shards(r) for r in range(w)],
                          [self.seed + self.rank * w + r for r in range(w)],
                          [len(range(r, t, w)) for r in range(w)], rotate)
        return iter(DataLoader(ds, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                               multiprocessing_context=self.multiprocessing_context if self.num_workers else None))

    def next_records(self, n: int) -> list[PromptRecord]:
        """The next n valid records (bad ones in between are counted in `skipped` and logged)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"next_records: n must be an int >= 0, got {n!r}")
        out: list[PromptRecord] = []
        while len(out) < n:
            if self._it is None:
                self._it = self._start()
            try:
                item = next(self._it)
            except BaseException:
                self._it = None  # a retry restarts from the last consumed item (and meets the same error)
                raise
            if item[0] == "e":
                self._it = None
                raise ShardReadError(item[1])
            self._items += 1
            if item[0] == "r":
                out.append(PromptRecord(item[1], item[2]))
            else:
                self._skip(*item[1:])
        self.records += n
        return out

    def __iter__(self) -> Iterator[PromptRecord]:
        while True:
            yield self.next_records(1)[0]

    def _skip(self, reason: str, url: str, key: str, detail: str) -> None:
        self.skipped[reason] += 1
        if (url, key) in self._logged:
            return
        if len(self._logged) < self.max_warnings:
            self._logged.add((url, key))
            logger.warning("%s: sample %s: skipping bad prompt record (%s): %s", url, key, reason, detail)
        elif not self._capped:
            self._capped = True
            logger.warning("more bad prompt records: only counted in stream.skipped from now on (%d so far: %s)",
                           sum(self.skipped.values()), dict(self.skipped))

    # ---------------------------------------------------------------------------------------------- resume

    def state_dict(self) -> dict:
        """Position (records/items consumed, skip counts) plus the settings it is valid for."""
        return {"records": self.records, "items": self._items, "skipped": dict(self.skipped),
                "urls": list(self.urls), "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "num_workers": self.num_workers}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the saved stream stopped; ValueError if saved with other settings."""
        for key in _STATE_KEYS:
            if key not in state:
                raise ValueError(f"ShardPromptStream state lacks {key!r}")
            mine, theirs = getattr(self, key), state[key]
            if key == "urls" and list(theirs) != mine:
                raise ValueError(f"ShardPromptStream state was saved with other shards ({len(theirs)} urls, "
                                 f"first {theirs[:1]}) than this stream has ({len(mine)}, first {mine[:1]})")
            if key != "urls" and theirs != mine:
                raise ValueError(f"ShardPromptStream state was saved with {key}={theirs}, this stream has {mine}")
        records, items = int(state["records"]), int(state["items"])
        if not 0 <= records <= items:
            raise ValueError(f"invalid ShardPromptStream state: records={records}, items={items}")
        self._it = None  # drops (and so stops) the current workers
        self.records, self._items = records, items
        self.skipped = Counter({str(k): int(v) for k, v in state.get("skipped", {}).items()})

    def close(self) -> None:
        """Stop the workers; log a summary of skipped bad records."""
        self._it = None
        if self.skipped:
            logger.warning("prompt stream skipped %d bad records: %s", sum(self.skipped.values()), dict(self.skipped))

    def __enter__(self) -> "ShardPromptStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
