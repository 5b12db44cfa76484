"""tools/checkpoint_rate.py: the lead-time table in docs/launchers.md is the tool's (checkpoint bytes from the model
shapes: FLUX.1-dev full fine-tune ~143 GB); the save-rate measurement it is read with is the product's
(`python -m jagg_scale.estimate.preemption --measure DIR`, tests/estimate/test_preemption.py)."""

from pathlib import Path

from extras import need

ROOT = Path(__file__).resolve().parents[2]

need("diffusers")
from tools import checkpoint_rate  # noqa: E402


def test_checkpoint_bytes_per_model():
    sizes = checkpoint_rate.checkpoint_bytes()
    flux = sizes["flux1_dev"]
    assert flux["full"] == 12 * flux["params"] and 142e9 < flux["full"] < 144e9  # the issue's ~143 GB
    assert flux["full+ema"] == 16 * flux["params"]
    assert all(0 < s["lora"] < s["full"] / 40 for s in sizes.values())


def test_docs_hold_the_tools_table():
    table = checkpoint_rate.table(checkpoint_rate.checkpoint_bytes(), 8, 1.0, 0.5)
    assert table in (ROOT / "docs" / "launchers.md").read_text()
