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
    PlannerError,
    ShardingOption,
    StorageReservation,
    Topology,
)
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner

from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile, profile_for_topology
from torchrec_sparselift.cost.model import PIPELINES, CostContext, DenseWork
from torchrec_sparselift.cost.two_d import choose_sync_interval, group_sizes, replica_sync_s
from torchrec_sparselift.plan import (
    ExecutionPlan,
    Fingerprint,
    Optimizations,
    PlanCache,
    PlanRequest,
    Prediction,
    RankPrediction,
)
from torchrec_sparselift.plan.request import describe_sharders
from torchrec_sparselift.search.errors import SparseLiftPlannerError
from torchrec_sparselift.search.options import to_sharding_option
from torchrec_sparselift.search.problem import PlanningProblem, build_problem, device_caps
from torchrec_sparselift.search.solve import SearchResult, solve
from torchrec_sparselift.semantics.tables import TableHandle, extract_tables
from torchrec_sparselift.validation import validate_inputs

__all__ = ["SparseLiftPlanner", "PlanResult", "dense_work", "evaluate_sharding_plan", "rank_breakdown"]

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
    sharding_group_size: Optional[int] = None  # None: 1D (tables sharded over all ranks)
    sync_interval: int = 1
    sync_s: float = 0.0  # replica sync per step (amortised), 2D only
    alternatives_2d: Tuple[Tuple[int, float], ...] = ()  # (group size, predicted step s)

    @property
    def step_time_s(self) -> float:
        """Predicted steady-state step time including 2D replica sync."""
        return self.search.step.total_s + self.sync_s

    def rank_breakdown(self) -> List[Dict[str, float]]:
        """Per rank: compute, communication (exposed / overlapped) seconds and memory bytes."""
        return rank_breakdown(self.problem.ctx, self.search)

    def optimizations(self) -> Optimizations:
        s = self.search
        return Optimizations(pipeline=s.pipeline, fwd_comm_precision=s.fwd_precision,
                             bwd_comm_precision=s.bwd_precision,
                             sharding_group_size=self.sharding_group_size,
                             sync_interval=self.sync_interval)

    def prediction(self) -> Prediction:
        s = self.search
        per_rank = [
            RankPrediction(rank=r, compute_s=b["compute_s"], exposed_comm_s=b["exposed_comm_s"],
                           overlapped_comm_s=b["overlapped_comm_s"], hbm_bytes=int(b["device_bytes"]),
                           ddr_bytes=int(b["host_bytes"]))
            for r, b in enumerate(self.rank_breakdown())
        ]
        lb = s.lower_bound_s if np.isfinite(s.lower_bound_s) else 0.0
        return Prediction(step_time_s=self.step_time_s, lower_bound_s=min(lb, self.step_time_s),
                          per_rank=per_rank, cost_model=f"sparselift/{self.profile.name}")

    def summary(self) -> str:
        s = self.search
        lines = [
            f"SparseLift plan: {len(self.handles)} tables on {self.topology.world_size} ranks "
            f"({self.profile.name}), pipeline={s.pipeline}, comm={s.fwd_precision}/{s.bwd_precision}"
            + (f", 2D: groups of {self.sharding_group_size} ranks, replica sync every "
               f"{self.sync_interval} steps ({self.sync_s * 1e3:.3f} ms/step)"
               if self.sharding_group_size else ", 1D"),
            f"  predicted step {self.step_time_s * 1e3:.3f} ms, lower bound "
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


def rank_breakdown(ctx: CostContext, search: SearchResult) -> List[Dict[str, float]]:
    """Each rank's compute and communication seconds, and memory, under the plan's pipeline."""
    from torchrec_sparselift.cost.model import (
        BWD, DEV_MEM, FWD, HOST_MEM, IN_INTER, IN_INTRA, OUT_INTER, OUT_INTRA, PRECISION_BYTES, UVM,
    )

    p = ctx.profile
    L = search.rank_loads
    dense = 3 * ctx.dense.fwd_flops_per_sample * ctx.batch_size / p.dense_flops
    fs = PRECISION_BYTES[search.fwd_precision] / 4
    bs = PRECISION_BYTES[search.bwd_precision] / 4
    out = []
    step = search.step.total_s
    for r in range(L.shape[0]):
        compute = float(L[r, FWD] + L[r, BWD] + L[r, UVM] + dense)
        comm_in = max(L[r, IN_INTRA] / p.intra_host_bw, L[r, IN_INTER] / p.inter_host_bw)
        comm_out = max(L[r, OUT_INTRA] / p.intra_host_bw, L[r, OUT_INTER] / p.inter_host_bw)
        comm = float(comm_in + (fs + bs) * comm_out)
        exposed = float(min(comm, max(0.0, step - compute)))
        out.append({
            "compute_s": compute,
            "comm_s": comm,
            "exposed_comm_s": exposed,
            "overlapped_comm_s": float(comm - exposed),
            "device_bytes": float(L[r, DEV_MEM]),
            "host_bytes": float(L[r, HOST_MEM]),
        })
    return out


def _ranks_repr(ranks: Sequence[int]) -> str:
    r = list(ranks)
    if len(r) > 4 and r == list(range(r[0], r[0] + len(r))):
        return f"{r[0]}..{r[-1]}"
    return ",".join(map(str, r))


def dense_work(module: nn.Module, handles: Sequence[TableHandle]) -> DenseWork:
    """Dense parameters (bytes) and forward FLOPs per sample, from the module's non-embedding
    parameters (2 FLOPs per weight per sample: a multiply and an add) plus known parameter-free
    work (DLRM's dot interaction)."""
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
    flops = 2.0 * numel + _interaction_flops(module, handles)
    return DenseWork(param_bytes=float(nbytes), fwd_flops_per_sample=flops)


def _interaction_flops(module: nn.Module, handles: Sequence[TableHandle]) -> float:
    """FLOPs per sample of parameter-free dense work TorchRec models do: DLRM's pairwise dot
    interaction (``InteractionArch``: a batched ``(F+1) x D`` by ``D x (F+1)`` product)."""
    dims = [h.spec.embedding_dim for h in handles]
    if not dims:
        return 0.0
    dim = max(dims)
    total = 0.0
    for m in module.modules():
        if type(m).__name__ == "InteractionArch" and isinstance(getattr(m, "F", None), int):
            total += 2.0 * (m.F + 1) ** 2 * dim
    return total


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
        time_budget_s: search time budget in seconds (default 8; ``timeout_seconds`` too).
        cache_dir: directory of reusable execution plans (see :meth:`plan_execution`).
        solver: "auto" (default: LP + greedy + local search; the exact MILP too on tiny
            instances), "heuristic", or "milp" (exact MILP over choice and placement with half
            the time budget; keeps the better plan and the tighter lower bound).
        sharding_group_size: None (default, 1D: a plan for plain ``DistributedModelParallel``),
            "auto" (2D sparse parallelism: the planner picks the group size, possibly the whole
            world) or a divisor of the world size. A 2D plan's ranks are group-local: apply it
            with ``torchrec_sparselift.runtime.lift`` (which builds ``DMPCollection``).
        sync_interval: pin the 2D replica sync interval (steps); default: the smallest interval
            whose amortised sync costs at most 5% of the step.
        cost_model: "sparselift" (default: SparseLift's cost model, pipelines and precisions) or
            "torchrec": optimize TorchRec's own rating instead (every shard's ``Perf``/``Storage``
            from TorchRec's estimators, objective = the slowest rank's summed ``Perf.total`` as
            ``NoopPerfModel`` rates it, memory = the storage estimates under the reservation);
            same search, same outputs (see :mod:`torchrec_sparselift.search.torchrec_objective`).
        estimator: with ``cost_model="torchrec"``, the ``ShardEstimator`` (or list) to use instead
            of TorchRec's defaults, as ``EmbeddingEnumerator(estimator=...)`` takes it (it
            replaces both defaults: include a storage estimator).
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
        cache_dir: Optional[str] = None,
        drift_tolerance: float = 0.2,
        solver: str = "auto",
        sharding_group_size: Any = None,
        sync_interval: Optional[int] = None,
        cost_model: str = "sparselift",
        estimator: Any = None,
    ) -> None:
        """See the class docstring. ``cache_dir``: reuse execution plans across runs (a run
        whose inputs match a stored plan's fingerprint loads it instead of planning);
        ``drift_tolerance``: how far observed statistics may move before a stored plan is
        re-planned."""
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
        self._budget = float(time_budget_s or timeout_seconds or 8.0)
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
        self._allow_lossy_comm = bool(allow_lossy_comm)
        self._allow_fp8 = bool(allow_fp8)
        self._allow_staleness = bool(allow_staleness)
        if solver not in ("auto", "heuristic", "milp"):
            raise ValueError(f"solver must be 'auto', 'heuristic' or 'milp', got {solver!r}")
        self._solver = solver
        if cost_model not in ("sparselift", "torchrec"):
            raise ValueError(f"cost_model must be 'sparselift' or 'torchrec', got {cost_model!r}")
        if estimator is not None and cost_model != "torchrec":
            raise ValueError("estimator= is TorchRec's ShardEstimator: pass cost_model='torchrec' with it")
        self._cost_model = cost_model
        self._estimator = estimator
        if sharding_group_size not in (None, "auto") and (
            not isinstance(sharding_group_size, int) or sharding_group_size < 1
            or topology.world_size % sharding_group_size
        ):
            raise ValueError(
                f"sharding_group_size must be None (1D), 'auto' or a divisor of the world size "
                f"{topology.world_size}, got {sharding_group_size!r}"
            )
        if isinstance(sharding_group_size, int) and sharding_group_size < topology.world_size:
            L = min(topology.local_world_size, topology.world_size)
            if sharding_group_size % L and L % sharding_group_size:
                raise ValueError(
                    f"sharding_group_size {sharding_group_size} must be a multiple or a divisor of "
                    f"the ranks per host ({L}), so every group has whole hosts or fits in one"
                )
        if sync_interval is not None and (not isinstance(sync_interval, int) or sync_interval < 1):
            raise ValueError(f"sync_interval must be a positive number of steps, got {sync_interval!r}")
        self._group = sharding_group_size
        self._sync_interval = sync_interval
        self._cache_dir = cache_dir
        self._drift_tolerance = float(drift_tolerance)
        self.last_result: Optional[PlanResult] = None
        self.last_execution_plan: Any = None
        self.last_cache_hit: Optional[bool] = None

    # -- ShardingPlanner API -----------------------------------------------------------
    def collective_plan(
        self,
        module: nn.Module,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
        pg: Optional[dist.ProcessGroup] = None,
    ) -> ShardingPlan:
        """Plan on rank 0 and broadcast, so every rank gets the identical plan.

        First every rank checks that all ranks are planning the same input (tables, topology,
        batch size, constraints, statistics); if not, every rank raises an error naming the
        ranks that differ, instead of hanging or sharding inconsistently.
        """
        return self.collective_plan_execution(module, sharders, pg).sharding_plan

    def collective_plan_execution(
        self,
        module: nn.Module,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
        pg: Optional[dist.ProcessGroup] = None,
    ) -> ExecutionPlan:
        """:meth:`plan_execution` on rank 0, broadcast to all ranks (an ``ExecutionPlan``)."""
        t0 = time.monotonic()
        if pg is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "collective_plan needs an initialized process group: call "
                    "torch.distributed.init_process_group() first, or use plan() on one process"
                )
            pg = dist.GroupMember.WORLD
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        request = self._check_ranks_agree(module, sharders, pg)
        local_error: List[Any] = [None]

        def plan_on_rank_0() -> Tuple[Any, ...]:
            try:
                return ("ok", self._plan_execution(request, module, sharders, t0).to_json())
            except Exception as e:  # noqa: BLE001 - shared with every rank, re-raised below
                local_error[0] = e
                return ("error", type(e).__name__, getattr(e, "kind", None), str(e))

        out = invoke_on_rank_and_broadcast_result(pg, 0, plan_on_rank_0)
        if out[0] == "error":
            _reraise_shared(out, local_error[0], "rank 0 could not plan")
        ep = ExecutionPlan.from_json(out[1])
        self.last_execution_plan = ep
        return ep

    def _check_ranks_agree(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]],
                           pg: Any) -> PlanRequest:
        """All ranks must plan the same request (:meth:`PlanRequest.digest`); an error on one
        rank is raised on every rank (instead of leaving the others waiting in a collective).
        Returns this rank's request."""
        local_error = None
        request: Optional[PlanRequest] = None
        try:
            request = self.request(module, sharders)
            mine: Any = ("ok", request.digest())
        except Exception as e:  # noqa: BLE001 - every rank learns of it through the all_gather
            local_error = e
            mine = ("error", type(e).__name__, getattr(e, "kind", None), str(e))
        entries: List[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(entries, mine, group=pg)
        failed = [r for r, e in enumerate(entries) if e[0] == "error"]
        if failed:
            _reraise_shared(entries[failed[0]], local_error, f"rank(s) {failed} have invalid planning input")
        digests = [e[1] for e in entries]
        if len(set(digests)) > 1:
            groups: Dict[str, List[int]] = {}
            for r, d in enumerate(digests):
                groups.setdefault(d, []).append(r)
            majority = max(groups.values(), key=len)
            differ = sorted(r for rs in groups.values() if rs is not majority for r in rs)
            raise SparseLiftPlannerError(
                f"ranks planned different inputs: ranks {differ} differ from ranks {majority} "
                "(tables, topology, batch size, constraints, workload statistics or planner "
                "options). Build the model and the planner identically on every rank.",
                kind="other",
            )
        assert request is not None
        return request

    def plan(
        self,
        module: nn.Module,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
    ) -> ShardingPlan:
        if self._cache_dir:
            return self.plan_execution(module, sharders).sharding_plan
        return self.plan_with_result(module, sharders).sharding_plan

    def request(
        self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
    ) -> PlanRequest:
        """The :class:`~torchrec_sparselift.plan.PlanRequest` for ``module``: its tables (after
        validating every input, all problems listed at once) and every option of this planner.
        One ``plan()`` builds exactly one; the cache, the fingerprint, the rank-agreement check
        and the ``ExecutionPlan`` read it."""
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        topo = self._topology
        handles = extract_tables(
            module, sharders, topo.compute_device, self._batch_size, self._constraints,
            self._workload,
        )
        validate_inputs(handles, topo, self._batch_size, self._constraints, self._workload)
        return self._request(handles, dense_work(module, handles), sharders)

    def _request(self, handles: Sequence[TableHandle], dense: DenseWork,
                 sharders: Sequence[Any]) -> PlanRequest:
        """The request for validated tables (none: this planner's context alone)."""
        return PlanRequest(
            tables=tuple(h.spec for h in handles), handles=tuple(handles), topology=self._topology,
            batch_size=self._batch_size, constraints=self._constraints, stats=self._workload,
            hardware=self._profile(), dense=dense,
            sharders=describe_sharders(sharders), storage_reservation=self._storage_reservation,
            callbacks=tuple(self._callbacks), pipelines=self._pipelines, precisions=self._precisions,
            allow_lossy_comm=self._allow_lossy_comm, allow_fp8=self._allow_fp8,
            allow_staleness=self._allow_staleness, solver=self._solver,
            time_budget_s=self._budget, sharding_group_size=self._group,
            sync_interval=self._sync_interval, cost_model=self._cost_model_id(),
        )

    def fingerprint(
        self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
    ) -> Fingerprint:
        """What a stored plan must match to be reused: :meth:`request`'s fingerprint."""
        return self.request(module, sharders).fingerprint()

    def plan_execution(
        self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
    ) -> ExecutionPlan:
        """Plan and return an ``ExecutionPlan`` (sharding plan + optimizations + prediction +
        fingerprint). With ``cache_dir`` set, a stored plan with the same fingerprint is loaded
        instead of planning; a missing, corrupt, stale or drifted one, or one this request's
        guards or shape refuse (:meth:`PlanRequest.refuses`), is re-planned (one log line says
        why) and stored."""
        t0 = time.monotonic()
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        return self._plan_execution(self.request(module, sharders), module, sharders, t0)

    def _plan_execution(self, request: PlanRequest, module: nn.Module,
                        sharders: List[ModuleSharder[nn.Module]], t0: float) -> ExecutionPlan:
        fp = request.fingerprint()
        if not self._cache_dir:
            ep = self._execution_plan(request, module, sharders, fp, t0)
            self.last_cache_hit = None
        else:
            ep, hit = PlanCache(self._cache_dir).get_or_plan(
                fp, lambda: self._execution_plan(request, module, sharders, fp, t0), request.stats,
                self._drift_tolerance, request=request,
            )
            self.last_cache_hit = hit
        self.last_execution_plan = ep
        return ep

    def _execution_plan(self, request: PlanRequest, module: nn.Module,
                        sharders: List[ModuleSharder[nn.Module]], fp: Fingerprint,
                        t0: float) -> ExecutionPlan:
        res = self._plan_request(request, module, sharders, t0)
        return ExecutionPlan(
            sharding_plan=res.sharding_plan,
            optimizations=res.optimizations(),
            prediction=res.prediction(),
            fingerprint=fp,
            stats=request.stats,
            planner_info={
                "planner": "SparseLiftPlanner",
                "solver": res.search.solver if res.search else "none",
                "status": res.search.status if res.search else "empty",
                "planning_time_s": round(res.search.planning_time_s, 4) if res.search else 0.0,
                "hardware": res.profile.name,
                "alternatives": {k: v for k, v in res.search.alternatives} if res.search else {},
            },
        )

    # -- the work ------------------------------------------------------------------------
    def plan_with_result(
        self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
    ) -> PlanResult:
        """Plan ``module`` and return the details (:class:`PlanResult`); no cache involved."""
        t0 = time.monotonic()
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        return self._plan_request(self.request(module, sharders), module, sharders, t0)

    def _plan_request(self, request: PlanRequest, module: nn.Module,
                      sharders: List[ModuleSharder[nn.Module]], t0: float) -> PlanResult:
        topo = self._topology
        handles = list(request.handles)
        if not handles:
            raise SparseLiftPlannerError(
                "the module has no embedding tables that the given sharders can shard; pass the "
                "model that holds the EmbeddingBagCollection/EmbeddingCollection and matching sharders",
                kind="other",
            )
        if self._group is None:
            res = self._solve_group(module, sharders, handles, topo.world_size, self._budget, t0)
        else:
            sizes = [self._group] if isinstance(self._group, int) else group_sizes(
                topo.world_size, topo.local_world_size)
            budget = self._budget / (len(sizes) + 1)
            results: List[PlanResult] = []
            failures: List[str] = []
            for g in sizes:
                try:
                    results.append(self._solve_group(module, sharders, handles, g, budget,
                                                     time.monotonic()))
                except PlannerError as e:  # tables do not fit in g ranks
                    failures.append(f"group size {g}: {str(e).splitlines()[0]}")
            if not results:
                raise SparseLiftPlannerError(
                    "no sharding-group size fits the tables:\n  " + "\n  ".join(failures),
                    kind="insufficient_storage",
                )
            best = min(results, key=lambda r: (r.step_time_s, -(r.sharding_group_size or topo.world_size)))
            alts = tuple((r.sharding_group_size or topo.world_size, r.step_time_s) for r in results)
            # polish the winner with the full budget left
            left = max(0.5, self._budget - (time.monotonic() - t0))
            g = best.sharding_group_size or topo.world_size
            res = self._solve_group(module, sharders, handles, g, left, time.monotonic())
            if res.step_time_s > best.step_time_s:
                res = best
            res = attrs.evolve(res, alternatives_2d=alts)
        self.last_result = res
        if self._debug:
            logger.info("%s", res.summary())
        return res

    def _solve_group(self, module: nn.Module, sharders: Sequence[Any], handles: Sequence[TableHandle],
                     group: int, budget: float, t0: float) -> PlanResult:
        """Plan the tables over ``group`` ranks (the whole world for 1D)."""
        topo = self._topology
        W = topo.world_size
        gtopo = topo if group == W else _sub_topology(topo, group)
        reserved = self._storage_reservation.reserve(
            gtopo, self._batch_size, module, list(sharders), self._constraints
        )
        profile = self._profile()
        if self._cost_model == "torchrec":
            return self._solve_group_torchrec(module, sharders, handles, gtopo, reserved, profile,
                                              budget, t0)
        ctx = CostContext(
            profile=profile,
            world_size=group,
            local_world_size=min(topo.local_world_size, group),
            batch_size=self._batch_size,
            dense=dense_work(module, handles),
        )
        device_cap, host_cap = device_caps(reserved)
        prob = build_problem(
            [h.spec for h in handles], ctx, device_cap, host_cap,
            pipelines=self._pipelines, precisions=self._precisions,
        )
        result = solve(prob, time_budget_s=max(0.5, budget - (time.monotonic() - t0)),
                       solver=self._solver)
        options = [
            to_sharding_option(h, prob, cid, ranks)
            for h, (cid, ranks) in zip(handles, result.assignment)
        ]
        for cb in self._callbacks:
            options = cb(options)
        _check_complete(handles, options)
        plan = to_sharding_plan(options, gtopo)
        sync_s, interval = 0.0, 1
        if self._group is not None and group < W:
            per_rank = np.zeros(group)
            for cid, ranks in result.assignment:
                c = prob.cands[cid]
                spec = prob.specs[c.table]
                b = c.shard_rows * c.shard_cols * spec.elem_bytes + c.shard_rows * 4
                for r in ranks:
                    per_rank[r] += b
            one = replica_sync_s(float(per_rank.max()), W, group, profile)
            interval = self._sync_interval or choose_sync_interval(result.step.total_s, one)
            sync_s = one / interval
        return PlanResult(
            sharding_plan=plan, sharding_options=tuple(options), search=result, problem=prob,
            handles=tuple(handles), topology=topo, profile=profile,
            sharding_group_size=(group if self._group is not None and group < W else None),
            sync_interval=interval, sync_s=sync_s,
        )

    def _profile(self) -> HardwareProfile:
        return profile_for_topology(self._topology, self._hardware)

    def _cost_model_id(self) -> str:
        """``cost_model`` as the plan request records it: with TorchRec's objective, the
        estimators' identity too, so cached plans of different estimators do not mix."""
        if self._cost_model != "torchrec":
            return self._cost_model
        from torchrec_sparselift.search.torchrec_objective import estimator_identity

        return f"torchrec:{estimator_identity(self._estimator)}"

    def _solve_group_torchrec(self, module: nn.Module, sharders: Sequence[Any],
                              handles: Sequence[TableHandle], gtopo: Topology, reserved: Topology,
                              profile: HardwareProfile, budget: float, t0: float) -> "PlanResult":
        """``cost_model="torchrec"``: plan ``gtopo`` under TorchRec's estimators (1D only)."""
        from torchrec_sparselift.search.torchrec_objective import (
            build_torchrec_problem, placed_options, solve_torchrec,
        )

        if self._group is not None:
            raise ValueError("cost_model='torchrec' plans 1D only (TorchRec's rating has no 2D "
                             "replica sync); use sharding_group_size=None")
        trp = build_torchrec_problem(module, list(sharders), [h.spec for h in handles], gtopo,
                                     reserved, self._batch_size, profile, self._constraints,
                                     self._estimator)
        result = solve_torchrec(trp, max(0.5, budget - (time.monotonic() - t0)), self._solver)
        options = placed_options(trp, result.assignment)
        for cb in self._callbacks:
            options = cb(options)
        _check_complete(handles, options)
        self.last_torchrec_problem = trp
        return PlanResult(
            sharding_plan=to_sharding_plan(options, gtopo), sharding_options=tuple(options),
            search=result, problem=trp.problem, handles=tuple(handles), topology=self._topology,
            profile=trp.problem.ctx.profile,
        )


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


def _reraise_shared(out: Any, local_error: Any, who: str) -> None:
    """Raise, on every rank, the error one rank reported: the original object where it
    happened, the same kind and message elsewhere."""
    if local_error is not None:
        raise local_error
    _, name, kind, msg = out
    if name == "ValueError":
        raise ValueError(f"{who}: {msg}")
    raise SparseLiftPlannerError(f"{who}: {msg}" if kind else f"{who}: {name}: {msg}", kind=kind or "other")


def _sub_topology(topo: Topology, group: int) -> Topology:
    """The topology one sharding group sees: ``group`` ranks with the same devices."""
    dev = topo.devices[0].storage
    kw = dict(world_size=group, local_world_size=min(topo.local_world_size, group),
              compute_device=topo.compute_device, ddr_cap=dev.ddr)
    if topo.compute_device != "cpu":
        kw["hbm_cap"] = dev.hbm
    return Topology(**kw)


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


def evaluate_sharding_plan(
    module: nn.Module,
    plan: ShardingPlan,
    topology: Topology,
    batch_size: int,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    hardware: Any = None,
    workload: Any = None,
    sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
    pipeline: str = "sparse_dist",
    fwd_precision: str = "fp32",
    bwd_precision: str = "fp32",
) -> PlanResult:
    """Price any ``ShardingPlan`` (e.g. TorchRec's) under SparseLift's cost model.

    Returns a :class:`PlanResult` whose ``search.step`` is the predicted step time under
    ``pipeline``; its lower bound is the LP bound of the same tables and topology. Column-wise
    shards are priced as equal splits of the table's width.
    """
    from torchrec_sparselift.cost.model import shard_cost
    from torchrec_sparselift.search.lp import solve_lp
    from torchrec_sparselift.search.solve import new_evaluator
    from torchrec_sparselift.semantics.graph import candidate_for

    sharders = list(sharders) if sharders is not None else get_default_sharders()
    profile = profile_for_topology(topology, get_profile(hardware) if isinstance(hardware, str) else hardware)
    handles = extract_tables(module, sharders, topology.compute_device, batch_size, constraints, workload)
    ctx = CostContext(profile=profile, world_size=topology.world_size,
                      local_world_size=min(topology.local_world_size, topology.world_size),
                      batch_size=batch_size, dense=dense_work(module, handles))
    inf = np.full(topology.world_size, np.inf)
    prob = build_problem([h.spec for h in handles], ctx, inf, inf, pipelines=(pipeline,),
                         precisions=((fwd_precision, bwd_precision),))
    cands = list(prob.cands)
    costs = list(prob.costs)
    assignment = []
    for t, h in enumerate(handles):
        module_plan = plan.plan.get(h.spec.module_path)
        ps = module_plan.get(h.spec.name) if module_plan is not None else None
        if ps is None:
            raise ValueError(f"the plan has no sharding for table {h.spec.fqn!r}")
        splits = len(ps.ranks) if ps.sharding_type in ("column_wise", "table_column_wise") else 1
        cand = candidate_for(t, h.spec, ps.sharding_type, ps.compute_kernel, ctx.world_size,
                             ctx.local_world_size, splits)
        cands.append(cand)
        costs.append(shard_cost(h.spec, cand, ctx))
        assignment.append((len(cands) - 1, tuple(int(r) for r in ps.ranks)))
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
