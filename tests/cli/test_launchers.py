"""The launchers (launchers/*.sh): each renders its command (DRY_RUN=1, parsed with shlex), starts two processes of a
stub trainer once to check the ranks it gets, and two real jagg-train workers that train a step together (the real
path: DeepSpeed's launcher broke there while its stub tests passed); signals reach the workers. The Slurm template:
test_sbatch.py; the stubs: tests/launch_stubs.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hang_guard import RUN_S, WAIT_S
from jagg_scale.parallel.ranks import free_port
from launch_stubs import (CONFIG, LAUNCHERS, ROOT, SBATCH, SCRIPTS, VENV_BIN, _dry, _env, _opt, _run, _stub, _tail,
                          _wait_for)


OVERRIDES = ["parallel.engine=fsdp2", "train.steps=3", "data.prompts_file=my prompts.txt", "run.name=it's"]


# ------------------------------------------------------------------ all scripts


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_syntax_and_executable(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("args", [[], ["configs/does_not_exist.yaml"], ["configs"]], ids=["none", "missing", "dir"])
def test_usage_and_exit_2_without_a_config_file(script, args, stubs):
    env = _env(stubs, DRY_RUN=1, SLURM_JOB_NODELIST="node[01-02]", SLURM_NNODES=2, SLURM_JOB_ID=123)
    r = _run(script, args, env)
    assert r.returncode == 2
    assert "usage:" in r.stderr
    assert r.stdout == ""


def test_hostfile_example_format():
    lines = [ln.split() for ln in (LAUNCHERS / "hostfile.example").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines and all(len(ln) == 2 and ln[1].startswith("slots=") and ln[1][6:].isdigit() for ln in lines)


# ------------------------------------------------------------------ torchrun


def test_torchrun_single_node(stubs):
    argv = _dry(LAUNCHERS / "torchrun.sh", [CONFIG, *OVERRIDES], _env(stubs, JAGG_TRAIN="/opt/venv/bin/jagg-train"))
    assert Path(argv[0]).name == "torchrun"
    assert _opt(argv, "--nnodes") == "1"
    assert _opt(argv, "--nproc-per-node") == "2"  # no GPU (the nvidia-smi stub fails): 2 CPU workers
    assert "--standalone" in argv and "--rdzv-endpoint" not in argv
    assert "SIGUSR1" in _opt(argv, "--signals-to-handle").split(",")
    assert int(_opt(argv, "--shutdown-timeout")) >= 60
    assert argv[argv.index("/opt/venv/bin/jagg-train") - 1] == "--no-python"
    assert _tail(argv, "/opt/venv/bin/jagg-train") == [CONFIG, *OVERRIDES]


def test_torchrun_counts_gpus(stubs):
    argv = _dry(LAUNCHERS / "torchrun.sh", [CONFIG], _env(stubs, STUB_GPUS=4, JAGG_TRAIN="jt"))
    assert _opt(argv, "--nproc-per-node") == "4"
    argv = _dry(LAUNCHERS / "torchrun.sh", [CONFIG], _env(stubs, STUB_GPUS=4, CUDA_VISIBLE_DEVICES="1,3,5",
                                                          JAGG_TRAIN="jt"))
    assert _opt(argv, "--nproc-per-node") == "3"
    argv = _dry(LAUNCHERS / "torchrun.sh", [CONFIG], _env(stubs, STUB_GPUS=4, NPROC_PER_NODE=7, JAGG_TRAIN="jt"))
    assert _opt(argv, "--nproc-per-node") == "7"


def test_torchrun_multi_node_c10d(stubs):
    env = _env(stubs, NNODES=2, NPROC_PER_NODE=8, MASTER_ADDR="10.0.0.1", MASTER_PORT=29600, JOB_ID="exp7",
               JAGG_TRAIN="jt", TORCHRUN="/x/torchrun", TORCHRUN_ARGS="--max-restarts 2")
    argv = _dry(LAUNCHERS / "torchrun.sh", [CONFIG, "train.steps=3"], env)
    assert argv[0] == "/x/torchrun"
    assert (_opt(argv, "--nnodes"), _opt(argv, "--nproc-per-node")) == ("2", "8")
    assert _opt(argv, "--rdzv-backend") == "c10d"
    assert _opt(argv, "--rdzv-endpoint") == "10.0.0.1:29600"
    assert _opt(argv, "--rdzv-id") == "exp7"
    assert _opt(argv, "--max-restarts") == "2"
    assert "--standalone" not in argv
    assert _tail(argv, "jt") == [CONFIG, "train.steps=3"]


def test_torchrun_multi_node_needs_master_addr(stubs):
    r = _run(LAUNCHERS / "torchrun.sh", [CONFIG], _env(stubs, NNODES=2, DRY_RUN=1))
    assert r.returncode == 2 and "MASTER_ADDR" in r.stderr


def test_torchrun_static(stubs):
    env = _env(stubs, NNODES=2, RDZV="static", NODE_RANK=1, MASTER_ADDR="n0", NPROC_PER_NODE=2, JAGG_TRAIN="jt")
    argv = _dry(LAUNCHERS / "torchrun.sh", [CONFIG], env)
    assert (_opt(argv, "--node-rank"), _opt(argv, "--master-addr"), _opt(argv, "--master-port")) == ("1", "n0", "29500")
    r = _run(LAUNCHERS / "torchrun.sh", [CONFIG], {**env, "NODE_RANK": "2", "DRY_RUN": "1"})
    assert r.returncode == 2 and "NODE_RANK" in r.stderr


def test_torchrun_finds_jagg_train(stubs, tmp_path):
    """Default JAGG_TRAIN: jagg-train on PATH; torchrun then comes from the same directory."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    _stub(venv / "jagg-train", "#!/bin/sh\n")
    _stub(venv / "torchrun", "#!/bin/sh\n")
    env = _env(stubs)
    env["PATH"] = f"{venv}{os.pathsep}{env['PATH']}"
    argv = _dry(LAUNCHERS / "torchrun.sh", [CONFIG], env)
    assert argv[0] == str(venv / "torchrun")
    assert _tail(argv, str(venv / "jagg-train")) == [CONFIG]


# ------------------------------------------------------------------ deepspeed


def test_deepspeed_hostfile(stubs):
    hostfile = str(LAUNCHERS / "hostfile.example")
    env = _env(stubs, HOSTFILE=hostfile, NUM_NODES=2, NUM_GPUS=4, MASTER_ADDR="node01", MASTER_PORT=29700,
               JAGG_TRAIN="jt")
    argv = _dry(LAUNCHERS / "deepspeed.sh", [CONFIG, "train.steps=3", "data.x=a b"], env)
    assert Path(argv[0]).name == "deepspeed"
    assert _opt(argv, "--hostfile") == hostfile
    assert (_opt(argv, "--num_nodes"), _opt(argv, "--num_gpus")) == ("2", "4")
    assert (_opt(argv, "--master_addr"), _opt(argv, "--master_port")) == ("node01", "29700")
    assert "--no_python" in argv and "--no_local_rank" in argv
    assert _tail(argv, "jt") == [CONFIG, "train.steps=3", "data.x=a b", "parallel.engine=deepspeed"]


def test_deepspeed_single_node_defaults(stubs):
    argv = _dry(LAUNCHERS / "deepspeed.sh", [CONFIG], _env(stubs, STUB_GPUS=8, JAGG_TRAIN="jt"))
    assert _opt(argv, "--num_gpus") == "8"
    assert "--hostfile" not in argv and "--num_nodes" not in argv and "--master_addr" not in argv
    assert _tail(argv, "jt") == [CONFIG, "parallel.engine=deepspeed"]
    # with a hostfile the slots decide, unless NUM_GPUS is given
    argv = _dry(LAUNCHERS / "deepspeed.sh", [CONFIG], _env(stubs, STUB_GPUS=8, JAGG_TRAIN="jt",
                                                           HOSTFILE=LAUNCHERS / "hostfile.example"))
    assert "--num_gpus" not in argv


def test_deepspeed_rejects_another_backend(stubs):
    r = _run(LAUNCHERS / "deepspeed.sh", [CONFIG, "parallel.engine=fsdp2"], _env(stubs, DRY_RUN=1))
    assert r.returncode == 2 and "parallel.engine=fsdp2" in r.stderr
    r = _run(LAUNCHERS / "deepspeed.sh", [CONFIG], _env(stubs, DRY_RUN=1, HOSTFILE="nope"))
    assert r.returncode == 2 and "HOSTFILE" in r.stderr


# ------------------------------------------------------------------ mpirun


def test_mpirun_single_node(stubs):
    argv = _dry(LAUNCHERS / "mpirun.sh", [CONFIG, *OVERRIDES], _env(stubs, NP=3, JAGG_TRAIN="jt"))
    assert Path(argv[0]).name == "mpirun"
    assert _opt(argv, "-np") == "3"
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    assert "--hostfile" not in argv
    assert _opt(argv, "--bind-to") == "none"
    exported = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert {"MASTER_ADDR=127.0.0.1", "MASTER_PORT=29500", "PATH"} <= set(exported)
    assert _tail(argv, "jt") == [CONFIG, *OVERRIDES]
    assert "--oversubscribe" not in argv
    argv = _dry(LAUNCHERS / "mpirun.sh", [CONFIG], _env(stubs, JAGG_TRAIN="jt"))
    assert _opt(argv, "-np") == "2" and "--oversubscribe" in argv  # the CPU default starts on any machine
    argv = _dry(LAUNCHERS / "mpirun.sh", [CONFIG], _env(stubs, STUB_GPUS=4, JAGG_TRAIN="jt"))
    assert _opt(argv, "-np") == "4" and "--oversubscribe" not in argv


def test_mpirun_hostfile(stubs, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\n\ngpu-a slots=4  # first\ngpu-b slots=2\n")
    argv = _dry(LAUNCHERS / "mpirun.sh", [CONFIG], _env(stubs, HOSTFILE=hostfile, MPI_EXPORT="NCCL_DEBUG",
                                                        NCCL_DEBUG="INFO", JAGG_TRAIN="jt"))
    assert _opt(argv, "-np") == "6"
    assert _opt(argv, "--hostfile") == str(hostfile)
    exported = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert "MASTER_ADDR=gpu-a" in exported and "NCCL_DEBUG" in exported
    hostfile.write_text("gpu-a slots=4\ngpu-b\n")  # slots missing: NP must be given
    r = _run(LAUNCHERS / "mpirun.sh", [CONFIG], _env(stubs, HOSTFILE=hostfile, DRY_RUN=1))
    assert r.returncode == 2 and "slots" in r.stderr


# ------------------------------------------------------------------ real process starts (stub trainer)


def _ranks(stdout: str) -> list[str]:
    return sorted(ln for ln in stdout.splitlines() if ln.startswith("RANK="))


@pytest.mark.dist
@pytest.mark.parametrize("script,tool", [("torchrun.sh", "torchrun"), ("mpirun.sh", "mpirun"),
                                         pytest.param("deepspeed.sh", "deepspeed", marks=pytest.mark.slow)])
def test_launcher_starts_two_ranks(script, tool, stubs, stub_train):
    if not (VENV_BIN / tool).exists():
        pytest.skip(f"{tool} is not installed next to {sys.executable}")
    # no GPU (nvidia-smi stub): each launcher defaults to 2 processes; a port of its own (launches run side by side)
    env = _env(stubs, JAGG_TRAIN=stub_train, MASTER_PORT=free_port())
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    r = _run(LAUNCHERS / script, [CONFIG, "train.steps=1", "data.x=a b"], env, timeout=RUN_S)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _ranks(r.stdout)
    assert [ln.split()[0] for ln in lines] == ["RANK=0", "RANK=1"], r.stdout
    assert all("SIZE=2" in ln for ln in lines)
    backend = " parallel.engine=deepspeed" if tool == "deepspeed" else ""
    assert all(ln.endswith(f"ARGS={CONFIG} train.steps=1 data.x=a b{backend}") for ln in lines), lines
    # every rank gets the allocator setting the sbatch sets (expandable segments), unless one is given
    assert sorted(ln for ln in r.stdout.splitlines() if ln.startswith("ALLOC")) == [
        "ALLOC 0=expandable_segments:True", "ALLOC 1=expandable_segments:True"], r.stdout


TINY = ["train.steps=1", "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=8",
        "model.dit.patch_size=2", "sampling.num_steps=4", "train.prompts_per_step=2", "train.minibatch_size=8",
        "sampling.chunk_size=8", "run.checkpoint_every=1", "log.progress=false"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The step the launches train, fitted in one process (train_runs.fit_metrics), once a session."""
    from once import once
    from train_runs import fit_metrics

    return once(tmp_path_factory, "launchers_one_process",
                lambda d: fit_metrics(str(ROOT / CONFIG), TINY, d / "one"))[1][0]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("script,tool,engine", [("torchrun.sh", "torchrun", ["parallel.engine=fsdp2"]),
                                                ("mpirun.sh", "mpirun", ["parallel.engine=fsdp2"]),
                                                ("deepspeed.sh", "deepspeed", [])])
def test_launcher_trains_a_step_with_real_workers(script, tool, engine, stubs, tmp_path, one_process):
    """The real path: each launcher starts two real jagg-train processes (no stub), which find their ranks from the
    launcher's own variables (Open MPI's OMPI_COMM_WORLD_*, DeepSpeed's LOCAL_SIZE), train one step together on the
    rows one process trains (its rewards and gradient norm, within tests/parallel/test_distributed.py's step-0
    tolerances) and save a checkpoint."""
    if not (VENV_BIN / tool).exists():
        pytest.skip(f"{tool} is not installed next to {sys.executable}")
    env = _env(stubs, JAGG_TRAIN=str(VENV_BIN / "jagg-train"), OMP_NUM_THREADS="1", MASTER_PORT=free_port())
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    out = tmp_path / "run"
    r = _run(LAUNCHERS / script, [str(ROOT / CONFIG), *TINY, *engine, f"run.output_dir={out}"], env, timeout=RUN_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0]
    assert rows[0]["reward_mean"] == pytest.approx(one_process["reward_mean"], rel=1e-4)
    assert rows[0]["grad_norm"] == pytest.approx(one_process["grad_norm"], rel=1e-2)
    assert (out / "checkpoints" / "step_00000001" / "COMPLETE").exists()
    ranks = re.findall(r"rank (\d)/2 \(local \d", r.stdout + r.stderr)
    assert sorted(set(ranks)) == ["0", "1"], (r.stdout + r.stderr)[-3000:]
    if tool == "mpirun":  # found through Open MPI's variables (parallel/ranks.py), not a torchrun's
        assert "(local 1, mpi)" in r.stdout + r.stderr


@pytest.mark.dist
def test_torchrun_forwards_usr1_to_the_workers(stubs, tmp_path):
    """SIGUSR1 to the launcher (exec'd into torchrun) reaches every worker; torchrun itself exits 1."""
    if not (VENV_BIN / "torchrun").exists():
        pytest.skip(f"torchrun is not installed next to {sys.executable}")
    worker = _stub(tmp_path / "worker", f"""#!/usr/bin/env bash
trap 'echo "$RANK" > {tmp_path}/got_usr1.$RANK; kill $S; exit 138' USR1
sleep {WAIT_S} & S=$!
touch {tmp_path}/started.$RANK
wait $S
""")
    # SHUTDOWN_TIMEOUT: how long torchrun waits for the workers to exit after forwarding the signal (they exit at
    # once) before it SIGKILLs them: a hang guard here
    env = _env(stubs, JAGG_TRAIN=worker, NPROC_PER_NODE=2, SHUTDOWN_TIMEOUT=WAIT_S, MASTER_PORT=free_port())
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    out, rc = _signal_two_workers("torchrun.sh", env, signal.SIGUSR1, tmp_path)
    assert sorted(f.name for f in tmp_path.glob("got_usr1.*")) == ["got_usr1.0", "got_usr1.1"], out
    assert rc == 1, out


def _signal_two_workers(script: str, env: dict, sig: int, tmp_path: Path) -> tuple[str, int]:
    """Start launchers/SCRIPT on CONFIG, wait until both stub workers have touched tmp_path/started.RANK, send
    `sig` to the launcher and return (its output, its exit code) once it has exited (WAIT_S: a hang guard only)."""
    p = subprocess.Popen(["bash", str(LAUNCHERS / script), CONFIG], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: all((tmp_path / f"started.{r}").exists() for r in (0, 1)), p, "workers did not start")
        p.send_signal(sig)
        out, _ = p.communicate(timeout=WAIT_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return out, p.returncode


@pytest.mark.dist
@pytest.mark.slow  # DeepSpeed's launcher imports for a while
def test_deepspeed_signal_reaches_every_worker_and_the_script_waits_for_their_save(stubs, tmp_path):
    """DeepSpeed forwards no signal on one node (docs/results/signal_matrix.jsonl: the workers were orphaned).
    deepspeed.sh turns SIGTERM into SIGUSR1 to the launch's process group: both workers get it, and the script exits
    (143) only after both have finished their 'checkpoint'."""
    if not (VENV_BIN / "deepspeed").exists():
        pytest.skip(f"deepspeed is not installed next to {sys.executable}")
    worker = _stub(tmp_path / "worker", f"""#!/usr/bin/env bash
trap 'touch {tmp_path}/got_usr1.$RANK; kill $S; sleep 2; touch {tmp_path}/saved.$RANK; exit 138' USR1
trap 'touch {tmp_path}/got_term.$RANK' TERM
sleep {WAIT_S} & S=$!
touch {tmp_path}/started.$RANK
wait $S
""")
    env = _env(stubs, JAGG_TRAIN=worker, MASTER_PORT=free_port())
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    out, rc = _signal_two_workers("deepspeed.sh", env, signal.SIGTERM, tmp_path)
    saved_when_done = sorted(f.name for f in tmp_path.glob("saved.*"))
    assert sorted(f.name for f in tmp_path.glob("got_usr1.*")) == ["got_usr1.0", "got_usr1.1"], out
    assert saved_when_done == ["saved.0", "saved.1"], out  # the script outlived the workers' save
    assert not list(tmp_path.glob("got_term.*")), out  # DeepSpeed's launch.py never got to SIGTERM them
    assert rc == 143 and "sending SIGUSR1" in out, out


# ------------------------------------------------------------------ the documented multi-node examples

DOCS = [ROOT / "docs" / "distributed.md", ROOT / "docs" / "launchers.md", SBATCH]


def _commands(path: Path) -> list[str]:
    """The shell command lines of a file (continuations joined; the sbatch header's '#' stripped)."""
    lines = [ln.removeprefix("#").strip() if path == SBATCH else ln.strip() for ln in path.read_text().splitlines()]
    out, cur = [], ""
    for ln in lines:
        cur += ln
        if ln.endswith("\\"):
            cur = cur[:-1] + " "
        else:
            out.append(cur)
            cur = ""
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_multi_node_lora_examples_use_hsdp_over_the_nodes(path):
    import yaml

    examples = []
    for cmd in _commands(path):
        nodes = re.search(r"(?:--nodes[= ]|NNODES=)(\d+)", cmd)
        config = re.search(r"(configs/\S+\.yaml)", cmd)
        if not (nodes and config and int(nodes[1]) > 1):
            continue
        lora = yaml.safe_load((ROOT / config[1]).read_text()).get("model", {}).get("lora", {}).get("enabled")
        if lora:
            examples.append(cmd)
            assert f"parallel.replicate={nodes[1]}" in cmd.split(), cmd
    assert examples, f"{path.name} shows no multi-node LoRA run"
