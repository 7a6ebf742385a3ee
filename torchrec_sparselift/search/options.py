"""TorchRec-facing adapter: our candidates and placements as TorchRec ``ShardingOption``s.

Shard shapes come from TorchRec's own ``calculate_shard_sizes_and_offsets`` where TorchRec's
runtime has a fixed layout (row-wise, table-row-wise, data-parallel), so the plan is exactly what
``DistributedModelParallel`` expects; column-wise uses equal splits of the planned width.
Each shard carries our cost as TorchRec ``Perf``/``Storage`` so TorchRec's stats and partitioners
keep working on our options.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torchrec.distributed.planner.enumerators import get_partition_by_type
from torchrec.distributed.planner.types import Perf, Shard, ShardingOption, Storage
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets

from torchrec_sparselift.cost.model import (
    BWD,
    DEV_MEM,
    FWD,
    HOST_MEM,
    IN_INTER,
    IN_INTRA,
    OUT_INTER,
    OUT_INTRA,
    UVM,
)
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.semantics.tables import TableHandle
from torchrec_sparselift.vocabulary import COLUMN_SPLIT_TYPES, TABLE_WISE

__all__ = ["to_sharding_option", "shard_layout"]

_MS = 1e3  # TorchRec's Perf is in milliseconds


def shard_layout(handle: TableHandle, prob: PlanningProblem, cand_id: int) -> Tuple[List[List[int]], List[List[int]]]:
    """(sizes, offsets) of every shard of candidate ``cand_id``."""
    c = prob.cands[cand_id]
    spec = handle.spec
    W, L = prob.ctx.world_size, min(prob.ctx.local_world_size, prob.ctx.world_size)
    if c.sharding_type in COLUMN_SPLIT_TYPES:
        w = c.shard_cols
        return (
            [[spec.num_embeddings, w] for _ in range(c.num_shards)],
            [[0, i * w] for i in range(c.num_shards)],
        )
    if c.sharding_type == TABLE_WISE:
        return [[spec.num_embeddings, spec.embedding_dim]], [[0, 0]]
    kw = {"num_buckets": spec.num_buckets} if spec.num_buckets else {}  # virtual: whole buckets
    sizes, offsets = calculate_shard_sizes_and_offsets(
        tensor=handle.tensor, world_size=W, local_world_size=L, sharding_type=c.sharding_type, **kw
    )
    return [list(s) for s in sizes], [list(o) for o in offsets]


def to_sharding_option(
    handle: TableHandle,
    prob: PlanningProblem,
    cand_id: int,
    ranks: Optional[Sequence[int]] = None,
) -> ShardingOption:
    """A TorchRec ``ShardingOption`` for one candidate; shards placed on ``ranks`` if given."""
    spec = handle.spec
    c = prob.cands[cand_id]
    owner = prob.costs[cand_id].owner
    p = prob.ctx.profile
    sizes, offsets = shard_layout(handle, prob, cand_id)

    def link_ms(intra: float, inter: float) -> float:
        return max(intra / p.intra_host_bw, inter / p.inter_host_bw) * _MS

    stage_ms = owner[layout().index["out_stage_s"]] * _MS  # table-row-wise's intra-host stage, fwd and bwd
    perf = Perf(
        fwd_compute=(owner[FWD] + owner[UVM]) * _MS,
        fwd_comms=link_ms(owner[OUT_INTRA], owner[OUT_INTER]) + stage_ms,
        bwd_compute=owner[BWD] * _MS,
        bwd_comms=link_ms(owner[OUT_INTRA], owner[OUT_INTER]) + stage_ms,
        input_dist_comms=link_ms(owner[IN_INTRA], owner[IN_INTER]),
    )
    if p.compute_device == "cpu":
        storage = Storage(hbm=0, ddr=int(owner[DEV_MEM] + owner[HOST_MEM]))
    else:
        storage = Storage(hbm=int(owner[DEV_MEM]), ddr=int(owner[HOST_MEM]))
    shards = [
        Shard(size=s, offset=o, storage=storage, perf=perf,
              rank=(int(ranks[i]) if ranks is not None else None))
        for i, (s, o) in enumerate(zip(sizes, offsets))
    ]
    cons = handle.constraints
    pfs = list(cons.pooling_factors) if cons is not None and cons.pooling_factors else [
        spec.pooling_factor / max(1, len(spec.feature_names))
    ] * len(spec.feature_names)
    return ShardingOption(
        name=spec.name,
        tensor=handle.tensor,
        module=handle.module,
        input_lengths=pfs,
        batch_size=spec.batch_size,
        sharding_type=c.sharding_type,
        partition_by=get_partition_by_type(c.sharding_type),
        compute_kernel=c.compute_kernel,
        shards=shards,
        cache_params=getattr(cons, "cache_params", None),
        enforce_hbm=getattr(cons, "enforce_hbm", None),
        stochastic_rounding=getattr(cons, "stochastic_rounding", None),
        bounds_check_mode=getattr(cons, "bounds_check_mode", None),
        is_pooled=spec.is_pooled,
        feature_names=list(spec.feature_names),
        output_dtype=getattr(cons, "output_dtype", None),
        key_value_params=getattr(cons, "key_value_params", None),
    )
