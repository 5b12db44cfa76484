#!/usr/bin/env bash
# Start jagg-train under torchrun, on one node or on several.
#
#   launchers/torchrun.sh CONFIG [section.key=value ...]
#
# Single node (default: one worker per visible GPU, 2 workers on a CPU-only machine):
#   launchers/torchrun.sh configs/tiny_cpu.yaml parallel.engine=fsdp2
# Multi-node, c10d rendezvous (run the same line on every node; the rendezvous assigns node ranks):
#   NNODES=2 MASTER_ADDR=node01 MASTER_PORT=29500 JOB_ID=exp1 launchers/torchrun.sh CONFIG ...
#
# Environment knobs:
#   NNODES            number of nodes (1)
#   NPROC_PER_NODE    workers per node (GPUs reported by nvidia-smi / CUDA_VISIBLE_DEVICES; 2 without GPUs)
#   RDZV              standalone (default when NNODES=1) | c10d (default when NNODES>1) | static
#   MASTER_ADDR       rendezvous host: required when NNODES>1 (c10d and static)
#   MASTER_PORT       rendezvous port (29500)
#   JOB_ID            c10d rendezvous id, identical on every node (${SLURM_JOB_ID:-jagg})
#   NODE_RANK         this node's rank, only for RDZV=static (required there when NNODES>1)
#   SHUTDOWN_TIMEOUT  seconds torchrun waits for workers after forwarding a signal, before SIGKILL (240);
#                     must cover a preemption checkpoint
#   JAGG_TRAIN        the training executable (jagg-train on PATH, else <repo>/.venv/bin/jagg-train)
#   TORCHRUN          the torchrun executable (next to JAGG_TRAIN, else on PATH, else <repo>/.venv/bin)
#   TORCHRUN_ARGS     extra torchrun options, word-split (e.g. "--max-restarts 3 --log-dir logs/tr")
#   DRY_RUN=1         print the command (one line, shell-quoted) instead of running it
#
# torchrun forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 to the workers (the trainer saves a
# checkpoint on SIGTERM/SIGUSR1) and runs the console script directly (--no-python).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
USAGE_ENV="  env: NNODES NPROC_PER_NODE RDZV MASTER_ADDR MASTER_PORT JOB_ID NODE_RANK SHUTDOWN_TIMEOUT
       JAGG_TRAIN TORCHRUN TORCHRUN_ARGS DRY_RUN  (see the header of $0)"

parse_config "$@"; shift

NNODES=${NNODES:-1}
posint NNODES "$NNODES"
NPROC_PER_NODE=${NPROC_PER_NODE:-$(default_nproc)}
posint NPROC_PER_NODE "$NPROC_PER_NODE"
MASTER_PORT=${MASTER_PORT:-29500}
posint MASTER_PORT "$MASTER_PORT"
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-240}
posint SHUTDOWN_TIMEOUT "$SHUTDOWN_TIMEOUT"
if [[ -z "${RDZV:-}" ]]; then
    if [[ "$NNODES" -eq 1 ]]; then RDZV=standalone; else RDZV=c10d; fi
fi

find_executables TORCHRUN torchrun

cmd=("$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE")
case "$RDZV" in
    standalone)
        [[ "$NNODES" -eq 1 ]] || die "RDZV=standalone needs NNODES=1 (got $NNODES)"
        cmd+=(--standalone)
        ;;
    c10d)
        if [[ "$NNODES" -gt 1 ]]; then
            [[ -n "${MASTER_ADDR:-}" ]] || die "NNODES=$NNODES needs MASTER_ADDR (the rendezvous host)"
        fi
        cmd+=(--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:$MASTER_PORT"
              --rdzv-id "${JOB_ID:-${SLURM_JOB_ID:-jagg}}")
        ;;
    static)
        if [[ "$NNODES" -gt 1 ]]; then
            [[ -n "${MASTER_ADDR:-}" ]] || die "NNODES=$NNODES needs MASTER_ADDR (node 0's address)"
            [[ -n "${NODE_RANK:-}" ]] || die "RDZV=static with NNODES=$NNODES needs NODE_RANK"
        fi
        NODE_RANK=${NODE_RANK:-0}
        [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] || die "NODE_RANK=$NODE_RANK must be in [0, $NNODES)"
        cmd+=(--node-rank "$NODE_RANK" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "$MASTER_PORT")
        ;;
    *) die "RDZV=$RDZV: expected standalone, c10d or static" ;;
esac
cmd+=(--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$SHUTDOWN_TIMEOUT")
append_extra_args "${TORCHRUN_ARGS:-}"
cmd+=(--no-python "$JAGG_TRAIN" "$CONFIG" "$@")

run_cmd "${cmd[@]}"
