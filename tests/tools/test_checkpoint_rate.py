"""tools/checkpoint_rate.py: the save-rate measurement runs through the trainer's save protocol, and the lead-time
table in docs/launchers.md is the tool's (checkpoint bytes from the model shapes: FLUX.1-dev full fine-tune ~143 GB)."""

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


def test_measure_times_write_hash_and_verify(tmp_path):
    m = checkpoint_rate.measure(0.06, 1, tmp_path)  # one 64 MB tensor
    assert m["bytes"] == 1 << 26 and len(m["runs"]) == 1
    assert all(m[k] > 0 for k in ("write_gbps", "hash_gbps", "save_gbps", "verify_gbps"))
    assert m["save_gbps"] < m["hash_gbps"]  # the save includes the hash
    assert not list(tmp_path.iterdir())  # cleaned up
