"""SparseLift's plan next to TorchRec's ``EmbeddingShardingPlanner``'s, for the same module.

:func:`compare_planners` plans the module with both planners and prices both plans three ways:
under SparseLift's cost model with TorchRec's default runtime (``TrainPipelineSparseDist``, fp32
comms; the lower bound of that model is shared), under SparseLift's model with the optimizations
SparseLift chose, and under TorchRec's own estimator (:mod:`torchrec_sparselift.cost.torchrec_score`);
with per-rank peak memory and planning time. ``sparselift compare`` prints it.

:func:`torchrec_plan` is TorchRec's plan alone, on the planner's inputs: what ``compare_planners``
and the never-slower rule (``SparseLiftPlanner(never_slower=True)``) compare SparseLift's plan with.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import attrs
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import PlannerError, Topology
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.cost.torchrec_score import BestPlanCapture, torchrec_score
from torchrec_sparselift.plan.evaluate import evaluate_sharding_plan
from torchrec_sparselift.plan.result import PlanResult

__all__ = ["PlannerComparison", "TorchRecPlan", "compare_planners", "torchrec_estimates", "torchrec_plan"]


@attrs.frozen
class TorchRecPlan:
    """``EmbeddingShardingPlanner``'s plan (``None`` with ``error`` set when it found none), the
    sharding options it chose (callbacks applied), its proposal count and its planning time."""

    plan: Any = attrs.field(eq=False, repr=False)
    options: Tuple[Any, ...] = attrs.field(default=(), converter=tuple, eq=False, repr=False)
    proposals: int = 0
    planning_time_s: float = 0.0
    error: str = ""


def torchrec_plan(module: nn.Module, sharders: Optional[Sequence[Any]], topology: Topology, batch_size: int,
                  constraints: Optional[Dict[str, Any]] = None, storage_reservation: Any = None,
                  callbacks: Sequence[Callable[[List[Any]], List[Any]]] = (),
                  timeout_s: Optional[float] = None, stats: Sequence[Any] = (), debug: bool = False) -> TorchRecPlan:
    """Plan ``module`` with TorchRec's ``EmbeddingShardingPlanner`` on the same inputs a
    ``SparseLiftPlanner`` got (a copy of ``storage_reservation``, so the caller's keeps its state;
    ``timeout_s``: TorchRec's ``timeout_seconds``, which stops its proposals, not its enumeration;
    ``stats``: more TorchRec ``Stats`` to log to, ``debug``: TorchRec's). A TorchRec ``PlannerError`` is returned as
    ``error``, not raised."""
    chosen = BestPlanCapture()  # TorchRec's chosen options, through its public Stats hook
    kwargs: Dict[str, Any] = {}
    if storage_reservation is not None:
        kwargs["storage_reservation"] = copy.deepcopy(storage_reservation)
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size, constraints=constraints or None,
        timeout_seconds=max(1, int(-(-timeout_s // 1))) if timeout_s else None,
        stats=list(stats) + [chosen], callbacks=list(callbacks) or None, debug=debug, **kwargs)
    t0 = time.monotonic()
    try:
        plan = planner.plan(module, list(sharders) if sharders is not None else get_default_sharders())
        error = ""
    except PlannerError as e:
        plan, error = None, " ".join(str(e).split())[:300]
    return TorchRecPlan(plan=plan, options=tuple(chosen.best_plan or ()), proposals=chosen.num_proposals,
                        planning_time_s=time.monotonic() - t0, error=error)


@attrs.frozen
class PlannerComparison:
    """Both planners' numbers (JSON-able; a key is absent where the number is unknown).

    ``sparselift`` and ``torchrec`` hold, per planner: ``planning_time_s``, ``optimizations``
    ("pipeline/fwd/bwd" precisions), ``step_s`` (SparseLift's model with those optimizations),
    ``step_sparse_dist_s`` (with TorchRec's default runtime), the lower bounds
    ``lower_bound_s`` and (SparseLift's) ``lower_bound_sparse_dist_s``, ``peak_device_bytes``,
    TorchRec's estimator's ``torchrec_estimate_ms`` and ``torchrec_peak_bytes`` (or
    ``torchrec_estimate_error``), TorchRec's ``proposals``, and ``error`` when TorchRec's planner
    found no plan. ``result`` is SparseLift's plan, ``torchrec_result`` TorchRec's priced under
    SparseLift's model (``None`` when it found none).
    """

    sparselift: Dict[str, Any]
    torchrec: Dict[str, Any]
    result: PlanResult
    torchrec_result: Optional[PlanResult]


def torchrec_estimates(col: Dict[str, Any], options: Sequence[Any], topology: Topology,
                       constraints: Optional[Dict[str, Any]]) -> None:
    """Put TorchRec's estimator's rating of the placed ``options`` (slowest rank, ms) and its
    peak per-rank storage (HBM; DDR on CPU) into ``col``, or the reason it cannot price them."""
    try:
        score = torchrec_score(options, topology, get_default_sharders(), constraints or None)
    except Exception as e:  # TorchRec's estimator may not know an option; say so, keep going
        col["torchrec_estimate_error"] = f"{type(e).__name__}: {e}"
        return
    col["torchrec_estimate_ms"] = score.perf_ms
    col["torchrec_peak_bytes"] = float(score.peak_ddr_bytes if topology.compute_device == "cpu"
                                       else score.peak_hbm_bytes)


def _peak(values: Sequence[float]) -> float:
    return max(values) if values else 0.0


def compare_planners(
    planner: Any,
    module: nn.Module,
    topology: Topology,
    batch_size: int,
    constraints: Optional[Dict[str, Any]],
    profile: HardwareProfile,
    torchrec_timeout_s: Optional[float] = None,
    stage: Callable[[str], ContextManager[Any]] = lambda name: contextlib.nullcontext(),
) -> PlannerComparison:
    """Plan ``module`` with ``planner`` (a ``SparseLiftPlanner`` for ``topology``, ``batch_size``
    and ``constraints``) and with TorchRec's ``EmbeddingShardingPlanner`` (``timeout_seconds`` =
    ``torchrec_timeout_s``), and price both (see :class:`PlannerComparison`). Each planner runs
    inside ``stage("sparselift")`` / ``stage("torchrec")`` (e.g. a progress message). A TorchRec
    ``PlannerError`` is recorded, not raised."""
    with stage("sparselift"):
        t0 = time.monotonic()
        ours = planner.plan_with_result(module)
        ours_time = time.monotonic() - t0
    s = ours.search
    sl: Dict[str, Any] = {}
    sl["planning_time_s"] = ours_time
    sl["optimizations"] = f"{s.pipeline}/{s.fwd_precision}/{s.bwd_precision}"
    sl["step_s"] = ours.rewritten_step_s  # with the rewrites the planner chose (plan.rewrites)
    sl["lower_bound_s"] = s.lower_bound_s
    sl["peak_device_bytes"] = _peak([b["device_bytes"] for b in ours.rank_breakdown()])
    base = evaluate_sharding_plan(module, ours.sharding_plan, topology, batch_size, constraints or None,
                                  hardware=profile)
    sl["step_sparse_dist_s"] = base.search.step.total_s
    sl["lower_bound_sparse_dist_s"] = base.search.lower_bound_s
    torchrec_estimates(sl, ours.sharding_options, topology, constraints)

    tr: Dict[str, Any] = {}
    with stage("torchrec"):
        got = torchrec_plan(module, get_default_sharders(), topology, batch_size, constraints,
                            timeout_s=torchrec_timeout_s, stats=[EmbeddingStats()], debug=True)
    tr_plan = got.plan
    if got.error:
        tr["error"] = got.error
    tr["planning_time_s"] = got.planning_time_s
    ev = None
    if tr_plan is not None:
        ev = evaluate_sharding_plan(module, tr_plan, topology, batch_size, constraints or None, hardware=profile)
        tr["optimizations"] = "sparse_dist/fp32/fp32"
        tr["step_s"] = ev.search.step.total_s
        tr["step_sparse_dist_s"] = ev.search.step.total_s
        tr["lower_bound_s"] = ev.search.lower_bound_s
        tr["peak_device_bytes"] = _peak([b["device_bytes"] for b in ev.rank_breakdown()])
        if got.options:
            torchrec_estimates(tr, got.options, topology, constraints)
        tr["proposals"] = got.proposals
    return PlannerComparison(sparselift=sl, torchrec=tr, result=ours, torchrec_result=ev)
