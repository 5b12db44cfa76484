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


def test_the_wait_is_the_longest_stretch_between_safe_points():
    """A rollout forward (rollout time over chunks x sampling steps), an update micro-batch before the first optimizer
    step (the update split evenly over its optimizer steps, the first into micro-batches), or the update after it;
    under pools the whole step (a trainer stops at its end only)."""
    from pathlib import Path

    from jagg_scale.train import load_config

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")
    cfg = load_config(tiny, ["sampling.num_steps=10", "train.prompts_per_step=3", "grpo.group_size=4",
                             "train.minibatch_size=6"])
    assert cfg.optimizer_steps_per_step == 2
    phases = {"rollout": 120.0, "train": 60.0, "step": 190.0}
    est = {"local_rows": 12, "sampling_batch": 4, "local_batch": 6, "micro_batch_size": 2}
    w = P.wait_seconds(cfg, phases, est)
    assert w["rollout_forward"] == pytest.approx(120 / (3 * 10))
    assert w["first_micro_batch"] == pytest.approx(60 / 2 / 3)
    assert w["after_first_optimizer_step"] == pytest.approx(30.0) == w["wait"]
    one = load_config(tiny, ["sampling.num_steps=10", "train.prompts_per_step=3", "grpo.group_size=4",
                             "train.minibatch_size=12"])  # one optimizer step: a micro-batch is the longest
    assert P.wait_seconds(one, phases, est)["wait"] == pytest.approx(60 / 3)


def test_a_two_expert_checkpoint_holds_both_experts():
    """Wan2.2 A14B trains both 14B experts: its checkpoint is twice Wan2.1's (the same architecture), and the wait
    for a safe point is one forward or micro-batch of one expert, not a step."""
    from pathlib import Path

    from jagg_scale.train import load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    one, two = (P.lead(load_config(str(root / f"{name}.yaml"), [], check_files=False), 4, 8)
                for name in ("wan21_t2v_14b_hps", "wan22_t2v_a14b_hps"))
    assert two["checkpoint_gb"] == pytest.approx(2 * one["checkpoint_gb"], rel=1e-3)
    assert two["wait_s"] < two["step_s"] / 10
    # Wan2.1 on 4 nodes starts with the sbatch's defaults (tests/cli/test_sbatch.py runs the shell on these numbers):
    # a safe point within a tenth of the step, a SHUTDOWN_TIMEOUT past torchrun's 240, the header's 300 s lead
    assert one["wait_s"] < one["step_s"] / 10 and one["shutdown_s"] > 240 and one["lead_s"] <= 300
