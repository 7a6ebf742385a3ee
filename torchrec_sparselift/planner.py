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

import functools
import logging
import os
import time
import warnings
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
    Stats,
    StorageReservation,
    Topology,
)
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner

from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile, profile_for_topology
from torchrec_sparselift.cost.model import CostContext, DenseWork
from torchrec_sparselift.cost.report import rank_breakdown
from torchrec_sparselift.cost.pipelines import trainable_pipelines
from torchrec_sparselift import defaults
from torchrec_sparselift.vocabulary import (
    COST_MODELS, LAYOUT_2D_CHOICES, LOSSY_COMM_PRECISIONS, STRATEGY_2D_CHOICES, PIPELINES, STALE_PIPELINES, SYNC_PIPELINES,
    comm_precision_pairs, has_side_streams, pipeline as pipeline_kind,
)
from torchrec_sparselift.cost.two_d import check_sync_interval
from torchrec_sparselift.semantics.layout import Layout2D
from torchrec_sparselift.plan import ExecutionPlan, Fingerprint, PlanCache, PlanRequest
from torchrec_sparselift.plan.contract import (
    has_shardable_tables, last_reserved, reservation_note, with_reservation,
)
from torchrec_sparselift.plan.loader import check_context, context_digest, context_hash_int, loaded_options
from torchrec_sparselift.plan.request import describe_sharders
from torchrec_sparselift.plan.evaluate import evaluate_sharding_plan
from torchrec_sparselift.plan.baseline import TermErrors
from torchrec_sparselift.plan.result import PlanResult
from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.search.options import to_sharding_option
from torchrec_sparselift.search.problem import build_problem, device_caps
from torchrec_sparselift.search.solve import solve
from torchrec_sparselift.search.two_d import (
    choose_replica_sync, group_setting, search_groups, strategies_to_price, sync_pipelines,
)
from torchrec_sparselift.search.torchrec_objective import (
    build_torchrec_problem,
    estimator_identity,
    placed_options,
    solve_torchrec,
)
from torchrec_sparselift.semantics.dense import dense_work
from torchrec_sparselift.semantics.tables import TableHandle, extract_tables, is_feature_processed
from torchrec_sparselift.semantics.workload import WorkloadStats
from torchrec_sparselift.validation import (
    Problems,
    argument_problems,
    callback_problem,
    planner_option_problems,
    raise_problems,
    validate_inputs,
)

__all__ = ["SparseLiftPlanner", "PlanResult", "dense_work", "evaluate_sharding_plan", "rank_breakdown"]

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = defaults.BATCH_SIZE  # TorchRec's planner default
LOSSY_PRECISIONS = LOSSY_COMM_PRECISIONS


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
            note = reservation_note(self._storage_reservation, self._topology, reserved)
            new = with_reservation(e, note)
            if new is e:
                raise
            raise new from None

    return wrapper


class SparseLiftPlanner(ShardingPlanner):
    """A TorchRec ``ShardingPlanner`` that plans the sparse path with a cost model and a
    constraint-aware search.

    Accepts ``EmbeddingShardingPlanner``'s arguments. ``topology``, ``batch_size``
    (per rank), ``constraints``, ``storage_reservation``, ``callbacks`` (applied to the final
    sharding options), ``debug`` and ``timeout_seconds`` (the search budget) are honoured;
    ``stats`` (TorchRec ``Stats``, one or a list, e.g. ``EmbeddingStats()``) get ``log()`` of
    every plan SparseLift searches, as ``EmbeddingShardingPlanner`` calls them (default: none;
    a plan reused from ``cache_dir`` is not logged again); and so is ``plan_loader`` (TorchRec's ``PlanLoader``: a stored plan whose context
    hash matches :meth:`hash_planner_context_inputs_str` is validated against the model and
    used instead of searching; see :mod:`torchrec_sparselift.plan.loader`). ``enumerator``,
    ``proposer``, ``partitioner`` and ``performance_model`` are TorchRec search components that
    SparseLift replaces: passing one logs a warning saying it is not used.

    SparseLift's own keyword arguments:
        hardware: a :class:`HardwareProfile`, a preset name ("h100", "h200", "a100",
            "cpu-gloo"), a calibrated profile JSON path, or "auto": this machine's profile
            fitted from real steps (``sparselift calibrate steps``, stored per machine
            fingerprint), else the closest stored one or the shipped base profile, with a warning
            naming what differs. Default: chosen from the topology.
        workload: :class:`~torchrec_sparselift.semantics.workload.WorkloadStats` observed from
            the dataloader; pooling factors then come from data instead of constraints.
        pipelines: train-pipeline kinds the plan may choose from (default: the synchronous
            ones, plus ``semi_sync`` when ``allow_staleness``).
        allow_lossy_comm: allow fp16/bf16 communication (and fp8 if also ``allow_fp8``).
        allow_staleness: allow ``semi_sync`` (one step of embedding staleness).
        time_budget_s: search time budget in seconds (default 8; ``timeout_seconds`` too). With
            ``cost_model="torchrec"`` the search keeps at least half of it after TorchRec's own
            enumeration and estimation; at scale the local search keeps a minimum amount of work
            (docs/concepts.md).
        cache_dir: directory of reusable execution plans (see :meth:`plan_execution`).
        solver: "auto" (default: LP + greedy + local search; the exact MILP too on tiny
            instances), "heuristic", or "milp" (exact MILP over choice and placement with half
            the time budget; keeps the better plan and the tighter lower bound).
        sharding_group_size: None (default, 1D: a plan for plain ``DistributedModelParallel``),
            "auto" (2D sparse parallelism: the planner picks the group size, possibly the whole
            world) or a divisor of the world size. A 2D plan's ranks are group-local: apply it
            with ``torchrec_sparselift.runtime.lift`` (which builds ``DMPCollection``).
        sync_interval: pin the 2D replica sync interval (steps); default: the smallest interval
            whose amortised sync costs at most 5% of the step, never above ``max_sync_interval``.
        max_sync_interval: the largest 2D sync interval the planner may choose or be pinned to.
            The interval changes model quality; default: the largest interval at which parity
            with 1D was measured (``cost.two_d.DEFAULT_MAX_SYNC_INTERVAL``). A larger value is the
            explicit allowance to go beyond the evidence (like ``allow_lossy_comm``).
        layout_2d: "auto" (default: on several hosts price TorchRec's strided sharding groups and
            contiguous ones, keep the faster), "strided" or "contiguous" (see
            :class:`~torchrec_sparselift.semantics.layout.Layout2D`); ``lift`` builds
            ``DMPCollection`` with the matching ``use_inter_host_allreduce``.
        strategy_2d: how a 2D plan keeps its replicas in step (``DMPCollection``'s
            ``ShardingStrategy``): "auto" (default: price every strategy the device runs, keep
            the faster), "default" (average weights and optimizer state every ``sync_interval``
            steps) or "fully_sharded" (reduce-scatter and all-gather the weights every step; not
            on CPU, see ``vocabulary.STRATEGY_2D_REGISTRY``).
        cost_model: "sparselift" (default: SparseLift's cost model, pipelines and precisions) or
            "torchrec": optimize TorchRec's own rating instead (every shard's ``Perf``/``Storage``
            from TorchRec's estimators, objective = the slowest rank's summed ``Perf.total`` as
            ``NoopPerfModel`` rates it, memory = the storage estimates under the reservation);
            same search, same outputs (see :mod:`torchrec_sparselift.search.torchrec_objective`).
        never_slower: "auto" (default) or True: also plan with TorchRec's ``EmbeddingShardingPlanner``
            on the same inputs and keep its plan unless SparseLift's predicted gain over it
            exceeds the model's error on the cost terms the two plans differ in;
            ``planner.last_result.never_slower`` says which and why. "auto" applies it where the
            error is measured (a step-fitted profile from the store: ``hardware="auto"`` or a
            stored profile); True also with the 30% error assumed for a profile without a step
            fit (the presets). Applies to 1D plans under ``cost_model="sparselift"``; costs one
            TorchRec planner run (its proposals stopped after ``time_budget_s``) and two split
            pricings (docs/cost_model.md, "Never slower than TorchRec"). False: the search alone.
        model_errors: the model's relative error per term for the never-slower rule (a
            ``TermErrors``), for a profile the store cannot match, e.g. a stored profile with its
            link terms corrected by hand: ``calibration.term_error.profile_errors(None, path)`` of
            the stored one it came from. Default: from the store (see ``never_slower``).
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
    ) -> None:
        """See the class docstring. ``cache_dir``: reuse execution plans across runs (a run
        whose inputs match a stored plan's fingerprint loads it instead of planning);
        ``drift_tolerance``: how far observed statistics may move before a stored plan is
        re-planned."""
        for name, value in (
            ("enumerator", enumerator), ("proposer", proposer), ("partitioner", partitioner),
            ("performance_model", performance_model),
        ):
            if value is not None:
                logger.warning(
                    "SparseLiftPlanner: %s=%s is a TorchRec search component that SparseLift "
                    "replaces; it is not used (use SparseLiftEnumerator/SparseLiftProposer inside "
                    "EmbeddingShardingPlanner to combine them)", name, type(value).__name__,
                )
        if topology is None:
            topology = _default_topology()
        raise_problems(argument_problems(
            topology=topology, constraints=constraints, hardware=hardware, workload=workload,
            pipelines=pipelines, callbacks=callbacks, stats=stats,
            storage_reservation=storage_reservation, cache_dir=cache_dir,
            flags={"allow_lossy_comm": allow_lossy_comm, "allow_fp8": allow_fp8,
                   "allow_staleness": allow_staleness},
            choices={"cost_model": (cost_model, COST_MODELS), "layout_2d": (layout_2d, LAYOUT_2D_CHOICES)},
            required={
                "drift_tolerance": (drift_tolerance, f"drift_tolerance={defaults.DRIFT_TOLERANCE}"),
                "heuristical_storage_reservation_percentage": (
                    heuristical_storage_reservation_percentage if storage_reservation is None else 0,
                    "heuristical_storage_reservation_percentage="
                    f"{defaults.STORAGE_RESERVATION_PERCENTAGE}"),
            },
            topology_type=Topology, constraint_type=ParameterConstraints,
            profile_type=HardwareProfile, workload_type=WorkloadStats,
        ) + planner_option_problems(
            topology=topology, batch_size=batch_size, timeout_seconds=timeout_seconds,
            time_budget_s=time_budget_s, pipelines=pipelines, known_pipelines=PIPELINES,
            stale_pipelines=STALE_PIPELINES, allow_staleness=allow_staleness, solver=solver,
            sharding_group_size=sharding_group_size, sync_interval=sync_interval,
            drift_tolerance=drift_tolerance, never_slower=never_slower,
            reservation_percentage=(heuristical_storage_reservation_percentage
                                    if storage_reservation is None else None),
        ), "SparseLiftPlanner's arguments")
        self._topology = topology
        self._batch_size = int(batch_size) if batch_size else DEFAULT_BATCH_SIZE
        self._constraints = dict(constraints) if constraints else None
        self._storage_reservation = storage_reservation or HeuristicalStorageReservation(
            percentage=heuristical_storage_reservation_percentage
        )
        self._stats: List[Stats] = [] if stats is None else list(stats) if isinstance(stats, list) else [stats]
        self._plan_loader = plan_loader
        self._last_context: Optional[Tuple[PlanRequest, Any]] = None  # (request, reserved topology)
        self._debug = debug
        self._callbacks = list(callbacks or [])
        self._budget = float(time_budget_s or timeout_seconds or defaults.TIME_BUDGET_S)
        self._auto_stored: Optional[Tuple[HardwareProfile, str, Any]] = None  # (profile, where, its link)
        self._on_link: Any = None  # ProfileOnLink: the hardware="auto" profile on the job's measured link
        if hardware == "auto":  # this machine's step-fitted profile (warns when it has none)
            from torchrec_sparselift.calibration.store import auto_profile_link

            local = defaults.ranks_per_host(topology)
            self._auto_stored = auto_profile_link(topology.compute_device, local,
                                                  hosts=max(1, topology.world_size // max(1, local)))
            hardware = self._auto_stored[0]
        if isinstance(hardware, str):
            hardware = get_profile(hardware)
        self._hardware: Optional[HardwareProfile] = hardware
        self._workload = workload
        self._pipelines_by_default = pipelines is None
        if pipelines is None:
            pipelines = SYNC_PIPELINES + (STALE_PIPELINES if allow_staleness else ())
        #: the pipelines asked for (the default set or the user's list), and those this machine's
        #: cores can run (the default set less the ones that need a core per rank where ranks
        #: outnumber the cores: ``_limit_overlap_to_free_cores``, set by each collective plan). A
        #: request chooses among the latter that train its module exactly (``_exact_pipelines``):
        #: ``PlanRequest.pipelines``, what the search and the never-slower rule read.
        self._requested_pipelines = tuple(pipelines)
        self._core_pipelines = self._requested_pipelines
        self._precisions = comm_precision_pairs(bool(allow_lossy_comm), bool(allow_fp8), topology.compute_device)
        self._allow_lossy_comm = bool(allow_lossy_comm)
        self._allow_fp8 = bool(allow_fp8)
        self._allow_staleness = bool(allow_staleness)
        self._solver = solver
        if cost_model not in COST_MODELS:
            raise ValueError(f"cost_model must be one of {', '.join(map(repr, COST_MODELS))}, got {cost_model!r}")
        if estimator is not None and cost_model != "torchrec":
            raise ValueError("estimator= is TorchRec's ShardEstimator: pass cost_model='torchrec' with it")
        self._cost_model = cost_model
        self._estimator = estimator
        self._max_sync_interval = check_sync_interval(sync_interval, max_sync_interval)
        if layout_2d not in LAYOUT_2D_CHOICES:
            raise ValueError(f"layout_2d must be one of {', '.join(map(repr, LAYOUT_2D_CHOICES))}, got {layout_2d!r}")
        self._layout_2d = layout_2d
        self._strategy_2d = strategy_2d
        if strategy_2d not in STRATEGY_2D_CHOICES:
            raise ValueError(f"strategy_2d must be one of {', '.join(map(repr, STRATEGY_2D_CHOICES))}, got {strategy_2d!r}")
        self._strategies, self._strategies_refused = strategies_to_price(  # 1D plans have none
            strategy_2d if sharding_group_size is not None else "auto", topology.compute_device, sync_interval)
        self._group = sharding_group_size
        self._sync_interval = sync_interval
        self._cache_dir = cache_dir
        self._never_slower = never_slower
        self._errors: Optional[Tuple[HardwareProfile, Any]] = None  # (profile, TermErrors) of the last rule
        if model_errors is not None:
            if not isinstance(model_errors, TermErrors):
                raise TypeError(f"model_errors must be a TermErrors (calibration.term_error.profile_errors(...)), "
                                f"got {type(model_errors).__name__}")
        self._given_errors = model_errors
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
        link: Any = None,
    ) -> ShardingPlan:
        """Plan on rank 0 and broadcast, so every rank gets the identical plan.

        First every rank checks that all ranks are planning the same input (tables, topology,
        batch size, constraints, statistics); if not, every rank raises an error naming the
        ranks that differ, instead of hanging or sharding inconsistently. Nothing to shard
        gives ``ShardingPlan({})`` on every rank, as in :meth:`plan`.

        ``link``: the :class:`~torchrec_sparselift.calibration.link.LinkRates` this job sees
        (:func:`torchrec_sparselift.measure.link.measure_link_rates` on every rank of ``pg``, a
        few seconds; the planner does not measure). With ``hardware="auto"`` the stored profile's
        link is compared with it; where they differ beyond the measured spread, one warning names
        each differing term and the profile's link terms are corrected in memory
        (:func:`~torchrec_sparselift.calibration.link.correct_link_terms`). Ignored for an
        explicit profile or preset.
        """
        try:
            shardable = has_shardable_tables(module, get_default_sharders() if sharders is None else sharders,
                                             self._topology.compute_device, self._batch_size)
        except Exception:  # noqa: BLE001 - malformed input: the agreement check raises it on every rank
            shardable = True
        if not shardable:
            return ShardingPlan({})
        return self.collective_plan_execution(module, sharders, pg, link=link).sharding_plan

    def collective_plan_execution(
        self,
        module: nn.Module,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
        pg: Optional[dist.ProcessGroup] = None,
        link: Any = None,
    ) -> ExecutionPlan:
        """:meth:`plan_execution` on rank 0, broadcast to all ranks (an ``ExecutionPlan``);
        ``link``: as in :meth:`collective_plan`."""
        t0 = time.monotonic()
        if pg is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "collective_plan needs an initialized process group: call "
                    "torch.distributed.init_process_group() first, or use plan() on one process"
                )
            pg = dist.GroupMember.WORLD
        _check_group_size(self._topology, pg)
        if link is not None:
            self._correct_link(link, dist.get_rank(pg) == 0)
        self._limit_overlap_to_free_cores(pg, link)
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

    def _limit_overlap_to_free_cores(self, pg: Any, link: Any = None) -> None:
        """On CPU, leave out the pipelines whose overlap runs the package's own work beside the
        rank's compute (``needs_spare_cores``: gloo's threads move the gradient all-to-all and the
        all-reduce while the rank computes) when more ranks share a machine than it has cores:
        there those threads take the cores the compute needs (measured: 4 ranks on 2 cores, the
        ``overlap`` pipeline ran 93 ms/step where ``sparse_dist`` ran 63, and TorchRec's
        ``fused``, which only issues the output all-to-all early, 0.92-1.02x ``sparse_dist``'s step,
        geomean 0.96; docs/benchmarks.md section 20). Only the default
        pipeline set; a list the user passed is kept. Decided again for every collective plan, from
        the pipelines asked for (a planner reused on a machine with cores to spare offers them all
        again). Every rank alike: the machine share ``link`` measured (``LinkRates.machine_ranks``,
        ``machine_cores``), else one all-gather (``runtime.machine.machine_share``)."""
        self._core_pipelines = self._requested_pipelines
        if not self._pipelines_by_default or self._topology.compute_device != "cpu":
            return
        if link is not None and getattr(link, "machine_ranks", None) is not None:
            ranks, cores = int(link.machine_ranks), int(link.machine_cores)
        else:
            from torchrec_sparselift.runtime.machine import machine_share

            ranks, cores = machine_share(pg)
        if ranks <= cores:
            return
        kept = tuple(p for p in self._requested_pipelines if not pipeline_kind(p).needs_spare_cores)
        if kept != self._requested_pipelines and kept:
            if dist.get_rank(pg) == 0:
                left = ", ".join(p for p in self._requested_pipelines if p not in kept)
                warnings.warn(f"sparselift: {ranks} ranks share a machine with {cores} CPU cores; the pipelines "
                              f"that overlap communication beside the ranks' compute ({left}) need a core per "
                              "rank, so the plan chooses among the others (pass pipelines=[...] to choose yourself)",
                              stacklevel=4)
            self._core_pipelines = kept

    def _exact_pipelines(self, handles: Sequence[TableHandle]) -> Tuple[str, ...]:
        """The pipelines the plan of ``handles`` chooses among: on a device with side streams
        (CUDA), a model with feature processors (a ``FeatureProcessedEmbeddingBagCollection``)
        leaves out the kinds that look up the next batch before the dense optimizer's step
        (``Pipeline.lookup_before_dense_step``: TorchRec's ``fused``, whose lookup would read the
        processor's weights before their update; ``cost.pipelines.trainable_pipelines``). Plans with
        data-parallel tables are filtered the same way in the search, per plan."""
        fp = sorted({h.module[0] for h in handles if is_feature_processed(h.sharder_key)})
        kept = trainable_pipelines(self._core_pipelines, False, streams=has_side_streams(self._topology.compute_device),
                                   feature_processors=bool(fp))
        if kept != self._core_pipelines and not self._pipelines_by_default:
            left = ", ".join(p for p in self._core_pipelines if p not in kept)
            warnings.warn(f"sparselift: pipeline(s) {left} left out: on {self._topology.compute_device} they look up "
                          f"the next batch before the dense optimizer updates the feature processors of "
                          f"{', '.join(fp)} (TorchRec's TrainPipelineFusedSparseDist assumes none)", stacklevel=4)
        return kept

    def _correct_link(self, link: Any, announce: bool) -> None:
        """With ``hardware="auto"``: the stored profile with its link terms corrected to ``link``,
        and the never-slower rule's errors for it (``calibration.term_error.profile_on_link``;
        every rank alike; ``announce``: this rank warns)."""
        if self._auto_stored is None:
            return
        from torchrec_sparselift.calibration.term_error import profile_on_link

        profile, where, stored = self._auto_stored
        self._on_link = profile_on_link(profile, stored, link, where)
        self._hardware = self._on_link.profile
        if self._on_link.note is not None and announce:
            warnings.warn(f"sparselift: {self._on_link.note}", stacklevel=3)

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
        """A ``ShardingPlan`` for ``module``; ``ShardingPlan({})`` when no sharder shards any
        of its tables (``sharders=[]`` included), as TorchRec's planner returns."""
        if not has_shardable_tables(module, get_default_sharders() if sharders is None else sharders,
                                    self._topology.compute_device, self._batch_size):
            return ShardingPlan({})
        if self._cache_dir:
            return self.plan_execution(module, sharders).sharding_plan
        return self.plan_with_result(module, sharders).sharding_plan

    @_names_reservation
    def request(
        self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
    ) -> PlanRequest:
        """The :class:`~torchrec_sparselift.plan.PlanRequest` for ``module``: its tables (after
        validating every input, all problems listed at once) and every option of this planner.
        One ``plan()`` builds exactly one; the cache, the fingerprint, the rank-agreement check
        and the ``ExecutionPlan`` read it."""
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        topo = self._topology
        problems = Problems()
        handles = extract_tables(
            module, sharders, topo.compute_device, self._batch_size, self._constraints,
            self._workload, problems=problems,
        )
        validate_inputs(handles, topo, self._batch_size, self._constraints, self._workload,
                        problems=problems)
        return self._request(handles, dense_work(module, handles), sharders, self._exact_pipelines(handles))

    def _request(self, handles: Sequence[TableHandle], dense: DenseWork, sharders: Sequence[Any],
                 pipelines: Optional[Tuple[str, ...]] = None) -> PlanRequest:
        """The request for validated tables (none: this planner's context alone) choosing among
        ``pipelines`` (None: those this machine's cores can run)."""
        return PlanRequest(
            tables=tuple(h.spec for h in handles), handles=tuple(handles), topology=self._topology,
            batch_size=self._batch_size, constraints=self._constraints, stats=self._workload,
            hardware=self._profile(), dense=dense,
            sharders=describe_sharders(sharders), storage_reservation=self._storage_reservation,
            callbacks=tuple(self._callbacks),
            pipelines=self._core_pipelines if pipelines is None else pipelines, precisions=self._precisions,
            allow_lossy_comm=self._allow_lossy_comm, allow_fp8=self._allow_fp8,
            allow_staleness=self._allow_staleness, solver=self._solver,
            time_budget_s=self._budget, sharding_group_size=self._group,
            sync_interval=self._sync_interval, cost_model=self._cost_model_id(),
            max_sync_interval=self._max_sync_interval if self._group is not None else None,
            layout_2d=self._layout_2d if self._group is not None else "auto",
            never_slower=self._never_slower,
            strategy_2d=self._strategy_2d if self._group is not None else "auto",
        )

    def fingerprint(
        self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
    ) -> Fingerprint:
        """What a stored plan must match to be reused: :meth:`request`'s fingerprint."""
        return self.request(module, sharders).fingerprint()

    def memory_caps(
        self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Per-rank (device, host) bytes a plan of ``module`` may fill on the whole topology:
        what this planner's storage reservation leaves, as :meth:`plan` reserves it (on CPU both
        are the rank's DDR). A 2D plan's group-local ranks are the first ``sharding_group_size``."""
        sharders = list(sharders) if sharders is not None else get_default_sharders()
        reserved = self._storage_reservation.reserve(
            self._topology, self._batch_size, module, sharders, self._constraints)
        return device_caps(reserved)

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
                **({"never_slower": res.never_slower.to_dict()} if res.never_slower is not None else {}),
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

    @_names_reservation
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
        reserved = self._storage_reservation.reserve(
            topo, self._batch_size, module, list(sharders), self._constraints)
        self._last_context = (request, reserved)
        if self._plan_loader is not None:
            loaded = self._loaded_result(request, module, sharders)
            if loaded is not None:
                return loaded
        if self._group is None:
            res = self._solve_group(module, sharders, handles, request.pipelines, topo.world_size, self._budget, t0)
        else:
            choice = search_groups(
                topo.world_size, topo.local_world_size, self._group, self._layout_2d, self._budget, t0,
                lambda g, lay, budget: self._solve_group(module, sharders, handles, request.pipelines, g,
                                                         budget, time.monotonic(), lay))
            res = attrs.evolve(choice.best, alternatives_2d=choice.alternatives_2d,
                               alternatives_layout=choice.alternatives_layout)
        if self._never_slower is not False:
            res = self._never_slower_rule(res, module, sharders, request.pipelines)
        self.last_result = res
        if self._debug:
            logger.info("%s", res.summary())
        self._log_stats(res, sharders, t0)
        return res

    def _log_stats(self, res: PlanResult, sharders: List[ModuleSharder[nn.Module]], t0: float) -> None:
        """Hand the plan to the user's TorchRec ``Stats``, as ``EmbeddingShardingPlanner`` does."""
        for s in self._stats:
            s.log(
                sharding_plan=res.sharding_plan, topology=self._topology, batch_size=self._batch_size,
                storage_reservation=self._storage_reservation, num_proposals=1, num_plans=1,
                run_time=time.monotonic() - t0, best_plan=list(res.sharding_options),
                constraints=self._constraints, sharders=list(sharders), debug=self._debug,
            )

    def _solve_group(self, module: nn.Module, sharders: Sequence[Any], handles: Sequence[TableHandle],
                     pipelines: Tuple[str, ...], group: int, budget: float, t0: float,
                     layout: Optional[Layout2D] = None) -> PlanResult:
        """Plan the tables over ``group`` ranks (the whole world for 1D) laid out as ``layout``
        (2D: the group-local topology has ``layout.group_ranks_per_host`` ranks per host, which
        is what the sharding group's all-to-all really crosses), choosing among ``pipelines``
        (the request's)."""
        topo = self._topology
        W = topo.world_size
        layout, local, gtopo = group_setting(topo, group, layout, self._layout_2d)
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
            local_world_size=local,
            batch_size=self._batch_size,
            dense=dense_work(module, handles),
            allreduce_world_size=W,  # 2D: DDP all-reduces the dense gradients over the whole world
        )
        device_cap, host_cap = device_caps(reserved)
        if layout is not None and group < W:  # only these pipelines run DMPCollection's sync
            pipelines = sync_pipelines(pipelines)
        prob = build_problem(
            [h.spec for h in handles], ctx, device_cap, host_cap,
            pipelines=pipelines, precisions=self._precisions,
        )
        result = solve(prob, time_budget_s=max(0.5, budget - (time.monotonic() - t0)),
                       solver=self._solver)
        options = [
            to_sharding_option(h, prob, cid, ranks)
            for h, (cid, ranks) in zip(handles, result.assignment)
        ]
        options = _run_callbacks(self._callbacks, options)
        _check_complete(handles, options)
        plan = to_sharding_plan(options, gtopo)
        sync_s, interval, sync = 0.0, 1, None
        if self._group is not None and group < W:
            sync = choose_replica_sync(prob, result.assignment, group, layout, profile,
                                       result.step.total_s, self._strategies, self._strategies_refused,
                                       self._sync_interval, self._max_sync_interval)
            sync_s, interval = sync.sync_s, sync.sync_interval
        return PlanResult(
            sharding_plan=plan, sharding_options=tuple(options), search=result, problem=prob,
            handles=tuple(handles), topology=topo, profile=profile,
            sharding_group_size=(group if self._group is not None and group < W else None),
            sync_interval=interval, sync_s=sync_s,
            layout_2d=layout if self._group is not None and group < W else None,
            max_sync_interval=self._max_sync_interval, replica_sync=sync,
        )

    def _profile(self) -> HardwareProfile:
        return profile_for_topology(self._topology, self._hardware)

    # -- never slower than TorchRec ------------------------------------------------------
    def _never_slower_rule(self, res: PlanResult, module: nn.Module,
                           sharders: List[ModuleSharder[nn.Module]], pipelines: Tuple[str, ...]) -> PlanResult:
        """``res``, or TorchRec's plan for the same inputs where SparseLift's predicted gain over it
        is within the model's error (:func:`~torchrec_sparselift.plan.baseline.never_slower`), or
        TorchRec's sharding under ``res``'s pipeline and precisions where that is priced no slower
        than ``res`` (:func:`~torchrec_sparselift.plan.baseline.same_sharding_price`); the decision
        is in the result's ``never_slower``."""
        from torchrec_sparselift.calibration.term_error import term_seconds
        from torchrec_sparselift.cost.pipelines import step_factor
        from torchrec_sparselift.plan.baseline import (
            BaselineDecision, baseline_name, kept_plan_pipeline, never_slower_with_precision, same_sharding_price,
            with_pipeline_term,
        )
        from torchrec_sparselift.plan.compare import torchrec_plan
        from torchrec_sparselift.plan.evaluate import GivenPlan

        if self._cost_model != "sparselift":
            return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
                "the plan optimizes TorchRec's own estimator (cost_model='torchrec')"))
        if res.sharding_group_size is not None:
            return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
                "a 2D plan (TorchRec's planner plans 1D only)"))
        if self._never_slower == "auto" and not self._model_errors(res.profile).measured:
            return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
                f"the profile {res.profile.name} has no measured error (not fitted from real steps; "
                "never_slower=True applies the rule with the 30% error assumed for it)"))
        t0 = time.monotonic()
        topo = self._topology
        try:
            tr = torchrec_plan(module, sharders, topo, self._batch_size, self._constraints,
                               self._storage_reservation, self._callbacks, timeout_s=self._budget)
        except Exception as e:  # noqa: BLE001 - TorchRec's planner failing must not fail SparseLift's plan
            return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
                f"TorchRec's planner failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})"))
        if tr.plan is None:
            return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
                f"TorchRec's planner found no plan ({tr.error})"))
        profile = res.profile
        s = res.search
        # TorchRec's plan as TorchRec's users run it: its default pipeline, full-precision comms
        pipeline = defaults.PIPELINE if defaults.PIPELINE in pipelines else pipelines[0]
        try:
            ours = GivenPlan.of(module, res.sharding_plan, topo, self._batch_size, self._constraints,
                                self._workload, sharders)
            theirs = GivenPlan.of(module, tr.plan, topo, self._batch_size, self._constraints, self._workload,
                                  sharders)
            # each breakdown without the pipelines' measured step factors (a term the same in both
            # plans cancels), each factor a term of its own (plan.baseline.with_pipeline_term)
            unscaled = attrs.evolve(profile, pipeline_factors=())
            spans = topo.world_size > topo.local_world_size

            def priced(given: Any, under: str, fwd: str, bwd: str) -> Any:
                return with_pipeline_term(term_seconds(lambda p: given.step_time(p, under, fwd, bwd).total_s,
                                                       unscaled), under, step_factor(profile, under, spans))

            def theirs_at(fwd: str, bwd: str, under: str = pipeline) -> Any:
                return priced(theirs, under, fwd, bwd)

            # with lossy comms, against TorchRec's plan with the same comms (qcomm by hand) and at
            # full precision (plan.baseline.never_slower_with_precision)
            full = (defaults.COMM_PRECISION, defaults.COMM_PRECISION)
            candidate = priced(ours, s.pipeline, s.fwd_precision, s.bwd_precision)
            decision, kept_precision = never_slower_with_precision(
                candidate, theirs_at, (s.fwd_precision, s.bwd_precision), full, self._model_errors(profile))
            fwd, bwd = kept_precision or full  # TorchRec's plan's comms, where it is kept
            kept_pipeline = pipeline
            # the pipelines that train TorchRec's plan exactly (its data-parallel tables' dense kernel)
            dense = any(getattr(o, "compute_kernel", None) == "dense" for o in tr.options)
            streams = has_side_streams(topo.compute_device)
            trainable = trainable_pipelines(pipelines, dense, streams=streams)
            # the module's feature processors are the same for both plans, and SparseLift's pipeline
            # passed them: only TorchRec's dense-kernel tables can conflict with it
            if (decision.leave and pipeline_kind(s.pipeline).conflict(dense, streams) is None
                    and same_sharding_price(candidate, theirs_at(s.fwd_precision, s.bwd_precision, s.pipeline))):
                # the gain is all in SparseLift's pipeline and precisions: TorchRec's sharding under them
                kept_pipeline, fwd, bwd = s.pipeline, s.fwd_precision, s.bwd_precision
                decision = attrs.evolve(decision, candidate_pipeline=s.pipeline, baseline_sharding=True)
            if not decision.leave:
                # TorchRec's plan is kept: under another of the planner's pipelines where that clears
                # the rule against TorchRec's plan under its default one (plan.baseline.kept_plan_pipeline)
                others = [p for p in trainable if p != pipeline]
                alt = kept_plan_pipeline(theirs_at(fwd, bwd), {p: theirs_at(fwd, bwd, p) for p in others},
                                         self._model_errors(profile), baseline_name((fwd, bwd), full)) if others else None
                if alt is not None:
                    logger.info("SparseLiftPlanner: %s", decision.describe())
                    kept_pipeline, decision = alt
        except Exception as e:  # noqa: BLE001 - the rule must never fail a plan the search found
            logger.warning("SparseLiftPlanner: the never-slower rule could not price TorchRec's plan (%s: %s); "
                           "keeping SparseLift's plan", type(e).__name__, e)
            return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
                f"TorchRec's plan could not be priced ({type(e).__name__}: {e})"))
        logger.info("SparseLiftPlanner: %s (TorchRec planned in %.2f s, the rule took %.2f s)",
                    decision.describe(), tr.planning_time_s, time.monotonic() - t0)
        if decision.leave and not decision.candidate_pipeline:  # SparseLift's plan
            return attrs.evolve(res, never_slower=decision)
        options = list(tr.options)
        _check_complete(res.handles, options)
        kept = evaluate_sharding_plan(module, tr.plan, topo, self._batch_size, self._constraints, profile,
                                      self._workload, sharders, pipeline=kept_pipeline, fwd_precision=fwd,
                                      bwd_precision=bwd)
        search = attrs.evolve(kept.search, solver="torchrec(never_slower)", status="kept",
                              planning_time_s=s.planning_time_s + time.monotonic() - t0)
        return attrs.evolve(kept, sharding_options=tuple(options), search=search, never_slower=decision)

    def _model_errors(self, profile: HardwareProfile) -> Any:
        """The model's relative error per term for ``profile``: from its step fit where the
        profile store holds it (``hardware="auto"``, or a profile equal to a stored one), else the
        documented error of an uncalibrated profile. A stored profile moved to this job's link
        (``collective_plan(link=...)``) has the errors ``profile_on_link`` gave it (its corrected
        link terms' at least the link measurement's spread)."""
        from torchrec_sparselift.calibration.term_error import profile_errors

        if self._given_errors is not None:
            return self._given_errors
        if self._on_link is not None:
            return self._on_link.errors
        if self._errors is not None and self._errors[0] == profile:
            return self._errors[1]
        errors = profile_errors(self._hardware or profile,
                                self._auto_stored[1] if self._auto_stored is not None else None)
        self._errors = (profile, errors)
        return errors

    # -- TorchRec's plan-loading contract ------------------------------------------------
    def hash_planner_context_inputs_str(self) -> str:
        """A stable hash (sha256 hex) of the planning context: tables of the module last
        planned, topology, batch size, constraints, statistics, hardware, planner options, the
        storage reservation and the topology it reserved. Before any ``plan()`` it covers the
        planner's context without tables. What a ``PlanLoader``'s ``plan_context_hash()`` must
        return for its plan to be used."""
        if self._last_context is not None:
            return context_digest(*self._last_context)
        return context_digest(self._request((), DenseWork(), ()), last_reserved(self._storage_reservation))

    def hash_planner_context_inputs(self) -> int:
        """:meth:`hash_planner_context_inputs_str` as a non-negative int."""
        return context_hash_int(self.hash_planner_context_inputs_str())

    def _loaded_result(self, request: PlanRequest, module: nn.Module,
                       sharders: List[ModuleSharder[nn.Module]]) -> Optional[PlanResult]:
        """The plan loader's plan for this request, validated and priced; ``None`` when the
        loader has none. Raises ``PLANNER_INPUT_CONTEXT_MISMATCH`` or ``PLAN_LOADING_FAILED``."""
        check_context(self._plan_loader, self.hash_planner_context_inputs_str())
        options = loaded_options(self._plan_loader.load(), request.handles, self._topology.world_size)
        if options is None:
            return None
        options = _run_callbacks(self._callbacks, options)
        plan = to_sharding_plan(options, self._topology)
        res = evaluate_sharding_plan(module, plan, self._topology, self._batch_size,
                                     self._constraints, self._profile(), self._workload, sharders)
        res = attrs.evolve(res, sharding_options=tuple(options))
        logger.info("SparseLiftPlanner: using the loaded plan %r (predicted step %.3f ms)",
                    getattr(self._plan_loader, "get_plan_id", lambda: None)(), res.step_time_s * 1e3)
        self.last_result = res
        return res

    def _cost_model_id(self) -> str:
        """``cost_model`` as the plan request records it: with TorchRec's objective, the
        estimators' identity too, so cached plans of different estimators do not mix."""
        if self._cost_model != "torchrec":
            return self._cost_model
        return f"torchrec:{estimator_identity(self._estimator)}"

    def _solve_group_torchrec(self, module: nn.Module, sharders: Sequence[Any],
                              handles: Sequence[TableHandle], gtopo: Topology, reserved: Topology,
                              profile: HardwareProfile, budget: float, t0: float) -> "PlanResult":
        """``cost_model="torchrec"``: plan ``gtopo`` under TorchRec's estimators (1D only)."""
        if self._group is not None:
            raise ValueError("cost_model='torchrec' plans 1D only (TorchRec's rating has no 2D "
                             "replica sync); use sharding_group_size=None")
        trp = build_torchrec_problem(module, list(sharders), [h.spec for h in handles], gtopo,
                                     reserved, self._batch_size, profile, self._constraints,
                                     self._estimator)
        # the search gets at least half the budget even when TorchRec's enumeration and
        # estimation took the rest (at 856 tables x 128 ranks they take ~10 s on 2 cores)
        result = solve_torchrec(trp, max(0.5 * budget, budget - (time.monotonic() - t0)), self._solver)
        options = placed_options(trp, result.assignment)
        options = _run_callbacks(self._callbacks, options)
        _check_complete(handles, options)
        self.last_torchrec_problem = trp
        return PlanResult(
            sharding_plan=to_sharding_plan(options, gtopo), sharding_options=tuple(options),
            search=result, problem=trp.problem, handles=tuple(handles), topology=self._topology,
            profile=trp.problem.ctx.profile,
        )


def _run_callbacks(callbacks: Sequence[Callable[[List[ShardingOption]], List[ShardingOption]]],
                   options: List[ShardingOption]) -> List[ShardingOption]:
    """Apply the user's ``callbacks`` in order; one that returns no list, or drops, adds or
    repeats a table, raises ``ValueError`` naming it and what it did."""
    for cb in callbacks:
        out = cb(options)
        problem = callback_problem(cb, options, out)
        if problem:
            raise ValueError(problem)
        options = list(out)
    return options


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


def _check_group_size(topology: Topology, pg: Any) -> None:
    """The topology must have one rank per member of the process group the plan is shared
    over (every rank sees the same sizes, so every rank raises, before any collective)."""
    size = dist.get_world_size(pg)
    if topology.world_size != size:
        raise ValueError(
            f"the topology has world_size {topology.world_size} but the process group has {size} "
            f"ranks: a plan for {topology.world_size} ranks cannot be applied by {size}. Build the "
            f"topology with Topology(world_size={size}, ...) (dist.get_world_size(pg)), or plan "
            "over the process group of the ranks the topology describes"
        )


def _reraise_shared(out: Any, local_error: Any, who: str) -> None:
    """Raise, on every rank, the error one rank reported: the original object where it
    happened, the same kind and message elsewhere."""
    if local_error is not None:
        raise local_error
    _, name, kind, msg = out
    if name == "ValueError":
        raise ValueError(f"{who}: {msg}")
    raise SparseLiftPlannerError(f"{who}: {msg}" if kind else f"{who}: {name}: {msg}", kind=kind or "other")


def _default_topology() -> Topology:
    from torchrec.distributed.comm import get_local_size

    if not dist.is_initialized():
        raise ValueError(
            "SparseLiftPlanner needs a topology: pass topology=Topology(world_size=..., "
            "compute_device=..., local_world_size=...) or initialize torch.distributed first"
        )
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Topology(
        world_size=dist.get_world_size(), local_world_size=get_local_size(), compute_device=device
    )

