#!/usr/bin/env bash
# The device check (tools/gpu_check.py): one prepared run, <= 8 min on one H100/H200. Results: $OUT/gpu_check.json
# (or ./gpu_check_out/) and a summary at the end of the output; keep the json as docs/results/gpu_check.json
# (its runs list) and re-render docs/benchmarks.md with `python -m tools.bench --from-json`.
#
#   bash tools/gpu_check.sh [gpu_check.py options]        e.g. --sections env,window --widths 4,8
#
# On a machine without this project's packages: wheels in .whl/ (diffusers and its missing needs, fetched with
# `pip download --no-deps ... -d .whl`) are installed into /tmp/gpu_check_site first; nothing else is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import diffusers" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl
        export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "gpu_check: diffusers is not importable and .whl/ holds no wheels to install" >&2
        exit 2
    fi
fi
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv || true
exec "$PY" -m tools.gpu_check --out "${OUT:-gpu_check_out}" "$@"
