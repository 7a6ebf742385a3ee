"""Real runs decide: SparseLift's plan vs TorchRec's plan and forced plans, measured step time.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.real_runs --out runs/real_runs.json [--quick]

For each workload shape (:data:`WORKLOADS`: DLRM-DCNv2 and Criteo Kaggle scaled, many small tables,
a few hot skewed tables, a few large tables, tables shared by several features) it makes these plans:
all table-wise, all row-wise, all data-parallel (only where the replicas fit, see
:data:`DP_MAX_BYTES`), column-wise for the big tables (the rest table-wise), mixed (largest table
row-wise, small ones data-parallel), SparseLift's plan (``SparseLiftPlanner``) and TorchRec's plan
(``EmbeddingShardingPlanner``), both given the workload's pooling factors. ``--reps`` rounds run every
plan in turn (interleaved, so machine noise hits all plans alike); each run shards a fresh model (DMP +
fused row-wise AdaGrad + dense AdaGrad + ``TrainPipelineSparseDist``, as the DLRM example trains and as
the step calibration measures its probes) and trains ``--warmup`` untimed and ``--steps`` timed steps
(``--keep-models`` builds each plan's model once and reuses it across rounds instead). A run's time is
the slowest rank's median step; a plan's time is the median (``--stat min``: minimum) over rounds.

Data: each rank's distinct batches (``--batches`` of them, cycled) are built before any timing
(:func:`torchrec_sparselift.measure.probe.prebuilt_batches`), like a DataLoader that prefetches, so
batch generation is not in the timed step.

Predictions: every plan is priced by SparseLift's cost model with this machine's profile fitted from
real steps of the *probe* workloads (:mod:`torchrec_sparselift.measure.steps`; none of the
workloads here). Without a stored profile for this machine the benchmark calibrates first
(``--calibrate`` forces it). The guard's choice is what the measured guard would keep among
SparseLift's plan, its table-wise alternative and TorchRec's plan, judged on round 0 only.

Machine drift: the calibration's reference probe plan (:data:`REFERENCE`) is measured again before
and after each workload; the ratio to its calibration time is printed per workload, with the MAPE of
the predictions scaled by it (``drift-corrected``; the plain MAPE stays the headline number).

Per workload it prints measured ms/step and predicted ms of each plan, TorchRec/SparseLift, SparseLift
vs the best measured plan, MAPE and Spearman across the plans; then the geomean and the held-out
fidelity over all workloads, and writes everything to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import attrs
import torch
import torch.distributed as dist
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from benchmarks.harness import (Cycle, exit_now, geomean, interleaved_rounds, paired_ratio, spread, timed_steps,
                                worker, write_report)
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.calibration.pricer import PlanPricer
from torchrec_sparselift.calibration.records import HostTermRecord
from torchrec_sparselift.calibration.store import ProfileStore, auto_profile, base_profile, current_fingerprint
from torchrec_sparselift.calibration.term_error import profile_errors
from torchrec_sparselift.plan.baseline import term_seconds
from torchrec_sparselift.cost.hardware import get_profile
from torchrec_sparselift.cost.report import mape, spearman
from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.dlrm.tables import preset_tables, scale_tables
from torchrec_sparselift.measure.probe import (DEFAULT_TIMING, ProbeTable, ProbeWorkload, measure_plan,
                                               pooling_constraints, prebuilt_batches, probe_constraints, probe_model,
                                               probe_stats, shard_for_training)
from torchrec_sparselift.measure.steps import (REFERENCE_PLAN, ReferencePlan, calibrate_steps, fit_measurements,
                                               forced_plan)
from torchrec_sparselift.measure.steps import probe_topology as _topology
from torchrec_sparselift.plan import sharding_plan_digest
from torchrec_sparselift.plan.baseline import never_slower
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["WORKLOADS", "QUICK_WORKLOADS", "BATCH_SEED", "plan_kinds_for", "main", "torchrec_plan_of",
           "price_plans", "distinct_plans", "model_parallel_features"]

#: Data-parallel plans only where every table's replica (weights + grad + state) fits this.
DP_MAX_BYTES = 96 * 2**20


def _example_tables(preset: str, scale: float, dim: Optional[int] = None) -> Tuple[ProbeTable, ...]:
    ts = scale_tables(preset_tables(preset, dim), scale)
    return tuple(ProbeTable(t.name, t.rows, t.dim, tuple(t.features), float(t.bag_sizes()[0])) for t in ts)


def _tables(prefix: str, spec: Sequence[Tuple[int, int, int, float]]) -> Tuple[ProbeTable, ...]:
    return tuple(ProbeTable(f"{prefix}{i}", rows, dim, tuple(f"{prefix}{i}_f{j}" for j in range(nf)), pf)
                 for i, (rows, dim, nf, pf) in enumerate(spec))


def _workloads() -> Dict[str, Tuple[ProbeWorkload, float]]:
    """name -> (workload, zipf alpha of its ids)."""
    return {
        "dcnv2": (ProbeWorkload("dcnv2", _example_tables("dcnv2", 0.001), model="dcn", dense=(64,),
                                batch_size=256), 1.05),
        "kaggle": (ProbeWorkload("kaggle", _example_tables("kaggle", 0.002), model="dlrm", dense=(64,),
                                 batch_size=512), 1.05),
        "many_small": (ProbeWorkload("many_small", _tables("ms", [(100 + 53 * i, 32, 1, 1.0) for i in range(60)]),
                                     model="dlrm", dense=(64,), batch_size=256), 1.05),
        "hot_skewed": (ProbeWorkload("hot_skewed", _tables("hs", [(20000 + 5000 * i, 64, 1, 16.0 if i < 4 else 6.0)
                                                                   for i in range(12)]),
                                     model="dlrm", dense=(64,), batch_size=512), 1.3),
        "few_large": (ProbeWorkload("few_large", _tables("fl", [(300000, 64, 1, 2.0), (200000, 64, 1, 1.0),
                                                                 (150000, 64, 1, 4.0), (100000, 64, 1, 1.0)]),
                                    model="dlrm", dense=(64,), batch_size=512), 1.05),
        "shared": (ProbeWorkload("shared", _tables("sh", [(30000, 64, 4, 2.0), (10000, 64, 3, 1.0), (5000, 64, 3, 3.0),
                                                          (2000, 64, 2, 1.0), (800, 64, 2, 1.0), (200, 64, 2, 1.0)]),
                                 model="dcn", dense=(64,), batch_size=512), 1.05),
    }


def model_parallel_features(workload: ProbeWorkload, plan: Any) -> List[str]:
    """The features of ``workload``'s tables that ``plan`` (a ``ShardingPlan``) does not place
    data-parallel: the ones an input all-to-all sends (what a forced dedup deduplicates)."""
    sharding = {t: p.sharding_type for module in plan.plan.values() for t, p in module.items()}
    return [f for t in workload.tables if sharding.get(t.name) != DATA_PARALLEL for f in t.features]


WORKLOADS = tuple(_workloads())
#: Seed of every run's pre-built batches (and of the statistics SparseLift plans and prices with).
BATCH_SEED = 1
QUICK_WORKLOADS = ("many_small", "shared")


def torchrec_plan_of(w: ProbeWorkload, topo, pg) -> Tuple[Any, Dict[str, Any]]:
    """``(plan, constraints)``: TorchRec's ``EmbeddingShardingPlanner`` plan of ``w`` on ``topo``
    (every rank of ``pg`` alike) with the workload's pooling factors as its only constraints
    (``measure.probe.pooling_constraints``), as the benchmarks run TorchRec's default."""
    cons = pooling_constraints(w.tables)
    plan = EmbeddingShardingPlanner(topology=topo, batch_size=w.batch_size, constraints=cons).collective_plan(
        probe_model(w), get_default_sharders(), pg)
    return plan, cons


def plan_kinds_for(w: ProbeWorkload) -> List[str]:
    """The forced plans of ``w`` (data-parallel only where the replicas fit)."""
    kinds = ["table_wise", "row_wise"]
    replica = sum(t.rows * t.dim * 4 * 3 for t in w.tables)
    if replica <= DP_MAX_BYTES:
        kinds.append("data_parallel")
    kinds += ["column_wise_big", "mixed"]
    return kinds


def _plans(w: ProbeWorkload, topo, profile, pg, say, stats=None) -> List[Tuple[str, Any, Dict[str, Any]]]:
    """``(name, plan, constraints)`` of every plan of ``w``; SparseLift plans (and places the forced
    plans) with ``stats`` as its ``workload=``."""
    big = sorted(t.rows for t in w.tables)[-max(1, len(w.tables) // 4)]
    pooling = pooling_constraints(w.tables)
    out = []
    for kind in plan_kinds_for(w):
        if kind == "column_wise_big":
            cons = probe_constraints(w.tables, kind, big_rows=big)
            plan = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, constraints=cons, hardware=profile,
                                     pipelines=["sparse_dist"], debug=False, never_slower=False,
                                     workload=stats).collective_plan(probe_model(w), get_default_sharders(), pg)
        else:
            plan, cons = forced_plan(probe_model(w), w.tables, kind, topo, w.batch_size, pg, profile, stats=stats)
        out.append((kind, plan, cons))
    t0 = time.perf_counter()
    sl = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, constraints=pooling, hardware=profile,
                           workload=stats)
    out.append(("sparselift", sl.collective_plan(probe_model(w), get_default_sharders(), pg), pooling))
    say(f"[real_runs] {w.name}: SparseLift planned in {time.perf_counter() - t0:.1f} s"
        + (f"; {sl.last_result.never_slower.describe()}" if sl.last_result is not None
           and sl.last_result.never_slower is not None else ""))
    # SparseLift's search alone (the never-slower rule off): what the rule compared with TorchRec's
    raw = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, constraints=pooling, hardware=profile,
                            workload=stats, never_slower=False)
    out.append(("sparselift_raw", raw.collective_plan(probe_model(w), get_default_sharders(), pg), pooling))
    out.append(("torchrec", *torchrec_plan_of(w, topo, pg)))
    return out


def distinct_plans(plans: Sequence[Any]) -> List[int]:
    """For each plan, the index of the first plan equal to it (``sharding_plan_digest``): a plan
    that two names share (SparseLift's is often exactly the forced all-table-wise plan, or
    TorchRec's) is one plan, measured once per round; timing it twice only measured the noise
    between a plan and itself (up to ~5% on this machine, docs/benchmarks.md)."""
    first: Dict[str, int] = {}
    return [first.setdefault(sharding_plan_digest(p), i) for i, p in enumerate(plans)]


#: Short names of the sharding types in a plan's summary (``twx26``: 26 tables table-wise).
TYPE_SHORT = {"table_wise": "tw", "table_row_wise": "twrw", "table_column_wise": "twcw", "column_wise": "cw",
              "row_wise": "rw", "data_parallel": "dp", "grid_shard": "gs"}


def _types(plan) -> str:
    c: Dict[str, int] = {}
    for mp in plan.plan.values():
        for ps in mp.values():
            c[ps.sharding_type] = c.get(ps.sharding_type, 0) + 1
    return ",".join(f"{TYPE_SHORT.get(k, k)}{'' if v == 1 else 'x' + str(v)}" for k, v in sorted(c.items()))


def _run_kept(w, runners, batches, pg, device, args, say) -> None:
    """``--keep-models``: every plan's sharded model built once and kept; rounds reuse them."""
    for r in runners:
        torch.manual_seed(0)
        dmp, opt = shard_for_training(probe_model(w), r["plan"], device)
        r["pipe"], r["it"] = TrainPipelineSparseDist(dmp, opt, device, execute_all_batches=True), Cycle(batches)
        for _ in range(args.warmup):
            r["pipe"].progress(r["it"])

    def measure(r, _round):
        timer = timed_steps(lambda: r["pipe"].progress(r["it"]), args.steps, pg, device, warmup=args.warmup)
        r["runs"].append(timer.record(pg, log=False).measured_s)  # the slowest rank's median step

    interleaved_rounds(runners, measure, args.reps, after_round=lambda done: say(
        f"[real_runs] {w.name} round {done}/{args.reps}: "
        + ", ".join(f"{r['name']} {r['runs'][-1] * 1e3:.1f}" for r in runners) + " ms"))
    for r in runners:
        r.pop("pipe"), r.pop("it")
    gc.collect()


#: The machine-speed reference: the calibration's reference plan (it normalizes the probe
#: measurements by it, too). Measured again before and after each workload, it says how much slower
#: or faster the machine runs now than when the profile was fitted (this VM drifts 10-20% within
#: minutes; docs/benchmarks.md section 10).
REFERENCE = REFERENCE_PLAN


def reference_seconds(info: Optional[Dict[str, Any]]) -> Optional[float]:
    """The reference plan's step as the calibration measured it (a stored profile's ``info``)."""
    label = "/".join(REFERENCE)
    for r in ((info or {}).get("fit") or {}).get("residuals", []):
        if r.get("label") == label and r.get("kind", "step") == "step":
            return float(r["measured_s"])
    return None


def price_plans(w: ProbeWorkload, plans: Sequence[Tuple[str, Any, Dict[str, Any]]], topo, profile,
                stats) -> List[Dict[str, Any]]:
    """One runner per plan: its name, plan, predicted step (seconds, ``profile``), summary of
    sharding types, and the never-slower rule's verdict with the plan as the candidate against
    TorchRec's (would the rule leave TorchRec's plan for it?). No timing (pure pricing)."""
    runners = []
    terms = {}
    for name, plan, cons in plans:
        pricer = PlanPricer(probe_model(w), plan, topo, w.batch_size, cons, stats=stats)
        pred = pricer(profile)
        terms[name] = term_seconds(pricer, profile)
        runners.append(dict(name=name, plan=plan, predicted_s=pred, runs=[], types=_types(plan)))
    errors = profile_errors(profile)
    for r in runners:
        d = never_slower(terms[r["name"]], terms["torchrec"], errors)
        r["rule"] = dict(leave=d.leave, gain_ms=d.gain_s * 1e3, margin_ms=d.margin_s * 1e3)
    return runners


def run_workload(w: ProbeWorkload, alpha: float, profile, pg, args, say, ref: Any = None,
                 ref_cal_s: Optional[float] = None) -> Dict[str, Any]:
    rank, W = dist.get_rank(pg), dist.get_world_size(pg)
    topo = _topology(W, "cpu")
    device = torch.device("cpu")
    # the ids' statistics as a user observes them (observe() of rank 0's batches: the same on every rank)
    stats = probe_stats(w, alpha, n=args.batches, seed=BATCH_SEED)
    plans = _plans(w, topo, profile, pg, say, stats)
    batches = prebuilt_batches(w, args.batches, seed=BATCH_SEED, rank=rank, alpha=alpha)
    runners = price_plans(w, plans, topo, profile, stats)
    saved_plans = [(name, plan, cons) for name, plan, cons in plans]
    owner = distinct_plans([r["plan"] for r in runners])
    measured = [r for i, r in enumerate(runners) if owner[i] == i]
    for i, r in enumerate(runners):
        if owner[i] != i:
            r["same_as"] = runners[owner[i]]["name"]
            say(f"[real_runs] {w.name}: {r['name']} is the same plan as {r['same_as']} (measured once)")
    if args.keep_models:
        _run_kept(w, measured, batches, pg, device, args, say)
    else:
        # each run shards a fresh model (as the step calibration's probes and a real job do), so no
        # plan's state or cache warmth carries over; one untimed run first pays the process's one-offs
        measure_plan("warm-up", lambda: probe_model(w), runners[0]["plan"], batches, 2, args.warmup, pg=pg,
                     device=device)
        ref_before = ref.measure().median_s if ref is not None else None

        def measure(r, _round):
            torch.manual_seed(0)
            m = measure_plan(r["name"], lambda: probe_model(w), r["plan"], batches, args.steps, args.warmup,
                             pg=pg, device=device)
            r["runs"].append(m.median_s)

        # after the --reps rounds: more rounds, up to --max-reps, while any plan's rounds still
        # spread more than --tolerance; every plan runs in every round, so all medians and the
        # paired ratios cover the same stretch of the machine's drift (extra rounds for the noisy
        # plans only had a plan measured once in a slow stretch compared with one that was not)
        interleaved_rounds(
            measured, measure, args.reps,
            more=lambda done: done < args.max_reps and any(spread(r["runs"]) > args.tolerance for r in measured),
            after_round=lambda done: say(
                f"[real_runs] {w.name} round {done}/{args.reps}{'+' if done > args.reps else ''}: "
                + ", ".join(f"{r['name']} {r['runs'][-1] * 1e3:.1f}" for r in measured) + " ms"))
    for i, r in enumerate(runners):
        r["runs"] = runners[owner[i]]["runs"]
    drift = None
    if ref is not None and ref_cal_s and not args.keep_models:
        drift = (ref_before + ref.measure().median_s) / 2 / ref_cal_s
        say(f"[real_runs] {w.name}: the reference plan ({'/'.join(REFERENCE)}) ran {drift:.3f}x its calibration time")
    rows = []
    stat = min if args.stat == "min" else statistics.median
    for r in runners:
        rows.append(dict(plan=r["name"], types=r["types"], measured_ms=stat(r["runs"]) * 1e3,
                         spread=spread(r["runs"]),
                         median_ms=statistics.median(r["runs"]) * 1e3, min_ms=min(r["runs"]) * 1e3,
                         runs_ms=[x * 1e3 for x in r["runs"]], predicted_ms=r["predicted_s"] * 1e3,
                         same_as=r.get("same_as"), rule=r["rule"]))
    gc.collect()
    by = {row["plan"]: row for row in rows}
    plan_of = {r["name"]: owner[i] for i, r in enumerate(runners)}
    best = min(rows, key=lambda x: x["measured_ms"])
    ours, theirs = by["sparselift"]["measured_ms"], by["torchrec"]["measured_ms"]
    guard_pool = [p for p in ("sparselift", "table_wise", "torchrec") if p in by]
    guard_pick = min(guard_pool, key=lambda p: by[p]["runs_ms"][0])
    # the model's accuracy over the distinct plans (a plan two names share counts once)
    meas = [row["measured_ms"] for row in rows if not row["same_as"]]
    pred = [row["predicted_ms"] for row in rows if not row["same_as"]]
    paired = paired_ratio(by["torchrec"]["runs_ms"], by["sparselift"]["runs_ms"])
    # each plan as the rule's candidate: TorchRec / plan, paired by round, and whether the rule left TorchRec's
    for row in rows:
        row["torchrec_over_paired"] = paired_ratio(by["torchrec"]["runs_ms"], row["runs_ms"])
    return dict(_plans=saved_plans, workload=w.name, tables=len(w.tables),
                same_plan_as_torchrec=plan_of["sparselift"] == plan_of["torchrec"], features=sum(len(t.features) for t in w.tables),
                batch_size=w.batch_size, alpha=alpha, rows=rows, best=best["plan"],
                torchrec_over_ours=theirs / ours, torchrec_over_ours_paired=paired,
                torchrec_over_raw=theirs / by["sparselift_raw"]["measured_ms"],
                torchrec_over_raw_paired=paired_ratio(by["torchrec"]["runs_ms"], by["sparselift_raw"]["runs_ms"]),
                same_raw_as_torchrec=plan_of["sparselift_raw"] == plan_of["torchrec"],
                ours_over_best=ours / best["measured_ms"],
                best_over_torchrec=theirs / best["measured_ms"],
                guard_pick=guard_pick, guard_torchrec_over=theirs / by[guard_pick]["measured_ms"],
                mape=mape(pred, meas), spearman=spearman(pred, meas), drift=drift,
                mape_drift_corrected=mape([p * drift for p in pred], meas) if drift else None)


def format_workload(res: Dict[str, Any]) -> str:
    lines = [f"\n## {res['workload']} ({res['tables']} tables, {res['features']} features, batch "
             f"{res['batch_size']}/rank, zipf {res['alpha']})",
             f"{'plan':<16}{'types':<18}{'measured ms':>12}{'predicted ms':>14}{'pred/meas':>10}{'vs best':>9}"
             f"{'rounds':>7}{'spread':>8}{'TR/plan':>9}  never-slower rule vs TorchRec's"]
    best = min(r["measured_ms"] for r in res["rows"])
    for r in res["rows"]:
        lines.append(f"{r['plan']:<16}{r['types'][:17]:<18}{r['measured_ms']:>12.2f}{r['predicted_ms']:>14.2f}"
                     f"{r['predicted_ms'] / r['measured_ms']:>10.2f}{r['measured_ms'] / best:>9.3f}"
                     f"{len(r['runs_ms']):>7}{r.get('spread', 0.0) * 100:>7.1f}%"
                     + (f"{r['torchrec_over_paired']:>9.3f}" if "torchrec_over_paired" in r else "")
                     + (f"  {'leaves' if r['rule']['leave'] else 'keeps'} (gain {r['rule']['gain_ms']:.2f} "
                        f"vs margin {r['rule']['margin_ms']:.2f} ms)" if r.get("rule") else "")
                     + (f"  = {r['same_as']} (same plan)" if r.get("same_as") else ""))
    same = " (the same plan)" if res.get("same_plan_as_torchrec") else ""
    paired = res.get("torchrec_over_ours_paired")
    if "torchrec_over_raw" in res:
        lines.append(f"TorchRec/SparseLift without the never-slower rule {res['torchrec_over_raw']:.3f}x "
                     f"(paired by round {res['torchrec_over_raw_paired']:.3f}x)"
                     + (" (the same plan)" if res.get("same_raw_as_torchrec") else ""))
    lines.append(f"TorchRec/SparseLift {res['torchrec_over_ours']:.3f}x{same}"
                 + (f" (paired by round {paired:.3f}x)" if paired else "") + "; "
                 f"SparseLift/best {res['ours_over_best']:.3f}; "
                 f"best plan {res['best']} ({res['best_over_torchrec']:.3f}x over TorchRec); guard keeps "
                 f"{res['guard_pick']} ({res['guard_torchrec_over']:.3f}x over TorchRec); MAPE "
                 f"{res['mape'] * 100:.1f}%, Spearman {res['spearman']:.2f}"
                 + (f"; machine drift since calibration {res['drift']:.2f}x, drift-corrected MAPE "
                    f"{res['mape_drift_corrected'] * 100:.1f}%" if res.get("drift") else ""))
    return "\n".join(lines)


def report(measured_path: str, profile_path: Optional[str], refit: bool = False,
           exclude: Sequence[str] = (), host_terms: Optional[Dict[str, float]] = None) -> int:
    """Re-price a finished run's plans with another profile (no torchrun): per-workload MAPE and
    Spearman, and over all plans. ``refit``: the profile is fitted again, by this code, from the
    probe measurements the run calibrated on (``<measured>.calibration.pkl``), leaving the step
    terms in ``exclude`` out (an ablation, :func:`~torchrec_sparselift.measure.steps.fit_measurements`):
    two code versions or models compared on the same measurements. ``host_terms``: host
    microbenchmark values (:class:`~torchrec_sparselift.calibration.records.HostTermRecord` fields) that
    replace the run's own in that refit, e.g. a newer microbenchmark's (a field the run did not
    measure, such as ``dense_flop_s`` before it existed, adds its floor)."""
    with open(measured_path, encoding="utf-8") as f:
        data = json.load(f)
    with open(measured_path + ".plans.pkl", "rb") as f:
        plans = pickle.load(f)
    if refit:
        with open(measured_path + ".calibration.pkl", "rb") as f:
            cal = pickle.load(f)
        host = dict(cal.get("host_terms") or {})
        if host_terms:
            known = {f.name for f in attrs.fields(HostTermRecord)}
            unknown = sorted(set(host_terms) - known)
            if unknown:
                raise ValueError(f"--host-terms {unknown}: not HostTermRecord fields; choose from {sorted(known)}")
            if not host:
                raise ValueError(f"{measured_path}.calibration.pkl holds no host terms to replace")
            host.update(host_terms)
        profile, fit, _recs, _fr = fit_measurements(cal["measurements"], base_profile("cpu"),
                                                    host=host or None, exclude=exclude)
        print(f"refit from {len(cal['measurements'])} probe plans"
              + (f" without {', '.join(exclude)}" if exclude else "")
              + (f" with host terms {host_terms}" if host_terms else "") + f": probe fit MAPE {fit.mape * 100:.1f}%")
    else:
        profile = get_profile(profile_path) if profile_path else auto_profile("cpu", 2)[0]
    table = _workloads()
    topo = _topology(2, "cpu")
    allp, allm, sps = [], [], []
    for res in data["workloads"]:
        w, alpha = table[res["workload"]]
        stats = probe_stats(w, alpha, n=data.get("settings", {}).get("batches", 8), seed=BATCH_SEED)
        meas = {r["plan"]: r["measured_ms"] for r in res["rows"]}
        entries = plans[res["workload"]]
        names: Dict[int, List[str]] = {}  # first index of each distinct plan -> every name it carries
        for (name, _p, _c), first in zip(entries, distinct_plans([p for _n, p, _c in entries])):
            names.setdefault(first, []).append(name)
        pred, mm, shown = [], [], []
        for i, group in names.items():
            _name, plan, cons = entries[i]
            # a plan two names share is one plan (runs before this rule timed it twice: their median)
            mm.append(statistics.median([meas[n] for n in group]))
            pred.append(PlanPricer(probe_model(w), plan, topo, w.batch_size, cons, stats=stats)(profile) * 1e3)
            shown.append("=".join(group))
        allp += pred
        allm += mm
        sps.append(spearman(pred, mm))
        print(f"{res['workload']:<12} MAPE {mape(pred, mm) * 100:5.1f}%  Spearman {spearman(pred, mm):5.2f}  "
              + " ".join(f"{n}:{p:.0f}/{m:.0f}" for n, p, m in zip(shown, pred, mm)))
    print(f"all {len(allm)} distinct plans: MAPE {mape(allp, allm) * 100:.1f}%  Spearman {spearman(allp, allm):.2f}  "
          f"mean per-workload Spearman {sum(sps) / len(sps):.2f}")
    return 0


def _host_terms_arg(text: str) -> Dict[str, float]:
    """``NAME=SECONDS,...`` -> ``{NAME: SECONDS}``; ValueError naming an item that is not one."""
    out: Dict[str, float] = {}
    for item in (t for t in text.split(",") if t):
        name, _sep, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"{item!r} is not NAME=SECONDS (a number >= 0)")
        out[name.strip()] = seconds
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        rp = argparse.ArgumentParser(description="re-price a finished run's plans with another profile")
        rp.add_argument("--measured", required=True, help="the JSON a run wrote (its .plans.pkl next to it)")
        rp.add_argument("--profile", help="profile JSON (default: this machine's stored step-fitted profile)")
        rp.add_argument("--refit", action="store_true", help="fit the profile again from the run's own probe "
                        "measurements (<measured>.calibration.pkl) with this code")
        rp.add_argument("--without", default="", help="with --refit: comma-separated step terms to leave out of "
                        "the model (e.g. bwd_row_s,reduce_scatter_factor)")
        rp.add_argument("--host-terms", default="", help="with --refit: comma-separated NAME=SECONDS host "
                        "microbenchmark values replacing the run's (e.g. interaction_flop_s=4.3e-11,dense_flop_s=7.4e-12)")
        ra = rp.parse_args(argv[1:])
        if (ra.without or ra.host_terms) and not ra.refit:
            rp.error("--without and --host-terms need --refit")
        try:
            host = _host_terms_arg(ra.host_terms)
        except ValueError as e:
            rp.error(f"--host-terms: {e}")
        return report(ra.measured, ra.profile, ra.refit, [t for t in ra.without.split(",") if t], host)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/real_runs.json")
    p.add_argument("--quick", action="store_true", help=f"smoke test: {', '.join(QUICK_WORKLOADS)}, 1 round, 4 steps")
    p.add_argument("--workloads", help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds (each plan once per round)")
    p.add_argument("--max-reps", type=int, default=6, help="at most this many rounds for a plan whose rounds "
                   "spread more than --tolerance after --reps (extra rounds interleaved among those plans)")
    p.add_argument("--tolerance", type=float, default=0.03, help="round-to-round spread (slowest/fastest - 1) "
                   "above which a plan gets extra rounds")
    p.add_argument("--steps", type=int, help="timed steps per plan per round (default: the harness's, "
                   "measure.probe.DEFAULT_TIMING)")
    p.add_argument("--warmup", type=int, help="untimed steps before each timed run (default: the harness's)")
    p.add_argument("--batches", type=int, default=8, help="distinct pre-built batches per rank (cycled)")
    p.add_argument("--keep-models", action="store_true",
                   help="build every plan's sharded model once and reuse it across rounds (faster; the default "
                   "shards a fresh model per run, as the step calibration measures)")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="a plan's time over its rounds (min: the least-disturbed round, for a shared machine)")
    p.add_argument("--profile", help="price with this profile JSON instead of the machine's step-fitted one")
    p.add_argument("--calibrate", action="store_true", help="fit this machine's profile first even if one is stored")
    args = p.parse_args(argv)
    args.steps = DEFAULT_TIMING["steps"] if args.steps is None else args.steps
    args.warmup = DEFAULT_TIMING["warmup"] if args.warmup is None else args.warmup
    if args.quick:
        args.reps, args.max_reps, args.steps, args.warmup = 1, 1, 4, 2
    names = args.workloads.split(",") if args.workloads else list(QUICK_WORKLOADS if args.quick else WORKLOADS)
    table = _workloads()
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {list(table)}")

    with worker() as me:
        rank, say = me.rank, me.say
        t_start = time.time()
        fp = current_fingerprint("cpu", ranks_per_host(world_size=dist.get_world_size()))
        store = ProfileStore()
        ref_cal_s = None
        if args.profile:
            profile, source = get_profile(args.profile), args.profile
        else:
            found, diff = store.lookup(fp)
            if found is None or diff or args.calibrate:
                say("[real_runs] calibrating this machine from the probe workloads first")
                # the probe measurements are kept next to the JSON, for refitting offline
                profile, fit, _recs, _fit_records = calibrate_steps(
                    dist.group.WORLD, "cpu", progress=rank == 0, store=store,
                    save_measurements=args.out + ".calibration.pkl" if args.out else None)
                source = "calibrated now (probe workloads)"
                ref_cal_s = reference_seconds(dict(fit=fit.to_dict()))
            else:
                profile, source = found.profile, found.path
                ref_cal_s = reference_seconds(found.info)
        say(f"[real_runs] profile {profile.name} from {source}; {len(names)} workloads, {args.reps} rounds x "
            f"({args.warmup}+{args.steps}) steps, {args.batches} pre-built batches per rank; load {os.getloadavg()[0]:.1f}")
        results = []
        all_plans: Dict[str, Any] = {}
        ref = ReferencePlan(dist.group.WORLD, profile) if ref_cal_s else None
        for n in names:
            w, alpha = table[n]
            res = run_workload(w, alpha, profile, dist.group.WORLD, args, say, ref, ref_cal_s)
            all_plans[n] = res.pop("_plans")
            results.append(res)
            say(format_workload(res))
        ratios = [r["torchrec_over_ours"] for r in results]
        distinct = [(r, row) for r in results for row in r["rows"] if not row.get("same_as")]
        all_pred = [row["predicted_ms"] for _r, row in distinct]
        all_meas = [row["measured_ms"] for _r, row in distinct]
        summary = dict(
            geomean_torchrec_over_ours=geomean(ratios),
            geomean_torchrec_over_ours_paired=geomean([r["torchrec_over_ours_paired"] for r in results]),
            geomean_torchrec_over_guard=geomean([r["guard_torchrec_over"] for r in results]),
            geomean_best_over_torchrec=geomean([r["best_over_torchrec"] for r in results]),
            min_torchrec_over_ours=min(ratios),
            geomean_torchrec_over_raw_paired=geomean([r["torchrec_over_raw_paired"] for r in results]),
            min_torchrec_over_raw_paired=min(r["torchrec_over_raw_paired"] for r in results),
            min_torchrec_over_ours_paired=min(r["torchrec_over_ours_paired"] for r in results),
            # every plan as the rule's candidate: how many it left TorchRec's for, and the worst of those measured
            rule_leaves=sum(1 for r in results for row in r["rows"] if row["rule"]["leave"] and row["plan"] != "torchrec"),
            rule_candidates=sum(1 for r in results for row in r["rows"] if row["plan"] != "torchrec"),
            rule_worst_left_for=min([row["torchrec_over_paired"] for r in results for row in r["rows"]
                                     if row["rule"]["leave"] and row["plan"] != "torchrec"], default=None),
            rule_kept_but_faster=sum(1 for r in results for row in r["rows"] if not row["rule"]["leave"]
                                     and row["plan"] != "torchrec" and row["torchrec_over_paired"] > 1.02),
            workloads_ours_ge_098_torchrec=sum(1 for r in results if r["torchrec_over_ours"] >= 0.98),
            workloads_ours_within_2pct_of_best=sum(1 for r in results if r["ours_over_best"] <= 1.02),
            workloads_same_plan_as_torchrec=sum(1 for r in results if r["same_plan_as_torchrec"]),
            max_ours_over_best=max(r["ours_over_best"] for r in results),
            mape_all=mape(all_pred, all_meas),
            mape_all_drift_corrected=mape([row["predicted_ms"] * r["drift"] for r, row in distinct], all_meas) if results and all(r.get("drift") for r in results) else None,
            drift_by_workload={r["workload"]: r.get("drift") for r in results},
            mean_workload_spearman=statistics.fmean([r["spearman"] for r in results if not math.isnan(r["spearman"])])
            if results else float("nan"),
        )
        say(f"\n[real_runs] never-slower rule: TorchRec/SparseLift paired by round, with the rule worst "
            f"{summary['min_torchrec_over_ours_paired']:.3f}x, geomean {summary['geomean_torchrec_over_ours_paired']:.3f}x; "
            f"without it worst {summary['min_torchrec_over_raw_paired']:.3f}x, geomean "
            f"{summary['geomean_torchrec_over_raw_paired']:.3f}x; every plan as the candidate: the rule left "
            f"TorchRec's plan for {summary['rule_leaves']}/{summary['rule_candidates']}"
            + (f" (worst of those TorchRec/plan {summary['rule_worst_left_for']:.3f}x)"
               if summary["rule_worst_left_for"] is not None else "")
            + f", kept it against {summary['rule_kept_but_faster']} plans that measured >2% faster")
        say(f"\n[real_runs] geomean TorchRec/SparseLift {summary['geomean_torchrec_over_ours']:.3f}x "
            f"(worst {summary['min_torchrec_over_ours']:.3f}x; paired by round "
            f"{summary['geomean_torchrec_over_ours_paired']:.3f}x); with the guard's pick "
            f"{summary['geomean_torchrec_over_guard']:.3f}x; best measured plan over TorchRec (headroom) "
            f"{summary['geomean_best_over_torchrec']:.3f}x; SparseLift/best worst {summary['max_ours_over_best']:.3f}; "
            f"SparseLift >= 0.98x TorchRec on {summary['workloads_ours_ge_098_torchrec']}/{len(results)} workloads, "
            f"within 2% of the best on {summary['workloads_ours_within_2pct_of_best']}/{len(results)} (same plan as "
            f"TorchRec on {summary['workloads_same_plan_as_torchrec']}); "
            f"prediction MAPE {summary['mape_all'] * 100:.1f}% over {len(all_meas)} distinct plans, mean Spearman "
            f"{summary['mean_workload_spearman']:.2f} (held out: profile fitted on the probe workloads)"
            + (f"; with the predictions scaled by the machine's drift since calibration (reference plan "
               f"{'/'.join(REFERENCE)} measured before and after each workload: "
               + ", ".join(f"{k} {v:.2f}x" for k, v in summary["drift_by_workload"].items())
               + f") MAPE {summary['mape_all_drift_corrected'] * 100:.1f}%"
               if summary["mape_all_drift_corrected"] is not None else ""))
        if rank == 0:
            out = write_report(args.out, dict(
                started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)), wall_s=time.time() - t_start,
                profile=profile.to_dict(), profile_source=source, fingerprint=fp.to_dict(),
                settings=dict(reps=args.reps, max_reps=args.max_reps, tolerance=args.tolerance, steps=args.steps,
                              warmup=args.warmup, batches=args.batches, quick=args.quick, stat=args.stat),
                load_end=os.getloadavg()[0], workloads=results, summary=summary))
            with open(args.out + ".plans.pkl", "wb") as f:  # for `real_runs.py report` (re-pricing)
                pickle.dump(all_plans, f)
            say(f"[real_runs] wrote {args.out} ({out['wall_s']:.0f} s)")
        dist.barrier()  # rank 0's files are written before any rank leaves
    return 0


if __name__ == "__main__":
    exit_now(main)
