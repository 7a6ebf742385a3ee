"""The planning problem as data: tables, their candidate shardings, per-shard costs, limits.

Like ``scipy.optimize.milp``'s inputs, a :class:`PlanningProblem` is a value; solvers
(:mod:`.solve`) take it and return a :class:`~torchrec_sparselift.search.solve.SearchResult`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.model import (
    DEV_MEM,
    HOST_MEM,
    CostContext,
    ShardCost,
    rewrite_wire,
    shard_cost,
)
from torchrec_sparselift.cost.wire_ids import WireRule, table_wire
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.semantics.graph import Candidate, candidate_for
from torchrec_sparselift.semantics.tables import TableSpec
from torchrec_sparselift.vocabulary import (
    COLUMN_SPLIT_TYPES,
    GRID_SHARD,
    MODELED_KERNELS,
    ROW_WISE,
    TABLE_COLUMN_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    UVM_KERNELS,
    comm_precision_pairs,
)

__all__ = ["PlanningProblem", "build_problem", "column_splits", "device_caps", "no_plan_kind",
           "storage_summary", "SUPPORTED_KERNELS"]

# Kernels whose sparse path the cost model describes (the key-value ones are offered only when a
# constraint names them, as in TorchRec). Others (key_value, dram_ssd_virtual_table) are rejected
# with a clear message.
SUPPORTED_KERNELS = MODELED_KERNELS


def device_caps(topology) -> Tuple[np.ndarray, np.ndarray]:
    """(device memory, host memory) per rank of a TorchRec ``Topology``. On CPU the device
    memory is DDR and host memory is the same DDR (fused CPU tables live there)."""
    if topology.compute_device == "cpu":
        dev = np.array([d.storage.ddr for d in topology.devices], dtype=float)
        return dev, dev.copy()
    return (np.array([d.storage.hbm for d in topology.devices], dtype=float),
            np.array([d.storage.ddr for d in topology.devices], dtype=float))


def no_plan_kind(lowest: Tuple[float, float], device_cap: np.ndarray, host_cap: np.ndarray,
                 compute_device: str) -> str:
    """TorchRec's classification of a failed plan: ``insufficient_storage`` when even the least
    memory any plan needs (``lowest``: device and host bytes summed over all shards of every
    table's smallest option) exceeds the cluster's capacity after the reservation, in some tier;
    ``strict_constraints`` when the cluster holds that much in total but the allowed sharding
    types, kernels and placements cannot use it (e.g. a table-wise-only table larger than any
    one rank). On CPU device and host memory are the same DDR."""
    dev, host = lowest
    if compute_device == "cpu":
        fits = dev + host <= float(np.sum(device_cap))
    else:
        fits = dev <= float(np.sum(device_cap)) and host <= float(np.sum(host_cap))
    return "strict_constraints" if fits else "insufficient_storage"


def column_splits(spec: TableSpec, world_size: int, compute_device: str) -> List[int]:
    """Column-wise shard counts worth trying: powers of two, equal widths, each width a
    multiple of 4 and at least ``min_partition`` (default 32 on GPU, 8 on CPU)."""
    dim = spec.embedding_dim
    min_w = spec.min_partition or (32 if compute_device != "cpu" else 8)
    out = []
    k = 2
    while k <= min(world_size, 64) and dim % k == 0 and dim // k >= min_w and (dim // k) % 4 == 0:
        out.append(k)
        k *= 2
    return out


@attrs.frozen
class PlanningProblem:
    """Everything a solver needs, as immutable data.

    ``candidates[t]`` lists candidate ids (indices into ``cands``/``costs``) for table ``t``.
    """

    specs: Tuple[TableSpec, ...]
    ctx: CostContext
    cands: Tuple[Candidate, ...]
    costs: Tuple[ShardCost, ...] = attrs.field(eq=False)
    candidates: Tuple[Tuple[int, ...], ...]
    device_cap: np.ndarray = attrs.field(eq=False)
    host_cap: np.ndarray = attrs.field(eq=False)
    pipelines: Tuple[str, ...] = (defaults.PIPELINE,)
    precisions: Tuple[Tuple[str, str], ...] = comm_precision_pairs()
    #: (device, host) bytes that every plan needs at least: per table, its smallest option's
    #: total over all shards, summed (what :func:`no_plan_kind` compares with the cluster).
    lowest_storage: Tuple[float, float] = (0.0, 0.0)
    #: the ids-on-the-wire rewrites ``costs`` price (``cost.wire_ids.WireRule``; None: int64 ids,
    #: no dedup, TorchRec's input dist); ``plain_costs`` then holds the options' costs without them
    wire: Optional[WireRule] = None
    plain_costs: Optional[Tuple[ShardCost, ...]] = attrs.field(default=None, eq=False, repr=False)
    #: per option, the features its wire terms deduplicate (empty without ``wire``)
    dedup_of: Tuple[Tuple[str, ...], ...] = attrs.field(default=(), eq=False, repr=False)
    #: the batch split the search prices under the ``overlap`` pipeline: the profile's per-chunk
    #: dense overhead (seconds); None where the split is not allowed for this problem
    split_overhead_s: Optional[float] = None

    @property
    def num_tables(self) -> int:
        return len(self.specs)

    def shard_time(self, c: int) -> float:
        """A scalar size for one shard of candidate ``c`` (seconds of its own work)."""
        return float(layout().rank_seconds(self.costs[c].owner, self.ctx.profile))


def build_problem(
    specs: Sequence[TableSpec],
    ctx: CostContext,
    device_cap: np.ndarray,
    host_cap: np.ndarray,
    pipelines: Sequence[str] = (defaults.PIPELINE,),
    precisions: Sequence[Tuple[str, str]] = comm_precision_pairs(),
    wire: Optional[WireRule] = None,
    split_overhead_s: Optional[float] = None,
) -> PlanningProblem:
    """Enumerate candidates for every table, price one shard of each, drop what cannot fit.

    ``wire``: the ids-on-the-wire rewrites to price in every option's input-dist columns
    (``cost.wire_ids.table_wire``, ``cost.model.rewrite_wire``); ``split_overhead_s``: the batch
    split's per-chunk overhead where the search may price the split (``search.solve.split_price``).

    Raises ``ValueError`` naming each table for which nothing fits, with how much memory its
    smallest option needs against the largest per-rank capacity.
    """
    W, L = ctx.world_size, min(ctx.local_world_size, ctx.world_size)
    device = ctx.profile.compute_device
    cands: List[Candidate] = []
    costs: List[ShardCost] = []
    plain: List[ShardCost] = []
    dedup_of: List[Tuple[str, ...]] = []
    wire = wire if wire is not None and wire.active else None
    per_table: List[Tuple[int, ...]] = []
    max_dev = float(np.max(device_cap)) if len(device_cap) else 0.0
    max_host = float(np.max(host_cap)) if len(host_cap) else 0.0
    misfits: List[str] = []
    lowest = [0.0, 0.0]
    min_dev = float(np.min(device_cap)) if len(device_cap) else 0.0
    for t, spec in enumerate(specs):
        ids: List[int] = []
        wires: dict = {}
        # UVM kernels trade speed for memory: only worth offering when the table is big
        # relative to a rank's memory (its whole fused table would take over 1/8 of a rank).
        uvm_useful = spec.weight_bytes > min_dev / 8
        smallest: Optional[Tuple[float, str]] = None
        least_dev = least_host = float("inf")
        for st in spec.sharding_types:
            for kernel in spec.kernels_for(st):
                if kernel not in SUPPORTED_KERNELS:
                    continue
                if kernel in UVM_KERNELS and not uvm_useful and any(
                    k == "fused" for k in spec.kernels_for(st)
                ):
                    continue  # dominated: same traffic, slower lookups, memory not needed
                if st == TABLE_ROW_WISE and W == L and ROW_WISE in spec.sharding_types:
                    continue  # one host: identical to row-wise
                if st in (GRID_SHARD, TABLE_COLUMN_WISE):
                    continue  # grid: not modelled yet; table-column-wise: column-wise covers it
                splits = [1]
                if st in COLUMN_SPLIT_TYPES:
                    splits = column_splits(spec, W, device)
                    if not splits:
                        if TABLE_WISE in spec.sharding_types:
                            continue
                        splits = [1]
                for k in splits:
                    cand = candidate_for(t, spec, st, kernel, W, L, k)
                    cost = shard_cost(spec, cand, ctx)
                    dev, host = cost.owner[DEV_MEM], cost.owner[HOST_MEM]
                    least_dev = min(least_dev, dev * cand.num_shards)
                    least_host = min(least_host, host * cand.num_shards)
                    # how far over the limits this option is, in the resource that is short
                    over = max(dev - max_dev, host - max_host)
                    if smallest is None or over < smallest[0]:
                        short_host = host - max_host > dev - max_dev
                        need = host if short_host else dev
                        have = max_host if short_host else max_dev
                        smallest = (over, f"{st}/{kernel}", need, have,
                                    "host memory" if short_host else "device memory")
                    if dev > max_dev or host > max_host:
                        continue
                    ids.append(len(cands))
                    cands.append(cand)
                    plain.append(cost)
                    if wire is not None:  # one price per (sharding type, shards): the kernels share it
                        key = (cand.sharding_type, cand.num_shards)
                        if key not in wires:
                            wires[key] = table_wire(wire, spec, cand.sharding_type, cand.num_shards)
                        tw = wires[key]
                        cost = rewrite_wire(cost, tw.factor, tw.kernel_s, cand.num_shards, ctx)
                        dedup_of.append(tw.dedup_features)
                    costs.append(cost)
        if not ids:
            if smallest is None:
                misfits.append(
                    f"{spec.fqn}: no supported sharding type/kernel among "
                    f"{list(spec.compute_kernels)} (the cost model covers kernels {SUPPORTED_KERNELS})"
                )
            else:
                _, option, need, have, resource = smallest
                misfits.append(
                    f"{spec.fqn} ({spec.num_embeddings} x {spec.embedding_dim}): its best-fitting "
                    f"shard ({option}) needs {need / 2**30:.2f} GiB of {resource}, a rank has "
                    f"{have / 2**30:.2f} GiB (short by {(need - have) / 2**30:.2f} GiB)"
                )
        per_table.append(tuple(ids))
        if np.isfinite(least_dev):
            lowest[0] += least_dev
            lowest[1] += least_host
    if misfits:
        raise _no_fit_error(misfits, no_plan_kind(tuple(lowest), device_cap, host_cap, device),
                            tuple(lowest), device_cap, host_cap, device)
    return PlanningProblem(
        specs=tuple(specs),
        ctx=ctx,
        cands=tuple(cands),
        costs=tuple(costs),
        candidates=tuple(per_table),
        device_cap=np.asarray(device_cap, dtype=float),
        host_cap=np.asarray(host_cap, dtype=float),
        pipelines=tuple(pipelines),
        precisions=tuple(precisions),
        lowest_storage=(lowest[0], lowest[1]),
        wire=wire,
        plain_costs=tuple(plain) if wire is not None else None,
        dedup_of=tuple(dedup_of),
        split_overhead_s=None if split_overhead_s is None else float(split_overhead_s),
    )


def storage_summary(lowest: Tuple[float, float], device_cap: np.ndarray, host_cap: np.ndarray,
                    compute_device: str) -> str:
    """One sentence: the least memory any plan needs against the cluster's, per tier."""
    if compute_device == "cpu":
        return (f"every plan needs at least {(lowest[0] + lowest[1]) / 2**30:.3f} GiB of memory; the "
                f"ranks have {float(np.sum(device_cap)) / 2**30:.3f} GiB in all after the reservation")
    return (f"every plan needs at least {lowest[0] / 2**30:.3f} GiB of device and "
            f"{lowest[1] / 2**30:.3f} GiB of host memory; the ranks have "
            f"{float(np.sum(device_cap)) / 2**30:.3f} GiB and {float(np.sum(host_cap)) / 2**30:.3f} GiB "
            "in all after the reservation")


def _no_fit_error(lines: List[str], kind: str, lowest: Tuple[float, float], device_cap: np.ndarray,
                  host_cap: np.ndarray, compute_device: str) -> Exception:
    why = ("insufficient storage" if kind == "insufficient_storage"
           else "the strict constraints (the cluster has the memory, the allowed shardings cannot use it)")
    if len(device_cap) and float(np.max(device_cap)) <= 0 and (
            compute_device == "cpu" or not len(host_cap) or float(np.max(host_cap)) <= 0):
        # the storage reservation (which keeps every rank's input buffers: the KJT ids of its
        # batch, several copies) left no memory for any table: the tables are not the cause
        return SparseLiftPlannerError(
            f"no plan because of insufficient storage: the input/output buffers of one step leave "
            f"no memory for the tables: after the storage reservation, which keeps each rank's "
            f"input buffers (the ids of batch_size x pooling factors, several copies), a rank has "
            f"{float(np.max(device_cap)) / 2**30:.2f} GiB "
            f"({storage_summary(lowest, device_cap, host_cap, compute_device)}). To fix: lower "
            "batch_size (it is per rank) or the pooling factors (ParameterConstraints."
            "pooling_factors or the workload statistics are ids per sample), or use ranks with "
            "more memory; sharding the tables differently cannot help.",
            kind="insufficient_storage",
        )
    return SparseLiftPlannerError(
        f"no plan because of {why}: {storage_summary(lowest, device_cap, host_cap, compute_device)}."
        "\nNo sharding of these tables fits in one rank's memory:\n  "
        + "\n  ".join(lines)
        + "\nTo fix: allow row-wise/table-row-wise or column-wise sharding for them "
        "(ParameterConstraints.sharding_types), allow a UVM kernel (fused_uvm_caching) on GPUs, "
        "use more ranks or ranks with more memory, or shrink the tables.",
        kind=kind,
    )
