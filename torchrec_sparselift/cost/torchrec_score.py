"""Score any placed plan with TorchRec's own planner models (for side-by-side benchmarks).

TorchRec rates a plan with ``NoopPerfModel``: the maximum over ranks of the summed
``shard.perf.total`` (milliseconds), where each shard's ``Perf`` comes from
``EmbeddingPerfEstimator``. :func:`torchrec_score` re-estimates every shard of a list of placed
``ShardingOption``s (TorchRec's or SparseLift's) with TorchRec's default perf and storage
estimators and rates them the same way, so two plans are compared on TorchRec's terms.

:class:`BestPlanCapture` is a TorchRec ``Stats`` that keeps the winning ``ShardingOption``s of
an ``EmbeddingShardingPlanner`` run (the public way to get them: pass ``stats=``).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import attrs
from torchrec.distributed.planner.perf_models import NoopPerfModel
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Stats, Topology
from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

__all__ = ["TorchRecScore", "torchrec_score", "BestPlanCapture"]


@attrs.frozen
class TorchRecScore:
    """A plan as TorchRec's planner sees it.

    ``perf_ms``: ``NoopPerfModel`` rating (max over ranks of summed shard ``Perf.total``, ms);
    ``rank_perf_ms``: that sum per rank; ``peak_hbm_bytes`` / ``peak_ddr_bytes``: the largest
    per-rank sum of ``EmbeddingStorageEstimator``'s shard storage.
    """

    perf_ms: float
    rank_perf_ms: Tuple[float, ...] = attrs.field(repr=False)
    peak_hbm_bytes: int
    peak_ddr_bytes: int


def torchrec_score(
    options: Sequence[ShardingOption],
    topology: Topology,
    sharders: Sequence[Any],
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
) -> TorchRecScore:
    """Re-estimate ``options`` (every shard placed: ``shard.rank`` set) with TorchRec's default
    ``EmbeddingPerfEstimator`` and ``EmbeddingStorageEstimator`` for ``topology`` and
    ``constraints``, and rate them with ``NoopPerfModel``. The inputs are not modified
    (the options are deep-copied; TorchRec's copy shares the module and tensor)."""
    opts: List[ShardingOption] = [copy.deepcopy(o) for o in options]
    for o in opts:
        for s in o.shards:
            if s.rank is None:
                raise ValueError(
                    f"table {o.name!r} has a shard without a rank: score placed plans only "
                    "(TorchRec's best plan or a PlanResult's sharding_options)"
                )
    data_map = build_sharder_data_map({sharder_name(s.module_type): s for s in sharders})
    EmbeddingPerfEstimator(topology=topology, constraints=constraints).estimate(opts, data_map)
    EmbeddingStorageEstimator(topology=topology, constraints=constraints).estimate(opts, data_map)
    perf_ms = NoopPerfModel(topology=topology).rate(opts)
    W = topology.world_size
    rank_perf = [0.0] * W
    hbm = [0] * W
    ddr = [0] * W
    for o in opts:
        for s in o.shards:
            rank_perf[s.rank] += s.perf.total
            hbm[s.rank] += s.storage.hbm
            ddr[s.rank] += s.storage.ddr
    return TorchRecScore(
        perf_ms=float(perf_ms), rank_perf_ms=tuple(rank_perf),
        peak_hbm_bytes=int(max(hbm)), peak_ddr_bytes=int(max(ddr)),
    )


class BestPlanCapture(Stats):
    """A TorchRec ``Stats`` that records what ``EmbeddingShardingPlanner.plan`` chose.

    After ``plan()``: ``best_plan`` holds the winning placed ``ShardingOption``s (a deep copy),
    ``run_time`` the planner's own run time in seconds, ``num_proposals``/``num_plans`` its
    search counts. Passing it as ``stats=`` replaces TorchRec's table printer.
    """

    def __init__(self) -> None:
        self.best_plan: Optional[List[ShardingOption]] = None
        self.run_time: Optional[float] = None
        self.num_proposals: Optional[int] = None
        self.num_plans: Optional[int] = None

    def log(self, sharding_plan: Any, topology: Topology, batch_size: int, storage_reservation: Any,
            num_proposals: int, num_plans: int, run_time: float, best_plan: List[ShardingOption],
            *args: Any, **kwargs: Any) -> None:
        self.best_plan = copy.deepcopy(list(best_plan))
        self.run_time = float(run_time)
        self.num_proposals = int(num_proposals)
        self.num_plans = int(num_plans)
