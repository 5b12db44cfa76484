"""Stub executables and helpers for the launcher tests (tests/cli/test_launchers.py, test_sbatch.py): Slurm's
scontrol/srun and nvidia-smi as stub scripts on PATH, a stub trainer, an environment cleared of the scripts' knobs,
and the runners that render or run a script (WAIT_S / RUN_S: hang guards only)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hang_guard import POLL_S, WAIT_S

ROOT = Path(__file__).resolve().parents[1]
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
    "RESUME", "MAX_REQUEUES", "MAX_STALLED_REQUEUES", "PYTHON", "SRUN_ARGS", "CUDA_VISIBLE_DEVICES", "RANK",
    "WORLD_SIZE", "LOCAL_RANK", "REPLICATE", "COLLECTIVE_TIMEOUT", "RESTARTS", "MAX_RESTARTS", "JAGG_FAILED_FILE",
    "USR1_LEAD", "PREEMPT_CHECK",
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
