#!/usr/bin/env bash
# Start jagg-train under DeepSpeed's launcher (parallel.engine=deepspeed is appended to the overrides).
#
#   launchers/deepspeed.sh CONFIG [section.key=value ...]
#
# Single node (one process per visible GPU; 2 on a CPU-only machine):
#   launchers/deepspeed.sh configs/tiny_cpu.yaml
# Multi-node: list the hosts in a hostfile, one per line as "HOSTNAME slots=N" (N = GPUs on that host;
# see launchers/hostfile.example), and run once, on the first host; DeepSpeed starts the other nodes over
# passwordless ssh (pdsh by default):
#   HOSTFILE=launchers/hostfile.example MASTER_ADDR=node01 launchers/deepspeed.sh CONFIG ...
#
# Environment knobs:
#   HOSTFILE      hostfile ("host slots=N" per line); unset: this machine only
#   NUM_NODES     --num_nodes: use the first N hosts of the hostfile (default: all)
#   NUM_GPUS      --num_gpus: processes per node (default without HOSTFILE: GPUs reported by
#                 nvidia-smi / CUDA_VISIBLE_DEVICES, 2 without GPUs; with HOSTFILE: the slots)
#   MASTER_ADDR   --master_addr (default: DeepSpeed infers it; set it for multi-node)
#   MASTER_PORT   --master_port (29500)
#   DS_LAUNCHER   --launcher for multi-node: pdsh (DeepSpeed's default) | openmpi | mvapich | slurm | ...
#   JAGG_TRAIN    the training executable (jagg-train on PATH, else <repo>/.venv/bin/jagg-train)
#   DEEPSPEED     the deepspeed executable (next to JAGG_TRAIN, else on PATH, else <repo>/.venv/bin)
#   DEEPSPEED_ARGS extra launcher options, word-split (e.g. "--include node01:0,1")
#   DRY_RUN=1     print the command (one line, shell-quoted) instead of running it
#
# The console script runs directly (--no_python) and without DeepSpeed's --local_rank argument
# (--no_local_rank): ranks come from the RANK/LOCAL_RANK/WORLD_SIZE environment DeepSpeed sets.
#
# Signals: DeepSpeed's `deepspeed` process forwards none, and its per-node launch.py kills the workers 30 s after
# a SIGTERM, too soon for a checkpoint of a large model. So this script does not exec the launcher: it runs it in
# a process group of its own and, on the first SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGQUIT, sends SIGUSR1 (the trainer's
# preemption signal: checkpoint, PREEMPTED marker, exit 138) to that whole group. Every local worker gets it
# directly; DeepSpeed's own processes die of it (SIGUSR1's default action) before they can kill anyone. The script
# then waits until every process of the group has exited and exits 128 + the number of the signal it got.
# Later signals are logged, not forwarded. Workers on other hosts (HOSTFILE) are reached through pdsh/ssh only:
# for preemptible multi-node jobs use slurm/jagg.sbatch (torchrun) with parallel.engine=deepspeed.
# Environment for remote nodes: DeepSpeed exports the variables listed in ./.deepspeed_env (NAME=value lines).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
USAGE_ENV="  env: HOSTFILE NUM_NODES NUM_GPUS MASTER_ADDR MASTER_PORT DS_LAUNCHER JAGG_TRAIN DEEPSPEED
       DEEPSPEED_ARGS DRY_RUN  (see the header of $0)"

parse_config "$@"; shift
for o in "$@"; do
    case "$o" in
        parallel.engine=deepspeed) ;;
        parallel.engine=*) die "$o contradicts this launcher (it appends parallel.engine=deepspeed)" ;;
    esac
done

find_executables DEEPSPEED deepspeed
MASTER_PORT=${MASTER_PORT:-29500}
posint MASTER_PORT "$MASTER_PORT"

cmd=("$DEEPSPEED")
if [[ -n "${HOSTFILE:-}" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE=$HOSTFILE is not a file"
    cmd+=(--hostfile "$HOSTFILE")
elif [[ -z "${NUM_GPUS:-}" ]]; then
    NUM_GPUS=$(default_nproc)
fi
if [[ -n "${NUM_NODES:-}" ]]; then posint NUM_NODES "$NUM_NODES"; cmd+=(--num_nodes "$NUM_NODES"); fi
if [[ -n "${NUM_GPUS:-}" ]]; then posint NUM_GPUS "$NUM_GPUS"; cmd+=(--num_gpus "$NUM_GPUS"); fi
[[ -n "${MASTER_ADDR:-}" ]] && cmd+=(--master_addr "$MASTER_ADDR")
cmd+=(--master_port "$MASTER_PORT")
[[ -n "${DS_LAUNCHER:-}" ]] && cmd+=(--launcher "$DS_LAUNCHER")
append_extra_args "${DEEPSPEED_ARGS:-}"
cmd+=(--no_python --no_local_rank "$JAGG_TRAIN" "$CONFIG" "$@" parallel.engine=deepspeed)

if dry_run; then quote_cmd "${cmd[@]}"; exit 0; fi
command -v "${cmd[0]}" >/dev/null 2>&1 || { echo "$PROG: ${cmd[0]}: not found" >&2; exit 127; }

LAUNCH_PID=""
SIGNALLED=""  # the first signal this script got; SIGUSR1 went to the launch's process group for it
on_signal() {
    if [[ -n "$SIGNALLED" ]]; then
        echo "$PROG: got SIG$1 after SIG$SIGNALLED: not forwarded (the workers are checkpointing)" >&2
        return 0
    fi
    SIGNALLED=$1
    if [[ -n "$LAUNCH_PID" ]]; then
        echo "$PROG: got SIG$1: sending SIGUSR1 to the launch's processes (group $LAUNCH_PID): the trainer" \
            "checkpoints and exits" >&2
        kill -s USR1 -- "-$LAUNCH_PID" 2>/dev/null || true
    fi
}
for sig in TERM INT HUP USR1 QUIT; do trap "on_signal $sig" "$sig"; done

set -m  # job control: the launch gets a process group of its own (pgid = its pid), one kill reaches all of it
"${cmd[@]}" &
LAUNCH_PID=$!
set +m
[[ -n "$SIGNALLED" ]] && kill -s USR1 -- "-$LAUNCH_PID" 2>/dev/null  # a signal before the launch started

rc=0
while :; do
    rc=0
    wait "$LAUNCH_PID" || rc=$?
    kill -0 "$LAUNCH_PID" 2>/dev/null || break  # a trapped signal cuts wait short while the launcher still runs
done
if [[ -n "$SIGNALLED" ]]; then
    # the workers outlive DeepSpeed's processes while they checkpoint: the job ends when the last one has
    while kill -0 -- "-$LAUNCH_PID" 2>/dev/null; do sleep 1; done
    exit $((128 + $(kill -l "$SIGNALLED")))
fi
exit "$rc"
