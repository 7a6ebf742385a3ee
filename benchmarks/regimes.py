"""SparseLift vs TorchRec over four network regimes: real runs on emulated hosts, one command.

    python -m benchmarks.regimes --out runs/regimes.json                  # all four regimes (needs root)
    python -m benchmarks.regimes --quick --regimes R1,R2 --out runs/q.json   # smoke version (~5 min)

Regimes (:data:`REGIMES`; each one torchrun job on the emulated-host testbed,
:mod:`torchrec_sparselift.measure.testbed`, docs/testbed.md):

    R1  compute-bound: 1 host x 2 ranks, unshaped loopback
    R2  2 one-rank hosts sharing one 1 Gbit/s link
    R3  the same at 300 Mbit/s
    R4  2 hosts x 2 ranks, 1 Gbit/s per host link (2D vs 1D here)

The driver (this script without ``--job``) runs, per regime,
``python -m torchrec_sparselift.measure.testbed <topology> -- -m benchmarks.regimes --job --regime R ...``
(the testbed tears its namespaces down on exit, failure or Ctrl-C), then merges the jobs' JSON into
``--out`` and prints the summary against its targets (:data:`TARGETS`, docs/benchmarks.md section 20).

The job (one rank of one regime): measures the link the job sees
(:func:`torchrec_sparselift.measure.link.measure_link_rates`), gets its profiles (below), then per
workload (:data:`WORKLOADS`, shared with :mod:`benchmarks.real_runs`) builds these runs:

    torchrec            TorchRec's plan (EmbeddingShardingPlanner), its default pipeline sparse_dist
    torchrec_<p>        the same plan with TorchRec's other exact pipelines base, fused, prefetch
                        ("TorchRec's best pipeline" = the fastest measured of the four)
    torchrec_fp16/bf16  the same plan, sparse_dist, fp16 / bf16 qcomm set by hand (a precision whose
                        run fails on gloo is reported as failed and left out)
    sparselift          SparseLiftPlanner (lossless, unguarded) with the regime's profile
    sparselift_unshaped the same with only the unshaped box's profile, link-corrected (--profile-from both)
    sparselift_lossy    SparseLiftPlanner(allow_lossy_comm=True)
    table_wise, dp_small, row_wise   forced alternatives (sparse_dist, fp32)
    <base>_split<k>     rewrites forced (``--rewrites``, default on) on SparseLift's plan and on
    <base>_int32        TorchRec's (``<base>``: sparselift, torchrec): batch split in k = 2, 4, 8
    <base>_dedup        chunks (overlap pipeline, the model declared per-sample), int32 ids on the
                        wire, int32 ids with every feature deduplicated (the base run's pipeline)
    R4 only: sparselift_2d (sharding_group_size=2, the default sync interval) and sparselift_auto
    (sharding_group_size="auto": does the planner pick 2D?)

Every measured run also gets its *communication part*: one steady step's collectives counted on
the run's model and sent again alone on the link (:mod:`benchmarks.harness.replay`). The driver
adds its *compute part*, the unshaped regime's (R1) measured step of the same run (same plan
digest and settings) where R1 ran it, and the *overlap bound* max(compute, communication); a
rewrite run reports the fraction of the gap between its base run's step and that bound which it
closes.
Runs that are the same (plan digest, pipeline, precisions, 2D group, rewrites) are measured once. ``--reps``
interleaved rounds (order rotated each round); each round shards a fresh model of every run (as
the calibration's pipeline factors; ``--keep-models``: one model per run, kept across the rounds)
through :func:`torchrec_sparselift.runtime.lift` (fused row-wise AdaGrad in backward, dense AdaGrad: the
optimizers of the step calibration's probes), ranks pinned, pre-built batches, ``--warmup`` untimed
and ``--steps`` timed steps; a run's time is the slowest rank's median step (a 2D plan's: the
median over whole sync intervals of their mean step, ``--steps`` rounded up to a multiple of its
interval, so the replica sync is in it), a plan's the median over rounds. Every run is priced by SparseLift's cost model (its plan, pipeline and precisions)
under each profile; MAPE and Spearman per regime over the distinct runs.

Profiles (``--profile-from``): ``regime`` calibrates under each regime's own link (step calibration
on the probe workloads, none of the evaluated ones; stored in ``--store``/<regime>, reused while
the stored one is current; ``--calibrate`` forces); ``unshaped`` uses in every regime only the
profile calibrated in R1 (the unshaped box, ``--store``/unshaped), its link terms corrected to the
link measured in the job (``calibration.link.correct_link_terms``, what ``hardware="auto"`` with
``collective_plan(link=...)`` does); ``both`` (default) plans and prices with both.

On R4 it also trains 1D (SparseLift's plan) and 2D (``sharding_group_size=2``, default sync
interval) from the same initial weights on the same batches with a planted signal, and reports
the loss of each (``--parity-steps``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np
import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.planner import Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from benchmarks.harness import (Cycle, exit_now, geomean, interleaved_rounds, names_arg, paired_ratio, start_worker,
                                stop_worker, timed_steps, write_report)
from benchmarks.harness.replay import count_step_collectives, replay_collectives
from benchmarks.harness.report import REPO
from benchmarks.real_runs import BATCH_SEED, DP_MAX_BYTES, WORKLOADS, _workloads, torchrec_plan_of
from benchmarks.real_runs import _types as plan_types
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.calibration.store import (ProfileStore, current_fingerprint, disturbed_spread,
                                                    stored_profile_problems)
from torchrec_sparselift.calibration.term_error import profile_errors, profile_on_link
from torchrec_sparselift.cost.report import mape, spearman
from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.dlrm.tables import feature_names
from torchrec_sparselift.measure.link import measure_link_rates
from torchrec_sparselift.measure.probe import (pin_rank_to_core, prebuilt_batches, probe_model, probe_stats,
                                               restore_affinity)
from torchrec_sparselift.measure.steps import calibrate_steps, forced_plan
from torchrec_sparselift.plan import sharding_plan_digest
from torchrec_sparselift.plan.serialization import sharding_plan_from_dict, sharding_plan_to_dict
from torchrec_sparselift.plan.evaluate import GivenPlan, evaluate_sharding_plan
from torchrec_sparselift.plan.rewrites import price_rewrites
from torchrec_sparselift.runtime import copy_full_state, lift
from torchrec_sparselift.runtime.timing import steady_step_s
from torchrec_sparselift.vocabulary import comm_precision

__all__ = ["REGIMES", "TARGETS", "parse_args", "merge_results", "summarize_workload", "summarize_regime",
           "check_targets", "format_summary", "main"]


# ---------------------------------------------------------------------------------------------
# regimes, runs and targets (pure)
# ---------------------------------------------------------------------------------------------

#: name -> (testbed topology as keyword arguments, kind, one line). ``kind``: "compute" or "network".
REGIMES: Dict[str, Dict[str, Any]] = {
    "R1": dict(hosts=1, ranks_per_host=2, rate=None, shared=False, kind="compute",
               doc="compute-bound: 1 host x 2 ranks, unshaped"),
    "R2": dict(hosts=2, ranks_per_host=1, rate="1gbit", shared=True, kind="network",
               doc="2 ranks sharing one 1 Gbit/s link"),
    "R3": dict(hosts=2, ranks_per_host=1, rate="300mbit", shared=True, kind="network",
               doc="2 ranks sharing one 300 Mbit/s link"),
    "R4": dict(hosts=2, ranks_per_host=2, rate="1gbit", shared=False, kind="network",
               doc="2 hosts x 2 ranks, 1 Gbit/s per host link"),
}
#: --quick's workloads: two small shapes (many small tables; a few large ones).
QUICK_WORKLOADS = ("many_small", "few_large")
#: The regime whose profile is "the unshaped box's" (``--profile-from unshaped``).
UNSHAPED = "R1"

#: TorchRec's exact pipelines that run on CPU; "default" is the one TorchRec's examples train with.
TORCHREC_DEFAULT_PIPELINE = "sparse_dist"
TORCHREC_PIPELINES = ("base", "sparse_dist", "fused", "prefetch")
#: qcomm precisions set by hand on TorchRec's plan (forward = backward).
QCOMM_PRECISIONS = ("fp16", "bf16")
FORCED_KINDS = ("table_wise", "dp_small", "row_wise")
#: The runs the rewrites are forced on (their plan and pipeline), the batch-split chunks forced
#: (``--quick``: only 4) and the wire-id settings: int32 ids; int32 ids with every feature deduplicated.
REWRITE_BASES = ("sparselift", "torchrec")
SPLIT_CHUNKS = (2, 4, 8)
QUICK_SPLIT_CHUNKS = (4,)
WIRE_REWRITES = ("int32", "dedup")


def rewrite_runs(quick: bool = False) -> List[str]:
    """The rewrite runs of one workload, in measuring order: every base's batch splits, then every
    base's wire-id settings (``--quick``: k = 4 and int32 ids only)."""
    chunks = QUICK_SPLIT_CHUNKS if quick else SPLIT_CHUNKS
    wires = WIRE_REWRITES[:1] if quick else WIRE_REWRITES
    return [f"{b}_split{k}" for b in REWRITE_BASES for k in chunks] + [f"{b}_{w}" for b in REWRITE_BASES for w in wires]


def rewrite_of(name: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """(base run, what the rewrite run forces on it) of a rewrite run's name, None for any other run:
    ``batch_split`` (with the overlap pipeline), ``id_dtype`` and ``dedup`` (every feature)."""
    for base in REWRITE_BASES:
        if not name.startswith(base + "_"):
            continue
        tail = name[len(base) + 1:]
        if tail.startswith("split") and tail[5:].isdigit():
            return base, dict(batch_split=int(tail[5:]))
        if tail == "int32":
            return base, dict(id_dtype="int32")
        if tail == "dedup":
            return base, dict(id_dtype="int32", dedup=True)
    return None
#: The A/A control: TorchRec's plan and default pipeline again, a second model measured as a run
#: of its own. Two models of one plan differ in their steady step (measured: up to 35% within one
#: interleaved run, docs/benchmarks.md section 20), so "TorchRec's best pipeline", the fastest of
#: four models, gains from that spread as much as from the pipelines; the control shows how much.
CONTROL_RUN = "torchrec_again"
#: R4's 1D and 2D training steps for the loss comparison (mean loss of the last half). At 80 steps
#: the 2D - 1D gap still moved with the steps (-0.0126..+0.0039; at 320: -0.0017..+0.0011,
#: docs/benchmarks.md section 20).
PARITY_STEPS = 320


def on_gloo(precision: str) -> str:
    """The precision TorchRec runs for ``precision`` on CPU/gloo
    (:data:`~torchrec_sparselift.vocabulary.COMM_PRECISION_REGISTRY`'s ``gloo_runs_as``: 1.8's codec
    registry replaces bf16 by fp16 there in both directions), so a bf16 run on gloo is the fp16
    run and is measured once."""
    return comm_precision(precision).gloo_runs_as or precision


#: Runs that train with lossy communication (not "best plan measured" candidates).
LOSSY_RUNS = ("torchrec_fp16", "torchrec_bf16", "sparselift_lossy")

#: Issue 26's targets: (key in a regime summary, comparison, bound, which regimes, text).
TARGETS: Tuple[Tuple[str, str, float, str, str], ...] = (
    # SparseLift lossless with the sparse-path rewrites, per network regime
    ("geo_torchrec_over_sparselift", ">=", 1.4, "R2", "SparseLift lossless >= 1.4x TorchRec default (geomean)"),
    ("geo_torchrec_best_pipeline_over_sparselift", ">=", 1.3, "R2",
     "SparseLift lossless >= 1.3x TorchRec best pipeline (geomean)"),
    ("geo_torchrec_over_sparselift", ">=", 1.3, "R3", "SparseLift lossless >= 1.3x TorchRec default (geomean)"),
    ("geo_torchrec_best_pipeline_over_sparselift", ">=", 1.2, "R3",
     "SparseLift lossless >= 1.2x TorchRec best pipeline (geomean)"),
    ("geo_torchrec_over_sparselift", ">=", 1.3, "R4", "SparseLift lossless >= 1.3x TorchRec default (geomean)"),
    ("geo_torchrec_best_pipeline_over_sparselift", ">=", 1.2, "R4",
     "SparseLift lossless >= 1.2x TorchRec best pipeline (geomean)"),
    ("geo_sparselift_over_best", "<=", 1.05, "network", "SparseLift lossless within 5% of the best plan measured (geomean)"),
    ("geo_torchrec_over_sparselift_unshaped", ">=", 1.3, "network", "same with the unshaped-only profile: >= 1.3x default"),
    ("geo_torchrec_best_pipeline_over_sparselift_unshaped", ">=", 1.1, "network",
     "same with the unshaped-only profile: >= 1.1x best pipeline"),
    ("geo_sparselift_unshaped_over_best", "<=", 1.05, "network", "same with the unshaped-only profile: within 5% of best"),
    ("geo_torchrec_over_sparselift_auto", ">=", 1.3, "R4",
     "SparseLift with 2D allowed (the planner's 1D/2D choice) >= 1.3x TorchRec default (geomean)"),
    ("geo_torchrec_best_pipeline_over_sparselift_auto", ">=", 1.1, "R4",
     "SparseLift with 2D allowed >= 1.1x TorchRec best pipeline (geomean)"),
    ("geo_sparselift_auto_over_best", "<=", 1.05, "R4", "SparseLift with 2D allowed within 5% of the best plan measured"),
    ("geo_torchrec_qcomm_over_lossy", ">=", 1.0, "all", "SparseLift lossy >= TorchRec with qcomm by hand (geomean)"),
    ("min_torchrec_over_sparselift", ">=", 0.98, "compute", "compute-bound: SparseLift >= 0.98x TorchRec on every workload"),
    ("mape_regime", "<=", 0.15, "all", "prediction MAPE <= 15% (regime profile)"),
    ("mape_unshaped", "<=", 0.15, "all", "prediction MAPE <= 15% (unshaped profile, link-corrected)"),
    ("mape_rewrites_regime", "<=", 0.15, "all", "rewritten plans (forced and chosen): prediction MAPE <= 15% "
     "(regime profile)"),
    ("two_d_decisions_right", "==", 1.0, "R4", "planner picks 2D exactly when 2D measures faster (share of workloads)"),
    ("two_d_loss_gap", "<=", 0.0005, "R4", "2D loss - 1D loss <= 0.0005 (loss parity, docs/benchmarks.md section 11)"),
    ("geo_best_gap_closed", ">=", 0.7, "network", "the best forced rewrite closes >= 70% of the gap to the overlap "
     "bound (geomean over the workloads with a bound)"),
    ("min_best_gap_closed", ">=", 0.5, "network", "... and >= 50% on every network workload with a bound"),
)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line of the driver and of the job (``--job``); ``error`` exits 2 naming the flag."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated subset of {','.join(REGIMES)}")
    p.add_argument("--workloads", help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="smoke version (~5 min for R1,R2): 2 workloads, 1 round, "
                   "2+4 steps, no prefetch run, a short calibration")
    p.add_argument("--reps", type=int, help="interleaved rounds, a fresh model of every run in each (default 4; "
                   "--quick 1)")
    p.add_argument("--steps", type=int, help="timed steps per run (default 6; --quick 4)")
    p.add_argument("--warmup", type=int, help="untimed steps per run (default 2; --quick 2)")
    p.add_argument("--keep-models", action="store_true", help="shard each run's model once per workload and keep "
                   "it across the rounds (faster; a run then measures one model, and two models of one plan differ "
                   "by up to 35%% here: docs/benchmarks.md section 20); default: a fresh model for every run of "
                   "every round")
    p.add_argument("--batches", type=int, default=6, help="distinct pre-built batches per rank (cycled)")
    p.add_argument("--profile-from", choices=["regime", "unshaped", "both"], default="both",
                   help="regime: each regime's own calibrated profile; unshaped: only R1's, link-corrected; both")
    p.add_argument("--store", default=os.path.join(os.path.expanduser("~"), ".cache", "torchrec_sparselift", "regimes"),
                   help="profile stores, one folder per regime (calibrated when missing or out of date)")
    p.add_argument("--calibrate", action="store_true", help="calibrate again even where a current profile is stored")
    p.add_argument("--calibration-steps", type=int, help="timed steps per probe plan of a calibration "
                   "(default 10; --quick 6)")
    p.add_argument("--parity-steps", type=int, help="R4: 1D and 2D training steps for the loss comparison "
                   f"(default {PARITY_STEPS}; --quick 20)")
    p.add_argument("--rewrites", action=argparse.BooleanOptionalAction, default=True,
                   help="also force the sparse-path rewrites (batch split k = 2, 4, 8; int32 ids; dedup) on "
                        "SparseLift's and TorchRec's plans (--no-rewrites: leave them out)")
    p.add_argument("--comm-part", action=argparse.BooleanOptionalAction, default=True,
                   help="measure every run's communication part (its collectives replayed alone on the link)")
    p.add_argument("--out", default="runs/regimes.json", help="merged JSON (driver) or this regime's JSON (--job)")
    p.add_argument("--burst", help="the testbed links' token-bucket depth (tc's units, e.g. 128kb; default: the "
                   "testbed's, see docs/testbed.md)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per regime before its job is killed")
    p.add_argument("--job", action="store_true", help="run as one rank of one regime's torchrun job (the driver does)")
    p.add_argument("--regime", help="with --job: which regime this job is")
    p.add_argument("--replay", help="with --job: measure only the runs of this file (the driver's: network regimes' "
                   "runs to time unshaped for their compute part)")
    args = p.parse_args(argv)
    args.regimes = names_arg(p, "--regimes", args.regimes, REGIMES)
    if args.workloads:
        args.workloads = names_arg(p, "--workloads", args.workloads, WORKLOADS)
    else:
        args.workloads = list(QUICK_WORKLOADS if args.quick else WORKLOADS)
    q = args.quick
    args.reps = args.reps if args.reps is not None else (1 if q else 4)
    args.steps = args.steps if args.steps is not None else (4 if q else 6)
    args.warmup = args.warmup if args.warmup is not None else 2
    args.parity_steps = args.parity_steps if args.parity_steps is not None else (20 if q else PARITY_STEPS)
    args.calibration_steps = args.calibration_steps if args.calibration_steps is not None else (6 if q else 10)
    for name in ("reps", "steps", "batches", "parity_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.job and args.regime not in REGIMES:
        p.error(f"--job needs --regime, one of {','.join(REGIMES)}")
    if (not args.job and args.profile_from != "regime" and UNSHAPED not in args.regimes
            and not os.path.isdir(os.path.join(args.store, "unshaped"))):
        p.error(f"--profile-from {args.profile_from} needs the unshaped box's profile: include {UNSHAPED} in --regimes "
                f"(it calibrates into {os.path.join(args.store, 'unshaped')}) or use --profile-from regime")
    return args


def dp_small_fits(tables: Sequence[Any]) -> bool:
    """Whether the forced ``dp_small`` plan (the smaller half of the tables data-parallel) keeps its
    replicas (weights + grad + state, fp32) within ``real_runs.DP_MAX_BYTES``, as real_runs offers
    data-parallel plans (few_large's 100k-150k-row replicas measured 2.5 s steps on R2: a run that
    only costs time)."""
    small = sorted(tables, key=lambda t: (t.rows, t.name))[: len(tables) // 2]
    return sum(t.rows * t.dim * 4 * 3 for t in small) <= DP_MAX_BYTES


def run_names(regime: str, profile_from: str, quick: bool = False, tables: Optional[Sequence[Any]] = None,
              rewrites: bool = False) -> List[str]:
    """The runs of one workload in ``regime``, in measuring order (before de-duplication);
    ``tables``: the workload's (``dp_small`` only where :func:`dp_small_fits`)."""
    names = ["torchrec", CONTROL_RUN] + [f"torchrec_{p}" for p in TORCHREC_PIPELINES if p != TORCHREC_DEFAULT_PIPELINE
                            and not (quick and p == "prefetch")]
    names += [f"torchrec_{q}" for q in QCOMM_PRECISIONS]
    names += ["sparselift"]
    if profile_from == "both" and regime != UNSHAPED:
        names.append("sparselift_unshaped")
    names += ["sparselift_lossy"] + [k for k in FORCED_KINDS if k != "dp_small" or tables is None or dp_small_fits(tables)]
    if REGIMES[regime]["hosts"] > 1 and REGIMES[regime]["ranks_per_host"] > 1:
        names += ["sparselift_2d", "sparselift_auto"]
    if rewrites:
        names += rewrite_runs(quick)
    return names


def _ms(rows: Mapping[str, Mapping[str, Any]], name: str) -> Optional[float]:
    row = rows.get(name)
    return None if row is None or row.get("failed") else float(row["measured_ms"])


def summarize_workload(rows: Mapping[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """Ratios of one workload from its rows (run name -> ``measured_ms``, ``failed``, ...):
    TorchRec default / best pipeline / qcomm over SparseLift's runs, SparseLift over the best
    lossless run, and the 2D decision (R4). A ratio whose runs are missing is None."""
    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b is not None and b > 0 else None

    tr = _ms(rows, "torchrec")
    pipes = {p: _ms(rows, "torchrec" if p == TORCHREC_DEFAULT_PIPELINE else f"torchrec_{p}") for p in TORCHREC_PIPELINES}
    pipes = {p: v for p, v in pipes.items() if v is not None}
    best_pipe = min(pipes, key=pipes.get) if pipes else None
    qcomm = {q: _ms(rows, f"torchrec_{q}") for q in QCOMM_PRECISIONS}
    qcomm = {q: v for q, v in qcomm.items() if v is not None}
    best_q = min(qcomm, key=qcomm.get) if qcomm else None
    lossless = {n: _ms(rows, n) for n in rows if n not in LOSSY_RUNS and n != CONTROL_RUN}
    lossless = {n: v for n, v in lossless.items() if v is not None}
    best = min(lossless, key=lossless.get) if lossless else None
    sl, slu, lossy = _ms(rows, "sparselift"), _ms(rows, "sparselift_unshaped"), _ms(rows, "sparselift_lossy")
    sla = _ms(rows, "sparselift_auto")
    if slu is None and (rows.get("sparselift") or {}).get("profile") == "unshaped":
        slu = sl  # --profile-from unshaped: SparseLift's plan is the unshaped-profile plan
    out: Dict[str, Any] = dict(
        torchrec_best_pipeline=best_pipe, torchrec_best_qcomm=best_q, best_run=best,
        torchrec_over_sparselift=ratio(tr, sl),
        torchrec_best_pipeline_over_sparselift=ratio(pipes.get(best_pipe), sl),
        sparselift_over_best=ratio(sl, lossless.get(best)),
        torchrec_over_sparselift_unshaped=ratio(tr, slu),
        torchrec_best_pipeline_over_sparselift_unshaped=ratio(pipes.get(best_pipe), slu),
        sparselift_unshaped_over_best=ratio(slu, lossless.get(best)),
        torchrec_over_sparselift_auto=ratio(tr, sla),
        torchrec_best_pipeline_over_sparselift_auto=ratio(pipes.get(best_pipe), sla),
        sparselift_auto_over_best=ratio(sla, lossless.get(best)),
        torchrec_qcomm_over_lossy=ratio(qcomm.get(best_q), lossy),
        torchrec_over_lossy=ratio(tr, lossy),
        control_over_torchrec=ratio(_ms(rows, CONTROL_RUN), tr),
    )
    forced = {n: _ms(rows, n) for n in rows if rewrite_of(n) is not None}
    forced = {n: v for n, v in forced.items() if v is not None}
    best_rw = min(forced, key=forced.get) if forced else None
    closed = {n: rows[n].get("gap_closed") for n in forced if rows[n].get("gap_closed") is not None}
    out.update(best_rewrite=best_rw, torchrec_over_best_rewrite=ratio(tr, forced.get(best_rw)),
               torchrec_best_pipeline_over_best_rewrite=ratio(pipes.get(best_pipe), forced.get(best_rw)),
               best_gap_closed=max(closed.values()) if closed else None,
               best_gap_closed_run=max(closed, key=closed.get) if closed else None)
    if "sparselift_2d" in rows:
        one, two = sl, _ms(rows, "sparselift_2d")
        auto = rows.get("sparselift_auto") or {}
        out["two_d_faster"] = None if one is None or two is None else two < one
        out["two_d_over_one_d"] = ratio(two, one)
        out["planner_picked_2d"] = auto.get("is_2d")
        out["two_d_decision_right"] = (None if out["two_d_faster"] is None or out["planner_picked_2d"] is None
                                       else out["two_d_faster"] == out["planner_picked_2d"])
    return out


def _geo(values: Sequence[Optional[float]]) -> Optional[float]:
    xs = [v for v in values if v is not None and v > 0]
    return geomean(xs) if xs else None


def summarize_regime(regime: str, workloads: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """A regime's summary from its workload results (each with ``ratios`` = :func:`summarize_workload`,
    and ``rows`` holding ``measured_ms``, ``predicted_ms`` (profile -> ms), ``same_as``):
    geomeans and worst cases of the ratios, MAPE and mean Spearman per profile, 2D decisions and
    loss parity."""
    out: Dict[str, Any] = dict(regime=regime, kind=REGIMES[regime]["kind"], workloads=len(workloads))
    keys = ["torchrec_over_sparselift", "torchrec_best_pipeline_over_sparselift", "sparselift_over_best",
            "torchrec_over_sparselift_unshaped", "torchrec_best_pipeline_over_sparselift_unshaped",
            "sparselift_unshaped_over_best", "torchrec_over_sparselift_auto",
            "torchrec_best_pipeline_over_sparselift_auto", "sparselift_auto_over_best", "torchrec_qcomm_over_lossy",
            "torchrec_over_lossy", "control_over_torchrec", "torchrec_over_best_rewrite",
            "torchrec_best_pipeline_over_best_rewrite", "best_gap_closed"]
    for k in keys:
        vals = [w["ratios"].get(k) for w in workloads]
        out[f"geo_{k}"] = _geo(vals)
        have = [v for v in vals if v is not None]
        out[f"min_{k}"] = min(have) if have else None
        out[f"max_{k}"] = max(have) if have else None
    for prof in ("regime", "unshaped"):
        pred, meas, sps, rw_pred, rw_meas = [], [], [], [], []
        for w in workloads:
            p_w, m_w = [], []
            for name, row in w["rows"].items():
                if row.get("same_as") or row.get("failed") or name == CONTROL_RUN:  # the control: TorchRec's run again
                    continue
                p = (row.get("predicted_ms") or {}).get(prof)
                if p is None:
                    continue
                p_w.append(p)
                m_w.append(row["measured_ms"])
                if row.get("rewrites"):  # a rewritten plan: forced, or SparseLift's own choice
                    rw_pred.append(p)
                    rw_meas.append(row["measured_ms"])
            pred += p_w
            meas += m_w
            if len(p_w) >= 2:
                s = spearman(p_w, m_w)
                if not math.isnan(s):
                    sps.append(s)
        out[f"mape_{prof}"] = mape(pred, meas) if meas else None
        out[f"spearman_{prof}"] = statistics.fmean(sps) if sps else None
        out[f"plans_priced_{prof}"] = len(meas)
        out[f"mape_rewrites_{prof}"] = mape(rw_pred, rw_meas) if rw_meas else None
        out[f"rewritten_priced_{prof}"] = len(rw_meas)
    decisions = [w["ratios"].get("two_d_decision_right") for w in workloads if "two_d_decision_right" in w["ratios"]]
    decisions = [d for d in decisions if d is not None]
    out["two_d_decisions_right"] = (sum(decisions) / len(decisions)) if decisions else None
    gaps = [w["parity"]["loss_gap"] for w in workloads if (w.get("parity") or {}).get("loss_gap") is not None]
    out["two_d_loss_gap"] = max(gaps) if gaps else None
    controls = [abs(w["parity"]["control_gap"]) for w in workloads
                if (w.get("parity") or {}).get("control_gap") is not None]
    out["one_d_control_loss_gap"] = max(controls) if controls else None  # what two exact 1D plans differ by
    return out


def _applies(scope: str, regime: str, kind: str) -> bool:
    return scope == "all" or scope == kind or scope == regime


def check_targets(summary: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Each target of :data:`TARGETS` that applies to the regime of ``summary``: the value, whether
    it is met (None when the benchmark has no value for it, e.g. a run left out)."""
    out = []
    for key, op, bound, scope, text in TARGETS:
        if not _applies(scope, summary["regime"], summary["kind"]):
            continue
        v = summary.get(key)
        met = None
        if v is not None:
            met = {">=": v >= bound, "<=": v <= bound, "==": abs(v - bound) < 1e-9}[op]
        out.append(dict(key=key, target=f"{op} {bound:g}", value=v, met=met, text=text))
    return out


def gap_closed(base_ms: float, run_ms: float, bound_ms: float) -> Optional[float]:
    """The fraction of the gap between a base run's step and its overlap bound that a rewrite run
    closes (1: the rewrite reaches the bound; 0: no faster; < 0: slower); None without a gap."""
    gap = base_ms - bound_ms
    return (base_ms - run_ms) / gap if gap > 0 else None


def add_overlap_bounds(jobs: Mapping[str, Mapping[str, Any]], unshaped: str = UNSHAPED,
                       replayed: Optional[Mapping[str, Mapping[str, float]]] = None) -> None:
    """Give every row of every regime (in place) its compute part (``unshaped``'s measured step of
    the same run key and workload, where that regime measured it, or ``replayed[workload][key]``:
    the unshaped replay job's), its overlap bound
    max(compute part, communication part), and for a rewrite run the fraction of its base run's
    gap to the base's bound that it closes (:func:`gap_closed`)."""
    plain = {}
    for wres in (jobs.get(unshaped) or {}).get("workloads", []):
        for row in wres["rows"].values():
            if row.get("key") and not row.get("failed") and not row.get("same_as"):
                plain[(wres.get("workload"), row["key"])] = row["measured_ms"]
    for wname, keys in (replayed or {}).items():
        for key, ms in keys.items():
            plain.setdefault((wname, key), ms)
    for job in jobs.values():
        for wres in job.get("workloads", []):
            rows = wres["rows"]
            for row in rows.values():
                c = plain.get((wres.get("workload"), row.get("key")))
                m = row.get("comm_part_ms")
                row["compute_part_ms"] = c
                row["overlap_bound_ms"] = max(c, m) if c is not None and m is not None else None
            for name, row in rows.items():
                base = rows.get(row.get("base") or "")
                if rewrite_of(name) is None or base is None or row.get("failed") or base.get("failed"):
                    continue
                bound = base.get("overlap_bound_ms")
                row["gap_closed"] = (None if bound is None else
                                     gap_closed(base["measured_ms"], row["measured_ms"], bound))


def merge_results(jobs: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Any]) -> Dict[str, Any]:
    """The driver's results: every regime's job result, its summary (recomputed from the rows, so a
    merged file and its parts agree) and its targets; regimes in :data:`REGIMES` order (the report
    header, :func:`benchmarks.harness.write_report`, adds the date)."""
    regimes = {}
    add_overlap_bounds(jobs, replayed=settings.get("replayed"))
    for name in REGIMES:
        if name not in jobs:
            continue
        job = dict(jobs[name])
        for wres in job.get("workloads", []):  # the gap each rewrite closes is known only now
            wres["ratios"] = summarize_workload(wres["rows"])
        summary = summarize_regime(name, job.get("workloads", []))
        job["summary"] = summary
        job["targets"] = check_targets(summary)
        regimes[name] = job
    return dict(settings=dict(settings), regimes=regimes)


def _f(v: Optional[float], fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_workload(res: Mapping[str, Any]) -> str:
    rows = res["rows"]
    lines = [f"\n## {res['regime']} {res['workload']} ({res['tables']} tables, batch {res['batch_size']}/rank)",
             f"{'run':<22}{'plan':<20}{'pipeline/comm':<30}{'ms/step':>9}{'pred reg':>9}{'pred uns':>9}"
             f"{'TR/run':>7}{'TRbp/run':>9}{'rounds':>7}{'comm':>7}{'comp':>7}{'bound':>7}{'closed':>7}"]
    tr = _ms(rows, "torchrec")
    bp = res["ratios"].get("torchrec_best_pipeline")
    trb = _ms(rows, "torchrec" if bp in (None, TORCHREC_DEFAULT_PIPELINE) else f"torchrec_{bp}")
    for name, r in rows.items():
        if r.get("failed"):
            lines.append(f"{name:<22}failed: {r['failed'][:90]}")
            continue
        pr = r.get("predicted_ms") or {}
        lines.append(f"{name:<22}{r['types'][:19]:<20}{r['settings'][:29]:<30}{r['measured_ms']:>9.1f}"
                     f"{_f(pr.get('regime'), '{:.1f}'):>9}{_f(pr.get('unshaped'), '{:.1f}'):>9}"
                     f"{_f(tr / r['measured_ms'] if tr else None, '{:.2f}'):>7}"
                     f"{_f(trb / r['measured_ms'] if trb else None, '{:.2f}'):>9}{len(r['runs_ms']):>7}"
                     f"{_f(r.get('comm_part_ms'), '{:.1f}'):>7}{_f(r.get('compute_part_ms'), '{:.1f}'):>7}"
                     f"{_f(r.get('overlap_bound_ms'), '{:.1f}'):>7}{_f(r.get('gap_closed'), '{:.2f}'):>7}"
                     + (f"  = {r['same_as']}" if r.get("same_as") else ""))
    x = res["ratios"]
    lines.append(f"TorchRec/SparseLift {_f(x['torchrec_over_sparselift'])}x; TorchRec best pipeline "
                 f"({x['torchrec_best_pipeline']})/SparseLift {_f(x['torchrec_best_pipeline_over_sparselift'])}x; "
                 f"SparseLift/best ({x['best_run']}) {_f(x['sparselift_over_best'])}; unshaped-profile SparseLift: "
                 f"{_f(x['torchrec_over_sparselift_unshaped'])}x, /best {_f(x['sparselift_unshaped_over_best'])}; "
                 f"TorchRec qcomm ({x['torchrec_best_qcomm']})/lossy {_f(x['torchrec_qcomm_over_lossy'])}x; "
                 f"A/A (a second model of TorchRec's run / the first) {_f(x.get('control_over_torchrec'))}")
    if x.get("best_rewrite"):
        lines.append(f"rewrites forced: fastest {x['best_rewrite']}, TorchRec/it {_f(x['torchrec_over_best_rewrite'])}x, "
                     f"TorchRec best pipeline/it {_f(x['torchrec_best_pipeline_over_best_rewrite'])}x; most of the "
                     f"gap to the overlap bound closed: {_f(x.get('best_gap_closed'), '{:.2f}')} "
                     f"({x.get('best_gap_closed_run') or 'no bound yet: the driver adds R1s compute parts'})")
    if "two_d_faster" in x:
        lines.append(f"2D/1D {_f(x.get('two_d_over_one_d'))}; planner picked 2D: {x.get('planner_picked_2d')}; "
                     f"decision right: {x.get('two_d_decision_right')}")
    if res.get("parity"):
        p = res["parity"]
        lines.append(f"loss parity ({p.get('steps')} steps): " + (
            f"1D {p['loss_1d']:.5f}, 2D {p['loss_2d']:.5f}, gap {p['loss_gap']:+.5f} "
            f"(standard error {_f(p.get('loss_gap_se'), '{:.5f}')}); another exact 1D plan "
            f"({p.get('control')}): gap {_f(p.get('control_gap'), '{:+.5f}')}" if p.get("loss_gap") is not None
            else f"not measured: {p.get('error')}"))
    return "\n".join(lines)


def format_summary(merged: Mapping[str, Any]) -> str:
    """The regimes side by side, then every target with its value and whether it is met."""
    lines = ["\n# Summary (ratios > 1: SparseLift faster; geomean over workloads)",
             f"{'regime':<8}{'TR/SL':>8}{'TRbest/SL':>10}{'SL/best':>9}{'TR/SLu':>8}{'TRbest/SLu':>11}{'SLu/best':>9}"
             f"{'TRq/lossy':>10}{'min TR/SL':>10}{'MAPE reg':>9}{'MAPE uns':>9}{'rho reg':>8}{'rho uns':>8}"
             f"{'A/A range':>14}"]
    for name, job in merged["regimes"].items():
        s = job["summary"]
        pct = lambda v: _f(v * 100 if v is not None else None, "{:.1f}%")  # noqa: E731
        lines.append(f"{name:<8}{_f(s['geo_torchrec_over_sparselift']):>8}"
                     f"{_f(s['geo_torchrec_best_pipeline_over_sparselift']):>10}"
                     f"{_f(s['geo_sparselift_over_best']):>9}{_f(s['geo_torchrec_over_sparselift_unshaped']):>8}"
                     f"{_f(s['geo_torchrec_best_pipeline_over_sparselift_unshaped']):>11}"
                     f"{_f(s['geo_sparselift_unshaped_over_best']):>9}{_f(s['geo_torchrec_qcomm_over_lossy']):>10}"
                     f"{_f(s['min_torchrec_over_sparselift']):>10}{pct(s['mape_regime']):>9}{pct(s['mape_unshaped']):>9}"
                     f"{_f(s['spearman_regime'], '{:.2f}'):>8}{_f(s['spearman_unshaped'], '{:.2f}'):>8}"
                     f"{_f(s.get('min_control_over_torchrec'), '{:.2f}') + '-' + _f(s.get('max_control_over_torchrec'), '{:.2f}'):>14}")
    for name, job in merged["regimes"].items():
        s = job["summary"]
        if s.get("geo_torchrec_over_sparselift_auto") is not None:
            lines.append(f"{name} with 2D allowed (the planner's 1D/2D choice, sparselift_auto): TR/SL "
                         f"{_f(s['geo_torchrec_over_sparselift_auto'])}, TRbest/SL "
                         f"{_f(s['geo_torchrec_best_pipeline_over_sparselift_auto'])}, SL/best "
                         f"{_f(s['geo_sparselift_auto_over_best'])}")
        if s.get("two_d_loss_gap") is not None:
            lines.append(f"{name} loss parity: 2D - 1D up to {s['two_d_loss_gap']:+.5f}; two exact 1D plans differ by "
                         f"up to {_f(s.get('one_d_control_loss_gap'), '{:.5f}')} (the control)")
    rewrite_lines = []
    for name, job in merged["regimes"].items():
        for wres in job.get("workloads", []):
            rows, x = wres["rows"], wres["ratios"]
            if not x.get("best_rewrite"):
                continue
            per = ", ".join(f"{n} {_f(r.get('gap_closed'), '{:.2f}')}" for n, r in rows.items()
                            if rewrite_of(n) is not None and not r.get("failed")
                            and (r.get("gap_closed") is not None or not r.get("same_as")))
            base = rows.get(x.get("best_gap_closed_run") or "", {}).get("base")
            bound = (rows.get(base or "") or {}).get("overlap_bound_ms")
            rewrite_lines.append(f"{name} {wres.get('workload')}: fastest {x['best_rewrite']} (TR/it "
                                 f"{_f(x['torchrec_over_best_rewrite'])}x, TRbest/it "
                                 f"{_f(x['torchrec_best_pipeline_over_best_rewrite'])}x); gap to the overlap bound "
                                 f"closed: {per or '-'}" + (f" (bound of {base}: {bound:.1f} ms)" if bound else ""))
    if rewrite_lines:
        lines += ["\n# Rewrites forced (share of the base run's gap to its overlap bound closed)"] + rewrite_lines
    lines.append("\n# Targets")
    for name, job in merged["regimes"].items():
        for t in job["targets"]:
            mark = "n/a" if t["met"] is None else ("MET" if t["met"] else "MISSED")
            lines.append(f"{name:<4}{mark:<8}{_f(t['value'], '{:.4f}'):>9} (target {t['target']})  {t['text']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the job: one rank of one regime
# ---------------------------------------------------------------------------------------------


def job_topology(world: int, local: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Topology(world_size=world, local_world_size=local, compute_device="cpu")


def job_profiles(args, regime: str, link: Any, pg, say) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """``({"regime": profile, "unshaped": profile}, errors, info)`` as ``--profile-from`` asks;
    calibrates into the regime's store where its profile is missing or out of date. ``errors``:
    the never-slower rule's error per term for each profile, its stored step fit's, as
    ``hardware="auto"`` finds them (a link-corrected profile equals no stored one)."""
    W = dist.get_world_size(pg)
    local = ranks_per_host(world_size=W)
    hosts = W // local
    profiles: Dict[str, Any] = {}
    errors: Dict[str, Any] = {}
    info: Dict[str, Any] = {}
    want_regime = args.profile_from in ("regime", "both") or regime == UNSHAPED
    if want_regime:
        root = os.path.join(args.store, "unshaped" if regime == UNSHAPED else regime)
        store = ProfileStore(root)
        fp = current_fingerprint("cpu", local, hosts=hosts)
        found, diff = store.lookup(fp)
        problems = stored_profile_problems(found.step_fit) if found is not None and not diff else []
        if problems and disturbed_spread(found.step_fit) is not None:
            # a calibration on a busy machine is kept (and reported): calibrating again on the same
            # busy machine would only repeat it
            info["disturbed_calibration_spread"] = disturbed_spread(found.step_fit)
            problems = problems[:-1]
        why = ("--calibrate" if args.calibrate else "no stored profile" if found is None
               else f"stored one differs ({'; '.join(diff)})" if diff else "; ".join(problems))
        if why:
            say(f"[regimes] {regime}: calibrating under this link ({why}) into {root}")
            t0 = time.perf_counter()
            prof, fit, _r, _f2 = calibrate_steps(pg, "cpu", progress=dist.get_rank(pg) == 0, store=store, link=link,
                                                 steps=args.calibration_steps,
                                                 warmup=2 if args.calibration_steps else None)
            info["regime"] = dict(source=f"calibrated now in {time.perf_counter() - t0:.0f} s", store=root,
                                  fit_mape=fit.mape)
        else:
            prof = found.profile
            info["regime"] = dict(source=found.path, store=root, fit_mape=((found.info or {}).get("fit") or {}).get("mape"))
        profiles["regime"] = prof
        errors["regime"] = profile_errors(prof, None, store=store)
        if regime == UNSHAPED:
            profiles["unshaped"] = prof
            errors["unshaped"] = errors["regime"]
            info["unshaped"] = dict(info["regime"], note="this regime is the unshaped box")
    if args.profile_from in ("unshaped", "both") and regime != UNSHAPED:
        root = os.path.join(args.store, "unshaped")
        store = ProfileStore(root)
        fp = current_fingerprint("cpu", REGIMES[UNSHAPED]["ranks_per_host"], hosts=1)
        found, diff = store.lookup(fp)
        if found is None or diff:
            raise SystemExit(f"[regimes] --profile-from {args.profile_from}: no profile of the unshaped box in {root}"
                             + (f" (closest differs: {'; '.join(diff)})" if diff else "")
                             + f"; run regime {UNSHAPED} first (it calibrates there) or use --profile-from regime")
        stored_link = found.link
        if stored_link is None or link is None:
            raise SystemExit(f"[regimes] the unshaped profile {found.path} or this job has no link record: "
                             f"recalibrate {UNSHAPED} with --calibrate")
        # as hardware="auto" does: link terms corrected, the rule's errors the stored step fit's with
        # the corrected link terms' at least the link measurement's spread
        on = profile_on_link(found.profile, stored_link, link, found.path, store=store)
        corr = on.correction
        profiles["unshaped"] = on.profile
        errors["unshaped"] = on.errors
        info["unshaped"] = dict(source=found.path, store=root, corrected=corr.differs,
                                changed=[list(c) for c in corr.changed], differences=list(corr.differences))
        say(f"[regimes] {regime}: unshaped profile {found.path}" + (f", link-corrected: {corr.describe(found.path)}"
                                                                   if corr.differs else " (link within spread)"))
    if "regime" not in profiles:
        profiles["regime"] = profiles["unshaped"]  # --profile-from unshaped: the only profile
        errors["regime"] = errors["unshaped"]
        info["regime"] = dict(info["unshaped"], note="--profile-from unshaped: the regime profile is the unshaped one")
    return profiles, errors, info


def signal_batches(w, n: int, seed: int, rank: int, alpha: float) -> List[Any]:
    """:func:`~torchrec_sparselift.measure.probe.prebuilt_batches` with labels from a planted
    signal (each id of each table has a hidden effect; a sample's logit is -1 plus the sum over
    features of the mean effect of its ids), so a loss comparison measures learning."""
    effects = {t.name: np.random.default_rng([seed, 77, i]).normal(0.0, 1.0, t.rows) for i, t in enumerate(w.tables)}
    table_of = {f: t.name for t in w.tables for f in t.features}
    rng = np.random.default_rng([seed, rank, 78])
    out = []
    for b in prebuilt_batches(w, n, seed=seed, rank=rank, alpha=alpha):
        kjt = b.sparse_features
        logit = np.full(w.batch_size, -1.0)
        for key in kjt.keys():
            jt = kjt[key]
            ids, lens = jt.values().numpy(), jt.lengths().numpy()
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            sums = np.add.reduceat(effects[table_of[key]][ids], starts)
            logit += sums / np.maximum(lens, 1)
        labels = (rng.random(w.batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        out.append(Batch(dense_features=b.dense_features, sparse_features=kjt, labels=torch.from_numpy(labels)))
    return out


def paired_gap_se(losses_1d: Sequence[float], losses_2d: Sequence[float], block: int = 16) -> Optional[float]:
    """Standard error of the mean 2D - 1D loss over the last half of the steps: the per-step
    differences (same batches, same initial weights) in blocks of ``block`` steps (consecutive
    steps are correlated), the blocks' standard deviation over the square root of their number;
    None with fewer than two blocks."""
    n = min(len(losses_1d), len(losses_2d))
    diff = [b - a for a, b in zip(losses_1d[n // 2:n], losses_2d[n // 2:n])]
    blocks = [statistics.fmean(diff[i:i + block]) for i in range(0, len(diff) - block + 1, block)]
    return statistics.stdev(blocks) / math.sqrt(len(blocks)) if len(blocks) >= 2 else None


def lift_run(w, spec: Mapping[str, Any], device, dense_optimizer: Callable[..., Any] = torch.optim.Adagrad):
    """A fresh model of ``w`` sharded per ``spec`` (``plan``: a ShardingPlan or an execution plan;
    ``pipeline``/``fwd``/``bwd``: overrides) through :func:`torchrec_sparselift.runtime.lift`;
    row-wise AdaGrad on the tables, ``dense_optimizer`` (lr 0.005) on the rest."""
    torch.manual_seed(0)
    split = spec.get("batch_split")
    return lift(probe_model(w), spec["plan"], device=device, pipeline=spec.get("pipeline"),
                fwd_comm_precision=spec.get("fwd"), bwd_comm_precision=spec.get("bwd"),
                batch_split=split, id_dtype=spec.get("id_dtype"), dedup_features=spec.get("dedup_features"),
                pipeline_options={"per_sample": True} if split and split > 1 else None,
                embedding_optimizer=(RowWiseAdagrad, {"lr": 0.05}),
                dense_optimizer_factory=lambda params: dense_optimizer(params, lr=0.005))


def timed_run(build: Callable[[], Any], batches: Sequence[Any], steps: int, warmup: int, pg,
              after_build: Optional[Callable[[Any], None]] = None,
              kept: Optional[Dict[str, Any]] = None, whole_intervals: bool = True) -> Tuple[float, List[float], float]:
    """Run ``warmup + steps`` steps on ``batches`` (cycled) with this rank pinned to its cores (as
    :func:`~torchrec_sparselift.measure.probe.measure_plan` times the calibration's probes) on a
    model sharded now (``build()`` -> Lifted), or, with ``kept`` (a dict), on the model a previous
    call kept there (built on the first call); returns the steady step of the per-step slowest
    rank (seconds; :func:`~torchrec_sparselift.runtime.timing.steady_step_s`: the median, or for a
    2D plan that syncs every ``Lifted.sync_period`` steps the median of the means of whole sync
    intervals, ``steps`` rounded up to a multiple of it unless ``whole_intervals`` is False), every
    step's loss averaged over ranks, and the seconds spent sharding."""
    old = pin_rank_to_core(pg)
    try:
        t_build = time.perf_counter()
        if kept is not None and "lifted" in kept:
            lifted, it = kept["lifted"], kept["it"]
        else:
            lifted, it = build(), Cycle(batches)
            if after_build is not None:
                after_build(lifted)
            if kept is not None:
                kept.update(lifted=lifted, it=it)
        build_s = time.perf_counter() - t_build
        period = lifted.sync_period if whole_intervals else 1  # the built model's, the one reading
        steps = -(-max(steps, period) // period) * period
        losses: List[float] = []

        def keep_loss(out: Any) -> None:
            loss = out[0] if isinstance(out, tuple) else out
            losses.append(float(loss.detach().float().mean()))

        timer = timed_steps(lambda pipeline=lifted.pipeline, batches=it: pipeline.progress(batches), steps, pg,
                            torch.device("cpu"), warmup=warmup,
                            period=period, collect=True, on_step=keep_loss)
        mx = timer.slowest_rank_durations_s(pg)
        ls = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(ls, op=dist.ReduceOp.SUM, group=pg)
        ls /= dist.get_world_size(pg)
        del lifted, it
        gc.collect()
    finally:
        restore_affinity(old)
    return steady_step_s(mx[warmup:], period), [float(x) for x in ls], build_s


def rewrites_of(spec: Mapping[str, Any]) -> str:
    """The rewrites a run applies (its overrides over its execution plan's), as one label: "" for none."""
    opt = getattr(spec["plan"], "optimizations", None)
    k = spec.get("batch_split") or getattr(opt, "batch_split", 1)
    ids = spec.get("id_dtype") or getattr(opt, "id_dtype", "int64")
    dedup = spec.get("dedup_features") or getattr(opt, "dedup_features", ())
    parts = ([f"split{k}"] if k > 1 else []) + ([ids] if ids != "int64" else []) + (
        [f"dedup{len(dedup)}"] if dedup else [])
    return "+".join(parts)


def _settings_of(spec: Mapping[str, Any]) -> Tuple[str, str, str, Optional[int]]:
    """(pipeline, fwd, bwd, 2D group) a run applies: its overrides over its execution plan's choice."""
    opt = getattr(spec["plan"], "optimizations", None)
    pipe = spec.get("pipeline") or getattr(opt, "pipeline", TORCHREC_DEFAULT_PIPELINE)
    fwd = spec.get("fwd") or getattr(opt, "fwd_comm_precision", "fp32")
    bwd = spec.get("bwd") or getattr(opt, "bwd_comm_precision", "fp32")
    return pipe, fwd, bwd, getattr(opt, "sharding_group_size", None)


def build_specs(w, names: Sequence[str], topo, profiles: Mapping[str, Any], errors: Mapping[str, Any], stats, pg,
                 say) -> List[Dict[str, Any]]:
    """One spec per run name: its plan (ShardingPlan or execution plan), overrides and constraints."""
    specs: List[Dict[str, Any]] = []
    tr_plan, pooling = torchrec_plan_of(w, topo, pg)

    def sl(**kw):
        t0 = time.perf_counter()
        planner = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, constraints=pooling, workload=stats,
                                    debug=False, **kw)
        ep = planner.collective_plan_execution(probe_model(w), get_default_sharders(), pg)
        res = planner.last_result
        rule = res.never_slower.describe() if res is not None and res.never_slower is not None else "not run"
        # one replica sync as the planner priced it (rank 0 planned; None elsewhere and for 1D)
        sync_ms = res.sync_s * res.sync_interval * 1e3 if res is not None and res.sync_s else None
        return ep, time.perf_counter() - t0, rule, sync_ms

    made: Dict[str, Dict[str, Any]] = {}
    for name in names:
        spec: Dict[str, Any] = dict(name=name, cons=pooling)
        rewrite = rewrite_of(name)
        if rewrite is not None:
            base_name, forced = rewrite
            base = made[base_name]  # the base runs come first (run_names)
            spec.update(plan=base["plan"], cons=base["cons"], base=base_name, pipeline=base.get("pipeline"),
                        fwd=base.get("fwd"), bwd=base.get("bwd"))
            if forced.get("batch_split"):
                spec.update(pipeline="overlap", batch_split=forced["batch_split"])
            if forced.get("id_dtype"):
                spec["id_dtype"] = forced["id_dtype"]
            if forced.get("dedup"):
                spec["dedup_features"] = feature_names(w.tables)
        elif name in ("torchrec", CONTROL_RUN):
            spec.update(plan=tr_plan, pipeline=TORCHREC_DEFAULT_PIPELINE, instance=2 if name == CONTROL_RUN else 1)
        elif name.startswith("torchrec_") and name[9:] in TORCHREC_PIPELINES:
            spec.update(plan=tr_plan, pipeline=name[9:])
        elif name.startswith("torchrec_") and name[9:] in QCOMM_PRECISIONS:
            spec.update(plan=tr_plan, pipeline=TORCHREC_DEFAULT_PIPELINE, fwd=name[9:], bwd=name[9:])
        elif name in FORCED_KINDS:
            plan, cons = forced_plan(probe_model(w), w.tables, name, topo, w.batch_size, pg, profiles["regime"],
                                     stats=stats)
            spec.update(plan=plan, cons=cons, pipeline=TORCHREC_DEFAULT_PIPELINE)
        else:
            which = "unshaped" if name == "sparselift_unshaped" else "regime"
            kw: Dict[str, Any] = dict(hardware=profiles[which], model_errors=errors.get(which))
            if name == "sparselift_lossy":
                kw["allow_lossy_comm"] = True
            elif name == "sparselift_2d":
                kw["sharding_group_size"] = topo.local_world_size
            elif name == "sparselift_auto":
                kw["sharding_group_size"] = "auto"
            ep, secs, rule, sync_ms = sl(**kw)
            spec.update(plan=ep, planning_s=secs, never_slower=rule, replica_sync_ms=sync_ms)
            group = ep.optimizations.sharding_group_size
            spec["is_2d"] = group is not None and group < topo.world_size
            say(f"[regimes] {w.name}: {name} planned in {secs:.1f} s: {ep.summary()}; {rule}")
        specs.append(spec)
        made[name] = spec
    return specs


def _types(spec: Mapping[str, Any]) -> str:
    plan = spec["plan"]
    return plan_types(getattr(plan, "sharding_plan", plan))


def _run_key(spec: Mapping[str, Any]) -> str:
    plan = spec["plan"]
    pipe, fwd, bwd, group = _settings_of(spec)
    fwd, bwd = on_gloo(fwd), on_gloo(bwd)
    sync = getattr(getattr(plan, "optimizations", None), "sync_interval", None) if group else None
    instance = spec.get("instance", 1)  # the A/A control is a second model of the same run
    return (f"{sharding_plan_digest(getattr(plan, 'sharding_plan', plan))}|{pipe}|{fwd}|{bwd}|{group}|{sync}|"
            f"{rewrites_of(spec)}|{instance}")


def _predict(w, spec: Mapping[str, Any], topo, profiles: Mapping[str, Any], stats) -> Dict[str, Optional[float]]:
    """Predicted ms of a run under each profile: SparseLift's cost model of its plan, pipeline and
    precisions. A 2D plan (group-local) takes its execution plan's own prediction, under the
    profile it was planned with."""
    pipe, fwd, bwd, group = _settings_of(spec)
    plan = spec["plan"]
    out: Dict[str, Optional[float]] = {}
    if rewrite_of(spec["name"]) is not None:  # forced rewrites: the plan priced with exactly them
        return {k: _forced_ms(w, spec, topo, prof, stats) for k, prof in profiles.items()}
    if (group is not None and group < topo.world_size) or rewrites_of(spec):
        which = profiles["unshaped" if spec["name"] == "sparselift_unshaped" else "regime"]
        for k, prof in profiles.items():
            out[k] = plan.prediction.step_time_s * 1e3 if prof is which else None
        return out
    given = GivenPlan.of(probe_model(w), getattr(plan, "sharding_plan", plan), topo, w.batch_size, spec["cons"], stats,
                         None)
    for k, prof in profiles.items():
        out[k] = float(given.step_time(prof, pipe, fwd, bwd).total_s) * 1e3
    return out


def _forced_ms(w, spec: Mapping[str, Any], topo, profile: Any, stats) -> float:
    """Predicted ms of a forced rewrite run under ``profile``: its base plan (sharding, pipeline,
    precisions) priced again, with exactly the rewrites the run applies
    (``plan.rewrites.price_rewrites``; dedup on the model-parallel features it deduplicates)."""
    pipe, fwd, bwd, _group = _settings_of(spec)
    plan = spec["plan"]
    sharding = getattr(plan, "sharding_plan", plan)
    opt = getattr(plan, "optimizations", None)
    module = probe_model(w)
    planner = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, constraints=spec["cons"], workload=stats,
                                hardware=profile, debug=False)
    evaluated = evaluate_sharding_plan(module, sharding, topo, w.batch_size, spec["cons"], hardware=profile,
                                       workload=stats, pipeline=pipe, fwd_precision=fwd, bwd_precision=bwd)
    request = attrs.evolve(planner.request(module), hardware=evaluated.profile)
    model_parallel = {t for mp in sharding.plan.values() for t, ps in mp.items() if ps.sharding_type != "data_parallel"}
    mp_features = {f for t in w.tables if t.name in model_parallel for f in t.features}
    dedup = spec.get("dedup_features") or getattr(opt, "dedup_features", ())
    step = price_rewrites(request, evaluated, batch_split=spec.get("batch_split") or getattr(opt, "batch_split", 1),
                          id_dtype=spec.get("id_dtype") or getattr(opt, "id_dtype", "int64"),
                          dedup_features=[f for f in dedup if f in mp_features])
    return step * 1e3


def parity_control(specs: Mapping[str, Mapping[str, Any]]) -> Optional[str]:
    """The run whose plan trains beside SparseLift's 1D plan as the loss comparison's control: the
    first of TorchRec's plan and the forced alternatives that shards differently (another exact 1D
    plan: its loss differs from SparseLift's 1D one only by the order of floating-point sums, which
    training amplifies; measured -0.0003..+0.0002 on kaggle over 320 steps). None when none does."""
    def digest(name: str) -> Optional[str]:
        spec = specs.get(name)
        if not spec or spec.get("failed"):
            return None
        return sharding_plan_digest(getattr(spec["plan"], "sharding_plan", spec["plan"]))

    ours = digest("sparselift")
    for name in ("torchrec",) + FORCED_KINDS:
        d = digest(name)
        if d is not None and d != ours:
            return name
    return None


def _parity(w, alpha: float, specs: Mapping[str, Mapping[str, Any]], steps: int, pg, device, say) -> Dict[str, Any]:
    """R4: 1D (SparseLift's plan), 2D (``sparselift_2d``, the replica sync ``lift`` installs) and a
    control (another exact 1D plan, :func:`parity_control`) trained from the same initial weights on the same batches with a planted signal; the mean loss over
    the last half of the steps. The control's gap to the 1D loss is what two equivalent plans
    already differ by."""
    rank = dist.get_rank(pg)
    batches = signal_batches(w, steps, seed=BATCH_SEED + 100, rank=rank, alpha=alpha)
    g = torch.Generator().manual_seed(4242)
    torch.manual_seed(0)
    ref = probe_model(w)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items() if not v.is_meta}
    for t in w.tables:
        state[f"embedding_bags.{t.name}.weight"] = (torch.rand(t.rows, t.dim, generator=g) * 2 - 1) * 0.05

    def anchor(lifted) -> None:
        copy_full_state(lifted.model, state)
        if hasattr(lifted.model, "install_replica_sync"):  # re-anchor the replica sync on the loaded weights
            lifted.model.install_replica_sync(lifted.model.replica_sync, lifted.settings.sync_interval or 1)

    out: Dict[str, Any] = dict(steps=steps, workload=w.name)
    try:
        control = parity_control(specs)
        runs = [("1d", "sparselift"), ("2d", "sparselift_2d")] + ([("control", control)] if control else [])
        for label, name in runs:
            _s, losses, _b = timed_run(lambda: lift_run(w, specs[name], device), batches, steps, 0, pg,
                                       after_build=anchor, whole_intervals=False)
            tail = losses[len(losses) // 2:]
            out[f"loss_{label}"] = statistics.fmean(tail)
            out[f"losses_{label}"] = losses
        out["sync_interval"] = getattr(specs["sparselift_2d"]["plan"].optimizations, "sync_interval", None)
        out["loss_gap"] = out["loss_2d"] - out["loss_1d"]
        out["loss_gap_se"] = paired_gap_se(out["losses_1d"], out["losses_2d"])
        out["control"] = control
        out["control_gap"] = out["loss_control"] - out["loss_1d"] if control else None
        say(f"[regimes] {w.name}: loss parity over {steps} steps (mean of the last half): 1D {out['loss_1d']:.5f}, "
            f"2D (sync every {out['sync_interval']}) {out['loss_2d']:.5f}, gap {out['loss_gap']:+.5f} "
            f"(standard error {_f(out['loss_gap_se'], '{:.5f}')}); control {control}: gap "
            f"{_f(out['control_gap'], '{:+.5f}')}")
    except Exception as e:  # noqa: BLE001 - reported, the timing results stand
        out["error"] = f"{type(e).__name__}: {e}"
        say(f"[regimes] {w.name}: loss parity not measured: {out['error']}")
    return out


def replay_entry(spec: Mapping[str, Any], world: int) -> Optional[Dict[str, Any]]:
    """What a run needs to train ``spec``'s run again (its sharding plan as a dict, its pipeline,
    precisions and rewrites: the unshaped regime's compute part, ``benchmarks.rewrite_pairs``), or None for a run whose plan depends on the host layout (2D,
    table-row-wise) and so is not the same plan on R1's one host."""
    _pipe, _fwd, _bwd, group = _settings_of(spec)
    if group is not None and group < world:
        return None
    plan = getattr(spec["plan"], "sharding_plan", spec["plan"])
    data = sharding_plan_to_dict(plan)
    if any(p.get("sharding_type") == "table_row_wise" for m in data["modules"].values()
           for p in (m.get("params") or {}).values()):
        return None
    pipe, fwd, bwd, _ = _settings_of(spec)
    opt = getattr(spec["plan"], "optimizations", None)
    return dict(plan=data, pipeline=pipe, fwd=fwd, bwd=bwd,
                batch_split=spec.get("batch_split") or getattr(opt, "batch_split", 1),
                id_dtype=spec.get("id_dtype") or getattr(opt, "id_dtype", "int64"),
                dedup_features=list(spec.get("dedup_features") or getattr(opt, "dedup_features", ())))


def replays_wanted(jobs: Mapping[str, Mapping[str, Any]], unshaped: str = UNSHAPED) -> Dict[str, Dict[str, Any]]:
    """workload -> {run key: replay entry} of the network regimes' runs whose compute part the
    unshaped regime did not measure (a key it ran is left out)."""
    have = {(w.get("workload"), r.get("key")) for w in (jobs.get(unshaped) or {}).get("workloads", [])
            for r in w["rows"].values() if not r.get("failed")}
    out: Dict[str, Dict[str, Any]] = {}
    for name, job in jobs.items():
        if name not in REGIMES or REGIMES[name]["kind"] != "network":
            continue
        for w in job.get("workloads", []):
            for r in w["rows"].values():
                if r.get("replay") and not r.get("failed") and (w.get("workload"), r.get("key")) not in have:
                    out.setdefault(w["workload"], {})[r["key"]] = r["replay"]
    return out


def comm_part_ms(w, spec: Mapping[str, Any], batches: Sequence[Any], pg, device, say) -> Optional[float]:
    """The run's communication part (ms): one steady step's collectives on a fresh model of the
    run, sent again alone on the link over ``pg`` (a group the run's model does not use:
    :mod:`benchmarks.harness.replay`); None if it cannot run."""
    try:
        lifted = lift_run(w, spec, device)
        calls, allreduce = count_step_collectives(lifted, Cycle(batches))
        del lifted
        gc.collect()
        return replay_collectives(calls, allreduce, pg) * 1e3
    except Exception as e:  # noqa: BLE001 - reported, the run's step stands without it
        say(f"[regimes] {w.name}: {spec['name']}: communication part not measured: {type(e).__name__}: {e}")
        dist.barrier(group=pg)
        return None


def run_workload(args, regime: str, wname: str, profiles, errors, pg, say) -> Dict[str, Any]:
    w, alpha = _workloads()[wname]
    W = dist.get_world_size(pg)
    topo = job_topology(W, ranks_per_host(world_size=W))
    device = torch.device("cpu")
    stats = probe_stats(w, alpha, n=args.batches, seed=BATCH_SEED)
    names = run_names(regime, args.profile_from, args.quick, w.tables, rewrites=args.rewrites)
    specs = build_specs(w, names, topo, profiles, errors, stats, pg, say)
    batches = prebuilt_batches(w, args.batches, seed=BATCH_SEED, rank=dist.get_rank(pg), alpha=alpha)
    owner: Dict[str, str] = {}
    for s in specs:
        s["key"] = _run_key(s)
        s["same_as"] = owner.setdefault(s["key"], s["name"])
        s["same_as"] = None if s["same_as"] == s["name"] else s["same_as"]
        s["runs"], s["losses"] = [], None
        s["predicted_ms"] = _predict(w, s, topo, profiles, stats)
    measured = [s for s in specs if s["same_as"] is None]

    def measure(s: Dict[str, Any], _round: int) -> None:
        if s.get("failed"):
            return
        try:
            secs, losses, build_s = timed_run(lambda: lift_run(w, s, device), batches, args.steps, args.warmup, pg,
                                              kept=s.setdefault("kept", {}) if args.keep_models else None)
            s["runs"].append(secs)
            s["losses"] = losses
            s.setdefault("build_s", []).append(build_s)
        except Exception as e:  # noqa: BLE001 - a precision/pipeline that cannot run here is a result
            s["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            say(f"[regimes] {w.name}: {s['name']} failed: {s['failed']}")
            dist.barrier(group=pg)

    def progress(done: int) -> None:
        sharding = sum(s["build_s"][-1] for s in measured if s.get("build_s"))
        say(f"[regimes] {regime} {w.name} round {done}/{args.reps} (sharding {sharding:.0f} s): " + ", ".join(
            f"{s['name']} {s['runs'][-1] * 1e3:.1f}" for s in measured if s["runs"] and not s.get("failed")) + " ms")

    interleaved_rounds(measured, measure, args.reps, after_round=progress)
    for s in specs:
        s.pop("kept", None)  # the kept models go now
    gc.collect()
    if args.comm_part:
        # the replays get a group of their own: a pipeline leaves its next batch's collectives in
        # flight on the job's group when a step returns
        replay_pg = dist.new_group(backend="gloo")
        for s in measured:
            if not s.get("failed"):
                s["comm_ms"] = comm_part_ms(w, s, batches, replay_pg, device, say)
        dist.destroy_process_group(replay_pg)
    by = {s["name"]: s for s in specs}
    rows: Dict[str, Dict[str, Any]] = {}
    for s in specs:
        src = by[s["same_as"]] if s["same_as"] else s
        pipe, fwd, bwd, group = _settings_of(s)
        comm = "/".join(p if on_gloo(p) == p else f"{p}>{on_gloo(p)}" for p in (fwd, bwd))
        rewrites = rewrites_of(s)
        row = dict(types=_types(s), settings=f"{pipe} {comm}" + (f" 2D:{group}" if group and group < W else "")
                   + (f" {rewrites}" if rewrites else ""), key=s["key"], base=s.get("base"),
                   comm_part_ms=src.get("comm_ms"), same_as=s["same_as"], predicted_ms=s["predicted_ms"], planning_s=s.get("planning_s"),
                   never_slower=s.get("never_slower"), is_2d=s.get("is_2d"),
                   replica_sync_ms=s.get("replica_sync_ms"), rewrites=rewrites)
        if s["name"].startswith("sparselift"):  # the profile it planned with
            row["profile"] = ("unshaped" if s["name"] == "sparselift_unshaped"
                              or profiles["regime"] is profiles.get("unshaped") else "regime")
        if s["same_as"] is None:  # the unshaped job's compute parts, benchmarks.rewrite_pairs
            row["replay"] = replay_entry(s, W)
        if src.get("failed") or not src["runs"]:
            row["failed"] = src.get("failed") or "not measured"
        else:
            row.update(measured_ms=statistics.median(src["runs"]) * 1e3, runs_ms=[x * 1e3 for x in src["runs"]],
                       spread=max(src["runs"]) / min(src["runs"]) - 1.0,
                       final_loss=src["losses"][-1] if src["losses"] else None, build_s=src.get("build_s"))
        rows[s["name"]] = row
    res: Dict[str, Any] = dict(regime=regime, workload=wname, tables=len(w.tables), batch_size=w.batch_size, alpha=alpha,
                               rows=rows)
    # paired (same round) TorchRec default / SparseLift, as real_runs reports it
    a, b = rows.get("torchrec", {}), rows.get("sparselift", {})
    if a.get("runs_ms") and b.get("runs_ms"):
        res["torchrec_over_sparselift_paired"] = paired_ratio(a["runs_ms"], b["runs_ms"])
    if "sparselift_2d" in by and not by["sparselift_2d"].get("failed"):
        res["parity"] = _parity(w, alpha, by, args.parity_steps, pg, device, say)
    res["ratios"] = summarize_workload(rows)
    gc.collect()
    return res


def replay_job(args) -> int:
    """The unshaped replay: every run of ``--replay`` trained here, interleaved rounds per workload
    as :func:`run_workload` times them; writes ``{workload: {run key: ms}}`` to ``--out``."""
    me = start_worker()
    pg, rank, say = me.pg, me.rank, me.say
    try:
        with open(args.replay, encoding="utf-8") as f:
            wanted = json.load(f)
        device = torch.device("cpu")
        out: Dict[str, Dict[str, float]] = {}
        for wname, entries in wanted.items():
            w, alpha = _workloads()[wname]
            batches = prebuilt_batches(w, args.batches, seed=BATCH_SEED, rank=dist.get_rank(pg), alpha=alpha)
            specs = [dict(e, name=key, plan=sharding_plan_from_dict(e["plan"]), runs=[]) for key, e in entries.items()]

            def measure(s: Dict[str, Any], _round: int) -> None:
                if s.get("failed"):
                    return
                try:
                    secs, _losses, _b = timed_run(lambda: lift_run(w, s, device), batches, args.steps, args.warmup, pg)
                    s["runs"].append(secs)
                except Exception as e:  # noqa: BLE001 - a run that cannot train here has no compute part
                    s["failed"] = f"{type(e).__name__}: {e}"
                    say(f"[regimes] replay {wname}: {s['name']}: {s['failed'][:200]}")
                    dist.barrier(group=pg)

            interleaved_rounds(specs, measure, args.reps)
            out[wname] = {s["name"]: statistics.median(s["runs"]) * 1e3 for s in specs if s["runs"]}
            say(f"[regimes] replay {wname}: {len(out[wname])} of {len(specs)} runs timed unshaped")
        if rank == 0:
            write_report(args.out, dict(replayed=out))
        dist.barrier()
    finally:
        stop_worker()
    return 0


def job(args) -> int:
    me = start_worker()
    pg, rank, say = me.pg, me.rank, me.say
    regime = args.regime
    t_start = time.time()
    try:
        link = measure_link_rates()  # every rank, before any pinning (as the calibration measures it)
        say(f"[regimes] {regime} ({REGIMES[regime]['doc']}): {dist.get_world_size()} ranks; link {link.describe()}")
        profiles, errors, pinfo = job_profiles(args, regime, link, pg, say)
        say(f"[regimes] {regime}: profiles " + ", ".join(f"{k}={v.name}" for k, v in profiles.items()))
        results = []
        for wname in args.workloads:
            res = run_workload(args, regime, wname, profiles, errors, pg, say)
            results.append(res)
            say(format_workload(res))
        summary = summarize_regime(regime, results)
        if rank == 0:
            out = write_report(args.out, dict(
                regime=regime, topology=REGIMES[regime], started=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                time.gmtime(t_start)),
                wall_s=time.time() - t_start, link=link.to_dict(), profiles={k: v.to_dict() for k, v in profiles.items()},
                profile_info=pinfo, load_end=os.getloadavg()[0], workloads=results, summary=summary,
                targets=check_targets(summary)))
            say(f"[regimes] {regime}: wrote {args.out} ({out['wall_s']:.0f} s)")
        dist.barrier()
    finally:
        stop_worker()
    return 0


# ---------------------------------------------------------------------------------------------
# the driver: one testbed job per regime
# ---------------------------------------------------------------------------------------------


def testbed_command(regime: str, job_argv: Sequence[str], timeout_s: float, burst: Optional[str] = None) -> List[str]:
    """The command that runs ``job_argv`` (this script's job flags) as ``regime``'s torchrun job on
    the emulated-host testbed (``burst``: its links' token-bucket depth, the testbed's default when
    None)."""
    r = REGIMES[regime]
    cmd = [sys.executable, "-m", "torchrec_sparselift.measure.testbed", "--hosts", str(r["hosts"]),
           "--ranks-per-host", str(r["ranks_per_host"]), "--timeout", str(int(timeout_s))]
    if r["rate"]:
        cmd += ["--rate", r["rate"]]
    if r["shared"]:
        cmd.append("--shared")
    if burst and r["rate"]:
        cmd += ["--burst", burst]
    return cmd + ["--", "-m", "benchmarks.regimes", "--job", "--regime", regime, *job_argv]


def job_argv(args, out: str) -> List[str]:
    """The job's flags: the driver's settings, resolved (so every regime runs the same ones)."""
    a = ["--workloads", ",".join(args.workloads), "--reps", str(args.reps), "--steps", str(args.steps),
         "--warmup", str(args.warmup), "--batches", str(args.batches), "--profile-from", args.profile_from,
         "--store", os.path.abspath(args.store), "--parity-steps", str(args.parity_steps), "--out", out]
    if args.calibration_steps:
        a += ["--calibration-steps", str(args.calibration_steps)]
    if args.quick:
        a.append("--quick")
    if args.keep_models:
        a.append("--keep-models")
    if args.calibrate:
        a.append("--calibrate")
    a.append("--rewrites" if args.rewrites else "--no-rewrites")
    a.append("--comm-part" if args.comm_part else "--no-comm-part")
    return a


def driver(args) -> int:
    out_dir = os.path.abspath(os.path.splitext(args.out)[0] + "_jobs")
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    order = [r for r in REGIMES if r in args.regimes]  # R1 first: the unshaped profile the others may use
    jobs: Dict[str, Any] = {}
    failed: Dict[str, str] = {}
    t0 = time.time()
    for regime in order:
        path = os.path.join(out_dir, f"{regime}.json")
        if os.path.exists(path):
            os.remove(path)
        cmd = testbed_command(regime, job_argv(args, path), args.timeout, args.burst)
        print(f"[regimes] {regime}: {REGIMES[regime]['doc']}\n  $ {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, env=env, cwd=REPO)
        try:
            code = proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGTERM)  # the testbed tears its namespaces down
            proc.wait(timeout=60)
            raise
        if code != 0 or not os.path.exists(path):
            failed[regime] = f"exit {code}"
            print(f"[regimes] {regime}: job failed ({failed[regime]}); continuing", flush=True)
            continue
        with open(path, encoding="utf-8") as f:
            jobs[regime] = json.load(f)
    replayed: Dict[str, Any] = {}
    wanted = replays_wanted(jobs) if args.comm_part else {}
    if wanted:  # the compute part of the network regimes' runs R1 did not run: those plans, unshaped
        want_path, path = os.path.join(out_dir, "replay_in.json"), os.path.join(out_dir, "replay.json")
        with open(want_path, "w", encoding="utf-8") as f:
            json.dump(wanted, f)
        if os.path.exists(path):
            os.remove(path)
        cmd = testbed_command(UNSHAPED, job_argv(args, path) + ["--replay", want_path], args.timeout, args.burst)
        n = sum(len(v) for v in wanted.values())
        print(f"[regimes] compute parts: {n} network-regime runs timed unshaped ({REGIMES[UNSHAPED]['doc']})\n"
              f"  $ {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, env=env, cwd=REPO)
        try:
            code = proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            raise
        if code != 0 or not os.path.exists(path):
            failed["replay"] = f"exit {code}"
            print(f"[regimes] compute parts: job failed ({failed['replay']}); the bounds cover R1's own runs only",
                  flush=True)
        else:
            with open(path, encoding="utf-8") as f:
                replayed = json.load(f).get("replayed") or {}
    settings = dict(regimes=order, workloads=args.workloads, reps=args.reps, steps=args.steps, warmup=args.warmup,
                    batches=args.batches, profile_from=args.profile_from, quick=args.quick,
                    fresh_models=not args.keep_models,
                    parity_steps=args.parity_steps, calibration_steps=args.calibration_steps, burst=args.burst,
                    wall_s=time.time() - t0, failed=failed, replayed=replayed)
    merged = merge_results(jobs, settings)
    print(format_summary(merged), flush=True)
    write_report(args.out, merged)
    print(f"[regimes] wrote {args.out} ({time.time() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.job:
        return replay_job(args) if args.replay else job(args)
    return driver(args)


if __name__ == "__main__":
    exit_now(main)
