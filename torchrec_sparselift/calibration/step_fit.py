"""Fit a hardware profile from measured training steps (pure functions, no torch).

The microbenchmark calibration (:mod:`torchrec_sparselift.cost.calibrate`) measures kernels and
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
:func:`fit_profile` alternates linearization and fitting until the critical path stops changing.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.hardware import HardwareProfile

__all__ = [
    "FitTerm",
    "FitRecord",
    "StepFit",
    "CPU_STEP_TERMS",
    "STEP_MODEL_VERSION",
    "term_value",
    "with_terms",
    "fit_terms",
    "linearize",
    "fit_profile",
]


@attrs.frozen
class FitTerm:
    """One fitted coefficient. ``fields``: the profile fields it sets (all to the same value);
    ``reciprocal``: the term is ``1 / field`` (a rate enters the step time as its inverse);
    ``step``: the finite-difference step used by :func:`linearize` when the value is 0."""

    name: str
    fields: Tuple[str, ...]
    reciprocal: bool = False
    step: float = 1e-5


#: The cost model's structure a fit depends on: bumped when the quantity a term multiplies changes,
#: so a profile fitted under an older structure is calibrated again (``step_calibration``).
#: 2: the input distribution pays two latencies per sharding group plus its splits exchange
#: (``cost.model.collective_calls``; it paid one per group before).
STEP_MODEL_VERSION = 2

#: The terms fitted from real CPU steps (the rest of the profile is kept).
CPU_STEP_TERMS: Tuple[FitTerm, ...] = (
    FitTerm("1/lookup_bw", ("hbm_bw", "ddr_bw"), reciprocal=True, step=1e-11),
    FitTerm("lookup_overhead_s", ("lookup_overhead_s",), step=1e-5),
    FitTerm("1/a2a_bw", ("intra_host_bw", "inter_host_bw"), reciprocal=True, step=1e-10),
    FitTerm("collective_latency_s", ("collective_latency_s",), step=1e-5),
    FitTerm("1/allreduce_bw", ("allreduce_bw",), reciprocal=True, step=1e-10),
    FitTerm("1/dense_flops", ("dense_flops",), reciprocal=True, step=1e-12),
    FitTerm("step_overhead_s", ("step_overhead_s",), step=1e-4),
    FitTerm("feature_overhead_s", ("feature_overhead_s",), step=1e-5),
    FitTerm("table_overhead_s", ("table_overhead_s",), step=1e-5),
    FitTerm("dp_table_overhead_s", ("dp_table_overhead_s",), step=1e-5),
    FitTerm("1/dense_update_bw", ("dense_update_bw",), reciprocal=True, step=1e-11),
    FitTerm("bucketize_id_s", ("bucketize_id_s",), step=1e-8),
    FitTerm("1/interaction_flops", ("interaction_flops",), reciprocal=True, step=1e-12),
    FitTerm("1/dense_mem_bw", ("dense_mem_bw",), reciprocal=True, step=1e-11),
    FitTerm("bwd_row_s", ("bwd_row_s",), step=1e-8),
    FitTerm("reduce_scatter_factor", ("reduce_scatter_factor",), step=1e-3),
)


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
    from scipy.optimize import nnls

    if not records:
        raise ValueError("no records to fit: measure at least one plan")
    names = [n for n in prior if any(abs(r.quantities.get(n, 0.0)) > 0 for r in records)]
    values = {n: float(v) for n, v in prior.items()}
    if names:
        # scale each column so the solver sees numbers of order one
        A = np.array([[r.quantities.get(n, 0.0) / r.measured_s for n in names] for r in records])
        b = np.array([(r.measured_s - r.fixed_s) / r.measured_s for r in records])
        w = np.sqrt(np.array([r.weight for r in records]))
        A, b = A * w[:, None], b * w
        scale = np.array([prior[n] if prior[n] > 0 else 0.0 for n in names])
        col = np.abs(A).max(axis=0)
        unit = np.where(scale > 0, scale, 1.0 / np.maximum(col, 1e-300))
        As = A * unit[None, :]
        rows, rhs = [As], [b]
        for j, n in enumerate(names):
            if prior[n] > 0:
                r = np.zeros(len(names))
                r[j] = math.sqrt(prior_weight)
                rows.append(r[None, :])
                rhs.append(np.array([math.sqrt(prior_weight)]))
        y, _ = nnls(np.vstack(rows), np.concatenate(rhs), maxiter=50 * len(names) + 100)
        for j, n in enumerate(names):
            values[n] = float(y[j] * unit[j])
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


def fit_profile(
    cases: Sequence[Tuple[Any, ...]],
    profile: HardwareProfile,
    terms: Sequence[FitTerm] = CPU_STEP_TERMS,
    iterations: int = 4,
    name: Optional[str] = None,
    prior_weight: float = 1e-3,
    floors: Optional[Mapping[str, float]] = None,
) -> Tuple[HardwareProfile, StepFit]:
    """Fit ``terms`` of ``profile`` to ``cases`` = ``(label, measured_s, predict)`` or
    ``(label, measured_s, predict, kind, weight)`` (``kind`` "step" for a whole step, else the
    attributed part of a step it predicts; default "step" and 1): linearize every case's
    prediction at the current profile, solve :func:`fit_terms`, and repeat from the fitted profile
    (the slowest rank or the exposed phase can change) ``iterations`` times; the iteration with the
    lowest error over the "step" cases (all cases when there are none) is returned, with residuals
    of the real (not linearized) predictions. ``floors``: see :func:`fit_terms`."""
    if not cases:
        raise ValueError("no measured plans to fit")
    full = [tuple(c) + ("step", 1.0)[len(c) - 3:] if len(c) < 5 else tuple(c) for c in cases]
    judged = [c for c in full if c[3] == "step"] or full
    prior = {t.name: term_value(profile, t) for t in terms}
    current = profile
    best: Optional[Tuple[float, HardwareProfile, StepFit]] = None
    for _ in range(max(1, iterations)):
        recs: List[FitRecord] = []
        for label, measured, predict, kind, weight in full:
            _base, q, fixed = linearize(predict, current, terms)
            recs.append(FitRecord(label=label, quantities=q, fixed_s=fixed, measured_s=measured, kind=kind,
                                  weight=weight))
        start = {t.name: term_value(current, t) for t in terms}
        fit = fit_terms(recs, {n: prior[n] if prior[n] > 0 else start[n] for n in prior}, prior_weight, floors)
        current = with_terms(profile, fit.values, terms, name=name or profile.name)
        # residuals of the true model at the fitted profile
        res = []
        errs = []
        for label, measured, predict, kind, _w in judged:
            p = float(predict(current))
            res.append((label, kind, p, float(measured)))
            errs.append(abs(p - measured) / measured)
        real = StepFit(values=fit.values, residuals=tuple(res), mape=float(np.mean(errs)),
                       max_error=float(np.max(errs)), determined=fit.determined)
        if best is None or real.mape < best[0]:
            best = (real.mape, current, real)
    assert best is not None
    return best[1], best[2]
