#!/usr/bin/env bash
# GPU checks on NCCL (scripts/gpu_check.py; JSON and logs under $OUT): base, sparse_dist and
# overlap train the same DLRM from the same start, overlap's losses must equal base's; then overlap
# unsplit and batch split in k chunks (CHUNKS, default 2,4,8), every split run's losses and final
# weights must equal the unsplit run's; then sparse_dist unrewritten and with ids on the wire (int32,
# dedup, dedup with the distinct-row lookup: WIRE_RUNS), losses, final weights must equal and the input
# all-to-all bytes shrink. Prints ms/step of each run; exits non-zero if a check fails.
#
# torchrec and fbgemm-gpu: the device image has torch but not these. They must match the device's
# torch (torchrec X.Y pairs with fbgemm-gpu X.Y, built for one torch release and CUDA version: see
# the compatibility table in TorchRec's README). The device machine reaches no package index, so
# the wheels travel with the working tree: on a machine with pip access, in the repository root,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     --index-url https://download.pytorch.org/whl/cu130 fbgemm-gpu==$VERSION
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#     torchrec==$VERSION tensordict iopath portalocker
# (cu130 and $VERSION for the device's torch: `python3 -c "import torch; print(torch.__version__)"`
# there). Carry .whl with the run. The CUDA fbgemm-gpu wheel is large: check it fits the carry limit
# before starting the device. With network access instead, WHEELS="" installs from the index
# (INDEX_URL, default https://download.pytorch.org/whl/cu$CUDA, for fbgemm-gpu; PyPI for torchrec).
#
# Environment: OUT (default out/gpu-check), WHEELS (.whl), WORLD (0: visible GPUs, at most 2),
# STEPS (60 overlap, 50 batch split and wire ids), WARMUP (10), BATCH (2048), CHUNKS (2,4,8),
# WIRE_RUNS (int32,dedup,dedup_unique), EXTRA (more flags for every check).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-out/gpu-check}"
WHEELS="${WHEELS-.whl}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT"

if ! "$PY" -c "import torchrec, fbgemm_gpu" 2>/dev/null; then
  if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || { echo "torchrec/fbgemm_gpu missing and no wheel folder $WHEELS (see the header of $0)" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  else
    CUDA="$("$PY" -c "import torch; print((torch.version.cuda or '').replace('.', ''))")"
    TORCH="$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")"
    echo "installing fbgemm-gpu and torchrec for torch $TORCH, CUDA $CUDA from the package indexes"
    "$PY" -m pip install -q --target /tmp/site --index-url "${INDEX_URL:-https://download.pytorch.org/whl/cu$CUDA}" fbgemm-gpu
    "$PY" -m pip install -q --target /tmp/site --no-deps torchrec tensordict iopath
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, torchrec, fbgemm_gpu; print('torch', torch.__version__, 'torchrec', torchrec.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__)" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/env.txt" || true

status=0
PYTHONUNBUFFERED=1 "$PY" scripts/gpu_check.py overlap --world "${WORLD:-0}" ${STEPS:+--steps "$STEPS"} \
  --warmup "${WARMUP:-10}" --batch "${BATCH:-2048}" --out "$OUT/overlap.json" ${EXTRA:-} 2>&1 | tee "$OUT/overlap.txt" \
  || status=1
PYTHONUNBUFFERED=1 "$PY" scripts/gpu_check.py batch-split --world "${WORLD:-0}" ${STEPS:+--steps "$STEPS"} \
  --warmup "${WARMUP:-10}" --batch "${BATCH:-2048}" --chunks "${CHUNKS:-2,4,8}" --out "$OUT/batch_split.json" \
  ${EXTRA:-} 2>&1 | tee "$OUT/batch_split.txt" || status=1
PYTHONUNBUFFERED=1 "$PY" scripts/gpu_check.py wire-ids --world "${WORLD:-0}" ${STEPS:+--steps "$STEPS"} \
  --warmup "${WARMUP:-10}" --batch "${BATCH:-2048}" --runs "${WIRE_RUNS:-int32,dedup,dedup_unique}" \
  --out "$OUT/wire_ids.json" ${EXTRA:-} 2>&1 | tee "$OUT/wire_ids.txt" || status=1
exit "$status"
