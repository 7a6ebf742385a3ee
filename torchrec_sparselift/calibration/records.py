"""Typed records of what calibration measures: the values that travel from the measuring side
(:mod:`torchrec_sparselift.measure`) to the fits (:mod:`.kernel_fit`, :mod:`.step_fit`).

* kernel microbenchmarks: :class:`LookupRecord`, :class:`CollectiveRecord`, :class:`DenseRecord`,
  :class:`CopyRecord`, and the sparse-path rewrites' constants: :class:`ChunkRecord` (a dense
  step in chunks) and :class:`DedupRecord` (the id-deduplication kernels), gathered in
  :class:`MicrobenchRecords` (JSON);
* host work measured alone: :class:`HostTermRecord` (the step fit's fixed values and floors);
* real training steps of probe plans: :class:`ProbeMeasurement` (one plan's measured step, its
  attribution and the machine's drift), and :class:`ProbeRecord` (one plan's fit result).

Nothing here imports torch.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.files import field_path, read_attrs, record_reader

__all__ = [
    "LookupRecord",
    "CollectiveRecord",
    "DenseRecord",
    "CopyRecord",
    "ChunkRecord",
    "DedupRecord",
    "MicrobenchRecords",
    "RECORDS_SCHEMA",
    "DENSE_DTYPES",
    "HostTermRecord",
    "ProbeMeasurement",
    "ProbeRecord",
]

RECORDS_SCHEMA = "sparselift.calibration_records/1"

#: matmul dtypes a dense record may hold (the measuring side maps them to torch dtypes)
DENSE_DTYPES = ("fp32", "fp16", "bf16")


def positive_int(instance: Any, attribute: "attrs.Attribute[Any]", value: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be an int >= 1, got {value!r}")


def positive_seconds(instance: Any, attribute: "attrs.Attribute[Any]", value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a positive finite time in seconds, "
            f"got {value!r}"
        )


def _one_of(*choices: str) -> Callable[[Any, "attrs.Attribute[Any]", str], None]:
    def check(instance: Any, attribute: "attrs.Attribute[Any]", value: str) -> None:
        if value not in choices:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name} must be one of {list(choices)}, got {value!r}"
            )

    return check


@attrs.frozen(kw_only=True)
class LookupRecord:
    """One embedding-bag measurement: ``batch_size`` bags of ``pooling`` ids into one table.

    ``phase`` is ``"fwd"`` (forward lookup) or ``"fwd_bwd"`` (forward, backward and the fused
    row-wise AdaGrad update); ``seconds`` is the median time of one call.
    """

    kernel: str = attrs.field(validator=_one_of("fbgemm_tbe", "torch_embedding_bag"))
    device: str = attrs.field(validator=_one_of("cpu", "cuda"))
    phase: str = attrs.field(validator=_one_of("fwd", "fwd_bwd"))
    rows: int = attrs.field(validator=positive_int)
    dim: int = attrs.field(validator=positive_int)
    batch_size: int = attrs.field(validator=positive_int)
    pooling: int = attrs.field(validator=positive_int)
    elem_bytes: int = attrs.field(default=4, validator=positive_int)
    seconds: float = attrs.field(validator=positive_seconds)

    @property
    def ids(self) -> int:
        """Row reads per call (batch size x pooling factor)."""
        return self.batch_size * self.pooling


@attrs.frozen(kw_only=True)
class CollectiveRecord:
    """One collective measurement on ``world_size`` ranks.

    ``bytes`` is the size of each rank's input buffer (for all-to-all: the whole send buffer,
    its own chunk included, so ``(n - 1) / n`` of it crosses a link; for all-reduce: the tensor
    being reduced). ``seconds`` is the median
    over calls of the slowest rank's time.
    """

    op: str = attrs.field(validator=_one_of("all_to_all", "all_reduce"))
    backend: str
    world_size: int = attrs.field(validator=positive_int)
    bytes: int = attrs.field(validator=positive_int)
    seconds: float = attrs.field(validator=positive_seconds)


@attrs.frozen(kw_only=True)
class DenseRecord:
    """One ``(m, k) @ (k, n)`` matmul measurement; ``flops`` = 2 m n k."""

    device: str = attrs.field(validator=_one_of("cpu", "cuda"))
    dtype: str = attrs.field(validator=_one_of(*DENSE_DTYPES))
    m: int = attrs.field(validator=positive_int)
    n: int = attrs.field(validator=positive_int)
    k: int = attrs.field(validator=positive_int)
    seconds: float = attrs.field(validator=positive_seconds)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


@attrs.frozen(kw_only=True)
class CopyRecord:
    """A pinned host-to-device copy of ``bytes`` (the bound on UVM row traffic)."""

    direction: str = attrs.field(validator=_one_of("h2d", "d2h"))
    bytes: int = attrs.field(validator=positive_int)
    seconds: float = attrs.field(validator=positive_seconds)


def _unit_ratio(instance: Any, attribute: "attrs.Attribute[Any]", value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a ratio in (0, 1], got {value!r}")


def _flag(instance: Any, attribute: "attrs.Attribute[Any]", value: bool) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class ChunkRecord:
    """One forward + backward of a DLRM-like dense model over ``batch_size`` samples run as
    ``chunks`` chunks of ``batch_size / chunks`` (the batch-split pipeline's dense work: slice the
    inputs, one forward per chunk, the chunk losses weighted by size, one backward, the outputs
    merged); ``seconds`` per step. ``held_out``: kept out of the fit, predicted by it."""

    batch_size: int = attrs.field(validator=positive_int)
    chunks: int = attrs.field(validator=positive_int)
    seconds: float = attrs.field(validator=positive_seconds)
    held_out: bool = attrs.field(default=False, validator=_flag)

    def __attrs_post_init__(self) -> None:
        if self.chunks > self.batch_size:
            raise ValueError(f"ChunkRecord: {self.chunks} chunks of a batch of {self.batch_size}: a chunk needs a sample")


@attrs.frozen(kw_only=True)
class DedupRecord:
    """The id-deduplication kernels over ``ids`` ids of one feature, ``unique_ratio`` of them
    distinct (``torch.unique`` with its inverse on the sender, the rebuild and the merge of the
    sources' distinct ids on the receiver, as ``runtime.wire_ids`` runs them); ``seconds`` per
    call. ``held_out``: kept out of the fit, predicted by it."""

    ids: int = attrs.field(validator=positive_int)
    unique_ratio: float = attrs.field(validator=_unit_ratio)
    seconds: float = attrs.field(validator=positive_seconds)
    held_out: bool = attrs.field(default=False, validator=_flag)


_RECORD_TYPES = {
    "lookups": LookupRecord,
    "collectives": CollectiveRecord,
    "dense": DenseRecord,
    "copies": CopyRecord,
    "chunks": ChunkRecord,
    "dedup": DedupRecord,
}


@attrs.frozen(kw_only=True)
class MicrobenchRecords:
    """All measurements of one calibration run, JSON-serializable."""

    lookups: Tuple[LookupRecord, ...] = attrs.field(default=(), converter=tuple)
    collectives: Tuple[CollectiveRecord, ...] = attrs.field(default=(), converter=tuple)
    dense: Tuple[DenseRecord, ...] = attrs.field(default=(), converter=tuple)
    copies: Tuple[CopyRecord, ...] = attrs.field(default=(), converter=tuple)
    chunks: Tuple[ChunkRecord, ...] = attrs.field(default=(), converter=tuple)
    dedup: Tuple[DedupRecord, ...] = attrs.field(default=(), converter=tuple)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "schema": RECORDS_SCHEMA,
            **{key: [attrs.asdict(r) for r in getattr(self, key)] for key in _RECORD_TYPES},
        }

    @classmethod
    def from_dict(cls, data: Any) -> "MicrobenchRecords":
        """The records :meth:`to_dict` wrote (a dict, or a file's reader): unknown and missing keys,
        and counts outside 1..int64, are named by field before the records' own validators run."""
        f = record_reader(cls, data)
        schema = f.data.get("schema")
        if schema != RECORDS_SCHEMA:
            raise f.fail("schema", f"is {schema!r}, not {RECORDS_SCHEMA!r}: not a calibration records file",
                         "write one with `sparselift calibrate kernels --records PATH`")
        return read_attrs(cls, f, ignore_unknown=True,
                          **{key: (lambda r, key=key, typ=typ: [_record(x, typ) for x in r.objs(key, required=False)])
                             for key, typ in _RECORD_TYPES.items()})


def _record(r: Any, typ: type) -> Any:
    """One record of type ``typ`` from its reader ``r``, its counts checked as integers >= 1."""
    for a in attrs.fields(typ):
        if a.validator is positive_int and a.name in r.data:
            r.check(r.data[a.name], int, field_path(r.path, a.name), lo=1)
    return read_attrs(typ, r)


# -- host work the step fit cannot separate -----------------------------------------------------


@attrs.frozen
class HostTermRecord:
    """Per-call costs of host work a training step does outside the embedding kernels, each
    measured alone (so the step fit need not guess them from whole steps, where they are
    collinear with table and feature counts):

    * ``optimizer_tensor_s`` / ``optimizer_byte_s``: the data-parallel tables' optimizer step
      (TorchRec's ``RowWiseAdagrad``, what the DLRM example and the probes run for every
      data-parallel table, one parameter per table) per parameter tensor and per fp32 parameter byte;
    * ``bucketize_id_s``: fbgemm's ``block_bucketize_sparse_features`` (row-wise input dist) per id
      into 2 buckets;
    * ``a2a_byte_s``: ``all_to_all_single`` per byte sent or received by a rank;
    * ``codec_byte_s``: the fp16 comm codec per byte sent or received by a rank (encode + decode);
    * ``chunk_overhead_s`` / ``dedup_id_s``: the sparse-path rewrites' constants (one more batch
      chunk's fixed cost; the dedup kernels per id), the profile fields of the same names.
    """

    optimizer_tensor_s: float
    optimizer_byte_s: float
    bucketize_id_s: float
    #: an all-to-all's cost per byte a rank sends or receives (the graph's link bytes), measured
    #: across the ranks of a process group (:func:`bench_a2a_byte_s`); 0: not measured (one rank)
    a2a_byte_s: float = 0.0
    #: the dense part's parameter-free work, forward + backward (:func:`bench_dense_terms`): seconds
    #: per activation byte the forward writes and per interaction FLOP (0: not measured)
    dense_act_byte_s: float = 0.0
    interaction_flop_s: float = 0.0
    #: a fused TBE backward (EXACT_ROWWISE_ADAGRAD, :func:`bench_tbe_backward`): seconds per distinct
    #: row it updates and per id it reads (0: not measured, fbgemm missing)
    tbe_row_s: float = 0.0
    tbe_bwd_id_s: float = 0.0
    #: the dense layers' products (:func:`bench_dense_flops`): seconds per forward FLOP of a forward +
    #: backward (the backward counted as twice the forward); 0: not measured
    dense_flop_s: float = 0.0
    #: TorchRec's fp16 comm codec (:func:`bench_codec_byte_s`): seconds per fp32 byte a rank sends or
    #: receives in a lossy-precision all-to-all (encode + decode, halved); 0: not measured
    codec_byte_s: float = 0.0
    #: one more batch chunk's fixed cost and the dedup kernels' seconds per id
    #: (``measure.microbench.bench_rewrite_constants``); None: not measured (a record saved before
    #: they were)
    chunk_overhead_s: Optional[float] = None
    dedup_id_s: Optional[float] = None

    def to_dict(self) -> Dict[str, float]:
        """Every term; the rewrites' constants only where measured."""
        d = attrs.asdict(self)
        for name in ("chunk_overhead_s", "dedup_id_s"):
            if d[name] is None:
                del d[name]
        return d

    @classmethod
    def mean_of(cls, records: Sequence["HostTermRecord"]) -> "HostTermRecord":
        """Every term's mean over ``records`` (the same work measured at different moments of a
        calibration, a minute apart). The step fit sits at several of these floors (the probes
        cannot pin the dense terms), so a floor acts as the value; the probes are priced at the
        calibration's median machine speed, and one reading in a slow or a fast stretch moved the
        held-out predictions of the many-feature workloads by 20-30%: the readings are averaged, not chosen."""
        if not records:
            raise ValueError("HostTermRecord.mean_of needs at least one record")
        def mean(name: str) -> Optional[float]:
            values = [getattr(r, name) for r in records]
            if any(v is None for v in values):  # a term one reading lacks is not measured
                return None
            return float(statistics.fmean(values))

        return cls(**{f.name: mean(f.name) for f in attrs.fields(cls)})


@attrs.frozen(kw_only=True)
class ProbeMeasurement:
    """One probe plan trained on the real machine (:func:`torchrec_sparselift.measure.steps.measure_probes`).

    ``workload`` / ``kind``: the probe model and plan kind (:data:`torchrec_sparselift.measure.probe.PLAN_KINDS`);
    ``plan`` / ``constraints``: the TorchRec ``ShardingPlan`` trained and the constraints that forced
    it; ``measured_s``: its median steady-state step of the per-step slowest rank, scaled to the
    calibration's median machine speed; ``attribution``: the profiled steps' attribution as its
    dict (:meth:`~torchrec_sparselift.calibration.attribution.StepAttribution.to_dict`), None when not
    attributed; ``drift``: the machine's slowdown while the plan's workload ran (1.0: not normalized).
    """

    workload: str
    kind: str
    plan: Any = attrs.field(eq=False, repr=False)
    constraints: Any = attrs.field(eq=False, repr=False)
    measured_s: float
    attribution: Optional[Mapping[str, Any]] = attrs.field(default=None, eq=False, repr=False)
    drift: float = 1.0

    def __attrs_post_init__(self) -> None:
        if not (self.measured_s > 0 and math.isfinite(self.measured_s)):
            raise ValueError(f"probe {self.label}: measured_s must be a positive time, got {self.measured_s!r}")

    @property
    def label(self) -> str:
        return f"{self.workload}/{self.kind}"

    def to_dict(self) -> Dict[str, Any]:
        """Plain values (the plan and constraints as the objects they are): what
        ``--save-measurements`` pickles, so a saved set does not depend on this class."""
        return dict(workload=self.workload, kind=self.kind, plan=self.plan, constraints=self.constraints,
                    measured_s=self.measured_s, attribution=self.attribution, drift=self.drift)

    @classmethod
    def from_saved(cls, item: Any) -> "ProbeMeasurement":
        """A measurement from a saved set: :meth:`to_dict`'s dict, or the positional tuple
        ``(workload, kind, plan, constraints, measured_s[, attribution[, drift]])`` older sets hold."""
        if isinstance(item, Mapping):
            return cls(**dict(item))
        t = tuple(item)
        if len(t) < 5:
            raise ValueError(f"a saved probe measurement needs at least (workload, kind, plan, constraints, "
                             f"measured_s), got {len(t)} fields")
        return cls(workload=t[0], kind=t[1], plan=t[2], constraints=t[3], measured_s=float(t[4]),
                   attribution=t[5] if len(t) > 5 else None, drift=float(t[6]) if len(t) > 6 else 1.0)


@attrs.frozen
class ProbeRecord:
    """One probe plan's measured step and the model's prediction before and after the fit."""

    workload: str
    plan: str
    measured_s: float
    predicted_before_s: float
    predicted_after_s: float
