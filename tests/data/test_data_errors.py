"""Bad data costs its record, or stops the run in one line with exit 2 and the FAILED marker (issue 41 items 6, 7):
an edit record's image is decoded as the record is loaded (a prompt file) or read (a shard), a bad one skipped with
a warning naming file:line or shard and key; a shard that cannot be read stops the run on every rank, in one line,
exit 2, FAILED written (so slurm/jagg.sbatch does not requeue it). Real files, the real CLI entry point."""

from __future__ import annotations

import io
import os
import struct
import threading
import zlib
from pathlib import Path

import pytest
from extras import need
from shard_files import hand_tar
from PIL import Image
from thread_ranks import ThreadDist

from jagg_scale.cli import train_main
from jagg_scale.data import EditPrompt, PromptRecord, load_prompts
from jagg_scale.data.images import MAX_IMAGE_PIXELS

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=4", "log.progress=false", "train.steps=1", "jagg.window=2"]


def png_bytes(size=(6, 4)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 10)).save(buf, format="PNG")
    return buf.getvalue()


def bomb_bytes(side: int = 30_000) -> bytes:
    """A valid PNG header claiming side x side pixels (a few hundred bytes)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


BAD_IMAGES = {  # name -> bytes: what a hostile or broken edit set holds
    "truncated.png": png_bytes((64, 64))[:60],  # a PNG cut inside its pixel data: the header still reads
    "text.png": b"just some text, not an image\n",
    "bomb.png": bomb_bytes(),
}


def test_bad_edit_images_in_a_prompt_file_cost_their_records_at_load(tmp_path, caplog):
    (tmp_path / "ok.png").write_bytes(png_bytes())
    for name, data in BAD_IMAGES.items():
        (tmp_path / name).write_bytes(data)
    lines = ['{"prompt": "fine", "image": "ok.png"}'] + [f'{{"prompt": "{n}", "image": "{n}"}}' for n in BAD_IMAGES]
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    got = load_prompts(tmp_path / "edits.jsonl")
    assert [str(p) for p in got.prompts] == ["fine"] and got.skipped == 3
    assert isinstance(got.prompts[0], EditPrompt)
    for lineno, name in enumerate(BAD_IMAGES, start=2):  # each named by file:line and its image
        assert f"edits.jsonl:{lineno}: skipping bad prompt record: 'image' '{name}'" in caplog.text
    assert "'truncated.png' could not be decoded" in caplog.text and "'text.png' could not be read: not an image" \
        in caplog.text and f"'bomb.png' is over {MAX_IMAGE_PIXELS} pixels" in caplog.text


def test_a_files_images_are_decoded_in_threads_with_the_verdicts_in_order(tmp_path, monkeypatch):
    """check_images: a file's images decoded at once in up to IMAGE_THREADS threads (PIL decodes without the GIL),
    each item's verdict that of check_image, in order, and the warning filters left as they were."""
    import warnings

    from jagg_scale.data import images

    for name, data in {"ok.png": png_bytes(), **BAD_IMAGES}.items():
        (tmp_path / name).write_bytes(data)
    items = [(tmp_path / n, f"'image' {n!r}") for n in ["ok.png", *BAD_IMAGES, "ok.png"] * 3]
    decoded_in, decode = set(), images._decode
    monkeypatch.setattr(images, "_decode", lambda *a: decoded_in.add(threading.current_thread().name) or decode(*a))
    filters = list(warnings.filters)
    got, pooled = images.check_images(items), set(decoded_in)
    assert warnings.filters == filters and len(got) == len(items)
    for (source, name), err in zip(items, got):
        try:
            images.check_image(source, name)
        except ValueError as expected:
            assert str(err) == str(expected)
        else:
            assert err is None
    assert sum(err is None for err in got) == 6
    threads = min(images.IMAGE_THREADS, len(os.sched_getaffinity(0)))
    assert len(pooled) >= 1 and all(n.startswith("check_image") for n in pooled) == (threads > 1)


def test_an_edit_set_of_bad_images_alone_stops_the_run_in_one_line(tmp_path, capsys):
    for name, data in BAD_IMAGES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "edits.jsonl").write_text("".join(f'{{"prompt": "{n}", "image": "{n}"}}\n' for n in BAD_IMAGES))
    rc = train_main([TINY, *SMALL, f"run.output_dir={tmp_path / 'run'}", "data.prompts=null",
                     f"data.prompt_file={tmp_path / 'edits.jsonl'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jagg-train")]
    assert rc == 2 and len(err) == 1 and "'data.prompt_file'" in err[0] and "no valid prompts" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_bad_image_members_of_a_shard_are_skipped_naming_shard_and_key(tmp_path, caplog, num_workers):
    need("webdataset")
    from jagg_scale.data import ShardPromptStream

    samples = [("000000000", {"txt": b"good edit", "png": png_bytes()})]
    samples += [(f"00000000{i}", {"txt": name.encode(), "png": data}) for i, name, data in
                ((i, n, d) for i, (n, d) in enumerate(BAD_IMAGES.items(), start=1))]
    shard = hand_tar(tmp_path / "edits-000000.tar", samples)
    with ShardPromptStream([shard], num_workers=num_workers) as stream:
        got = stream.next_records(3)  # the good record, drawn again and again: the bad ones never come back
        assert [str(r.prompt) for r in got] == ["good edit"] * 3 and stream.skipped["bad_image"] >= 3
    for key in ("000000001", "000000002", "000000003"):
        assert f"edits-000000.tar: sample {key}: skipping bad prompt record (bad_image): its .png" in caplog.text


def _shard_run(tmp_path, monkeypatch, capsys, shards: str, *extra):
    marker = tmp_path / "FAILED"
    monkeypatch.setenv("JAGG_FAILED_FILE", str(marker))
    rc = train_main([TINY, *SMALL, f"run.output_dir={tmp_path / 'run'}", "data.source=wds", "data.prompts=null",
                     f"data.shards={shards}", *extra])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jagg-train")]
    return rc, err, marker


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_truncated_shard_stops_the_run_with_exit_2_and_the_failed_marker(tmp_path, monkeypatch, capsys,
                                                                           num_workers):
    need("webdataset")
    from jagg_scale.data import write_prompt_shards

    [good] = write_prompt_shards([PromptRecord(f"a photo of {i}", {}) for i in range(8)], tmp_path / "shards")
    cut = tmp_path / "cut.tar"
    cut.write_bytes(good.read_bytes()[:3000])
    rc, err, marker = _shard_run(tmp_path, monkeypatch, capsys, str(cut), f"data.num_workers={num_workers}")
    assert rc == 2 and len(err) == 1 and "cut.tar" in err[0], err
    assert "Traceback" not in err[0] and "Caught" not in err[0]  # a worker's error arrives as its own line
    assert marker.read_text().startswith("jagg-train exit 2: ") and "cut.tar" in marker.read_text()


def test_shards_without_one_valid_record_stop_the_run_with_exit_2(tmp_path, monkeypatch, capsys):
    need("webdataset")
    empty = hand_tar(tmp_path / "empty.tar", [("a", {"txt": b"  "}), ("b", {"json": b"{}"})])
    rc, err, marker = _shard_run(tmp_path, monkeypatch, capsys, empty)
    assert rc == 2 and len(err) == 1 and "no valid prompt record" in err[0] and marker.is_file(), err


def test_a_shard_error_on_one_rank_stops_every_rank_naming_it(tmp_path):
    """Rank 1's shard is cut, rank 0's is whole: both raise at the step's gather, naming rank 1 (a rank that raised
    alone would leave the other waiting in the gather until the collective timeout). Ranks are threads here (the
    real sources and readers; tests/thread_ranks.py's gather)."""
    need("webdataset")
    from jagg_scale.data import StreamPromptSource, write_prompt_shards
    from jagg_scale.data.shards import ShardReadError

    paths = write_prompt_shards([PromptRecord(f"p{i}", {}) for i in range(8)], tmp_path / "shards", shard_size=4)
    paths[1].write_bytes(paths[1].read_bytes()[:3000])
    dist, errors = ThreadDist(2), [None, None]

    def rank(r):
        src = StreamPromptSource([str(p) for p in paths], 2, seed=0, dist=dist.rank_view(r))
        try:
            src.next_prompts()
        except ShardReadError as err:
            errors[r] = str(err)
        finally:
            src.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors[0] == errors[1] and errors[0].startswith("rank 1's prompt stream: ") and "000001.tar" in errors[0]
