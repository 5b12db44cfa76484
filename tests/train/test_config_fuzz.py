"""Hostile values for every numeric config key and hostile prompt records (issue 41's fuzz tests): every outcome is
a one-line ConfigError naming the key (exit 2 at the CLI), a bad record skipped with a one-line warning, or a normal
run. The keys are read from the Config dataclasses, so a key added later is fuzzed too."""

from __future__ import annotations

import dataclasses
import json
import time
import typing
from pathlib import Path

import pytest
from extras import need
from shard_files import hand_tar
from hang_guard import WAIT_S

from jagg_scale.cli import train_main
from jagg_scale.data import load_prompts
from jagg_scale.train import ConfigError, load_config
from jagg_scale.train.config import Config
from jagg_scale.train.config_bounds import MAXIMA

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=2",
         "train.minibatch_size=4", "log.progress=false", "train.steps=1", "jagg.window=2"]
HOSTILE = ["0", "-1", "1000000000", "1.0e9", ".inf", "-.inf", ".nan", "abc", "true", "[1]", "{a: 1}"]
EXTREME = {"1000000000", "1.0e9", ".inf", "-.inf", ".nan"}

# the keys a value of 1e9 leaves meaningful, each run below at it (test_the_extremes_accepted_run_normally): counts,
# intervals, seeds, the window (warned: one window of all steps) and loss coefficients (a non-finite step is skipped
# by the run's own guard). train.steps is the run's length: a run of 1e9 steps is a normal, long run (not run here).
RUN_COUNTS = ["jagg.probe_every", "train.max_nonfinite_steps", "eval.every", "eval.seed", "run.seed",
              "run.checkpoint_every", "run.keep_last", "run.export_every", "sampling.chunk_size", "jagg.window"]
RUN_COEFFICIENTS = ["model.lora.alpha", "sampling.shift", "grpo.clip_range", "grpo.adv_clip_max", "grpo.kl_beta",
                    "grpo.onpolicy_tolerance", "train.adam_eps", "train.grad_clip"]
ACCEPTED_EXTREMES = set(RUN_COUNTS) | set(RUN_COEFFICIENTS) | {"train.steps"}


def numeric_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key whose type takes an int or a float (alone, Optional or in a union)."""
    hints, keys = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += numeric_keys(tp, f"{prefix}{f.name}.")
        elif tp in (int, float) or any(a in (int, float) for a in typing.get_args(tp)):
            keys.append(prefix + f.name)
    return keys


def outcome(config: str, overrides: list[str], key: str) -> str:
    """'accepted', or 'refused' after checking the error is one line naming `key`."""
    started = time.monotonic()
    try:
        load_config(config, overrides)
    except ConfigError as err:
        assert "\n" not in str(err) and f"'{key}'" in str(err), (overrides[-1], str(err))
        return "refused"
    finally:
        assert time.monotonic() - started < WAIT_S  # a hang guard: each answer is immediate
    return "accepted"


def test_every_numeric_key_at_every_hostile_value_is_refused_naming_it_or_accepted():
    keys = numeric_keys()
    assert len(keys) > 80 and "sampling.num_steps" in keys and "model.dit.hidden_size" in keys
    accepted_extremes = set()
    for key in keys:
        for value in HOSTILE:
            if outcome(TINY, [*SMALL, f"{key}={value}"], key) == "accepted" and value in EXTREME:
                accepted_extremes.add(key)
    assert accepted_extremes <= ACCEPTED_EXTREMES, sorted(accepted_extremes - ACCEPTED_EXTREMES)
    assert set(RUN_COUNTS) <= accepted_extremes  # else the list below runs what is refused anyway: trim it


# the sections a base config must switch on for their keys to be read (elsewhere they are refused as unread): each
# section's keys fuzzed on its own base; the 1e9s accepted there are intervals and loss coefficients, run below
BASES = {
    "train.ema": ["train.ema_decay=0.99"],
    "nft.": ["train.algorithm=nft", "sampling.ode_solver=dpm2", "nft.noise=per_sample", "nft.kl_beta=0.01"],
    "awm.": ["train.algorithm=awm", "awm.kl_beta=0.01", "awm.ema_kl_beta=1.0", "awm.ema_decay=0.3",
             "awm.ema_update_interval=1"],
    "gcpo.": ["train.algorithm=gcpo", "sampling.num_steps=8", "gcpo.chunks=[3, 4]", "gcpo.chunk_fraction=0.5",
              "train.micro_batch_size=1", "jagg.window=4"],
    "dppo.": ["train.algorithm=dppo"],
    "pools.": ["pools.rollout_ranks=1", "parallel.engine=fsdp2"],  # its run needs two ranks: test_pools_training's
}
SECTION_RUNS = {"train.ema": ["train.ema_every"], "nft.": ["nft.mix", "nft.kl_beta"],
                "awm.": ["awm.kl_beta", "awm.ema_kl_beta", "awm.ema_update_interval", "awm.ema_warmup_steps"],
                "gcpo.": [], "dppo.": ["dppo.kl_mask_threshold"], "pools.": []}


def test_each_sections_keys_on_a_base_that_reads_them():
    # awm.ema_kl_beta 0 leaves awm.ema_decay (set by the base) unread: refused naming that key, as it should be
    other_key = {("awm.ema_kl_beta", "0"): "awm.ema_decay"}
    for prefix, base in BASES.items():
        accepted = set()
        for key in (k for k in numeric_keys() if k.startswith(prefix)):
            for value in HOSTILE:
                got = outcome(TINY, [*SMALL, *base, f"{key}={value}"], other_key.get((key, value), key))
                if got == "accepted" and value in EXTREME:
                    accepted.add(key)
        assert accepted == set(SECTION_RUNS[prefix]), (prefix, sorted(accepted))


@pytest.mark.parametrize("prefix", [p for p, keys in SECTION_RUNS.items() if keys])
def test_a_sections_accepted_extremes_run_normally(prefix, tmp_path):
    overrides = [*BASES[prefix], *(f"{k}=1000000000" for k in SECTION_RUNS[prefix])]
    assert train_main([TINY, *SMALL, f"run.output_dir={tmp_path / 'run'}", *overrides]) == 0


def test_the_issues_size_keys_are_refused_before_anything_is_built():
    """Each was accepted and then a MemoryError, a 160 GB / 4 TB allocation or a step that never ends."""
    for override in ("sampling.num_steps=1000000000", "model.dit.image_size=100000", "model.dit.hidden_size=1000000",
                     "train.prompts_per_step=1000000", "grpo.group_size=1000000", "grpo.inner_epochs=1000000000",
                     "sampling.eval_num_steps=100000", "eval.num_per_prompt=100000"):
        assert outcome(TINY, [*SMALL, override], override.split("=")[0]) == "refused"
    for key, most in MAXIMA.items():  # every documented maximum is enforced, one past it
        value = int(most) + 1 if float(most).is_integer() else most * 2
        assert outcome(TINY, [*SMALL, f"{key}={value}"], key) == "refused", key


@pytest.mark.parametrize("overrides, key", [
    # the DiT's sizes together, each under its own maximum: weights + Adam past a node's host memory, a row's tokens,
    # a step's stored latents
    (["model.dit.hidden_size=16384", "model.dit.depth=512", "model.dit.num_heads=128"], "model.dit.hidden_size"),
    (["model.dit.image_size=4096", "model.dit.patch_size=1"], "model.dit.image_size"),
    (["model.dit.image_size=4096", "model.dit.patch_size=16", "train.prompts_per_step=1024", "grpo.group_size=1024",
      "train.minibatch_size=1024"], "train.prompts_per_step"),
])
def test_sizes_within_their_maxima_are_refused_by_what_they_allocate_together(overrides, key):
    assert outcome(TINY, [*SMALL, *overrides], key) == "refused"


@pytest.mark.parametrize("override", ["model.dit.hidden_size=34", "model.dit.mlp_ratio=0.01"])
def test_the_dits_shape_rules_are_config_errors(override):
    """Each was an AssertionError or an empty layer at the build: the 2-D sin-cos embedding needs hidden % 4 == 0."""
    assert outcome(TINY, [*SMALL, override], override.split("=")[0]) == "refused"


def test_the_extremes_accepted_run_normally(tmp_path):
    """The accepted 1e9s, in two one-step runs of the real CLI: both finish (rc 0)."""
    counts = [f"{k}=1000000000" for k in RUN_COUNTS]
    coefficients = [f"{k}=1.0e9" for k in RUN_COEFFICIENTS]
    for name, overrides in (("counts", counts), ("coefficients", coefficients)):
        assert train_main([TINY, *SMALL, f"run.output_dir={tmp_path / name}", *overrides]) == 0, name
        assert (tmp_path / name / "metrics.jsonl").is_file()


LEGAL = {("model.max_sequence_length", "17"), ("model.num_frames", "17")}  # 17 frames: 1 + 4 x 4, Wan's rule


@pytest.mark.parametrize("kind", ["wan", "flux_kontext"])
def test_a_pipelines_shape_keys_are_refused_naming_them_or_accepted(kind, request):
    """The keys a pipeline family takes, against its real (tiny) pipeline directory: each hostile value refused by
    key at config time (the family's check), never a traceback after the load."""
    path = request.getfixturevalue(f"{kind}_dir")
    config, base = str(ROOT / "configs" / f"{kind}_tiny_cpu.yaml"), [f"model.pretrained={path}"]
    keys = ["model.resolution", "model.max_sequence_length"] + (["model.num_frames"] if kind == "wan" else [])
    for key in keys:
        for value in [*HOSTILE, "17", "4096", "8192"]:
            got = outcome(config, [*base, f"{key}={value}"], key)
            assert got == "refused" or (key, value) in LEGAL, (key, value)


# ------------------------------------------------------------------------------------------------ record formats

GOOD = {"prompt": "a red cube", "image": "ok.png", "tag": "x"}
FIELD_VALUES = [None, 3, 1.5, True, [], {}, "", "x" * (2 << 20), [[[[[]]]]] * 3]  # None: the field left out


def test_every_field_of_a_jsonl_record_missing_of_a_wrong_type_or_huge(tmp_path, caplog):
    """One line per variant: a good record loads, every other is skipped with one warning naming its line."""
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "ok.png")
    lines, expect_ok = [json.dumps(GOOD)], [True]
    for field in GOOD:
        for value in FIELD_VALUES:
            record = {k: v for k, v in GOOD.items() if k != field}
            if value is not None:
                record[field] = value
            lines.append(json.dumps(record))
            # only metadata (tag) takes any value, and an edit record may drop its image
            expect_ok.append(field == "tag" and len(lines[-1]) <= (1 << 20) or (field == "image" and value is None))
    lines += ["[" * 100_000 + "]" * 100_000, "not json", "\0\0\0", '"a string"']
    expect_ok += [False] * 4
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    got = load_prompts(tmp_path / "p.jsonl")
    assert time.monotonic() - started < WAIT_S
    assert len(got) == sum(expect_ok) and got.skipped == len(lines) - sum(expect_ok)
    warned = {int(r.getMessage().split(":")[1]) for r in caplog.records if "skipping bad prompt record" in r.message}
    assert warned == {i + 1 for i, ok in enumerate(expect_ok) if not ok} or len(warned) == 20  # the first 20 named
    assert all("\n" not in r.getMessage() for r in caplog.records)


def test_every_member_of_a_shard_sample_missing_of_a_wrong_type_or_huge(tmp_path, caplog):
    need("webdataset")
    from jagg_scale.data import ShardPromptStream

    good = {"txt": b"a red cube", "json": b'{"tag": "x"}'}
    variants = [good, {"json": good["json"]}, {"txt": good["txt"]}, {**good, "txt": b""}, {**good, "txt": b"\xff\xfe"},
                {**good, "txt": b"x" * (2 << 20)}, {**good, "json": b"[1, 2]"}, {**good, "json": b"{bad"},
                {**good, "json": b"[" * 100_000}, {**good, "json": b"{}" * (1 << 20)},
                {**good, "png": b"not a png"}, {**good, "png": b"\x89PNG", "jpg": b"\xff\xd8\xff"}]
    shard = hand_tar(tmp_path / "s.tar", [(f"{i:09d}", sample) for i, sample in enumerate(variants)])
    with ShardPromptStream([shard]) as stream:  # 0 and 2 (no .json: no metadata) are good
        got = stream.next_records(3)  # 0, 2, then 0 again: every other variant passed over once
        assert [r.prompt for r in got] == ["a red cube"] * 3 and [r.metadata for r in got] == [{"tag": "x"}, {}] * 1 \
            + [{"tag": "x"}] and sum(stream.skipped.values()) == len(variants) - 2
    named = {r.getMessage().split("sample ")[1][:9] for r in caplog.records if "skipping bad" in r.getMessage()}
    assert named == {f"{i:09d}" for i in range(len(variants)) if i not in (0, 2)}
    assert all("\n" not in r.getMessage() for r in caplog.records)
