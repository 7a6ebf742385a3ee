#!/usr/bin/env bash
# SparseLift vs TorchRec's EmbeddingShardingPlanner, side by side.
# Usage: bash scripts/bench_planners.sh [small|large|all|SCENARIOS] [extra args]
#   small: DLRM-DCNv2 on 8/16/64/128 GPUs + Criteo Kaggle on 8 (about 5-10 minutes on 2 cores)
#   large: production-like 200x64, 856x128, 2000x512, 2000x1024 (TorchRec capped by
#          --torchrec-timeout, default 600 s each) + 5000x1024 SparseLift only
# Results: a printed table, PASS/MISS target lines, and runs/bench_planners_<set>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
SET=${1:-small}
shift || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p runs
exec .venv/bin/python -m benchmarks.planners --scenarios "$SET" \
    --out "runs/bench_planners_${SET//[^a-zA-Z0-9@_-]/_}.json" "$@"
