"""``SparseLiftEnumerator``: a TorchRec ``Enumerator`` over SparseLift's candidate space.

Use it inside TorchRec's own planner to get SparseLift's options (finer column splits,
row-wise/table-row-wise on CPU, UVM kernels only where memory calls for them) with SparseLift's
costs on every shard::

    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=B,
        enumerator=SparseLiftEnumerator(topology=topology, batch_size=B),
        proposer=SparseLiftProposer(topology=topology),
    )

Each ``ShardingOption`` carries our cost as TorchRec ``Perf``/``Storage`` on its shards, so
TorchRec's partitioners, perf models and stats work on it unchanged.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import attrs
from torch import nn
from torchrec.distributed.planner.types import Enumerator, ParameterConstraints, ShardingOption, Topology
from torchrec.distributed.types import ModuleSharder

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile, profile_for_topology
from torchrec_sparselift.cost.model import CostContext, ShardCost, shard_cost
from torchrec_sparselift.search.options import to_sharding_option
from torchrec_sparselift.search.problem import PlanningProblem, build_problem, device_caps
from torchrec_sparselift.semantics.dense import dense_work
from torchrec_sparselift.semantics.graph import Candidate, candidate_for
from torchrec_sparselift.semantics.tables import TableHandle, extract_tables
from torchrec_sparselift.vocabulary import COLUMN_SPLIT_TYPES

__all__ = ["SparseLiftEnumerator"]


class SparseLiftEnumerator(Enumerator):
    """Enumerates SparseLift's candidate shardings as TorchRec ``ShardingOption``s.

    Args:
        topology: the TorchRec topology (world size, ranks per host, memory).
        batch_size: per-rank batch size.
        constraints: TorchRec ``ParameterConstraints`` by table name.
        estimator: ignored (our cost model fills ``Perf``/``Storage``); accepted for signature
            compatibility with ``EmbeddingEnumerator``.
        hardware: a :class:`HardwareProfile` or preset name; default chosen from the topology.
        workload: optional ``WorkloadStats`` for pooling factors.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = defaults.BATCH_SIZE,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        estimator: Any = None,
        hardware: Any = None,
        workload: Any = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self._topology = topology
        self._batch_size = batch_size
        self._constraints = constraints
        if isinstance(hardware, str):
            hardware = get_profile(hardware)
        self._profile: HardwareProfile = profile_for_topology(topology, hardware)
        self._workload = workload
        self.last_problem: Optional[PlanningProblem] = None
        self.last_handles: Tuple[TableHandle, ...] = ()
        self.option_candidates: Dict[int, int] = {}  # id(option) -> candidate id

    def enumerate(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> List[ShardingOption]:
        topo = self._topology
        handles = extract_tables(module, sharders, topo.compute_device, self._batch_size,
                                 self._constraints, self._workload)
        ctx = CostContext(profile=self._profile, world_size=topo.world_size,
                          local_world_size=min(topo.local_world_size, topo.world_size),
                          batch_size=self._batch_size, dense=dense_work(module, handles))
        dev, host = device_caps(topo)
        prob = build_problem([h.spec for h in handles], ctx, dev, host)
        options: List[ShardingOption] = []
        self.option_candidates = {}
        for t, h in enumerate(handles):
            for cid in prob.candidates[t]:
                so = to_sharding_option(h, prob, cid, ranks=None)
                self.option_candidates[id(so)] = cid
                options.append(so)
        self.last_problem = prob
        self.last_handles = tuple(handles)
        return options

    def populate_estimates(self, sharding_options: List[ShardingOption]) -> None:
        """Refill ``Perf``/``Storage`` of the given options from the cost model."""
        if self.last_problem is None:
            raise RuntimeError("populate_estimates() needs enumerate() to have run first")
        prob = self.last_problem
        by_name = {(h.spec.module_path, h.spec.name): (t, h) for t, h in enumerate(self.last_handles)}
        for so in sharding_options:
            t, h = by_name[(so.path, so.name)]
            splits = len(so.shards) if so.sharding_type in COLUMN_SPLIT_TYPES else 1
            cand = candidate_for(t, h.spec, so.sharding_type, so.compute_kernel, prob.ctx.world_size,
                                 prob.ctx.local_world_size, splits)
            cost = shard_cost(h.spec, cand, prob.ctx)
            fresh = to_sharding_option(
                h, _one_candidate_problem(prob, cand, cost), 0, ranks=None
            )
            for s, f in zip(so.shards, fresh.shards):
                s.perf, s.storage = f.perf, f.storage


def _one_candidate_problem(prob: PlanningProblem, cand: Candidate, cost: ShardCost) -> PlanningProblem:
    return attrs.evolve(prob, cands=(cand,), costs=(cost,), candidates=((0,),))
