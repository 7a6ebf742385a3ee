"""Price a given ``ShardingPlan`` (e.g. TorchRec's) under SparseLift's cost model: the second way
into the cost model next to planning, used by ``sparselift compare``/``explain``, the benchmarks
and the measured guard."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np
from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.hardware import get_profile, profile_for_topology
from torchrec_sparselift.cost.evaluator import PlanEvaluator
from torchrec_sparselift.cost.model import CostContext, StepTime, shard_cost
from torchrec_sparselift.plan.result import PlanResult
from torchrec_sparselift.search.lp import solve_lp
from torchrec_sparselift.search.problem import build_problem
from torchrec_sparselift.search.solve import SearchResult, new_evaluator
from torchrec_sparselift.semantics.dense import dense_work
from torchrec_sparselift.semantics.graph import Candidate, candidate_for
from torchrec_sparselift.semantics.tables import TableHandle, extract_tables
from torchrec_sparselift.vocabulary import COLUMN_SPLIT_TYPES, COMM_PRECISIONS, PIPELINES
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.semantics.workload import WorkloadStats
from torchrec_sparselift.validation import argument_problems, raise_problems, setting_problems

__all__ = ["evaluate_sharding_plan", "evaluate_given", "given_candidates", "GivenPlan"]


def given_candidates(handles: Sequence[TableHandle], plan: ShardingPlan, world_size: int,
                     local_world_size: int) -> List[Tuple[Candidate, Tuple[int, ...]]]:
    """Each table's candidate and ranks as ``plan`` places it, in ``handles`` order (column-wise
    shards as equal splits of the table's width). Raises ``ValueError`` naming a table the plan
    does not place."""
    out = []
    for t, h in enumerate(handles):
        module_plan = plan.plan.get(h.spec.module_path)
        ps = module_plan.get(h.spec.name) if module_plan is not None else None
        if ps is None:
            raise ValueError(f"the plan has no sharding for table {h.spec.fqn!r}")
        splits = len(ps.ranks) if ps.sharding_type in COLUMN_SPLIT_TYPES else 1
        cand = candidate_for(t, h.spec, ps.sharding_type, ps.compute_kernel, world_size,
                             local_world_size, splits)
        out.append((cand, tuple(int(r) for r in ps.ranks)))
    return out


@attrs.frozen(eq=False)
class GivenPlan:
    """A ``ShardingPlan`` as the cost model sees it, extracted once: its tables (``handles``), the
    dense part and each table's candidate and ranks (:func:`given_candidates`). Pricing it under a
    profile (:meth:`context`, :meth:`shard_costs`, :meth:`step_time`) repeats no extraction: what
    the calibration's fit does for thousands of profiles of one plan."""

    handles: Tuple[TableHandle, ...] = attrs.field(converter=tuple)
    dense: Any
    placed: Tuple[Tuple[Candidate, Tuple[int, ...]], ...] = attrs.field(converter=tuple)
    topology: Topology
    batch_size: int

    @classmethod
    def of(cls, module: nn.Module, plan: ShardingPlan, topology: Topology, batch_size: int,
           constraints: Optional[Dict[str, ParameterConstraints]] = None, workload: Any = None,
           sharders: Optional[List[ModuleSharder[nn.Module]]] = None) -> "GivenPlan":
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        handles = extract_tables(module, sharders, topology.compute_device, batch_size, constraints, workload)
        placed = given_candidates(handles, plan, topology.world_size,
                                  min(topology.local_world_size, topology.world_size))
        return cls(handles=handles, dense=dense_work(module, handles), placed=placed, topology=topology,
                   batch_size=batch_size)

    def context(self, hardware: Any) -> CostContext:
        """The cost context of the plan's topology under ``hardware`` (a profile or preset name)."""
        topo = self.topology
        profile = profile_for_topology(topo, get_profile(hardware) if isinstance(hardware, str) else hardware)
        return CostContext(profile=profile, world_size=topo.world_size,
                           local_world_size=min(topo.local_world_size, topo.world_size),
                           batch_size=self.batch_size, dense=self.dense)

    def shard_costs(self, ctx: CostContext) -> List[Any]:
        """Each table's shard cost under ``ctx``, in ``handles`` order."""
        return [shard_cost(h.spec, cand, ctx) for h, (cand, _r) in zip(self.handles, self.placed)]

    def step_time(self, hardware: Any, pipeline: str = defaults.PIPELINE, fwd_precision: str = defaults.COMM_PRECISION,
                  bwd_precision: str = defaults.COMM_PRECISION) -> StepTime:
        """The plan's step time under ``hardware``: its shards placed as given in the planner's
        evaluator (no search, no bound)."""
        ctx = self.context(hardware)
        cands = [c for c, _r in self.placed]
        inf = np.full(self.topology.world_size, np.inf)
        ev = PlanEvaluator(ctx, self.shard_costs(ctx), [c.sharding_type for c in cands], inf, inf, pipeline,
                           fwd_precision, bwd_precision, kernels=[c.compute_kernel for c in cands])
        for t, (_c, ranks) in enumerate(self.placed):
            ev.assign(t, t, ranks)
        return ev.step_time()


def evaluate_sharding_plan(
    module: nn.Module,
    plan: ShardingPlan,
    topology: Topology,
    batch_size: int,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    hardware: Any = None,
    workload: Any = None,
    sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
    pipeline: str = defaults.PIPELINE,
    fwd_precision: str = defaults.COMM_PRECISION,
    bwd_precision: str = defaults.COMM_PRECISION,
) -> PlanResult:
    """Price any ``ShardingPlan`` (e.g. TorchRec's) under SparseLift's cost model.

    Returns a :class:`PlanResult` whose ``search.step`` is the predicted step time under
    ``pipeline``; its lower bound is the LP bound of the same tables and topology. Column-wise
    shards are priced as equal splits of the table's width.
    """
    raise_problems(argument_problems(
        topology=topology, constraints=constraints, hardware=hardware, workload=workload,
        topology_type=Topology, constraint_type=ParameterConstraints, profile_type=HardwareProfile,
        workload_type=WorkloadStats, choices={"pipeline": (pipeline, PIPELINES), "fwd_precision": (
            fwd_precision, COMM_PRECISIONS), "bwd_precision": (bwd_precision, COMM_PRECISIONS)},
    ) + setting_problems([("batch_size", batch_size, "int>=1", "batch_size=512 (per rank)")]) + (
        [] if isinstance(plan, ShardingPlan) else [f"plan must be a torchrec ShardingPlan, got {type(plan).__name__}"]
    ), "evaluate_sharding_plan's arguments")
    given = GivenPlan.of(module, plan, topology, batch_size, constraints, workload, sharders)
    return evaluate_given(given, plan, hardware, pipeline, fwd_precision, bwd_precision)


def evaluate_given(given: "GivenPlan", plan: ShardingPlan, hardware: Any = None,
                   pipeline: str = defaults.PIPELINE, fwd_precision: str = defaults.COMM_PRECISION,
                   bwd_precision: str = defaults.COMM_PRECISION) -> PlanResult:
    """:func:`evaluate_sharding_plan` of a plan already read (``given``: :meth:`GivenPlan.of` of
    ``plan``, on its topology), for a caller that prices one plan under several settings."""
    topology = given.topology
    handles = given.handles
    ctx = given.context(hardware)
    profile = ctx.profile
    inf = np.full(topology.world_size, np.inf)
    prob = build_problem([h.spec for h in handles], ctx, inf, inf, pipelines=(pipeline,),
                         precisions=((fwd_precision, bwd_precision),))
    cands = list(prob.cands)
    costs = list(prob.costs)
    assignment = []
    for (cand, ranks), cost in zip(given.placed, given.shard_costs(ctx)):
        cands.append(cand)
        costs.append(cost)
        assignment.append((len(cands) - 1, ranks))
    full = attrs.evolve(prob, cands=tuple(cands), costs=tuple(costs))
    ev = new_evaluator(full, pipeline, fwd_precision, bwd_precision)
    for t, (cid, ranks) in enumerate(assignment):
        ev.assign(t, cid, ranks)
    lp = solve_lp(prob, pipeline, fwd_precision, bwd_precision)
    step = ev.step_time()
    search = SearchResult(
        assignment=tuple(assignment), step=step,
        lower_bound_s=min(lp.lower_bound_s, step.total_s) if lp.status == "optimal" else float("nan"),
        pipeline=pipeline, fwd_precision=fwd_precision, bwd_precision=bwd_precision,
        solver="given", status="evaluated", planning_time_s=0.0, moves=0,
        rank_loads=ev.rank_loads(),
    )
    return PlanResult(sharding_plan=plan, sharding_options=(), search=search, problem=full,
                      handles=tuple(handles), topology=topology, profile=profile)
