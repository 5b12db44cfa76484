"""tools/knot_fidelity.py at toy size: both measurements run through the trainer's own algorithm unit and report cosines
that could fail (in [-1, 1], the reference-at-knots gradient close to the reference-everywhere one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_knot_fidelity_quick(tmp_path):
    from tools import knot_fidelity

    assert knot_fidelity.main(["--quick", "--out", str(tmp_path / "kf")]) == 0
    res = json.loads((tmp_path / "kf.json").read_text())
    (case,) = res["ref_at"]
    assert 0.99 < case["knots_vs_steps"] <= 1.0 + 1e-9 and 0.5 < case["steps_vs_exact"] <= 1.0 + 1e-9
    schemes = res["nft"]["schemes"]
    assert set(schemes) == {name for name, *_ in knot_fidelity.NFT_SCHEMES}
    assert all(-1 <= s["cos_to_expected"] <= 1 and s["train_seconds"] > 0 for s in schemes.values())
    assert not (tmp_path / "kf.work").exists()


@pytest.mark.slow
def test_refresh_fidelity_quick(tmp_path):
    """The refresh_at part alone: every variant's cosine to the full refresh, the value errors of the interpolation
    (the drift form misses less than the plain blend of the fresh knots, the rollout's u being far from affine)."""
    from tools import knot_fidelity

    assert knot_fidelity.main(["--quick", "--parts", "refresh_at", "--lr-scales", "1", "--out",
                               str(tmp_path / "rf")]) == 0
    res = json.loads((tmp_path / "rf.json").read_text())
    assert res["ref_at"] == [] and res["nft"] is None
    (case,) = res["refresh_at"]
    means = case["means"]["lr_x1.0"]
    assert all(-1 - 1e-9 <= means[name] <= 1 + 1e-9 for name, *_ in knot_fidelity.REFRESH_VARIANTS)
    assert 0 < means["u_drift_missed"] < means["u_plain_missed"] and means["c_interpolate_missed"] > 0
