"""``SparseLiftPlanner``: a drop-in TorchRec ``ShardingPlanner``.

Swap one word::

    planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    plan = planner.collective_plan(model, sharders, pg)   # a normal torchrec ShardingPlan

The decision itself is :func:`torchrec_sparselift.plan.planning.plan`, a pure function of a
:class:`~torchrec_sparselift.plan.PlanRequest`. This module adds only what a TorchRec planner is:
TorchRec's arguments and methods, the plan loader and the ``Stats`` it logs to, the plan cache, and
the agreement of every rank on one request (``collective_plan``). SparseLift's own options are
checked and grouped by :func:`torchrec_sparselift.plan.options.planner_options`.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (
    ParameterConstraints, PlannerError, ShardingOption, Stats, StorageReservation, Topology,
)
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner

from torchrec_sparselift import defaults
from torchrec_sparselift.calibration.store import auto_profile_link
from torchrec_sparselift.calibration.term_error import ProfileOnLink, profile_errors, profile_on_link
from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile, profile_for_topology
from torchrec_sparselift.cost.report import rank_breakdown
from torchrec_sparselift.plan import ExecutionPlan, Fingerprint, PlanCache, PlanRequest
from torchrec_sparselift.plan.contract import has_shardable_tables, last_reserved, reservation_note, with_reservation
from torchrec_sparselift.plan.evaluate import evaluate_sharding_plan
from torchrec_sparselift.plan.loader import check_context, context_digest, context_hash_int
from torchrec_sparselift.plan.options import build_request, pipelines_for_cores, planner_options, request_tables
from torchrec_sparselift.plan.planning import execution_plan, loaded_result, plan_result, require_tables
from torchrec_sparselift.plan.result import PlanResult
from torchrec_sparselift.runtime.agreement import agreed, check_group_size, from_rank_0
from torchrec_sparselift.runtime.machine import machine_share
from torchrec_sparselift.search.problem import device_caps
from torchrec_sparselift.semantics.dense import dense_work

__all__ = ["SparseLiftPlanner", "PlanResult", "dense_work", "evaluate_sharding_plan", "rank_breakdown"]

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = defaults.BATCH_SIZE  # TorchRec's planner default


def _names_reservation(method: Callable[..., Any]) -> Callable[..., Any]:
    """Storage errors raised by ``method`` name the storage reservation planned under: what it
    keeps per device and what it left for the tables."""

    @functools.wraps(method)
    def wrapper(self: "SparseLiftPlanner", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except PlannerError as e:
            reserved = last_reserved(self._storage_reservation) or (
                self._last_context[1] if self._last_context is not None else None)
            new = with_reservation(e, reservation_note(self._storage_reservation, self._topology, reserved))
            if new is e:
                raise
            raise new from None

    return wrapper


class SparseLiftPlanner(ShardingPlanner):
    """A TorchRec ``ShardingPlanner`` that plans the sparse path with a cost model and a
    constraint-aware search.

    Takes ``EmbeddingShardingPlanner``'s arguments as TorchRec spells them: ``topology``,
    ``batch_size`` (per rank), ``constraints``, ``storage_reservation``, ``callbacks`` (applied to
    the final sharding options), ``debug``, ``timeout_seconds`` (the search budget), ``stats``
    (TorchRec ``Stats``, one or a list, given every plan SparseLift searches) and ``plan_loader``
    (TorchRec's ``PlanLoader``: a stored plan whose context hash matches
    :meth:`hash_planner_context_inputs_str` is validated and used instead of searching).
    ``enumerator``, ``proposer``, ``partitioner`` and ``performance_model`` are TorchRec search
    components that SparseLift replaces: passing one logs a warning that it is not used.

    SparseLift's keyword arguments (documented on the values they fill,
    :mod:`torchrec_sparselift.plan.options`): ``hardware`` (a ``HardwareProfile``, a preset name,
    a calibrated profile path, or "auto": this machine's step-fitted profile from the store) and
    ``workload`` (observed ``WorkloadStats``); the search's ``pipelines``, ``allow_lossy_comm``,
    ``allow_fp8``, ``allow_staleness``, ``time_budget_s``, ``solver``, ``cost_model``,
    ``estimator``; 2D's ``sharding_group_size``, ``sync_interval``, ``max_sync_interval``,
    ``layout_2d``, ``strategy_2d``; the never-slower rule's ``never_slower`` and ``model_errors``;
    the rewrite stage's ``rewrites`` (the rewrites the planner may choose, ``plan.rewrites.REWRITES``:
    None all, ``()`` none) and ``per_sample`` (declare the dense part per-sample for the batch split);
    the plan cache's ``cache_dir`` and ``drift_tolerance``; and
    ``heuristical_storage_reservation_percentage`` as TorchRec's planner has it.
    ``planner.last_result`` keeps the details of the last plan.
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
        heuristical_storage_reservation_percentage: float = defaults.STORAGE_RESERVATION_PERCENTAGE,
        cache_dir: Optional[str] = None,
        drift_tolerance: float = defaults.DRIFT_TOLERANCE,
        solver: str = defaults.SOLVER,
        sharding_group_size: Any = None,
        sync_interval: Optional[int] = None,
        cost_model: str = "sparselift",
        estimator: Any = None,
        max_sync_interval: Optional[int] = None,
        layout_2d: str = defaults.LAYOUT_2D,
        never_slower: Any = defaults.NEVER_SLOWER,
        strategy_2d: str = defaults.STRATEGY_2D,
        model_errors: Any = None,
        rewrites: Optional[Sequence[str]] = None,
        per_sample: bool = False,
    ) -> None:
        for name, value in (("enumerator", enumerator), ("proposer", proposer), ("partitioner", partitioner),
                            ("performance_model", performance_model)):
            if value is not None:
                logger.warning(
                    "SparseLiftPlanner: %s=%s is a TorchRec search component that SparseLift "
                    "replaces; it is not used (use SparseLiftEnumerator/SparseLiftProposer inside "
                    "EmbeddingShardingPlanner to combine them)", name, type(value).__name__,
                )
        topology = _default_topology() if topology is None else topology
        #: SparseLift's options, checked together and grouped (:mod:`torchrec_sparselift.plan.options`)
        self.options = planner_options(
            topology=topology, batch_size=batch_size, constraints=constraints, storage_reservation=storage_reservation,
            callbacks=callbacks, stats=stats, timeout_seconds=timeout_seconds,
            heuristical_storage_reservation_percentage=heuristical_storage_reservation_percentage,
            hardware=hardware, workload=workload, pipelines=pipelines, allow_lossy_comm=allow_lossy_comm,
            allow_fp8=allow_fp8, allow_staleness=allow_staleness, time_budget_s=time_budget_s, cache_dir=cache_dir,
            drift_tolerance=drift_tolerance, solver=solver, sharding_group_size=sharding_group_size,
            sync_interval=sync_interval, cost_model=cost_model, estimator=estimator,
            max_sync_interval=max_sync_interval, layout_2d=layout_2d, never_slower=never_slower,
            strategy_2d=strategy_2d, model_errors=model_errors, rewrites=rewrites, per_sample=per_sample)
        self._topology = topology
        self._batch_size = int(batch_size) if batch_size else DEFAULT_BATCH_SIZE
        self._constraints = dict(constraints) if constraints else None
        self._storage_reservation = storage_reservation or HeuristicalStorageReservation(
            percentage=heuristical_storage_reservation_percentage)
        self._stats: List[Stats] = [] if stats is None else list(stats) if isinstance(stats, list) else [stats]
        self._plan_loader = plan_loader
        self._debug = debug
        self._callbacks = list(callbacks or [])
        #: with hardware="auto": (the stored profile, where it is, the link it was calibrated on)
        self._stored: Optional[Tuple[HardwareProfile, str, Any]] = None
        if hardware == "auto":  # this machine's step-fitted profile (warns when it has none)
            local = defaults.ranks_per_host(topology)
            self._stored = auto_profile_link(topology.compute_device, local,
                                             hosts=max(1, topology.world_size // max(1, local)))
            hardware = self._stored[0]
        #: the profile this planner plans with on the link it was calibrated on (None: a preset
        #: chosen from the topology)
        self.hardware: Optional[HardwareProfile] = get_profile(hardware) if isinstance(hardware, str) else hardware
        self._last_context: Optional[Tuple[PlanRequest, Any]] = None  # (request, reserved topology)
        self.last_request: Optional[PlanRequest] = None  # the request of the last plan
        self.last_result: Optional[PlanResult] = None
        self.last_execution_plan: Optional[ExecutionPlan] = None
        self.last_cache_hit: Optional[bool] = None
        self.last_torchrec_problem: Any = None

    # -- ShardingPlanner API -----------------------------------------------------------
    def plan(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None) -> ShardingPlan:
        """A ``ShardingPlan`` for ``module``; ``ShardingPlan({})`` when no sharder shards any
        of its tables (``sharders=[]`` included), as TorchRec's planner returns."""
        if not has_shardable_tables(module, get_default_sharders() if sharders is None else sharders,
                                    self._topology.compute_device, self._batch_size):
            return ShardingPlan({})
        if self.options.cache.cache_dir:
            return self.plan_execution(module, sharders).sharding_plan
        return self.plan_with_result(module, sharders).sharding_plan

    def collective_plan(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
                        pg: Optional[dist.ProcessGroup] = None, link: Any = None) -> ShardingPlan:
        """Plan on rank 0 and broadcast, so every rank gets the identical plan.

        First every rank checks that all ranks plan the same request (tables, topology, batch
        size, constraints, statistics, options); if not, every rank raises an error naming the
        ranks that differ. Nothing to shard gives ``ShardingPlan({})`` on every rank.

        ``link``: the :class:`~torchrec_sparselift.calibration.link.LinkRates` this job sees
        (:func:`torchrec_sparselift.measure.link.measure_link_rates` on every rank of ``pg``). With
        ``hardware="auto"`` the plan uses :meth:`on_link`'s profile and errors (one warning names
        each corrected term). Ignored for an explicit profile or preset."""
        try:
            shardable = has_shardable_tables(module, get_default_sharders() if sharders is None else sharders,
                                             self._topology.compute_device, self._batch_size)
        except Exception:  # noqa: BLE001 - malformed input: the agreement check raises it on every rank
            shardable = True
        if not shardable:
            return ShardingPlan({})
        return self.collective_plan_execution(module, sharders, pg, link=link).sharding_plan

    def collective_plan_execution(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
                                  pg: Optional[dist.ProcessGroup] = None, link: Any = None) -> ExecutionPlan:
        """:meth:`plan_execution` on rank 0, broadcast to all ranks; ``link``: as in :meth:`collective_plan`."""
        t0 = time.monotonic()
        if pg is None:
            if not dist.is_initialized():
                raise RuntimeError("collective_plan needs an initialized process group: call "
                                   "torch.distributed.init_process_group() first, or use plan() on one process")
            pg = dist.GroupMember.WORLD
        check_group_size(self._topology, pg)
        on = self.on_link(link) if link is not None else None
        if on is not None and on.note is not None and dist.get_rank(pg) == 0:
            warnings.warn(f"sparselift: {on.note}", stacklevel=3)
        cores = self._pipelines_for_cores(pg, link)
        request = self.last_request = agreed(lambda: self._request(module, sharders, cores, on), pg)
        self.last_execution_plan = ExecutionPlan.from_json(
            from_rank_0(lambda: self._plan_execution(request, t0).to_json(), pg))
        return self.last_execution_plan

    # -- the request ---------------------------------------------------------------------
    def profile(self, on: Optional[ProfileOnLink] = None) -> HardwareProfile:
        """The profile a plan of this planner's topology prices with: :attr:`hardware` (or the
        topology's preset), or ``on``'s profile (:meth:`on_link`)."""
        return profile_for_topology(self._topology, on.profile if on is not None else self.hardware)

    def on_link(self, link: Any) -> Optional[ProfileOnLink]:
        """With ``hardware="auto"``: the stored profile moved to the measured ``link`` (a
        ``LinkRates``) with the never-slower rule's errors for it
        (:func:`~torchrec_sparselift.calibration.term_error.profile_on_link`); None for an explicit
        profile or preset, which plan as given."""
        if self._stored is None:
            return None
        profile, where, stored_link = self._stored
        return profile_on_link(profile, stored_link, link, where)

    def request(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
                on_link: Optional[ProfileOnLink] = None) -> PlanRequest:
        """The :class:`~torchrec_sparselift.plan.PlanRequest` for ``module``: its tables (after
        validating every input, all problems listed at once) and every option of this planner, on
        ``on_link``'s profile where given (:meth:`on_link`). The cache, the fingerprint, the rank
        agreement and :func:`~torchrec_sparselift.plan.planning.plan` read it."""
        return self._request(module, sharders, self.options.search.requested_pipelines(), on_link)

    @_names_reservation
    def _request(self, module: Any, sharders: Optional[Sequence[Any]], pipelines: Tuple[str, ...],
                 on: Optional[ProfileOnLink]) -> PlanRequest:
        sharders = () if module is None else list(sharders) if sharders is not None else get_default_sharders()
        handles, dense = ((), None) if module is None else request_tables(
            self.options, self._topology, self._batch_size, self._constraints, module, sharders)
        hardware = self.profile(on)
        return build_request(
            self.options, topology=self._topology, batch_size=self._batch_size, constraints=self._constraints,
            storage_reservation=self._storage_reservation, callbacks=self._callbacks, hardware=hardware,
            pipelines=pipelines, handles=handles, dense=dense, module=module, sharders=sharders,
            model_errors=self._errors(hardware, on) if handles else None)

    def _errors(self, profile: HardwareProfile, on: Optional[ProfileOnLink]) -> Any:
        """The never-slower rule's error per term for ``profile`` where the rule runs: the given
        ``model_errors``, else ``on``'s, else the stored step fit's (``hardware="auto"``, or a
        profile equal to a stored one), else the documented error of an uncalibrated profile."""
        rule = self.options.rule
        if rule.never_slower is False or self.options.search.cost_model != "sparselift":
            return None
        if rule.model_errors is not None or on is not None:
            return rule.model_errors or on.errors
        return profile_errors(self.hardware or profile, self._stored[1] if self._stored is not None else None)

    def _pipelines_for_cores(self, pg: Any, link: Any = None) -> Tuple[str, ...]:
        """:func:`~torchrec_sparselift.plan.options.pipelines_for_cores` on this job's machine share
        (``link``'s, else one all-gather: ``runtime.machine.machine_share``); every rank alike."""
        if link is not None and getattr(link, "machine_ranks", None) is not None:
            ranks, cores = int(link.machine_ranks), int(link.machine_cores)
        elif self.options.search.pipelines_by_default and self._topology.compute_device == "cpu":
            ranks, cores = machine_share(pg)
        else:
            ranks, cores = 1, 1
        kept, left = pipelines_for_cores(self.options.search, self._topology.compute_device, ranks, cores)
        if left and dist.get_rank(pg) == 0:
            warnings.warn(f"sparselift: {ranks} ranks share a machine with {cores} CPU cores; the pipelines that "
                          f"overlap communication beside the ranks' compute ({', '.join(left)}) need a core per rank, "
                          "so the plan chooses among the others (pass pipelines=[...] to choose yourself)", stacklevel=4)
        return kept

    def fingerprint(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None) -> Fingerprint:
        """What a stored plan must match to be reused: :meth:`request`'s fingerprint."""
        return self.request(module, sharders).fingerprint()

    def memory_caps(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
        """Per-rank (device, host) bytes a plan of ``module`` may fill on the whole topology: what
        the storage reservation leaves, as :meth:`plan` reserves it (on CPU both are the rank's DDR)."""
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        return device_caps(self._storage_reservation.reserve(self._topology, self._batch_size, module, sharders,
                                                             self._constraints))

    # -- planning --------------------------------------------------------------------------
    def plan_execution(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
                       ) -> ExecutionPlan:
        """Plan and return an ``ExecutionPlan``. With ``cache_dir`` set, a stored plan with the
        same fingerprint is loaded instead of planning; a missing, corrupt, stale or drifted one,
        or one the request's guards or shape refuse (:meth:`PlanRequest.refuses`), is re-planned
        (one log line says why) and stored."""
        t0 = time.monotonic()
        return self._plan_execution(self.request(module, sharders), t0)

    def plan_with_result(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
                         ) -> PlanResult:
        """Plan ``module`` and return the details (:class:`PlanResult`); no cache involved."""
        t0 = time.monotonic()
        return self._result(self.request(module, sharders), t0)

    def _plan_execution(self, request: PlanRequest, t0: float) -> ExecutionPlan:
        cache = self.options.cache
        if not cache.cache_dir:
            ep, hit = execution_plan(request, self._result(request, t0)), None
        else:
            ep, hit = PlanCache(cache.cache_dir).get_or_plan(
                request.fingerprint(), lambda: execution_plan(request, self._result(request, t0)), request.stats,
                cache.drift_tolerance, request=request)
        self.last_cache_hit = hit
        self.last_execution_plan = ep
        return ep

    @_names_reservation
    def _result(self, request: PlanRequest, t0: float) -> PlanResult:
        """The plan loader's plan where it has one, else :func:`~torchrec_sparselift.plan.planning.plan_result`;
        logged to the user's ``Stats``."""
        self.last_request = request
        require_tables(request)
        reserved = self._storage_reservation.reserve(self._topology, self._batch_size, request.module,
                                                     list(request.sharder_objects), self._constraints)
        self._last_context = (request, reserved)
        if self._plan_loader is not None:  # TorchRec's PlanLoader: its plan, where it has one, instead of a search
            check_context(self._plan_loader, self.hash_planner_context_inputs_str())
            res = loaded_result(self._plan_loader, request, self._callbacks)
            if res is not None:
                self.last_result = res
                return res
        res = plan_result(request, t0)
        self.last_result = res
        self.last_torchrec_problem = res.torchrec_problem
        if self._debug:
            logger.info("%s", res.summary())
        for s in self._stats:  # as EmbeddingShardingPlanner hands its plan to the user's Stats
            s.log(sharding_plan=res.sharding_plan, topology=self._topology, batch_size=self._batch_size,
                  storage_reservation=self._storage_reservation, num_proposals=1, num_plans=1,
                  run_time=time.monotonic() - t0, best_plan=list(res.sharding_options),
                  constraints=self._constraints, sharders=list(request.sharder_objects), debug=self._debug)
        return res

    # -- TorchRec's plan-loading contract ------------------------------------------------
    def hash_planner_context_inputs_str(self) -> str:
        """A stable hash (sha256 hex) of the planning context: tables of the module last planned,
        topology, batch size, constraints, statistics, hardware, planner options, the storage
        reservation and the topology it reserved. Before any ``plan()`` it covers the planner's
        context without tables. What a ``PlanLoader``'s ``plan_context_hash()`` must return."""
        if self._last_context is not None:
            return context_digest(*self._last_context)
        return context_digest(self._request(None, (), self.options.search.requested_pipelines(), None),
                              last_reserved(self._storage_reservation))

    def hash_planner_context_inputs(self) -> int:
        """:meth:`hash_planner_context_inputs_str` as a non-negative int."""
        return context_hash_int(self.hash_planner_context_inputs_str())


def _default_topology() -> Topology:
    if not dist.is_initialized():
        raise ValueError("SparseLiftPlanner needs a topology: pass topology=Topology(world_size=..., "
                         "compute_device=..., local_world_size=...) or initialize torch.distributed first")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Topology(world_size=dist.get_world_size(), local_world_size=get_local_size(), compute_device=device)
