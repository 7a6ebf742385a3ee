"""The rank-load columns: what a shard puts on a rank, declared once.

Every plan is priced from per-rank load vectors, one entry per :class:`LoadColumn` of
:data:`LOAD_COLUMNS` (the order is the vectors' order). A column is

* ``time``: seconds of compute; the step equation adds its maximum over ranks to each phase in
  ``phases`` (:func:`torchrec_sparselift.cost.model.phase_table`);
* ``link``: bytes over a host link; divided by the profile's ``bandwidth`` it is a link phase's
  seconds (each link phase takes the slowest of its columns, scaled by the phase's comm precision,
  :data:`PHASE_PRECISION`);
* ``memory``: bytes held per rank, limited by the rank's ``capacity`` (``device`` or ``host``).

``group_cost`` names a :class:`~torchrec_sparselift.cost.hardware.HardwareProfile` field (seconds)
a rank pays in this column once per TBE group (sharding type, kernel) it holds.

Everything that reads per-rank loads takes its columns from here: the cost model's shard loads and
phase seconds, the incremental evaluator, the placement's balance weights, and the equation builder
every solver's rows come from (:mod:`torchrec_sparselift.search.equation`). Adding a cost term is
one :class:`LoadColumn` in :data:`LOAD_COLUMNS`: a column whose load is not one of the sparse-path
nodes' gives ``shard_load(spec, cand, ctx)``, the seconds (or bytes) one shard puts on its rank,
and :func:`~torchrec_sparselift.cost.model.shard_cost` adds it (``tests/test_step_equation.py``
registers such a term and checks that the evaluator, the bounds and the MILP all move by it).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import attrs
import numpy as np

from torchrec_sparselift.semantics.graph import shard_nodes

__all__ = [
    "LoadColumn",
    "cold_row_seconds",
    "cold_rows_load",
    "LOAD_COLUMNS",
    "PHASE_PRECISION",
    "LoadLayout",
    "layout",
]

COLUMN_KINDS = ("time", "link", "memory")


@attrs.frozen
class LoadColumn:
    """One per-rank load column (see module docs)."""

    name: str
    kind: str = attrs.field(validator=attrs.validators.in_(COLUMN_KINDS))
    phases: Tuple[str, ...] = attrs.field(default=(), converter=tuple)
    bandwidth: str = ""
    group_cost: str = ""
    capacity: str = ""
    shard_load: Optional[Callable[..., float]] = attrs.field(default=None, eq=False)
    doc: str = ""

    def __attrs_post_init__(self) -> None:
        if self.kind == "link" and not (self.bandwidth and self.phases):
            raise ValueError(f"link column {self.name!r} needs its phases and a bandwidth field")
        if self.kind == "time" and not self.phases:
            raise ValueError(f"time column {self.name!r} needs the phase(s) its seconds add to")
        if self.kind == "memory" and self.capacity not in ("device", "host"):
            raise ValueError(f"memory column {self.name!r}: capacity must be 'device' or 'host'")


def cold_row_seconds(ids: float, shard_bytes: float, profile: Any) -> float:
    """Seconds ``ids`` lookups (forward and backward together) of a shard of ``shard_bytes`` pay
    beyond the row traffic ``hbm_bw`` prices, because the shard does not fit the cache its rank's
    lookups share:

        ids * cold_row_s * max(0, 1 - lookup_cache_bytes / shard_bytes)

    (under uniform access, the share of the rows read that are not in the cache). 0 for a shard
    within the cache and for a profile with ``cold_row_s = 0`` (the GPU presets); never decreases
    as the shard grows."""
    if ids <= 0 or shard_bytes <= 0 or profile.cold_row_s <= 0:
        return 0.0
    miss = 1.0 - profile.lookup_cache_bytes / float(shard_bytes)
    return float(ids) * profile.cold_row_s * miss if miss > 0 else 0.0


def cold_rows_load(spec: Any, cand: Any, ctx: Any) -> float:
    """The ``cold_rows_s`` load of one shard on its rank: :func:`cold_row_seconds` of the ids its
    memory-resident lookups read (``shard_nodes``' ``lookup`` nodes on ``hbm``, i.e. device memory,
    or host memory on CPU; UVM and key-value lookups have rates of their own) and the shard's
    weight bytes (``shard_rows x shard_cols x elem_bytes``)."""
    if ctx.profile.cold_row_s <= 0:
        return 0.0
    ids = sum(n.quantity for n in shard_nodes(spec, cand, ctx.world_size, ctx.local_world_size)
              if n.kind == "lookup" and n.resource == "hbm")
    return cold_row_seconds(ids, cand.shard_rows * cand.shard_cols * spec.elem_bytes, ctx.profile)


#: The columns, in load-vector order. New columns go at the end (indices stay stable).
LOAD_COLUMNS: Tuple[LoadColumn, ...] = (
    LoadColumn("fwd_s", "time", ("lookup",), group_cost="lookup_overhead_s",
               doc="embedding lookups and forward host work"),
    LoadColumn("bwd_s", "time", ("backward_update",), group_cost="lookup_overhead_s",
               doc="TBE backward with the fused optimizer update, backward host work"),
    LoadColumn("uvm_s", "time", ("uvm_fetch",), doc="UVM-cache misses (what prefetch hides)"),
    LoadColumn("in_intra_bytes", "link", ("input_dist",), bandwidth="intra_host_bw",
               doc="ids sent/received within the host"),
    LoadColumn("in_inter_bytes", "link", ("input_dist",), bandwidth="inter_host_bw",
               doc="ids sent/received across hosts"),
    LoadColumn("out_intra_bytes", "link", ("output_dist", "grad_dist"), bandwidth="intra_host_bw",
               doc="pooled embeddings (and their gradients) within the host"),
    LoadColumn("out_inter_bytes", "link", ("output_dist", "grad_dist"), bandwidth="inter_host_bw",
               doc="pooled embeddings (and their gradients) across hosts"),
    LoadColumn("device_mem_bytes", "memory", capacity="device", doc="device memory"),
    LoadColumn("host_mem_bytes", "memory", capacity="host", doc="host memory"),
    LoadColumn("cold_rows_s", "time", ("backward_update",), shard_load=cold_rows_load,
               doc="lookups of shards larger than the cache (cold_row_s; forward and backward, "
                   "in the backward's phase, where ~90% of it is measured)"),
    LoadColumn("out_stage_s", "time", ("output_dist", "grad_dist"),
               doc="a sequential stage of the output (and gradient) distribution: table-row-wise's "
                   "intra-host reduce-scatter (all-gather), which runs before its cross-host "
                   "all-to-all, so its seconds add to the link phase (priced at intra_host_bw and "
                   "reduce_scatter_factor, full precision)"),
)

#: The comm precision that scales a link phase's bytes (``None``: ids, always full size).
PHASE_PRECISION: Mapping[str, Optional[str]] = {
    "input_dist": None, "output_dist": "fwd", "grad_dist": "bwd",
}


@attrs.frozen(eq=False)
class LoadLayout:
    """Index views of a column tuple (:func:`layout` builds and caches it)."""

    columns: Tuple[LoadColumn, ...]
    index: Mapping[str, int]
    time: Tuple[int, ...]  # every column the step time reads (compute and link), in order
    compute: Tuple[int, ...]
    link: Tuple[int, ...]
    memory: Tuple[int, ...]
    phase_columns: Mapping[str, Tuple[int, ...]]  # phase -> compute columns adding to it
    #: link groups in first-appearance order: (the phases they carry, their columns)
    link_groups: Tuple[Tuple[Tuple[str, ...], Tuple[int, ...]], ...]
    #: bandwidth fields in first-appearance order, with their link columns
    bandwidths: Tuple[Tuple[str, Tuple[int, ...]], ...]
    #: link phase -> the phases of its link group
    link_group_of: Mapping[str, Tuple[str, ...]]

    @property
    def width(self) -> int:
        return len(self.columns)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def capacity_column(self, which: str) -> int:
        """The memory column limited by the ``device`` or ``host`` capacity."""
        for j in self.memory:
            if self.columns[j].capacity == which:
                return j
        raise ValueError(f"no memory column with capacity {which!r}")

    def link_group(self, phase: str) -> Optional[Tuple[str, ...]]:
        """The link group (its phases) carrying ``phase``; None for a phase without link bytes."""
        return self.link_group_of.get(phase)

    def zeros(self) -> np.ndarray:
        return np.zeros(self.width)

    def group_costs(self, profile: Any) -> np.ndarray:
        """Per column, the seconds a rank pays once per TBE group it holds."""
        out = np.zeros(self.width)
        for j, c in enumerate(self.columns):
            if c.group_cost:
                out[j] = getattr(profile, c.group_cost)
        return out

    def scale(self, profile: Any, unit: float = 1.0) -> np.ndarray:
        """Per column, ``unit`` per second: ``unit`` for time (and memory) columns, ``unit /
        bandwidth`` for link columns (bytes -> seconds in ``unit``)."""
        out = np.full(self.width, float(unit))
        for j in self.link:
            out[j] = unit / getattr(profile, self.columns[j].bandwidth)
        return out

    def balance_weights(self, profile: Any) -> np.ndarray:
        """Seconds per unit of each column counted once per phase it feeds (a link column of the
        output counts for the output and the gradient); 0 for memory columns. The placement's
        balance measure."""
        w = np.zeros(self.width)
        for j in self.compute:
            w[j] = float(len(self.columns[j].phases))
        for j in self.link:
            c = self.columns[j]
            w[j] = len(c.phases) / getattr(profile, c.bandwidth)
        return w

    def rank_seconds(self, rows: np.ndarray, profile: Any) -> np.ndarray:
        """A scalar load per rank (seconds; rows x columns, or one vector): the compute columns
        plus each link column once over its bandwidth (the tie-break between ranks)."""
        out: Any = None
        for j in self.compute:
            out = rows[..., j] if out is None else out + rows[..., j]
        for bw, cols in self.bandwidths:
            s = rows[..., cols[0]]
            for j in cols[1:]:
                s = s + rows[..., j]
            s = s / getattr(profile, bw)
            out = s if out is None else out + s
        return out


def _build(columns: Tuple[LoadColumn, ...]) -> LoadLayout:
    names = [c.name for c in columns]
    if len(set(names)) != len(names):
        raise ValueError(f"load column names repeat: {names}")
    compute = tuple(j for j, c in enumerate(columns) if c.kind == "time")
    link = tuple(j for j, c in enumerate(columns) if c.kind == "link")
    phase_columns: Dict[str, Tuple[int, ...]] = {}
    for j in compute:
        for ph in columns[j].phases:
            phase_columns[ph] = phase_columns.get(ph, ()) + (j,)
    groups: Dict[Tuple[str, ...], Tuple[int, ...]] = {}
    bws: Dict[str, Tuple[int, ...]] = {}
    for j in link:
        c = columns[j]
        groups[c.phases] = groups.get(c.phases, ()) + (j,)
        bws[c.bandwidth] = bws.get(c.bandwidth, ()) + (j,)
    seen = [p for g in groups for p in g]
    if len(set(seen)) != len(seen):
        raise ValueError(f"a link phase is carried by two link groups: {list(groups)}")
    return LoadLayout(
        columns=columns, index={n: j for j, n in enumerate(names)},
        time=tuple(j for j, c in enumerate(columns) if c.kind != "memory"), compute=compute, link=link,
        memory=tuple(j for j, c in enumerate(columns) if c.kind == "memory"),
        phase_columns=phase_columns, link_groups=tuple(groups.items()), bandwidths=tuple(bws.items()),
        link_group_of={p: g for g in groups for p in g},
    )


_cache: Dict[str, Any] = {"columns": None, "layout": None}


def layout() -> LoadLayout:
    """The :class:`LoadLayout` of the current :data:`LOAD_COLUMNS` (rebuilt when it changes)."""
    cols = LOAD_COLUMNS
    if _cache["columns"] is not cols:
        _cache["layout"] = _build(cols)
        _cache["columns"] = cols
    return _cache["layout"]
