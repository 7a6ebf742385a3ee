"""Held-out error of the step fit with and without cost terms, on one saved calibration.

    python -m benchmarks.heldout_terms --measurements PROBES.pkl [--without cold_row_s] [--out R.json]

``PROBES.pkl`` is what ``sparselift calibrate steps --save-measurements PROBES.pkl`` wrote (the
probe plans' measured steps, attributions and host microbenchmarks). For each probe workload in
turn the step fit runs on the *other* workloads' plans and predicts the held-out workload's plans
(leave one workload out), once with every step term and once with the terms of ``--without`` left
out of the model (their profile fields at ``HardwareProfile``'s defaults, as
``fit_probe_plans(exclude=...)``). It prints measured and predicted ms per held-out plan and the
MAPE per held-out workload and over all, both ways. No torch process group: one process, a few
minutes (one fit per workload and term set).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Dict, List, Sequence

from benchmarks.harness import write_report
from torchrec_sparselift.calibration.step_fit import fit_probe_plans
from torchrec_sparselift.calibration.store import base_profile
from torchrec_sparselift.measure.steps import load_measurement_set, probe_pricers


def heldout(measurements: Sequence[Any], host: Any, base: Any, exclude: Sequence[str]) -> List[Dict[str, Any]]:
    """Per measured plan: its workload, kind, measured seconds and the prediction of the profile
    fitted on every other workload's plans (``exclude``: step terms left out)."""
    pricers = probe_pricers(measurements)
    out = []
    for wl in sorted({m.workload for m in measurements}):
        train = [i for i, m in enumerate(measurements) if m.workload != wl]
        fitted, _fit, _recs, _fr = fit_probe_plans([measurements[i] for i in train], [pricers[i] for i in train],
                                                   base, host=host, exclude=tuple(exclude))
        for m, pr in zip(measurements, pricers):
            if m.workload == wl:
                out.append(dict(workload=wl, plan=m.kind, measured_s=m.measured_s, predicted_s=pr(fitted)))
    return out


def _mape(rows: Sequence[Dict[str, Any]]) -> float:
    return sum(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows) / max(1, len(rows))


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measurements", required=True, help="a set `calibrate steps --save-measurements` wrote")
    p.add_argument("--without", default="cold_row_s", help="comma-separated step terms to compare without")
    p.add_argument("--out", help="write every held-out prediction here (JSON)")
    a = p.parse_args(list(argv) or None)
    warnings.filterwarnings("ignore")

    ms, host = load_measurement_set(a.measurements)
    base = base_profile("cpu")
    without = [t for t in a.without.split(",") if t]
    runs = {"all terms": heldout(ms, host, base, ()), f"without {','.join(without)}": heldout(ms, host, base, without)}
    names = list(runs)
    print(f"leave-one-workload-out step fit, {len(ms)} probe plans; measured / predicted ms "
          f"({names[0]} | {names[1]})")
    for a_row, b_row in zip(*runs.values()):
        print(f"  {a_row['workload']:>13}/{a_row['plan']:<14} {a_row['measured_s'] * 1e3:8.1f}  "
              f"{a_row['predicted_s'] * 1e3:8.1f} | {b_row['predicted_s'] * 1e3:8.1f}")
    print("held-out MAPE per workload:")
    for wl in sorted({r["workload"] for r in runs[names[0]]}):
        vals = [_mape([r for r in rows if r["workload"] == wl]) for rows in runs.values()]
        print(f"  {wl:>13}: {vals[0] * 100:5.1f}% | {vals[1] * 100:5.1f}%")
    print(f"  {'all':>13}: {_mape(runs[names[0]]) * 100:5.1f}% | {_mape(runs[names[1]]) * 100:5.1f}%")
    if a.out:
        write_report(a.out, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
