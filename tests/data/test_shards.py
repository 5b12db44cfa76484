"""Prompt shards and ShardPromptStream: round trip, rank/worker split, determinism, resume, bad records/shards."""

import json
import logging
import tarfile
from pathlib import Path

import pytest
from extras import need
from shard_files import hand_tar

need("webdataset")

from jagg_scale.data import (
    PromptRecord, ShardPromptStream, read_ocr, shard_pattern, shared_prompts_dir, write_prompt_shards,
)
from jagg_scale.data.shards import ShardReadError, expand_shard_urls



def _read_tar(path):
    """{key: {ext: bytes}} straight from the tar (independent of the stream's reader)."""
    out = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return out


def _shards(tmp_path, n_shards=8, per_shard=5):
    """n_shards shards; record j of shard s is 's{s}-{j}' with metadata {'shard': s, 'j': j}."""
    recs = [PromptRecord(f"s{s}-{j}", {"shard": s, "j": j}) for s in range(n_shards) for j in range(per_shard)]
    paths = write_prompt_shards(recs, tmp_path / "shards", per_shard)
    return [str(p) for p in paths]


def _prompts(recs):
    return [r.prompt for r in recs]


# ------------------------------------------------------------------------------------------------- writing


def test_write_round_trip(tmp_path):
    recs = [PromptRecord(f"prompt {i} — ünïcode ✓", {"i": i, "tags": ["a", {"b": None}], "text": f"t{i}"})
            for i in range(25)]
    paths = write_prompt_shards(recs, tmp_path, shard_size=10, prefix="p")
    assert [p.name for p in paths] == ["p-000000.tar", "p-000001.tar", "p-000002.tar"]
    assert expand_shard_urls(shard_pattern(tmp_path, "p", 3)) == [str(p) for p in paths]
    contents = [_read_tar(p) for p in paths]
    assert [len(c) for c in contents] == [10, 10, 5]
    back = [PromptRecord(f["txt"].decode(), json.loads(f["json"])) for c in contents for _, f in sorted(c.items())]
    assert back == recs
    assert sorted(contents[1]) == [f"{i:09d}" for i in range(10, 20)]
    assert not list(tmp_path.glob("*.part"))

    with pytest.raises(FileExistsError, match="p-000000.tar"):
        write_prompt_shards(recs, tmp_path, 10, "p")
    paths = write_prompt_shards(recs[:4], tmp_path, 10, "p", overwrite=True)  # stale shards 1 and 2 removed
    assert sorted(tmp_path.glob("p-*.tar")) == paths and len(_read_tar(paths[0])) == 4
    with pytest.raises(ValueError, match="no records"):
        write_prompt_shards([], tmp_path / "empty", 10)
    with pytest.raises(ValueError, match="#1"):
        write_prompt_shards([recs[0], PromptRecord("  ", {})], tmp_path / "bad", 10)
    assert not list((tmp_path / "bad").iterdir())  # the partial shard is removed


def test_cli(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"prompt": f"p{i}", "tag": i}) for i in range(7)] + ["{not json", '{"prompt": ""}']
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    from jagg_scale.data import make_shards

    out = tmp_path / "out"
    summary = make_shards.main([str(src), str(out), "--shard-size", "3"])
    assert (summary["written"], summary["skipped"], summary["shards"], summary["format"]) == (7, 2, 3, "jsonl")
    assert summary["pattern"] == f"{out}/prompts-{{000000..000002}}.tar"
    assert summary["pattern"] in capsys.readouterr().out
    assert json.loads((out / "prompts.json").read_text())["written"] == 7
    stream = ShardPromptStream(summary["pattern"])
    assert {r.prompt: r.metadata for r in stream.next_records(30)} == {f"p{i}": {"tag": i} for i in range(7)}


@pytest.mark.parametrize("name, error", [("missing.txt", "missing.txt: no such file"),
                                         ("prompts.xyz", "cannot tell the format of")])
def test_cli_refuses_bad_input_naming_it(tmp_path, capsys, name, error):
    from jagg_scale.data import make_shards

    if name.endswith(".xyz"):
        (tmp_path / name).write_text("a prompt\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        make_shards.main([str(tmp_path / name), str(tmp_path / "out")])
    assert exc.value.code == 2 and error in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- split/order


def test_split_disjoint_and_deterministic(tmp_path):
    urls = _shards(tmp_path)
    seqs = {}
    slots = []
    for rank in (0, 1):
        with ShardPromptStream(urls, seed=7, rank=rank, world_size=2, num_workers=2) as s:
            slots += [s.slot_shards(0), s.slot_shards(1)]
            recs = s.next_records(40)
        # in-order DataLoader output: item i comes from worker i % 2, which reads only its own shards
        for i, r in enumerate(recs):
            assert urls[r.metadata["shard"]] in slots[2 * rank + i % 2], (rank, i, r)
            assert r.prompt == f"s{r.metadata['shard']}-{r.metadata['j']}"
        seqs[rank] = _prompts(recs)
    flat = [u for slot in slots for u in slot]
    assert sorted(flat) == sorted(urls) and len(set(flat)) == len(urls)  # each shard in exactly one slot
    assert all(len(slot) == 2 for slot in slots)
    with ShardPromptStream(urls, seed=7, rank=1, world_size=2, num_workers=2) as again:
        assert _prompts(again.next_records(40)) == seqs[1]
    with ShardPromptStream(urls, seed=8, rank=1, world_size=2, num_workers=2) as other:
        assert _prompts(other.next_records(40)) != seqs[1]


def test_too_few_shards(tmp_path):
    urls = _shards(tmp_path, n_shards=3)
    with pytest.raises(ValueError, match=r"3 prompt shards are too few for 4 readers"):
        ShardPromptStream(urls, rank=0, world_size=2, num_workers=2)
    ShardPromptStream(urls, rank=1, world_size=3, num_workers=0)  # one in-process reader per rank: fine


def test_missing_shard(tmp_path):
    urls = _shards(tmp_path, n_shards=2)
    gone = str(tmp_path / "shards" / "prompts-000005.tar")
    with pytest.raises(FileNotFoundError, match="prompts-000005.tar"):
        ShardPromptStream(urls + [gone])
    with pytest.raises(FileNotFoundError, match="prompts-000002.tar"):
        ShardPromptStream(str(tmp_path / "shards" / "prompts-{000000..000002}.tar"))
    with pytest.raises(ValueError, match="more than once"):
        ShardPromptStream(urls + urls[:1])


# ------------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_exact(tmp_path, num_workers):
    urls = _shards(tmp_path, n_shards=4, per_shard=4)
    # one hand-made shard with bad samples, so items consumed != records consumed
    bad = hand_tar(tmp_path / "bad.tar", [("a", {"txt": b""}), ("b", {"txt": b"ok b"}),
                                           ("c", {"txt": b"x", "json": b"[1]"}), ("d", {"txt": b"ok d"})])
    urls.insert(0, str(bad))  # slot 0: rank 0, worker 0
    kw = dict(seed=3, rank=0, world_size=2, num_workers=num_workers)
    with ShardPromptStream(urls, **kw) as ref:
        full = _prompts(ref.next_records(40))
        ref_skipped = dict(ref.skipped)
    with ShardPromptStream(urls, **kw) as first:
        head = _prompts(first.next_records(6) + first.next_records(7))  # 13: odd, so worker roles rotate
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    assert head == full[:13] and state["records"] == 13
    with ShardPromptStream(urls, **kw) as resumed:
        resumed.load_state_dict(state)
        assert _prompts(resumed.next_records(27)) == full[13:]
        assert resumed.records == 40 and dict(resumed.skipped) == ref_skipped
    assert ref_skipped  # the bad samples were met, and replayed exactly on resume

    for key, value in (("seed", 4), ("rank", 1), ("num_workers", 1 if num_workers else 2)):
        other = ShardPromptStream(urls, **{**kw, key: value})
        with pytest.raises(ValueError, match=f"saved with {key}={kw[key]}, this stream has {value}"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="other shards"):
        ShardPromptStream(urls[:-1], **kw).load_state_dict(state)


# -------------------------------------------------------------------------------------------- bad data


def test_bad_records_skipped_and_counted(tmp_path, caplog):
    bad = hand_tar(tmp_path / "hand.tar", [
        ("k0", {"txt": b"   ", "json": b"{}"}),          # empty prompt
        ("k1", {"txt": b"fine text", "json": b"{oops"}),  # invalid JSON
        ("k2", {"txt": b"\xff\xfe bad utf-8"}),          # undecodable
        ("k3", {"txt": b"list meta", "json": b"[1, 2]"}),  # metadata not an object
        ("k4", {"json": b"{}"}),                          # no .txt at all
        ("k7", {"txt": b"deep", "json": b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}),  # RecursionError once
        ("k8", {"txt": b"x" * (2 << 20)}),               # a prompt over the line limit
        ("k5", {"txt": "gut ✓".encode(), "json": b'{"text": "x"}'}),
        ("k6", {"txt": b"no json"}),                      # no .json: empty metadata, fine
    ])
    with caplog.at_level(logging.WARNING, logger="jagg_scale.data.shards"):
        stream = ShardPromptStream([str(bad)], max_warnings=3)
        recs = stream.next_records(4)  # the only shard, read twice
        stream.close()
    assert recs == [PromptRecord("gut ✓", {"text": "x"}), PromptRecord("no json", {})] * 2
    assert stream.skipped == {"empty_txt": 2, "bad_json": 4, "bad_utf8": 2, "json_not_object": 2, "missing_txt": 2,
                              "too_long": 2}
    text = caplog.text
    assert "hand.tar: sample k0" in text and "hand.tar: sample k2" in text and "is not valid JSON" in text
    assert "sample k3" not in text and "only counted" in text  # first 3 distinct, then one line
    assert "skipped 14 bad records" in text

    empty = hand_tar(tmp_path / "allbad.tar", [("a", {"txt": b""}), ("b", {"json": b"{}"})])
    with pytest.raises(ShardReadError, match="no valid prompt record"):
        ShardPromptStream([str(empty)]).next_records(1)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_corrupt_shard_raises_naming_it(tmp_path, num_workers):
    good = _shards(tmp_path, n_shards=1, per_shard=50)[0]
    trunc = tmp_path / "trunc.tar"
    trunc.write_bytes(Path(good).read_bytes()[:5000])
    with ShardPromptStream([str(trunc)], num_workers=num_workers) as s:
        with pytest.raises(ShardReadError, match="cannot read prompt shard .*trunc.tar"):
            s.next_records(100)



@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_shard_cut_at_a_member_boundary_raises_instead_of_reading_part(tmp_path, num_workers):
    """tarfile reads a tar cut between two members as a shorter valid one: 5 records counted, the rest lost
    silently, before the end-of-archive check."""
    good = _shards(tmp_path, n_shards=1, per_shard=50)[0]
    with tarfile.open(good) as tf:
        cut = tf.getmembers()[20].offset  # the header of a member: everything before it is whole
    trunc = tmp_path / "cut.tar"
    trunc.write_bytes(Path(good).read_bytes()[:cut])
    with ShardPromptStream([str(trunc)], num_workers=num_workers) as s:
        with pytest.raises(ShardReadError, match=r"prompt shard .*cut.tar is truncated"):
            s.next_records(100)
    with ShardPromptStream([str(good)], num_workers=num_workers) as s:  # the whole shard still reads
        assert len(s.next_records(50)) == 50


# ------------------------------------------------------------------------------------------ shared prompts


@pytest.mark.slow  # the whole OCR prompt set through shards
def test_shared_ocr_prompts_keep_text(tmp_path):
    # the full set when it is present, else the committed sample of it (data/prompts, tools/make_prompt_samples.py)
    rel = Path("flow_grpo") / "dataset" / "ocr" / "test.txt"
    full = shared_prompts_dir().is_dir()
    ocr = shared_prompts_dir() / rel if full else Path(__file__).resolve().parents[2] / "data" / "prompts" / rel
    shard_size = 300 if full else 8
    src = read_ocr(ocr)
    paths = write_prompt_shards(src.records, tmp_path, shard_size=shard_size, prefix="ocr")
    assert len(paths) == -(-len(src) // shard_size) > 1
    back = [PromptRecord(f["txt"].decode(), json.loads(f["json"]))
            for p in paths for _, f in sorted(_read_tar(p).items())]
    assert back == src.records
    with ShardPromptStream(shard_pattern(tmp_path, "ocr", len(paths)), seed=1, world_size=2, rank=1) as s:
        recs = s.next_records(64)
    assert not s.skipped
    for r in recs:
        assert set(r.metadata) == {"text"} and f'"{r.metadata["text"]}"' in r.prompt
