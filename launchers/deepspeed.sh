#!/usr/bin/env bash
# Start jagg-train under DeepSpeed's launcher (parallel.backend=deepspeed is appended to the overrides).
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
# Environment for remote nodes: DeepSpeed exports the variables listed in ./.deepspeed_env (NAME=value lines).
set -euo pipefail

PROG=${0##*/}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    cat >&2 <<USAGE
usage: $PROG CONFIG [section.key=value ...]
  env: HOSTFILE NUM_NODES NUM_GPUS MASTER_ADDR MASTER_PORT DS_LAUNCHER JAGG_TRAIN DEEPSPEED
       DEEPSPEED_ARGS DRY_RUN  (see the header of $0)
USAGE
    exit "${1:-2}"
}
die() { echo "$PROG: $*" >&2; exit 2; }

# Shell-quote every argument onto one line (readable back by sh and by Python's shlex.split).
quote_cmd() {
    local out="" a sq="'" esc="'\\''" re='^[A-Za-z0-9_./:=,@%+-]+$'
    for a in "$@"; do
        if [[ $a =~ $re ]]; then out+=" $a"; else out+=" '${a//"$sq"/"$esc"}'"; fi
    done
    printf '%s\n' "${out# }"
}
dry_run() { [[ -n "${DRY_RUN:-}" && "${DRY_RUN}" != 0 ]]; }
run_cmd() {
    if dry_run; then quote_cmd "$@"; exit 0; fi
    command -v "$1" >/dev/null 2>&1 || { echo "$PROG: $1: not found" >&2; exit 127; }
    exec "$@"
}
posint() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1=$2 must be a positive integer"; }
gpu_count() {
    local n=0
    if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
        [[ -n "$CUDA_VISIBLE_DEVICES" ]] && n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
    elif command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    fi
    echo "${n:-0}"
}
find_jagg_train() {
    if [[ -n "${JAGG_TRAIN:-}" ]]; then echo "$JAGG_TRAIN"
    elif command -v jagg-train >/dev/null 2>&1; then command -v jagg-train
    elif [[ -x "$ROOT/.venv/bin/jagg-train" ]]; then echo "$ROOT/.venv/bin/jagg-train"
    else echo jagg-train; fi
}
# find_tool NAME TRAIN: the tool next to the training executable (same venv), else PATH, else <repo>/.venv/bin.
find_tool() {
    local dir
    dir=$(dirname "$2")
    if [[ "$2" == */* && -x "$dir/$1" ]]; then echo "$dir/$1"
    elif command -v "$1" >/dev/null 2>&1; then command -v "$1"
    elif [[ -x "$ROOT/.venv/bin/$1" ]]; then echo "$ROOT/.venv/bin/$1"
    else echo "$1"; fi
}

[[ "${1:-}" == -h || "${1:-}" == --help ]] && usage 0
[[ $# -ge 1 ]] || usage
CONFIG=$1; shift
[[ -f "$CONFIG" ]] || { echo "$PROG: config '$CONFIG' is not a file" >&2; usage; }
for o in "$@"; do
    case "$o" in
        parallel.backend=deepspeed) ;;
        parallel.backend=*) die "$o contradicts this launcher (it appends parallel.backend=deepspeed)" ;;
    esac
done

JAGG_TRAIN=$(find_jagg_train)
DEEPSPEED=${DEEPSPEED:-$(find_tool deepspeed "$JAGG_TRAIN")}
MASTER_PORT=${MASTER_PORT:-29500}
posint MASTER_PORT "$MASTER_PORT"

cmd=("$DEEPSPEED")
if [[ -n "${HOSTFILE:-}" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE=$HOSTFILE is not a file"
    cmd+=(--hostfile "$HOSTFILE")
elif [[ -z "${NUM_GPUS:-}" ]]; then
    NUM_GPUS=$(gpu_count)
    [[ "$NUM_GPUS" -gt 0 ]] || NUM_GPUS=2
fi
if [[ -n "${NUM_NODES:-}" ]]; then posint NUM_NODES "$NUM_NODES"; cmd+=(--num_nodes "$NUM_NODES"); fi
if [[ -n "${NUM_GPUS:-}" ]]; then posint NUM_GPUS "$NUM_GPUS"; cmd+=(--num_gpus "$NUM_GPUS"); fi
[[ -n "${MASTER_ADDR:-}" ]] && cmd+=(--master_addr "$MASTER_ADDR")
cmd+=(--master_port "$MASTER_PORT")
[[ -n "${DS_LAUNCHER:-}" ]] && cmd+=(--launcher "$DS_LAUNCHER")
if [[ -n "${DEEPSPEED_ARGS:-}" ]]; then
    read -r -a extra <<<"$DEEPSPEED_ARGS"
    cmd+=("${extra[@]}")
fi
cmd+=(--no_python --no_local_rank "$JAGG_TRAIN" "$CONFIG" "$@" parallel.backend=deepspeed)

run_cmd "${cmd[@]}"
