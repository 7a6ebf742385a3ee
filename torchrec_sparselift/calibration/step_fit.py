"""Fit a hardware profile from measured training steps (pure functions, no torch).

The microbenchmark calibration (:mod:`torchrec_sparselift.calibration.kernel_fit`) measures kernels and
collectives alone; a real step also pays work those benchmarks never see (KJT permutes and splits
per feature, per-table bookkeeping, row-wise bucketize, data-parallel tables' dense gradient and
optimizer pass, fixed per-step pipeline work). Here the profile's coefficients are fitted to what
real steps measured, so those costs are priced at the rate this machine really has.

The cost model's step time is piecewise linear in each *term* below (a term is a profile field, or
the reciprocal of a rate field: seconds per byte, per FLOP): within one piece,

    predicted(plan) = fixed(plan) + sum_j q_j(plan) * x_j

where ``x_j`` is the term's value and ``q_j`` the graph quantity that term multiplies on the
critical path (bytes moved on the slowest rank for ``1/hbm_bw``, tables on it for
``table_overhead_s``, ...). A :class:`FitRecord` holds ``(q, fixed, measured)`` for one plan or one
node kind of one plan; :func:`fit_terms` solves non-negative least squares on the relative residuals
``(predicted - measured) / measured`` (so a 5 ms plan counts as much as a 100 ms one), with a weak
pull of each term towards its prior value so that a term no record can separate stays near it.
:func:`linearize` gets ``q`` and ``fixed`` from any pure ``profile -> seconds`` function (the
cost model itself) by finite differences, so the fit can never disagree with the model it fits;
:func:`fit_step_profile` alternates linearization and fitting until the critical path stops changing.

:func:`fit_probe_plans` is the step calibration's fit: the probe plans measured on this machine
(:class:`~torchrec_sparselift.calibration.records.ProbeMeasurement`, each with its
:class:`~torchrec_sparselift.calibration.pricer.PlanPricer`) as whole-step cases and, where
attributed, one case per fit group (:func:`group_cases`), with the host work measured alone as
fixed values and floors (:func:`host_fit_setup`). :class:`StepFitInfo` is what the fitted profile
is stored with (:mod:`.store`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.calibration.nnls import nonnegative_least_squares
from torchrec_sparselift.calibration.records import HostTermRecord, ProbeMeasurement, ProbeRecord
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.calibration.attribution import StepAttribution, measured_groups
from torchrec_sparselift.cost.report import mape
from torchrec_sparselift.cost.step_terms import CPU_STEP_TERMS, FitTerm
from torchrec_sparselift.files import read_attrs, record_reader

__all__ = [
    "FitRecord",
    "FitCase",
    "StepFit",
    "StepFitInfo",
    "STEP_MODEL_VERSION",
    "term_value",
    "with_terms",
    "fit_terms",
    "linearize",
    "fit_step_profile",
    "HOST_FIXED_TERMS",
    "HOST_DENSE_TERMS",
    "host_fixed_terms",
    "REWRITE_HOST_FIELDS",
    "host_fit_setup",
    "with_a2a_host_split",
    "group_cases",
    "fit_probe_plans",
    "stored_info",
]


#: The cost model's structure a fit depends on: bumped when the quantity a term multiplies changes,
#: so a profile fitted under an older structure is calibrated again (``sparselift calibrate check``
#: fails on it).
#: 2: the input distribution pays two latencies per sharding group plus its splits exchange
#: (``cost.model.collective_calls``; it paid one per group before).
#: 3: a batch split's extra chunk puts the link's own latency (``link_latency_s``) on the link; the
#: rest of a collective's fitted latency is in the measured per-chunk price (``chunk_overhead_s``).
#: 4: the dense part's activation and interaction rates are the host microbenchmark's, not fitted
#: (:func:`host_fixed_terms`; a fit of version 3 put the interaction at ~4x its measured cost).
STEP_MODEL_VERSION = 4



@attrs.frozen
class FitRecord:
    """One measurement to fit: ``measured_s`` against ``fixed_s + sum q * x``.

    ``label``: which plan (and workload); ``kind``: "step" for a whole step, or a node kind when
    an attributed part of the step is fitted; ``quantities``: term name -> the quantity that term
    multiplies (missing: 0)."""

    label: str
    quantities: Mapping[str, float] = attrs.field(converter=dict)
    fixed_s: float
    measured_s: float
    kind: str = "step"
    weight: float = 1.0

    def __attrs_post_init__(self) -> None:
        if not (self.measured_s > 0 and math.isfinite(self.measured_s)):
            raise ValueError(f"record {self.label!r}: measured_s must be a positive time, got {self.measured_s!r}")
        if not self.weight > 0:
            raise ValueError(f"record {self.label!r}: weight must be > 0, got {self.weight!r}")


@attrs.frozen
class StepFit:
    """Fitted term values, per-record residuals and the fit error.

    ``residuals``: ``(label, kind, predicted_s, measured_s)`` per record; ``mape``: mean absolute
    relative error over the records; ``determined``: terms at least one record depends on (the
    others keep their prior); ``max_error``: largest absolute relative error."""

    values: Mapping[str, float] = attrs.field(converter=dict)
    residuals: Tuple[Tuple[str, str, float, float], ...]
    mape: float
    max_error: float
    determined: Tuple[str, ...]

    def to_dict(self) -> Dict[str, object]:
        return dict(values=dict(self.values), mape=self.mape, max_error=self.max_error,
                    determined=list(self.determined),
                    residuals=[dict(label=a, kind=k, predicted_s=p, measured_s=m) for a, k, p, m in self.residuals])


def term_value(profile: HardwareProfile, term: FitTerm) -> float:
    """The term's current value in ``profile`` (its first field; reciprocal for rates)."""
    v = profile.rate(term.fields[0])  # an optional rate falls back to its field (RATE_FALLBACK)
    return 1.0 / v if term.reciprocal else v


def with_terms(profile: HardwareProfile, values: Mapping[str, float], terms: Sequence[FitTerm],
               name: Optional[str] = None) -> HardwareProfile:
    """``profile`` with each term in ``values`` set (a reciprocal term of value 0, an infinitely
    fast rate, is set to 1e18 per second)."""
    by = {t.name: t for t in terms}
    changes: Dict[str, float] = {}
    for k, v in values.items():
        t = by[k]
        if v < 0 or not math.isfinite(v):
            raise ValueError(f"term {k}: value must be finite and >= 0, got {v!r}")
        field_value = (1.0 / v if v > 0 else 1e18) if t.reciprocal else float(v)
        for f in t.fields:
            changes[f] = field_value
    if name is not None:
        changes["name"] = name  # type: ignore[assignment]
    return attrs.evolve(profile, **changes)


def fit_terms(records: Sequence[FitRecord], prior: Mapping[str, float], prior_weight: float = 1e-3,
              floors: Optional[Mapping[str, float]] = None) -> StepFit:
    """Non-negative least squares of the relative residuals of ``records`` over the terms in
    ``prior`` (their starting values). Each term with a positive prior also gets a row pulling it
    towards that value with weight ``prior_weight`` (relative to one record), so a term the
    records cannot separate from another stays near its prior instead of taking an arbitrary
    share; terms no record depends on keep the prior exactly. ``floors``: a lower bound per term
    (what a microbenchmark measured of it alone); the fit solves for the part above it."""
    if floors:
        floors = {n: float(f) for n, f in floors.items() if n in prior and f > 0}
    if floors:
        shifted = [attrs.evolve(r, fixed_s=r.fixed_s + sum(r.quantities.get(n, 0.0) * f for n, f in floors.items()))
                   for r in records]
        above = {n: max(0.0, float(v) - floors.get(n, 0.0)) for n, v in prior.items()}
        fit = fit_terms(shifted, above, prior_weight)
        values = {n: v + floors.get(n, 0.0) for n, v in fit.values.items()}
        res = tuple((a, k, p, m) for a, k, p, m in fit.residuals)  # predictions are unchanged by the shift
        return StepFit(values=values, residuals=res, mape=fit.mape, max_error=fit.max_error,
                       determined=fit.determined)
    if not records:
        raise ValueError("no records to fit: measure at least one plan")
    names = [n for n in prior if any(abs(r.quantities.get(n, 0.0)) > 0 for r in records)]
    values = {n: float(v) for n, v in prior.items()}
    if names:
        # relative residuals of the records, then one row per term with a prior pulling it towards
        # that value (weight ``prior_weight``, relative to one record of weight 1)
        A = [[r.quantities.get(n, 0.0) / r.measured_s for n in names] for r in records]
        b = [(r.measured_s - r.fixed_s) / r.measured_s for r in records]
        w = [r.weight for r in records]
        for j, n in enumerate(names):
            if prior[n] > 0:
                row = [0.0] * len(names)
                row[j] = 1.0 / prior[n]
                A.append(row)
                b.append(1.0)
                w.append(prior_weight)
        y = nonnegative_least_squares(A, b, weights=w, maxiter=50 * len(names) + 100)
        for j, n in enumerate(names):
            values[n] = float(y[j])
    res = []
    errs = []
    for r in records:
        p = r.fixed_s + sum(r.quantities.get(n, 0.0) * values[n] for n in values)
        res.append((r.label, r.kind, float(p), float(r.measured_s)))
        errs.append(abs(p - r.measured_s) / r.measured_s)
    return StepFit(values=values, residuals=tuple(res), mape=float(np.mean(errs)), max_error=float(np.max(errs)),
                   determined=tuple(names))


def linearize(predict: Callable[[HardwareProfile], float], profile: HardwareProfile, terms: Sequence[FitTerm],
              rel: float = 0.05) -> Tuple[float, Dict[str, float], float]:
    """``(predicted_s, quantities, fixed_s)`` of ``predict`` (a pure ``profile -> seconds``) at
    ``profile``: the quantity of each term is the slope of the prediction in it (a forward
    difference of ``rel`` times its value, or ``term.step`` when it is 0), and ``fixed_s`` the
    rest, so that ``fixed_s + sum q * value == predicted_s``."""
    base = float(predict(profile))
    q: Dict[str, float] = {}
    fixed = base
    for t in terms:
        x0 = term_value(profile, t)
        dx = rel * x0 if x0 > 0 else t.step
        up = float(predict(with_terms(profile, {t.name: x0 + dx}, terms)))
        q[t.name] = (up - base) / dx
        fixed -= q[t.name] * x0
    return base, q, fixed


@attrs.frozen
class FitCase:
    """One measurement for :func:`fit_step_profile`: ``measured_s`` against ``predict(profile)``
    (a pure ``profile -> seconds``, e.g. a :class:`~torchrec_sparselift.calibration.pricer.PlanPricer`).
    ``kind``: "step" for a whole step, else the attributed part of a step it predicts (a fit
    group); ``weight``: how much its relative residual counts against a step case's."""

    label: str
    measured_s: float
    predict: Callable[[HardwareProfile], float] = attrs.field(eq=False, repr=False)
    kind: str = "step"
    weight: float = 1.0


def fit_step_profile(
    cases: Sequence[FitCase],
    profile: HardwareProfile,
    terms: Sequence[FitTerm] = CPU_STEP_TERMS,
    iterations: int = 4,
    name: Optional[str] = None,
    prior_weight: float = 1e-3,
    floors: Optional[Mapping[str, float]] = None,
) -> Tuple[HardwareProfile, StepFit]:
    """Fit ``terms`` of ``profile`` to ``cases``: linearize every case's prediction at the current
    profile, solve :func:`fit_terms`, and repeat from the fitted profile (the slowest rank or the
    exposed phase can change) ``iterations`` times; the iteration with the lowest error over the
    "step" cases (all cases when there are none) is returned, with residuals of the real (not
    linearized) predictions. ``floors``: see :func:`fit_terms`."""
    if not cases:
        raise ValueError("no measured plans to fit")
    judged = [c for c in cases if c.kind == "step"] or list(cases)
    prior = {t.name: term_value(profile, t) for t in terms}
    current = profile
    best: Optional[Tuple[float, HardwareProfile, StepFit]] = None
    for _ in range(max(1, iterations)):
        recs: List[FitRecord] = []
        for c in cases:
            _base, q, fixed = linearize(c.predict, current, terms)
            recs.append(FitRecord(label=c.label, quantities=q, fixed_s=fixed, measured_s=c.measured_s, kind=c.kind,
                                  weight=c.weight))
        start = {t.name: term_value(current, t) for t in terms}
        fit = fit_terms(recs, {n: prior[n] if prior[n] > 0 else start[n] for n in prior}, prior_weight, floors)
        current = with_terms(profile, fit.values, terms, name=name or profile.name)
        # residuals of the true model at the fitted profile
        res = []
        errs = []
        for c in judged:
            p = float(c.predict(current))
            res.append((c.label, c.kind, p, float(c.measured_s)))
            errs.append(abs(p - c.measured_s) / c.measured_s)
        real = StepFit(values=fit.values, residuals=tuple(res), mape=float(np.mean(errs)),
                       max_error=float(np.max(errs)), determined=fit.determined)
        if best is None or real.mape < best[0]:
            best = (real.mape, current, real)
    assert best is not None
    return best[1], best[2]


#: Step-fit terms a calibration with host microbenchmarks takes as measured instead of fitting.
HOST_FIXED_TERMS = ("bucketize_id_s",)
#: Step-fit terms taken as the host microbenchmarks measured them where they measured them (> 0):
#: the dense part's parameter-free work (``measure.microbench.bench_dense_terms``), term -> the
#: :class:`~torchrec_sparselift.calibration.records.HostTermRecord` field.
HOST_DENSE_TERMS = (("1/dense_mem_bw", "dense_act_byte_s"), ("1/interaction_flops", "interaction_flop_s"))


def host_fixed_terms(host: Optional[Any]) -> Tuple[str, ...]:
    """The step-fit terms a fit with host microbenchmarks ``host`` (a
    :class:`~torchrec_sparselift.calibration.records.HostTermRecord` or its stored dict; None: none)
    takes as measured instead of fitting: :data:`HOST_FIXED_TERMS`, and each of
    :data:`HOST_DENSE_TERMS` the record measured."""
    if not host:
        return ()
    get = host.get if isinstance(host, Mapping) else lambda f, d=0.0: getattr(host, f, d)
    return HOST_FIXED_TERMS + tuple(t for t, f in HOST_DENSE_TERMS if float(get(f, 0.0) or 0.0) > 0)


#: Profile fields the host microbenchmarks measure for the sparse-path rewrites and the step fit
#: takes as they are (``HostTermRecord``'s fields of the same names).
REWRITE_HOST_FIELDS = ("chunk_overhead_s", "dedup_id_s")


def host_fit_setup(base: HardwareProfile, host: Optional[Any]
                   ) -> Tuple[HardwareProfile, Tuple[FitTerm, ...], Dict[str, float]]:
    """``(base, terms, floors)`` of a step fit given host microbenchmarks (a
    :class:`~torchrec_sparselift.calibration.records.HostTermRecord` or its stored dict; None: the
    base, all of ``CPU_STEP_TERMS``, no floors). With them, ``codec_byte_s`` (the fp16 comm codec;
    the probes run at fp32, so no step holds it) and ``bucketize_id_s`` are the measured values
    and not fitted (whole steps cannot tell it from per-feature row-wise work: fitted, it came out
    20-40x the measured kernel cost and over-priced row-wise plans with many ids), and the
    data-parallel optimizer's per-table (``dp_table_overhead_s``) and per-byte
    (``1/dense_update_bw``, the model's dense update moves 3x the replica's bytes) terms are fitted
    above what the tables' ``RowWiseAdagrad.step`` alone costs (DDP's per-parameter work and cold caches come on top),
    ``1/a2a_bw`` above the bare all-to-all's per-byte cost (measured across ranks; 0 when not), and
    the dense part's activation and interaction rates are their cost measured alone
    (``measure.microbench.bench_dense_terms``; :func:`host_fixed_terms`), the dense layers' FLOP rate above an MLP's alone
    (``measure.microbench.bench_dense_flops``), and the fused backward's per-distinct-row cost above
    fbgemm's alone (``measure.microbench.bench_tbe_backward``). The rewrites' constants
    (:data:`REWRITE_HOST_FIELDS`: ``chunk_overhead_s``, ``dedup_id_s``) are the measured values
    where the record has them."""
    if host is None:
        return base, tuple(CPU_STEP_TERMS), {}
    if isinstance(host, Mapping):
        host = HostTermRecord(**host)
    base = attrs.evolve(base, bucketize_id_s=float(host.bucketize_id_s), codec_byte_s=float(host.codec_byte_s))
    # the sparse-path rewrites' constants (no probe plan runs a rewrite): the measured values as they are
    rewrites = {f: float(getattr(host, f)) for f in REWRITE_HOST_FIELDS if getattr(host, f) is not None}
    if rewrites:
        base = attrs.evolve(base, **rewrites)
    # the dense part's parameter-free work measured alone (forward + backward = 3x the forward the
    # rates price), taken as it is: the probes cannot tell activation bytes from FLOPs (their ratio
    # is within 0.06-0.12 B/FLOP on all four probe models; fitted freely the byte rate went to 0 or
    # infinity), and as floors the fit put the interaction at ~4x its measured cost, which priced
    # the held-out workloads' dense part at 1.25-1.97x their dense forward + backward timed alone
    # (benchmarks/dense_part.py; docs/cost_model.md, "Dense part")
    fixed = set(host_fixed_terms(host))
    base = with_terms(base, {t: float(getattr(host, f)) / 3.0 for t, f in HOST_DENSE_TERMS if t in fixed},
                      CPU_STEP_TERMS)
    terms = tuple(t for t in CPU_STEP_TERMS if t.name not in fixed)
    floors = {"dp_table_overhead_s": float(host.optimizer_tensor_s),
              "1/dense_update_bw": float(host.optimizer_byte_s) / 3.0}
    if host.a2a_byte_s > 0:
        # a step's all-to-all cannot move a byte faster than the bare collective. Fitted from whole
        # steps it comes out ~3-5x that: it also holds byte-correlated work around the collective.
        # Fixing it at the bare cost made the planner keep kaggle/dcnv2 table-wise but priced every
        # plan 6-18% low, so it is a floor, not the value.
        floors["1/a2a_bw"] = float(host.a2a_byte_s)
    # the dense layers' products cannot run faster than a near-square MLP's measured alone (fitted
    # freely the FLOP rate went to 1e18, i.e. free, where the probes' FLOPs moved with their
    # activation bytes; the DCN example's 1.4 GFLOP per step, forward + backward, then cost nothing)
    if host.dense_flop_s > 0:
        floors["1/dense_flops"] = float(host.dense_flop_s)
    # a fused TBE backward updates each distinct row once (fbgemm's CPU kernel, measured alone:
    # ~0.6 us per row, ~0 per id): a step cannot update a row faster
    if host.tbe_row_s > 0:
        floors["bwd_row_s"] = float(host.tbe_row_s)
    # a reduce-scatter byte costs no less than an all-to-all byte (gloo alone: ~4.5x, its all-gather ~2x)
    floors["reduce_scatter_factor"] = 1.0
    return base, terms, floors


#: A group measured below this share of its step is left out of the fit (its relative error is noise).
MIN_GROUP_SHARE = 0.02
#: Weight of a fit group's case relative to a step case of the same plan (residuals relative to the step).
GROUP_WEIGHT = 1.0


def with_a2a_host_split(profile: HardwareProfile, host: Optional[Any]) -> HardwareProfile:
    """``profile`` with ``a2a_host_byte_s`` set from its fitted all-to-all cost per byte and the bare
    collective's measured alone (``host``: a
    :class:`~torchrec_sparselift.calibration.records.HostTermRecord` or its dict, ``a2a_byte_s``):

        a2a_host_byte_s = max(0, 1 / intra_host_bw - a2a_byte_s)

    the byte-correlated work around the collective that the fit found above its floor (what a
    lossy comm precision does not shrink, ``cost.model.lossy_byte_s``). ``profile`` unchanged
    without a measured bare collective (one rank, no host terms)."""
    if host is None:
        return profile
    bare = float(host.get("a2a_byte_s", 0.0) if isinstance(host, Mapping) else host.a2a_byte_s)
    if bare <= 0:
        return profile
    return attrs.evolve(profile, a2a_host_byte_s=max(0.0, 1.0 / float(profile.intra_host_bw) - bare))


def group_cases(label: str, measured_s: float, attribution: Any, pricer: Any) -> List[FitCase]:
    """:func:`fit_step_profile` cases of one attributed plan: per fit group
    (:data:`~torchrec_sparselift.calibration.attribution.FIT_GROUPS`) its measured seconds (the
    attribution scaled to the unprofiled ``measured_s``) against the model's (``pricer.group``),
    weighted so that its residual counts relative to the whole step, as a step case's does."""
    att = attribution if isinstance(attribution, StepAttribution) else StepAttribution.from_dict(attribution)
    out = []
    for g, sec in measured_groups(att, measured_s).items():
        if sec >= MIN_GROUP_SHARE * measured_s:
            out.append(FitCase(f"{label}:{g}", sec, pricer.group(g), g, GROUP_WEIGHT * (sec / measured_s) ** 2))
    return out


def fit_probe_plans(
    measurements: Sequence[ProbeMeasurement],
    pricers: Sequence[Any],
    base: HardwareProfile,
    name: str = "step-fit",
    prior_weight: float = 1e-2,
    attributed: bool = True,
    host: Optional[Any] = None,
    exclude: Sequence[str] = (),
) -> Tuple[HardwareProfile, StepFit, List[ProbeRecord], List[FitRecord]]:
    """Fit ``base``'s step terms to measured probe plans, ``pricers[i]`` pricing
    ``measurements[i]``'s plan (a :class:`~torchrec_sparselift.calibration.pricer.PlanPricer`):
    the fitted profile, the fit, per-plan before/after predictions, and the linearized records.

    Each plan is a step case; a plan measured with an attribution also gives one case per fit
    group (:func:`group_cases`), so each term is fitted to the work it prices. ``attributed=False``
    fits the step times alone.

    ``host``: a :class:`~torchrec_sparselift.calibration.records.HostTermRecord` measured on this
    machine: the row-wise bucketize cost per id is taken from it (not fitted), and the data-parallel
    tables' optimizer terms are fitted above its per-tensor and per-byte costs (:func:`host_fit_setup`);
    the fitted all-to-all's share above the bare collective becomes ``a2a_host_byte_s``
    (:func:`with_a2a_host_split`).

    ``exclude``: step terms left out of the model (an ablation: their profile fields at
    ``HardwareProfile``'s defaults, not fitted), e.g. ``("bwd_row_s",)`` prices the fused backward
    per id only."""
    if len(measurements) != len(pricers):
        raise ValueError(f"fit_probe_plans: {len(measurements)} measurements but {len(pricers)} pricers")
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

    cases: List[FitCase] = []
    extra: List[FitCase] = []
    for m, pricer in zip(measurements, pricers):
        cases.append(FitCase(m.label, m.measured_s, pricer))
        if attributed and m.attribution is not None:
            extra += group_cases(m.label, m.measured_s, m.attribution, pricer)
    fitted, fit = fit_step_profile(cases + extra, base, terms, name=name, prior_weight=prior_weight, floors=floors)
    fitted = with_a2a_host_split(fitted, host)
    fit_records = []
    for c in cases + extra:
        _b, q, fixed = linearize(c.predict, fitted, terms)
        fit_records.append(FitRecord(label=c.label, quantities=q, fixed_s=fixed, measured_s=c.measured_s, kind=c.kind,
                                     weight=c.weight))
    recs = [ProbeRecord(workload=m.workload, plan=m.kind, measured_s=c.measured_s, predicted_before_s=c.predict(base),
                        predicted_after_s=c.predict(fitted))
            for m, c in zip(measurements, cases)]
    return fitted, fit, recs, fit_records


def record_dict(r: FitRecord) -> Dict[str, Any]:
    """A :class:`FitRecord` as the JSON the store keeps."""
    return dict(label=r.label, quantities=dict(r.quantities), fixed_s=r.fixed_s, measured_s=r.measured_s,
                kind=r.kind, weight=r.weight)


def records_mape(recs: Sequence[ProbeRecord], attr: str) -> float:
    """MAPE of the probe records' ``attr`` prediction (``predicted_before_s`` or ``predicted_after_s``)."""
    return mape([getattr(r, attr) for r in recs], [r.measured_s for r in recs])


@attrs.frozen(kw_only=True)
class StepFitInfo:
    """What a step-fitted profile is stored with (the store's ``info``, JSON).

    ``fit``: the :class:`StepFit` as its dict (``values``, errors, residuals); ``model_version``:
    the :data:`STEP_MODEL_VERSION` it was fitted under (None: stored before versions were recorded);
    ``host_terms``: the host microbenchmarks' :class:`HostTermRecord` dict (None: not measured);
    ``fit_records``: the linearized records (what guard feedback refits); ``drift_spread``: how far
    the machine's speed moved during the calibration (None: not recorded); ``feedback_records``:
    guard trials added since; ``extra``: every other stored field (creation time, base profile,
    errors before and after, per-plan records, ...), kept as stored."""

    fit: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    model_version: Optional[int] = None
    host_terms: Optional[Mapping[str, float]] = None
    fit_records: Tuple[FitRecord, ...] = attrs.field(default=(), converter=tuple)
    drift_spread: Optional[float] = None
    feedback_records: int = 0
    extra: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    _FIELDS = ("fit", "model_version", "host_terms", "fit_records", "drift_spread", "feedback_records")

    @classmethod
    def from_dict(cls, info: Any) -> "StepFitInfo":
        """The info :meth:`to_dict` wrote (a dict, a file's reader, or None: no step fit)."""
        f = record_reader(cls, {} if info is None else info)
        return read_attrs(cls, f, ignore_unknown=True,
                          kinds={"fit": dict, "model_version": int, "host_terms": dict, "drift_spread": float,
                                 "feedback_records": int},
                          fit_records=lambda r: [read_attrs(FitRecord, x, kinds={"label": str, "quantities": dict,
                                                                                 "fixed_s": float, "measured_s": float,
                                                                                 "kind": str, "weight": float})
                                                 for x in r.objs("fit_records", required=False)],
                          extra=lambda r: {k: v for k, v in r.data.items() if k not in cls._FIELDS})

    def to_dict(self) -> Dict[str, Any]:
        out = dict(self.extra)
        out["fit"] = dict(self.fit)
        out["fit_records"] = [record_dict(r) for r in self.fit_records]
        for key in ("model_version", "host_terms", "drift_spread"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.feedback_records:
            out["feedback_records"] = self.feedback_records
        return out

    @property
    def pipeline_factors(self) -> Dict[str, Any]:
        """The measured pipeline step factors (``extra["pipeline_factors"]``: per pipeline its
        ``factor``, its ``error`` and the per-workload ``ratios``); empty when not measured."""
        return dict(self.extra.get("pipeline_factors") or {})

    @property
    def fitted(self) -> bool:
        """Whether the profile has a step fit (a microbenchmark profile has none)."""
        return bool(self.fit.get("values"))

    def fitted_model_version(self) -> Optional[int]:
        """The :data:`STEP_MODEL_VERSION` of the fit (1 for one stored before versions were recorded);
        None without a step fit."""
        if not self.fitted:
            return None
        return int(self.model_version) if self.model_version is not None else 1

    def before_codec(self) -> bool:
        """Whether the fit was calibrated before the lossy comms' codec was measured (host terms
        without ``codec_byte_s``): its profile has no codec or all-to-all host share of its own."""
        return self.fitted and bool(self.host_terms) and "codec_byte_s" not in self.host_terms

    def before_rewrites(self) -> bool:
        """Whether the fit was calibrated before the sparse-path rewrites' constants were measured
        (host terms without ``chunk_overhead_s`` / ``dedup_id_s``): its profile has them None, so
        the planner neither splits the batch nor deduplicates ids."""
        return self.fitted and bool(self.host_terms) and any(f not in self.host_terms for f in REWRITE_HOST_FIELDS)

    def missing_terms(self) -> List[str]:
        """The :data:`CPU_STEP_TERMS` the fit neither fitted nor fixed from host measurements: it was
        calibrated by an older cost model. Empty without a step fit."""
        if not self.fitted:
            return []
        fixed = set(host_fixed_terms(self.host_terms))
        return [t.name for t in CPU_STEP_TERMS if t.name not in self.fit["values"] and t.name not in fixed]


def stored_info(base: HardwareProfile, fit: StepFit, recs: Sequence[ProbeRecord], fit_records: Sequence[FitRecord],
                fingerprint: str, host: Optional[Mapping[str, float]] = None, drift_spread: Optional[float] = None,
                **extra: Any) -> StepFitInfo:
    """The :class:`StepFitInfo` a step-fitted profile is stored with: the fit, its records (what
    guard feedback refits), the host terms, the errors before and after, when and for which machine
    (``fingerprint``: its description)."""
    return StepFitInfo(
        fit=fit.to_dict(), model_version=STEP_MODEL_VERSION, host_terms=None if host is None else dict(host),
        fit_records=fit_records, drift_spread=drift_spread,
        extra=dict(created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), base=base.name,
                   mape_before=records_mape(recs, "predicted_before_s"),
                   mape_after=records_mape(recs, "predicted_after_s"),
                   records=[attrs.asdict(r) for r in recs], fingerprint=fingerprint, **extra))
