"""`python -m jagg_scale.estimate.preemption`: the save rates measured on a filesystem through the trainer's save
protocol, and the lead computed with rates given (slurm/jagg.sbatch's own check is in tests/cli/test_sbatch.py)."""

import json

import pytest

from jagg_scale.estimate import preemption as P


def test_measure_times_write_hash_and_verify(tmp_path):
    m = P.measure_save_rate(tmp_path, 0.06, 1)  # one 64 MB tensor
    assert m["bytes"] == 1 << 26 and len(m["runs"]) == 1
    assert all(m[k] > 0 for k in ("write_gbps", "hash_gbps", "save_gbps", "verify_gbps"))
    assert m["save_gbps"] < m["hash_gbps"]  # the save includes the hash
    assert not list(tmp_path.iterdir())  # cleaned up


def test_the_cli_measures_a_directory_and_refuses_a_missing_one(tmp_path, capsys):
    assert P.main(["--measure", str(tmp_path), "--gb", "0.06", "--repeats", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == 1 << 26
    with pytest.raises(SystemExit) as exc:
        P.main(["--measure", str(tmp_path / "nope")])
    assert exc.value.code == 2 and "nope: not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        P.main(["--nodes", "2"])
    assert exc.value.code == 2 and "CONFIG, --nodes and --gpus" in capsys.readouterr().err


def test_the_rates_given_set_the_save_time():
    nbytes = 100 * P.GB
    slow, fast = P.save_seconds(nbytes, 2, 8), P.save_seconds(nbytes, 2, 8, node_gbps=4.0, hash_gbps=2.0)
    assert slow == pytest.approx(100 / 2 + 100 / 16 / 0.5) and fast == pytest.approx(slow / 4)
