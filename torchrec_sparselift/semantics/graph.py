"""The sparse-path graph: what a sharding option really does, node by node.

TorchRec shows a sharded embedding module as one opaque node. Here each candidate sharding of a
table is unfolded into the nodes it implies on the ranks that hold its shards:

``input_dist`` (ids + lengths all-to-all) -> ``lookup`` (TBE forward) -> ``output_dist`` (pooled
all-to-all, or reduce-scatter for row-wise) -> ... dense ... -> ``grad_dist`` -> ``backward_update``
(TBE backward with the fused optimizer) [-> ``replica_sync`` for 2D, ``grad_allreduce`` for
data-parallel tables].

Every node names the resource it occupies, how much of it (bytes or rows), the memory it pins and
what it waits for. The cost model (:mod:`torchrec_sparselift.cost.model`) turns nodes into time;
``explain`` shows the same nodes to users. Quantities are hardware-independent; only the cost model
knows rates.

All shards of one candidate are identical up to TorchRec's remainder rounding, so a candidate
carries one shard template plus the rule that places its shards (``free``: each shard on any rank,
``host``: all shards on the ranks of one host, ``all``: shard ``i`` on rank ``i``).
"""

from __future__ import annotations

from typing import List, Tuple

import attrs

from torchrec_sparselift.semantics.tables import TableSpec
from torchrec_sparselift.vocabulary import (
    COLUMN_SPLIT_TYPES,
    DATA_PARALLEL,
    GRID_SHARD,
    HOST_ROW_SPLIT_TYPES,
    ON_EVERY_RANK_TYPES,
    PLACED_FREELY_TYPES,
    ROW_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
)

__all__ = [
    "HOST_WORK_KINDS",
    "Node",
    "Candidate",
    "shard_nodes",
    "candidate_for",
    "PLACEMENT_OF",
    "INDEX_BYTES",
    "LENGTH_BYTES",
    "OPTIMIZER_STATE_BYTES_PER_ROW",
]

INDEX_BYTES = 8  # int64 ids on the wire
LENGTH_BYTES = 4  # int32 lengths, one per (sample, feature)
OPTIMIZER_STATE_BYTES_PER_ROW = 4  # row-wise AdaGrad: one fp32 accumulator per row
DEFAULT_CACHE_LOAD_FACTOR = 0.2  # TorchRec's default for UVM caching kernels
KV_CACHE_LOAD_FACTOR = 0.2  # TorchRec's KV_CACHING_RATIO: the largest L1 cache, as a table fraction

PLACEMENT_OF = {
    **{t: "free" for t in PLACED_FREELY_TYPES},
    **{t: "all" for t in ON_EVERY_RANK_TYPES},
    **{t: "host" for t in HOST_ROW_SPLIT_TYPES},
}

NODE_KINDS = (
    "input_dist",
    "lookup",
    "output_dist",
    "grad_dist",
    "backward_update",
    "grad_allreduce",
    # host work per step that the kernels and collectives above do not include (fitted from
    # real steps, calibration.step_fit): KJT permutes/splits/lengths per feature and shard, per-shard
    # bookkeeping, row-wise bucketize per id, per data-parallel table dense-gradient/optimizer
    "kjt_work",
    "table_work",
    "bucketize",
    "dp_table_work",
)
#: Node kinds priced per unit of host work (features, tables, ids), not bytes or rows.
HOST_WORK_KINDS = ("kjt_work", "table_work", "bucketize", "dp_table_work")
RESOURCES = ("hbm", "ddr", "uvm", "intra_host", "inter_host")


@attrs.frozen
class Node:
    """One step of the sparse path on the rank that holds a shard.

    ``quantity`` is bytes for links and memory traffic, rows for lookups (a row moves
    ``width_bytes``; the cost model rounds to the memory transaction size). ``scope`` says who
    pays: ``"owner"`` the rank holding the shard, ``"others"`` every rank except the owner,
    equally (the other end of an all-to-all: what each peer sends to or receives from the owner),
    ``"peers"`` every rank equally, ``"global"`` a collective over all ranks (data-parallel
    all-reduce). Link bytes on a rank are what it sends to plus what it receives from *other*
    ranks (its own chunk of an all-to-all never leaves it); ``runtime.comm_counter`` counts the
    same on a real run and the tests check them equal.
    """

    kind: str
    resource: str
    quantity: float
    unit: str = "bytes"
    width_bytes: int = 0
    scope: str = "owner"
    backward: bool = False  # happens in the backward pass
    l1_cached: bool = False  # key-value lookups ("kv_dram"/"kv_ssd"): an HBM (L1) cache in front
    l2_cached: bool = False  # "kv_ssd": a DRAM (L2) cache between L1 and the SSD store
    #: ``backward_update`` of a fused kernel: the distinct rows its optimizer updates (fbgemm's
    #: TBE backward deduplicates the ids and writes each row and its state once)
    distinct_rows: float = 0.0
    #: a link node's collective: "all_to_all", or for row-wise pooled outputs "reduce_scatter"
    #: (forward) and "all_gather" (its backward); the bytes are counted alike, the cost model
    #: prices a reduce-scatter's at its own rate (gloo: ~4x an all-to-all's per byte)
    collective: str = "all_to_all"
    #: a collective of its own that runs before the phase's next one (table-row-wise's
    #: intra-host reduce-scatter, then its cross-host all-to-all): its seconds add to the phase
    #: instead of overlapping the other link's (cost.terms' ``out_stage_s``)
    stage: bool = False


@attrs.frozen
class Candidate:
    """One way to shard one table: type, kernel, and the shape and count of its shards."""

    table: int
    sharding_type: str
    compute_kernel: str
    num_shards: int
    shard_rows: int
    shard_cols: int
    placement: str

    @property
    def key(self) -> Tuple[str, str, int]:
        return (self.sharding_type, self.compute_kernel, self.num_shards)


def candidate_for(
    table_index: int,
    spec: TableSpec,
    sharding_type: str,
    compute_kernel: str,
    world_size: int,
    local_world_size: int,
    column_splits: int = 1,
) -> Candidate:
    rows, dim = spec.num_embeddings, spec.embedding_dim
    if sharding_type == TABLE_WISE:
        n, r, c = 1, rows, dim
    elif sharding_type in COLUMN_SPLIT_TYPES:
        n, r, c = column_splits, rows, dim // column_splits
    elif sharding_type == ROW_WISE:
        n, r, c = world_size, -(-rows // world_size), dim
    elif sharding_type == TABLE_ROW_WISE:
        n, r, c = local_world_size, -(-rows // local_world_size), dim
    elif sharding_type == DATA_PARALLEL:
        n, r, c = world_size, rows, dim
    elif sharding_type == GRID_SHARD:
        n, r, c = local_world_size * column_splits, -(-rows // local_world_size), dim // column_splits
    else:
        raise ValueError(f"table {spec.fqn!r}: unknown sharding type {sharding_type!r}")
    return Candidate(
        table=table_index,
        sharding_type=sharding_type,
        compute_kernel=compute_kernel,
        num_shards=n,
        shard_rows=r,
        shard_cols=c,
        placement=PLACEMENT_OF[sharding_type],
    )


def _flat_a2a_fractions(world_size: int, local_world_size: int) -> Tuple[float, float]:
    """(intra, inter) fraction of one rank's all-to-all bytes in a flat all-to-all."""
    if world_size <= 1:
        return 0.0, 0.0
    local = min(local_world_size, world_size)
    return (local - 1) / world_size, (world_size - local) / world_size


def shard_nodes(
    spec: TableSpec, cand: Candidate, world_size: int, local_world_size: int
) -> List[Node]:
    """Nodes one shard of ``cand`` puts on its rank (plus ``peers``/``global`` terms).

    Quantities per training step, for the per-rank batch ``spec.batch_size``:
    ``I = B * W * pf`` ids per step over the whole job; a fused kernel's backward also updates
    the shard's distinct rows (:meth:`TableSpec.distinct_rows` of the batches it serves: ``W``
    ranks' for a table-wise or column-wise shard, its ``1/W`` (row-wise) or ``1/L`` (table-row-wise)
    share of them for a row bucket, the rank's own for a data-parallel replica).
    """
    B, W, L = spec.batch_size, world_size, min(local_world_size, world_size)
    pf = spec.pooling_factor
    nf = len(spec.feature_names)
    ids_global = B * W * pf
    st = cand.sharding_type
    width = cand.shard_cols * spec.elem_bytes
    fi, fe = _flat_a2a_fractions(W, L)
    nodes: List[Node] = []

    def a2a(kind: str, owner_bytes: float, intra: float, inter: float, peer_bytes: float,
            backward: bool, collective: str = "all_to_all") -> None:
        c = collective
        if intra > 0:
            nodes.append(Node(kind, "intra_host", owner_bytes * intra, backward=backward, collective=c))
        if inter > 0:
            nodes.append(Node(kind, "inter_host", owner_bytes * inter, backward=backward, collective=c))
        # peer_bytes: what each *other* rank sends to (receives from) this shard's owner
        if peer_bytes > 0 and W > 1:
            pi = (L - 1) / (W - 1)
            if pi > 0:
                nodes.append(Node(kind, "intra_host", peer_bytes * pi, scope="others",
                                  backward=backward, collective=c))
            if pi < 1:
                nodes.append(Node(kind, "inter_host", peer_bytes * (1 - pi), scope="others",
                                  backward=backward, collective=c))

    kernel = cand.compute_kernel
    lookup_res = {"fused_uvm": "uvm", "fused_uvm_caching": "uvm_cached",
                  "dram_virtual_table": "kv_dram", "ssd_virtual_table": "kv_ssd"}.get(kernel, "hbm")
    kv = ({"l1_cached": spec.kv_l1_bytes > 0, "l2_cached": spec.kv_l2_bytes > 0}
          if lookup_res.startswith("kv_") else {})

    fused = kernel != "dense" and not kernel.startswith("quant")

    def distinct(batches: float, share: float) -> float:
        return spec.distinct_rows(batches) * share if fused else 0.0

    if st == DATA_PARALLEL:
        rows_local = B * pf
        nodes.append(Node("lookup", lookup_res, rows_local, unit="rows", width_bytes=width, **kv))
        nodes.append(Node("backward_update", lookup_res, rows_local, unit="rows",
                          width_bytes=width, backward=True, distinct_rows=distinct(1, 1.0), **kv))
        grad_bytes = spec.num_embeddings * spec.embedding_dim * 4
        nodes.append(Node("grad_allreduce", "allreduce", grad_bytes, scope="global", backward=True))
        # dense optimizer step over the whole replica: read weight + grad + state, write both
        nodes.append(Node("backward_update", "dense_update", 3.0 * grad_bytes,
                          backward=True))
        # per replica and step: its dense gradient, its slot in DDP's buckets, its optimizer call
        nodes.append(Node("dp_table_work", "host", 1.0, unit="tables", backward=True))
        # and the per-table work of its (dense) TBE on every rank, as a sharded table's on its owner
        # (measured: moving 20 small tables from table-wise to data-parallel left the ranks'
        # lookup + backward time unchanged, docs/calibration.md)
        nodes.append(Node("table_work", "host", 1.0, unit="tables"))
        # its features still go through the KJT split by sharding type and the output's per-feature
        # assembly on every rank (measured: the KJT kind stayed 0.45 ms when 20 of kaggle's 26
        # features went data-parallel)
        nodes.append(Node("kjt_work", "host", float(nf), unit="features"))
        return nodes

    if st in PLACED_FREELY_TYPES:
        ids_here = ids_global
        in_bytes = ids_here * INDEX_BYTES + B * W * nf * LENGTH_BYTES
        a2a("input_dist", in_bytes, fi, fe, in_bytes / W, False)
        nodes.append(Node("lookup", lookup_res, ids_here, unit="rows", width_bytes=width, **kv))
        # pooled: one pooled row per sample *and feature* (EmbeddingBagCollection pools each
        # feature's bag separately) to each of the W-1 other ranks
        if spec.is_pooled:
            out_bytes = B * (W - 1) * nf * cand.shard_cols * 4
        else:
            out_bytes = ids_global * (W - 1) / W * cand.shard_cols * 4
        frac_i = (L - 1) / (W - 1) if W > 1 else 0.0
        peer = out_bytes / (W - 1) if W > 1 else 0.0
        a2a("output_dist", out_bytes, frac_i, 1 - frac_i if W > 1 else 0.0, peer, False)
        a2a("grad_dist", out_bytes, frac_i, 1 - frac_i if W > 1 else 0.0, peer, True)
        nodes.append(Node("backward_update", lookup_res, ids_here, unit="rows", width_bytes=width,
                          backward=True, distinct_rows=distinct(W, 1.0), **kv))
        _host_work(nodes, nf, 1.0, 0.0)
        return nodes

    if st == ROW_WISE:
        ids_here = ids_global / W
        in_bytes = ids_here * INDEX_BYTES + B * W * nf * LENGTH_BYTES
        # every rank receives its bucket from the W-1 others (owner side) and sends its own ids
        # to the W-1 other buckets (the others side: in_bytes / W to each other shard)
        a2a("input_dist", in_bytes, fi, fe, in_bytes / W, False)
        nodes.append(Node("lookup", lookup_res, ids_here, unit="rows", width_bytes=width, **kv))
        if spec.is_pooled:  # reduce-scatter of partial sums (per sample and feature) over all ranks
            out_bytes = B * W * nf * cand.shard_cols * 4 * (W - 1) / W
        else:
            out_bytes = ids_here * cand.shard_cols * 4 * (W - 1) / W
        # the owner receives the W-1 others' partials of its slice; each other rank sends it one
        peer = out_bytes / (W - 1) if W > 1 else 0.0
        fwd_c, bwd_c = ("reduce_scatter", "all_gather") if spec.is_pooled else ("all_to_all", "all_to_all")
        a2a("output_dist", out_bytes, fi * W / max(W - 1, 1), fe * W / max(W - 1, 1), peer, False, fwd_c)
        a2a("grad_dist", out_bytes, fi * W / max(W - 1, 1), fe * W / max(W - 1, 1), peer, True, bwd_c)
        nodes.append(Node("backward_update", lookup_res, ids_here, unit="rows", width_bytes=width,
                          backward=True, distinct_rows=distinct(W, 1.0 / W), **kv))
        # each rank bucketizes its own ids once per feature, split over the W shards
        _host_work(nodes, nf / W, 1.0, B * pf / W)
        return nodes

    if st in HOST_ROW_SPLIT_TYPES:
        rows_split = L
        ids_here = ids_global / rows_split
        in_bytes = ids_here * INDEX_BYTES + B * W * nf * LENGTH_BYTES
        # as row-wise within the host's L buckets: the owner receives (W-1)/W of its bucket, each
        # other rank sends it in_bytes / W
        a2a("input_dist", in_bytes, fi, fe, in_bytes / W, False)
        nodes.append(Node("lookup", lookup_res, ids_here, unit="rows", width_bytes=width, **kv))
        H = max(1, W // L)
        for kind, bwd in (("output_dist", False), ("grad_dist", True)):
            if spec.is_pooled:
                # intra-host reduce-scatter of the partials (per sample and feature) among the
                # host's L shards: each sends (L-1)/L of them and receives as much
                partial = B * W * nf * cand.shard_cols * 4
                rs = 2 * partial * (L - 1) / L
                if rs > 0:
                    nodes.append(Node(kind, "intra_host", rs, backward=bwd, stage=H > 1,
                                      collective="all_gather" if bwd else "reduce_scatter"))
                # then each shard's reduced slice (the samples of the ranks with its local index)
                # goes to those ranks on the H-1 other hosts; the W-L receivers are spread over
                # all other ranks (exact in total; per rank only on one host, where it is 0)
                cross = B * (H - 1) * nf * cand.shard_cols * 4
                if cross > 0:
                    nodes.append(Node(kind, "inter_host", cross, backward=bwd))
                    nodes.append(Node(kind, "inter_host", cross / (W - 1), scope="others",
                                      backward=bwd))
            else:
                out_bytes = ids_here * cand.shard_cols * 4 * (W - 1) / W if W > 1 else 0.0
                a2a(kind, out_bytes, fi * W / max(W - 1, 1), fe * W / max(W - 1, 1),
                    out_bytes / (W - 1) if W > 1 else 0.0, bwd)
        nodes.append(Node("backward_update", lookup_res, ids_here, unit="rows", width_bytes=width,
                          backward=True, distinct_rows=distinct(W, 1.0 / rows_split), **kv))
        _host_work(nodes, nf / rows_split, 1.0, B * pf / rows_split)
        return nodes

    raise ValueError(f"table {spec.fqn!r}: no sparse-path model for sharding type {st!r}")


def _host_work(nodes: List[Node], features_per_rank: float, tables: float, ids_per_rank: float) -> None:
    """The host work one sharded (not data-parallel) shard adds: ``features_per_rank`` KJT
    features every rank permutes/splits for it (scope ``peers``), ``tables`` of per-shard
    bookkeeping on its owner, ``ids_per_rank`` ids every rank bucketizes for it (row-wise)."""
    if features_per_rank > 0:
        nodes.append(Node("kjt_work", "host", features_per_rank, unit="features", scope="peers"))
    if tables > 0:
        nodes.append(Node("table_work", "host", tables, unit="tables"))
    if ids_per_rank > 0:
        nodes.append(Node("bucketize", "host", ids_per_rank, unit="ids", scope="peers"))


def shard_memory(spec: TableSpec, cand: Candidate, world_size: int,
                 cache_load_factor: float = DEFAULT_CACHE_LOAD_FACTOR) -> Tuple[float, float]:
    """(device bytes, host bytes) one shard pins: weights, optimizer state, and the buffers of
    one training step on the rank that holds it. Checked against what ranks really pin after
    ``DistributedModelParallel`` on CPU (``benchmarks/memory_safety.py``, docs/memory.md):

    * sharded types: ids received (``ids_here`` int64), the lookup's output and its gradient
      (``out_rows x cols`` fp32 each), and for table-row-wise and grid an intra-host partial-sum
      copy;
    * data-parallel: the replica, its gradient, the optimizer state and one more full-size
      buffer (the DDP gradient bucket, or the optimizer's temporary).

    Not here, as in TorchRec: what every rank pays for its own batch whatever the placement
    (its input KJT, the pooled output the dense part consumes and its gradient); that is the
    storage reservation's share (``HeuristicalStorageReservation`` keeps 20 input copies plus a
    percentage), measured in docs/memory.md.
    """
    rows, cols = cand.shard_rows, cand.shard_cols
    weights = rows * cols * spec.elem_bytes
    if cand.sharding_type == DATA_PARALLEL:
        return float(weights + 3 * rows * cols * 4), 0.0
    state = rows * OPTIMIZER_STATE_BYTES_PER_ROW
    B, W = spec.batch_size, world_size
    if cand.sharding_type == ROW_WISE:
        ids_here = B * W * spec.pooling_factor / W
    elif cand.sharding_type in HOST_ROW_SPLIT_TYPES:
        ids_here = B * W * spec.pooling_factor / max(cand.num_shards, 1)
    else:
        ids_here = B * W * spec.pooling_factor
    out_rows = B * W if spec.is_pooled else ids_here
    partial_copy = out_rows * cols * 4 if cand.sharding_type in HOST_ROW_SPLIT_TYPES else 0
    buffers = ids_here * INDEX_BYTES + out_rows * cols * 4 * 2 + partial_copy  # ids; output + grad
    if cand.compute_kernel in ("dram_virtual_table", "ssd_virtual_table"):
        # A key-value store holds only the ids a job inserts, never the whole id space: what a
        # shard pins up front is its HBM (L1) cache, capped at KV_CACHE_LOAD_FACTOR of the table
        # as TorchRec's estimator does, and its DRAM (L2) cache; the store itself grows with the
        # inserted ids (bounded by the job's eviction policy, not known when planning).
        l1 = min(spec.kv_l1_bytes, KV_CACHE_LOAD_FACTOR * spec.weight_bytes)
        return float(l1 + buffers), float(spec.kv_l2_bytes)
    if cand.compute_kernel == "fused_uvm":
        return float(buffers), float(weights + state)
    if cand.compute_kernel == "fused_uvm_caching":
        return float(cache_load_factor * weights + state + buffers), float(weights)
    return float(weights + state + buffers), 0.0
