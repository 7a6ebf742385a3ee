"""Workload statistics: what the sparse path will actually be asked to do, per feature.

The cost of an embedding lookup and of the all-to-alls around it depends less on table shapes
than on the ids that flow through them. :func:`observe` measures that from a few batches of the
user's dataloader (KeyedJaggedTensors); :func:`declare` and :func:`from_constraints` build the same
value from numbers the user already knows (TorchRec's ``ParameterConstraints.pooling_factors``).

Definitions (all per feature; a *batch* is one rank's local batch, a *sample* one row of it):

- ``batch_size``: samples per batch (the KJT's stride), mean over observed batches.
- ``pooling_factor``: ids per sample, mean over all observed samples.
- ``pooling_p95`` / ``pooling_p99`` / ``pooling_max``: the 95th / 99th percentile (linear
  interpolation) and the maximum of ids per sample over all observed samples.
- ``unique_ratio``: distinct ids / ids within one batch, mean over the batches that had ids.
  1.0 means no id repeats inside a batch; small values mean deduplication pays off.
- ``unique_growth``: how the distinct ids grow when batches are pooled: the least-squares slope
  of ``log distinct(k batches)`` over ``log k`` for ``k = 1, 2, 4, ...`` observed batches pooled
  (Heaps' law, ``distinct(k) ~ distinct(1) k^g``). 1.0 when pooling repeats nothing (ids drawn from
  a space far larger than the batches), near 0 when the batches keep hitting the same rows. A
  table-wise shard serves the ids of all ``W`` ranks' batches in one step, so its distinct rows
  are ``distinct(1) W^g`` (see :func:`distinct_ids`). Needs two observed batches with ids.
- ``hot_row_skew``: the fraction of all observed lookups that hit the most frequent 1% of the
  distinct ids seen (at least one id), pooled over all observed batches. About 0.01 for uniform
  ids, approaching 1.0 when a few rows take almost all lookups (cacheable, and a load-balance risk
  for row-wise sharding).

Declared statistics know only the mean pooling factor (and optionally the batch size); the
fields they cannot know are ``None`` and ``num_batches`` is 0. Weights of weighted KJTs are ignored:
they do not change which rows are read.

A :class:`WorkloadStats` is an immutable value with a stable :meth:`WorkloadStats.digest`, so
execution plans can fingerprint the statistics they were planned for and detect drift.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping as _MappingABC
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import attrs
import torch

from torchrec_sparselift.files import canonical_digest, read_attrs, record_reader

__all__ = [
    "FeatureStats",
    "WorkloadStats",
    "observe",
    "declare",
    "from_constraints",
    "distinct_ids",
    "HOT_ROW_FRACTION",
    "STATS_SCHEMA",
]

#: Fraction of distinct ids counted as "hot" by ``hot_row_skew``.
HOT_ROW_FRACTION = 0.01
#: Schema tag written by :meth:`WorkloadStats.to_dict`.
STATS_SCHEMA = "sparselift.workload_stats/1"


def _feature_error(instance: Any, attribute: "attrs.Attribute[Any]", value: Any, must: str) -> None:
    raise ValueError(
        f"FeatureStats for feature {getattr(instance, 'feature', '?')!r}: {attribute.name} "
        f"must be {must}, got {value!r}"
    )


def _finite_non_negative(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is None and attribute.default is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        _feature_error(instance, attribute, value, "a finite number >= 0")


def _positive_or_none(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        _feature_error(instance, attribute, value, "a finite number > 0 (or None when unknown)")


def _unit_interval_or_none(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value <= 1.0):
        _feature_error(instance, attribute, value, "in [0, 1] (or None when unknown)")


def _float_or_none(value: Any) -> Optional[float]:
    return None if value is None else float(value)


@attrs.frozen(kw_only=True)
class FeatureStats:
    """Statistics of one sparse feature (see the module docstring for the definitions).

    Fields a declaration cannot know are ``None``; ``num_batches`` is 0 for declared stats.
    """

    feature: str = attrs.field(validator=attrs.validators.instance_of(str))
    pooling_factor: float = attrs.field(converter=float, validator=_finite_non_negative)
    batch_size: Optional[float] = attrs.field(
        default=None, converter=_float_or_none, validator=_positive_or_none
    )
    pooling_p95: Optional[float] = attrs.field(
        default=None, converter=_float_or_none, validator=_finite_non_negative
    )
    pooling_p99: Optional[float] = attrs.field(
        default=None, converter=_float_or_none, validator=_finite_non_negative
    )
    pooling_max: Optional[float] = attrs.field(
        default=None, converter=_float_or_none, validator=_finite_non_negative
    )
    unique_ratio: Optional[float] = attrs.field(
        default=None, converter=_float_or_none, validator=_unit_interval_or_none
    )
    hot_row_skew: Optional[float] = attrs.field(
        default=None, converter=_float_or_none, validator=_unit_interval_or_none
    )
    num_batches: int = attrs.field(default=0)
    unique_growth: Optional[float] = attrs.field(
        default=None, converter=_float_or_none, validator=_unit_interval_or_none
    )

    def __attrs_post_init__(self) -> None:
        if not self.feature:
            raise ValueError("FeatureStats.feature must be a non-empty feature name")
        if isinstance(self.num_batches, bool) or not isinstance(self.num_batches, int) or self.num_batches < 0:
            raise ValueError(
                f"FeatureStats for feature {self.feature!r}: num_batches must be an int >= 0, "
                f"got {self.num_batches!r}"
            )
        tails = [("pooling_p95", self.pooling_p95), ("pooling_p99", self.pooling_p99),
                 ("pooling_max", self.pooling_max)]
        known = [(n, v) for n, v in tails if v is not None]
        for (n1, v1), (n2, v2) in zip(known, known[1:]):
            if v1 > v2 * (1 + 1e-12):
                raise ValueError(
                    f"FeatureStats for feature {self.feature!r}: {n1}={v1} exceeds {n2}={v2}; "
                    "tail statistics must be ordered p95 <= p99 <= max"
                )
        if self.pooling_max is not None and self.pooling_factor > self.pooling_max * (1 + 1e-12):
            raise ValueError(
                f"FeatureStats for feature {self.feature!r}: pooling_factor={self.pooling_factor} "
                f"exceeds pooling_max={self.pooling_max}"
            )

    @property
    def observed(self) -> bool:
        """True when measured from batches, False when declared."""
        return self.num_batches > 0

    def to_dict(self) -> Dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "FeatureStats":
        """The statistics :meth:`to_dict` wrote (a dict, or a file's reader)."""
        return read_attrs(cls, data, kinds={"feature": str})


def _sorted_features(features: Iterable[FeatureStats]) -> Tuple[FeatureStats, ...]:
    if isinstance(features, _MappingABC):
        items = list(features.values())
    else:
        items = list(features)
    return tuple(sorted(items, key=lambda f: f.feature))


def _no_duplicates(instance: Any, attribute: "attrs.Attribute[Any]", value: Tuple[FeatureStats, ...]) -> None:
    for fs in value:
        if not isinstance(fs, FeatureStats):
            raise TypeError(f"WorkloadStats.features must hold FeatureStats, got {type(fs).__name__}")
    for a, b in zip(value, value[1:]):
        if a.feature == b.feature:
            raise ValueError(f"WorkloadStats: feature {a.feature!r} appears twice; give each feature once")


@attrs.frozen
class WorkloadStats(_MappingABC):
    """Per-feature statistics: an immutable mapping ``feature name -> FeatureStats``.

    Build it with :func:`observe`, :func:`declare` or :func:`from_constraints`, or directly from
    FeatureStats values (any order; stored sorted by feature name).
    """

    features: Tuple[FeatureStats, ...] = attrs.field(converter=_sorted_features, validator=_no_duplicates)
    _index: Dict[str, FeatureStats] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_index", {f.feature: f for f in self.features})

    # Mapping protocol ----------------------------------------------------------------------
    def __getitem__(self, feature: str) -> FeatureStats:
        try:
            return self._index[feature]
        except KeyError:
            raise KeyError(
                f"no workload statistics for feature {feature!r}; known: {sorted(self._index)[:10]}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(f.feature for f in self.features)

    def __len__(self) -> int:
        return len(self.features)

    def __contains__(self, feature: object) -> bool:
        return feature in self._index

    # Queries -------------------------------------------------------------------------------
    def pooling_factor(self, feature: str, default: Optional[float] = None) -> Optional[float]:
        """Mean ids per sample of ``feature``, or ``default`` when the feature is unknown."""
        fs = self._index.get(feature)
        return default if fs is None else fs.pooling_factor

    def drift(self, other: "WorkloadStats") -> float:
        """How far ``other`` moved from ``self`` (the reference, e.g. the stats a plan was made for).

        Returns the largest relative change ``|new - old| / old`` of the pooling factor and of the
        unique ratio over all features (unique ratio only where both sides know it); ``inf`` when
        the feature sets differ or a zero reference became non-zero; 0.0 when nothing changed.
        """
        if set(self._index) != set(other._index):
            return math.inf
        worst = 0.0
        for name, old in self._index.items():
            new = other._index[name]
            pairs = [(old.pooling_factor, new.pooling_factor)]
            if old.unique_ratio is not None and new.unique_ratio is not None:
                pairs.append((old.unique_ratio, new.unique_ratio))
            for a, b in pairs:
                if a == b:
                    continue
                if a == 0:
                    return math.inf
                worst = max(worst, abs(b - a) / abs(a))
        return worst

    # Serialization -------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (schema ``STATS_SCHEMA``) that :meth:`from_dict` reads back equal."""
        return {"schema": STATS_SCHEMA, "features": [f.to_dict() for f in self.features]}

    @classmethod
    def from_dict(cls, data: Any) -> "WorkloadStats":
        """The statistics :meth:`to_dict` wrote (a dict, or a file's reader)."""
        f = record_reader(cls, data)
        f.req("schema", str, choices=[STATS_SCHEMA], fix="write it with WorkloadStats.to_dict")
        return read_attrs(cls, f, ignore_unknown=True,
                          features=lambda r: tuple(FeatureStats.from_dict(x) for x in r.objs("features")))

    def digest(self) -> str:
        """sha256 hex of the canonical JSON of :meth:`to_dict`: equal stats, equal digest, in any process."""
        return canonical_digest(self.to_dict())


# ------------------------------------------------------------------------------------------------
# Observation
# ------------------------------------------------------------------------------------------------


def _as_kjt(batch: Any) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if isinstance(batch, KeyedJaggedTensor):
        return batch
    sparse = getattr(batch, "sparse_features", None)
    if isinstance(sparse, KeyedJaggedTensor):
        return sparse
    raise TypeError(
        "observe() needs KeyedJaggedTensors or objects with a `.sparse_features` KeyedJaggedTensor "
        f"(like torchrec's Batch); got {type(batch).__name__}"
    )


def _quantile(sorted_values: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile of an ascending 1-D float64 tensor (numpy's default rule)."""
    n = sorted_values.numel()
    pos = q * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac)


def _distinct(ids: torch.Tensor) -> int:
    """Number of distinct values (sort + neighbour compare: several times faster than
    ``torch.unique`` on CPU for millions of ids)."""
    if ids.numel() == 0:
        return 0
    s = torch.sort(ids).values
    return int((s[1:] != s[:-1]).sum()) + 1


def _unique_growth(chunks: Sequence[torch.Tensor]) -> Optional[float]:
    """Slope of ``log distinct`` over ``log k`` with the first ``k = 1, 2, 4, ...`` batches that
    had ids pooled (clipped to [0, 1]); None with fewer than two such batches."""
    chunks = [c for c in chunks if c.numel()]
    if len(chunks) < 2:
        return None
    xs, ys = [], []
    k = 1
    while k <= len(chunks):
        xs.append(math.log(k))
        ys.append(math.log(_distinct(torch.cat(chunks[:k]))))
        k *= 2
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return min(1.0, max(0.0, slope))


def distinct_ids(ids_per_batch: float, batches: float, rows: int,
                 unique_ratio: Optional[float] = None, unique_growth: Optional[float] = None) -> float:
    """Expected distinct ids among ``batches`` batches of ``ids_per_batch`` ids each, from a table
    of ``rows`` rows (what one shard's backward updates in a step).

    With a measured ``unique_ratio`` (and ``unique_growth``, else 1.0): ``min(rows, u n b^g)``
    (Heaps' law from the observed batches, :func:`observe`). Without: ids drawn uniformly from the
    rows, ``rows (1 - exp(-n b / rows))`` (an upper bound for any skewed distribution).
    """
    n = float(ids_per_batch) * float(batches)
    if n <= 0 or rows <= 0:
        return 0.0
    if unique_ratio is None:
        return float(rows) * -math.expm1(-n / float(rows))
    g = 1.0 if unique_growth is None else float(unique_growth)
    return min(float(rows), float(unique_ratio) * float(ids_per_batch) * float(batches) ** g, n)


def _hot_row_skew(ids: torch.Tensor) -> float:
    _, counts = torch.unique_consecutive(torch.sort(ids).values, return_counts=True)
    k = max(1, math.ceil(HOT_ROW_FRACTION * counts.numel()))
    top = torch.topk(counts, k, sorted=False).values
    return float(top.sum().item()) / float(ids.numel())


def observe(batches: Iterable[Any], max_batches: int = 8) -> WorkloadStats:
    """Measure per-feature statistics from at most ``max_batches`` batches.

    ``batches`` yields KeyedJaggedTensors or objects with a ``.sparse_features`` KJT (torchrec's
    ``Batch``); only the first ``max_batches`` items are drawn from it (pass a fresh iterator if the
    training loop must see them too). Variable-batch KJTs are supported. Raises ``ValueError``
    when nothing was observed or a batch is malformed (naming the feature).
    """
    if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
        raise ValueError(f"observe(max_batches=...) must be an int >= 1, got {max_batches!r}")
    lengths_by_feature: Dict[str, List[torch.Tensor]] = {}
    ids_by_feature: Dict[str, List[torch.Tensor]] = {}
    unique_ratios: Dict[str, List[float]] = {}
    batch_sizes: Dict[str, List[int]] = {}
    n_seen = 0
    for batch in itertools.islice(batches, max_batches):
        kjt = _as_kjt(batch)
        n_seen += 1
        keys = list(kjt.keys())
        lengths = kjt.lengths().detach().to("cpu", torch.int64)
        values = kjt.values().detach().to("cpu")
        if kjt.variable_stride_per_key():
            strides = [int(s) for s in kjt.stride_per_key()]
        else:
            strides = [int(kjt.stride())] * len(keys)
        if sum(strides) != lengths.numel():
            raise ValueError(
                f"batch {n_seen - 1}: KJT lengths have {lengths.numel()} entries but the strides of "
                f"features {keys} add up to {sum(strides)}"
            )
        per_key_lengths = lengths.split(strides)
        per_key_counts = [int(x.sum()) for x in per_key_lengths]
        if sum(per_key_counts) != values.numel():
            raise ValueError(
                f"batch {n_seen - 1}: KJT lengths add up to {sum(per_key_counts)} ids but it holds "
                f"{values.numel()} values"
            )
        per_key_values = values.split(per_key_counts)
        for key, key_lengths, key_values, stride in zip(keys, per_key_lengths, per_key_values, strides):
            if key_lengths.numel() and int(key_lengths.min()) < 0:
                raise ValueError(f"batch {n_seen - 1}: feature {key!r} has negative lengths")
            lengths_by_feature.setdefault(key, []).append(key_lengths)
            ids_by_feature.setdefault(key, []).append(key_values)
            batch_sizes.setdefault(key, []).append(stride)
            if key_values.numel():
                unique_ratios.setdefault(key, []).append(_distinct(key_values) / key_values.numel())
    if n_seen == 0:
        raise ValueError("observe() got no batches: pass an iterable that yields at least one KJT")

    out = []
    for key, chunks in lengths_by_feature.items():
        all_lengths = torch.cat(chunks).to(torch.float64)
        sizes = batch_sizes[key]
        mean_bs = sum(sizes) / len(sizes)
        if all_lengths.numel() == 0:
            raise ValueError(f"feature {key!r} had no samples in any observed batch; cannot measure it")
        sorted_lengths = torch.sort(all_lengths).values
        all_ids = torch.cat(ids_by_feature[key])
        ratios = unique_ratios.get(key)
        out.append(
            FeatureStats(
                feature=key,
                batch_size=mean_bs,
                pooling_factor=float(all_lengths.mean()),
                pooling_p95=_quantile(sorted_lengths, 0.95),
                pooling_p99=_quantile(sorted_lengths, 0.99),
                pooling_max=float(sorted_lengths[-1]),
                unique_ratio=(sum(ratios) / len(ratios)) if ratios else None,
                hot_row_skew=_hot_row_skew(all_ids) if all_ids.numel() else None,
                num_batches=len(chunks),
                unique_growth=_unique_growth(ids_by_feature[key]),
            )
        )
    return WorkloadStats(tuple(out))


# ------------------------------------------------------------------------------------------------
# Declaration
# ------------------------------------------------------------------------------------------------


def declare(
    pooling_factors: Optional[Mapping[str, float]] = None,
    /,
    *,
    batch_size: Optional[float] = None,
    **more_pooling_factors: float,
) -> WorkloadStats:
    """Statistics from known mean pooling factors: ``declare(f1=3.0, f2=1.0)`` or
    ``declare({"f1": 3.0}, batch_size=512)`` (a mapping allows feature names that are not
    identifiers, or that collide with ``batch_size``). Unknown quantities stay ``None``.
    """
    merged: Dict[str, float] = dict(pooling_factors or {})
    for name, value in more_pooling_factors.items():
        if name in merged:
            raise ValueError(f"feature {name!r} declared twice; give its pooling factor once")
        merged[name] = value
    if not merged:
        raise ValueError("declare() needs at least one feature: declare(my_feature=pooling_factor)")
    out = []
    for name, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(
                f"declared pooling factor for feature {name!r} must be a finite number >= 0, got {value!r}"
            )
        out.append(FeatureStats(feature=name, pooling_factor=value, batch_size=batch_size))
    return WorkloadStats(tuple(out))


def from_constraints(
    constraints: Mapping[str, Any],
    feature_names: Optional[Mapping[str, Sequence[str]]] = None,
) -> WorkloadStats:
    """Statistics from TorchRec ``ParameterConstraints`` (keyed by table name).

    Each table's ``pooling_factors`` (and ``batch_sizes`` when given) are matched position by
    position with its features: ``ParameterConstraints.feature_names`` when set, else
    ``feature_names[table]`` (e.g. from the module's ``EmbeddingBagConfig.feature_names``).
    Tables whose constraints keep TorchRec's default ``pooling_factors=[1.0]`` (and no
    ``batch_sizes``) declare nothing and are skipped.
    Raises ``ValueError`` naming the table whose lengths disagree or whose features are unknown.
    """
    from torchrec.distributed.planner.constants import POOLING_FACTOR

    out: Dict[str, FeatureStats] = {}
    for table, pc in constraints.items():
        pfs = list(pc.pooling_factors)
        if pfs == [POOLING_FACTOR] and getattr(pc, "batch_sizes", None) is None:
            continue  # TorchRec's untouched default: this constraint declares no statistics
        names = getattr(pc, "feature_names", None)
        if names is None and feature_names is not None:
            names = feature_names.get(table)
        if names is None:
            raise ValueError(
                f"constraints for table {table!r} do not say which features its pooling_factors "
                "belong to: set ParameterConstraints.feature_names or pass feature_names={table: [...]}"
            )
        if len(pfs) != len(names):
            raise ValueError(
                f"constraints for table {table!r}: {len(pfs)} pooling_factors for {len(names)} "
                f"features {list(names)}; give one pooling factor per feature"
            )
        bss = getattr(pc, "batch_sizes", None)
        if bss is not None and len(bss) != len(names):
            raise ValueError(
                f"constraints for table {table!r}: {len(bss)} batch_sizes for {len(names)} features"
            )
        for i, name in enumerate(names):
            if name in out:
                raise ValueError(
                    f"feature {name!r} gets pooling factors from two tables' constraints (table {table!r})"
                )
            value = pfs[i]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"constraints for table {table!r}: pooling factor of feature {name!r} must be a "
                    f"finite number >= 0, got {value!r}"
                )
            out[name] = FeatureStats(
                feature=name,
                pooling_factor=value,
                batch_size=None if bss is None else bss[i],
            )
    if not out:
        raise ValueError(
            "from_constraints(): no table's ParameterConstraints sets pooling_factors; declare them "
            "(or use observe()/declare())"
        )
    return WorkloadStats(tuple(out.values()))
