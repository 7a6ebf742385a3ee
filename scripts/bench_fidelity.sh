#!/usr/bin/env bash
# Fidelity benchmark (issue 3 item 7): DLRM on CPU, 2 gloo ranks, six deliberately different plans;
# measured steady-state step time vs SparseLift's calibrated prediction and TorchRec's estimator.
#   bash scripts/bench_fidelity.sh                 # OUT=runs/fidelity REPS=3 STEPS=60 WARMUP=15
#   PROFILE=profiles/cpu-2core-gloo-fidelity.json bash scripts/bench_fidelity.sh   # re-report only
# Env: OUT, REPS, STEPS, WARMUP, PROFILE (calibrated profile JSON), MODEL (dlrm|dcn), BATCH, SKIP_MEASURE=1.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
OUT=${OUT:-runs/fidelity}
REPS=${REPS:-3}
STEPS=${STEPS:-60}
WARMUP=${WARMUP:-15}
PROFILE=${PROFILE:-profiles/cpu-2core-gloo.json}
MODEL=${MODEL:-dlrm}
BATCH=${BATCH:-256}
mkdir -p "$OUT"
export PYTHONWARNINGS=ignore
if [ "${SKIP_MEASURE:-0}" != 1 ]; then
  python benchmarks/fidelity.py predict --out "$OUT/plans.pkl" --profile "$PROFILE" --model "$MODEL" --batch-size "$BATCH" \
    2> "$OUT/predict.log"
  echo "load before: $(cat /proc/loadavg)" | tee "$OUT/load.txt"
  timeout 1800 torchrun --standalone --nproc_per_node 2 benchmarks/fidelity.py measure --plans "$OUT/plans.pkl" \
    --reps "$REPS" --steps "$STEPS" --warmup "$WARMUP" --out "$OUT/measured.json" 2> "$OUT/measure.log"
  echo "load after: $(cat /proc/loadavg)" | tee -a "$OUT/load.txt"
fi
for key in step_ms cpu_step_ms; do
  echo "== $key (profile $PROFILE)"
  python benchmarks/fidelity.py report --plans "$OUT/plans.pkl" --measured "$OUT/measured.json" \
    --profile "$PROFILE" --key "$key" --out "$OUT/report_${key}.json" 2>> "$OUT/report.log"
done
