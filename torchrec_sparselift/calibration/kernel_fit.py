"""Fit a :class:`HardwareProfile` to kernel microbenchmarks (pure: the measuring is
:mod:`torchrec_sparselift.measure.kernels`).

The fitted parameters are exactly those the cost model's equations use (``B`` = ``ids x
row_bytes(dim)``, the bytes a lookup reads; ``n`` = ranks in the group)::

    lookup forward            t = lookup_overhead_s + B / bw
    backward + fused update   t = lookup_overhead_s + bwd_factor * B / bw
      (measured together:     t = 2 lookup_overhead_s + (1 + bwd_factor) * B / bw)
    all_to_all_single         t = collective_latency_s + (n - 1) / n * bytes / a2a_bw
    all_reduce                t = collective_latency_s + 2 (n - 1) / n * bytes / allreduce_bw
    dense matmul              t = flops / dense_flops
    pinned host->device copy  t = c + bytes / uvm_bw                 (CUDA only)
    dense step in k chunks    t = t_1 + (k - 1) * chunk_overhead_s     (:mod:`.rewrite_fit`)
    dedup kernels over n ids  t = c + n * dedup_id_s                   (:mod:`.rewrite_fit`)

``bytes`` is each rank's buffer; (n - 1) / n of it leaves the rank, which is what the cost model
counts. ``bw`` is ``hbm_bw`` on CUDA and ``ddr_bw`` on CPU (a CPU profile gets the fitted value in
``hbm_bw``, ``ddr_bw`` and ``uvm_bw``, as the ``cpu-gloo`` preset does). ``row_granularity_bytes``
is chosen from a few candidates by the same fit. Each family is fitted by non-negative least
squares (:func:`~torchrec_sparselift.calibration.nnls.nonnegative_least_squares`) on *relative*
residuals (every point counts the same whatever its size) with Huber reweighting, so one noisy
point on a shared machine cannot drag a rate far. The report gives each family's mean and max
absolute percentage error under the fitted profile. Nothing here imports torch.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.calibration.nnls import nonnegative_least_squares
from torchrec_sparselift.calibration.records import (
    CollectiveRecord,
    CopyRecord,
    DenseRecord,
    LookupRecord,
    MicrobenchRecords,
)
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.cost.terms import cold_row_seconds
from torchrec_sparselift.errors import CalibrationError
from torchrec_sparselift.calibration.records import RECORDS_SCHEMA
from torchrec_sparselift.calibration.rewrite_fit import SlopeFit, fit_chunk_overhead, fit_dedup_id_s
from torchrec_sparselift.files import Fields, load_json

__all__ = [
    "CalibrationError",
    "FamilyFit",
    "CalibrationReport",
    "REPORT_SCHEMA",
    "fit_nonnegative",
    "fit_lookups",
    "fit_collectives",
    "fit_dense",
    "fit_copies",
    "fit_kernel_profile",
    "predict_lookup",
    "predict_collective",
    "predict_dense",
    "load_records",
]

GRANULARITY_CANDIDATES = (4, 16, 32, 64, 128)
REPORT_SCHEMA = "sparselift.calibration_report/1"


# -- generic fit --------------------------------------------------------------------------------


def _relative_residuals(rows: Sequence[Sequence[float]], y: Sequence[float], coef: Sequence[float]) -> List[float]:
    return [(sum(a * c for a, c in zip(r, coef)) - yi) / yi for r, yi in zip(rows, y)]


def fit_nonnegative(
    rows: Sequence[Sequence[float]],
    y: Sequence[float],
    *,
    robust: bool = True,
    iterations: int = 8,
) -> Tuple[float, ...]:
    """Coefficients ``c >= 0`` minimizing ``sum_i w_i ((rows_i . c - y_i) / y_i)^2``.

    :func:`~torchrec_sparselift.calibration.nnls.nonnegative_least_squares` on the relative rows.
    With ``robust`` the weights ``w_i`` are Huber weights on the relative residuals (scale from
    their median absolute deviation), refitted ``iterations`` times.
    """
    if len(rows) != len(y) or not rows:
        raise CalibrationError(f"need matching, non-empty rows and times (got {len(rows)} rows, {len(y)} times)")
    k = len(rows[0])
    if any(len(r) != k for r in rows):
        raise CalibrationError("all design rows must have the same length")
    if not all(math.isfinite(v) and v > 0 for v in y):
        raise CalibrationError("measured times must be positive and finite")
    relative = [[a / yi for a in r] for r, yi in zip(rows, y)]
    ones = [1.0] * len(y)
    w = [1.0] * len(y)
    best: Tuple[float, ...] = ()
    for _ in range(iterations if robust else 1):
        best = tuple(float(c) for c in nonnegative_least_squares(relative, ones, weights=w))
        if not robust:
            break
        res = _relative_residuals(rows, y, best)
        mad = statistics.median(abs(r - statistics.median(res)) for r in res)
        delta = 1.345 * max(1.4826 * mad, 0.01)
        w = [1.0 if abs(r) <= delta else delta / abs(r) for r in res]
    return best


# -- report values ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FamilyFit:
    """How well the fitted profile predicts one family of measurements."""

    family: str
    points: int
    mape: float  # mean |predicted - measured| / measured
    max_ape: float
    median_ape: float

    @classmethod
    def of(cls, family: str, predicted: Sequence[float], measured: Sequence[float]) -> "FamilyFit":
        ape = [abs(p - m) / m for p, m in zip(predicted, measured)]
        return cls(
            family=family, points=len(ape), mape=sum(ape) / len(ape), max_ape=max(ape),
            median_ape=float(statistics.median(ape)),
        )

    def line(self) -> str:
        return (
            f"{self.family:<16} {self.points:4d} points  MAPE {100 * self.mape:6.1f}%  "
            f"median {100 * self.median_ape:6.1f}%  max {100 * self.max_ape:6.1f}%"
        )


@attrs.frozen(kw_only=True)
class CalibrationReport:
    """What a calibration measured, what it fitted, and how well the fit holds."""

    profile: HardwareProfile
    base: str
    device: str
    kernel: Optional[str]
    world_size: int
    fits: Tuple[FamilyFit, ...] = attrs.field(converter=tuple)
    diagnostics: Mapping[str, float] = attrs.field(factory=dict)
    notes: Tuple[str, ...] = attrs.field(default=(), converter=tuple)
    records: MicrobenchRecords = attrs.field(factory=MicrobenchRecords)
    #: the sparse-path rewrites' constants fitted (``chunk_overhead_s``, ``dedup_id_s``), each with
    #: its residual and held-out predictions
    slopes: Tuple[SlopeFit, ...] = attrs.field(default=(), converter=tuple)
    #: every record under the fitted profile, ``(family, label, predicted s, measured s)``: the
    #: points each family's fit summarises (derived, so not in the JSON)
    points: Tuple[Tuple[str, str, float, float], ...] = attrs.field(default=(), converter=tuple, eq=False,
                                                                    repr=False)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA,
            "profile": self.profile.to_dict(),
            "base": self.base,
            "device": self.device,
            "kernel": self.kernel,
            "world_size": self.world_size,
            "fits": [attrs.asdict(f) for f in self.fits],
            "diagnostics": dict(self.diagnostics),
            "notes": list(self.notes),
            "records": self.records.to_dict(),
            "slopes": [f.to_dict() for f in self.slopes],
        }

    def summary(self) -> str:
        p = self.profile
        bw = p.ddr_bw if p.compute_device == "cpu" else p.hbm_bw
        lines = [
            f"profile {p.name!r} ({p.compute_device}, base {self.base!r}, kernel {self.kernel}, "
            f"{self.world_size} rank(s))",
            f"  lookup bw {bw / 1e9:.2f} GB/s  overhead {p.lookup_overhead_s * 1e6:.1f} us  "
            f"bwd_factor {p.bwd_factor:.2f}  row_granularity {p.row_granularity_bytes} B",
            f"  a2a bw {p.intra_host_bw / 1e9:.3f} GB/s (intra) {p.inter_host_bw / 1e9:.3f} GB/s (inter)  "
            f"allreduce bw {p.allreduce_bw / 1e9:.3f} GB/s  latency {p.collective_latency_s * 1e6:.1f} us",
            f"  dense {p.dense_flops / 1e12:.3f} TFLOP/s  uvm bw {p.uvm_bw / 1e9:.2f} GB/s",
        ]
        lines += ["  " + f.line() for f in self.fits]
        lines += ["  " + line for f in self.slopes for line in f.lines()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- model predictions (the cost model's equations, for residuals) ------------------------------


def _lookup_bw(profile: HardwareProfile) -> float:
    return profile.ddr_bw if profile.compute_device == "cpu" else profile.hbm_bw


def predict_lookup(profile: HardwareProfile, rec: LookupRecord) -> float:
    """Predicted seconds of one lookup call (forward, or forward + backward + update)."""
    bw = _lookup_bw(profile)
    term = rec.ids * profile.row_bytes(rec.dim, rec.elem_bytes) / bw
    ids_fwd = rec.ids * profile.id_overhead_bytes / bw
    if rec.phase == "fwd":
        return profile.lookup_overhead_s + term + ids_fwd
    ids_bwd = rec.ids * profile.bwd_id_overhead_bytes / bw
    cold = cold_row_seconds(rec.ids, rec.rows * rec.dim * rec.elem_bytes, profile)
    return 2.0 * profile.lookup_overhead_s + (1.0 + profile.bwd_factor) * term + ids_fwd + ids_bwd + cold


def predict_collective(profile: HardwareProfile, rec: CollectiveRecord, spans_hosts: bool = False) -> float:
    """Predicted seconds of one collective call on ``rec.world_size`` ranks."""
    n = rec.world_size
    if rec.op == "all_to_all":
        return profile.collective_latency_s + (n - 1) / n * rec.bytes / profile.a2a_bw(n, spans_hosts)
    return profile.collective_latency_s + 2.0 * (n - 1) / n * rec.bytes / profile.allreduce_bw


def predict_dense(profile: HardwareProfile, rec: DenseRecord) -> float:
    return rec.flops / profile.dense_flops


# -- family fits --------------------------------------------------------------------------------


def _require(records: Sequence[Any], what: str, hint: str) -> None:
    if not records:
        raise CalibrationError(f"no {what} records to fit; {hint}")


def fit_lookups(
    base: HardwareProfile,
    lookups: Sequence[LookupRecord],
    granularities: Sequence[int] = GRANULARITY_CANDIDATES,
) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Fit ``bw``, ``lookup_overhead_s``, ``bwd_factor``, ``row_granularity_bytes``, the
    width-independent per-id costs ``id_overhead_bytes`` / ``bwd_id_overhead_bytes`` and, where
    CPU forward + backward records span tables beyond ``base.lookup_cache_bytes``, ``cold_row_s``
    (per id of a table beyond the cache, :func:`~torchrec_sparselift.cost.terms.cold_row_seconds`;
    as in the cost model it is paid by the forward + backward, not by a forward alone).

    Forward and forward+backward records are fitted jointly: as in the cost model, the forward
    and the backward each pay ``lookup_overhead_s`` and share the bandwidth. Returns
    ``(parameters, diagnostics)``; the diagnostics hold each phase's own intercept and slope.
    """
    _require(lookups, "lookup", "run the lookup microbenchmark (bench_lookups)")
    phases = {r.phase for r in lookups}
    if "fwd" not in phases:
        raise CalibrationError("lookup records hold no forward ('fwd') points; the bandwidth needs them")
    if len({r.ids * r.dim for r in lookups}) < 2:
        raise CalibrationError(
            "all lookup records read the same number of bytes; vary pooling, batch size or dim "
            "so bandwidth and overhead can be told apart"
        )
    y = [r.seconds for r in lookups]
    unit_cold = attrs.evolve(base, cold_row_s=1.0)
    cold = [cold_row_seconds(r.ids, r.rows * r.dim * r.elem_bytes, unit_cold) if r.phase == "fwd_bwd" else 0.0
            for r in lookups]
    def search(with_ids: bool, with_cold: bool) -> Tuple[float, int, Tuple[float, ...]]:
        best: Optional[Tuple[float, int, Tuple[float, ...]]] = None
        base_result: Optional[Tuple[float, int, Tuple[float, ...]]] = None
        for g in sorted(set(granularities) | {base.row_granularity_bytes}):
            prof = attrs.evolve(base, row_granularity_bytes=g)
            rows = []
            for r in lookups:
                b = float(r.ids * prof.row_bytes(r.dim, r.elem_bytes))
                n = float(r.ids) if with_ids else 0.0
                # columns: overhead, fwd bytes, bwd bytes, fwd per-id, bwd per-id, cold per-id
                if r.phase == "fwd":
                    rows.append([1.0, b, 0.0, n, 0.0, 0.0])
                else:  # forward + backward: two kernel calls, both pay the overhead
                    rows.append([2.0, b, b, n, n, cold[len(rows)] if with_cold else 0.0])
            keep = [0, 1] + ([2] if "fwd_bwd" in phases else []) + (
                [3] + ([4] if "fwd_bwd" in phases else []) + ([5] if with_cold else []) if with_ids else [])
            sub = [[row[k] for k in keep] for row in rows]
            c = fit_nonnegative(sub, y)
            full = [0.0] * 6
            for k, v in zip(keep, c):
                full[k] = v
            loss = sum(abs(e) for e in _relative_residuals(sub, y, c))
            result = (loss, g, tuple(full))
            if g == base.row_granularity_bytes:
                base_result = result
            if best is None or loss < best[0]:
                best = result
        assert best is not None and base_result is not None
        if base_result[0] <= best[0] * 1.02:  # prefer the base granularity unless clearly worse
            best = base_result
        return best

    # CPU only: a GPU's row gathers are bandwidth-bound at every table size (hbm_bw prices them) and
    # its cache is not lookup_cache_bytes' per-core L2; GPU profiles keep cold_row_s = 0
    with_cold = any(c > 0 for c in cold) and all(r.device == "cpu" for r in lookups)
    best = search(with_ids=True, with_cold=with_cold)
    if best[2][1] <= 0 and with_cold:  # bytes and cold ids not separable in this sweep: no cold term
        with_cold = False
        best = search(with_ids=True, with_cold=False)
    if best[2][1] <= 0:  # bytes and ids not separable in this sweep: bytes only
        best = search(with_ids=False, with_cold=False)
    _, g, coef = best
    overhead, per_byte = coef[0], coef[1]
    if per_byte <= 0:
        raise CalibrationError(
            "lookup times do not grow with bytes read; measure larger batches or pooling factors"
        )
    params: Dict[str, float] = {
        "bw": 1.0 / per_byte,
        "lookup_overhead_s": overhead,
        "row_granularity_bytes": g,
        "id_overhead_bytes": coef[3] / per_byte,
    }
    if "fwd_bwd" in phases:
        params["bwd_id_overhead_bytes"] = coef[4] / per_byte
    if with_cold:
        params["cold_row_s"] = coef[5]
    if "fwd_bwd" in phases and coef[2] > 0:
        params["bwd_factor"] = coef[2] / per_byte
    # else: the sweep cannot resolve the backward's bytes term (overhead-dominated); the caller
    # keeps the base bwd_factor and says so
    diagnostics: Dict[str, float] = {}
    prof = attrs.evolve(base, row_granularity_bytes=g)
    for phase in sorted(phases):
        sub = [r for r in lookups if r.phase == phase]
        if len({r.ids * r.dim for r in sub}) < 2:
            continue
        c = fit_nonnegative([[1.0, float(r.ids * prof.row_bytes(r.dim, r.elem_bytes))] for r in sub], [r.seconds for r in sub])
        diagnostics[f"lookup_{phase}_intercept_s"] = c[0]
        if c[1] > 0:
            diagnostics[f"lookup_{phase}_bytes_per_s"] = 1.0 / c[1]
    return params, diagnostics


def fit_collectives(collectives: Sequence[CollectiveRecord]) -> Dict[str, float]:
    """Fit ``collective_latency_s``, the all-to-all bandwidth and ``allreduce_bw`` jointly.

    A bandwidth whose bytes term fits to zero (times that do not grow with size, e.g. on a
    loaded machine) is left out of the result.
    """
    _require(collectives, "collective", "run under torchrun with 2 or more ranks")
    worlds = {r.world_size for r in collectives}
    if len(worlds) != 1:
        raise CalibrationError(f"collective records mix world sizes {sorted(worlds)}; fit one group at a time")
    n = worlds.pop()
    if n < 2:
        raise CalibrationError("collective records need a world size of 2 or more")
    ops = sorted({r.op for r in collectives})
    rows = []
    for r in collectives:
        row = [1.0]
        for op in ops:
            if op == "all_to_all":
                row.append((n - 1) / n * r.bytes if r.op == op else 0.0)
            else:
                row.append(2.0 * (n - 1) / n * r.bytes if r.op == op else 0.0)
        rows.append(row)
    for op in ops:
        if len({r.bytes for r in collectives if r.op == op}) < 2:
            raise CalibrationError(f"{op} was measured at one message size only; measure several sizes")
    coef = fit_nonnegative(rows, [r.seconds for r in collectives])
    out = {"collective_latency_s": coef[0], "world_size": float(n)}
    for op, c in zip(ops, coef[1:]):
        if c > 0:  # else noise hid the size dependence: the caller keeps the base value
            out["a2a_bw" if op == "all_to_all" else "allreduce_bw"] = 1.0 / c
    return out


def fit_dense(dense: Sequence[DenseRecord], dtype: str) -> float:
    """Sustained FLOP/s for ``dtype``: the slope through the origin of time against FLOPs."""
    sub = [r for r in dense if r.dtype == dtype]
    _require(sub, f"dense {dtype}", f"measure matmuls in {dtype} (available: {sorted({r.dtype for r in dense})})")
    (per_flop,) = fit_nonnegative([[float(r.flops)] for r in sub], [r.seconds for r in sub])
    return 1.0 / per_flop


def fit_copies(copies: Sequence[CopyRecord]) -> Tuple[float, float]:
    """``(bytes_per_s, fixed_s)`` of pinned host-to-device copies."""
    sub = [r for r in copies if r.direction == "h2d"]
    _require(sub, "host-to-device copy", "measure pinned copies on a CUDA device")
    if len({r.bytes for r in sub}) < 2:
        raise CalibrationError("copies were measured at one size only; measure several sizes")
    fixed, per_byte = fit_nonnegative([[1.0, float(r.bytes)] for r in sub], [r.seconds for r in sub])
    if per_byte <= 0:
        raise CalibrationError("copy times do not grow with size; measure larger copies")
    return 1.0 / per_byte, fixed


def _a2a_fields(base: HardwareProfile, a2a_bw: float, n: int, spans_hosts: bool) -> Dict[str, float]:
    """Profile fields that make ``a2a_bw(n, spans_hosts)`` equal the measured bandwidth."""
    if not spans_hosts:
        fields = {"intra_host_bw": a2a_bw}
        if base.compute_device == "cpu":
            fields["inter_host_bw"] = a2a_bw  # loopback gloo: one path
        return fields
    local = min(base.local_world_size, n)
    remote_frac = (n - local) / n
    return {"inter_host_bw": max(remote_frac * a2a_bw, 1.0)}


def fit_kernel_profile(
    base: HardwareProfile,
    records: MicrobenchRecords,
    *,
    name: Optional[str] = None,
    dense_dtype: Optional[str] = None,
    compute_device: Optional[str] = None,
    local_world_size: Optional[int] = None,
    spans_hosts: bool = False,
    hbm_cap_bytes: Optional[int] = None,
    notes: Sequence[str] = (),
) -> Tuple[HardwareProfile, CalibrationReport]:
    """Fit every parameter the records determine; the others keep ``base``'s values.

    Pure: no measurement happens here. Raises :class:`CalibrationError` when the records cannot
    determine a parameter (no lookups, one message size, ...).
    """
    notes = list(notes)
    device = compute_device or (records.lookups[0].device if records.lookups else base.compute_device)
    fields: Dict[str, Any] = {"name": name or f"{base.name}-calibrated", "compute_device": device}
    if local_world_size is not None:
        fields["local_world_size"] = local_world_size
    if hbm_cap_bytes is not None:
        fields["hbm_cap_bytes"] = hbm_cap_bytes
    start = attrs.evolve(base, **fields)

    lk, diagnostics = fit_lookups(start, records.lookups)
    fields.update(
        row_granularity_bytes=int(lk["row_granularity_bytes"]),
        lookup_overhead_s=lk["lookup_overhead_s"],
        id_overhead_bytes=lk["id_overhead_bytes"],
    )
    if "bwd_id_overhead_bytes" in lk:
        fields["bwd_id_overhead_bytes"] = lk["bwd_id_overhead_bytes"]
    if "cold_row_s" in lk:
        fields["cold_row_s"] = lk["cold_row_s"]
    if "bwd_factor" in lk:
        fields["bwd_factor"] = lk["bwd_factor"]
    elif any(r.phase == "fwd_bwd" for r in records.lookups):
        notes.append(
            "the backward's bytes term fitted to zero (overhead-dominated sweep): bwd_factor kept "
            "from the base profile; measure larger batches or pooling factors"
        )
    else:
        notes.append("no forward+backward lookups measured: bwd_factor kept from the base profile")
    if device == "cpu":
        fields.update(hbm_bw=lk["bw"], ddr_bw=lk["bw"], uvm_bw=lk["bw"])
    else:
        fields["hbm_bw"] = lk["bw"]

    world = 1
    if records.collectives:
        col = fit_collectives(records.collectives)
        world = int(col["world_size"])
        fields["collective_latency_s"] = col["collective_latency_s"]
        for key, op in (("a2a_bw", "all_to_all"), ("allreduce_bw", "all_reduce")):
            if key not in col and any(r.op == op for r in records.collectives):
                notes.append(
                    f"{op} times did not grow with message size (noise?): its bandwidth is kept "
                    "from the base profile; measure larger messages or on a quieter machine"
                )
        if "a2a_bw" in col:
            fields.update(_a2a_fields(start, col["a2a_bw"], world, spans_hosts))
        if "allreduce_bw" in col:
            fields["allreduce_bw"] = col["allreduce_bw"]
    else:
        notes.append("no collectives measured (single process): link bandwidths and latency kept from the base profile")

    if records.dense:
        dtypes = sorted({r.dtype for r in records.dense})
        chosen = dense_dtype or ("fp32" if "fp32" in dtypes else dtypes[0])
        fields["dense_flops"] = fit_dense(records.dense, chosen)
        for dt in dtypes:
            sub = [r for r in records.dense if r.dtype == dt]
            diagnostics[f"dense_{dt}_fitted_flops"] = fit_dense(records.dense, dt)
            diagnostics[f"dense_{dt}_best_flops"] = max(r.flops / r.seconds for r in sub)
        notes.append(f"dense_flops fitted on {chosen} matmuls")
    else:
        chosen = None
        notes.append("no dense matmuls measured: dense_flops kept from the base profile")

    if records.copies:
        bw, fixed = fit_copies(records.copies)
        fields["uvm_bw"] = bw
        diagnostics["h2d_fixed_s"] = fixed
        notes.append("uvm_bw = pinned host-to-device copy bandwidth (an upper bound for UVM row gathers)")

    slopes: List[SlopeFit] = []
    for field, recs, fit, what in (("chunk_overhead_s", records.chunks, fit_chunk_overhead, "chunked dense steps"),
                                   ("dedup_id_s", records.dedup, fit_dedup_id_s, "dedup kernels")):
        if not recs:
            notes.append(f"no {what} measured: {field} kept from the base profile")
            continue
        line = fit(recs)
        slopes.append(line)
        fields[field] = line.slope
        diagnostics[f"{field}_intercept_s"] = line.intercept
        if line.slope <= 0:
            notes.append(f"{field}: the {what}' times did not grow with the {line.unit} count (noise?): fitted 0; "
                         "calibrate on a quieter machine")

    profile = attrs.evolve(base, **fields)

    fits: List[FamilyFit] = []
    points: List[Tuple[str, str, float, float]] = []

    def family(name: str, sub: Sequence[Any], predicted: Sequence[float], label: Callable[[Any], str]) -> None:
        fits.append(FamilyFit.of(name, predicted, [r.seconds for r in sub]))
        points.extend((name, label(r), float(p), float(r.seconds)) for r, p in zip(sub, predicted))

    for phase in ("fwd", "fwd_bwd"):
        sub = [r for r in records.lookups if r.phase == phase]
        if sub:
            family(f"lookup_{phase}", sub, [predict_lookup(profile, r) for r in sub],
                   lambda r: f"{r.rows} rows x {r.dim}, batch {r.batch_size}, pooling {r.pooling}")
            for rows in sorted({r.rows for r in sub}):  # the model has no cache term: show its cost
                part = [r for r in sub if r.rows == rows]
                signed = [(predict_lookup(profile, r) - r.seconds) / r.seconds for r in part]
                diagnostics[f"lookup_{phase}_rows_{rows}_mean_signed_error"] = sum(signed) / len(signed)
    for op in ("all_to_all", "all_reduce"):
        sub = [r for r in records.collectives if r.op == op]
        if sub:
            family(op, sub, [predict_collective(profile, r, spans_hosts) for r in sub], lambda r: f"{r.op} {r.bytes} B")
    for dt in sorted({r.dtype for r in records.dense}):
        sub = [r for r in records.dense if r.dtype == dt]
        rate = diagnostics[f"dense_{dt}_fitted_flops"]
        family(f"dense_{dt}", sub, [r.flops / rate for r in sub], lambda r: f"{r.m}x{r.n}x{r.k} {r.dtype}")
    if records.copies:
        sub = [r for r in records.copies if r.direction == "h2d"]
        family("h2d_copy", sub, [diagnostics["h2d_fixed_s"] + r.bytes / profile.uvm_bw for r in sub],
               lambda r: f"h2d {r.bytes} B")

    by_field = {f.field: f for f in slopes}
    for field, sub, label, x in (
            ("chunk_overhead_s", records.chunks, lambda r: f"k={r.chunks} of batch {r.batch_size}",
             lambda r: r.chunks - 1),
            ("dedup_id_s", records.dedup, lambda r: f"{r.ids} ids at ratio {r.unique_ratio:g}", lambda r: r.ids)):
        fitted = [r for r in sub if not r.held_out]
        if field in by_field and fitted:
            line = by_field[field]
            family(field, fitted, [line.intercept + line.slope * x(r) for r in fitted], label)

    kernels = sorted({r.kernel for r in records.lookups})
    report = CalibrationReport(
        profile=profile, base=base.name, device=device, kernel=",".join(kernels) or None,
        world_size=world, fits=fits, diagnostics=diagnostics, notes=notes, records=records, points=points,
        slopes=slopes,
    )
    return profile, report


def load_records(path: str) -> Tuple[MicrobenchRecords, Dict[str, Any]]:
    """``(records, report)`` of a records file or a calibration report (empty report for a bare
    records file) written by ``sparselift calibrate kernels``.

    Raises :class:`~torchrec_sparselift.errors.FileFormatError` naming the file and the field
    (``lookups[3]``) for anything unreadable or malformed."""
    f = Fields(load_json(path, "calibration records", top=dict), file=path, what="calibration records")
    if f.data.get("schema") == REPORT_SCHEMA:
        return _records_from_fields(f.obj("records")), f.data
    return _records_from_fields(f), {}


def _records_from_fields(f: Any) -> MicrobenchRecords:
    schema = f.data.get("schema")
    if schema != RECORDS_SCHEMA:
        raise f.fail("schema", f"is {schema!r}, not {RECORDS_SCHEMA!r} (nor {REPORT_SCHEMA!r}): not a calibration "
                     "records file", "write one with `sparselift calibrate kernels --records PATH`")
    return MicrobenchRecords.from_dict(f)
