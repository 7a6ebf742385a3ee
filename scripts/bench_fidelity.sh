#!/usr/bin/env bash
# Fidelity benchmark: DLRM on CPU, 2 gloo ranks, six deliberately different plans;
# measured steady-state step time vs SparseLift's calibrated prediction and TorchRec's estimator.
#   bash scripts/bench_fidelity.sh                 # OUT=runs/fidelity REPS=3 STEPS=60 WARMUP=15
#   SKIP_MEASURE=1 PROFILE=profiles/cpu-2core-gloo-fidelity.json bash scripts/bench_fidelity.sh  # re-report
# Env: OUT, REPS, STEPS, WARMUP, PROFILE (calibrated profile JSON), MODEL (dlrm|dcn), BATCH, SKIP_MEASURE=1
# (report an earlier measurement again), FIT=0 (no refit), FIT_OUT (refitted profile path).
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
  python -m benchmarks.fidelity predict --out "$OUT/plans.pkl" --profile "$PROFILE" --model "$MODEL" --batch-size "$BATCH" \
    2> "$OUT/predict.log"
  echo "load before: $(cat /proc/loadavg)" | tee "$OUT/load.txt"
  timeout 1800 torchrun --standalone --nproc_per_node 2 -m benchmarks.fidelity measure --plans "$OUT/plans.pkl" \
    --reps "$REPS" --steps "$STEPS" --warmup "$WARMUP" --out "$OUT/measured.json" 2> "$OUT/measure.log"
  echo "load after: $(cat /proc/loadavg)" | tee -a "$OUT/load.txt"
fi
SIX=table_wise,row_wise,column_wise,mixed,imbalanced,dp_small
for key in step_ms cpu_step_ms; do
  echo "== $key, all plans (profile $PROFILE)"
  python -m benchmarks.fidelity report --plans "$OUT/plans.pkl" --measured "$OUT/measured.json" \
    --profile "$PROFILE" --key "$key" --out "$OUT/report_${key}.json" 2>> "$OUT/report.log"
  echo "== $key, the six sharded plans"
  python -m benchmarks.fidelity report --plans "$OUT/plans.pkl" --measured "$OUT/measured.json" \
    --profile "$PROFILE" --key "$key" --kinds "$SIX" --out "$OUT/report_${key}_six.json" 2>> "$OUT/report.log" | tail -3
done
echo "== step_ms, minimum over repetitions (interference-free estimate)"
python -m benchmarks.fidelity report --plans "$OUT/plans.pkl" --measured "$OUT/measured.json" \
  --profile "$PROFILE" --key step_ms --stat min --out "$OUT/report_step_ms_min.json" 2>> "$OUT/report.log"
python -m benchmarks.fidelity report --plans "$OUT/plans.pkl" --measured "$OUT/measured.json" \
  --profile "$PROFILE" --key step_ms --stat min --kinds "$SIX" 2>> "$OUT/report.log" | tail -3
echo "== summary"
python -m benchmarks.fidelity summary --plans "$OUT/plans.pkl" --measured "$OUT/measured.json" --profile "$PROFILE" \
  2>> "$OUT/report.log" | tee "$OUT/summary.md"
# hold-out refit (leave-one-out) of the per-table lookup overhead, dense FLOP/s and all-reduce bandwidth
# on the load-robust CPU-time measurement; FIT_OUT receives the profile fitted on all plans
if [ "${FIT:-1}" = 1 ]; then
  echo "== leave-one-out refit on cpu_step_ms"
  python -m benchmarks.fidelity fit --plans "$OUT/plans.pkl" --measured "$OUT/measured.json" --profile "$PROFILE" \
    --key cpu_step_ms --fields lookup_overhead_s,1/dense_flops,1/allreduce_bw --loo \
    --loo-out "$OUT/loo_cpu_step_ms.json" --out "${FIT_OUT:-$OUT/cpu-2core-gloo-fidelity.json}" 2>> "$OUT/report.log"
fi
