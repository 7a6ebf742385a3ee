#!/usr/bin/env bash
# Set up (if needed) and run the default test suite. Extra arguments go to pytest.
# TORCHREC=1.9 runs it against TorchRec 1.9.2 in a separate venv (VENV19, default /tmp/venv19).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${TORCHREC:-1.8}" = "1.9" ]; then
  # TorchRec 1.9.2 in a separate venv (scripts/setup_torchrec19.sh), the source tree on PYTHONPATH
  VENV19=${VENV19:-/tmp/venv19}
  VENV19="$VENV19" bash scripts/setup_torchrec19.sh
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV19/bin/python" -m pytest -q "$@"
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
