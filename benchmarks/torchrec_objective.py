"""Search strength under TorchRec's own estimator.

Run (one command, writes JSON)::

    python -m benchmarks.torchrec_objective --out runs/bench_torchrec_objective.json

Per scenario (same inputs as :mod:`benchmarks.planners`: meta-device module, simulated 80 GiB
GPUs, 8 per host, per-rank batch, pooling constraints) three plans are judged by TorchRec's own
estimator (every shard re-estimated with ``EmbeddingPerfEstimator``/``EmbeddingStorageEstimator``,
rated with ``NoopPerfModel``, :func:`torchrec_sparselift.cost.torchrec_score.torchrec_score`):

1. TorchRec's ``EmbeddingShardingPlanner`` (defaults), planned in a child process with a per
   scenario wall limit and cached as JSON in ``--torchrec-cache`` (its plans do not depend on
   SparseLift: reruns reuse them); ``--skip-torchrec`` names scenarios where it is not run
   (reported as skipped);
2. ``SparseLiftPlanner(cost_model="torchrec")``: its rating, lower bound, gap, planning time;
3. ``SparseLiftPlanner()`` (the default SparseLift model), judged the same way.

Then the search-strength targets are printed as PASS/MISS lines. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torchrec

from benchmarks import planners as P  # the planner benchmark: scenarios, inputs, TorchRec runner
from benchmarks.harness import exit_now, write_report
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.search.torchrec_objective import rate_placed

DEFAULT_SCENARIOS = ("dcnv2@8", "dcnv2@16", "dcnv2@64", "dcnv2@128", "kaggle@8", "kaggle@16",
                     "production-856@128", "production-2000@512", "production-200@64")
# TorchRec's planner did not finish these within 300 s in earlier runs (docs/benchmarks.md)
DEFAULT_SKIP = ("production-856@128", "production-2000@512")


def _judge(options: Sequence[Any], topo: Any, sharders: Any, cons: Any, reserved_hbm: float) -> Dict[str, Any]:
    # = cost.torchrec_score.torchrec_score (TorchRec's default estimators + NoopPerfModel), one
    # estimate per distinct shard size (tests/test_torchrec_objective.py checks they agree)
    s = rate_placed(options, topo, sharders, cons)
    return {"torchrec_perf_ms": s["perf_ms"], "torchrec_peak_hbm_bytes": s["peak_hbm_bytes"],
            "fits_reserved_hbm": bool(s["peak_hbm_bytes"] <= reserved_hbm + 1)}


def run_ours(sc: Any, cost_model: str, budget_s: Optional[float]) -> Dict[str, Any]:
    wl, module, topo, batch, cons, sharders = P._inputs(sc, 80.0)
    planner = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                                time_budget_s=budget_s, cost_model=cost_model)
    w0, c0 = time.perf_counter(), time.process_time()
    res = planner.plan_with_result(module, sharders)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    s = res.search
    rec: Dict[str, Any] = {"status": "ok", "plan_wall_s": wall, "plan_cpu_s": cpu,
                           "solver": s.solver, "search_status": s.status,
                           "objective_ms": s.step.total_s * 1e3, "lower_bound_ms": s.lower_bound_s * 1e3,
                           "gap": s.gap, "types": P._type_counts(res.sharding_options)}
    trp = getattr(planner, "last_torchrec_problem", None)
    if cost_model == "torchrec" and trp is not None:
        rec["timings"] = trp.timings
        rec["options"] = len(trp.option_of)
        rec["skipped_options"] = len(trp.skipped)
    reserved = 80.0 * P.GiB * 0.85
    rec.update(_judge(res.sharding_options, topo, sharders, cons, reserved))
    return rec


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def compare(sc: Any, args: argparse.Namespace) -> Dict[str, Any]:
    row: Dict[str, Any] = {"scenario": sc.name}
    for key, cm in (("torchrec_objective", "torchrec"), ("sparselift_model", "sparselift")):
        try:
            row[key] = run_ours(sc, cm, args.budget)
        except Exception as e:  # noqa: BLE001 - a row records the failure and goes on
            row[key] = {"status": "error", "note": f"{type(e).__name__}: {e}"}

    cached = os.path.join(args.torchrec_cache or "", f"{sc.workload}@{sc.world_size}_hbm80_torchrec-{torchrec.__version__}.json")
    if sc.name in args.skip_torchrec:
        row["torchrec"] = {"status": "skipped", "note": "--skip-torchrec"}
    elif args.torchrec_cached_only and not os.path.exists(cached):
        row["torchrec"] = {"status": "skipped", "note": "--torchrec-cached-only and no stored plan"}
    else:
        tr = dict(P.cached_run_torchrec(sc, args.torchrec_timeout, args.torchrec_mem_gib, 80.0,
                                        args.torchrec_cache or None))
        tr.pop("plan", None)
        row["torchrec"] = tr
    tr_ms = row["torchrec"].get("torchrec_perf_ms")
    row["ratios"] = {
        "torchrec_over_ours_torchrec_objective": _ratio(tr_ms, row["torchrec_objective"].get("torchrec_perf_ms")),
        "torchrec_over_ours_sparselift_model": _ratio(tr_ms, row["sparselift_model"].get("torchrec_perf_ms")),
        "planning_wall_torchrec_over_ours": _ratio(row["torchrec"].get("plan_wall_s"),
                                                   row["torchrec_objective"].get("plan_wall_s")),
    }
    return row


def check_targets(rows: Sequence[Dict[str, Any]]) -> List[str]:
    out = []
    rat = {r["scenario"]: r["ratios"]["torchrec_over_ours_torchrec_objective"] for r in rows
           if r["ratios"].get("torchrec_over_ours_torchrec_objective") is not None}
    if rat:
        worse = {k: v for k, v in rat.items() if v < 1 - 1e-9}
        g = math.exp(sum(math.log(v) for v in rat.values()) / len(rat))
        out.append(("PASS" if not worse else "MISS") + " never worse than TorchRec under its estimator: "
                   + ("TorchRec/ours >= 1 on " + ", ".join(f"{k} {v:.3f}x" for k, v in rat.items())
                      if not worse else "worse on " + ", ".join(f"{k} ({v:.3f}x)" for k, v in worse.items())))
        out.append(("PASS" if g >= 1.20 else "MISS") + f" geomean >= 1.20x: {g:.3f}x over {len(rat)} scenarios")
    gaps = [r["torchrec_objective"]["gap"] for r in rows if r["torchrec_objective"].get("status") == "ok"
            and r["torchrec_objective"].get("gap") is not None and math.isfinite(r["torchrec_objective"]["gap"])]
    if gaps:
        med = float(np.median(gaps))
        out.append(("PASS" if med <= 0.02 else "MISS") + f" median gap to bound <= 2%: {med * 100:.2f}% "
                   f"over {len(gaps)} scenarios (max {max(gaps) * 100:.1f}%)")
    for r in rows:
        if r["scenario"] == "production-200@64":
            x = r["ratios"].get("planning_wall_torchrec_over_ours")
            out.append(("PASS" if x is not None and x >= 20 else ("N/A" if x is None else "MISS"))
                       + f" 200x64 planning >= 20x faster: {'-' if x is None else f'{x:.1f}x'} (TorchRec "
                       f"{r['torchrec'].get('plan_wall_s', r['torchrec'].get('status'))} s, ours "
                       f"{r['torchrec_objective'].get('plan_wall_s', float('nan')):.2f} s wall)")
        if r["scenario"] == "production-856@128":
            t = r["torchrec_objective"].get("plan_wall_s")
            out.append(("PASS" if t is not None and t < 10 else "MISS") + f" 856x128 planning < 10 s: "
                       + ("-" if t is None else f"{t:.2f} s wall ({r['torchrec_objective']['plan_cpu_s']:.2f} s CPU)"))
    unfit = [r["scenario"] for r in rows if r["torchrec_objective"].get("fits_reserved_hbm") is False]
    out.append(("PASS" if not unfit else "MISS") + " cost_model='torchrec' plans within the reserved HBM "
               "under TorchRec's storage estimate" + (": over on " + ", ".join(unfit) if unfit else ""))
    skipped = [r["scenario"] for r in rows if r["torchrec"].get("status") in ("skipped", "timeout")]
    if skipped:
        out.append("NOTE TorchRec's planner not compared on: " + ", ".join(
            f"{s} ({next(r['torchrec']['status'] for r in rows if r['scenario'] == s)})" for s in skipped))
    return out


def _f(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    lines = ["| scenario | TorchRec ms | ours (torchrec) ms | ratio | bound ms | gap | ours (sparselift model) ms | ratio | planning s: TorchRec / ours (torchrec) |",
             "|" + "---|" * 9]
    for r in rows:
        tr, a, b, ra = r["torchrec"], r["torchrec_objective"], r["sparselift_model"], r["ratios"]
        trs = _f(tr.get("torchrec_perf_ms")) if tr.get("status") == "ok" else tr.get("status", "-")
        trt = _f(tr.get("plan_wall_s"), ".1f") if tr.get("status") == "ok" else (
            f">{tr['limit_s']:.0f}" if tr.get("status") == "timeout" else "-")
        lines.append(
            f"| {r['scenario']} | {trs} | {_f(a.get('torchrec_perf_ms'))} | {_f(ra.get('torchrec_over_ours_torchrec_objective'), '.3f')}x "
            f"| {_f(a.get('lower_bound_ms'))} | {_f((a.get('gap') or float('nan')) * 100, '.2f')}% "
            f"| {_f(b.get('torchrec_perf_ms'))} | {_f(ra.get('torchrec_over_ours_sparselift_model'), '.3f')}x "
            f"| {trt} / {_f(a.get('plan_wall_s'), '.2f')} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.torchrec_objective", description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS))
    ap.add_argument("--out", default="runs/bench_torchrec_objective.json")
    ap.add_argument("--budget", type=float, default=None, help="SparseLift time budget, s (default: the planner's 8)")
    ap.add_argument("--torchrec-timeout", type=float, default=900.0,
                    help="wall limit for TorchRec's planner per scenario, s (default 900)")
    ap.add_argument("--torchrec-mem-gib", type=float, default=8.0)
    ap.add_argument("--torchrec-cache", default="runs/torchrec_cache",
                    help="directory of TorchRec plans as JSON, reused across runs ('' to re-plan)")
    ap.add_argument("--skip-torchrec", default=",".join(DEFAULT_SKIP),
                    help="comma-separated scenarios where TorchRec's planner is not run "
                         f"(default {','.join(DEFAULT_SKIP)}; '' for none)")
    ap.add_argument("--torchrec-cached-only", action="store_true",
                    help="use stored TorchRec plans only; never run TorchRec's planner")
    ap.add_argument("--report", default=None, help="print the table/targets of a stored --out JSON")
    args = ap.parse_args(argv)
    P._quiet()
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        print(format_table(data["rows"]))
        print("\n".join(check_targets(data["rows"])))
        return 0
    args.skip_torchrec = {s.strip() for s in args.skip_torchrec.split(",") if s.strip()}
    meta = {"command": "python -m benchmarks.torchrec_objective " + " ".join(argv if argv is not None else sys.argv[1:]),
            "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_avg_at_start": os.getloadavg()[0]}
    rows: List[Dict[str, Any]] = []
    for name in (s.strip() for s in args.scenarios.split(",") if s.strip()):
        sc = P.Scenario.parse(name)
        print(f"== {sc.name} ...", flush=True)
        row = compare(sc, args)
        rows.append(row)
        print("  ", json.dumps({k: (v if k != "torchrec" else {kk: vv for kk, vv in v.items() if kk != "types"})
                                for k, v in row.items() if k != "scenario"}, default=float), flush=True)
        if args.out:
            write_report(args.out, {"meta": meta, "rows": rows, "targets": check_targets(rows)})
    print()
    print(format_table(rows))
    print()
    print("\n".join(check_targets(rows)))
    return 0


if __name__ == "__main__":
    exit_now(main)
