"""The Slurm template (slurm/jagg.sbatch): the command it renders, the settings it exports, the layout it decides
(HSDP), the preemption it estimates, and its trap and requeue paths run for real against a stub srun
(tests/launch_stubs.py)."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import RUN_S, WAIT_S
from launch_stubs import NCCL_SETTINGS, CONFIG, ROOT, SBATCH, _dry, _env, _opt, _run, _tail, _wait_for


# ------------------------------------------------------------------ slurm/jagg.sbatch


def _slurm_env(stubs: Path, tmp_path: Path, **extra) -> dict:
    """A 2-node allocation. REPLICATE is given, so that the script need not read the config with Python (the
    tests of what it reads there remove it)."""
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    return _env(stubs, **{**dict(SLURM_JOB_NODELIST="node[01-02]", SLURM_NNODES=2, SLURM_JOB_ID=123,
                                 SLURM_GPUS_ON_NODE=4, STUB_LOG=tmp_path / "stub.log", OUTPUT_DIR=out,
                                 JAGG_TRAIN="jt", REPLICATE=2, PREEMPT_CHECK=0), **extra})


def _log(tmp_path: Path) -> list[str]:
    p = tmp_path / "stub.log"
    return p.read_text().splitlines() if p.exists() else []


def test_sbatch_header():
    text = SBATCH.read_text()
    for directive in ("--nodes=", "--ntasks-per-node=1", "--gpus-per-node=", "--cpus-per-task=", "--time=",
                      "--signal=B:USR1@300", "--requeue", "--open-mode=append", "--output=logs/%x-%j.out"):
        assert f"#SBATCH {directive}" in text, directive
    # sbatch stops reading #SBATCH lines at the first command
    head = text.split("set -euo pipefail")[0]
    assert text.count("#SBATCH") == head.count("#SBATCH")


def test_sbatch_dry_run(stubs, tmp_path):
    env = _slurm_env(stubs, tmp_path, SLURM_CPUS_PER_TASK=16)
    argv = _dry(SBATCH, [CONFIG, "train.steps=3", "data.x=a b"], env)
    assert argv[0] == "srun"
    assert (_opt(argv, "--nodes"), _opt(argv, "--ntasks-per-node"), _opt(argv, "--cpus-per-task")) == ("2", "1", "16")
    torchrun = next(i for i, a in enumerate(argv) if Path(a).name == "torchrun")
    tr = argv[torchrun:]
    assert (_opt(tr, "--nnodes"), _opt(tr, "--nproc-per-node")) == ("2", "4")
    assert _opt(tr, "--rdzv-backend") == "c10d"
    assert _opt(tr, "--rdzv-id") == "123"
    assert _opt(tr, "--rdzv-endpoint") == f"node01:{10000 + 123 % 20000}"  # the port ranks.py derives
    assert "SIGUSR1" in _opt(tr, "--signals-to-handle").split(",")
    assert _tail(argv, "jt") == [CONFIG, "train.steps=3", "data.x=a b", f"run.output_dir={env['OUTPUT_DIR']}",
                                 "parallel.replicate=2", "run.resume=auto"]
    assert _log(tmp_path) == []  # dry run: no srun, no requeue


def test_sbatch_output_dir_from_override_or_config(stubs, tmp_path):
    env = _slurm_env(stubs, tmp_path)
    del env["OUTPUT_DIR"]
    argv = _dry(SBATCH, [CONFIG, "run.output_dir=runs/x"], env)
    assert _tail(argv, "jt") == [CONFIG, "run.output_dir=runs/x", "parallel.replicate=2", "run.resume=auto"]
    # neither: read the config's run.output_dir with the venv's Python
    r = _run(SBATCH, [CONFIG, "parallel.engine=fsdp2"], {**env, "DRY_RUN": "1", "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    assert "output_dir=runs/tiny_cpu" in r.stderr
    assert shlex.split(r.stdout)[-3:] == ["parallel.engine=fsdp2", "parallel.replicate=2", "run.resume=auto"]


@pytest.mark.slow
def test_sbatch_uses_hsdp_over_the_nodes_where_it_fits(stubs, tmp_path):
    """fsdp2 across nodes: parallel.replicate = the node count for LoRA, and for a full fine-tune whose state
    sharded over one node fits the GPU by the memory model (FLUX.1-dev on 8 GPUs a node: 56 GiB per rank; on 2 GPUs
    a node it does not fit: flat FSDP), unless the layout is given; one node keeps the config's. The log says why."""
    def replicate_overrides(config, nodes, *args, gpus=4):  # the config's own paths: the shapes are the model's
        env = _slurm_env(stubs, tmp_path, SLURM_NNODES=nodes, PYTHON=sys.executable, GPUS=gpus)
        del env["REPLICATE"]
        r = _run(SBATCH, [config, *args], {**env, "DRY_RUN": "1"}, timeout=RUN_S)
        assert r.returncode == 0, r.stderr
        tail = _tail(shlex.split(r.stdout.splitlines()[-1]), "jt")
        assert tail[-1] == "run.resume=auto"
        return [a for a in tail if a.startswith("parallel.replicate=")], r.stderr

    assert replicate_overrides("configs/sd35m_pickscore.yaml", 4)[0] == ["parallel.replicate=4"]
    assert replicate_overrides("configs/sd35m_pickscore.yaml", 4, "parallel.replicate=1")[0] == [
        "parallel.replicate=1"]
    assert replicate_overrides("configs/sd35m_pickscore.yaml", 1)[0] == []
    flux, log = replicate_overrides("configs/flux1_dev_hps.yaml", 2, gpus=8)
    assert flux == ["parallel.replicate=2"] and "peaks at 56.1 GiB per rank, within 71.3 GiB" in log
    flux, log = replicate_overrides("configs/flux1_dev_hps.yaml", 2, gpus=2)
    assert flux == [] and "flat FSDP over every node" in log


def test_sbatch_sets_the_sequence_parallel_size_and_chooses_hsdp_where_its_groups_fit_a_node(stubs, tmp_path):
    """SEQUENCE_PARALLEL (or the override, which must agree) becomes parallel.sequence_parallel; HSDP over the nodes
    is chosen with it as without it when the groups fit inside a node (sp 2 of 8 GPUs: one replica a node), not when
    a group would straddle nodes (sp 4 of 6 GPUs: flat FSDP), and the log says why."""
    env = _slurm_env(stubs, tmp_path, SLURM_NNODES=4, PYTHON=sys.executable, GPUS=8, SEQUENCE_PARALLEL=2)
    del env["REPLICATE"]
    r = _run(SBATCH, ["configs/wan_tiny_cpu.yaml", "parallel.engine=fsdp2"], {**env, "DRY_RUN": "1"}, timeout=RUN_S)
    assert r.returncode == 0, r.stderr
    tail = _tail(shlex.split(r.stdout.splitlines()[-1]), "jt")
    assert "parallel.sequence_parallel=2" in tail and "parallel.replicate=4" in tail, (tail, r.stderr)
    r = _run(SBATCH, [CONFIG, "parallel.sequence_parallel=4"], {**env, "DRY_RUN": "1"})
    assert r.returncode == 2
    assert "SEQUENCE_PARALLEL=2 and the override parallel.sequence_parallel=4 disagree" in r.stderr
    env.update(GPUS="6", SEQUENCE_PARALLEL="4")
    r = _run(SBATCH, ["configs/wan_tiny_cpu.yaml", "parallel.engine=fsdp2"], {**env, "DRY_RUN": "1"}, timeout=RUN_S)
    tail = _tail(shlex.split(r.stdout.splitlines()[-1]), "jt")
    assert r.returncode == 0 and not any(a.startswith("parallel.replicate=") for a in tail), r.stderr
    assert "parallel.sequence_parallel 4 does not divide a node's 6 GPUs: flat FSDP over every node" in r.stderr


def test_sbatch_replicate_and_collective_timeout_knobs(stubs, tmp_path):
    env = _slurm_env(stubs, tmp_path, REPLICATE=4, COLLECTIVE_TIMEOUT=600)
    tail = _tail(_dry(SBATCH, [CONFIG], env), "jt")
    assert tail[-3:] == ["parallel.replicate=4", "parallel.collective_timeout_s=600", "run.resume=auto"]
    r = _run(SBATCH, [CONFIG, "parallel.replicate=2"], {**env, "DRY_RUN": "1"})
    assert r.returncode == 2 and "REPLICATE=4 and the override parallel.replicate=2 disagree" in r.stderr
    r = _run(SBATCH, [CONFIG], {**env, "DRY_RUN": "1", "COLLECTIVE_TIMEOUT": "30m"})
    assert r.returncode == 2 and "COLLECTIVE_TIMEOUT=30m must be a positive integer" in r.stderr


def _srun_env(env: dict, tmp_path: Path) -> dict:
    """The environment the stub srun saw (what torchrun and the workers inherit)."""
    r = _run(SBATCH, [CONFIG], {**env, "STUB_MODE": "env"})
    assert r.returncode == 0, r.stderr
    lines = (Path(env["OUTPUT_DIR"]) / "srun.env").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if "=" in ln)


def test_sbatch_exports_nccl_and_torch_settings(stubs, tmp_path):
    env = _slurm_env(stubs, tmp_path)
    seen = _srun_env(env, tmp_path)
    out = env["OUTPUT_DIR"]
    assert {k: seen.get(k) for k in NCCL_SETTINGS} == {
        "NCCL_DEBUG": "WARN",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a failed collective ends the process (torch's SkipCleanUp)
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
        "TORCH_FR_DUMP_TEMP_FILE": f"{out}/nccl_trace/rank_",  # on the shared run directory
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None,
        "PYTORCH_ALLOC_CONF": None,
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    assert (Path(out) / "nccl_trace").is_dir()


def test_sbatch_keeps_the_submitters_nccl_and_torch_settings(stubs, tmp_path):
    mine = {"NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "500",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "fr" / "trace_"),
            "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}
    seen = _srun_env(_slurm_env(stubs, tmp_path, **mine), tmp_path)
    assert {k: seen[k] for k in mine} == mine
    # the older names carried over to the ones torch reads first; no second allocator setting beside the user's
    assert seen["TORCH_FR_BUFFER_SIZE"] == "500"
    assert seen["TORCH_FR_DUMP_TEMP_FILE"] == mine["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in seen
    assert (tmp_path / "fr").is_dir()


def test_sbatch_outside_slurm(stubs):
    r = _run(SBATCH, [CONFIG], _env(stubs, DRY_RUN=1))
    assert r.returncode == 2 and "SLURM_JOB_ID" in r.stderr


def test_sbatch_requeues_after_preemption_marker(stubs, tmp_path):
    env = _slurm_env(stubs, tmp_path, STUB_MODE="preempt")
    r = _run(SBATCH, [CONFIG], env)
    log = _log(tmp_path)
    assert log[0].startswith("srun ") and "--rdzv-endpoint node01:10123" in log[0]
    assert "requeue 123" in log, r.stderr
    assert r.returncode == 0


def test_sbatch_no_requeue_after_a_finished_run(stubs, tmp_path):
    env = _slurm_env(stubs, tmp_path, STUB_MODE="exitcode", STUB_RC=0)
    (Path(env["OUTPUT_DIR"]) / "PREEMPTED").write_text("stale")  # from an earlier job: removed before srun
    r = _run(SBATCH, [CONFIG], env)
    assert r.returncode == 0
    assert not any(ln.startswith("requeue") for ln in _log(tmp_path)), r.stderr


def test_sbatch_requeues_a_crash_within_its_budget_then_fails(stubs, tmp_path):
    """A non-zero exit without preemption (an NCCL error, a lost node): requeued, counted in OUTPUT_DIR/CRASHES,
    RESTARTS times; the next crash writes OUTPUT_DIR/FAILED with the reason and ends the job with srun's code."""
    env = _slurm_env(stubs, tmp_path, STUB_MODE="exitcode", STUB_RC=1, RESTARTS=2)
    out = Path(env["OUTPUT_DIR"])
    (out / "FAILED").write_text("stale")  # from an earlier job: removed before srun
    for crash in (1, 2):
        r = _run(SBATCH, [CONFIG], env)
        assert r.returncode == 0 and _log(tmp_path).count("requeue 123") == crash, r.stderr
        assert (out / "CRASHES").read_text().strip() == str(crash) and not (out / "FAILED").exists()
        assert f"crash {crash} of RESTARTS=2" in r.stderr
    r = _run(SBATCH, [CONFIG], env)
    assert r.returncode == 1 and _log(tmp_path).count("requeue 123") == 2, r.stderr
    assert "RESTARTS=2 requeues used up" in (out / "FAILED").read_text()


def _checkpoint(out: Path, step: int) -> None:
    """A complete checkpoint of `step`, as the trainer leaves one (its COMPLETE marker written last)."""
    d = out / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text("")


def test_the_requeue_budgets_count_from_the_newest_checkpoint(stubs, tmp_path):
    """Issue 40: a run of many hour-long steps is requeued at every time limit for as long as it checkpoints, and may
    crash on many nodes over a month; what stops is a run that makes no checkpoint: MAX_STALLED_REQUEUES requeues, or
    RESTARTS crashes, in a row without one."""
    env = _slurm_env(stubs, tmp_path, STUB_MODE="preempt", MAX_STALLED_REQUEUES=2)
    out = Path(env["OUTPUT_DIR"])
    for n in (1, 2):  # preempted twice without a new checkpoint: requeued, counted
        r = _run(SBATCH, [CONFIG], env)
        assert r.returncode == 0 and _log(tmp_path).count("requeue 123") == n, r.stderr
        assert f"requeue {n} of MAX_STALLED_REQUEUES=2 since the checkpoint of step 0" in r.stderr
    r = _run(SBATCH, [CONFIG], env)  # the third in a row: stopped
    assert r.returncode == 138 and _log(tmp_path).count("requeue 123") == 2
    assert "2 requeues in a row made no checkpoint after step 0 (MAX_STALLED_REQUEUES=2): not requeueing" in r.stderr
    for step in (4, 8, 12):  # each job checkpoints: requeued every time, the count back at 1
        _checkpoint(out, step)
        r = _run(SBATCH, [CONFIG], env)
        assert r.returncode == 0 and f"a new checkpoint (step {step}, after {step - 4 or 0})" in r.stderr, r.stderr
        assert f"requeue 1 of MAX_STALLED_REQUEUES=2 since the checkpoint of step {step}" in r.stderr
    crash = {**env, "STUB_MODE": "exitcode", "STUB_RC": "1", "RESTARTS": "1"}
    r = _run(SBATCH, [CONFIG], crash)
    assert r.returncode == 0 and "crash 1 of RESTARTS=1" in r.stderr
    _checkpoint(out, 16)  # the resumed job checkpointed before its node failed: a crash of a progressing run
    r = _run(SBATCH, [CONFIG], crash)
    assert r.returncode == 0 and "crash 1 of RESTARTS=1" in r.stderr and not (out / "FAILED").exists()
    r = _run(SBATCH, [CONFIG], crash)  # a second crash with nothing saved between: the loop stops
    assert r.returncode == 1 and "since the checkpoint of step 16" in (out / "FAILED").read_text()


def test_sbatch_does_not_requeue_what_the_trainer_says_a_retry_cannot_fix(stubs, tmp_path):
    """The trainer writes JAGG_FAILED_FILE (OUTPUT_DIR/FAILED) on a config error or a diverged run: no requeue."""
    env = _slurm_env(stubs, tmp_path, STUB_MODE="fail")
    r = _run(SBATCH, [CONFIG], env)
    assert r.returncode == 1 and not any(ln.startswith("requeue") for ln in _log(tmp_path)), r.stderr
    assert "a retry cannot help" in r.stderr and "config key 'x' is bad" in r.stderr
    assert (Path(env["OUTPUT_DIR"]) / "CRASHES").read_text().strip() == "0"  # not counted as a crash


def one_node(env: dict) -> dict:
    return {**{k: v for k, v in env.items() if k != "REPLICATE"}, "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node01"}


@pytest.mark.slow
def test_sbatch_derives_its_preemption_deadlines_from_the_estimate(stubs, tmp_path):
    """Deadlines that nest: the wait for the trainer's next safe point and the checkpoint must fit in torchrun's
    SHUTDOWN_TIMEOUT, and that in the signal's lead. Wan2.1 14B on 4 nodes (a safe point inside the step, not the
    ~3,900 s step) starts with the defaults, its SHUTDOWN_TIMEOUT raised to the estimate's. FLUX.1-dev's full
    fine-tune on one node (a 143 GB checkpoint written by one node) needs a longer lead than the header's 300 s: kept
    by the script's own timer from the job's end, whose USR1 reaches srun with no signal from outside (the job then
    requeues). That and the refusals (an end that cannot be read or comes within the lead, a SHUTDOWN_TIMEOUT given
    too short) run on a stand-in of its estimate (`PYTHON` printing the numbers): the shell's decisions; the
    estimate itself is tests/estimate/test_preemption.py's."""
    import time

    env = _slurm_env(stubs, tmp_path, PREEMPT_CHECK=1, PYTHON=sys.executable, GPUS=8)
    wan = {**{k: v for k, v in env.items() if k != "REPLICATE"},  # the script decides: no HSDP with sp 2 on 8 GPUs
           "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "node[01-04]", "DRY_RUN": "1"}
    r = _run(SBATCH, ["configs/wan21_t2v_14b_hps.yaml"], wan, timeout=RUN_S)
    m = re.search(r"a wait ~(\d+) s for a safe point \(a step ~(\d+) s\).* needs SHUTDOWN_TIMEOUT >= (\d+) s "
                  r"\(have (\d+)\), a signal lead >= (\d+) s", r.stderr)
    assert r.returncode == 0 and m, r.stderr
    wait, step, need_shutdown, have, lead = map(int, m.groups())
    assert wait < step / 10 and have == need_shutdown > 240 and lead <= 300  # the default lead, a derived timeout
    assert _opt(shlex.split(r.stdout), "--shutdown-timeout") == str(need_shutdown)

    flux = ["configs/flux1_dev_hps.yaml"]  # its real lead on one node: 466 s (docs/launchers.md), stood in below
    one = {**{k: v for k, v in env.items() if k != "REPLICATE"}, "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node01"}
    python = tmp_path / "estimate"  # shutdown_s lead_s checkpoint_gb save_s step_s wait_s, as --shell prints
    python.write_text("#!/bin/sh\necho 436 466 143 179 186 49\n")
    python.chmod(0o755)
    stand_in = {**one, "PYTHON": str(python), "DRY_RUN": "1"}
    # the job "ends" 3 s after the lead it needs: the script's own USR1, forwarded to srun, then the requeue
    r = _run(SBATCH, flux, {**stand_in, "DRY_RUN": "", "STUB_MODE": "wait",
                            "SLURM_JOB_END_TIME": str(int(time.time()) + 466 + 3)})
    log = _log(tmp_path)
    assert re.search(r"this script signals itself in [0-3] s", r.stderr), r.stderr
    assert "srun got USR1" in log and "requeue 123" in log and r.returncode == 0, (log, r.stderr)
    r = _run(SBATCH, flux, stand_in)  # no SLURM_JOB_END_TIME, no squeue: the lead cannot be kept
    assert r.returncode == 2 and "end time could not be read" in r.stderr and "--signal=B:USR1@466" in r.stderr
    r = _run(SBATCH, flux, {**stand_in, "SLURM_JOB_END_TIME": str(int(time.time()) + 200)})
    assert r.returncode == 2 and "within the preemption's lead of 466 s" in r.stderr, r.stderr
    r = _run(SBATCH, flux, {**stand_in, "SLURM_JOB_END_TIME": "9999999999", "SHUTDOWN_TIMEOUT": "100"})
    assert r.returncode == 2 and "this job has SHUTDOWN_TIMEOUT=100" in r.stderr, r.stderr
    r = _run(SBATCH, flux, {**stand_in, "SLURM_JOB_END_TIME": str(int(time.time()) + 7200)})
    m = re.search(r"this script signals itself in (\d+) s", r.stderr)
    assert r.returncode == 0 and m and 7200 - 466 - 60 < int(m.group(1)) <= 7200 - 466, r.stderr
    assert _opt(shlex.split(r.stdout.splitlines()[-1]), "--shutdown-timeout") == "436"


def test_sbatch_exposes_torchruns_restarts_and_says_its_budget(stubs, tmp_path):
    argv = _dry(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, MAX_RESTARTS=2, DRY_RUN=1))
    assert _opt(argv, "--max-restarts") == "2"
    r = _run(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, DRY_RUN=1))
    assert ("requeue budget without a new checkpoint: 3 crash(es), 5 requeues; torchrun --max-restarts 0"
            in r.stderr)
    r = _run(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, DRY_RUN=1, RESTARTS="x"))
    assert r.returncode == 2 and "RESTARTS=x must be a non-negative integer" in r.stderr
    r = _run(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, DRY_RUN=1, MAX_REQUEUES=50))
    assert r.returncode == 2 and "MAX_REQUEUES=50 counted requeues over the whole run and is gone" in r.stderr


def test_sbatch_requeues_on_preemption_exit_code(stubs, tmp_path):
    r = _run(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, STUB_MODE="exitcode", STUB_RC=143))
    assert "requeue 123" in _log(tmp_path), r.stderr


@pytest.mark.parametrize("extra", [{"STUB_JOBSTATE": "CANCELLED"}, {"MAX_STALLED_REQUEUES": 0}],
                         ids=["cancelled", "max-stalled-requeues"])
def test_sbatch_requeue_limits(extra, stubs, tmp_path):
    r = _run(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, STUB_MODE="preempt", **extra))
    assert not any(ln.startswith("requeue") for ln in _log(tmp_path)), r.stderr
    assert r.returncode == 138


def test_sbatch_forwards_usr1_once_and_requeues(stubs, tmp_path):
    """Slurm's B:USR1 reaches the batch shell: the trap forwards it to srun (once), then requeues."""
    saved = tmp_path / "saved"  # the stub srun "saves a checkpoint" until this file exists
    env = _slurm_env(stubs, tmp_path, STUB_MODE="wait", STUB_SAVED=saved)
    started = Path(env["OUTPUT_DIR"]) / "STARTED"
    err_file = tmp_path / "sbatch.err"  # a file, not a pipe: read while the shell runs
    with err_file.open("w") as stderr:
        p = subprocess.Popen(["bash", str(SBATCH), CONFIG], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=stderr, text=True)
    try:
        _wait_for(started.exists, p, "stub srun did not start")
        p.send_signal(signal.SIGUSR1)
        _wait_for(lambda: "srun got USR1" in _log(tmp_path), p, "USR1 did not reach srun")
        p.send_signal(signal.SIGTERM)  # e.g. the time limit while the trainer saves: logged, not forwarded
        _wait_for(lambda: "not forwarded" in err_file.read_text(), p, "the second signal was not logged")
        saved.touch()  # the save ends: srun exits, the shell requeues
        p.wait(timeout=WAIT_S)  # a hang guard only
    finally:
        saved.touch()
        if p.poll() is None:
            p.kill()
            p.wait()
    err = err_file.read_text()
    log = _log(tmp_path)
    assert [ln for ln in log if ln.startswith("srun got")] == ["srun got USR1"], (log, err)
    assert "requeue 123" in log, err
    assert "not forwarded" in err
    assert p.returncode == 0
