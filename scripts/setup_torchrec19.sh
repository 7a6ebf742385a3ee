#!/usr/bin/env bash
# Create a SEPARATE venv with TorchRec 1.9.2 (fbgemm-gpu-cpu 1.9.0 needs torch 2.14): the suite runs
# against it from the source tree (PYTHONPATH), the default .venv (TorchRec 1.8.0) is not touched.
#   VENV19=/tmp/venv19 bash scripts/setup_torchrec19.sh      (default /tmp/venv19)
# PyPI has no CPU-only build of torch 2.14, so this installs torch==2.14.1's default (CUDA) wheel
# and its CUDA libraries (about 5.7 GB in the venv); it runs on the CPU. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV19=${VENV19:-/tmp/venv19}
if [ ! -x "$VENV19/bin/python" ]; then
  "$PY" -m venv "$VENV19"
fi
VPY="$VENV19/bin/python"
if ! "$VPY" -c "import torchrec, fbgemm_gpu, scipy, attrs, hypothesis, pytest" >/dev/null 2>&1; then
  echo "[setup19] installing torch 2.14.1, fbgemm-gpu-cpu 1.9.0, torchrec 1.9.2 into $VENV19"
  "$VPY" -m pip install -q --disable-pip-version-check torch==2.14.1
  # torchrec declares the CUDA fbgemm-gpu; the CPU build is its real dependency here
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps fbgemm-gpu-cpu==1.9.0 torchrec==1.9.2
  "$VPY" -m pip install -q --disable-pip-version-check tensordict torchmetrics==1.0.3 tqdm \
    pyre-extensions iopath "scipy>=1.11" "attrs>=23.1" numpy "pytest>=8" "hypothesis>=6.100" matplotlib
fi
"$VPY" -c "import torch, torchrec; print(f'[setup19] ok: torch {torch.__version__}, torchrec {torchrec.__version__}')"
