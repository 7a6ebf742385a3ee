#!/usr/bin/env bash
# Calibrate a hardware profile on one GPU and write it, with the raw records, under $OUT.
#
# Needs only torch (with CUDA) and attrs: torchrec and fbgemm_gpu are not required (without
# fbgemm the lookups use torch's embedding_bag + row-wise AdaGrad). When attrs is missing, a copy
# carried in .device/calib_vendor is used (make it with:
#   mkdir -p .device/calib_vendor && cp -r .venv/lib/python3*/site-packages/{attr,attrs} .device/calib_vendor/).
# Single GPU: no collectives (their fields keep the base profile's values).
#
# Environment: OUT (default out/gpu-calibrate), DEVICE (cuda; cpu to test this script),
# BASE (h200), NAME (h200-measured), KERNEL (auto|torch|fbgemm), QUICK=1 for the small sweep,
# BUDGET_S (240: lookup sweep stops starting new tables after 70% of it).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-out/gpu-calibrate}"
DEVICE="${DEVICE:-cuda}"
BASE="${BASE:-h200}"
NAME="${NAME:-h200-measured}"
KERNEL="${KERNEL:-auto}"
BUDGET_S="${BUDGET_S:-240}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT"

if ! "$PY" -c "import attrs" 2>/dev/null; then
  export PYTHONPATH="$PWD/.device/calib_vendor${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== environment"
"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import sys, platform, torch, attrs
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", "SMs", p.multi_processor_count)
    print("matmul allow_tf32", torch.backends.cuda.matmul.allow_tf32)
import torchrec_sparselift.measure.kernels as k  # must import without torchrec / fbgemm
from torchrec_sparselift.measure.microbench import fbgemm_available
print("fbgemm_gpu importable:", fbgemm_available())
try:
    import torchrec  # noqa: F401
    print("torchrec importable: True")
except Exception as exc:
    print("torchrec importable: False", type(exc).__name__)
EOF

SWEEP=()
[ "${QUICK:-0}" = "1" ] && SWEEP=(--quick)

echo "== calibrate ($DEVICE, base $BASE, dense_flops from bf16 matmuls)"
"$PY" -m torchrec_sparselift calibrate kernels ${SWEEP[@]+"${SWEEP[@]}"} --device "$DEVICE" --base "$BASE" \
  --name "$NAME" --kernel "$KERNEL" --dense-dtype bf16 --budget-s "$BUDGET_S" \
  --out "$OUT/$NAME.json" --records "$OUT/$NAME.records.json" 2>&1 | tee "$OUT/calibrate.log"

echo "== refit from the same records with dense_flops from fp32 matmuls"
"$PY" -m torchrec_sparselift calibrate kernels --from-records "$OUT/$NAME.records.json" --base "$BASE" \
  --name "$NAME-fp32" --dense-dtype fp32 \
  --out "$OUT/$NAME-fp32.json" --records "$OUT/$NAME-fp32.records.json" 2>&1 | tee -a "$OUT/calibrate.log"

ls -l "$OUT"
