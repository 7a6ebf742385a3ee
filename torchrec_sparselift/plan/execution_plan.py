"""The execution plan: what SparseLift decided, what it predicts, and what it was decided for.

An :class:`ExecutionPlan` is an immutable value holding

- ``sharding_plan``: the TorchRec ``ShardingPlan`` handed to ``DistributedModelParallel``;
- ``optimizations``: the sparse-path optimizations chosen on top of sharding (:class:`Optimizations`);
- ``prediction``: modeled step time, its lower bound and a per-rank breakdown (:class:`Prediction`);
- ``fingerprint``: digests of the inputs it was planned for (:class:`Fingerprint`);
- ``stats``: the :class:`~torchrec_sparselift.semantics.workload.WorkloadStats` it was planned with;
- ``created_at`` and ``planner_info`` (solver, status, planning time, ...).

It serializes to versioned JSON (schema :data:`EXECUTION_PLAN_SCHEMA`) that reads back to an equal
value; :mod:`torchrec_sparselift.plan.cache` stores it for reuse. Everything here is a pure value:
no files, no logging.
"""

from __future__ import annotations

import datetime
import json
import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.wire_ids import ID_DTYPES, feature_tuple
from torchrec_sparselift.cost.batch_split import BATCH_SPLIT_PIPELINE, MAX_CHUNKS
from torchrec_sparselift.errors import PlanFormatError
from torchrec_sparselift.files import Fields, canonical_digest, canonical_form, decode_utf8, load_json, parse_json
from torchrec_sparselift.plan.serialization import sharding_plan_from_dict, sharding_plan_to_dict
from torchrec_sparselift.validation import int_at_least
from torchrec_sparselift.semantics.layout import Layout2D
from torchrec_sparselift.semantics.tables import embedding_configs, embedding_modules
from torchrec_sparselift.semantics.workload import WorkloadStats
from torchrec_sparselift.vocabulary import COMM_PRECISIONS, PIPELINES, STRATEGIES_2D
import torchrec_sparselift

__all__ = [
    "EXECUTION_PLAN_SCHEMA",
    "PlanFormatError",
    "Optimizations",
    "RankPrediction",
    "Prediction",
    "Versions",
    "Fingerprint",
    "TableSpec",
    "fingerprint_inputs",
    "sharding_plan_digest",
    "table_specs",
    "topology_description",
    "ExecutionPlan",
]

#: Schema tag of :meth:`ExecutionPlan.to_json`; bump the number on any incompatible change.
EXECUTION_PLAN_SCHEMA = "sparselift.execution_plan/2"
#: Schema 1 keyed plans without the planner's options (guards, pipelines, 2D settings), so a plan
#: stored under them is never reused: it is re-planned with this reason.
_OLDER_SCHEMAS = {"sparselift.execution_plan/1": "it was keyed without the planner's options"}

#: (module_path, table_name, rows, dim, feature_names, pooled[, data_type])
TableSpec = Tuple[Any, ...]


# ----------------------------------------------------------------------------------------------
# canonical JSON digests
# ----------------------------------------------------------------------------------------------


def sharding_plan_digest(plan: Any) -> str:
    """sha256 hex of a TorchRec ``ShardingPlan``'s lossless JSON (:func:`sharding_plan_to_dict`).
    Two plans have equal digests exactly when they shard every table the same way (sharding type,
    kernel, ranks, shard offsets and sizes, cache and kernel settings), whatever order their dicts
    list the tables in: they run the same step, so one measurement of either is a measurement of
    both."""
    return canonical_digest(sharding_plan_to_dict(plan))


# ----------------------------------------------------------------------------------------------
# validators
# ----------------------------------------------------------------------------------------------


def _non_negative(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a finite number >= 0, got {value!r}"
        )


_non_negative_int = int_at_least(0)


def _one_of(choices: Sequence[str]) -> Any:
    def check(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        if value not in choices:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name} must be one of {list(choices)}, got {value!r}"
            )

    return check


def _hex_digest(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is None and attribute.default is None:
        return
    if not (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a sha256 hex digest (64 lowercase hex "
            f"characters), got {value!r}; build fingerprints with fingerprint_inputs()"
        )


# ----------------------------------------------------------------------------------------------
# value types
# ----------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Optimizations:
    """Sparse-path optimizations chosen on top of the sharding.

    Attributes:
        pipeline: train-pipeline kind, one of :data:`PIPELINES`.
        fwd_comm_precision / bwd_comm_precision: element type of the pooled-embedding all-to-all
            and of its gradient, one of :data:`COMM_PRECISIONS` (TorchRec qcomm codecs).
        sharding_group_size: ranks per sharding group for 2D sparse parallelism (``DMPCollection``);
            ``None`` means 1D (tables sharded over all ranks).
        sync_interval: steps between replica weight/optimizer averaging (2D only; 1 otherwise).
        layout_2d: which ranks form the sharding and replica groups (:class:`Layout2D`, 2D only);
            the runtime builds ``DMPCollection`` from it.
        max_sync_interval: the sync-interval bound the plan was made under (2D only).
        strategy_2d: how the replicas are kept in step, one of :data:`STRATEGIES_2D`
            (``DMPCollection``'s ``ShardingStrategy``; 2D only, None read as "default").
        table_grouping: whether tables with equal kernel/dim are fused into one TBE group.
        id_dtype: element type of the ids and lengths in the input all-to-all, one of
            :data:`~torchrec_sparselift.cost.wire_ids.ID_DTYPES` ("int64" is TorchRec's; "int32"
            needs every model-parallel table within int32 rows).
        dedup_features: features whose ids the input all-to-all deduplicates (distinct ids plus
            an inverse index, rebuilt exactly on the receiver); sorted, each once.
        batch_split: chunks the batch splits into for the embeddings' output and gradient
            all-to-alls (1..16; 1 splits nothing): the ``overlap`` pipeline's step, each chunk's
            dense work beside the next chunk's transfer, exact
            (``runtime.batch_split.TrainPipelineBatchSplit``; priced by ``cost.batch_split``).
        per_sample: the batch split was chosen for a dense model the planner proved per-sample or
            the user declared per-sample (``per_sample=True``); the runtime's batch-split pipeline
            takes the declaration from here (only with ``batch_split`` > 1).
    """

    pipeline: str = attrs.field(default=defaults.PIPELINE, validator=_one_of(PIPELINES))
    fwd_comm_precision: str = attrs.field(default=defaults.COMM_PRECISION, validator=_one_of(COMM_PRECISIONS))
    bwd_comm_precision: str = attrs.field(default=defaults.COMM_PRECISION, validator=_one_of(COMM_PRECISIONS))
    sharding_group_size: Optional[int] = attrs.field(default=None, validator=int_at_least(1, optional=True))
    sync_interval: int = attrs.field(default=1, validator=int_at_least(1, " (steps)"))
    table_grouping: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    layout_2d: Optional[Layout2D] = attrs.field(
        default=None, converter=lambda v: Layout2D.from_dict(v) if isinstance(v, Mapping) else v,
        validator=attrs.validators.optional(attrs.validators.instance_of(Layout2D)))
    max_sync_interval: Optional[int] = attrs.field(default=None)
    strategy_2d: Optional[str] = attrs.field(
        default=None, validator=attrs.validators.optional(_one_of(STRATEGIES_2D)))
    id_dtype: str = attrs.field(default="int64", validator=_one_of(ID_DTYPES))
    dedup_features: Tuple[str, ...] = attrs.field(default=(), converter=feature_tuple)
    batch_split: int = attrs.field(default=1, validator=int_at_least(1, " (chunks)"))
    per_sample: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.per_sample and self.batch_split == 1:
            raise ValueError("Optimizations.per_sample declares the dense model per-sample for a batch split, but "
                             "batch_split=1 splits nothing: drop per_sample or set batch_split > 1")
        if self.is_2d and (self.id_dtype != "int64" or self.dedup_features):
            raise ValueError("Optimizations: ids on the wire (id_dtype, dedup_features) apply to 1D plans only; "
                             "keep id_dtype='int64' and no dedup_features for a 2D plan")
        if self.batch_split > MAX_CHUNKS:
            raise ValueError(f"Optimizations.batch_split must be at most {MAX_CHUNKS} chunks, got {self.batch_split}")
        if self.batch_split > 1 and self.pipeline != BATCH_SPLIT_PIPELINE:
            raise ValueError(
                f"Optimizations.batch_split={self.batch_split} splits the {BATCH_SPLIT_PIPELINE!r} pipeline's "
                f"all-to-alls, but the pipeline is {self.pipeline!r}: choose pipeline={BATCH_SPLIT_PIPELINE!r} "
                "or batch_split=1")
        g = self.sharding_group_size
        if g is None and self.strategy_2d is not None:
            raise ValueError(f"Optimizations.strategy_2d={self.strategy_2d!r} needs a 2D plan "
                             "(sharding_group_size); drop it for 1D")
        lay = self.layout_2d
        if lay is not None and (g is None or lay.group_size != g):
            raise ValueError(
                f"Optimizations.layout_2d has groups of {lay.group_size} ranks but sharding_group_size "
                f"is {g!r}; build both from the same Layout2D (or drop layout_2d for 1D)"
            )

    @property
    def is_2d(self) -> bool:
        return self.sharding_group_size is not None

    @property
    def strategy(self) -> Optional[str]:
        """The 2D strategy in force: ``strategy_2d``, "default" for a 2D plan stored without one,
        None for 1D."""
        return (self.strategy_2d or "default") if self.is_2d else None


@attrs.frozen(kw_only=True)
class RankPrediction:
    """Modeled cost of one step on one rank (seconds, bytes)."""

    rank: int = attrs.field(validator=_non_negative_int)
    compute_s: float = attrs.field(validator=_non_negative)
    exposed_comm_s: float = attrs.field(validator=_non_negative)
    overlapped_comm_s: float = attrs.field(default=0.0, validator=_non_negative)
    hbm_bytes: int = attrs.field(default=0, validator=_non_negative_int)
    ddr_bytes: int = attrs.field(default=0, validator=_non_negative_int)

    @property
    def step_s(self) -> float:
        """Time this rank alone would need: compute plus communication it cannot hide."""
        return self.compute_s + self.exposed_comm_s


def _rank_tuple(value: Iterable[RankPrediction]) -> Tuple[RankPrediction, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Prediction:
    """Modeled steady-state step time of a plan.

    ``lower_bound_s`` is a bound on the best step time reachable under the same model, so
    ``gap`` says how far this plan can be from optimal (0.0 = provably optimal under the model).
    """

    step_time_s: float = attrs.field(validator=_non_negative)
    lower_bound_s: float = attrs.field(validator=_non_negative)
    per_rank: Tuple[RankPrediction, ...] = attrs.field(converter=_rank_tuple, factory=tuple)
    cost_model: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        if self.lower_bound_s > self.step_time_s * (1 + 1e-6) + 1e-12:
            raise ValueError(
                f"Prediction.lower_bound_s={self.lower_bound_s} exceeds step_time_s={self.step_time_s}: "
                "a lower bound cannot be above the plan it bounds"
            )
        ranks = [r.rank for r in self.per_rank]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"Prediction.per_rank lists a rank twice: ranks {ranks}")

    @property
    def gap(self) -> float:
        """``step_time / lower_bound - 1``: 0.0 when equal, ``inf`` when the bound is 0."""
        if self.step_time_s == self.lower_bound_s:
            return 0.0
        if self.lower_bound_s == 0:
            return math.inf
        return self.step_time_s / self.lower_bound_s - 1.0


@attrs.frozen(kw_only=True)
class Versions:
    """Library versions a plan was made with, and the plan schema."""

    torch: str
    torchrec: str
    torchrec_sparselift: str
    schema: str = EXECUTION_PLAN_SCHEMA

    @classmethod
    def current(cls) -> "Versions":
        """The versions installed in this process."""
        import importlib.metadata

        import torch

        try:
            torchrec_version = importlib.metadata.version("torchrec")
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout
            import torchrec

            torchrec_version = str(getattr(torchrec, "__version__", "unknown"))
        return cls(
            torch=str(torch.__version__),
            torchrec=torchrec_version,
            torchrec_sparselift=str(torchrec_sparselift.__version__),
        )


def _versions(value: Any) -> Versions:
    return value if isinstance(value, Versions) else Versions(**value)


@attrs.frozen(kw_only=True)
class Fingerprint:
    """What a plan was made for, as digests of canonical JSON (stable across processes).

    ``cache_key()`` covers the planning inputs that make a stored plan *a candidate* (tables,
    topology, batch size, constraints, hardware profile, and ``options_digest``: the planner's
    options, i.e. guards, pipelines, precisions, solver, time budget, 2D settings, ...);
    ``versions`` and ``stats_digest`` are compared after loading so that a mismatch can be
    reported with a reason. Build with :meth:`~torchrec_sparselift.plan.PlanRequest.fingerprint`
    (what the planner does) or :func:`fingerprint_inputs`.
    """

    tables_digest: str = attrs.field(validator=_hex_digest)
    topology_digest: str = attrs.field(validator=_hex_digest)
    batch_size: int = attrs.field(validator=int_at_least(1))
    constraints_digest: str = attrs.field(validator=_hex_digest)
    stats_digest: Optional[str] = attrs.field(default=None, validator=_hex_digest)
    hardware_digest: Optional[str] = attrs.field(default=None, validator=_hex_digest)
    options_digest: Optional[str] = attrs.field(default=None, validator=_hex_digest)
    versions: Versions = attrs.field(factory=Versions.current, converter=_versions)

    def cache_key(self) -> str:
        """sha256 hex over tables, topology, batch size, constraints, hardware and options digests."""
        return canonical_digest(
            [self.tables_digest, self.topology_digest, self.batch_size, self.constraints_digest,
             self.hardware_digest, self.options_digest]
        )

    def digest(self) -> str:
        """sha256 hex over every field (including statistics and versions)."""
        return canonical_digest(attrs.asdict(self))

    def mismatch(self, other: "Fingerprint") -> Optional[str]:
        """A short reason why ``other`` differs from ``self`` outside the statistics, or ``None``."""
        for name in ("tables_digest", "topology_digest", "batch_size", "constraints_digest",
                     "hardware_digest", "options_digest"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                label = name.replace("_digest", "").replace("options", "planner options")
                if name == "batch_size":
                    return f"batch size changed ({a} -> {b})"
                return f"{label} changed ({str(a)[:12]} -> {str(b)[:12]})"
        for name in ("schema", "torch", "torchrec", "torchrec_sparselift"):
            a, b = getattr(self.versions, name), getattr(other.versions, name)
            if a != b:
                return f"{name} version changed ({a} -> {b})"
        return None


def _check_table_spec(spec: Sequence[Any]) -> Tuple[Any, ...]:
    if not isinstance(spec, (tuple, list)) or len(spec) not in (6, 7):
        raise ValueError(
            "each table must be a tuple (module_path, table_name, rows, dim, feature_names, pooled"
            f"[, data_type]); got {spec!r}"
        )
    module_path, name, rows, dim, features, pooled = spec[:6]
    where = f"table {name!r} (module {module_path!r})"
    if not isinstance(name, str) or not name:
        raise ValueError(f"table name must be a non-empty string, got {name!r} in module {module_path!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"{where}: rows must be an int >= 1, got {rows!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"{where}: dim must be an int >= 1, got {dim!r}")
    if isinstance(features, str) or not all(isinstance(f, str) for f in features):
        raise ValueError(f"{where}: feature_names must be a list of strings, got {features!r}")
    out = (str(module_path), name, rows, dim, list(features), bool(pooled))
    if len(spec) == 7:
        out = out + (str(spec[6]),)
    return out


def topology_description(topology: Any) -> Dict[str, Any]:
    """What of a TorchRec ``Topology`` can change a plan: devices' capacities, sizes, bandwidths."""
    devices = [
        [d.storage.hbm, d.storage.ddr, getattr(d.storage, "ssd", 0)] for d in getattr(topology, "devices", [])
    ]
    desc: Dict[str, Any] = {"devices": devices}
    for name in (
        "world_size", "compute_device", "local_world_size", "intra_group_size", "hbm_mem_bw",
        "ddr_mem_bw", "ssd_mem_bw", "hbm_to_ddr_mem_bw", "intra_host_bw", "inter_host_bw",
        "bwd_compute_multiplier", "weighted_feature_bwd_compute_multiplier",
        "uneven_sharding_perf_multiplier",
    ):
        if hasattr(topology, name):
            desc[name] = canonical_form(getattr(topology, name))
    return desc


def fingerprint_inputs(
    tables: Iterable[Sequence[Any]],
    topology: Any,
    batch_size: int,
    constraints: Optional[Mapping[str, Any]] = None,
    stats: Optional[WorkloadStats] = None,
    hardware: Any = None,
    versions: Optional[Versions] = None,
    options: Optional[Mapping[str, Any]] = None,
) -> Fingerprint:
    """Fingerprint of the planning inputs.

    Args:
        tables: ``(module_path, table_name, rows, dim, feature_names, pooled)`` tuples, optionally
            with a 7th element ``data_type`` (e.g. "FP16"); order does not matter.
            :func:`table_specs` builds them from a model.
        topology: a TorchRec ``Topology`` (world size, devices' capacities, bandwidths).
        batch_size: per-rank batch size, as given to the planner.
        constraints: TorchRec ``ParameterConstraints`` by table name (or ``None``).
        stats: the workload statistics planned with (or ``None``).
        hardware: the :class:`~torchrec_sparselift.cost.hardware.HardwareProfile` planned with.
        versions: defaults to :meth:`Versions.current`.
        options: the planner options the plan was made under (``None``: not recorded);
            :meth:`~torchrec_sparselift.plan.PlanRequest.options` is what the planner records.

    Raises ``ValueError`` naming the table with zero/negative rows or dims, a table listed twice,
    or a non-positive batch size. The same inputs give the same fingerprint in any process.
    """
    specs = [_check_table_spec(t) for t in tables]
    if not specs:
        raise ValueError("fingerprint_inputs() needs at least one table")
    specs.sort(key=lambda s: (s[0], s[1]))
    for a, b in zip(specs, specs[1:]):
        if (a[0], a[1]) == (b[0], b[1]):
            raise ValueError(f"table {a[1]!r} listed twice in module {a[0]!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    hardware_digest = None
    if hardware is not None:
        to_dict = getattr(hardware, "to_dict", None)
        hardware_digest = canonical_digest(to_dict() if callable(to_dict) else hardware)
    return Fingerprint(
        tables_digest=canonical_digest(specs),
        topology_digest=canonical_digest(topology_description(topology)),
        batch_size=batch_size,
        constraints_digest=canonical_digest(dict(constraints or {})),
        stats_digest=None if stats is None else stats.digest(),
        hardware_digest=hardware_digest,
        options_digest=None if options is None else canonical_digest(dict(options)),
        versions=versions if versions is not None else Versions.current(),
    )


def table_specs(module: Any) -> List[TableSpec]:
    """``(module_path, table_name, rows, dim, feature_names, pooled, data_type)`` for every
    embedding module in ``module`` that a TorchRec sharder plans as a unit (EBC, EC, and wrappers
    such as FP-EBC or managed-collision modules, reported at the wrapper's path), found by the
    planner's table walker (:func:`~torchrec_sparselift.semantics.tables.embedding_modules`)."""
    out: List[TableSpec] = []
    for path, sub in embedding_modules(module):
        configs, pooled = embedding_configs(sub)
        for cfg in configs or ():
            data_type = getattr(getattr(cfg, "data_type", None), "value", None) or "FP32"
            out.append(
                (path, cfg.name, int(cfg.num_embeddings), int(cfg.embedding_dim),
                 list(cfg.feature_names), pooled, str(data_type))
            )
    return out


# ----------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def _json_stable(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"ExecutionPlan.{attribute.name} must be JSON-serializable: {e}") from None
    if json.loads(text) != value:
        raise ValueError(
            f"ExecutionPlan.{attribute.name} must survive a JSON round trip unchanged (use lists, not "
            f"tuples; string keys): {value!r}"
        )


def _optional_stats(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is not None and not isinstance(value, WorkloadStats):
        raise TypeError(f"ExecutionPlan.stats must be WorkloadStats or None, got {type(value).__name__}")


def _sharding_plan(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    from torchrec.distributed.types import ShardingPlan

    if not isinstance(value, ShardingPlan):
        raise TypeError(f"ExecutionPlan.sharding_plan must be a torchrec ShardingPlan, got {type(value).__name__}")


@attrs.frozen(kw_only=True)
class ExecutionPlan:
    """A sharding plan plus optimizations, prediction and provenance. See the module docstring."""

    sharding_plan: Any = attrs.field(validator=_sharding_plan, repr=False)
    optimizations: Optimizations = attrs.field(validator=attrs.validators.instance_of(Optimizations))
    prediction: Prediction = attrs.field(validator=attrs.validators.instance_of(Prediction))
    fingerprint: Fingerprint = attrs.field(validator=attrs.validators.instance_of(Fingerprint))
    stats: Optional[WorkloadStats] = attrs.field(default=None, validator=_optional_stats, repr=False)
    created_at: str = attrs.field(factory=_utc_now)
    planner_info: Dict[str, Any] = attrs.field(factory=dict, converter=dict, validator=_json_stable)

    def __attrs_post_init__(self) -> None:
        expected = None if self.stats is None else self.stats.digest()
        if self.fingerprint.stats_digest != expected:
            raise ValueError(
                "ExecutionPlan.fingerprint.stats_digest does not match ExecutionPlan.stats: build the "
                "fingerprint with the same WorkloadStats the plan carries (or None for both)"
            )

    def summary(self) -> str:
        """One line for logs: pipeline, precision, 2D, predicted step, gap, solver."""
        o, p = self.optimizations, self.prediction
        sync = "fully_sharded" if o.strategy == "fully_sharded" else f"sync {o.sync_interval}"
        two_d = f"2D group {o.sharding_group_size}/{sync}" if o.is_2d else "1D"
        if o.layout_2d is not None:
            two_d += f" ({o.layout_2d.kind})"
        tables = sum(len(m) for m in self.sharding_plan.plan.values() if isinstance(m, dict))
        split = f" batch split {o.batch_split}" if o.batch_split > 1 else ""
        wire = "" if o.id_dtype == "int64" else f", ids {o.id_dtype}"
        wire += f", dedup {len(o.dedup_features)} features" if o.dedup_features else ""
        return (
            f"{tables} tables, pipeline={o.pipeline}{split}, comm={o.fwd_comm_precision}/{o.bwd_comm_precision}{wire}, "
            f"{two_d}, predicted {p.step_time_s * 1e3:.3f} ms/step (gap {p.gap:.1%}), "
            f"solver={self.planner_info.get('solver', '?')}"
        )

    # serialization ---------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {
            "schema": EXECUTION_PLAN_SCHEMA,
            "fingerprint": attrs.asdict(self.fingerprint),
            "optimizations": attrs.asdict(self.optimizations),
            "prediction": {
                "step_time_s": self.prediction.step_time_s,
                "lower_bound_s": self.prediction.lower_bound_s,
                "cost_model": self.prediction.cost_model,
                "per_rank": [attrs.asdict(r) for r in self.prediction.per_rank],
            },
            "stats": None if self.stats is None else self.stats.to_dict(),
            "created_at": self.created_at,
            "planner_info": self.planner_info,
            "sharding_plan": sharding_plan_to_dict(self.sharding_plan),
        }

    def to_json(self, indent: Optional[int] = None) -> str:
        """Versioned JSON text; :meth:`from_json` reads it back to an equal plan."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: Optional[str] = None) -> "ExecutionPlan":
        """The plan :meth:`to_dict` wrote. Raises :class:`PlanFormatError` (a ``FileFormatError``)
        naming the field (``prediction.per_rank[2]``) and ``path`` when given, for any JSON-like
        ``data`` that is not one; no other exception type escapes."""
        what = "" if path is None else "execution plan"
        if not isinstance(data, Mapping):
            where = "" if path is None else f"execution plan {path}: "
            raise PlanFormatError(f"{where}execution plan must be a JSON object, got {type(data).__name__}", path=path)
        f = Fields(dict(data), file=path, what=what, error=PlanFormatError)
        schema = f.data.get("schema")
        if isinstance(schema, str) and schema in _OLDER_SCHEMAS:
            raise f.fail(None, f"schema {schema!r} is older than {EXECUTION_PLAN_SCHEMA!r}: {_OLDER_SCHEMAS[schema]}")
        if schema != EXECUTION_PLAN_SCHEMA:
            raise f.fail(None, f"schema {schema!r} is not {EXECUTION_PLAN_SCHEMA!r}",
                         "plan again with this version (a plan of another schema is never read)")
        sharding_plan = sharding_plan_from_dict(f.req("sharding_plan", dict), file=path)
        optimizations = f.obj("optimizations").build(None, lambda d: Optimizations(**d))
        p = f.obj("prediction")
        per_rank = [r.build(None, lambda d: RankPrediction(**d)) for r in p.objs("per_rank")]
        step_time_s = p.req("step_time_s", float, lo=0.0)
        lower_bound_s = p.req("lower_bound_s", float, lo=0.0)
        cost_model = p.req("cost_model", str)
        prediction = p.build(None, lambda _d: Prediction(step_time_s=step_time_s, lower_bound_s=lower_bound_s,
                                                          cost_model=cost_model, per_rank=tuple(per_rank)))
        fingerprint = f.obj("fingerprint").build(None, lambda d: Fingerprint(**d))
        if "stats" not in f.data:
            raise f.fail("stats", "is missing", "add 'stats': null or the plan's workload statistics")
        stats = None if not f.has("stats") else WorkloadStats.from_dict(f.obj("stats"))
        created_at = f.req("created_at", str)
        planner_info = f.req("planner_info", dict)
        return f.build(None, lambda _d: cls(
            sharding_plan=sharding_plan, optimizations=optimizations, prediction=prediction,
            fingerprint=fingerprint, stats=stats, created_at=created_at, planner_info=planner_info))

    @classmethod
    def from_json(cls, text: str, path: Optional[str] = None) -> "ExecutionPlan":
        """Parse :meth:`to_json` output (``path``: the file it came from, named in errors).
        Raises :class:`PlanFormatError` on anything unreadable: invalid or truncated JSON, a
        duplicate key, another schema, a missing or ill-typed field."""
        what = "" if path is None else "execution plan"
        if isinstance(text, (bytes, bytearray)):
            text = decode_utf8(bytes(text), path, what, PlanFormatError)
        if not isinstance(text, str):
            raise PlanFormatError(f"an execution plan is JSON text, got {type(text).__name__}", path=path)
        return cls.from_dict(parse_json(text, path, what, PlanFormatError), path=path)

    @classmethod
    def load(cls, path: str) -> "ExecutionPlan":
        """The plan in file ``path`` (written by :meth:`to_json`); :class:`PlanFormatError` naming
        the file and the field for anything else."""
        return cls.from_dict(load_json(path, "execution plan", error=PlanFormatError), path=path)
