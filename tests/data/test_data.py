"""Prompt loading (txt/jsonl, bad records counted) and the seeded, resumable prompt sampler."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from jagg_scale.data import PromptSampler, PromptSet, load_prompts, shared_prompts_dir

PICKSCORE_TEST = Path("flow_grpo") / "dataset" / "pickscore" / "test.txt"
SAMPLES = Path(__file__).resolve().parents[2] / "data" / "prompts"  # committed (tools/make_prompt_samples.py)


# --------------------------------------------------------------------------------------------- prompts


def test_load_txt_skips_blank_lines_without_counting(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a cat\n\n  a dog  \n\n\na red car\n", encoding="utf-8")
    ps = load_prompts(f)
    assert ps.prompts == ["a cat", "a dog", "a red car"]
    assert ps.skipped == 0
    assert all(r.metadata == {} for r in ps.records)


def test_load_jsonl_metadata_and_bad_lines(tmp_path, caplog):
    f = tmp_path / "p.jsonl"
    lines = [
        json.dumps({"prompt": "a cat", "tag": "single_object", "include": [{"class": "cat", "count": 1}]}),
        "{not json",
        json.dumps({"text": "no prompt field"}),
        "",
        json.dumps({"prompt": "   "}),
        json.dumps({"prompt": 3}),
        json.dumps(["prompt", "not an object"]),
        json.dumps({"prompt": "two dogs", "tag": "counting"}),
    ]
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        ps = load_prompts(f)
    assert ps.prompts == ["a cat", "two dogs"]
    assert ps.records[0].metadata == {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}
    assert ps.records[1].metadata == {"tag": "counting"}
    assert ps.skipped == 5
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"{f}:2" in m for m in msgs) and any(f"{f}:7" in m for m in msgs)


def test_a_record_nested_100k_deep_or_a_line_of_50_mb_is_skipped_naming_its_line(tmp_path, caplog):
    """Either one used to stop the run (an uncaught RecursionError; 8.2 GB read into memory for a 400 MB line): now
    each costs its line, logged with file:line and why, and the long line is never held whole (peak well under its
    size)."""
    import tracemalloc

    f = tmp_path / "p.jsonl"
    with f.open("w", encoding="utf-8") as out:
        out.write(json.dumps({"prompt": "a cat"}) + "\n")
        out.write('{"prompt": "deep", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
        out.write('{"prompt": "' + "x" * (50 << 20) + '"}\n')
        out.write(json.dumps({"prompt": "two dogs"}) + "\n")
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING):
            ps = load_prompts(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ps.prompts == ["a cat", "two dogs"] and ps.skipped == 2
    msgs = " | ".join(r.getMessage() for r in caplog.records)
    assert f"{f}:2: skipping bad prompt record: the record nests arrays/objects deeper than the limit of 32" in msgs
    assert f"{f}:3: skipping bad prompt record: line longer than the limit of 1048576 bytes" in msgs
    assert peak < 16 << 20, peak  # the 50 MB line was skipped in chunks, not read whole


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_prompts(tmp_path / "missing.txt")
    csv = tmp_path / "p.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"\.csv"):
        load_prompts(csv)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n{bad\n\n")
    with pytest.raises(ValueError, match="empty.jsonl"):
        load_prompts(empty)


def test_from_list():
    ps = PromptSet.from_list(["a", " b "])
    assert ps.prompts == ["a", "b"] and ps.skipped == 0 and len(ps) == 2
    with pytest.raises(ValueError):
        PromptSet.from_list([])
    with pytest.raises(ValueError, match="#1"):
        PromptSet.from_list(["ok", ""])


def test_real_pickscore_test_set():
    # the full set when it is present (a missing file in it fails), else the committed sample of it
    shared = shared_prompts_dir()
    path, expected = (shared / PICKSCORE_TEST, 2048) if shared.is_dir() else (SAMPLES / PICKSCORE_TEST, 30)
    ps = load_prompts(path)
    assert len(ps) == expected
    assert ps.skipped == 0
    assert all(p and p == p.strip() for p in ps.prompts)


# --------------------------------------------------------------------------------------------- sampler


def test_distinct_prompts_per_step_and_epoch_coverage():
    s = PromptSampler(num_prompts=12, prompts_per_step=4, seed=0)
    seen = []
    for _ in range(3):  # exactly one epoch
        heads = s.next_prompts()
        assert len(heads) == 4 and len(set(heads)) == 4
        seen += heads
    assert sorted(seen) == list(range(12))


def test_same_seed_same_sequence_different_seed_differs():
    def run(seed):
        s = PromptSampler(50, 8, seed=seed)
        return [s.next_prompts() for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_state_dict_resume_identical_continuation():
    ref = PromptSampler(10, 4, seed=3)  # 10 % 4 != 0: batches straddle epoch boundaries
    full = [ref.next_prompts() for _ in range(15)]
    for k in (0, 1, 2, 3, 7):
        s = PromptSampler(10, 4, seed=3)
        for _ in range(k):
            s.next_prompts()
        state = json.loads(json.dumps(s.state_dict()))  # must survive serialization
        assert "epoch" in state and "position" in state
        resumed = PromptSampler(10, 4, seed=3)
        resumed.load_state_dict(state)
        assert [resumed.next_prompts() for _ in range(15 - k)] == full[k:]


def test_load_state_dict_rejects_other_config():
    state = PromptSampler(10, 4, seed=3).state_dict()
    with pytest.raises(ValueError, match="num_prompts"):
        PromptSampler(11, 4, seed=3).load_state_dict(state)


def test_epoch_wrap_mid_batch_keeps_batch_distinct_and_epochs_complete():
    n, p = 10, 4
    s = PromptSampler(n, p, seed=1)
    flat = []
    for _ in range(10):  # 40 draws = 4 full epochs
        b = s.next_prompts()
        assert len(set(b)) == p  # distinct even when straddling an epoch boundary
        flat += b
    assert s.epoch == 3
    for e in range(4):
        assert sorted(flat[e * n : (e + 1) * n]) == list(range(n))


def test_more_prompts_per_step_than_prompts_repeats():
    s = PromptSampler(num_prompts=3, prompts_per_step=5, seed=0)
    heads = s.next_prompts()
    assert len(heads) == 5 and set(heads) == {0, 1, 2}
    assert sorted(heads[:3]) == [0, 1, 2]  # the first epoch is still a full permutation


def test_invalid_sampler_args():
    with pytest.raises(ValueError, match="prompts_per_step"):
        PromptSampler(10, 0, seed=0)
