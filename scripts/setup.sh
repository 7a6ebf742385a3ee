#!/usr/bin/env bash
# Create .venv with the CPU working set and install torchrec_sparselift into it (editable).
# Idempotent: a second run only checks that everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torchrec, fbgemm_gpu, scipy, attrs, hypothesis, yaml, torchrec_sparselift" >/dev/null 2>&1; then
  echo "[setup] installing the CPU working set into .venv (torch 2.13.0, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0)"
  "$VPY" -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0
  "$VPY" -m pip install -q --disable-pip-version-check --no-deps -e .
fi
"$VPY" -c "import torch, torchrec, torchrec_sparselift; print(f'[setup] ok: torch {torch.__version__}, torchrec 1.8.0, torchrec_sparselift {torchrec_sparselift.__version__}')"
