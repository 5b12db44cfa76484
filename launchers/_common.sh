# shellcheck shell=bash
# The part of launchers/torchrun.sh, deepspeed.sh and mpirun.sh that they share. Sourced, never run.
#
# A launcher, before it calls these functions:
#   set -euo pipefail                                  (the functions are written for it)
#   source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
#   USAGE_ENV="  env: ..."   the environment-knob line(s) of its usage message (printed after "usage: ...")
# and then, typically:
#   parse_config "$@"; shift                   CONFIG=$1 (-h/--help: usage, exit 0; no file: usage, exit 2)
#   find_executables TORCHRUN torchrun         JAGG_TRAIN, and TORCHRUN unless the caller set it
#   cmd=("$TORCHRUN" ...)                      the launcher's own options, in the global array cmd
#   append_extra_args "${TORCHRUN_ARGS:-}"     word-split extra options onto cmd
#   cmd+=(... "$JAGG_TRAIN" "$CONFIG" "$@")
#   run_cmd "${cmd[@]}"                        DRY_RUN: print it, shell-quoted; else exec it
#
# Sourcing defines PROG (the launcher's file name, for messages) and ROOT (the repository root: the
# directory above this file), and the functions below; it reads nothing else from the environment.

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "${0##*/}: source this file from a launcher, do not run it" >&2
    exit 2
fi

PROG=${0##*/}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The CUDA caching allocator with expandable segments (less fragmentation between the rollout's and the joint
# pass's shapes), as slurm/jagg.sbatch sets it, unless the caller chose an allocator setting (either name).
if [[ -z "${PYTORCH_ALLOC_CONF:-}" && -z "${PYTORCH_CUDA_ALLOC_CONF:-}" ]]; then
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi

# usage [CODE]: the usage message (with the launcher's USAGE_ENV) on stderr; exit CODE (2).
usage() {
    cat >&2 <<EOF
usage: $PROG CONFIG [section.key=value ...]
$USAGE_ENV
EOF
    exit "${1:-2}"
}
# die MESSAGE: "PROG: MESSAGE" on stderr; exit 2.
die() { echo "$PROG: $*" >&2; exit 2; }

# parse_config "$@": CONFIG=$1, a file; the caller then shifts it off. -h/--help: usage, exit 0.
parse_config() {
    if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then usage 0; fi
    [[ $# -ge 1 ]] || usage
    CONFIG=$1
    [[ -f "$CONFIG" ]] || { echo "$PROG: config '$CONFIG' is not a file" >&2; usage; }
}

# Shell-quote every argument onto one line (readable back by sh and by Python's shlex.split).
quote_cmd() {
    local out="" a sq="'" esc="'\\''" re='^[A-Za-z0-9_./:=,@%+-]+$'
    for a in "$@"; do
        if [[ $a =~ $re ]]; then out+=" $a"; else out+=" '${a//"$sq"/"$esc"}'"; fi
    done
    printf '%s\n' "${out# }"
}
# dry_run: true when DRY_RUN is set, non-empty and not 0.
dry_run() { [[ -n "${DRY_RUN:-}" && "${DRY_RUN}" != 0 ]]; }
# run_cmd PROGRAM ARGS...: with DRY_RUN print the command (quote_cmd) and exit 0; else exec it
# (exit 127 when PROGRAM is not found).
run_cmd() {
    if dry_run; then quote_cmd "$@"; exit 0; fi
    command -v "$1" >/dev/null 2>&1 || { echo "$PROG: $1: not found" >&2; exit 127; }
    exec "$@"
}

# posint NAME VALUE: die unless VALUE is a positive integer.
posint() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1=$2 must be a positive integer"; }
# gpu_count: the entries of CUDA_VISIBLE_DEVICES when it is set, else the GPUs nvidia-smi -L lists, else 0.
gpu_count() {
    local n=0
    if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
        [[ -n "$CUDA_VISIBLE_DEVICES" ]] && n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
    elif command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    fi
    echo "${n:-0}"
}
# default_nproc: processes per node when none is given: gpu_count, or 2 on a machine without GPUs.
default_nproc() {
    local n
    n=$(gpu_count)
    [[ "$n" -gt 0 ]] || n=2
    echo "$n"
}

# find_jagg_train: $JAGG_TRAIN, else jagg-train on PATH, else <repo>/.venv/bin/jagg-train, else the bare name.
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
# find_executables VAR NAME: set JAGG_TRAIN (find_jagg_train) and, unless VAR is already non-empty,
# VAR to the launcher tool NAME (find_tool NAME "$JAGG_TRAIN"), e.g. find_executables TORCHRUN torchrun.
find_executables() {
    JAGG_TRAIN=$(find_jagg_train)
    if [[ -z "${!1:-}" ]]; then
        local tool
        tool=$(find_tool "$2" "$JAGG_TRAIN")
        printf -v "$1" '%s' "$tool"
    fi
}

# append_extra_args STRING: append STRING, word-split (no globbing), to the array cmd.
append_extra_args() {
    if [[ -n "$1" ]]; then
        local -a extra
        read -r -a extra <<<"$1"
        cmd+=("${extra[@]}")
    fi
}
