#!/usr/bin/env bash
# Start jagg-train under Open MPI's mpirun (ranks from OMPI_COMM_WORLD_*, rendezvous at MASTER_ADDR:MASTER_PORT).
#
#   launchers/mpirun.sh CONFIG [section.key=value ...]
#
# Single node (one rank per visible GPU; 2 on a CPU-only machine):
#   launchers/mpirun.sh configs/tiny_cpu.yaml parallel.engine=fsdp2
# Several nodes: a hostfile with "HOSTNAME slots=N" per line (launchers/hostfile.example); NP defaults to the
# sum of the slots and MASTER_ADDR to the first host:
#   HOSTFILE=launchers/hostfile.example launchers/mpirun.sh CONFIG ...
#
# Environment knobs:
#   NP            number of ranks (default: sum of the hostfile slots; else GPUs reported by nvidia-smi /
#                 CUDA_VISIBLE_DEVICES; else 2, with --oversubscribe so that 2 CPU ranks start on any machine)
#   HOSTFILE      --hostfile ("host slots=N" per line)
#   MASTER_ADDR   address of rank 0's host, exported to every rank (first hostfile host, else 127.0.0.1)
#   MASTER_PORT   exported to every rank (29500)
#   MPI_BIND      --bind-to policy (none: the trainer is multi-threaded; Open MPI's default pins a rank to a core)
#   MPI_EXPORT    more variable names to export with -x (space-separated), e.g. "NCCL_DEBUG HF_HOME"
#   JAGG_TRAIN    the training executable (jagg-train on PATH, else <repo>/.venv/bin/jagg-train)
#   MPIRUN        the mpirun executable (next to JAGG_TRAIN, else on PATH, else <repo>/.venv/bin)
#   MPIRUN_ARGS   extra mpirun options, word-split (e.g. "--oversubscribe" when NP exceeds the cores)
#   DRY_RUN=1     print the command (one line, shell-quoted) instead of running it
#
# Exported to the ranks: MASTER_ADDR, MASTER_PORT, PATH, and LD_LIBRARY_PATH / PYTHONPATH / VIRTUAL_ENV /
# CUDA_VISIBLE_DEVICES / OMP_NUM_THREADS when set here. --allow-run-as-root is added when run as root.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
USAGE_ENV="  env: NP HOSTFILE MASTER_ADDR MASTER_PORT MPI_BIND MPI_EXPORT JAGG_TRAIN MPIRUN MPIRUN_ARGS DRY_RUN
       (see the header of $0)"

# hostfile_first FILE: the first host name (blank lines and comments skipped).
hostfile_first() { awk '{ sub(/#.*/, "") } NF { print $1; exit }' "$1"; }
# hostfile_slots FILE: the sum of the slots=N fields; fails when a host line has none.
hostfile_slots() {
    awk '
        { sub(/#.*/, "") }
        NF { n = 0; for (i = 2; i <= NF; i++) if ($i ~ /^slots=[0-9]+$/) { split($i, a, "="); n = a[2] }
             if (n == 0) { bad = 1 } total += n }
        END { if (bad || total == 0) exit 1; print total }' "$1"
}

parse_config "$@"; shift
find_executables MPIRUN mpirun

if [[ -n "${HOSTFILE:-}" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE=$HOSTFILE is not a file"
    first_host=$(hostfile_first "$HOSTFILE")
    [[ -n "$first_host" ]] || die "HOSTFILE=$HOSTFILE lists no host"
    MASTER_ADDR=${MASTER_ADDR:-$first_host}
    if [[ -z "${NP:-}" ]]; then
        NP=$(hostfile_slots "$HOSTFILE") || die "HOSTFILE=$HOSTFILE: give every host slots=N, or set NP"
    fi
elif [[ -z "${NP:-}" ]]; then
    NP=$(gpu_count)
    [[ "$NP" -gt 0 ]] || { NP=2; CPU_DEFAULT=1; }  # no GPU: 2 CPU ranks, even on a 1-core machine
fi
posint NP "$NP"
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
posint MASTER_PORT "$MASTER_PORT"

cmd=("$MPIRUN" -np "$NP")
[[ -n "${HOSTFILE:-}" ]] && cmd+=(--hostfile "$HOSTFILE")
[[ "$(id -u)" -eq 0 ]] && cmd+=(--allow-run-as-root)
cmd+=(--bind-to "${MPI_BIND:-none}")
[[ -n "${CPU_DEFAULT:-}" ]] && cmd+=(--oversubscribe)
cmd+=(-x "MASTER_ADDR=$MASTER_ADDR" -x "MASTER_PORT=$MASTER_PORT" -x PATH)
for v in LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV CUDA_VISIBLE_DEVICES OMP_NUM_THREADS PYTORCH_CUDA_ALLOC_CONF \
         PYTORCH_ALLOC_CONF ${MPI_EXPORT:-}; do
    [[ -n "${!v+x}" ]] && cmd+=(-x "$v")
done
append_extra_args "${MPIRUN_ARGS:-}"
cmd+=("$JAGG_TRAIN" "$CONFIG" "$@")

run_cmd "${cmd[@]}"
