"""Ids on the wire: what the input all-to-all carries per feature, priced (pure functions).

TorchRec's input all-to-all sends each feature's ids and lengths at the KJT's dtype (int64 from
the usual dataloaders). Two rewrites shrink it; the runtime applies them in
:mod:`torchrec_sparselift.runtime.wire_ids`, an execution plan chooses them in its
``Optimizations`` (``id_dtype``, ``dedup_features``), and docs/wire_ids.md is the manual.

* **narrow ids** (``id_dtype="int32"``): ids and lengths travel as int32, which holds every id of
  a table with at most :data:`INT32_MAX` rows (:func:`narrow_refusal` names a table that does not
  fit). A feature's ids cost ``n * 4`` bytes instead of ``n * 8`` (and its lengths 4 bytes each,
  :data:`LENGTH_BYTES`).
* **dedup** (a feature in ``dedup_features``): the sender sends, per destination, the feature's
  distinct ids once and an inverse index per id (into the distinct ids, at the narrowest of uint8,
  int16 and int32 that holds it, :func:`inverse_bytes`); the receiver rebuilds the ids exactly. A
  feature of ``n`` ids with distinct-id ratio ``r`` costs

      dedup bytes = r * n * id_bytes + n * inverse_bytes

  and the unique/rebuild kernels ``n * dedup_id_s`` seconds. With the link's ``bandwidth`` (bytes
  per second), dedup pays exactly when

      r < 1 - (inverse_bytes + dedup_id_s * bandwidth) / id_bytes          (:func:`dedup_threshold`)

  (never, when the right side is <= 0).

Per feature and rank, ``n`` is the feature's ids in one rank's batch (``batch_size *
pooling_factor``) and ``r`` its observed ``unique_ratio``
(:class:`~torchrec_sparselift.semantics.workload.FeatureStats`); the lengths (one per sample) are
the same under every choice but their element size. :func:`choose_wire_ids` picks both settings
for a set of tables by these prices.

**In the step equation** (:class:`WireRule`, :func:`table_wire`): the search prices both rewrites
per option. Under a rule (the plan's id dtype, the dedup kernels' ``dedup_id_s``, the input
link's bandwidth), one option (a table under one sharding type and shard count) sends

    factor = sum_f feature_input_bytes(f, id_dtype, f in dedup) / sum_f feature_input_bytes(f)

of its int64 input bytes (``f`` its features under that sharding, :func:`wire_features`; a
feature is deduplicated where :func:`dedup_saving_s` is positive), and every rank runs its
deduplicated features' kernels, ``kernel_s = sum_{f in dedup} f.ids * dedup_id_s`` seconds per
step. ``cost.model.rewrite_wire`` writes both into the option's input-dist load columns, the one
place the LP, the MILP, the bounds, the local search and the rewrite stage read them from.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.semantics.graph import LENGTH_BYTES as GRAPH_LENGTH_BYTES
from torchrec_sparselift.vocabulary import COLUMN_WISE, DATA_PARALLEL, GRID_SHARD, ROW_WISE, TABLE_ROW_WISE

__all__ = [
    "ID_DTYPES",
    "ID_BYTES",
    "INT32_MAX",
    "LENGTH_BYTES",
    "FeatureWire",
    "feature_tuple",
    "WireChoice",
    "inverse_bytes",
    "narrow_refusal",
    "ids_bytes",
    "lengths_bytes",
    "dedup_bytes",
    "feature_input_bytes",
    "dedup_threshold",
    "dedup_saving_s",
    "choose_wire_ids",
    "wire_features",
    "choose_for_request",
    "WireRule",
    "TableWire",
    "table_wire",
]

#: Element types the input all-to-all may carry ids and lengths in (first: TorchRec's).
ID_DTYPES: Tuple[str, ...] = ("int64", "int32")
#: Bytes per id (and per length) of each id dtype.
ID_BYTES: Mapping[str, int] = {"int64": 8, "int32": 4}
#: The largest id int32 holds: a table with more rows than ``INT32_MAX + 1`` cannot go narrow.
INT32_MAX = 2**31 - 1
#: Bytes per length on the wire under each id dtype: int32 under narrow ids; under TorchRec's own
#: all-to-all the dataloader's lengths dtype, which the sparse-path graph takes as int32
#: (:data:`~torchrec_sparselift.semantics.graph.LENGTH_BYTES`; an int64-lengths dataloader sends
#: twice that, and narrow ids then halve the lengths too).
LENGTH_BYTES: Mapping[str, int] = {"int64": GRAPH_LENGTH_BYTES, "int32": 4}
#: Inverse-index widths (bytes) and the most distinct ids each can index (uint8, int16, int32).
_INVERSE_WIDTHS: Tuple[Tuple[int, int], ...] = ((1, 256), (2, 32768), (4, INT32_MAX + 1))


def feature_tuple(features: Iterable[str]) -> Tuple[str, ...]:
    """``features`` as a sorted tuple of distinct non-empty names; ``ValueError`` for a bare
    string (name the features in a list), a non-string, an empty name or a repeat."""
    if isinstance(features, str):
        raise ValueError(f"dedup_features must be a list of feature names, got the string {features!r}: "
                         f"write [{features!r}]")
    out = list(features)
    bad = [f for f in out if not isinstance(f, str) or not f]
    if bad:
        raise ValueError(f"dedup_features must hold non-empty feature names, got {bad[:3]}")
    if len(set(out)) != len(out):
        raise ValueError(f"dedup_features names a feature twice: {sorted(out)}; give each once")
    return tuple(sorted(out))


def _check_dtype(id_dtype: str) -> int:
    if id_dtype not in ID_BYTES:
        raise ValueError(f"id_dtype={id_dtype!r} is not supported: use one of {', '.join(ID_DTYPES)}")
    return ID_BYTES[id_dtype]


def inverse_bytes(distinct: float) -> int:
    """Bytes per inverse-index entry for a message of ``distinct`` distinct ids: 1 (uint8) up to
    256, 2 (int16) up to 32768, else 4 (int32). The runtime picks the width per message by the
    same rule (sender and receiver both know the counts)."""
    if not distinct >= 0:
        raise ValueError(f"distinct ids must be >= 0, got {distinct!r}")
    for width, most in _INVERSE_WIDTHS:
        if distinct <= most:
            return width
    raise ValueError(f"{distinct} distinct ids exceed what an int32 inverse index holds ({INT32_MAX + 1})")


def narrow_refusal(tables: Iterable[Tuple[str, int]]) -> Optional[str]:
    """None when every ``(table name, num_embeddings)`` fits int32 ids; else the reason naming the
    tables that do not (and the fix)."""
    big = [f"{name} ({rows} rows)" for name, rows in tables if rows - 1 > INT32_MAX]
    if not big:
        return None
    return (f"id_dtype='int32' cannot hold the ids of {', '.join(big)}: int32 ids reach {INT32_MAX}; "
            "keep id_dtype='int64' for this plan")


def ids_bytes(ids: float, id_dtype: str = "int64") -> float:
    """Bytes of ``ids`` ids on the wire at ``id_dtype``."""
    if not ids >= 0:
        raise ValueError(f"ids must be >= 0, got {ids!r}")
    return float(ids) * _check_dtype(id_dtype)


def lengths_bytes(samples: float, id_dtype: str = "int64") -> float:
    """Bytes of ``samples`` lengths (one per sample and feature) at ``id_dtype``."""
    if not samples >= 0:
        raise ValueError(f"samples must be >= 0, got {samples!r}")
    _check_dtype(id_dtype)
    return float(samples) * LENGTH_BYTES[id_dtype]


def dedup_bytes(ids: float, unique_ratio: float, id_dtype: str = "int64",
                messages: int = 1) -> float:
    """Bytes of ``ids`` ids deduplicated, spread over ``messages`` destinations (a row-wise table
    sends one bucket to each rank): ``r * ids * id_bytes`` distinct ids plus ``ids`` inverse
    entries at :func:`inverse_bytes` of one message's distinct ids."""
    if not 0.0 <= unique_ratio <= 1.0:
        raise ValueError(f"unique_ratio must be in [0, 1], got {unique_ratio!r}")
    if messages < 1:
        raise ValueError(f"messages must be >= 1, got {messages!r}")
    distinct = unique_ratio * ids
    return ids_bytes(distinct, id_dtype) + float(ids) * inverse_bytes(math.ceil(distinct / messages))


@attrs.frozen(kw_only=True)
class FeatureWire:
    """One feature's input all-to-all traffic per rank and step: ``ids`` ids over ``samples``
    samples in ``messages`` destination messages, with distinct-id ratio ``unique_ratio`` (None:
    not observed, dedup is not priced)."""

    feature: str = attrs.field(validator=attrs.validators.instance_of(str))
    ids: float = attrs.field(converter=float)
    samples: float = attrs.field(converter=float)
    unique_ratio: Optional[float] = attrs.field(default=None)
    messages: int = attrs.field(default=1)
    table: str = attrs.field(default="")

    def __attrs_post_init__(self) -> None:
        if not (self.ids >= 0 and self.samples >= 0 and math.isfinite(self.ids) and math.isfinite(self.samples)):
            raise ValueError(f"feature {self.feature!r}: ids and samples must be finite and >= 0, "
                             f"got {self.ids}, {self.samples}")
        r = self.unique_ratio
        if r is not None and not 0.0 <= r <= 1.0:
            raise ValueError(f"feature {self.feature!r}: unique_ratio must be in [0, 1] or None, got {r!r}")
        if isinstance(self.messages, bool) or not isinstance(self.messages, int) or self.messages < 1:
            raise ValueError(f"feature {self.feature!r}: messages must be an int >= 1, got {self.messages!r}")


def feature_input_bytes(f: FeatureWire, id_dtype: str = "int64", dedup: bool = False) -> float:
    """The feature's input all-to-all bytes per rank and step: its ids (plain or deduplicated)
    plus its lengths, at ``id_dtype``."""
    if dedup:
        if f.unique_ratio is None:
            raise ValueError(f"feature {f.feature!r} has no observed unique_ratio: dedup cannot be priced; "
                             "observe the workload (semantics.workload.observe) or leave it out of dedup")
        ids = dedup_bytes(f.ids, f.unique_ratio, id_dtype, f.messages)
    else:
        ids = ids_bytes(f.ids, id_dtype)
    return ids + lengths_bytes(f.samples, id_dtype)


def dedup_threshold(id_dtype: str, inverse_width: int, dedup_id_s: float, bandwidth: float) -> float:
    """The distinct-id ratio below which dedup pays: ``1 - (inverse_width + dedup_id_s *
    bandwidth) / id_bytes`` (clipped at 0: never pays). ``dedup_id_s``: seconds of the unique and
    rebuild kernels per id; ``bandwidth``: the input link's bytes per second."""
    if dedup_id_s < 0 or not bandwidth > 0:
        raise ValueError(f"dedup_id_s must be >= 0 and bandwidth > 0, got {dedup_id_s!r}, {bandwidth!r}")
    if inverse_width not in (w for w, _ in _INVERSE_WIDTHS):
        raise ValueError(f"inverse_width must be one of 1, 2, 4 bytes, got {inverse_width!r}")
    return max(0.0, 1.0 - (inverse_width + dedup_id_s * bandwidth) / _check_dtype(id_dtype))


def dedup_saving_s(f: FeatureWire, id_dtype: str, dedup_id_s: float, bandwidth: float) -> float:
    """Seconds per step dedup saves on feature ``f`` at ``id_dtype`` (negative: it costs): the
    bytes it removes over ``bandwidth`` less its kernels' ``f.ids * dedup_id_s``. 0 for a feature
    without an observed ratio (not priced, never chosen)."""
    if f.unique_ratio is None:
        return 0.0
    if dedup_id_s < 0 or not bandwidth > 0:
        raise ValueError(f"dedup_id_s must be >= 0 and bandwidth > 0, got {dedup_id_s!r}, {bandwidth!r}")
    saved = feature_input_bytes(f, id_dtype) - feature_input_bytes(f, id_dtype, dedup=True)
    return saved / bandwidth - f.ids * dedup_id_s


@attrs.frozen(kw_only=True)
class WireChoice:
    """What :func:`choose_wire_ids` picked: the id dtype, the features to deduplicate (sorted),
    the predicted input bytes per rank and step before/after, and why narrow ids were refused
    (``""`` when chosen or not asked)."""

    id_dtype: str
    dedup_features: Tuple[str, ...] = attrs.field(converter=feature_tuple)
    bytes_before: float
    bytes_after: float
    refused: str = ""


def choose_wire_ids(features: Sequence[FeatureWire], table_rows: Mapping[str, int], *,
                    dedup_id_s: float, bandwidth: float, allow_narrow: bool = True,
                    allow_dedup: bool = True) -> WireChoice:
    """Pick the id dtype and the features to deduplicate by price.

    ``features``: the sharded (model-parallel) features' traffic; ``table_rows``: rows of every
    table those features read (narrow ids need all of them within int32: one dtype per plan, as
    the runtime applies it per sharded module); ``dedup_id_s`` the dedup kernels' seconds per id,
    ``bandwidth`` the input link's bytes per second. Narrow ids are chosen whenever they fit (they
    never add bytes, :func:`feature_input_bytes`); a feature is deduplicated when
    :func:`dedup_saving_s` at the chosen dtype is positive.
    """
    refused = narrow_refusal(table_rows.items()) or ""
    id_dtype = "int32" if allow_narrow and not refused else "int64"
    before = sum(feature_input_bytes(f) for f in features)
    dedup = tuple(f.feature for f in features if allow_dedup and f.unique_ratio is not None
                  and dedup_saving_s(f, id_dtype, dedup_id_s, bandwidth) > 0)
    after = sum(feature_input_bytes(f, id_dtype, f.feature in dedup) for f in features)
    return WireChoice(id_dtype=id_dtype, dedup_features=dedup, bytes_before=before, bytes_after=after,
                      refused=refused if allow_narrow else "")


def wire_features(tables: Sequence[Any], stats: Optional[Mapping[str, Any]], sharding: Mapping[str, Tuple[str, int]],
                  *, batch_size: int, world_size: int, local_world_size: int) -> Tuple[FeatureWire, ...]:
    """Each model-parallel feature's input all-to-all traffic per rank and step, for
    :func:`choose_wire_ids`.

    ``tables``: values with ``name``, ``feature_names``, ``pooling_factor`` (ids per sample over
    the table's features), ``batch_size`` and ``unique_ratio`` (``TableSpec``); ``stats``: feature
    -> statistics with ``pooling_factor``, ``batch_size`` and ``unique_ratio``
    (``WorkloadStats``, or None); a feature's own statistics win, else its table's share
    (``pooling_factor`` split evenly over its features, the table's ``unique_ratio``), else
    ``batch_size``. ``sharding``: table -> (sharding type, shards). A data-parallel table sends
    nothing and is left out; a column-wise table's ids go to each of its shards (``shards``
    copies, one message each); a row-wise table's go to ``world_size`` buckets, a table-row-wise
    one's to ``local_world_size``, one message each (the distinct ids per message are the
    feature's spread over them, as the runtime deduplicates per destination).
    """
    if world_size < 1 or local_world_size < 1 or batch_size < 1:
        raise ValueError(f"batch_size, world_size and local_world_size must be >= 1, got "
                         f"{batch_size}, {world_size}, {local_world_size}")
    out = []
    for t in tables:
        if t.name not in sharding:
            raise ValueError(f"table {t.name!r} has no sharding: give sharding[{t.name!r}] = (type, shards)")
        st, shards = sharding[t.name]
        if st == DATA_PARALLEL:
            continue
        copies = shards if st == COLUMN_WISE else 1
        messages = {ROW_WISE: world_size, TABLE_ROW_WISE: local_world_size,
                    GRID_SHARD: local_world_size}.get(st, 1)
        features = list(t.feature_names)
        for f in features:
            fs = stats[f] if stats is not None and f in stats else None
            if fs is not None:
                pf, b, r = fs.pooling_factor, fs.batch_size, fs.unique_ratio
            else:
                pf, b, r = t.pooling_factor / max(len(features), 1), getattr(t, "batch_size", None), t.unique_ratio
            b = b if b is not None else batch_size
            out.append(FeatureWire(feature=f, table=t.name, ids=b * pf * copies, samples=b * copies,
                                   unique_ratio=r, messages=messages * copies))
    return tuple(out)


def choose_for_request(request: Any, sharding: Mapping[str, Tuple[str, int]], *, dedup_id_s: float,
                       allow_narrow: bool = True, allow_dedup: bool = True) -> WireChoice:
    """:func:`choose_wire_ids` for a plan request (``PlanRequest``: its ``tables``, ``stats``,
    ``batch_size``, ``topology`` and ``hardware``) under ``sharding`` (table -> (sharding type,
    shards): the sharding the search chose). The input link is the cross-host one
    (``inter_host_bw``) when the topology spans hosts, else ``intra_host_bw``; narrow ids need every
    model-parallel table within int32 rows."""
    world = int(request.topology.world_size)
    local = int(getattr(request.topology, "local_world_size", world) or world)
    features = wire_features(request.tables, request.stats, sharding, batch_size=request.batch_size,
                             world_size=world, local_world_size=local)
    rows = {t.name: int(t.num_embeddings) for t in request.tables
            if t.name in sharding and sharding[t.name][0] != DATA_PARALLEL}
    hw = request.hardware
    bandwidth = hw.inter_host_bw if world > local else hw.intra_host_bw
    return choose_wire_ids(features, rows, dedup_id_s=dedup_id_s, bandwidth=bandwidth,
                           allow_narrow=allow_narrow, allow_dedup=allow_dedup)


@attrs.frozen(kw_only=True)
class WireRule:
    """What the search prices on the wire: ``id_dtype`` (every model-parallel table's ids and
    lengths; ``"int64"``: TorchRec's), ``dedup_id_s`` (the dedup kernels' seconds per id; None:
    no feature is deduplicated), ``bandwidth`` (the input link's bytes per second, which prices
    dedup), the workload's feature ``stats`` (None: the tables' own ratios) and the sizes
    :func:`wire_features` takes. :func:`table_wire` prices one option under it."""

    id_dtype: str = attrs.field(default="int64")
    dedup_id_s: Optional[float] = None
    bandwidth: float = attrs.field(converter=float)
    batch_size: int
    world_size: int
    local_world_size: int
    stats: Optional[Mapping[str, Any]] = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        _check_dtype(self.id_dtype)
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"WireRule.bandwidth must be a finite bytes/s > 0, got {self.bandwidth!r}")
        if self.dedup_id_s is not None and not (self.dedup_id_s >= 0 and math.isfinite(self.dedup_id_s)):
            raise ValueError(f"WireRule.dedup_id_s must be None or finite seconds >= 0, got {self.dedup_id_s!r}")
        if min(self.batch_size, self.world_size, self.local_world_size) < 1:
            raise ValueError(f"WireRule: batch_size, world_size and local_world_size must be >= 1, got "
                             f"{self.batch_size}, {self.world_size}, {self.local_world_size}")

    @property
    def active(self) -> bool:
        """Whether the rule changes anything (narrow ids or a priced dedup)."""
        return self.id_dtype != "int64" or self.dedup_id_s is not None


@attrs.frozen(kw_only=True)
class TableWire:
    """One option's wire terms (:func:`table_wire`): ``factor`` on its int64 input bytes,
    ``kernel_s`` the dedup kernels' seconds per rank and step, the deduplicated features, and
    the option's input bytes per rank (its features' sum) before and after."""

    factor: float = 1.0
    kernel_s: float = 0.0
    dedup_features: Tuple[str, ...] = ()
    bytes_before: float = 0.0
    bytes_after: float = 0.0


def table_wire(rule: WireRule, table: Any, sharding_type: str, num_shards: int,
               dedup: Optional[Iterable[str]] = None) -> TableWire:
    """The wire terms of ``table`` (a ``TableSpec``) sharded ``sharding_type`` over ``num_shards``
    shards under ``rule`` (module docstring): the one definition the search's load columns and the
    rewrite stage's choice both take. A data-parallel option sends nothing (factor 1).
    ``dedup``: deduplicate exactly these of the table's features (a forced run; ``ValueError``
    for one without an observed ratio, ``feature_input_bytes``), else the ones whose price pays."""
    if sharding_type == DATA_PARALLEL:
        return TableWire()
    feats = wire_features([table], rule.stats, {table.name: (sharding_type, int(num_shards))},
                          batch_size=rule.batch_size, world_size=rule.world_size,
                          local_world_size=min(rule.local_world_size, rule.world_size))
    if dedup is not None:
        forced = set(dedup)
        dedup = tuple(f.feature for f in feats if f.feature in forced)
    else:
        dedup = tuple(f.feature for f in feats if rule.dedup_id_s is not None and f.unique_ratio is not None
                      and dedup_saving_s(f, rule.id_dtype, rule.dedup_id_s, rule.bandwidth) > 0)
    before = sum(feature_input_bytes(f) for f in feats)
    after = sum(feature_input_bytes(f, rule.id_dtype, f.feature in dedup) for f in feats)
    kernel_s = sum(f.ids for f in feats if f.feature in dedup) * (rule.dedup_id_s or 0.0)
    return TableWire(factor=after / before if before > 0 else 1.0, kernel_s=kernel_s,
                     dedup_features=feature_tuple(dedup), bytes_before=before, bytes_after=after)
