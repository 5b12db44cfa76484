"""jagg-bench smoke test: `python -m tools.bench --quick` runs every part at toy sizes and writes the report.

No timing assertions (the numbers of a quick run are meaningless): every part must be in the JSON without an
error, with a non-empty summary of finite positive numbers, every number in the JSON must be finite, and the
markdown and the plots must be written.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import RUN_S
from extras import need

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("window_speed", "memory", "cfg")


def _numbers(x, path="$"):
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return
    if isinstance(x, (int, float)):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.mark.slow
def test_bench_quick_writes_every_part(tmp_path):
    need("diffusers")
    need("matplotlib")
    out = tmp_path / "bench" / "benchmarks"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_S)  # a hang guard only (tests/hang_guard.py)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]

    data = json.loads(out.with_suffix(".json").read_text())
    assert data["quick"] is True and data["machine"]["cpu_model"] and data["machine"]["torch"]
    for part in PARTS:
        res = data["parts"].get(part)
        assert res is not None, f"{part} missing"
        assert "error" not in res, f"{part}: {res.get('error')}"
        assert res["summary"], f"{part}: empty summary"
        for key, value in res["summary"].items():
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (part, key, value)
        assert res["wall_seconds"] > 0
    bad = [(p, v) for p, v in _numbers(data) if not math.isfinite(v)]
    assert not bad, bad[:10]

    md = (out.parent / "benchmarks.md").read_text()
    assert "## Targets" in md and data["command"] in md
    for part in PARTS:
        assert f"{part}:" in md
        png = out.parent / f"benchmarks_{part}.png"
        assert png.exists() and png.stat().st_size > 1000
        assert png.name in md


# The quick run trains the arms whose pass counts it asserts (6 of the 12 default arms: each arm's step is ~2 s of a
# 2-core CI machine); every arm's config, the default ones, the variants and the objectives, is built below
QUICK_ARMS = ("Flow-GRPO", "Fast k2", "JAGG in SDE k4 + dpm2", "per-step in SDE k4 + dpm2", "NFT", "JAGG-NFT")


def test_every_time_to_reward_arm_is_a_valid_config():
    """Each arm's overrides (tools/bench/time_to_reward.py: ARMS, VARIANTS, OBJECTIVES) on the study's recipe load as a
    config that passes every check, at the full study's schedule and the quick one's."""
    from tools.bench import time_to_reward as S

    from jagg_scale.train import load_config

    for size in (S.FULL, S.QUICK):
        for arm in (*S.ARMS, *S.VARIANTS, *S.OBJECTIVES):
            cfg = load_config(str(ROOT / "configs" / "digits_cpu.yaml"),
                              S.COMMON + size["extra"] + S.arm_overrides(arm, size["num_steps"]))
            assert cfg.sampling.num_steps == size["num_steps"], arm


@pytest.mark.slow
def test_time_to_reward_study_quick_writes_its_table_plot_and_target(tmp_path):
    """The study (not in the default parts) at toy sizes: every arm's curve, the table, the plot, the target row."""
    need("matplotlib")
    out = tmp_path / "bench" / "benchmarks"
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--quick", "--parts", "time_to_reward",
                           "--set", "arms=" + ";".join(QUICK_ARMS), "--out", str(out)], cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=RUN_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    res = json.loads(out.with_suffix(".json").read_text())["parts"]["time_to_reward"]
    assert "error" not in res and set(res["rows"]) == set(QUICK_ARMS)
    for key, value in res["summary"].items():
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    # two worker processes, one seed each, every one training all the arms
    assert res["setup"]["workers"] == 2 and sorted((r["seed"], r["arm"]) for r in res["runs"]) == sorted(
        (s, a) for s in (0, 1) for a in res["rows"])
    for run in res["runs"]:  # 1 step, evaluated at 0 and 1; whole-step times measured
        assert run["eval_steps"] == [0, 1] and len(run["step_seconds"]) == 1 and min(run["step_seconds"]) > 0
    rows = res["rows"]
    assert rows["JAGG in SDE k4 + dpm2"]["per_step_equiv_per_step"] == 4
    assert rows["per-step in SDE k4 + dpm2"]["backward_passes_per_step"] == 4  # MixGRPO-Flash: per step in the window
    assert rows["JAGG in SDE k4 + dpm2"]["backward_passes_per_step"] == 2  # one joint pass over the window's ends
    assert rows["Fast k2"]["per_step_equiv_per_step"] == 2
    # DiffusionNFT: 7 training timesteps per sample (8 x 0.99), one backward each; JAGG-NFT: one window of them
    assert rows["NFT"]["per_step_equiv_per_step"] == 7 == rows["NFT"]["backward_passes_per_step"]
    assert rows["JAGG-NFT"]["backward_passes_per_step"] == 2
    assert all(r["diversity_ratio"] is not None and r["diversity_ratio"] > 0 for r in rows.values())
    md = (out.parent / "benchmarks.md").read_text()
    assert "4. time_to_reward" in md and "benchmarks_time_to_reward.png" in md and "best arm" in md
    assert (out.parent / "benchmarks_time_to_reward.png").stat().st_size > 1000


def test_the_report_of_a_results_prefix_is_a_page_beside_the_results_folder():
    """`python -m tools.bench` writes docs/results/benchmarks.json and *.png (generated results apart from the prose)
    and the page docs/benchmarks.md, whose plots link into docs/results/; elsewhere all sit together."""
    from tools.bench.report import report_path

    assert report_path(Path("docs/results/benchmarks")) == Path("docs/benchmarks.md")
    assert report_path(Path("/tmp/b/benchmarks")) == Path("/tmp/b/benchmarks.md")

