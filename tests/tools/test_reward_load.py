"""tools/bench/reward_load.py at toy size: both arms run against the real server and every client gets its own
scores, so the benchmark of docs/reward_server.md does not rot (its numbers are the benchmark's, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from extras import need
from hang_guard import RUN_S

ROOT = Path(__file__).resolve().parents[2]


def test_the_load_benchmark_runs_both_arms_and_checks_every_score(tmp_path):
    need("uvicorn")
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench.reward_load", "--clients", "6", "--requests", "2",
                           "--fixed-s", "0.05", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [a["batch_rows"] for a in result["arms"]] == [1, 64]
    assert all(a["requests"] == 12 and a["wrong_scores"] == 0 and a["p99_s"] >= a["p50_s"] > 0
               for a in result["arms"])
