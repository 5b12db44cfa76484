"""The launchers (launchers/*.sh) and the Slurm template (slurm/jagg.sbatch).

Most checks render the command with DRY_RUN=1 and parse it with shlex; Slurm's scontrol/srun and nvidia-smi
are stub scripts on PATH. The trap path of the sbatch template runs for real against a stub srun, and each
launcher starts two processes of a stub trainer once, to check the ranks it gets, and two real jagg-train workers
that train a step together (the real path: DeepSpeed's launcher broke there while its stub tests passed).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hang_guard import POLL_S, RUN_S, WAIT_S

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ROOT / "launchers"
SBATCH = ROOT / "slurm" / "jagg.sbatch"
SCRIPTS = [LAUNCHERS / "torchrun.sh", LAUNCHERS / "deepspeed.sh", LAUNCHERS / "mpirun.sh", SBATCH]
CONFIG = "configs/tiny_cpu.yaml"
VENV_BIN = Path(sys.executable).parent

# Everything the scripts read from the environment: cleared so the host's settings cannot leak in.
KNOBS = {
    "NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV", "JOB_ID", "SHUTDOWN_TIMEOUT",
    "JAGG_TRAIN", "TORCHRUN", "TORCHRUN_ARGS", "DRY_RUN", "HOSTFILE", "NUM_NODES", "NUM_GPUS", "DS_LAUNCHER",
    "DEEPSPEED", "DEEPSPEED_ARGS", "NP", "MPI_BIND", "MPI_EXPORT", "MPIRUN", "MPIRUN_ARGS", "GPUS", "OUTPUT_DIR",
    "RESUME", "MAX_REQUEUES", "PYTHON", "SRUN_ARGS", "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "REPLICATE", "COLLECTIVE_TIMEOUT", "RESTARTS", "MAX_RESTARTS", "JAGG_FAILED_FILE", "USR1_LEAD", "PREEMPT_CHECK",
}
# The NCCL / torch settings jagg.sbatch exports (and older names it reads): cleared the same way.
NCCL_SETTINGS = {
    "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "PYTORCH_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
}

STUB_TRAIN = """#!/usr/bin/env bash
echo "ALLOC ${RANK:-${OMPI_COMM_WORLD_RANK:-}}=${PYTORCH_CUDA_ALLOC_CONF:-unset}"
echo "RANK=${RANK:-${OMPI_COMM_WORLD_RANK:-}} SIZE=${WORLD_SIZE:-${OMPI_COMM_WORLD_SIZE:-}} \
MASTER=${MASTER_ADDR:-}:${MASTER_PORT:-} ARGS=$*"
"""

NVIDIA_SMI = """#!/usr/bin/env bash
n=${STUB_GPUS:-0}
[ "$n" -gt 0 ] || { echo "NVIDIA-SMI has failed" >&2; exit 9; }
for ((i = 0; i < n; i++)); do echo "GPU $i: Stub GPU (UUID: GPU-$i)"; done
"""

SCONTROL = """#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then printf 'node01\\nnode02\\n'; exit 0; fi
echo "$*" >> "$STUB_LOG"
if [ "$1 $2" = "show job" ]; then echo "JobId=$3 JobName=jagg JobState=${STUB_JOBSTATE:-RUNNING} Reason=None"; fi
exit 0
"""

# srun stub: logs its argv; STUB_MODE picks what the "trainer" does. In wait mode it "trains" until a signal, then
# "saves a checkpoint" until the test creates $STUB_SAVED (both bounded by a hang guard of 600 s = WAIT_S).
SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$STUB_LOG"
on_sig() {
    echo "srun got $1" >> "$STUB_LOG"
    touch "$OUTPUT_DIR/PREEMPTED"
    for ((i = 0; i < 12000; i++)); do [ -n "${STUB_SAVED:-}" ] && [ ! -e "$STUB_SAVED" ] || break; sleep 0.05; done
    kill "$S" 2>/dev/null
    exit 1                            # what torchrun returns after forwarding a signal
}
case "${STUB_MODE:-}" in
    preempt) touch "$OUTPUT_DIR/PREEMPTED"; exit 138 ;;
    env) env > "$OUTPUT_DIR/srun.env"; exit 0 ;;
    exitcode) exit "$STUB_RC" ;;
    fail) echo "jagg-train exit 2: config key 'x' is bad" > "$JAGG_FAILED_FILE"; exit 1 ;;
    wait)
        trap 'on_sig USR1' USR1
        trap 'on_sig TERM' TERM
        sleep 600 & S=$!
        touch "$OUTPUT_DIR/STARTED"
        wait "$S"
        exit 0 ;;
    *) exit 0 ;;
esac
"""


def _stub(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def stubs(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    _stub(d / "nvidia-smi", NVIDIA_SMI)
    _stub(d / "scontrol", SCONTROL)
    _stub(d / "srun", SRUN)
    return d


@pytest.fixture
def stub_train(tmp_path):
    return _stub(tmp_path / "jagg-train-stub", STUB_TRAIN)


def _env(stubs: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in KNOBS | NCCL_SETTINGS and not k.startswith(("SLURM_", "STUB_"))}
    env["PATH"] = f"{stubs}{os.pathsep}{env.get('PATH', '')}"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(script: Path, args, env, *, timeout=WAIT_S) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # a hang guard only (tests/hang_guard.py)


def _wait_for(condition, p: subprocess.Popen, what: str) -> None:
    """Poll until condition() holds; fail if p exits first, or after WAIT_S (a hang guard only)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert p.poll() is None and time.monotonic() < deadline, what
        time.sleep(POLL_S)


def _dry(script: Path, args, env) -> list[str]:
    r = _run(script, args, {**env, "DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    return shlex.split(lines[0])


def _opt(argv: list[str], flag: str) -> str:
    assert flag in argv, (flag, argv)
    return argv[argv.index(flag) + 1]


def _tail(argv: list[str], train: str) -> list[str]:
    """The training executable's arguments: everything after it."""
    assert train in argv, (train, argv)
    return argv[argv.index(train) + 1:]


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
    env = _env(stubs, JAGG_TRAIN=stub_train)  # no GPU (nvidia-smi stub): each launcher defaults to 2 processes
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
        "model.dit.patch_size=2", "sampling.num_steps=4", "train.prompts_per_step=2", "train.batch_size=8",
        "sampling.batch_size=8", "run.checkpoint_every=1", "log.progress=false"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("script,tool,engine", [("torchrun.sh", "torchrun", ["parallel.engine=fsdp2"]),
                                                ("mpirun.sh", "mpirun", ["parallel.engine=fsdp2"]),
                                                ("deepspeed.sh", "deepspeed", [])])
def test_launcher_trains_a_step_with_real_workers(script, tool, engine, stubs, tmp_path):
    """The real path: each launcher starts two real jagg-train processes (no stub), which find their ranks from the
    launcher's own variables (DeepSpeed's LOCAL_SIZE), train one step together and save a checkpoint."""
    if not (VENV_BIN / tool).exists():
        pytest.skip(f"{tool} is not installed next to {sys.executable}")
    env = _env(stubs, JAGG_TRAIN=str(VENV_BIN / "jagg-train"), OMP_NUM_THREADS="1")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    out = tmp_path / "run"
    r = _run(LAUNCHERS / script, [str(ROOT / CONFIG), *TINY, *engine, f"run.output_dir={out}"], env, timeout=RUN_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and '"step": 0' in rows[0]
    assert (out / "checkpoints" / "step_00000001" / "COMPLETE").exists()
    ranks = re.findall(r"rank (\d)/2 \(local \d", r.stdout + r.stderr)
    assert sorted(set(ranks)) == ["0", "1"], (r.stdout + r.stderr)[-3000:]


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
    assert flux == ["parallel.replicate=2"] and "peaks at 56.2 GiB per rank, within 71.3 GiB" in log
    flux, log = replicate_overrides("configs/flux1_dev_hps.yaml", 2, gpus=2)
    assert flux == [] and "flat FSDP over every node" in log


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


def test_sbatch_does_not_requeue_what_the_trainer_says_a_retry_cannot_fix(stubs, tmp_path):
    """The trainer writes JAGG_FAILED_FILE (OUTPUT_DIR/FAILED) on a config error or a diverged run: no requeue."""
    env = _slurm_env(stubs, tmp_path, STUB_MODE="fail")
    r = _run(SBATCH, [CONFIG], env)
    assert r.returncode == 1 and not any(ln.startswith("requeue") for ln in _log(tmp_path)), r.stderr
    assert "a retry cannot help" in r.stderr and "config key 'x' is bad" in r.stderr
    assert not (Path(env["OUTPUT_DIR"]) / "CRASHES").exists()


@pytest.mark.slow
def test_sbatch_estimates_the_preemption_and_refuses_a_lead_too_short(stubs, tmp_path):
    """Deadlines that nest: the step in progress and the checkpoint must fit in torchrun's SHUTDOWN_TIMEOUT, and
    that in the signal's lead. For sd35m_pickscore (LoRA: a 0.3 GB checkpoint) the defaults do; for FLUX.1-dev's
    full fine-tune on 2 nodes (a 143 GB checkpoint) they do not: refused before srun, naming the values to submit
    with, which then pass."""
    env = _slurm_env(stubs, tmp_path, PREEMPT_CHECK=1, PYTHON=sys.executable, GPUS=8)
    r = _run(SBATCH, ["configs/sd35m_pickscore.yaml"], {**env, "DRY_RUN": "1"}, timeout=RUN_S)
    assert r.returncode == 0, r.stderr
    need = re.search(r"needs SHUTDOWN_TIMEOUT >= (\d+) s \(have 240\), a signal lead >= (\d+) s", r.stderr)
    assert need and int(need.group(1)) < 240 and int(need.group(2)) <= 300, r.stderr
    r = _run(SBATCH, ["configs/flux1_dev_hps.yaml"], env, timeout=RUN_S)
    m = re.search(r"needs SHUTDOWN_TIMEOUT >= (\d+) s and a signal lead >= (\d+) s \(a step ~\d+ s \+ 2 x a ~(\d+) s "
                  r"save of a 143 GB checkpoint", r.stderr)
    assert r.returncode == 2 and m and int(m.group(1)) > 240, r.stderr
    assert f"sbatch --signal=B:USR1@{m.group(2)}" in r.stderr and not _log(tmp_path)  # srun never ran
    env.update(SHUTDOWN_TIMEOUT=m.group(1), USR1_LEAD=m.group(2), DRY_RUN="1")
    assert _run(SBATCH, ["configs/flux1_dev_hps.yaml"], env, timeout=RUN_S).returncode == 0


def test_sbatch_exposes_torchruns_restarts_and_says_its_budget(stubs, tmp_path):
    argv = _dry(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, MAX_RESTARTS=2, DRY_RUN=1))
    assert _opt(argv, "--max-restarts") == "2"
    r = _run(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, DRY_RUN=1))
    assert "requeue budget: 3 crash(es), 50 requeues in all, torchrun --max-restarts 0" in r.stderr
    r = _run(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, DRY_RUN=1, RESTARTS="x"))
    assert r.returncode == 2 and "RESTARTS=x must be a non-negative integer" in r.stderr


def test_sbatch_requeues_on_preemption_exit_code(stubs, tmp_path):
    r = _run(SBATCH, [CONFIG], _slurm_env(stubs, tmp_path, STUB_MODE="exitcode", STUB_RC=143))
    assert "requeue 123" in _log(tmp_path), r.stderr


@pytest.mark.parametrize("extra", [{"STUB_JOBSTATE": "CANCELLED"}, {"SLURM_RESTART_COUNT": 3, "MAX_REQUEUES": 3}],
                         ids=["cancelled", "max-requeues"])
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
    env = _env(stubs, JAGG_TRAIN=worker, NPROC_PER_NODE=2, SHUTDOWN_TIMEOUT=WAIT_S)
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
    """DeepSpeed forwards no signal on one node (docs/signal_matrix.jsonl: the workers were orphaned). deepspeed.sh
    turns SIGTERM into SIGUSR1 to the launch's process group: both workers get it, and the script exits (143) only
    after both have finished their 'checkpoint'."""
    if not (VENV_BIN / "deepspeed").exists():
        pytest.skip(f"deepspeed is not installed next to {sys.executable}")
    worker = _stub(tmp_path / "worker", f"""#!/usr/bin/env bash
trap 'touch {tmp_path}/got_usr1.$RANK; kill $S; sleep 2; touch {tmp_path}/saved.$RANK; exit 138' USR1
trap 'touch {tmp_path}/got_term.$RANK' TERM
sleep {WAIT_S} & S=$!
touch {tmp_path}/started.$RANK
wait $S
""")
    env = _env(stubs, JAGG_TRAIN=worker)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    out, rc = _signal_two_workers("deepspeed.sh", env, signal.SIGTERM, tmp_path)
    saved_when_done = sorted(f.name for f in tmp_path.glob("saved.*"))
    assert sorted(f.name for f in tmp_path.glob("got_usr1.*")) == ["got_usr1.0", "got_usr1.1"], out
    assert saved_when_done == ["saved.0", "saved.1"], out  # the script outlived the workers' save
    assert not list(tmp_path.glob("got_term.*")), out  # DeepSpeed's launch.py never got to SIGTERM them
    assert rc == 143 and "sending SIGUSR1" in out, out


# ------------------------------------------------------------------ the documented multi-node examples

DOCS = [ROOT / "README.md", ROOT / "docs" / "launchers.md", SBATCH]


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
