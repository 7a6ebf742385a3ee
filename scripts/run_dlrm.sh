#!/usr/bin/env bash
# Set up (if needed) and train the DLRM example on 2 CPU ranks with the SparseLift planner.
# Defaults finish in about 1-2 minutes on 2 CPU cores; extra arguments go to train.py and
# override the defaults (e.g. --planner torchrec, --steps 500, --tables kaggle, --out my.json).
# NPROC=4 bash scripts/run_dlrm.sh runs 4 ranks. The SparseLift plan is cached in .sparselift_cache/:
# a second run with the same tables and batch size reuses it. Add --checkpoint-dir DIR to save
# and resume (rerun the same command after a crash).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DEFAULTS=(--planner sparselift --tables dcnv2 --scale 0.001 --batch-size 256 --steps 200 --warmup-steps 20
          --out runs/dlrm_result.json)
# SparseLift runs use the measured guard (its best 2 plans and TorchRec's, a few steps each; cached)
case " $* " in *" torchrec "*|*"--planner=torchrec"*|*"--measured-guard"*) ;; *) DEFAULTS+=(--measured-guard 2) ;; esac
# Validate flags and table file in one cheap process first (no torch): a clear error, no launcher noise.
.venv/bin/python examples/dlrm/train.py "${DEFAULTS[@]}" "$@" --check
mkdir -p runs
# First run on this machine: fit the hardware profile from real steps of a few probe plans (about a
# minute on 2 cores), stored per machine fingerprint in ~/.cache/torchrec_sparselift/profiles
# (TORCHREC_SPARSELIFT_PROFILE_DIR overrides) with the link its ranks saw; later runs reuse it.
# A stored profile is also checked against the link this run sees (a few seconds under torchrun):
# when it is another network (other hosts, an inter-host term beyond the measured spread, or a
# loopback more than 3x slower or faster: a shaped link) the machine is calibrated again under
# this link; smaller loopback swings follow the machine's load and are not a difference.
# Skipped for --planner torchrec or an explicit --hardware.
CALIBRATE=1
for a in "$@"; do
    case "$a" in --hardware|--hardware=*|torchrec|--check) CALIBRATE=0 ;; esac
done
if [ "$CALIBRATE" = 1 ]; then
    RECALIBRATE=0
    if ! NPROC="$NPROC" .venv/bin/python -m torchrec_sparselift calibrate check; then
        RECALIBRATE=1
    elif [ "$NPROC" -gt 1 ] && ! .venv/bin/torchrun --standalone --nproc_per_node "$NPROC" \
            -m torchrec_sparselift calibrate check --link 2>/dev/null; then
        echo "[dlrm] the link this run sees differs from the one the stored profile was calibrated on"
        RECALIBRATE=1
    fi
    if [ "$RECALIBRATE" = 1 ]; then
        echo "[dlrm] calibrating this machine from real steps first (bounded, ~1-2 min)"
        .venv/bin/torchrun --standalone --nproc_per_node "$NPROC" -m torchrec_sparselift calibrate steps
    fi
fi
exec .venv/bin/torchrun --standalone --nproc_per_node "$NPROC" examples/dlrm/train.py "${DEFAULTS[@]}" "$@"
