"""Cost equations: sparse-path nodes -> per-rank resource loads -> step time.

Everything here is a pure function of immutable inputs. The equations (also in docs/cost_model.md):

* a lookup of ``n`` rows of ``w`` bytes on resource ``m``:
  ``t = n * (ceil(w / g) * g + id_overhead) / bw(m)``, plus ``lookup_overhead_s`` once per
  rank and TBE group (TorchRec fuses all tables of one sharding type and kernel on a rank into
  one kernel call; the evaluator charges it when a rank's first table of a group arrives) (``g`` the memory transaction
  size, ``id_overhead`` the width-independent per-id cost);
  UVM-caching kernels split rows into hits (``bw = hbm_bw``) and misses (``bw = uvm_bw``);
  the miss part is what a prefetch pipeline can hide.
* backward + fused optimizer update: ``n * (bwd_factor * ceil(w/g) g + bwd_id_overhead) / bw
  + d * bwd_row_s``, with ``d`` the distinct rows the shard's fused optimizer updates in the step
  (from the observed ids, :meth:`~torchrec_sparselift.semantics.tables.TableSpec.distinct_rows`).
* a collective phase (input_dist, output_dist, grad_dist) is as slow as its slowest rank
  (a row-wise pooled output's reduce-scatter / all-gather bytes count ``reduce_scatter_factor`` times):
  ``t = latency * calls + max(max_r intra_r / intra_bw, max_r inter_r / inter_bw)``,
  where each rank's bytes are what its shards send/receive plus its share of its peers' traffic,
  and ``calls`` the collectives the phase issues (:func:`collective_calls`): one per sharding group
  for the output and gradient, ``2 * groups + 1`` for the input (lengths and values per group, one
  splits exchange shared by all groups; ``3 * groups`` under ``TrainPipelineBase``, which does not
  fuse the splits exchanges).
* data-parallel tables and the dense model all-reduce their gradients:
  ``t = latency + 2 (n-1)/n * bytes / allreduce_bw`` over the ``n`` ranks DDP spans: the world,
  also for a 2D plan whose tables are priced over one sharding group (``CostContext.allreduce_world_size``).
* dense compute, forward (the backward is twice it): ``B * (flops / dense_flops + interaction_flops /
  interaction_flops_rate + activation_bytes / dense_mem_bw)`` per rank (:func:`dense_fwd_s`); its
  part independent of the embeddings (:func:`dense_fwd_indep_s`) is a phase of its own for the
  ``overlap`` pipeline.
* the pipeline kind decides what overlaps (:mod:`torchrec_sparselift.cost.pipelines`, the one
  description the step total, the LP rows, the explain timeline and the report derive from).
* the per-rank load columns (what a shard puts on its rank, which phase each feeds, the link
  bandwidths, the memory limits) are declared once, in :mod:`torchrec_sparselift.cost.terms`;
  :func:`phase_table` sums each phase from them, and every solver's rows come from the same
  declaration (:mod:`torchrec_sparselift.search.equation`).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.cost import terms as _terms
from torchrec_sparselift.cost.terms import PHASE_PRECISION
from torchrec_sparselift.cost.pipelines import (
    COMPUTE_PHASES,
    LINK_PHASES,
    PHASE_NAMES,
    PHASES,
    PIPELINES,
    pipeline_kind,
    step_factor,
    step_totals,
)
from torchrec_sparselift.semantics.dense import DenseWork  # re-exported: the cost layer prices it
from torchrec_sparselift.semantics.graph import HOST_WORK_KINDS, Candidate, Node, shard_memory, shard_nodes
from torchrec_sparselift.semantics.tables import TableSpec
from torchrec_sparselift.vocabulary import BASE, COMM_PRECISION_BYTES, DATA_PARALLEL, comm_precision

__all__ = [
    "COMPONENTS",
    "K",
    "FWD", "BWD", "UVM", "IN_INTRA", "IN_INTER", "OUT_INTRA", "OUT_INTER", "DEV_MEM", "HOST_MEM",
    "PIPELINES",
    "PRECISION_BYTES",
    "DenseWork",
    "CostContext",
    "ShardCost",
    "StepTime",
    "SHARED_LINK_BANDWIDTH",
    "shared_link_columns",
    "host_mean_rows",
    "piece_loads",
    "shard_cost",
    "input_kernel_column",
    "rewrite_wire",
    "step_time",
    "step_total_batch",
    "phase_times",
    "phase_table",
    "rank_times",
    "node_time",
    "dp_optimizer_s",
    "dense_fwd_s",
    "dense_fwd_indep_s",
    "phase_constants",
    "collective_calls",
    "collective_call_form",
    "lossy_byte_s",
    "lossy_column_rates",
    "INPUT_DIST_CALLS_PER_GROUP",
    "INPUT_DIST_SHARED_CALLS",
]

# The load columns are declared once, in cost.terms.LOAD_COLUMNS; these names index the base ones
# (a column added there is read through cost.terms.layout(), which every consumer uses).
COMPONENTS = tuple(c.name for c in _terms.LOAD_COLUMNS)
_IDX = _terms.layout().index
FWD, BWD, UVM = _IDX["fwd_s"], _IDX["bwd_s"], _IDX["uvm_s"]
IN_INTRA, IN_INTER = _IDX["in_intra_bytes"], _IDX["in_inter_bytes"]
_STAGE = _IDX["out_stage_s"]
OUT_INTRA, OUT_INTER = _IDX["out_intra_bytes"], _IDX["out_inter_bytes"]
DEV_MEM, HOST_MEM = _IDX["device_mem_bytes"], _IDX["host_mem_bytes"]
K = len(COMPONENTS)
TIME_COLUMNS = _terms.layout().time

PRECISION_BYTES = COMM_PRECISION_BYTES  # bytes per element on the wire (the vocabulary's registry)
#: Collectives TorchRec's input distribution issues (``KJTAllToAll``, counted on real steps in
#: tests/test_comm_semantics.py): one all-to-all per KJT tensor (lengths, values) per sharding group,
#: after a splits all-to-all (per-destination counts). ``TrainPipelineSparseDist`` and its
#: subclasses fuse the groups' splits exchanges into one call per step
#: (``PipelineKind.fused_input_splits``); without it each group runs its own. A weighted KJT's
#: weights would add a third tensor per group; the tables here carry none.
INPUT_DIST_CALLS_PER_GROUP = 2
INPUT_DIST_SHARED_CALLS = 1


def lossy_byte_s(profile: HardwareProfile, precision: str, bandwidth: float) -> float:
    """Seconds per fp32 byte of a link phase's payload (the graph's link bytes: sent plus
    received) that a rank pays at ``precision`` beyond the phase's scaled link seconds
    ``(o/4) bytes / bandwidth``: 0 at fp32; for a lossy precision (``o < 4`` bytes per element)
    the quantized-comm codec (``codec_byte_s``: it encodes every byte sent and decodes every byte
    received) plus the full-precision host work that the scaling wrongly shrank,
    ``(1 - o/4) a2a_host_byte_s`` (never more than the link's whole per-byte time,
    ``1 / bandwidth``). So a lossy phase costs

        (o/4) (bytes/bandwidth - host bytes) + host bytes + codec bytes

    where the wire's share shrinks and the rank's own work does not. :func:`phase_table` adds it per
    link column, and every solver's rows write it on the columns' ``z``
    (``search.equation.phase_forms``)."""
    o = PRECISION_BYTES[precision]
    if o >= 4:
        return 0.0
    host = min(float(profile.a2a_host_byte_s), 1.0 / float(bandwidth))
    return float(profile.codec_byte_s) + (1.0 - o / 4.0) * host


def lossy_column_rates(profile: HardwareProfile, precision: str) -> Dict[int, float]:
    """:func:`lossy_byte_s` of each link column (``cost.terms`` index -> seconds per byte of that
    column at its bandwidth), the columns that pay none left out (all of them at fp32): what
    :func:`phase_table` adds to a lossy link phase and ``search.equation.lossy_per_z`` writes on
    the columns' ``z``."""
    if PRECISION_BYTES[precision] >= 4:
        return {}
    lay = _terms.layout()
    rates = {j: lossy_byte_s(profile, precision, getattr(profile, lay.columns[j].bandwidth)) for j in lay.link}
    return {j: r for j, r in rates.items() if r > 0}


def collective_call_form(phase: str, fused_splits: bool = True) -> Tuple[int, int]:
    """``(per_group, once)``: link phase ``phase`` issues ``per_group`` collective calls per
    sharding group plus ``once`` more per step when any group exists (the form the LP/MILP rows
    write, ``search.equation.phase_forms``). ``fused_splits``: the train pipeline fuses the input's
    splits exchanges into one per step (``PipelineKind.fused_input_splits``); otherwise each group
    runs its own."""
    if phase == "input_dist":
        if fused_splits:
            return INPUT_DIST_CALLS_PER_GROUP, INPUT_DIST_SHARED_CALLS
        return INPUT_DIST_CALLS_PER_GROUP + INPUT_DIST_SHARED_CALLS, 0
    if phase in ("output_dist", "grad_dist"):
        return 1, 0
    raise ValueError(f"collective_calls: {phase!r} is not a link phase; choose input_dist, output_dist or grad_dist")


def collective_calls(phase: str, groups: int, fused_splits: bool = True) -> int:
    """Collective calls link phase ``phase`` issues in one step of a plan with ``groups`` sharding
    groups (non-data-parallel sharding types): the number of latencies the phase pays
    (:func:`collective_call_form`)."""
    if groups < 0:
        raise ValueError(f"collective_calls: groups must be >= 0, got {groups}")
    per_group, once = collective_call_form(phase, fused_splits)
    return per_group * groups + (once if groups > 0 else 0)


_COMPUTE_COLS = [PHASE_NAMES.index(p) for p in COMPUTE_PHASES]
_COLLECTIVE = frozenset(p.name for p in PHASES if p.kind == "collective")
_LINK_COLS = [PHASE_NAMES.index(p) for p in LINK_PHASES]


@attrs.frozen
class CostContext:
    """What every cost equation needs besides the table: hardware, scale, dense part."""

    profile: HardwareProfile
    world_size: int
    local_world_size: int
    batch_size: int
    dense: DenseWork = DenseWork()
    #: Ranks the gradient all-reduce of the dense part and the data-parallel tables spans (DDP's
    #: process group); None: ``world_size``. A 2D plan's tables are priced over one sharding
    #: group (``world_size`` = the group), but ``DMPCollection`` wraps the dense part in DDP over
    #: the global process group: the planner sets the whole world here.
    allreduce_world_size: Optional[int] = None

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.allreduce_world_size is not None and self.allreduce_world_size < self.world_size:
            raise ValueError(f"allreduce_world_size must be None or >= world_size {self.world_size}, "
                             f"got {self.allreduce_world_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.local_world_size < 1 or self.world_size % min(self.local_world_size, self.world_size):
            raise ValueError(
                f"world_size {self.world_size} must be a multiple of local_world_size "
                f"{self.local_world_size}"
            )

    @property
    def ranks_per_host(self) -> int:
        """Ranks on each host (``local_world_size``, at most the world)."""
        return min(self.local_world_size, self.world_size)

    @property
    def num_hosts(self) -> int:
        return max(1, self.world_size // self.ranks_per_host)

    @property
    def allreduce_ranks(self) -> int:
        """Ranks the gradient all-reduce spans (``allreduce_world_size`` or the world)."""
        return self.allreduce_world_size or self.world_size

    def allreduce_s_per_byte(self) -> float:
        """Seconds per gradient byte of the ring all-reduce, ``2 (n-1)/n / allreduce_bw`` over
        :attr:`allreduce_ranks` ranks (0 on one rank)."""
        n = self.allreduce_ranks
        return 0.0 if n <= 1 else 2 * (n - 1) / n / self.profile.allreduce_bw


#: The link a host's ranks share when ``HardwareProfile.host_link_shared``: the profile field of
#: the load columns whose bytes cross it.
SHARED_LINK_BANDWIDTH = "inter_host_bw"


def shared_link_columns(ctx: CostContext) -> Tuple[int, ...]:
    """The load columns a host's ranks share (:data:`SHARED_LINK_BANDWIDTH`'s link columns) where
    ``ctx.profile.host_link_shared`` and the job has several hosts of several ranks; empty
    otherwise (every rank prices its own bytes).

    On a shared link the bytes that cross it are the host's, however they are spread over its
    ranks (measured on the testbed, 2 hosts x 2 ranks at 1 Gbit/s: one rank sending 2 MiB to each
    rank of the other host took 36 ms, two ranks sending 1 MiB to each 36 ms, two sending 2 MiB to
    each 74 ms). ``inter_host_bw``
    is the per-rank rate with every rank of the host sending, so a rank's shared columns are
    priced at its host's mean (:func:`host_mean_rows`): equal to the per-rank price when the host's
    ranks carry equal bytes, and no gain from splitting a table over ranks of one host."""
    L = ctx.ranks_per_host
    if not getattr(ctx.profile, "host_link_shared", False) or ctx.num_hosts < 2 or L < 2:
        return ()
    lay = _terms.layout()
    return tuple(j for j, c in enumerate(lay.columns) if c.kind == "link" and c.bandwidth == SHARED_LINK_BANDWIDTH)


def host_mean_rows(loads: np.ndarray, ctx: CostContext) -> np.ndarray:
    """Per-rank loads (``W x K``, each rank's own bytes) with the shared link columns
    (:func:`shared_link_columns`) replaced by the mean over the rank's host (ranks
    ``h*L .. h*L+L-1``); a copy, or ``loads`` itself when nothing is shared."""
    cols = list(shared_link_columns(ctx))
    if not cols:
        return loads
    L = ctx.ranks_per_host
    out = np.array(loads, dtype=float, copy=True)
    means = out[:, cols].reshape(-1, L, len(cols)).mean(axis=1)
    out[:, cols] = np.repeat(means, L, axis=0)
    return out


def piece_loads(owner: np.ndarray, ctx: CostContext) -> np.ndarray:
    """Owner loads (options x columns) as one shard raises the row of the rank holding it: its
    own load, except in the shared link columns (:func:`shared_link_columns`), where the rank's
    row is its host's mean and gains ``owner / L`` (as every other rank of the host does). The
    evaluator's per-shard increment and the bounds' "largest piece" rows."""
    cols = list(shared_link_columns(ctx))
    if not cols:
        return owner
    out = np.array(owner, dtype=float, copy=True)
    out[..., cols] /= ctx.ranks_per_host
    return out


@attrs.frozen
class ShardCost:
    """Per-shard loads. ``owner`` lands on the shard's rank, ``peers`` on every rank,
    ``allreduce_bytes`` joins the gradient all-reduce."""

    owner: np.ndarray = attrs.field(eq=False)
    peers: np.ndarray = attrs.field(eq=False)
    allreduce_bytes: float = 0.0
    dense_update_s: float = 0.0


def _rows_time(node: Node, profile: HardwareProfile) -> float:
    """Seconds of a lookup or backward node's row traffic on its memory resource."""
    rb = profile.row_bytes(node.width_bytes, 1)
    if node.kind == "backward_update":
        moved = node.quantity * (profile.bwd_factor * rb + profile.bwd_id_overhead_bytes)
    else:
        moved = node.quantity * (rb + profile.id_overhead_bytes)
    if node.resource == "hbm":
        return moved / profile.hbm_bw
    if node.resource == "uvm":
        return moved / profile.uvm_bw
    if node.resource == "uvm_cached":
        h = profile.cache_hit_rate
        return moved * (h / profile.hbm_bw + (1 - h) / profile.uvm_bw)
    if node.resource in ("kv_dram", "kv_ssd"):
        # key-value lookup: L1 (HBM) hits, then DRAM (the store, or the SSD table's L2
        # cache), then the SSD store
        h1 = profile.cache_hit_rate if node.l1_cached else 0.0
        if node.resource == "kv_dram":
            miss = 1.0 / profile.uvm_bw
        else:
            h2 = profile.cache_hit_rate if node.l2_cached else 0.0
            miss = h2 / profile.uvm_bw + (1 - h2) / profile.ssd_bw
        return moved * (h1 / profile.hbm_bw + (1 - h1) * miss)
    return moved / profile.ddr_bw


def node_time(node: Node, profile: HardwareProfile) -> float:
    """Seconds a compute node takes on its resource (links are handled per phase).

    A lookup of ``n`` rows moves ``n * (row_bytes(w) + id_overhead)``; a backward + update
    moves ``n * (bwd_factor * row_bytes(w) + bwd_id_overhead)`` and pays ``bwd_row_s`` per
    distinct row its fused optimizer updates (``node.distinct_rows``).
    """
    if node.unit == "rows":
        t = _rows_time(node, profile)
        if node.kind == "backward_update" and node.distinct_rows:
            t += node.distinct_rows * profile.bwd_row_s
        return t
    if node.resource == "hbm":
        return node.quantity / profile.hbm_bw
    if node.resource == "ddr":
        return node.quantity / profile.ddr_bw
    if node.resource == "host":  # host work per feature, table or id (fitted from real steps)
        if node.unit == "features":
            return node.quantity * profile.feature_overhead_s
        if node.unit == "ids":
            return node.quantity * profile.bucketize_id_s
        if node.unit == "tables":
            per = profile.dp_table_overhead_s if node.kind == "dp_table_work" else profile.table_overhead_s
            return node.quantity * per
    if node.resource == "dense_update":  # dense optimizer pass over a data-parallel replica
        return node.quantity / profile.rate("dense_update_bw")
    raise ValueError(f"node {node.kind} on {node.resource} has no compute time")


def dp_optimizer_s(specs, cands, ctx: CostContext) -> float:
    """Seconds per step of the data-parallel tables' dense optimizer work (the same on every rank):
    every backward compute node of a data-parallel shard but its embedding-rows backward, i.e. the
    dense optimizer pass over the replica and the per-table dense-gradient work. The step time has
    it inside ``backward_update``; the runtime measures it in ``optimizer.step``
    (:mod:`torchrec_sparselift.calibration.attribution`'s ``dense_optimizer``)."""
    total = 0.0
    for spec, cand in zip(specs, cands):
        if cand.sharding_type != DATA_PARALLEL:
            continue
        for node in shard_nodes(spec, cand, ctx.world_size, ctx.local_world_size):
            if node.backward and node.kind not in ("grad_allreduce", "grad_dist") and node.unit != "rows":
                total += node_time(node, ctx.profile)
    return total


def _rs_factor(node: Node, p: HardwareProfile) -> float:
    """All-to-all bytes one byte of ``node``'s collective costs (``HardwareProfile.rs_factor`` of
    its link for a reduce-scatter or all-gather, 1 for an all-to-all)."""
    return p.rs_factor(node.resource == "inter_host") if node.collective != "all_to_all" else 1.0


def shard_cost(spec: TableSpec, cand: Candidate, ctx: CostContext) -> ShardCost:
    """Fold one shard's sparse-path nodes into per-rank load vectors (fp32 comm bytes)."""
    p = ctx.profile
    lay = _terms.layout()
    owner = lay.zeros()
    peers = lay.zeros()
    allreduce = 0.0
    for node in shard_nodes(spec, cand, ctx.world_size, ctx.local_world_size):
        vec = owner if node.scope == "owner" else peers
        if node.kind in ("lookup", "backward_update"):
            t = node_time(node, p)
            col = BWD if node.backward else FWD
            vec[col] += t
            if node.resource == "uvm_cached" and node.kind == "lookup":
                # the miss traffic is what a prefetch pipeline moves ahead of time
                miss = node.quantity * p.row_bytes(node.width_bytes, 1) * (1 - p.cache_hit_rate)
                vec[FWD] -= miss / p.uvm_bw
                vec[UVM] += miss / p.uvm_bw
        elif node.kind in HOST_WORK_KINDS:
            vec[BWD if node.backward else FWD] += node_time(node, p)
        elif node.kind == "grad_allreduce":
            allreduce += node.quantity
        elif node.kind == "output_dist" and node.stage:
            # a collective of its own before the next (table-row-wise's intra-host reduce-scatter):
            # seconds in out_stage_s, which adds to the output and the gradient phases
            bw = p.intra_host_bw if node.resource == "intra_host" else p.inter_host_bw
            vec = owner if node.scope == "owner" else peers
            vec[_STAGE] += node.quantity * _rs_factor(node, p) / bw
        elif node.kind in ("input_dist", "output_dist"):
            if node.kind == "input_dist":
                col = IN_INTRA if node.resource == "intra_host" else IN_INTER
            else:
                col = OUT_INTRA if node.resource == "intra_host" else OUT_INTER
            # a reduce-scatter's byte costs reduce_scatter_factor all-to-all bytes (the link column
            # holds all-to-all-equivalent bytes; the graph's own quantities stay the bytes sent)
            q = node.quantity * _rs_factor(node, p)
            vec[col] += q
            if node.scope == "others":  # every rank but the owner: all ranks, less the owner's share
                owner[col] -= q
        # grad_dist mirrors output_dist byte for byte (a reduce-scatter's all-gather at the same
        # factor); step_time scales it by bwd precision
    dev, host = shard_memory(spec, cand, ctx.world_size)
    owner[lay.capacity_column("device")] += dev
    owner[lay.capacity_column("host")] += host
    for j, column in enumerate(lay.columns):  # terms priced per shard (cost.terms.LoadColumn.shard_load)
        if column.shard_load is not None:
            owner[j] += column.shard_load(spec, cand, ctx)
    return ShardCost(owner=owner, peers=peers, allreduce_bytes=allreduce)


def input_kernel_column(ctx: CostContext) -> int:
    """The input-dist load column that carries the dedup kernels' seconds (as bytes at its
    bandwidth): the cross-host one where the ranks span hosts, else the intra-host one (the link
    whose bandwidth prices dedup, ``cost.wire_ids.choose_for_request``)."""
    return IN_INTER if ctx.world_size > min(ctx.local_world_size, ctx.world_size) else IN_INTRA


def rewrite_wire(cost: ShardCost, factor: float, kernel_s: float, num_shards: int, ctx: CostContext) -> ShardCost:
    """One option's shard cost with the ids-on-the-wire rewrites (``cost.wire_ids.table_wire``):
    its input-dist bytes (``in_intra_bytes``, ``in_inter_bytes``, owner and peers) times
    ``factor``, and ``kernel_s`` seconds per rank (the dedup kernels every rank runs before the
    input all-to-all) on :func:`input_kernel_column` as bytes at its bandwidth, spread over the
    ``num_shards`` shards' peers terms (every rank carries ``kernel_s`` once the table is
    placed). The input-dist phase is then ``latency + max(in_intra / intra_bw, in_inter / inter_bw)``
    over these columns, in the evaluator and in every solver's rows alike."""
    if not (0.0 <= factor and np.isfinite(factor)) or not (kernel_s >= 0 and np.isfinite(kernel_s)):
        raise ValueError(f"rewrite_wire: factor must be finite >= 0 and kernel_s finite >= 0, got {factor!r}, "
                         f"{kernel_s!r}")
    if factor == 1.0 and kernel_s == 0.0:
        return cost
    owner, peers = cost.owner.copy(), cost.peers.copy()
    for j in (IN_INTRA, IN_INTER):
        owner[j] *= factor
        peers[j] *= factor
    if kernel_s > 0:
        col = input_kernel_column(ctx)
        bw = float(getattr(ctx.profile, _terms.layout().columns[col].bandwidth))
        peers[col] += kernel_s * bw / max(int(num_shards), 1)
    return attrs.evolve(cost, owner=owner, peers=peers)


@attrs.frozen
class StepTime:
    """Predicted steady-state step time and where it goes (seconds)."""

    total_s: float
    phases: Mapping[str, float]
    compute_s: float
    exposed_comm_s: float
    overlapped_s: float
    pipeline: str

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={v * 1e3:.3f}ms" for k, v in self.phases.items() if v)
        return f"StepTime({self.total_s * 1e3:.3f} ms, {self.pipeline}: {parts})"


def _allreduce_s(bytes_: float, ctx: CostContext) -> float:
    if ctx.allreduce_ranks <= 1 or bytes_ <= 0:
        return 0.0
    return ctx.profile.collective_latency_s + bytes_ * ctx.allreduce_s_per_byte()


def rank_times(loads: np.ndarray, ctx: CostContext, fwd_precision: str = defaults.COMM_PRECISION,
               bwd_precision: str = defaults.COMM_PRECISION) -> Tuple[np.ndarray, np.ndarray]:
    """Each rank's compute seconds and communication seconds (the compute and link phases of
    :data:`~torchrec_sparselift.cost.pipelines.PHASES` on that rank's own loads, rows of
    ``loads``; no collective latency). The per-rank report's numbers."""
    table = phase_table(loads, 0.0, 0, ctx, fwd_precision, bwd_precision)
    return table[:, _COMPUTE_COLS].sum(axis=1), table[:, _LINK_COLS].sum(axis=1)


def phase_constants(ctx: CostContext) -> Dict[str, float]:
    """The phases' seconds that no plan changes: the dense forward and backward (twice the
    forward, :func:`dense_fwd_s`) and the fixed per-step overhead. The step equation adds them to
    the phases' plan-dependent parts (:func:`phase_table`; ``search.equation.FixedTerms`` in
    milliseconds)."""
    dense_fwd = dense_fwd_s(ctx)
    indep = min(dense_fwd_indep_s(ctx), dense_fwd)
    return {"dense_fwd": dense_fwd, "dense_bwd": 2 * dense_fwd, "step_overhead": ctx.profile.step_overhead_s,
            "dense_fwd_indep": indep, "dense_fwd_rest": dense_fwd - indep,
            "dense_bwd_rest": 2 * (dense_fwd - indep), "dense_bwd_indep": 2 * indep}


def dense_fwd_indep_s(ctx: CostContext) -> float:
    """Seconds of the part of the dense forward independent of the embeddings (DLRM's bottom
    MLP; ``DenseWork.indep_*``), priced like :func:`dense_fwd_s`; its backward costs twice it.
    The ``overlap`` pipeline runs it beside the output all-to-all (and its backward beside the
    gradient all-to-all); every other kind uses only the whole ``dense_fwd``/``dense_bwd``."""
    p, d = ctx.profile, ctx.dense
    return ctx.batch_size * (d.indep_fwd_flops_per_sample / p.dense_flops
                             + d.indep_activation_bytes_per_sample / p.rate("dense_mem_bw"))


def dense_fwd_s(ctx: CostContext) -> float:
    """Seconds of the dense forward on one rank (the backward costs twice this): the weights'
    products at ``dense_flops``, the parameter-free interaction products at ``interaction_flops``,
    the activations written at ``dense_mem_bw``."""
    p, d = ctx.profile, ctx.dense
    return ctx.batch_size * (d.fwd_flops_per_sample / p.dense_flops
                             + d.interaction_flops_per_sample / p.rate("interaction_flops")
                             + d.activation_bytes_per_sample / p.rate("dense_mem_bw"))


def phase_table(
    colmax: np.ndarray,
    allreduce_bytes: float,
    comm_groups: int,
    ctx: CostContext,
    fwd_precision: str = defaults.COMM_PRECISION,
    bwd_precision: str = defaults.COMM_PRECISION,
    pipeline: str = defaults.PIPELINE,
) -> np.ndarray:
    """Seconds per phase for each row of ``colmax`` (per-column maxima over ranks, or one rank's
    loads): rows x :data:`~torchrec_sparselift.cost.pipelines.PHASE_NAMES` columns. ``pipeline``:
    the train pipeline kind, which decides how many splits exchanges the input pays
    (:func:`collective_calls`)."""
    p = ctx.profile
    fused = pipeline_kind(pipeline).fused_input_splits
    cm = np.atleast_2d(colmax)
    lay = _terms.layout()
    scale = {"fwd": PRECISION_BYTES[fwd_precision] / 4, "bwd": PRECISION_BYTES[bwd_precision] / 4}
    lossy = {"fwd": lossy_column_rates(p, fwd_precision), "bwd": lossy_column_rates(p, bwd_precision)}
    lat = p.collective_latency_s if ctx.world_size > 1 else 0.0
    link = {}  # link group -> its slowest column's seconds
    group_cols = dict(lay.link_groups)
    for phases, cols in lay.link_groups:
        v = cm[:, cols[0]] / getattr(p, lay.columns[cols[0]].bandwidth)
        for j in cols[1:]:
            v = np.maximum(v, cm[:, j] / getattr(p, lay.columns[j].bandwidth))
        link[phases] = v
    constants = phase_constants(ctx)
    seconds = {}
    for name in PHASE_NAMES:  # each phase: constant + latencies + link seconds + compute columns
        parts = []
        if name in constants:
            parts.append(constants[name])
        if name in _COLLECTIVE:  # the gradient all-reduce (dense and data-parallel bytes)
            parts.append(_allreduce_s(allreduce_bytes + ctx.dense.param_bytes, ctx))
        group = lay.link_group(name)
        if group is not None:
            prec = PHASE_PRECISION.get(name)
            parts.append(lat * collective_calls(name, comm_groups, fused))
            parts.append(link[group] if prec is None else scale[prec] * link[group])
            if prec is not None:  # what a lossy precision does not shrink, and its codec
                parts.extend(r * cm[:, j] for j, r in lossy[prec].items() if j in group_cols[group])
        parts.extend(cm[:, j] for j in lay.phase_columns.get(name, ()))
        total = parts[0] if parts else 0.0
        for x in parts[1:]:
            total = total + x
        seconds[name] = total
    table = np.empty((cm.shape[0], len(PHASE_NAMES)))
    for i, name in enumerate(PHASE_NAMES):
        table[:, i] = seconds[name]
    return table


def phase_times(
    colmax: np.ndarray,
    allreduce_bytes: float,
    comm_groups: int,
    ctx: CostContext,
    fwd_precision: str = defaults.COMM_PRECISION,
    bwd_precision: str = defaults.COMM_PRECISION,
    pipeline: str = defaults.PIPELINE,
) -> Dict[str, float]:
    """Seconds per phase from the per-column maxima over ranks (one vector)."""
    row = phase_table(np.asarray(colmax, dtype=float)[None, :], allreduce_bytes, comm_groups, ctx,
                      fwd_precision, bwd_precision, pipeline)[0]
    return {name: float(v) for name, v in zip(PHASE_NAMES, row)}


def step_time(
    colmax: np.ndarray,
    allreduce_bytes: float,
    comm_groups: int,
    ctx: CostContext,
    pipeline: str = defaults.PIPELINE,
    fwd_precision: str = defaults.COMM_PRECISION,
    bwd_precision: str = defaults.COMM_PRECISION,
) -> StepTime:
    """Steady-state step time under a pipeline kind's overlap rules
    (:data:`~torchrec_sparselift.cost.pipelines.PIPELINE_KINDS` says what overlaps with what).

    ``compute_s`` sums the compute phases, ``overlapped_s`` is what the pipeline hides relative
    to running everything in sequence (``base``), ``exposed_comm_s`` the communication left on
    the critical path. On hardware without compute/communication overlap
    (``profile.supports_overlap`` False, e.g. CPU gloo) every pipeline runs as ``base``, except
    ``overlap`` when the ranks span hosts (``cost.pipelines.effective_pipeline``).
    """
    table = phase_table(np.asarray(colmax, dtype=float)[None, :], allreduce_bytes, comm_groups, ctx,
                        fwd_precision, bwd_precision, pipeline)
    ph = {name: float(v) for name, v in zip(PHASE_NAMES, table[0])}
    overlap = getattr(ctx.profile, "supports_overlap", True)
    serial = float(step_totals(table, BASE, overlap)[0])
    compute = float(table[0, _COMPUTE_COLS].sum())
    total = float(step_totals(table, pipeline, overlap, ctx.num_hosts > 1)[0]) * step_factor(
        ctx.profile, pipeline, ctx.num_hosts > 1)
    comm = serial - compute
    exposed = max(0.0, total - compute)
    return StepTime(
        total_s=total,
        phases=ph,
        compute_s=compute,
        exposed_comm_s=float(min(exposed, comm)),
        overlapped_s=float(max(0.0, serial - total)),
        pipeline=pipeline,
    )


def describe_precisions(fwd: str, bwd: str) -> Tuple[str, str]:
    for p in (fwd, bwd):
        comm_precision(p)  # ValueError naming the choices
    return fwd, bwd


def step_total_batch(
    colmax: np.ndarray,
    allreduce_bytes: float,
    comm_groups: int,
    ctx: CostContext,
    pipeline: str = defaults.PIPELINE,
    fwd_precision: str = defaults.COMM_PRECISION,
    bwd_precision: str = defaults.COMM_PRECISION,
) -> np.ndarray:
    """:func:`step_time`'s total for many column-maximum vectors at once (rows of ``colmax``):
    the pipeline's composition (:mod:`~torchrec_sparselift.cost.pipelines`) evaluated on
    :func:`phase_table`.

    Used by the search to price every target rank of a move in one numpy pass; equal to
    ``step_time(row, ...).total_s`` for each row (tested).
    """
    table = phase_table(colmax, allreduce_bytes, comm_groups, ctx, fwd_precision, bwd_precision, pipeline)
    return step_total_of_table(table, ctx, pipeline)


def step_total_of_table(table: np.ndarray, ctx: CostContext, pipeline: str = defaults.PIPELINE) -> np.ndarray:
    """:func:`step_total_batch` of a :func:`phase_table` already built under ``pipeline``: the
    pipeline's composition times its measured step factor, per row."""
    return step_totals(table, pipeline, getattr(ctx.profile, "supports_overlap", True), ctx.num_hosts > 1
                       ) * step_factor(ctx.profile, pipeline, ctx.num_hosts > 1)
