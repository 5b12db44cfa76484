"""Edit prompts (data/images.py): an instruction carrying its input image, from a jsonl `image` field or a shard's
image member, and the one bounded image decoder. Real files throughout: a hostile record must not read outside its
prompt file's folder, and a hostile image or shard must not exhaust memory."""

import io
import pickle
import struct
import tarfile
import zlib
from pathlib import Path

import pytest
import torch
from extras import need
from PIL import Image

from jagg_scale.data import EditPrompt, PromptRecord, load_prompts
from jagg_scale.data.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, load_rgb

EDITS = Path(__file__).resolve().parents[2] / "data" / "edits" / "tiny"


def png(path_or_none, size=(6, 4), color=(200, 10, 10)):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    if path_or_none is not None:
        Path(path_or_none).write_bytes(buf.getvalue())
    return buf.getvalue()


def test_the_committed_edit_set_loads_as_edit_prompts():
    records = load_prompts(EDITS / "edits.jsonl").records
    assert len(records) == 4 and all(isinstance(r.prompt, EditPrompt) for r in records)
    assert all(Path(r.prompt.image).parent == EDITS.resolve() for r in records)
    assert "image" not in records[0].metadata and records[0].metadata["output_caption"] == "a blue square on white"


def test_an_edit_prompt_is_its_text_and_image_for_equality_hashing_and_pickling():
    a, b = EditPrompt("make it red", "x.png"), EditPrompt("make it red", "y.png")
    assert str(a) == "make it red" and a != b and a == EditPrompt("make it red", "x.png") and a != "make it red"
    assert len({a, b, EditPrompt("make it red", "x.png")}) == 2
    back = pickle.loads(pickle.dumps([a, b]))  # the shard stream all-gathers records as pickles
    assert back == [a, b] and back[1].image == "y.png" and isinstance(back[0], EditPrompt)
    assert a.strip().image == "x.png"


def test_jsonl_image_paths_stay_inside_the_prompt_files_folder(tmp_path, caplog):
    folder = tmp_path / "set"
    folder.mkdir()
    png(folder / "ok.png")
    png(tmp_path / "outside.png")
    (folder / "link.png").symlink_to(tmp_path / "outside.png")
    lines = ['{"prompt": "fine", "image": "ok.png"}',
             '{"prompt": "dots", "image": "../outside.png"}',
             f'{{"prompt": "absolute", "image": "{tmp_path / "outside.png"}"}}',
             '{"prompt": "link", "image": "link.png"}',
             '{"prompt": "missing", "image": "nope.png"}',
             '{"prompt": "not a path", "image": 3}',
             '{"prompt": "text only"}']
    (folder / "p.jsonl").write_text("\n".join(lines) + "\n")
    got = load_prompts(folder / "p.jsonl")
    assert [str(p) for p in got.prompts] == ["fine", "text only"] and got.skipped == 5
    assert isinstance(got.prompts[0], EditPrompt) and not isinstance(got.prompts[1], EditPrompt)
    assert "leaves the prompt file's folder" in caplog.text and "p.jsonl:2" in caplog.text
    assert "'nope.png' is not a file" in caplog.text and "non-empty path string" in caplog.text


def test_load_rgb_resizes_crops_and_bounds_what_it_reads(tmp_path):
    png(tmp_path / "wide.png", size=(40, 20))
    out = load_rgb(tmp_path / "wide.png", 8)
    assert out.shape == (3, 8, 8) and out.dtype == torch.float32
    assert torch.allclose(out[:, 4, 4], torch.tensor([200, 10, 10]) / 255, atol=2 / 255)
    assert torch.equal(load_rgb(png(None, size=(40, 20)), 8), out)  # encoded bytes, as a shard carries them
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match="junk.png could not be read"):
        load_rgb(tmp_path / "junk.png", 8)
    with pytest.raises(FileNotFoundError, match="nope.png"):
        load_rgb(tmp_path / "nope.png", 8)
    with pytest.raises(ValueError, match="over"):
        load_rgb(b"\0" * (MAX_IMAGE_BYTES + 1), 8)


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path):
    """A PNG whose header claims 10000 x 10000 pixels (a few hundred bytes on disk): refused before decoding."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    side = 10_000  # over our limit, under PIL's own bomb error (which then only warns)
    assert side * side > MAX_IMAGE_PIXELS
    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))
    (tmp_path / "bomb.png").write_bytes(bomb)
    with pytest.raises(ValueError, match="bomb.png is 10000x10000 pixels"):
        load_rgb(tmp_path / "bomb.png", 8)


def test_shards_carry_input_images_and_refuse_oversized_members(tmp_path):
    need("webdataset")
    from jagg_scale.data import ShardPromptStream, write_prompt_shards
    from jagg_scale.data.shards import ShardReadError

    png(tmp_path / "a.png")
    recs = [PromptRecord(EditPrompt("make it blue", str(tmp_path / "a.png")), {"k": 1}),
            PromptRecord(EditPrompt("make it green", png(None, color=(0, 200, 0))), {}),
            PromptRecord("plain text", {})]
    paths = write_prompt_shards(recs, tmp_path / "shards", shard_size=10)
    with ShardPromptStream([str(p) for p in paths]) as stream:
        back = stream.next_records(3)
    assert [str(r.prompt) for r in back] == ["make it blue", "make it green", "plain text"]
    assert back[0].prompt.image == (tmp_path / "a.png").read_bytes() and back[0].metadata == {"k": 1}
    assert torch.equal(load_rgb(back[1].prompt.image, 4)[:, 0, 0], torch.tensor([0, 200, 0]) / 255)
    assert not isinstance(back[2].prompt, EditPrompt)

    big = tmp_path / "big.tar"
    with tarfile.open(big, "w") as tf:
        info = tarfile.TarInfo("000000000.txt")
        info.size = MAX_IMAGE_BYTES + 1  # a sparse claim: the header alone is checked before anything is read
        tf.addfile(info, io.BytesIO(b"x" * info.size))
    with pytest.raises(ShardReadError, match="000000000.txt is .* bytes, over"):
        with ShardPromptStream([str(big)]) as stream:
            stream.next_records(1)
