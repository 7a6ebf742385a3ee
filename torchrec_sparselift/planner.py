"""``SparseLiftPlanner``: a drop-in TorchRec ``ShardingPlanner``.

Swap one word::

    planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    plan = planner.collective_plan(model, sharders, pg)   # a normal torchrec ShardingPlan

Inside: tables are recovered as values (:mod:`.semantics`), every candidate sharding is unfolded
into its sparse-path nodes and priced (:mod:`.cost`), and the search (:mod:`.search`) chooses
options, placements and the train-pipeline/comm-precision optimizations under per-rank memory
limits, reporting a lower bound on the step time. ``planner.last_result`` keeps the details.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np
import torch.distributed as dist
from torch import nn
from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
from torchrec.distributed.planner.planners import to_sharding_plan
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    ShardingOption,
    StorageReservation,
    Topology,
)
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner

from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile, profile_for_topology
from torchrec_sparselift.cost.model import PIPELINES, CostContext, DenseWork
from torchrec_sparselift.search.errors import SparseLiftPlannerError
from torchrec_sparselift.search.options import to_sharding_option
from torchrec_sparselift.search.problem import PlanningProblem, build_problem
from torchrec_sparselift.search.solve import SearchResult, solve
from torchrec_sparselift.semantics.tables import TableHandle, extract_tables

__all__ = ["SparseLiftPlanner", "PlanResult", "dense_work"]

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 512  # TorchRec's planner default
SYNC_PIPELINES = ("base", "sparse_dist", "fused", "prefetch")
LOSSY_PRECISIONS = ("fp16", "bf16", "fp8")


@attrs.frozen
class PlanResult:
    """What the last ``plan()`` decided and predicted (for logs, ExecutionPlan and explain)."""

    sharding_plan: ShardingPlan = attrs.field(eq=False)
    sharding_options: Tuple[ShardingOption, ...] = attrs.field(eq=False, repr=False)
    search: SearchResult
    problem: PlanningProblem = attrs.field(eq=False, repr=False)
    handles: Tuple[TableHandle, ...] = attrs.field(eq=False, repr=False)
    topology: Topology = attrs.field(eq=False, repr=False)
    profile: HardwareProfile

    def summary(self) -> str:
        s = self.search
        lines = [
            f"SparseLift plan: {len(self.handles)} tables on {self.problem.ctx.world_size} ranks "
            f"({self.profile.name}), pipeline={s.pipeline}, comm={s.fwd_precision}/{s.bwd_precision}",
            f"  predicted step {s.step.total_s * 1e3:.3f} ms, lower bound "
            f"{s.lower_bound_s * 1e3:.3f} ms (gap {s.gap * 100:.1f}%), planned in "
            f"{s.planning_time_s:.2f} s by {s.solver}",
        ]
        for h, (cid, ranks) in zip(self.handles, s.assignment):
            c = self.problem.cands[cid]
            rk = _ranks_repr(ranks)
            lines.append(
                f"  {h.spec.fqn:<32} {c.sharding_type:<15} {c.compute_kernel:<18} "
                f"{c.num_shards:>4} shard(s) on ranks {rk}"
            )
        return "\n".join(lines)


def _ranks_repr(ranks: Sequence[int]) -> str:
    r = list(ranks)
    if len(r) > 4 and r == list(range(r[0], r[0] + len(r))):
        return f"{r[0]}..{r[-1]}"
    return ",".join(map(str, r))


def dense_work(module: nn.Module, handles: Sequence[TableHandle]) -> DenseWork:
    """Dense parameters (bytes) and forward FLOPs per sample, from the module's non-embedding
    parameters (2 FLOPs per weight per sample: a multiply and an add)."""
    sparse_ids = {id(h.tensor) for h in handles}
    sharded_modules = {id(h.module[1]) for h in handles}
    skip = set()
    for m in module.modules():
        if id(m) in sharded_modules:
            skip.update(id(p) for p in m.parameters())
    numel = 0
    nbytes = 0
    for p in module.parameters():
        if id(p) in skip or id(p) in sparse_ids:
            continue
        numel += p.numel()
        nbytes += p.numel() * p.element_size()
    return DenseWork(param_bytes=float(nbytes), fwd_flops_per_sample=2.0 * numel)


class SparseLiftPlanner(ShardingPlanner):
    """A TorchRec ``ShardingPlanner`` that plans the sparse path with a cost model and a
    constraint-aware search.

    Accepts ``EmbeddingShardingPlanner``'s arguments. ``topology``, ``batch_size``
    (per rank), ``constraints``, ``storage_reservation``, ``callbacks`` (applied to the final
    sharding options), ``stats``, ``debug`` and ``timeout_seconds`` (the search budget) are
    honoured. ``enumerator``, ``proposer``, ``partitioner``, ``performance_model`` and
    ``plan_loader`` are TorchRec search components that SparseLift replaces: passing one logs a
    warning saying it is not used.

    SparseLift's own keyword arguments:
        hardware: a :class:`HardwareProfile`, a preset name ("h100", "h200", "a100",
            "cpu-gloo") or a calibrated profile JSON path. Default: chosen from the topology.
        workload: :class:`~torchrec_sparselift.semantics.workload.WorkloadStats` observed from
            the dataloader; pooling factors then come from data instead of constraints.
        pipelines: train-pipeline kinds the plan may choose from (default: the synchronous
            ones, plus ``semi_sync`` when ``allow_staleness``).
        allow_lossy_comm: allow fp16/bf16 communication (and fp8 if also ``allow_fp8``).
        allow_staleness: allow ``semi_sync`` (one step of embedding staleness).
        time_budget_s: search time budget in seconds (default 10; ``timeout_seconds`` too).
    """

    def __init__(
        self,
        topology: Optional[Topology] = None,
        batch_size: Optional[int] = None,
        enumerator: Any = None,
        storage_reservation: Optional[StorageReservation] = None,
        proposer: Any = None,
        partitioner: Any = None,
        performance_model: Any = None,
        stats: Any = None,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        debug: bool = True,
        callbacks: Optional[List[Callable[[List[ShardingOption]], List[ShardingOption]]]] = None,
        timeout_seconds: Optional[int] = None,
        plan_loader: Any = None,
        *,
        hardware: Any = None,
        workload: Any = None,
        pipelines: Optional[Sequence[str]] = None,
        allow_lossy_comm: bool = False,
        allow_fp8: bool = False,
        allow_staleness: bool = False,
        time_budget_s: Optional[float] = None,
        heuristical_storage_reservation_percentage: float = 0.15,
    ) -> None:
        for name, value in (
            ("enumerator", enumerator), ("proposer", proposer), ("partitioner", partitioner),
            ("performance_model", performance_model), ("plan_loader", plan_loader),
        ):
            if value is not None:
                logger.warning(
                    "SparseLiftPlanner: %s=%s is a TorchRec search component that SparseLift "
                    "replaces; it is not used (use SparseLiftEnumerator/SparseLiftProposer inside "
                    "EmbeddingShardingPlanner to combine them)", name, type(value).__name__,
                )
        if batch_size is not None and batch_size <= 0:
            raise ValueError(f"batch_size must be a positive per-rank batch size, got {batch_size}")
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        if topology is None:
            topology = _default_topology()
        if topology.world_size % max(1, min(topology.local_world_size, topology.world_size)):
            raise ValueError(
                f"topology world_size {topology.world_size} is not a multiple of local_world_size "
                f"{topology.local_world_size}; set local_world_size to the ranks per host"
            )
        self._topology = topology
        self._batch_size = int(batch_size) if batch_size else DEFAULT_BATCH_SIZE
        self._constraints = dict(constraints) if constraints else None
        self._storage_reservation = storage_reservation or HeuristicalStorageReservation(
            percentage=heuristical_storage_reservation_percentage
        )
        self._stats = stats
        self._debug = debug
        self._callbacks = list(callbacks or [])
        self._budget = float(time_budget_s or timeout_seconds or 10.0)
        if isinstance(hardware, str):
            hardware = get_profile(hardware)
        self._hardware: Optional[HardwareProfile] = hardware
        self._workload = workload
        if pipelines is None:
            pipelines = SYNC_PIPELINES + (("semi_sync",) if allow_staleness else ())
        for p in pipelines:
            if p not in PIPELINES:
                raise ValueError(f"unknown pipeline {p!r}; choose from {PIPELINES}")
            if p == "semi_sync" and not allow_staleness:
                raise ValueError("pipeline 'semi_sync' trains on one-step-stale embeddings; "
                                 "pass allow_staleness=True to allow it")
        self._pipelines = tuple(pipelines)
        precs = [("fp32", "fp32")]
        if allow_lossy_comm:
            precs += [("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "bf16")]
            if allow_fp8:
                precs += [("fp8", "bf16")]
        self._precisions = tuple(precs)
        self.last_result: Optional[PlanResult] = None

    # -- ShardingPlanner API -----------------------------------------------------------
    def collective_plan(
        self,
        module: nn.Module,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
        pg: Optional[dist.ProcessGroup] = None,
    ) -> ShardingPlan:
        """Plan on rank 0 and broadcast, so every rank gets the identical plan."""
        if pg is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "collective_plan needs an initialized process group: call "
                    "torch.distributed.init_process_group() first, or use plan() on one process"
                )
            pg = dist.GroupMember.WORLD
        if sharders is None:
            sharders = get_default_sharders()
        return invoke_on_rank_and_broadcast_result(pg, 0, self.plan, module, sharders)

    def plan(
        self,
        module: nn.Module,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
    ) -> ShardingPlan:
        return self.plan_with_result(module, sharders).sharding_plan

    # -- the work ------------------------------------------------------------------------
    def plan_with_result(
        self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
    ) -> PlanResult:
        t0 = time.monotonic()
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        topo = self._topology
        handles = extract_tables(
            module, sharders, topo.compute_device, self._batch_size, self._constraints,
            self._workload,
        )
        if not handles:
            self.last_result = None
            return PlanResult(
                sharding_plan=ShardingPlan({}), sharding_options=(), search=None, problem=None,  # type: ignore[arg-type]
                handles=(), topology=topo, profile=self._profile(),
            )
        reserved = self._storage_reservation.reserve(
            topo, self._batch_size, module, sharders, self._constraints
        )
        profile = self._profile()
        ctx = CostContext(
            profile=profile,
            world_size=topo.world_size,
            local_world_size=min(topo.local_world_size, topo.world_size),
            batch_size=self._batch_size,
            dense=dense_work(module, handles),
        )
        if topo.compute_device == "cpu":
            device_cap = np.array([d.storage.ddr for d in reserved.devices], dtype=float)
            host_cap = device_cap.copy()
        else:
            device_cap = np.array([d.storage.hbm for d in reserved.devices], dtype=float)
            host_cap = np.array([d.storage.ddr for d in reserved.devices], dtype=float)
        prob = build_problem(
            [h.spec for h in handles], ctx, device_cap, host_cap,
            pipelines=self._pipelines, precisions=self._precisions,
        )
        result = solve(prob, time_budget_s=max(0.5, self._budget - (time.monotonic() - t0)))
        options = [
            to_sharding_option(h, prob, cid, ranks)
            for h, (cid, ranks) in zip(handles, result.assignment)
        ]
        for cb in self._callbacks:
            options = cb(options)
        _check_complete(handles, options)
        plan = to_sharding_plan(options, topo)
        res = PlanResult(
            sharding_plan=plan, sharding_options=tuple(options), search=result, problem=prob,
            handles=tuple(handles), topology=topo, profile=profile,
        )
        self.last_result = res
        if self._debug:
            logger.info("%s", res.summary())
        return res

    def _profile(self) -> HardwareProfile:
        return profile_for_topology(self._topology, self._hardware)


def _check_complete(handles: Sequence[TableHandle], options: Sequence[ShardingOption]) -> None:
    """A plan must place every table exactly once, every shard on a rank."""
    want = {(h.spec.module_path, h.spec.name) for h in handles}
    got = [(o.path, o.name) for o in options]
    missing = want - set(got)
    if missing or len(got) != len(set(got)):
        raise SparseLiftPlannerError(
            f"internal error: plan lost or duplicated tables {sorted(missing)}; please report it",
            kind="other",
        )
    for o in options:
        if any(s.rank is None for s in o.shards):
            raise SparseLiftPlannerError(f"internal error: table {o.fqn} has an unplaced shard")


def _default_topology() -> Topology:
    from torchrec.distributed.comm import get_local_size

    if not dist.is_initialized():
        raise RuntimeError(
            "SparseLiftPlanner needs a topology: pass topology=Topology(world_size=..., "
            "compute_device=..., local_world_size=...) or initialize torch.distributed first"
        )
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Topology(
        world_size=dist.get_world_size(), local_world_size=get_local_size(), compute_device=device
    )
