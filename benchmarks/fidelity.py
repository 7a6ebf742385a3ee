"""Fidelity of step-time predictions: measured DLRM step time vs SparseLift's and TorchRec's estimate.

Three stages (``scripts/bench_fidelity.sh`` runs them in order)::

    python -m benchmarks.fidelity predict --out runs/fidelity/plans.pkl
    torchrun --standalone --nproc_per_node 2 -m benchmarks.fidelity measure \
        --plans runs/fidelity/plans.pkl --reps 3 --steps 60 --warmup 15 --out runs/fidelity/measured.json
    python -m benchmarks.fidelity report --plans runs/fidelity/plans.pkl \
        --measured runs/fidelity/measured.json [--profile profiles/cpu-2core-gloo.json]

``predict`` builds the DLRM example's model (``examples/dlrm``: its tables, ``build_model`` on the
meta device) and a set of deliberately different plans (:data:`PLAN_KINDS`: all table-wise, all
row-wise, all column-wise, mixed, imbalanced, data-parallel small tables, all data-parallel),
forced through ``SparseLiftPlanner`` constraints (the imbalanced plan by moving table-wise shards
afterwards). Each plan is scored by TorchRec's ``EmbeddingPerfEstimator`` rated like
``NoopPerfModel`` (max over ranks of summed shard perf; :func:`torchrec_score`) and saved.

``measure`` trains the example's model under every saved plan with the example's own
``shard_model`` and its pipeline, ``TrainPipelineSparseDist`` ( fused row-wise AdaGrad for sharded
tables, dense AdaGrad for the rest), plans interleaved round-robin ``--reps`` times, batches
generated before the timed loop (the example generates them inside it). Step time per run: the
median over steady-state steps of the slowest rank's step duration (``step_ms``), and the mean
(``mean_step_ms``); a plan's measured time is the median over repetitions.

``report`` prices the saved plans with ``evaluate_sharding_plan`` under ``--profile`` (so a refined
profile can be tried without re-measuring) and prints the table, MAPE and Spearman correlation.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import pickle
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.planners import to_sharding_plan
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from benchmarks.harness import interleaved_rounds, timed_steps, worker, write_report
from torchrec_sparselift import SparseLiftPlanner, evaluate_sharding_plan
from torchrec_sparselift.cost.hardware import get_profile
from torchrec_sparselift.cost.report import mape, spearman  # noqa: F401 (F.mape/F.spearman in tests)
from torchrec_sparselift.cost.torchrec_score import torchrec_score
from torchrec_sparselift.dlrm import model as dlrm_model
from torchrec_sparselift.dlrm import tables as dlrm_tables
from torchrec_sparselift.dlrm.data import synthetic_batches
from torchrec_sparselift.dlrm.logs import quiet_logs

__all__ = [
    "PLAN_KINDS",
    "FidelityConfig",
    "size_class",
    "sharding_types_for",
    "table_constraints",
    "imbalance_ranks",
    "mape",
    "spearman",
    "fit_fields",
    "linear_terms",
    "fidelity_summary",
    "build_cases",
    "predict_ours",
    "measure_cases",
    "main",
]

# Each plan kind: (description, {size class -> sharding type}); "auto" leaves the choice to SparseLift.
PLAN_KINDS: Dict[str, Tuple[str, Dict[str, str]]] = {
    "table_wise": ("every table table-wise", dict(large="table_wise", medium="table_wise", small="table_wise")),
    "row_wise": ("every table row-wise", dict(large="row_wise", medium="row_wise", small="row_wise")),
    "column_wise": ("every table column-wise (2 column shards)",
                    dict(large="column_wise", medium="column_wise", small="column_wise")),
    "mixed": ("large row-wise, medium column-wise, small table-wise",
              dict(large="row_wise", medium="column_wise", small="table_wise")),
    "imbalanced": ("every table table-wise, all on rank 0 but the last small one",
                   dict(large="table_wise", medium="table_wise", small="table_wise")),
    "dp_small": ("small tables data-parallel, the rest table-wise",
                 dict(large="table_wise", medium="table_wise", small="data_parallel")),
    "data_parallel": ("every table data-parallel (large tables' gradients all-reduced)",
                      dict(large="data_parallel", medium="data_parallel", small="data_parallel")),
    "auto": ("SparseLift's own choice", {}),
}
# the plans of the benchmark: six deliberately different ones plus an all-data-parallel one ("auto" repeats
# table_wise's placement on the DLRM workload, so it only serves as a noise control)
DEFAULT_KINDS = ("table_wise", "row_wise", "column_wise", "mixed", "imbalanced", "dp_small", "data_parallel")
LARGE_ROWS = 10_000  # tables with at least this many rows are "large"
SMALL_ROWS = 200  # tables with at most this many rows are "small"; between: "medium"
KERNEL_FOR = {"data_parallel": "dense"}  # every other sharding type uses the "fused" kernel on CPU


@attrs.frozen
class FidelityConfig:
    """The DLRM workload the plans are made and measured for (the example's flags)."""

    tables: str = "dcnv2"
    scale: float = 0.001
    embedding_dim: Optional[int] = None
    model: str = "dlrm"  # the example's --model: dlrm (light dense part) or dcn
    arch: str = "small"
    batch_size: int = 256  # per rank
    world_size: int = 2
    column_shard_dim: int = 64  # min_partition of column-wise plans
    seed: int = 0
    zipf_alpha: float = 1.05
    signal: float = 3.0
    lr: float = 0.05
    dense_lr: float = 0.005


def size_class(rows: int) -> str:
    """"large" (>= LARGE_ROWS rows), "small" (<= SMALL_ROWS) or "medium"."""
    if rows >= LARGE_ROWS:
        return "large"
    if rows <= SMALL_ROWS:
        return "small"
    return "medium"


def sharding_types_for(kind: str, tables: Sequence[Any]) -> Dict[str, Optional[str]]:
    """Table name -> the sharding type plan ``kind`` forces on it (None: the planner chooses)."""
    if kind not in PLAN_KINDS:
        raise ValueError(f"unknown plan kind {kind!r}: use one of {sorted(PLAN_KINDS)}")
    by_class = PLAN_KINDS[kind][1]
    return {t.name: by_class.get(size_class(t.rows)) for t in tables}


def table_constraints(
    tables: Sequence[Any], forced: Mapping[str, Optional[str]], column_shard_dim: int
) -> Dict[str, Any]:
    """TorchRec ``ParameterConstraints`` per table: the data's pooling factor always (both
    estimators read it), and where ``forced`` names a sharding type, that type with its CPU
    kernel (column-wise: ``min_partition=column_shard_dim``)."""
    out = {}
    for t in tables:
        st = forced.get(t.name)
        kw: Dict[str, Any] = dict(pooling_factors=[float(b) for b in t.bag_sizes()])
        if st is not None:
            kw.update(sharding_types=[st], compute_kernels=[KERNEL_FOR.get(st, "fused")])
            if st in ("column_wise", "table_column_wise"):
                kw.update(min_partition=column_shard_dim)
        out[t.name] = ParameterConstraints(**kw)
    return out


def imbalance_ranks(names: Sequence[str], rows: Sequence[int]) -> Dict[str, int]:
    """Rank of each table in the imbalanced plan: everything on rank 0 except the smallest
    table, on rank 1 (so rank 1 still takes part in every collective)."""
    if not names:
        return {}
    smallest = min(range(len(names)), key=lambda i: (rows[i], names[i]))
    return {n: (1 if i == smallest else 0) for i, n in enumerate(names)}


def fidelity_summary(measured: Sequence[float], predicted: Sequence[float]) -> Dict[str, float]:
    """MAPE (fraction), Spearman correlation and mean signed error (fraction) of one predictor."""
    bias = sum((p - m) / m for p, m in zip(predicted, measured)) / len(measured)
    return dict(mape=mape(predicted, measured), spearman=spearman(predicted, measured), bias=bias)


# ---------------------------------------------------------------- plans and predictions (torchrec)


def resolve_tables(cfg: FidelityConfig) -> List[Any]:
    """The DLRM library's tables for ``cfg`` (preset, dim override, scale)."""
    tables = dlrm_tables.preset_tables(cfg.tables, cfg.embedding_dim)
    return dlrm_tables.scale_tables(tables, cfg.scale)


def build_model(cfg: FidelityConfig, tables: Sequence[Any]):
    """The DLRM library's DLRMTrain model (``cfg.model``: DLRM or DLRM_DCN) on the meta device."""
    dim = dlrm_tables.check_uniform_dim(tables)
    return dlrm_model.build_model(tables, cfg.model, dlrm_model.arch_spec(cfg.arch, dim))


def topology_for(cfg: FidelityConfig):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Topology(world_size=cfg.world_size, local_world_size=cfg.world_size, compute_device="cpu")


@attrs.frozen
class Case:
    """One plan to measure: its kind, the ShardingPlan, TorchRec's estimate and SparseLift's
    prediction under the profile used by ``predict``."""

    name: str
    description: str
    plan: Any = attrs.field(eq=False, repr=False)
    summary: Tuple[Tuple[str, str, Tuple[int, ...]], ...] = attrs.field(repr=False)
    torchrec_ms: float
    torchrec_rank_ms: Tuple[float, ...]
    ours_ms: float


def _plan_summary(plan) -> Tuple[Tuple[str, str, Tuple[int, ...]], ...]:
    rows = []
    for _path, mp in sorted(plan.plan.items()):
        for table, ps in sorted(mp.items()):
            rows.append((table, ps.sharding_type, tuple(sorted(set(ps.ranks or ())))))
    return tuple(rows)


def predict_ours(cfg: FidelityConfig, plan, profile, tables=None, model=None) -> float:
    """SparseLift's predicted step time (ms) of ``plan`` (TrainPipelineSparseDist, fp32 comm)
    for the DLRM model of ``cfg``, priced with ``profile``, dense part included."""
    tables = tables if tables is not None else resolve_tables(cfg)
    model = model if model is not None else build_model(cfg, tables)
    cons = table_constraints(tables, {}, cfg.column_shard_dim)
    res = evaluate_sharding_plan(model, plan, topology_for(cfg), cfg.batch_size, cons,
                                 hardware=profile, pipeline="sparse_dist")
    return res.step_time_s * 1e3


def build_cases(cfg: FidelityConfig, kinds: Sequence[str], profile) -> List[Case]:
    """One :class:`Case` per plan kind: planned by SparseLiftPlanner under the kind's
    constraints (imbalanced: its table-wise shards then moved per :func:`imbalance_ranks`),
    scored by TorchRec's estimator and by SparseLift's model under ``profile``."""
    tables = resolve_tables(cfg)
    topo = topology_for(cfg)
    sharders = get_default_sharders()
    pf_only = table_constraints(tables, {}, cfg.column_shard_dim)
    cases = []
    for kind in kinds:
        model = build_model(cfg, tables)
        cons = table_constraints(tables, sharding_types_for(kind, tables), cfg.column_shard_dim)
        planner = SparseLiftPlanner(topology=topo, batch_size=cfg.batch_size, constraints=cons,
                                    hardware=profile, pipelines=["sparse_dist"], debug=False)
        plan = planner.plan(model, sharders)
        options = list(planner.last_result.sharding_options)
        if kind == "imbalanced":
            options = [copy.copy(o) for o in options]
            names = [o.name for o in options]
            rows = [o.tensor.shape[0] for o in options]
            target = imbalance_ranks(names, rows)
            for o in options:
                if o.sharding_type != "table_wise":
                    raise RuntimeError(f"imbalanced plan: table {o.name!r} is {o.sharding_type}, expected table_wise")
                o.shards = [_moved_shard(s, target[o.name]) for s in o.shards]
            plan = to_sharding_plan(options, topo)
        tr = torchrec_score(options, topo, sharders, pf_only)
        ours = predict_ours(cfg, plan, profile, tables, model)
        cases.append(Case(name=kind, description=PLAN_KINDS[kind][0], plan=plan, summary=_plan_summary(plan),
                          torchrec_ms=float(tr.perf_ms), torchrec_rank_ms=tuple(tr.rank_perf_ms), ours_ms=ours))
    return cases


def _moved_shard(shard, rank: int):
    """A copy of TorchRec ``Shard`` ``shard`` placed on ``rank``."""
    s = copy.copy(shard)
    s.rank = rank
    return s


# ---------------------------------------------------------------- measurement (under torchrun)


def _sparse_dist_step(dmp, optimizer, batches: Sequence[Any], device) -> Callable[[], Any]:
    """One training step of TorchRec's ``TrainPipelineSparseDist`` (the example's pipeline) over
    ``batches`` per call; it returns the step's loss."""
    pipeline = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
    it = iter(batches)
    return lambda: pipeline.progress(it)[0]


def measure_cases(cfg: FidelityConfig, cases: Sequence[Tuple[str, Any]], reps: int, steps: int, warmup: int,
                  log=print) -> List[Dict[str, Any]]:
    """Train the DLRM model under each ``(name, plan)`` for ``steps`` steps (the first ``warmup``
    of them left out of the statistics), ``reps`` interleaved rounds (the order rotated each round), a fresh model per
    run; one record per run (every rank returns the same).

    Record: name, rep, step_ms (median over the steps after ``warmup`` of the slowest rank's
    step duration), mean_step_ms (steady-state seconds / steps, slowest rank), load average."""
    rank, world_size, pg = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    if world_size != cfg.world_size:
        raise RuntimeError(f"plans were made for {cfg.world_size} ranks, running on {world_size}")
    tables = resolve_tables(cfg)
    device = torch.device("cpu")
    batches = list(synthetic_batches(tables, cfg.batch_size, cfg.seed, rank, steps, cfg.zipf_alpha, cfg.signal))
    if cases:  # one untimed run first: the process's first training pays one-off costs
        model = build_model(cfg, tables)
        dmp, opt = dlrm_model.shard_model(model, cases[0][1], device, cfg.lr, "adagrad", cfg.dense_lr)
        step = _sparse_dist_step(dmp, opt, batches, device)
        for _ in range(max(2, warmup)):
            step()
        dist.barrier()
        del dmp, opt, model, step
        gc.collect()
    records = []

    def measure(case: Tuple[str, Any], rep: int) -> None:
        name, plan = case
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, tables)
        dmp, opt = dlrm_model.shard_model(model, plan, device, cfg.lr, "adagrad", cfg.dense_lr)
        load_before = os.getloadavg()[0]
        losses: List[Any] = []
        timer = timed_steps(_sparse_dist_step(dmp, opt, batches, device), steps - warmup, pg, device, warmup=warmup,
                            on_step=losses.append)
        durs = torch.tensor(timer.slowest_rank_durations_s(pg)[warmup:], dtype=torch.float64)
        cpus = torch.tensor(timer.slowest_rank_cpu_durations_s(pg)[warmup:], dtype=torch.float64)
        total = torch.tensor([sum(timer.steady_durations_s)], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pg)
        rec = dict(name=name, rep=rep, step_ms=float(durs.median()) * 1e3,
                   mean_step_ms=float(total) / (steps - warmup) * 1e3,
                   cpu_step_ms=float(cpus.median()) * 1e3,
                   p10_step_ms=float(durs.quantile(0.1)) * 1e3,
                   load_before=load_before, load_after=os.getloadavg()[0],
                   loss_last=float(losses[-1].detach()) if losses else float("nan"))
        if not math.isfinite(rec["loss_last"]):
            raise RuntimeError(f"plan {name}: training diverged (loss {rec['loss_last']})")
        records.append(rec)
        if rank == 0:
            log(f"[fidelity] rep {rep} {name:<12} median {rec['step_ms']:8.2f} ms  mean "
                f"{rec['mean_step_ms']:8.2f} ms  cpu {rec['cpu_step_ms']:8.2f} ms  load {load_before:.1f}", flush=True)
        del dmp, opt, model
        gc.collect()

    interleaved_rounds(list(cases), measure, reps)
    return records


def measured_per_plan(records: Sequence[Mapping[str, Any]], key: str = "step_ms", stat: str = "median"
                      ) -> Dict[str, float]:
    """Plan name -> ``stat`` ("median" or "min") of ``key`` over its repetitions. The minimum
    estimates the step without interference from other processes (which only adds time)."""
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    by: Dict[str, List[float]] = {}
    for r in records:
        by.setdefault(r["name"], []).append(float(r[key]))
    out = {}
    for n, xs in by.items():
        xs = sorted(xs)
        k = len(xs)
        if stat == "min":
            out[n] = xs[0]
        else:
            out[n] = xs[k // 2] if k % 2 else 0.5 * (xs[k // 2 - 1] + xs[k // 2])
    return out


# ---------------------------------------------------------------- hold-out refit of a profile

FIT_FIELDS = ("lookup_overhead_s", "1/dense_flops")


def field_value(profile, field: str) -> float:
    """``profile``'s value of ``field``; ``"1/name"`` is the reciprocal of field ``name`` (a rate
    enters the step time as its inverse, so it is fitted as one)."""
    if field.startswith("1/"):
        return 1.0 / float(getattr(profile, field[2:]))
    return float(getattr(profile, field))


def with_field(profile, field: str, value: float):
    """``profile`` with ``field`` (see :func:`field_value`) set to ``value``."""
    if field.startswith("1/"):
        if value <= 0:
            raise ValueError(f"{field} must be > 0 to be set, got {value} (the rate would be infinite)")
        return attrs.evolve(profile, **{field[2:]: 1.0 / value})
    return attrs.evolve(profile, **{field: value})


def linear_terms(cfg: FidelityConfig, plan, profile, fields: Sequence[str], tables=None, model=None,
                 rel: float = 0.5) -> Tuple[float, Dict[str, float]]:
    """SparseLift's prediction (ms) of ``plan`` under ``profile`` and its slope (ms per unit) in
    each profile field of ``fields``, by a finite difference of ``rel`` times the field's value
    (the step time is piecewise linear in these fields; :func:`fit_fields` checks the refit
    with a full evaluation)."""
    base = predict_ours(cfg, plan, profile, tables, model)
    slopes = {}
    for f in fields:
        x0 = field_value(profile, f)
        dx = rel * x0 if x0 > 0 else 1e-4
        up = predict_ours(cfg, plan, with_field(profile, f, x0 + dx), tables, model)
        slopes[f] = (up - base) / dx
    return base, slopes


def fit_fields(points: Sequence[Tuple[float, Mapping[str, float], float]], x0: Mapping[str, float]
               ) -> Dict[str, float]:
    """Non-negative values of the fields in ``x0`` minimising the squared relative error of the
    linearised predictions ``base + sum_f slope_f * (x_f - x0_f)`` against the measurements;
    ``points`` holds ``(base_ms, slopes, measured_ms)`` per training plan. A field that no
    point's prediction depends on keeps its ``x0`` value."""
    # a field no training point depends on is not determined by them: it keeps its value
    fields = [f for f in x0 if any(sl[f] != 0 for _b, sl, _m in points)]
    out = {f: float(v) for f, v in x0.items()}
    if not fields:
        return out
    A = np.array([[sl[f] / m for f in fields] for _b, sl, m in points])
    b = np.array([(m - (base - sum(sl[f] * x0[f] for f in x0))) / m for base, sl, m in points])
    x, _ = nnls(A, b)
    out.update({f: float(v) for f, v in zip(fields, x)})
    return out


def refit(profile, points: Sequence[Tuple[float, Mapping[str, float], float]], fields: Sequence[str], name: str):
    """``profile`` with ``fields`` refitted by :func:`fit_fields` on ``points``."""
    values = fit_fields(points, {f: field_value(profile, f) for f in fields})
    out = attrs.evolve(profile, name=name)
    for f, v in values.items():
        out = with_field(out, f, v)
    return out, values


def _cmd_fit(args) -> int:
    data = _load_plans(args.plans)
    with open(args.measured, encoding="utf-8") as f:
        measured = json.load(f)
    cfg = data["config"]
    profile = get_profile(args.profile or data["profile"])
    meas = measured_per_plan(measured["records"], args.key, args.stat)
    cases = [c for c in data["cases"] if c.name in meas]
    train_names = args.train.split(",") if args.train else [c.name for c in cases]
    tables = resolve_tables(cfg)
    model = build_model(cfg, tables)
    fields = args.fields.split(",")
    terms = {}
    for c in cases:
        base, slopes = linear_terms(cfg, c.plan, profile, fields, tables, model)
        terms[c.name] = (base, slopes, meas[c.name])
        print(f"{c.name:<12} measured {meas[c.name]:7.2f} ms  predicted {base:7.2f} ms  slopes "
              + ", ".join(f"{k} {v:.4g}" for k, v in slopes.items()))
    points = [terms[n] for n in train_names]
    if len(points) < len(fields):
        raise SystemExit(f"need at least {len(fields)} training plans for {fields}, got {len(points)}")
    refined, values = refit(profile, points, fields, args.name)
    refined.save(args.out)
    print("fitted on " + ",".join(train_names) + ": "
          + ", ".join(f"{k} = {v:.6g} (was {field_value(profile, k):.6g})" for k, v in values.items()))
    print(f"wrote {args.out}")
    if args.loo:
        # leave-one-out: each plan predicted by a profile fitted on the other plans only
        rows = []
        for c in cases:
            others = [terms[n] for n in terms if n != c.name]
            prof_c, _ = refit(profile, others, fields, args.name)
            rows.append(dict(plan=c.name, measured_ms=meas[c.name],
                             ours_ms=predict_ours(cfg, c.plan, prof_c, tables, model), torchrec_ms=c.torchrec_ms))
        m = [r["measured_ms"] for r in rows]
        rep = dict(rows=rows, ours=fidelity_summary(m, [r["ours_ms"] for r in rows]),
                   torchrec=fidelity_summary(m, [r["torchrec_ms"] for r in rows]),
                   fields=fields, key=args.key, note="ours: leave-one-out (each plan's profile fitted on the others)")
        print("leave-one-out (each plan predicted by a profile fitted on the other plans):")
        print(format_report(rep))
        if args.loo_out:
            write_report(args.loo_out, rep)
    return 0


# ---------------------------------------------------------------- command line


def _load_plans(path: str) -> Dict[str, Any]:
    with open(path, "rb") as f:
        data = pickle.load(f)
    data["config"] = FidelityConfig(**data["config"])
    data["cases"] = [Case(**c) for c in data["cases"]]
    return data


def _cmd_predict(args) -> int:
    cfg = FidelityConfig(tables=args.tables, scale=args.scale, embedding_dim=args.embedding_dim,
                         model=args.model, batch_size=args.batch_size)
    profile = get_profile(args.profile)
    kinds = args.kinds.split(",")
    cases = build_cases(cfg, kinds, profile)
    for c in cases:
        types = {}
        for _t, st, _r in c.summary:
            types[st] = types.get(st, 0) + 1
        print(f"{c.name:<12} ours {c.ours_ms:8.2f} ms  torchrec {c.torchrec_ms:8.2f} ms  "
              f"(ranks {', '.join(f'{x:.2f}' for x in c.torchrec_rank_ms)})  {types}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "wb") as f:
        pickle.dump(dict(config=attrs.asdict(cfg), profile=args.profile,
                         cases=[attrs.asdict(c, recurse=False) for c in cases]), f)
    print(f"wrote {args.out}")
    return 0


def _cmd_measure(args) -> int:
    data = _load_plans(args.plans)
    cfg = data["config"]
    quiet_logs()
    with worker():
        names = args.kinds.split(",") if args.kinds else [c.name for c in data["cases"]]
        chosen = [(c.name, c.plan) for c in data["cases"] if c.name in names]
        t0 = time.time()
        recs = measure_cases(cfg, chosen, args.reps, args.steps, args.warmup)
        if dist.get_rank() == 0:
            out = dict(config=attrs.asdict(cfg), steps=args.steps, warmup=args.warmup, reps=args.reps,
                       wall_s=time.time() - t0, records=recs,
                       started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                       torch=torch.__version__)
            write_report(args.out, out)
            print(f"[fidelity] wrote {args.out}")
        dist.barrier()
    return 0


def report(data: Mapping[str, Any], measured: Mapping[str, Any], profile, key: str = "step_ms",
           kinds: Optional[Sequence[str]] = None, stat: str = "median") -> Dict[str, Any]:
    """Rows (plan, measured, ours, TorchRec; ms) and each predictor's :func:`fidelity_summary`,
    SparseLift re-priced under ``profile``; only the plans in ``kinds`` when given."""
    cfg = data["config"]
    meas = measured_per_plan(measured["records"], key, stat)
    tables = resolve_tables(cfg)
    model = build_model(cfg, tables)
    rows = []
    for c in data["cases"]:
        if c.name not in meas or (kinds is not None and c.name not in kinds):
            continue
        rows.append(dict(plan=c.name, description=c.description, measured_ms=meas[c.name],
                         ours_ms=predict_ours(cfg, c.plan, profile, tables, model), torchrec_ms=c.torchrec_ms))
    m = [r["measured_ms"] for r in rows]
    return dict(rows=rows, ours=fidelity_summary(m, [r["ours_ms"] for r in rows]),
                torchrec=fidelity_summary(m, [r["torchrec_ms"] for r in rows]))


def format_report(rep: Mapping[str, Any]) -> str:
    """The report as a markdown table plus one line per predictor."""
    lines = ["| plan | measured ms | SparseLift ms | TorchRec ms |", "|---|---:|---:|---:|"]
    for r in rep["rows"]:
        lines.append(f"| {r['plan']} | {r['measured_ms']:.1f} | {r['ours_ms']:.1f} | {r['torchrec_ms']:.2f} |")
    for who in ("ours", "torchrec"):
        s = rep[who]
        lines.append(f"\n{who}: MAPE {s['mape'] * 100:.1f}%, Spearman {s['spearman']:.3f}, "
                     f"mean signed error {s['bias'] * 100:+.1f}%")
    return "\n".join(lines)


SUMMARY_COLUMNS = (("wall median", "step_ms", "median"), ("wall min", "step_ms", "min"),
                   ("CPU median", "cpu_step_ms", "median"))


def summary_markdown(data: Mapping[str, Any], measured: Mapping[str, Any], profile,
                     subsets: Sequence[Tuple[str, Optional[Sequence[str]]]]) -> str:
    """Two markdown tables: per plan the measured times (:data:`SUMMARY_COLUMNS`) and both
    predictions; per measurement and plan subset, MAPE and Spearman of both predictors."""
    reps = {c[0]: report(data, measured, profile, c[1], None, c[2]) for c in SUMMARY_COLUMNS}
    lines = ["| plan | " + " | ".join(f"measured {c[0]} ms" for c in SUMMARY_COLUMNS)
             + " | SparseLift ms | TorchRec ms |", "|---|" + "---:|" * (len(SUMMARY_COLUMNS) + 2)]
    first = reps[SUMMARY_COLUMNS[0][0]]["rows"]
    for i, r in enumerate(first):
        lines.append(f"| {r['plan']} | " + " | ".join(f"{reps[c[0]]['rows'][i]['measured_ms']:.1f}"
                                                    for c in SUMMARY_COLUMNS)
                     + f" | {r['ours_ms']:.1f} | {r['torchrec_ms']:.2f} |")
    lines += ["", "| measured | plans | SparseLift MAPE | SparseLift Spearman | TorchRec MAPE | TorchRec Spearman |",
              "|---|---|---:|---:|---:|---:|"]
    for label, key, stat in SUMMARY_COLUMNS:
        for name, kinds in subsets:
            rp = report(data, measured, profile, key, kinds, stat)
            o, t = rp["ours"], rp["torchrec"]
            lines.append(f"| {label} | {name} | {o['mape'] * 100:.1f}% | {o['spearman']:.2f} | "
                         f"{t['mape'] * 100:.1f}% | {t['spearman']:.2f} |")
    recs = measured["records"]
    lines.append(f"\nmeasured {measured.get('started', '?')}, {measured.get('wall_s', float('nan')):.0f} s, "
                 f"{measured.get('reps')} repetitions of {measured.get('steps')} steps ({measured.get('warmup')} "
                 f"warm-up), load average {min(r['load_before'] for r in recs):.1f}-"
                 f"{max(r['load_after'] for r in recs):.1f}")
    return "\n".join(lines)


def _cmd_summary(args) -> int:
    data = _load_plans(args.plans)
    with open(args.measured, encoding="utf-8") as f:
        measured = json.load(f)
    six = [k for k in DEFAULT_KINDS if k != "data_parallel"]
    print(summary_markdown(data, measured, get_profile(args.profile or data["profile"]),
                           [(f"all {len(data['cases'])}", None), (f"{len(six)} sharded", six)]))
    return 0


def _cmd_report(args) -> int:
    data = _load_plans(args.plans)
    with open(args.measured, encoding="utf-8") as f:
        measured = json.load(f)
    kinds = args.kinds.split(",") if args.kinds else None
    rep = report(data, measured, get_profile(args.profile or data["profile"]), args.key, kinds, args.stat)
    rep["stat"] = args.stat
    rep["profile"] = args.profile or data["profile"]
    rep["key"] = args.key
    print(format_report(rep))
    if args.out:
        write_report(args.out, rep)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("predict", help="make the plans and score them")
    pp.add_argument("--out", required=True)
    pp.add_argument("--profile", default="profiles/cpu-2core-gloo.json")
    pp.add_argument("--kinds", default=",".join(DEFAULT_KINDS))
    pp.add_argument("--tables", default="dcnv2")
    pp.add_argument("--scale", type=float, default=0.001)
    pp.add_argument("--embedding-dim", type=int)
    pp.add_argument("--model", choices=["dlrm", "dcn"], default="dlrm")
    pp.add_argument("--batch-size", type=int, default=256)
    pm = sub.add_parser("measure", help="train under every plan (run with torchrun, 2 ranks)")
    pm.add_argument("--plans", required=True)
    pm.add_argument("--out", required=True)
    pm.add_argument("--kinds", help="comma-separated subset of the saved plans")
    pm.add_argument("--reps", type=int, default=3)
    pm.add_argument("--steps", type=int, default=60)
    pm.add_argument("--warmup", type=int, default=15)
    pr = sub.add_parser("report", help="MAPE and Spearman of both predictors")
    pr.add_argument("--plans", required=True)
    pr.add_argument("--measured", required=True)
    pr.add_argument("--profile", help="re-price with this profile (default: the one predict used)")
    pr.add_argument("--key", choices=["step_ms", "mean_step_ms", "cpu_step_ms", "p10_step_ms"], default="step_ms")
    pr.add_argument("--kinds", help="comma-separated subset of the plans to report")
    pr.add_argument("--stat", choices=["median", "min"], default="median", help="over repetitions")
    pr.add_argument("--out")
    ps = sub.add_parser("summary", help="markdown tables: wall median/min and CPU time vs both predictors")
    ps.add_argument("--plans", required=True)
    ps.add_argument("--measured", required=True)
    ps.add_argument("--profile", help="re-price with this profile (default: the one predict used)")
    pf = sub.add_parser("fit", help="refit profile fields on a subset of plans (hold out the rest)")
    pf.add_argument("--plans", required=True)
    pf.add_argument("--measured", required=True)
    pf.add_argument("--train", help="comma-separated plan names to fit on (default: all measured)")
    pf.add_argument("--loo", action="store_true", help="also report leave-one-out predictions")
    pf.add_argument("--loo-out", help="write the leave-one-out report JSON here")
    pf.add_argument("--fields", default=",".join(FIT_FIELDS))
    pf.add_argument("--profile", help="the profile to refine (default: the one predict used)")
    pf.add_argument("--key", choices=["step_ms", "mean_step_ms", "cpu_step_ms", "p10_step_ms"], default="step_ms")
    pf.add_argument("--stat", choices=["median", "min"], default="median", help="over repetitions")
    pf.add_argument("--name", default="cpu-2core-gloo-fidelity")
    pf.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "measure" and not 0 <= args.warmup < args.steps - 1:
        p.error("--warmup must be in [0, --steps - 1)")
    cmds = {"predict": _cmd_predict, "measure": _cmd_measure, "report": _cmd_report, "fit": _cmd_fit,
            "summary": _cmd_summary}
    return cmds[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
