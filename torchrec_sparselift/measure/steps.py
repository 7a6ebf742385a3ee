"""Step calibration: train the probe plans on this machine and fit the profile to their steps.

    torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate steps [--quick]

runs the probe plans (:data:`torchrec_sparselift.measure.probe.PLAN_KINDS`: all table-wise, all
row-wise, all data-parallel, all column-wise, mixed, the smaller half data-parallel (``dp_small``),
the table-wise shards in two sharding groups (``two_groups``)) on the probe models
(:data:`~torchrec_sparselift.measure.probe.PROBE_WORKLOADS`) for a few steps each
(:func:`measure_probes`), with the host work measured alone before and after (:func:`host_terms`),
prices every plan with the cost model (:class:`~torchrec_sparselift.calibration.pricer.PlanPricer`,
the same evaluator the planner optimizes), fits the profile's terms
(:func:`torchrec_sparselift.calibration.step_fit.fit_probe_plans`) and stores the profile in the
:class:`~torchrec_sparselift.calibration.store.ProfileStore` under this machine's fingerprint (rank 0
writes; the path is printed). The base profile is the shipped CPU microbenchmark profile
(:func:`~torchrec_sparselift.calibration.store.base_profile`).

The calibration first measures the link its ranks see
(:func:`~torchrec_sparselift.measure.link.measure_link_rates`, a few seconds) and stores it with
the profile; the fingerprint records the hosts it saw.

``sparselift calibrate steps --from-measurements PATH`` refits a saved set in one process;
``sparselift calibrate check`` says whether this machine's stored profile is current;
``sparselift calibrate check --link`` (under torchrun) also measures the link the job sees and
fails when it differs from the stored profile's beyond the measured spread.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import time
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.calibration.link import with_link_facts, with_link_latency
from torchrec_sparselift.calibration.pricer import PlanPricer
from torchrec_sparselift.calibration.records import HostTermRecord, ProbeMeasurement, ProbeRecord
from torchrec_sparselift.calibration.rewrite_fit import ChunkCostFit, step_chunk_cost
from torchrec_sparselift.calibration.step_fit import FitRecord, StepFit, fit_probe_plans, records_mape, stored_info
from torchrec_sparselift.calibration.store import (
    MAX_DRIFT_SPREAD,
    ProfileStore,
    base_profile,
    calibrate_command,
    current_fingerprint,
    drift_spread,
    stored_profile_problems,
)
from torchrec_sparselift.cost.batch_split import SplitTerms, chunk_latency_within, chunk_link_latency_s, split_step_s
from torchrec_sparselift.cost.evaluator import PlanEvaluator
from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile
from torchrec_sparselift.errors import FileFormatError
from torchrec_sparselift.pictures import fit_png, fit_points, require_matplotlib
from torchrec_sparselift.runtime.process_group import close_process_group
from torchrec_sparselift import defaults
from torchrec_sparselift.calibration.link import LinkRatesError, differing_terms
from torchrec_sparselift.measure import probe
from torchrec_sparselift.measure.link import measure_link_rates
from torchrec_sparselift.measure.microbench import bench_a2a_byte_s, bench_host_terms
from torchrec_sparselift.measure.probe import probe_constraints
from torchrec_sparselift.plan.evaluate import GivenPlan
from torchrec_sparselift.planner import SparseLiftPlanner
from torchrec_sparselift.runtime.pipelines import make_train_pipeline
from torchrec_sparselift.vocabulary import BASE, FUSED, OVERLAP, PREFETCH, SPARSE_DIST, TABLE_WISE

__all__ = [
    "forced_plan",
    "probe_topology",
    "measure_probes",
    "StepTiming",
    "REFERENCE_PLAN",
    "ReferencePlan",
    "reference_drifts",
    "host_terms",
    "probe_pricers",
    "fit_measurements",
    "calibrate_steps",
    "save_measurement_set",
    "load_measurement_set",
    "run_steps",
    "run_check",
]

logger = logging.getLogger(__name__)


def probe_topology(world_size: int, device: str):
    """A one-host TorchRec ``Topology`` of ``world_size`` ranks on ``device`` (the probes' topology)."""
    from torchrec.distributed.planner import Topology

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Topology(world_size=world_size, local_world_size=world_size, compute_device=device)


def forced_plan(model: Any, tables: Sequence[Any], kind: str, topology: Any, batch_size: int, pg: Any = None,
                profile: Optional[HardwareProfile] = None, stats: Any = None):
    """A plan with ``kind`` forced (probe constraints), placed by ``SparseLiftPlanner`` (TorchRec's
    planner offers no row-wise sharding on CPU; SparseLift's does and DMP runs it; ``stats``: its
    ``workload=``); collective over ``pg`` when given. Returns ``(plan, constraints)``."""
    from torchrec.distributed.sharding_plan import get_default_sharders

    cons = probe_constraints(tables, kind)
    planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=cons,
                                hardware=profile or base_profile(topology.compute_device),
                                pipelines=[SPARSE_DIST], debug=False, workload=stats,
                                never_slower=False)  # the forced plan as SparseLift places it
    sharders = get_default_sharders()
    plan = planner.collective_plan(model, sharders, pg) if pg is not None else planner.plan(model, sharders)
    return plan, cons


#: Distinct pre-built batches each probe plan trains on (cycled); their statistics price it.
PROBE_BATCHES = 6
#: Profiled steps after each probe plan's timed steps: the attribution the fit splits into groups.
ATTRIBUTED_STEPS = 5


def measure_probes(
    pg: Any,
    device_type: str = "cpu",
    workloads: Optional[Sequence[Any]] = None,
    kinds: Optional[Sequence[str]] = None,
    steps: Optional[int] = None,
    warmup: Optional[int] = None,
    progress: bool = True,
    base: Optional[HardwareProfile] = None,
    attribute: int = ATTRIBUTED_STEPS,
    normalize: bool = True,
) -> List[ProbeMeasurement]:
    """Train every probe plan on every rank of ``pg``; one
    :class:`~torchrec_sparselift.calibration.records.ProbeMeasurement` per plan (the median step of
    the per-step slowest rank; the same on every rank; its ``attribution``: the dict of ``attribute``
    more steps run under the profiler after the timed ones,
    :func:`torchrec_sparselift.measure.attribution.attribute_steps`, or None when 0).
    ``steps`` / ``warmup`` default to the harness's (``measure.probe.DEFAULT_TIMING``).

    ``normalize``: a shared machine's speed drifts within one calibration (measured: 1.8x between
    two workloads a minute apart), which no profile can fit. The reference plan
    (:data:`REFERENCE_PLAN`: its workload's table-wise plan) is measured before the first workload and
    after each one; every plan's seconds are scaled by ``median(reference) / reference around its
    workload`` (the geometric mean of the measurements before and after it), so all plans are priced
    at the calibration's median machine speed. ``drift`` is that factor's inverse (1.0 when not
    normalized)."""
    import torch
    import torch.distributed as dist

    workloads = list(workloads or probe.PROBE_WORKLOADS)
    kinds = list(kinds or probe.PLAN_KINDS)
    rank, W = dist.get_rank(pg), dist.get_world_size(pg)
    device = torch.device(device_type)
    topo = probe_topology(W, device_type)
    ref = ReferencePlan(pg, base, next((w for w in workloads if w.name == REFERENCE_PLAN[0]), workloads[0]),
                        device_type)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(w.kinds(kinds)) for w in workloads) + (len(workloads) + 1 if normalize else 0),
                   desc="calibrate",
                   unit="plan", file=sys.stdout, ascii=True, mininterval=0.5)

    def reference() -> float:
        n_warm = probe.DEFAULT_TIMING["warmup"] if warmup is None else warmup
        n_steps = max(REFERENCE_STEPS, probe.DEFAULT_TIMING["steps"] if steps is None else steps)
        m = ref.measure(n_steps, n_warm)
        # the lower quartile of its steps: a slow stretch of the machine slows them all, a transient
        # (a neighbour's burst of a few hundred ms) only some (a single reading's median was once 1.6x)
        sec = float(np.quantile(np.asarray(m.durations_s[n_warm:]), 0.25))
        if bar is not None:
            bar.set_postfix_str(f"reference {sec * 1e3:.1f} ms", refresh=False)
            bar.update(1)
        return sec

    refs = [reference()] if normalize else []
    raw = []
    for w in workloads:
        batches = probe.prebuilt_batches(w, PROBE_BATCHES, seed=0, rank=rank)
        for kind in w.kinds(kinds):
            plan, cons = forced_plan(probe.probe_model(w), w.tables, kind, topo, w.batch_size, pg, base,
                                     stats=probe.probe_stats(w, n=PROBE_BATCHES))
            torch.manual_seed(0)
            m = probe.measure_plan(f"{w.name}/{kind}", lambda: probe.probe_model(w), plan, batches, steps, warmup,
                                   pg=pg, device=device, attribute=attribute)
            att = m.attribution.to_dict() if m.attribution is not None else None
            raw.append((len(refs) - 1, (w.name, kind, plan, cons, m.median_s, att)))
            if bar is not None:
                bar.set_postfix_str(f"{m.label} {m.median_s * 1e3:.1f} ms", refresh=False)
                bar.update(1)
        if normalize:
            refs.append(reference())
    if bar is not None:
        bar.close()
    drifts = reference_drifts(refs) if normalize else []
    out = []
    for i, (wn, kind, plan, cons, sec, att) in raw:
        d = drifts[i] if normalize else 1.0
        out.append(ProbeMeasurement(workload=wn, kind=kind, plan=plan, constraints=cons, measured_s=sec / d,
                                    attribution=att, drift=d))
    if normalize and rank == 0 and progress:
        print("[calibrate] machine speed drift per workload (reference plan "
              f"{ref.workload.name}/{REFERENCE_PLAN[1]}, 1.00 = the calibration's median): "
              + ", ".join(f"{w.name} {d:.2f}x" for w, d in zip(workloads, drifts)), flush=True)
    spread = drift_spread(drifts) if normalize else 1.0
    if spread > MAX_DRIFT_SPREAD and rank == 0:
        msg = (f"the machine's speed moved {spread:.2f}x between probe workloads during this calibration "
               f"(reference plan; more than {MAX_DRIFT_SPREAD:.2f}x): the drift normalization assumes it is "
               "steady within a workload, so this profile may price plans wrongly; calibrate again on a "
               "quieter machine (sparselift calibrate steps)")
        logger.warning(msg)
        if progress:
            print(f"[calibrate] warning: {msg}", flush=True)
    return out


#: The plan measured before and after each probe workload to normalize the machine's drift
#: (:func:`measure_probes`): ``(workload, kind)``.
REFERENCE_PLAN = ("probe_many", TABLE_WISE)
#: Timed steps of each reference measurement (at least; its lower quartile is the reading).
REFERENCE_STEPS = 30


class ReferencePlan:
    """:data:`REFERENCE_PLAN` of ``workload`` (default: that probe model), placed once on ``pg``
    with ``profile`` (None: the base profile), measured on demand over the calibration's own batches
    of it (6 per rank, seed 0): the calibration reads it around each probe model, the real-run
    benchmark around each workload."""

    def __init__(self, pg: Any, profile: Optional[HardwareProfile] = None, workload: Any = None,
                 device_type: str = "cpu") -> None:
        import torch.distributed as dist

        self.workload = workload or next(w for w in probe.PROBE_WORKLOADS if w.name == REFERENCE_PLAN[0])
        w = self.workload
        self.pg, self.device_type = pg, device_type
        self.plan, _cons = forced_plan(probe.probe_model(w), w.tables, REFERENCE_PLAN[1],
                                       probe_topology(dist.get_world_size(pg), device_type), w.batch_size, pg, profile)
        self.batches = probe.prebuilt_batches(w, PROBE_BATCHES, seed=0, rank=dist.get_rank(pg))

    def measure(self, steps: Optional[int] = None, warmup: Optional[int] = None) -> Any:
        """One :func:`~torchrec_sparselift.measure.probe.measure_plan` run of the plan
        (``steps`` / ``warmup``: the harness's defaults when None)."""
        import torch

        torch.manual_seed(0)
        w = self.workload
        return probe.measure_plan(f"reference {w.name}/{REFERENCE_PLAN[1]}", lambda: probe.probe_model(w),
                                  self.plan, self.batches, steps, warmup, pg=self.pg,
                                  device=torch.device(self.device_type))


def reference_drifts(refs: Sequence[float]) -> List[float]:
    """Per workload ``i`` (measured between reference runs ``i`` and ``i + 1``), the machine's
    slowdown relative to the median reference: ``sqrt(refs[i] * refs[i+1]) / median(refs)``."""
    import statistics

    if len(refs) < 2 or any(not (r > 0) for r in refs):
        raise ValueError(f"reference_drifts needs at least two positive reference times, got {list(refs)!r}")
    mid = statistics.median(refs)
    return [float(np.sqrt(a * b)) / mid for a, b in zip(refs[:-1], refs[1:])]


def host_terms(pg: Any = None) -> HostTermRecord:
    """:func:`~torchrec_sparselift.measure.microbench.bench_host_terms` on every rank of ``pg`` at once,
    each pinned to its core as in the probes; the ranks' mean (every rank returns the same)."""
    import torch

    old = probe.pin_rank_to_core(pg)
    try:
        rec = bench_host_terms()
        a2a = bench_a2a_byte_s(pg) if pg is not None else 0.0
    finally:
        probe.restore_affinity(old)
    if pg is None:
        return rec
    import torch.distributed as dist

    # every per-rank term averaged over the ranks; the all-to-all's is already the ranks' (slowest)
    names = [n for n in rec.to_dict() if n != "a2a_byte_s"]
    t = torch.tensor([getattr(rec, n) for n in names], dtype=torch.float64)
    dist.all_reduce(t, group=pg)
    t /= dist.get_world_size(pg)
    return HostTermRecord(a2a_byte_s=a2a, **{n: float(v) for n, v in zip(names, t)})


def probe_pricers(measurements: Sequence[ProbeMeasurement], world_size: int = 2,
                  device_type: str = "cpu") -> List[PlanPricer]:
    """A :class:`~torchrec_sparselift.calibration.pricer.PlanPricer` per measured probe plan: its
    probe model and the statistics of the batches it trained on."""
    by_name = {w.name: w for w in probe.PROBE_WORKLOADS}
    topo = probe_topology(world_size, device_type)
    out = []
    for m in measurements:
        w = by_name[m.workload]
        out.append(PlanPricer(probe.probe_model(w), m.plan, topo, w.batch_size, m.constraints,
                              stats=probe.probe_stats(w, n=PROBE_BATCHES)))
    return out


def fit_measurements(measurements: Sequence[Any], base: HardwareProfile, world_size: int = 2,
                     device_type: str = "cpu", name: str = "step-fit", **fit_options: Any,
                     ) -> Tuple[HardwareProfile, StepFit, List[ProbeRecord], List[FitRecord]]:
    """:func:`~torchrec_sparselift.calibration.step_fit.fit_probe_plans` of measured probe plans
    (:class:`~torchrec_sparselift.calibration.records.ProbeMeasurement`, or a saved set's items),
    each priced on its probe model (:func:`probe_pricers`); ``fit_options`` are
    ``fit_probe_plans``' (``prior_weight``, ``attributed``, ``host``, ``exclude``)."""
    ms = [m if isinstance(m, ProbeMeasurement) else ProbeMeasurement.from_saved(m) for m in measurements]
    return fit_probe_plans(ms, probe_pricers(ms, world_size, device_type), base, name=name, **fit_options)


def save_measurement_set(path: str, measurements: Sequence[ProbeMeasurement], host: Optional[HostTermRecord],
                      host_runs: Sequence[HostTermRecord] = ()) -> None:
    """Pickle a measured set (plain dicts and the TorchRec plans) for ``--from-measurements``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"measurements": [m.to_dict() for m in measurements],
                     "host_terms": host.to_dict() if host is not None else None,
                     "host_term_runs": [h.to_dict() for h in host_runs]}, f)


def load_measurement_set(path: str) -> Tuple[List[ProbeMeasurement], Optional[Dict[str, float]]]:
    """``(measurements, host terms dict or None)`` of a set :func:`save_measurement_set` wrote (or an
    older one: a bare list, or positional tuples)."""
    with open(path, "rb") as f:
        saved = pickle.load(f)
    items, host = (saved["measurements"], saved.get("host_terms")) if isinstance(saved, dict) else (saved, None)
    return [ProbeMeasurement.from_saved(m) for m in items], host


#: The pipelines whose step factor a calibration measures (``HardwareProfile.pipeline_factors``):
#: every exact pipeline but ``sparse_dist``, which the probe plans are fitted under (its factor is 1).
FACTOR_PIPELINES: Tuple[str, ...] = (BASE, FUSED, PREFETCH, OVERLAP)
#: The probe workloads whose table-wise plan the factors are measured on (their ratios' spread is
#: the factors' error): many small tables, a few wide ones, many wide ones at DLRM-like counts.
FACTOR_WORKLOADS: Tuple[str, ...] = ("probe_many", "probe_wide", "probe_deep")
#: The chunk counts the step calibration trains ``overlap`` at, on the table-wise plans of
#: :data:`CHUNK_WORKLOADS`, to measure what one more chunk of a real step costs
#: (``HardwareProfile.chunk_overhead_s``; the host terms' dense-only reading misses the batch
#: slicing, the chunk's collectives and the merge).
CHUNK_COUNTS: Tuple[int, ...] = (1, 2, 4)
#: A probe model of many narrow features (48 tables of one feature, dim 16), for the chunk cost's
#: per-feature part: one more chunk cuts the batch's jagged ids, the keyed embeddings into
#: per-feature tensors and their gradients once more per feature.
PROBE_FEATURES = probe.ProbeWorkload(
    "probe_features", tuple(probe.ProbeTable(f"f{i}", 200 + 31 * i, 16, (f"f{i}_f0",), 1.0) for i in range(48)),
    model="dlrm", dense=(64,), batch_size=256)
#: The probe workloads the chunk cost is measured on: 4, 16 and 48 features, so that the per-chunk
#: price's per-feature part (``HardwareProfile.chunk_feature_s``) is determined apart from its
#: fixed part (``chunk_overhead_s``).
CHUNK_WORKLOADS: Tuple[str, ...] = ("probe_wide", "probe_many", PROBE_FEATURES.name)
#: The A/A control's label: a second model under ``sparse_dist``, timed beside the first.
CONTROL = "sparse_dist (control)"
#: The least error a measured factor is given (three workloads cannot show less).
MIN_FACTOR_ERROR = 0.02


def pipeline_factors(ratios: Dict[str, Sequence[float]], control: Sequence[float] = ()) -> Dict[str, Dict[str, Any]]:
    """Per pipeline, from its per-workload step ratios to ``sparse_dist``: the ``factor`` (their
    median), its ``error``, the ``ratios``, and whether it is ``significant`` (further from 1 than
    its error: only those enter the profile, a pipeline within its error of ``sparse_dist``
    prices as ``sparse_dist``). ``control``: per workload, a second ``sparse_dist`` model's ratio
    to the first (an A/A comparison: what two instances of the same pipeline differ by). The
    error is the largest of :data:`MIN_FACTOR_ERROR`, the largest distance of a ratio from the
    median, and the largest distance of a control ratio from 1. Pure."""
    control = [float(c) for c in control]
    if not all(c > 0 and np.isfinite(c) for c in control):
        raise ValueError(f"control ratios {control} must be positive and finite")
    aa = max((abs(c - 1.0) for c in control), default=0.0)
    out = {}
    for name, rs in ratios.items():
        rs = [float(r) for r in rs]
        if not rs or not all(r > 0 and np.isfinite(r) for r in rs):
            raise ValueError(f"pipeline {name!r}: step ratios {rs} must be positive and finite")
        f = float(np.median(rs))
        err = max(MIN_FACTOR_ERROR, aa, max(abs(r - f) for r in rs))
        out[name] = dict(factor=round(f, 4), error=round(err, 4), ratios=[round(r, 4) for r in rs],
                         significant=bool(abs(f - 1.0) > err))
    return out


def _timing_count(instance: Any, attribute: "attrs.Attribute[int]", value: int) -> None:
    least = 0 if attribute.name == "warmup" else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"instances and block_steps must be >= 1 and warmup >= 0, got "
                         f"{attribute.name}={value!r}")


@attrs.frozen(kw_only=True)
class StepTiming:
    """How :func:`time_table_wise_runs` times a probe's table-wise plan under several pipelines:
    ``instances`` fresh models per pipeline (rounds, the order rotated each round), each run
    ``warmup`` untimed and ``block_steps`` timed steps; ``base``: the profile the plan is made
    with (None: the machine's base profile); ``say``: a callable for one line per workload (rank 0)."""

    instances: int = attrs.field(default=4, validator=_timing_count)
    block_steps: int = attrs.field(default=6, validator=_timing_count)
    warmup: int = attrs.field(default=3, validator=_timing_count)
    base: Optional[HardwareProfile] = None
    say: Optional[Any] = attrs.field(default=None, eq=False)


#: :func:`measure_pipeline_factors`' timing: four models per pipeline
FACTOR_TIMING = StepTiming(instances=4)
#: :func:`measure_chunk_times`' timing: two models per chunk count
CHUNK_TIMING = StepTiming(instances=2)


def probe_workload(name: str) -> Any:
    """The probe workload ``name`` (:data:`~torchrec_sparselift.measure.probe.PROBE_WORKLOADS`, or
    :data:`PROBE_FEATURES`); ``ValueError`` naming the known ones."""
    known = {p.name: p for p in probe.PROBE_WORKLOADS + (PROBE_FEATURES,)}
    if name not in known:
        raise ValueError(f"no probe workload {name!r}; the probe workloads are {sorted(known)}")
    return known[name]


def time_table_wise_runs(pg: Any, device_type: str, wname: str, factories: Mapping[Any, Any],
                         timing: StepTiming) -> Dict[Any, List[float]]:
    """The table-wise plan of probe workload ``wname`` (:func:`probe_workload`) trained once per key
    of ``factories`` (a train-pipeline factory each, ``(dmp, optimizer, device) -> pipeline``) on
    ``timing.instances`` fresh models per key: that many rounds, each shards one new model per key
    (the order rotated each round), runs ``timing.warmup`` untimed and ``timing.block_steps`` timed
    steps on it and drops it, timed as the probes are
    (:func:`~torchrec_sparselift.measure.probe.measure_plan`: ranks pinned, the per-step slowest
    rank). Returns every timed step per key (seconds; the same on every rank)."""
    import torch
    import torch.distributed as dist

    instances, block_steps, warmup, base = timing.instances, timing.block_steps, timing.warmup, timing.base
    device = torch.device(device_type)
    rank, W = dist.get_rank(pg), dist.get_world_size(pg)
    w = probe_workload(wname)
    batches = probe.prebuilt_batches(w, PROBE_BATCHES, seed=0, rank=rank)
    plan, _cons = forced_plan(probe.probe_model(w), w.tables, TABLE_WISE, probe_topology(W, device_type), w.batch_size,
                              pg, base, stats=probe.probe_stats(w, n=PROBE_BATCHES))
    keys = list(factories)
    times: Dict[Any, List[float]] = {k: [] for k in keys}
    for b in range(instances):

        def model(seed: int = b) -> Any:
            torch.manual_seed(seed)
            return probe.probe_model(w)

        for k in keys[b % len(keys):] + keys[:b % len(keys)]:
            m = probe.measure_plan(f"{w.name}/{k}", model, plan, batches, steps=block_steps, warmup=warmup, pg=pg,
                                   device=device, pipeline_factory=factories[k])
            times[k].extend(m.durations_s[warmup:])
    return times


def measure_pipeline_factors(
    pg: Any,
    device_type: str = "cpu",
    pipelines: Sequence[str] = FACTOR_PIPELINES,
    workloads: Sequence[str] = FACTOR_WORKLOADS,
    timing: StepTiming = FACTOR_TIMING,
) -> Dict[str, Dict[str, Any]]:
    """Per probe workload, its table-wise plan trained under each pipeline (``sparse_dist``, a
    second ``sparse_dist`` as the A/A control, and each of ``pipelines``) on ``timing.instances``
    fresh models each (:func:`time_table_wise_runs`: rounds, one new model per pipeline each, the
    order rotated each round, ``timing.warmup`` untimed and ``timing.block_steps`` timed steps). Two
    models of one plan differ in their steady step by up to 35% on this CPU (section 20 of
    docs/benchmarks.md: the same pipeline's second model), so one model per pipeline measures the
    model as much as the pipeline; fresh ones average that out. Each model is timed as the probes
    are (:func:`~torchrec_sparselift.measure.probe.measure_plan`: ranks pinned to their cores, the
    per-step slowest rank). A pipeline's ratio is the median of its steps (the per-step slowest rank, over all
    its models) over ``sparse_dist``'s, and :func:`pipeline_factors` reduces the workloads'
    ratios. The same on every rank of ``pg``."""
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    control = CONTROL  # a second sparse_dist: the A/A control
    kinds = [defaults.PIPELINE, control] + [p for p in pipelines if p != defaults.PIPELINE]
    ratios: Dict[str, List[float]] = {p: [] for p in kinds[2:]}
    controls: List[float] = []
    for wname in workloads:
        factories = {k: (lambda dmp, opt, dev, kind=(defaults.PIPELINE if k == control else k):
                         make_train_pipeline(kind, dmp, opt, dev)) for k in kinds}
        times = time_table_wise_runs(pg, device_type, wname, factories, timing)
        ref = float(np.median(times[kinds[0]]))
        controls.append(float(np.median(times[control])) / ref)
        for k in kinds[2:]:
            ratios[k].append(float(np.median(times[k])) / ref)
        if timing.say is not None and rank == 0:
            timing.say(f"[calibrate] pipelines on {wname}/table_wise ({timing.instances} models each): " + ", ".join(
                f"{k} {np.median(times[k]) * 1e3:.1f} ms" for k in kinds))
    return pipeline_factors(ratios, controls)


def measure_chunk_times(
    pg: Any,
    device_type: str = "cpu",
    workloads: Sequence[str] = CHUNK_WORKLOADS,
    chunks: Sequence[int] = CHUNK_COUNTS,
    timing: StepTiming = CHUNK_TIMING,
) -> Dict[str, Dict[int, float]]:
    """Per probe workload, its table-wise plan trained under ``overlap`` unsplit and batch split
    into each k of ``chunks`` (the probe model declared per-sample), on ``timing.instances`` fresh
    models each, rounds rotated, timed as :func:`measure_pipeline_factors` times the pipelines
    (:func:`time_table_wise_runs`); returns ``{workload: {k: median step seconds}}`` (the same on
    every rank of ``pg``)."""
    import torch.distributed as dist

    if not chunks or min(chunks) < 1:
        raise ValueError(f"chunks must be >= 1, got {list(chunks)}")
    out: Dict[str, Dict[int, float]] = {}
    for wname in workloads:
        factories = {k: (lambda dmp, opt, dev, k=k: make_train_pipeline(
            OVERLAP, dmp, opt, dev, batch_split=k, options={"per_sample": True} if k > 1 else None)) for k in chunks}
        times = time_table_wise_runs(pg, device_type, wname, factories, timing)
        out[wname] = {k: float(np.median(v)) for k, v in times.items()}
        if timing.say is not None and dist.get_rank(pg) == 0:
            timing.say(f"[calibrate] batch split on {wname}/table_wise ({timing.instances} models each): " + ", ".join(
                f"k={k} {t * 1e3:.1f} ms" for k, t in out[wname].items()))
    return out


def chunk_workload_features(names: Sequence[str]) -> Dict[str, int]:
    """Each probe workload's feature count (:func:`probe_workload`): what its chunks carry."""
    return {n: sum(len(t.features) for t in probe_workload(n).tables) for n in names}


def model_chunk_slopes(profile: HardwareProfile, names: Sequence[str], chunks: Sequence[int] = CHUNK_COUNTS,
                       world_size: int = 2, device_type: str = "cpu") -> Dict[str, float]:
    """Per probe workload, the slope over ``k - 1`` of its table-wise plan's ``overlap`` step split
    into each k of ``chunks`` as the cost model prices it under ``profile`` with no dense chunk
    cost (``cost.batch_split.split_step_s``: the chunks' collective latency less what the split
    hides; least squares, it may be negative): what the measured slope holds beside the dense
    chunk cost. The plan as :func:`time_table_wise_runs` trains it, placed in this process."""
    topo = probe_topology(world_size, device_type)
    out: Dict[str, float] = {}
    for name in names:
        w = probe_workload(name)
        stats = probe.probe_stats(w, n=PROBE_BATCHES)
        plan, cons = forced_plan(probe.probe_model(w), w.tables, TABLE_WISE, topo, w.batch_size, None, profile,
                                 stats=stats)
        given = GivenPlan.of(probe.probe_model(w), plan, topo, w.batch_size, cons, stats)
        ctx = given.context(profile)
        cands = [c for c, _r in given.placed]
        inf = np.full(world_size, np.inf)
        ev = PlanEvaluator(ctx, given.shard_costs(ctx), [c.sharding_type for c in cands], inf, inf, OVERLAP,
                           "fp32", "fp32", kernels=[c.compute_kernel for c in cands])
        for t, (_c, ranks) in enumerate(given.placed):
            ev.assign(t, t, ranks)
        phases = dict(ev.phases())
        per_chunk = float(chunk_latency_within(ctx.profile, world_size, ev.comm_groups, phases["output_dist"],
                                               phases["grad_dist"]))
        terms = SplitTerms.from_phases(phases, chunk_latency_s=per_chunk, chunk_overhead_s=0.0,
                                       supports_overlap=ctx.profile.supports_overlap)
        ks = sorted(set(int(k) for k in chunks))
        out[name] = float(np.polyfit([k - 1 for k in ks], [split_step_s(terms, k) for k in ks], 1)[0])
    return out


def step_chunk_fit(profile: HardwareProfile, times: Mapping[str, Mapping[int, float]],
                   model_slopes: Optional[Mapping[str, float]] = None) -> ChunkCostFit:
    """The chunk cost of real batch-split steps (:func:`measure_chunk_times` of probe workloads,
    by name): :func:`~torchrec_sparselift.calibration.rewrite_fit.step_chunk_cost` beside
    ``model_slopes`` (:func:`model_chunk_slopes`: what the cost model already predicts per extra
    chunk of each workload), or, None, beside what one table-wise group's output and gradient
    collectives add to the link per chunk (``cost.batch_split.chunk_link_latency_s``, nothing
    hidden)."""
    if model_slopes is None:
        latency = 2 * chunk_link_latency_s(profile, 2, 1)
        model_slopes = {w: latency for w in times}
    return step_chunk_cost(times, chunk_workload_features(list(times)), model_slopes)


def with_step_chunk_cost(profile: HardwareProfile, times: Mapping[str, Mapping[int, float]],
                         model_slopes: Optional[Mapping[str, float]] = None) -> HardwareProfile:
    """``profile`` with ``chunk_overhead_s`` and ``chunk_feature_s`` from real batch-split steps
    (:func:`step_chunk_fit`): the line's fixed part, never below the dense-only reading the
    profile holds, and its part per feature; the chunk's collectives' latency (and what the split
    hides) is the cost model's own (``cost.batch_split.split_schedule``)."""
    fit = step_chunk_fit(profile, times, model_slopes)
    return attrs.evolve(profile, chunk_overhead_s=max(fit.overhead_s, profile.chunk_overhead_s or 0.0),
                        chunk_feature_s=fit.feature_s)


def calibrate_chunk_cost(pg: Any, profile: HardwareProfile, device_type: str = "cpu",
                         workloads: Sequence[str] = CHUNK_WORKLOADS, chunks: Sequence[int] = CHUNK_COUNTS,
                         timing: StepTiming = CHUNK_TIMING) -> HardwareProfile:
    """``profile`` with the batch split's per-chunk price (``chunk_overhead_s``, ``chunk_feature_s``)
    from real batch-split steps: :func:`measure_chunk_times` of ``workloads``, the cost model's own
    slopes on ``profile`` (:func:`model_chunk_slopes`, rank 0's, sent to every rank) and
    :func:`with_step_chunk_cost`; ``timing.say`` gets the fit's lines (rank 0). The same profile
    on every rank of ``pg``."""
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    dense_only = profile.chunk_overhead_s
    chunk_times = measure_chunk_times(pg, device_type, workloads, chunks, timing)
    # what the model already predicts per extra chunk (latency, hiding), the same on every rank
    slopes = [model_chunk_slopes(profile, list(chunk_times), chunks, dist.get_world_size(pg), device_type)
              if rank == 0 else None]
    dist.broadcast_object_list(slopes, src=dist.get_global_rank(pg, 0), group=pg)
    fitted = with_step_chunk_cost(profile, chunk_times, slopes[0])
    if rank == 0 and timing.say is not None:
        for line in step_chunk_fit(profile, chunk_times, slopes[0]).lines():
            timing.say(f"[calibrate] {line}")
        timing.say(f"[calibrate] chunk_overhead_s {fitted.chunk_overhead_s * 1e3:.3f} ms + chunk_feature_s "
                   f"{fitted.chunk_feature_s * 1e6:.1f} us per feature per extra chunk from the batch-split steps "
                   f"(the dense calls alone: {'-' if dense_only is None else f'{dense_only * 1e3:.3f} ms'})")
    return fitted


def calibrate_steps(
    pg: Any,
    device_type: str = "cpu",
    base: Optional[HardwareProfile] = None,
    workloads: Optional[Sequence[Any]] = None,
    kinds: Optional[Sequence[str]] = None,
    steps: Optional[int] = None,
    warmup: Optional[int] = None,
    progress: bool = True,
    name: str = "step-fit",
    store: Optional[ProfileStore] = None,
    save_measurements: Optional[str] = None,
    link: Any = None,
) -> Tuple[HardwareProfile, StepFit, List[ProbeRecord], List[FitRecord]]:
    """:func:`host_terms`, :func:`measure_probes`, :func:`host_terms` again, then
    :func:`fit_measurements` with each host term's mean reading (every rank returns the same).
    ``save_measurements``: rank 0 also saves the probe measurements and host terms there
    (:func:`save_measurement_set`; ``--from-measurements`` reads them). ``store``: rank 0 stores the
    fitted profile under this machine's fingerprint (with the hosts the link saw) with the fit's
    records (:func:`~torchrec_sparselift.calibration.step_fit.stored_info`) and the link rates.
    ``link``: the job's :class:`~torchrec_sparselift.calibration.link.LinkRates`; None measures them
    first (every rank of the default group, a few seconds). On CPU it also measures the pipelines'
    step factors (:func:`measure_pipeline_factors`, about 30 s on 2 cores) into the profile's
    ``pipeline_factors`` and the stored info. The fitted profile's ``host_link_shared`` is the
    link's (:attr:`~torchrec_sparselift.calibration.link.LinkRates.host_link_shared`) where it was
    measured (several hosts of several ranks), the base profile's otherwise
    (:func:`~torchrec_sparselift.calibration.link.with_link_facts`, which also sets the replica sync's
    measured rates)."""
    import torch.distributed as dist

    base = base or base_profile(device_type)
    t0 = time.perf_counter()
    if link is None:
        link = _measured_link(progress and dist.get_rank(pg) == 0)
    # hosts whose ranks share one link: the probes are fitted priced as shared, as the profile stored
    base = with_link_latency(with_link_facts(base, link), link)
    # the host microbenchmarks run before and after the probes, a minute apart, and their floors
    # take the mean of the two readings (HostTermRecord.mean_of: one reading in a slow stretch
    # lifted a floor, and with it every prediction of the many-feature DLRM workloads, by ~20%)
    host_runs = [host_terms(pg)]
    ms = measure_probes(pg, device_type, workloads, kinds, steps, warmup, progress, base)
    host_runs.append(host_terms(pg))
    host = HostTermRecord.mean_of(host_runs)
    rank = dist.get_rank(pg)
    if rank == 0 and save_measurements:
        save_measurement_set(save_measurements, ms, host, host_runs)
    fitted, fit, recs, fit_records = fit_measurements(ms, base, dist.get_world_size(pg), device_type, name,
                                                      host=host)
    factors: Dict[str, Dict[str, Any]] = {}
    if device_type == "cpu":
        # on CPU the model prices every pipeline as the plain loop; what each still costs per step
        # is measured here (HardwareProfile.pipeline_factors, cost.pipelines.step_factor)
        say = (lambda line: print(line, flush=True)) if progress else None
        factors = measure_pipeline_factors(pg, device_type, timing=attrs.evolve(FACTOR_TIMING, base=base, say=say))
        fitted = attrs.evolve(fitted, pipeline_factors=tuple(
            (k, v["factor"]) for k, v in factors.items() if v["significant"]))
        if rank == 0 and progress:
            print("[calibrate] pipeline step factors (step / sparse_dist's, median of "
                  f"{len(FACTOR_WORKLOADS)} probe workloads): "
                  + ", ".join(f"{k} {v['factor']:.3f} (+-{v['error']:.3f}"
                              f"{'' if v['significant'] else ', within its error of 1: not used'})"
                              for k, v in factors.items()), flush=True)
        # what one more batch chunk costs a real step (the dense-only host term misses most of it)
        fitted = calibrate_chunk_cost(pg, fitted, device_type, timing=attrs.evolve(CHUNK_TIMING, base=base, say=say))
    if rank == 0 and store is not None:
        fp = current_fingerprint(device_type, ranks_per_host(world_size=dist.get_world_size(pg)),
                                 hosts=link.hosts if link is not None else 1)
        drifts = {m.workload: m.drift for m in ms}
        info = stored_info(base, fit, recs, fit_records, fp.describe(), host=host.to_dict(),
                           drift_spread=round(drift_spread(list(drifts.values())), 3),
                           host_term_runs=[h.to_dict() for h in host_runs],
                           wall_s=round(time.perf_counter() - t0, 1), steps=steps, warmup=warmup,
                           **({"pipeline_factors": factors} if factors else {}))
        store.save(fitted, fp, info, link=link)
    return fitted, fit, recs, fit_records


def _measured_link(say: bool) -> Any:
    """The default group's :class:`~torchrec_sparselift.calibration.link.LinkRates` (every rank);
    None on one rank, or when they cannot be fitted (``say``: print why; the profile is stored
    without a link record then)."""
    import torch.distributed as dist

    if dist.get_world_size() < 2:
        return None
    try:
        return measure_link_rates()
    except LinkRatesError as e:
        if say:
            print(f"[calibrate] warning: the link could not be measured ({e}); the profile is stored "
                  "without a link record", flush=True)
        return None


# -- the commands ---------------------------------------------------------------------------------


def _local_ranks() -> int:
    return ranks_per_host(world_size=int(os.environ.get("NPROC", "1")))


def run_check(args: argparse.Namespace) -> int:
    """``sparselift calibrate check``: 0 if this machine has a stored profile fitted with the
    current cost model's terms on a steady machine, else 1 with the reasons (no torch, no measuring).
    With ``--link`` (under torchrun) also measure the job's link and fail when it differs from the
    one stored with the profile (:func:`~torchrec_sparselift.calibration.link.links_differ`; on
    one host only a loopback bandwidth several times apart counts: the machine's load moves the
    rest); a profile stored without a link record passes with a line saying its link is unknown."""
    store = ProfileStore(args.store)
    if getattr(args, "link", False):
        return _check_with_link(store)
    try:
        found, diff = store.lookup(current_fingerprint("cpu", _local_ranks()))
    except FileFormatError as e:  # this machine's stored profile is damaged: named, with the fix
        print(f"[calibrate] {e}", flush=True)
        return 1
    why = _check_reasons(found, diff)
    for line in why:
        print(f"[calibrate] {line}", flush=True)
    return 1 if why else 0


def _check_reasons(found: Any, diff: Sequence[str]) -> List[str]:
    if found is None or diff:
        return ["no calibrated profile for this machine yet"]
    return [f"the stored profile {found.path} {p}" for p in stored_profile_problems(found.step_fit)]


def _check_with_link(store: ProfileStore) -> int:
    import torch.distributed as dist

    if "RANK" not in os.environ:
        print("sparselift calibrate check --link: error: run under torchrun (every rank measures the link: "
              "torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate check --link)", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    dist.init_process_group(backend="gloo")
    try:
        try:
            link = measure_link_rates()  # the same on every rank: every rank decides alike
        except LinkRatesError as e:  # raised on every rank alike
            if dist.get_rank() == 0:
                print(f"[calibrate] the link could not be measured ({e}); not compared", flush=True)
            return 0
        try:
            found, diff = store.lookup(current_fingerprint(
                "cpu", ranks_per_host(world_size=dist.get_world_size()), hosts=link.hosts))
        except FileFormatError as e:  # this machine's stored profile is damaged: named, with the fix
            if dist.get_rank() == 0:
                print(f"[calibrate] {e}", flush=True)
            return 1
        why = _check_reasons(found, diff)
        notes = []
        if not why:
            try:
                stored = found.link
            except LinkRatesError as e:
                stored, why = None, [str(e)]
            if stored is None and not why:
                notes.append(f"the stored profile {found.path} has no link record: its link is unknown, "
                             f"not compared (this job's: {link.describe()})")
            elif stored is not None:
                # on one host only a loopback several times apart counts (differing_terms): a shaped link
                why = [f"the link differs from the one {found.path} was calibrated on: {msg}"
                       for _term, msg in differing_terms(stored, link)]
        if dist.get_rank() == 0:
            for line in notes + why:
                print(f"[calibrate] {line}", flush=True)
        dist.barrier()
    finally:
        close_process_group()
    return 1 if why else 0


def _refit(args: argparse.Namespace, store: ProfileStore) -> int:
    warnings.filterwarnings("ignore")
    ms, host = load_measurement_set(args.from_measurements)
    ranks = _local_ranks()
    fp = current_fingerprint("cpu", ranks if ranks > 1 else 2)
    base = get_profile(args.base) if args.base else base_profile("cpu")
    fitted, fit, recs, fit_records = fit_measurements(
        ms, base, name=f"step-fit-{fp.device}-{fp.cores}core-{fp.backend}x{fp.ranks}", host=host)
    info = stored_info(base, fit, recs, fit_records, fp.describe(), host=host, refit_from=args.from_measurements)
    path = store.save(fitted, fp, info)
    if args.out:
        fitted.save(args.out)
    print(f"[calibrate] refit {len(recs)} probe plans: fit error (MAPE) {info.extra['mape_after'] * 100:.1f}% "
          f"(base profile {info.extra['mape_before'] * 100:.0f}%); stored in {path}")
    return _fit_png(args.png, recs, f"step fit on {fp.describe()}")


def _png_problem(path: Optional[str]) -> str:
    """Why ``--png`` cannot be drawn (checked before measuring); "" when it can."""
    if not path:
        return ""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--png {path}: the folder {folder} does not exist"
    try:
        require_matplotlib()
    except ImportError as e:
        return str(e)
    return ""


def _fit_png(path: Optional[str], recs: Sequence[ProbeRecord], what: str) -> int:
    """``--png``: draw the fit's probe plans (exit 0), or say why not (exit 2; the profile is stored)."""
    if not path:
        return 0
    try:
        fit_png(fit_points(recs), path, title=what)
    except (ImportError, OSError, ValueError) as e:
        print(f"sparselift calibrate steps: error: --png {path}: {e} (the profile is stored)", file=sys.stderr)
        return 2
    print(f"[calibrate] wrote {path}", flush=True)
    return 0


def run_steps(args: argparse.Namespace) -> int:
    """``sparselift calibrate steps``: measure the probe plans under torchrun and store the fitted
    profile (or refit a saved set with ``--from-measurements``)."""
    store = ProfileStore(args.store)
    why = _png_problem(getattr(args, "png", None))
    if why:
        print(f"sparselift calibrate steps: error: {why}", file=sys.stderr)
        return 2
    if args.from_measurements:
        return _refit(args, store)
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        print("sparselift calibrate steps: error: run under torchrun (2 ranks: "
              f"{calibrate_command(2)}), or refit saved measurements with --from-measurements PATH",
              file=sys.stderr)
        return 2
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    drawn = 0  # rank 0's --png exit code
    try:
        rank, W = dist.get_rank(), dist.get_world_size()
        device = "cpu"
        link = _measured_link(rank == 0)
        if link is not None and rank == 0:
            print(f"[calibrate] {link.describe()}", flush=True)
        fp = current_fingerprint(device, ranks_per_host(world_size=W), hosts=link.hosts if link is not None else 1)
        workloads = probe.PROBE_WORKLOADS[:2] if args.quick else probe.PROBE_WORKLOADS
        steps = args.steps or (5 if args.quick else probe.DEFAULT_TIMING["steps"])
        warmup = probe.DEFAULT_TIMING["warmup"] if args.warmup is None else args.warmup
        base = get_profile(args.base) if args.base else base_profile(device)
        t0 = time.perf_counter()
        fitted, fit, recs, _fit_records = calibrate_steps(
            dist.group.WORLD, device, base, workloads, steps=steps, warmup=warmup, progress=not args.no_progress,
            name=f"step-fit-{fp.device}-{fp.cores}core-{fp.backend}x{fp.ranks}", store=store,
            save_measurements=args.save_measurements, link=link)
        wall = time.perf_counter() - t0
        if rank == 0:
            path = store.path_for(fp)
            if args.out:
                fitted.save(args.out)
            print(f"[calibrate] {len(recs)} probe plans in {wall:.0f} s: fit error (MAPE) "
                  f"{records_mape(recs, 'predicted_after_s') * 100:.1f}% (base profile "
                  f"{records_mape(recs, 'predicted_before_s') * 100:.0f}%); profile for {fp.describe()} stored in {path}",
                  flush=True)
            drawn = _fit_png(args.png, recs, f"step fit on {fp.describe()}")
        dist.barrier()
    finally:
        close_process_group()
    return drawn
