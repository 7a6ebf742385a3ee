"""Profile-guided calibration: fit the hardware profile from real training steps.

    torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift.step_calibration [--quick]

runs the probe plans (:data:`torchrec_sparselift.runtime.probe.PLAN_KINDS`: all table-wise, all
row-wise, all data-parallel, all column-wise, mixed, the smaller half data-parallel (``dp_small``),
the table-wise shards in two sharding groups (``two_groups``)) on the probe models
(:data:`~torchrec_sparselift.runtime.probe.PROBE_WORKLOADS`) for a few steps each, prices every
plan with the cost model (:class:`PlanPricer`, the same evaluator the planner optimizes), fits the
profile's terms (:func:`torchrec_sparselift.cost.step_fit.fit_profile`) to the whole steps and to
their attribution by node kind (:func:`group_cases`), with the host work measured alone
(:func:`host_terms`: optimizer per tensor and byte, bucketize per id, all-to-all per byte) as fixed
values and floors (:func:`host_fit_setup`), and stores the profile in
the :class:`~torchrec_sparselift.cost.machine.ProfileStore` under this machine's fingerprint (rank 0
writes; the path is printed). The base profile is the committed microbenchmark profile on CPU
(``profiles/cpu-2core-gloo.json`` when present) or the topology's preset.

:func:`auto_profile` is what ``hardware="auto"`` resolves to: the stored profile of this machine,
else the closest stored one with a warning naming the differences, else the base with a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile, profile_for_topology
from torchrec_sparselift.cost.machine import MachineFingerprint, ProfileStore, current_fingerprint
from torchrec_sparselift.cost.report import mape
from torchrec_sparselift.cost.step_fit import (
    CPU_STEP_TERMS,
    STEP_MODEL_VERSION,
    FitRecord,
    StepFit,
    fit_profile,
    fit_terms,
    linearize,
    term_value,
    with_terms,
)

__all__ = ["PlanPricer", "REFERENCE_PLAN", "ReferencePlan", "reference_drifts", "missing_terms", "fitted_model_version", "stored_info",
           "HOST_FIXED_TERMS", "auto_profile", "calibrate_steps", "measure_probes", "fit_measurements", "add_feedback", "base_profile", "forced_plan", "main",
           "COMMITTED_CPU_PROFILE"]

logger = logging.getLogger(__name__)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The microbenchmark profile committed with the repository (the base of a CPU step fit).
COMMITTED_CPU_PROFILE = os.path.join(_ROOT, "profiles", "cpu-2core-gloo.json")


class PlanPricer:
    """``profile -> predicted step seconds`` of one fixed ``ShardingPlan`` (tables, topology,
    batch size and dense part extracted once; each call re-prices the shards with the profile
    and sums them in the planner's evaluator). Column-wise shards are priced as equal splits.
    ``stats``: the run's :class:`~torchrec_sparselift.semantics.workload.WorkloadStats` (the
    planner's ``workload=``; its distinct ids price the fused backward)."""

    def __init__(self, module: Any, plan: Any, topology: Any, batch_size: int,
                 constraints: Optional[Dict[str, Any]] = None, sharders: Optional[Sequence[Any]] = None,
                 pipeline: str = "sparse_dist", stats: Any = None) -> None:
        from torchrec.distributed.sharding_plan import get_default_sharders

        from torchrec_sparselift.plan.evaluate import given_candidates
        from torchrec_sparselift.semantics.dense import dense_work
        from torchrec_sparselift.semantics.tables import extract_tables

        sharders = list(sharders) if sharders is not None else get_default_sharders()
        self.topology = topology
        self.batch_size = batch_size
        self.pipeline = pipeline
        handles = extract_tables(module, sharders, topology.compute_device, batch_size, constraints, stats)
        self.specs = [h.spec for h in handles]
        self.dense = dense_work(module, handles)
        placed = given_candidates(handles, plan, topology.world_size,
                                  min(topology.local_world_size, topology.world_size))
        self.cands = [c for c, _ in placed]
        self.ranks = [r for _, r in placed]

    def _ctx(self, profile: HardwareProfile) -> Any:
        from torchrec_sparselift.cost.model import CostContext

        topo = self.topology
        return CostContext(profile=profile_for_topology(topo, profile), world_size=topo.world_size,
                           local_world_size=min(topo.local_world_size, topo.world_size),
                           batch_size=self.batch_size, dense=self.dense)

    def step_time(self, profile: HardwareProfile) -> Any:
        """The plan's evaluated step under ``profile``. The fit's finite differences price the same
        profiles for a plan's step case and each of its group cases: each is priced once (the last
        64 profiles are kept)."""
        return self._memo("_step_by_profile", profile, self._evaluate)

    def _memo(self, name: str, profile: HardwareProfile, compute: Callable[[HardwareProfile], Any]) -> Any:
        """``compute(profile)``, remembered in the cache ``name`` (its last 64 profiles)."""
        cache = self.__dict__.setdefault(name, {})
        if profile not in cache:
            if len(cache) >= 64:
                cache.clear()
            cache[profile] = compute(profile)
        return cache[profile]

    def _evaluate(self, profile: HardwareProfile) -> Any:
        from torchrec_sparselift.cost.evaluator import PlanEvaluator
        from torchrec_sparselift.cost.model import shard_cost

        topo = self.topology
        ctx = self._ctx(profile)
        costs = [shard_cost(s, c, ctx) for s, c in zip(self.specs, self.cands)]
        inf = np.full(topo.world_size, np.inf)
        ev = PlanEvaluator(ctx, costs, [c.sharding_type for c in self.cands], inf, inf, self.pipeline,
                           kernels=[c.compute_kernel for c in self.cands])
        for t, ranks in enumerate(self.ranks):
            ev.assign(t, t, ranks)
        return ev.step_time()

    def __call__(self, profile: HardwareProfile) -> float:
        return float(self.step_time(profile).total_s)

    def groups(self, profile: HardwareProfile) -> Dict[str, float]:
        """Predicted seconds per attribution fit group
        (:data:`~torchrec_sparselift.runtime.attribution.FIT_GROUPS`; they sum to the step)."""
        from torchrec_sparselift.cost.model import dp_optimizer_s
        from torchrec_sparselift.runtime.attribution import group_kinds, predicted_by_kind

        def split(p: HardwareProfile) -> Dict[str, float]:
            dp = dp_optimizer_s(self.specs, self.cands, self._ctx(p))
            return group_kinds(predicted_by_kind(self.step_time(p), dp_optimizer_s=dp))

        # every group's case of a plan prices the same profiles: split each one's step once
        return dict(self._memo("_groups_by_profile", profile, split))

    def group(self, name: str) -> Callable[[HardwareProfile], float]:
        """``profile -> seconds`` of one fit group (a case for ``fit_profile``)."""
        return lambda profile: self.groups(profile)[name]


def base_profile(device: str) -> HardwareProfile:
    """The profile a step fit starts from: the committed CPU microbenchmark profile on CPU."""
    if device == "cpu" and os.path.isfile(COMMITTED_CPU_PROFILE):
        return get_profile(COMMITTED_CPU_PROFILE)
    return get_profile("cpu-gloo" if device == "cpu" else "h100")


def auto_profile(device: str, ranks: int, store: Optional[ProfileStore] = None,
                 warn: Callable[[str], None] = lambda m: warnings.warn(m, stacklevel=3)
                 ) -> Tuple[HardwareProfile, str]:
    """``(profile, where)`` for ``hardware="auto"``: this machine's stored profile; else the
    closest stored one (``warn`` names the differing fingerprint fields); else the base profile
    (``warn`` says how to calibrate)."""
    store = store or ProfileStore()
    fp = current_fingerprint(device, ranks)
    found, diff = store.lookup(fp)
    how = ("calibrate this machine with `torchrun --standalone --nproc_per_node "
           f"{ranks} -m torchrec_sparselift.step_calibration`")
    if found is not None and not diff:
        for problem in stored_profile_problems(found.info):
            warn(f"sparselift: this machine's profile {found.path} {problem}: predictions may be off; {how}")
        return found.profile, found.path
    if found is not None:
        warn(f"sparselift: no calibrated profile for this machine; using {found.path} from another machine "
             f"(differs in {'; '.join(diff)}): predictions may be off; {how}")
        return found.profile, found.path
    base = base_profile(device)
    warn(f"sparselift: no calibrated profile for this machine in {store.root}; using {base.name}: "
         f"predictions may be off; {how}")
    return base, base.name


def missing_terms(info: Optional[Mapping[str, Any]]) -> List[str]:
    """The step-fit terms (:data:`~torchrec_sparselift.cost.step_fit.CPU_STEP_TERMS`) a stored
    profile's fit (its ``info``) neither fitted nor fixed from host measurements: it was calibrated by
    an older cost model. Empty for a profile with no step fit (a microbenchmark profile)."""
    fit = (info or {}).get("fit") or {}
    if not fit.get("values"):
        return []
    fixed = set(HOST_FIXED_TERMS) if (info or {}).get("host_terms") else set()
    return [t.name for t in CPU_STEP_TERMS if t.name not in fit["values"] and t.name not in fixed]


def fitted_model_version(info: Optional[Mapping[str, Any]]) -> Optional[int]:
    """The :data:`~torchrec_sparselift.cost.step_fit.STEP_MODEL_VERSION` a stored profile's step fit
    was made under (1 for a fit stored before versions were recorded); None without a step fit."""
    if not ((info or {}).get("fit") or {}).get("values"):
        return None
    return int((info or {}).get("model_version", 1))


def stored_profile_problems(info: Optional[Mapping[str, Any]]) -> List[str]:
    """Why a stored profile of this machine should be calibrated again (empty: it is fine), each as
    a phrase after "the profile ...": fitted by an older cost model (:func:`missing_terms`), or
    calibrated on a machine whose speed moved (:func:`disturbed_spread`). ``step_calibration --check``
    fails on them and ``auto_profile`` warns with them."""
    out = []
    missing = missing_terms(info)
    if missing:
        out.append(f"was fitted before the cost model had {', '.join(missing)} (they take their fallback values)")
    version = fitted_model_version(info)
    if version is not None and version != STEP_MODEL_VERSION:
        out.append(f"was fitted under cost-model structure {version} (this code prices structure "
                   f"{STEP_MODEL_VERSION}: its terms multiply other quantities now)")
    spread = disturbed_spread(info)
    if spread is not None:
        out.append(f"was calibrated while the machine's speed moved {spread:.2f}x between probe workloads "
                   "(calibrate on a quieter machine)")
    return out


def disturbed_spread(info: Optional[Mapping[str, Any]]) -> Optional[float]:
    """The drift spread a stored profile's calibration recorded (``info["drift_spread"]``) when it
    is above :data:`MAX_DRIFT_SPREAD`, else None."""
    spread = (info or {}).get("drift_spread")
    return float(spread) if spread is not None and float(spread) > MAX_DRIFT_SPREAD else None


def _topology(world_size: int, device: str):
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

    from torchrec_sparselift.planner import SparseLiftPlanner
    from torchrec_sparselift.runtime.probe import probe_constraints

    cons = probe_constraints(tables, kind)
    planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=cons,
                                hardware=profile or base_profile(topology.compute_device),
                                pipelines=["sparse_dist"], debug=False, workload=stats)
    sharders = get_default_sharders()
    plan = planner.collective_plan(model, sharders, pg) if pg is not None else planner.plan(model, sharders)
    return plan, cons


#: Distinct pre-built batches each probe plan trains on (cycled); their statistics price it.
PROBE_BATCHES = 6
#: Profiled steps after each probe plan's timed steps: the attribution the fit splits into groups.
ATTRIBUTED_STEPS = 5
#: A group measured below this share of its step is left out of the fit (its relative error is noise).
MIN_GROUP_SHARE = 0.02
#: Weight of a fit group's case relative to a step case of the same plan (residuals relative to the step).
GROUP_WEIGHT = 1.0


@attrs.frozen
class ProbeRecord:
    workload: str
    plan: str
    measured_s: float
    predicted_before_s: float
    predicted_after_s: float


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
) -> List[Tuple[Any, ...]]:
    """Train every probe plan on every rank of ``pg``; ``(workload, kind, plan, constraints,
    measured seconds, attribution, drift)`` per plan (the median step of the per-step slowest
    rank; the same on every rank; ``attribution``: the dict of ``attribute`` more steps run under the
    profiler after the timed ones, :mod:`torchrec_sparselift.runtime.attribution`, or None when 0).
    ``steps`` / ``warmup`` default to the harness's (``runtime.probe.DEFAULT_TIMING``).

    ``normalize``: a shared machine's speed drifts within one calibration (measured: 1.8x between
    two workloads a minute apart), which no profile can fit. The reference plan
    (:data:`REFERENCE_PLAN`: its workload's table-wise plan) is measured before the first workload and
    after each one; every plan's seconds are scaled by ``median(reference) / reference around its
    workload`` (the geometric mean of the measurements before and after it), so all plans are priced
    at the calibration's median machine speed. ``drift`` is that factor's inverse (1.0 when not
    normalized)."""
    import torch
    import torch.distributed as dist

    from torchrec_sparselift.runtime import probe

    workloads = list(workloads or probe.PROBE_WORKLOADS)
    kinds = list(kinds or probe.PLAN_KINDS)
    rank, W = dist.get_rank(pg), dist.get_world_size(pg)
    device = torch.device(device_type)
    topo = _topology(W, device_type)
    ref = ReferencePlan(pg, base, next((w for w in workloads if w.name == REFERENCE_PLAN[0]), workloads[0]),
                        device_type)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(workloads) * len(kinds) + (len(workloads) + 1 if normalize else 0), desc="calibrate",
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
        for kind in kinds:
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
        out.append((wn, kind, plan, cons, sec / d, att, d))
    if normalize and rank == 0 and progress:
        print("[calibrate] machine speed drift per workload (reference plan "
              f"{ref.workload.name}/{REFERENCE_PLAN[1]}, 1.00 = the calibration's median): "
              + ", ".join(f"{w.name} {d:.2f}x" for w, d in zip(workloads, drifts)), flush=True)
    spread = drift_spread(drifts) if normalize else 1.0
    if spread > MAX_DRIFT_SPREAD and rank == 0:
        msg = (f"the machine's speed moved {spread:.2f}x between probe workloads during this calibration "
               f"(reference plan; more than {MAX_DRIFT_SPREAD:.2f}x): the drift normalization assumes it is "
               "steady within a workload, so this profile may price plans wrongly; calibrate again on a "
               "quieter machine (python -m torchrec_sparselift.step_calibration)")
        logger.warning(msg)
        if progress:
            print(f"[calibrate] warning: {msg}", flush=True)
    return out


#: Largest spread (slowest / fastest) of the reference plan's drift across one calibration's probe
#: workloads before it warns. Measured in session 5's seven calibrations: 1.02-1.26x with probe fits
#: of 7.7-9.1%; 1.49x and 2.10x with probe fits of 14.3% and 22.8%, whose benchmark runs had held-out
#: MAPEs of 18.0% and 24.9% (docs/benchmarks.md, "Session 5").
MAX_DRIFT_SPREAD = 1.3


def drift_spread(drifts: Sequence[float]) -> float:
    """``max / min`` of per-workload drifts (:func:`reference_drifts`); 1.0 for fewer than two."""
    ds = [float(d) for d in drifts if d > 0]
    return max(ds) / min(ds) if len(ds) > 1 else 1.0


#: The plan measured before and after each probe workload to normalize the machine's drift
#: (:func:`measure_probes`): ``(workload, kind)``.
REFERENCE_PLAN = ("probe_many", "table_wise")
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

        from torchrec_sparselift.runtime import probe

        self.workload = workload or next(w for w in probe.PROBE_WORKLOADS if w.name == REFERENCE_PLAN[0])
        w = self.workload
        self.pg, self.device_type = pg, device_type
        self.plan, _cons = forced_plan(probe.probe_model(w), w.tables, REFERENCE_PLAN[1],
                                       _topology(dist.get_world_size(pg), device_type), w.batch_size, pg, profile)
        self.batches = probe.prebuilt_batches(w, PROBE_BATCHES, seed=0, rank=dist.get_rank(pg))

    def measure(self, steps: Optional[int] = None, warmup: Optional[int] = None) -> Any:
        """One :func:`~torchrec_sparselift.runtime.probe.measure_plan` run of the plan
        (``steps`` / ``warmup``: the harness's defaults when None)."""
        import torch

        from torchrec_sparselift.runtime import probe

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


def group_cases(label: str, measured_s: float, attribution: Any, pricer: "PlanPricer") -> List[Tuple[Any, ...]]:
    """``fit_profile`` cases of one attributed plan: per fit group
    (:data:`~torchrec_sparselift.runtime.attribution.FIT_GROUPS`) its measured seconds (the
    attribution scaled to the unprofiled ``measured_s``) against the model's, weighted so that its
    residual counts relative to the whole step, as a step case's does."""
    from torchrec_sparselift.runtime.attribution import StepAttribution, measured_groups

    att = attribution if isinstance(attribution, StepAttribution) else StepAttribution.from_dict(attribution)
    out = []
    for g, sec in measured_groups(att, measured_s).items():
        if sec >= MIN_GROUP_SHARE * measured_s:
            out.append((f"{label}:{g}", sec, pricer.group(g), g, GROUP_WEIGHT * (sec / measured_s) ** 2))
    return out


def host_terms(pg: Any = None) -> Any:
    """:func:`~torchrec_sparselift.cost.microbench.bench_host_terms` on every rank of ``pg`` at once,
    each pinned to its core as in the probes; the ranks' mean (every rank returns the same)."""
    import torch

    from torchrec_sparselift.cost.microbench import HostTermRecord, bench_a2a_byte_s, bench_host_terms
    from torchrec_sparselift.runtime import probe

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


#: Step-fit terms a calibration with host microbenchmarks takes as measured instead of fitting.
HOST_FIXED_TERMS = ("bucketize_id_s",)


def host_fit_setup(base: HardwareProfile, host: Optional[Any]
                   ) -> Tuple[HardwareProfile, Tuple[Any, ...], Dict[str, float]]:
    """``(base, terms, floors)`` of a step fit given host microbenchmarks (None: the base, all of
    ``CPU_STEP_TERMS``, no floors). With them, ``bucketize_id_s`` is the measured value and not
    fitted (whole steps cannot tell it from per-feature row-wise work: fitted, it came out 20-40x
    the measured kernel cost and over-priced row-wise plans with many ids), and the data-parallel
    optimizer's per-table (``dp_table_overhead_s``) and per-byte (``1/dense_update_bw``, the model's
    dense update moves 3x the replica's bytes) terms are fitted above what ``Adagrad.step`` alone
    costs (DDP's per-parameter work and cold caches come on top), ``1/a2a_bw`` above the bare
    all-to-all's per-byte cost (measured across ranks; 0 when not), and the dense activation and
    interaction rates above their cost measured alone (``microbench.bench_dense_terms``), the dense
    layers' FLOP rate above an MLP's alone (``microbench.bench_dense_flops``), and the fused
    backward's per-distinct-row cost above fbgemm's alone (``microbench.bench_tbe_backward``)."""
    if host is None:
        return base, tuple(CPU_STEP_TERMS), {}
    if isinstance(host, Mapping):
        from torchrec_sparselift.cost.microbench import HostTermRecord

        host = HostTermRecord(**host)
    base = attrs.evolve(base, bucketize_id_s=float(host.bucketize_id_s))
    terms = tuple(t for t in CPU_STEP_TERMS if t.name not in HOST_FIXED_TERMS)
    floors = {"dp_table_overhead_s": float(host.optimizer_tensor_s),
              "1/dense_update_bw": float(host.optimizer_byte_s) / 3.0}
    if getattr(host, "a2a_byte_s", 0.0) > 0:
        # a step's all-to-all cannot move a byte faster than the bare collective. Fitted from whole
        # steps it comes out ~3-5x that: it also holds byte-correlated work around the collective.
        # Fixing it at the bare cost made the planner keep kaggle/dcnv2 table-wise but priced every
        # plan 6-18% low (docs/calibration.md), so it is a floor, not the value.
        floors["1/a2a_bw"] = float(host.a2a_byte_s)
    # the dense part's parameter-free work measured alone (forward + backward = 3x the forward the
    # rates price): the probes cannot tell activation bytes from FLOPs (their ratio is within
    # 0.06-0.12 B/FLOP on all four probe models), fitted freely the byte rate went to 0 or infinity
    for term, value in (("1/dense_mem_bw", getattr(host, "dense_act_byte_s", 0.0)),
                        ("1/interaction_flops", getattr(host, "interaction_flop_s", 0.0))):
        if value > 0:
            floors[term] = float(value) / 3.0
    # the dense layers' products cannot run faster than a near-square MLP's measured alone (fitted
    # freely the FLOP rate went to 1e18, i.e. free, where the probes' FLOPs moved with their
    # activation bytes; the DCN example's 1.4 GFLOP per step, forward + backward, then cost nothing)
    if getattr(host, "dense_flop_s", 0.0) > 0:
        floors["1/dense_flops"] = float(host.dense_flop_s)
    # a fused TBE backward updates each distinct row once (fbgemm's CPU kernel, measured alone:
    # ~0.6 us per row, ~0 per id): a step cannot update a row faster
    if getattr(host, "tbe_row_s", 0.0) > 0:
        floors["bwd_row_s"] = float(host.tbe_row_s)
    # a reduce-scatter byte costs no less than an all-to-all byte (gloo alone: ~4.5x, its all-gather ~2x)
    floors["reduce_scatter_factor"] = 1.0
    return base, terms, floors


def fit_measurements(
    measurements: Sequence[Tuple[Any, ...]],
    base: HardwareProfile,
    world_size: int = 2,
    device_type: str = "cpu",
    name: str = "step-fit",
    prior_weight: float = 1e-2,
    attributed: bool = True,
    host: Optional[Any] = None,
    exclude: Sequence[str] = (),
) -> Tuple[HardwareProfile, StepFit, List[ProbeRecord], List[FitRecord]]:
    """Fit ``base``'s step terms to :func:`measure_probes` output (pure given the plans): the
    fitted profile, the fit, per-plan before/after predictions, and the linearized records.

    Each plan is a step case; a plan measured with an attribution also gives one case per fit
    group (:func:`group_cases`), so each term is fitted to the work it prices. ``attributed=False``
    fits the step times alone.

    ``host``: a :class:`~torchrec_sparselift.cost.microbench.HostTermRecord` measured on this
    machine (:func:`host_terms`): the row-wise bucketize cost per id is taken from it (not fitted),
    and the data-parallel tables' optimizer terms are fitted above its per-tensor and per-byte
    costs (:func:`host_fit_setup`).

    ``exclude``: step terms left out of the model (an ablation: their profile fields at
    ``HardwareProfile``'s defaults, not fitted), e.g. ``("bwd_row_s",)`` prices the fused backward
    per id only, as the model did before it counted distinct rows."""
    from torchrec_sparselift.runtime import probe

    base, terms, floors = host_fit_setup(base, host)
    excluded = set(exclude)
    if excluded:
        unknown = sorted(excluded - {t.name for t in CPU_STEP_TERMS})
        if unknown:
            raise ValueError(f"exclude={unknown}: not step-fit terms; choose from {[t.name for t in CPU_STEP_TERMS]}")
        defaults = {f.name: f.default for f in attrs.fields(HardwareProfile)}
        base = attrs.evolve(base, **{fld: defaults[fld] for t in terms if t.name in excluded for fld in t.fields})
        terms = tuple(t for t in terms if t.name not in excluded)
        floors = {k: v for k, v in floors.items() if k not in excluded}

    by_name = {w.name: w for w in probe.PROBE_WORKLOADS}
    topo = _topology(world_size, device_type)
    cases, extra, meta = [], [], []
    for m in measurements:
        wn, kind, plan, cons, measured = m[:5]
        w = by_name[wn]
        pricer = PlanPricer(probe.probe_model(w), plan, topo, w.batch_size, cons, stats=probe.probe_stats(w, n=PROBE_BATCHES))
        cases.append((f"{wn}/{kind}", measured, pricer))
        if attributed and len(m) > 5 and m[5] is not None:
            extra += group_cases(f"{wn}/{kind}", measured, m[5], pricer)
        meta.append((wn, kind))
    fitted, fit = fit_profile(cases + extra, base, terms, name=name, prior_weight=prior_weight, floors=floors)
    fit_records = []
    for label, measured, pricer in cases:
        _b, q, fixed = linearize(pricer, fitted, terms)
        fit_records.append(FitRecord(label=label, quantities=q, fixed_s=fixed, measured_s=measured))
    for label, measured, predict, kind, weight in extra:
        _b, q, fixed = linearize(predict, fitted, terms)
        fit_records.append(FitRecord(label=label, quantities=q, fixed_s=fixed, measured_s=measured, kind=kind,
                                     weight=weight))
    recs = [ProbeRecord(workload=wn, plan=k, measured_s=meas, predicted_before_s=pr(base),
                        predicted_after_s=pr(fitted))
            for (wn, k), (_l, meas, pr) in zip(meta, cases)]
    return fitted, fit, recs, fit_records


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
) -> Tuple[HardwareProfile, StepFit, List[ProbeRecord], List[FitRecord]]:
    """:func:`host_terms`, :func:`measure_probes`, :func:`host_terms` again, then
    :func:`fit_measurements` with each host term's mean reading (every rank returns the same).
    ``save_measurements``: rank 0 also pickles the probe measurements and host terms there
    (``--from-measurements`` reads them). ``store``: rank 0 stores the fitted profile under
    this machine's fingerprint with the fit's records (:func:`stored_info`)."""
    import pickle

    import torch.distributed as dist

    from torchrec_sparselift.cost.microbench import HostTermRecord

    base = base or base_profile(device_type)
    t0 = time.perf_counter()
    # the host microbenchmarks run before and after the probes, a minute apart, and their floors
    # take the mean of the two readings (HostTermRecord.mean_of: one reading in a slow stretch
    # lifted a floor, and with it every prediction of the many-feature DLRM workloads, by ~20%)
    host_runs = [host_terms(pg)]
    ms = measure_probes(pg, device_type, workloads, kinds, steps, warmup, progress, base)
    host_runs.append(host_terms(pg))
    host = HostTermRecord.mean_of(host_runs)
    rank = dist.get_rank(pg)
    if rank == 0 and save_measurements:
        os.makedirs(os.path.dirname(os.path.abspath(save_measurements)), exist_ok=True)
        with open(save_measurements, "wb") as f:
            pickle.dump({"measurements": ms, "host_terms": host.to_dict(),
                         "host_term_runs": [h.to_dict() for h in host_runs]}, f)
    fitted, fit, recs, fit_records = fit_measurements(ms, base, dist.get_world_size(pg), device_type, name,
                                                      host=host)
    if rank == 0 and store is not None:
        fp = current_fingerprint(device_type, int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size(pg))))
        drifts = {m[0]: m[6] for m in ms if len(m) > 6}
        info = stored_info(base, fit, recs, fit_records, fp, host=host.to_dict(),
                           host_term_runs=[h.to_dict() for h in host_runs],
                           wall_s=round(time.perf_counter() - t0, 1), steps=steps, warmup=warmup,
                           drift_spread=round(drift_spread(list(drifts.values())), 3))
        store.save(fitted, fp, info)
    return fitted, fit, recs, fit_records


def stored_info(base: HardwareProfile, fit: StepFit, recs: Sequence[ProbeRecord], fit_records: Sequence[FitRecord],
                fp: MachineFingerprint, host: Optional[Mapping[str, float]] = None, **extra: Any) -> Dict[str, Any]:
    """The ``info`` a step-fitted profile is stored with: the fit, its records (what guard feedback
    refits), the host terms, the errors before and after, when and for which machine."""
    info = dict(created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), base=base.name, fit=fit.to_dict(),
                model_version=STEP_MODEL_VERSION,
                mape_before=_mape(recs, "predicted_before_s"), mape_after=_mape(recs, "predicted_after_s"),
                records=[attrs.asdict(r) for r in recs], fingerprint=fp.describe(),
                fit_records=[_record_dict(r) for r in fit_records], **extra)
    if host is not None:
        info["host_terms"] = dict(host)
    return info


def add_feedback(records: Sequence[FitRecord], profile: HardwareProfile, topology: Any,
                 store: Optional[ProfileStore] = None, prior_weight: float = 1e-2) -> Optional[str]:
    """Add measured-guard trials (FitRecords) to this machine's stored step-fit records and refit
    its profile; returns the store path, or None when this machine has no stored profile of its
    own (feedback never edits another machine's profile)."""
    store = store or ProfileStore()
    fp = current_fingerprint(topology.compute_device, int(topology.local_world_size))
    found, diff = store.lookup(fp)
    version = fitted_model_version(found.info) if found is not None else None
    if found is None or diff or (version is not None and version != STEP_MODEL_VERSION):
        # another machine's profile, or records linearized under another model structure: never mixed
        return None
    old = [FitRecord(**r) for r in found.info.get("fit_records", [])]
    _base, terms, floors = host_fit_setup(found.profile, found.info.get("host_terms"))
    fitted_names = {t.name for t in terms}
    kept = {t.name: term_value(found.profile, t) for t in CPU_STEP_TERMS if t.name not in fitted_names}
    # a term the calibration measured instead of fitting (host terms) is part of the fixed time
    allrecs = [attrs.evolve(r, fixed_s=r.fixed_s + sum(r.quantities.get(n, 0.0) * v for n, v in kept.items()),
                            quantities={n: q for n, q in r.quantities.items() if n not in kept})
               for r in old + list(records)]
    prior = {t.name: term_value(found.profile, t) for t in terms}
    fit = fit_terms(allrecs, prior, prior_weight, floors)
    refit = with_terms(found.profile, fit.values, terms)
    info = dict(found.info)
    info["fit_records"] = [_record_dict(r) for r in allrecs]
    info["feedback_records"] = int(info.get("feedback_records", 0)) + len(records)
    info["feedback_fit_mape"] = fit.mape
    return store.save(refit, fp, info)


def _record_dict(r: FitRecord) -> Dict[str, Any]:
    return dict(label=r.label, quantities=dict(r.quantities), fixed_s=r.fixed_s, measured_s=r.measured_s,
                kind=r.kind, weight=r.weight)


def _mape(recs: Sequence[ProbeRecord], attr: str) -> float:
    """MAPE of the records' ``attr`` prediction (cost/report.mape)."""
    return mape([getattr(r, attr) for r in recs], [r.measured_s for r in recs])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="fit the hardware profile from real training steps (run under torchrun)")
    p.add_argument("--quick", action="store_true", help="two probe models, fewer steps (smoke test)")
    p.add_argument("--steps", type=int, help="timed steps per probe plan (default: the harness's, "
                   "runtime.probe.DEFAULT_TIMING; quick 5)")
    p.add_argument("--warmup", type=int, help="untimed steps per probe plan (default: the harness's, "
                   "runtime.probe.DEFAULT_TIMING)")
    p.add_argument("--store", help="profile store directory (default: $TORCHREC_SPARSELIFT_PROFILE_DIR or "
                   "~/.cache/torchrec_sparselift/profiles)")
    p.add_argument("--out", help="also write the profile JSON here")
    p.add_argument("--base", help="profile to start from (default: the committed CPU profile / preset)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--save-measurements", metavar="PATH", help="also pickle the probe plans and their measured "
                   "times here (refit later with --from-measurements)")
    p.add_argument("--from-measurements", metavar="PATH", help="refit from saved measurements (no torchrun, no "
                   "measuring) and store the profile")
    p.add_argument("--check", action="store_true", help="exit 0 if this machine has a stored profile fitted "
                   "with the current cost model's terms on a steady machine, else 1 (no torch, no measuring)")
    args = p.parse_args(argv)
    store = ProfileStore(args.store)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("NPROC", "1")))
    if args.check:
        found, diff = store.lookup(current_fingerprint("cpu", ranks))
        if found is None or diff:
            why = ["no calibrated profile for this machine yet"]
        else:
            why = [f"the stored profile {found.path} {p}" for p in stored_profile_problems(found.info)]
        for line in why:
            print(f"[calibrate] {line}", flush=True)
        return 1 if why else 0
    if args.from_measurements:
        import pickle

        warnings.filterwarnings("ignore")
        with open(args.from_measurements, "rb") as f:
            saved = pickle.load(f)
        # {"measurements": [...], "host_terms": {...}}; a bare list from before host terms
        ms, host = (saved["measurements"], saved.get("host_terms")) if isinstance(saved, dict) else (saved, None)
        fp = current_fingerprint("cpu", ranks if ranks > 1 else 2)
        base = get_profile(args.base) if args.base else base_profile("cpu")
        fitted, fit, recs, fit_records = fit_measurements(
            ms, base, name=f"step-fit-{fp.device}-{fp.cores}core-{fp.backend}x{fp.ranks}", host=host)
        info = stored_info(base, fit, recs, fit_records, fp, host=host, refit_from=args.from_measurements)
        path = store.save(fitted, fp, info)
        if args.out:
            fitted.save(args.out)
        print(f"[calibrate] refit {len(recs)} probe plans: fit error (MAPE) {info['mape_after'] * 100:.1f}% "
              f"(base profile {info['mape_before'] * 100:.0f}%); stored in {path}")
        return 0
    import torch
    import torch.distributed as dist

    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun (2 ranks: torchrun --standalone --nproc_per_node 2 -m "
                         "torchrec_sparselift.step_calibration)")
    dist.init_process_group(backend="gloo")
    try:
        from torchrec_sparselift.runtime import probe

        rank, W = dist.get_rank(), dist.get_world_size()
        device = "cpu"
        fp = current_fingerprint(device, int(os.environ.get("LOCAL_WORLD_SIZE", W)))
        workloads = probe.PROBE_WORKLOADS[:2] if args.quick else probe.PROBE_WORKLOADS
        steps = args.steps or (5 if args.quick else probe.DEFAULT_TIMING["steps"])
        warmup = probe.DEFAULT_TIMING["warmup"] if args.warmup is None else args.warmup
        base = get_profile(args.base) if args.base else base_profile(device)
        t0 = time.perf_counter()
        fitted, fit, recs, _fit_records = calibrate_steps(
            dist.group.WORLD, device, base, workloads, steps=steps, warmup=warmup, progress=not args.no_progress,
            name=f"step-fit-{fp.device}-{fp.cores}core-{fp.backend}x{fp.ranks}", store=store,
            save_measurements=args.save_measurements)
        wall = time.perf_counter() - t0
        if rank == 0:
            path = store.path_for(fp)
            if args.out:
                fitted.save(args.out)
            print(f"[calibrate] {len(recs)} probe plans in {wall:.0f} s: fit error (MAPE) "
                  f"{_mape(recs, 'predicted_after_s') * 100:.1f}% (base profile "
                  f"{_mape(recs, 'predicted_before_s') * 100:.0f}%); profile for {fp.describe()} stored in {path}",
                  flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
