"""Fit the sparse-path rewrites' machine constants to their measurements (pure: the measuring is
:mod:`torchrec_sparselift.measure.microbench` and :mod:`torchrec_sparselift.measure.steps`).

The host microbenchmarks' two profile fields, each the slope of a line through its records
(:func:`~torchrec_sparselift.calibration.nnls.nonnegative_least_squares` on ``[1, x]``, residuals
relative to each measured time so that every point counts the same)::

    chunk_overhead_s   t(k) = t_1 + (k - 1) * chunk_overhead_s
        t(k): one forward + backward of a DLRM-like dense model over a fixed batch run as k
        chunks (:class:`~torchrec_sparselift.calibration.records.ChunkRecord`): what one more
        chunk adds to a step (the dense calls run once more, the batch is sliced and merged once
        more): the dense calls' own part of what ``cost.batch_split`` charges per extra chunk;

    dedup_id_s         t(n) = c + n * dedup_id_s
        t(n): the id-deduplication kernels over n ids of a feature at a unique ratio
        (:class:`~torchrec_sparselift.calibration.records.DedupRecord`), over several n and ratios:
        the per-id price ``cost.wire_ids`` charges (``n * dedup_id_s``; the per-call ``c`` is
        reported, not priced).

The step calibration's real batch-split steps give the chunk cost of a real step
(:func:`step_chunk_cost`): ``chunk_overhead_s`` and ``chunk_feature_s``, the intercept and slope
of the probe workloads' per-chunk step slopes over their feature counts.

Records marked ``held_out`` are not fitted: the fit predicts them and :class:`SlopeFit` reports
the error (what ``sparselift calibrate kernels`` prints). Nothing here imports torch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.calibration.nnls import nonnegative_least_squares
from torchrec_sparselift.calibration.records import ChunkRecord, DedupRecord
from torchrec_sparselift.errors import CalibrationError

__all__ = ["SlopeFit", "ChunkCostFit", "fit_slope", "fit_chunk_overhead", "fit_dedup_id_s", "step_chunk_cost"]


@attrs.frozen(kw_only=True)
class SlopeFit:
    """One line ``t = intercept + slope * x`` fitted to measured times, and how well it holds.

    ``field``: the profile field the slope is; ``unit``: what ``x`` counts (one more chunk, one
    id); ``points``: the fitted records; ``rms_error`` / ``max_error``: their relative residuals
    (root mean square, largest); ``held_out``: ``(label, predicted s, measured s)`` of each record
    kept out of the fit."""

    field: str
    unit: str
    slope: float
    intercept: float
    points: int
    rms_error: float
    max_error: float
    held_out: Tuple[Tuple[str, float, float], ...] = attrs.field(default=(), converter=tuple)

    @property
    def held_out_error(self) -> Optional[float]:
        """The largest relative error of a held-out prediction (None: none held out)."""
        if not self.held_out:
            return None
        return max(abs(p - m) / m for _l, p, m in self.held_out)

    def lines(self) -> Tuple[str, ...]:
        """What ``calibrate kernels`` prints: the value, the fit's residual, each held-out point."""
        scale, unit = (1e9, "ns") if self.slope < 1e-6 else (1e6, "us")
        out = [f"{self.field} {self.slope * scale:.3g} {unit} per {self.unit} (intercept "
               f"{self.intercept * 1e6:.1f} us; {self.points} points, residual rms {100 * self.rms_error:.1f}% "
               f"max {100 * self.max_error:.1f}%)"]
        for label, p, m in self.held_out:
            out.append(f"  held out {label}: predicted {p * 1e3:.3f} ms, measured {m * 1e3:.3f} ms "
                       f"({100 * (p - m) / m:+.1f}%)")
        return tuple(out)

    def to_dict(self) -> Dict[str, Any]:
        return {**attrs.asdict(self), "held_out": [list(h) for h in self.held_out]}


def fit_slope(xs: Sequence[float], ys: Sequence[float], *, field: str, unit: str,
              held_out: Sequence[Tuple[str, float, float]] = ()) -> SlopeFit:
    """``t = intercept + slope * x`` by non-negative least squares on relative residuals (both
    coefficients >= 0) through ``(xs, ys)``; ``held_out``: ``(label, x, measured s)`` to predict.
    :class:`~torchrec_sparselift.errors.CalibrationError` for fewer than two distinct ``x`` or a
    time that is not positive and finite."""
    if len(xs) != len(ys):
        raise CalibrationError(f"{field}: {len(xs)} quantities but {len(ys)} times")
    if len(set(xs)) < 2:
        raise CalibrationError(f"{field}: the records span {len(set(xs))} distinct {unit} count(s); measure at "
                               "least two so that the slope is determined")
    for t in list(ys) + [m for _l, _x, m in held_out]:
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise CalibrationError(f"{field}: measured times must be positive and finite, got {t!r}")
    rows = [[1.0 / y, float(x) / y] for x, y in zip(xs, ys)]
    intercept, slope = (float(v) for v in nonnegative_least_squares(rows, [1.0] * len(ys)))
    rel = [(intercept + slope * x - y) / y for x, y in zip(xs, ys)]
    return SlopeFit(
        field=field, unit=unit, slope=slope, intercept=intercept, points=len(xs),
        rms_error=math.sqrt(sum(r * r for r in rel) / len(rel)), max_error=max(abs(r) for r in rel),
        held_out=[(label, intercept + slope * x, m) for label, x, m in held_out])


def _split(records: Sequence[Any], x: Callable[[Any], float], label: Callable[[Any], str]
           ) -> Tuple[List[float], List[float], List[Tuple[str, float, float]]]:
    """``(xs, times, held_out)``: the records to fit and the ``(label, x, time)`` of those held out."""
    fit = [r for r in records if not r.held_out]
    held = [(label(r), x(r), float(r.seconds)) for r in records if r.held_out]
    return [x(r) for r in fit], [float(r.seconds) for r in fit], held


def fit_chunk_overhead(records: Sequence[ChunkRecord]) -> SlopeFit:
    """``chunk_overhead_s``: the slope of a step's time over its chunk count minus one, at one
    fixed total batch (``t(k) = t_1 + (k - 1) * chunk_overhead_s``)."""
    if not records:
        raise CalibrationError("no chunked dense steps to fit chunk_overhead_s; run bench_chunk_steps")
    batches = {r.batch_size for r in records}
    if len(batches) != 1:
        raise CalibrationError(f"chunked dense steps of several total batches {sorted(batches)}: the slope over k "
                               "is taken at one fixed batch")
    xs, ys, held = _split(records, lambda r: float(r.chunks - 1), lambda r: f"k={r.chunks}")
    return fit_slope(xs, ys, field="chunk_overhead_s", unit="extra chunk", held_out=held)


def fit_dedup_id_s(records: Sequence[DedupRecord]) -> SlopeFit:
    """``dedup_id_s``: the slope of the dedup kernels' time over the ids they take, over every
    measured id count and unique ratio (``t(n) = c + n * dedup_id_s``)."""
    if not records:
        raise CalibrationError("no dedup kernel timings to fit dedup_id_s; run bench_dedup_kernels")
    xs, ys, held = _split(records, lambda r: float(r.ids), lambda r: f"{r.ids} ids at unique ratio {r.unique_ratio:g}")
    return fit_slope(xs, ys, field="dedup_id_s", unit="id", held_out=held)


@attrs.frozen(kw_only=True)
class ChunkCostFit:
    """What one more batch chunk costs a real training step, as a line over the split module's
    feature count: ``overhead_s + feature_s * features`` beside the chunk's collectives' latency.

    ``slopes``: per probe workload, its measured step's slope over ``k - 1`` (:class:`SlopeFit`);
    ``features``: each workload's feature count; ``model_slopes``: per workload, what the cost
    model predicts per extra chunk without a dense chunk cost (the chunk's collectives' latency
    less what the split hides), taken off its measured slope; ``residuals``: per workload, the
    line's error on its slope relative to its unsplit step (what the price misses of the step)."""

    overhead_s: float
    feature_s: float
    model_slopes: Mapping[str, float]
    slopes: Mapping[str, SlopeFit]
    features: Mapping[str, int]
    residuals: Mapping[str, float]

    def dense_s(self, features: int) -> float:
        """One more chunk's dense cost for a model of ``features`` features."""
        return self.overhead_s + self.feature_s * features

    def predicted_slope_s(self, workload: str) -> float:
        """The fitted step's seconds per extra chunk of ``workload`` (its model slope included)."""
        return self.model_slopes[workload] + self.dense_s(self.features[workload])

    def lines(self) -> Tuple[str, ...]:
        """What the calibration prints: the two constants, then each workload's slope and the line's."""
        out = [f"chunk cost {self.overhead_s * 1e3:.3f} ms + {self.feature_s * 1e6:.1f} us per feature per extra "
               f"chunk ({len(self.slopes)} workloads)"]
        for w, fit in self.slopes.items():
            out.append(f"  {w} ({self.features[w]} features): measured {fit.slope * 1e3:.3f} ms per extra chunk, "
                       f"priced {self.predicted_slope_s(w) * 1e3:.3f} ms (the model without a dense chunk cost "
                       f"{self.model_slopes[w] * 1e3:.3f} ms; {100 * self.residuals[w]:+.1f}% of its step)")
        return tuple(out)


def step_chunk_cost(times: Mapping[str, Mapping[int, float]], features: Mapping[str, int],
                    model_slopes: Optional[Mapping[str, float]] = None) -> ChunkCostFit:
    """What one more batch chunk costs a real training step, from the measured ``overlap`` steps of
    probe workloads of several feature counts (``times[workload][k]``: seconds, at least two chunk
    counts each; ``features[workload]``: its feature count; ``model_slopes[workload]``: what the
    cost model predicts per extra chunk of it without a dense chunk cost, default 0): per workload
    the slope of its step over ``k - 1`` (its own intercept), then
    ``slope - model_slope = overhead_s + feature_s * F`` by
    non-negative least squares over the workloads, each residual relative to that workload's
    unsplit step (its shortest chunk count's). A real chunk cuts the batch, issues its
    collectives, cuts its keyed embeddings into per-feature tensors and merges their gradients
    beside running the dense calls again, which the dense-only reading (:func:`fit_chunk_overhead`)
    leaves out. :class:`~torchrec_sparselift.errors.CalibrationError` for no workloads, a
    workload without its feature count, or fewer than two distinct feature counts (the
    per-feature part is then not determined)."""
    if not times:
        raise CalibrationError("no batch-split steps to fit the chunk cost; run measure_chunk_times")
    missing = sorted(w for w in times if w not in features)
    if missing:
        raise CalibrationError(f"the chunk cost needs each workload's feature count; none for {missing}")
    counts = {w: int(features[w]) for w in times}
    if len(set(counts.values())) < 2:
        raise CalibrationError(f"the chunk cost's workloads span {len(set(counts.values()))} feature count(s) "
                               f"({counts}); measure workloads of at least two feature counts so that the "
                               "per-feature part is determined")
    base = {w: 0.0 for w in times} if model_slopes is None else {w: model_slopes.get(w) for w in times}
    bad = {w: v for w, v in base.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
    if bad:
        raise CalibrationError(f"the cost model's slopes per extra chunk must be finite numbers, got {bad}")
    slopes = {w: fit_slope([k - 1 for k in ks], [ks[k] for k in ks], field="chunk_overhead_s",
                           unit=f"extra chunk of {w}'s step") for w, ks in times.items()}
    unsplit = {w: float(ks[min(ks)]) for w, ks in times.items()}
    rows = [[1.0 / unsplit[w], counts[w] / unsplit[w]] for w in times]
    target = [(slopes[w].slope - base[w]) / unsplit[w] for w in times]
    overhead, per_feature = (float(v) for v in nonnegative_least_squares(rows, target))
    residuals = {w: (base[w] + overhead + per_feature * counts[w] - slopes[w].slope) / unsplit[w] for w in times}
    return ChunkCostFit(overhead_s=overhead, feature_s=per_feature, model_slopes={w: float(v) for w, v in base.items()},
                        slopes=slopes, features=counts, residuals=residuals)
