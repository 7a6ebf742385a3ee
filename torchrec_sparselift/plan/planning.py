"""``plan(request)``: the whole planning decision as one pure function of a :class:`PlanRequest`.

Every caller plans through it: ``SparseLiftPlanner`` (which adds TorchRec's interface, the plan
loader, the cache and the rank agreement), the command line, the benchmarks and the DLRM example
(through the planner). The request carries everything the decision reads: the tables and their
live handles, the module and the sharders, the topology, batch size, constraints, workload
statistics, the hardware profile (already moved to the job's link), the storage reservation, the
callbacks, the pipelines and precisions to choose among, the search options, the 2D options and the
never-slower rule's options with the model's error per term. Nothing here reads a file, a process
group or the clock beyond the search's time budget.

Steps, in order:

1. 1D: :func:`solve_group` over the whole world; 2D: :func:`~torchrec_sparselift.search.two_d.search_groups`
   calls it per group size and layout and keeps the fastest.
2. 1D: the rewrite stage (:func:`with_rewrites`, :mod:`.rewrites`): batch split, narrow ids and
   dedup chosen by price on the plan the search found.
3. The never-slower rule (:func:`apply_never_slower`, the rule itself in :mod:`.baseline`): TorchRec's
   plan is kept unless SparseLift's predicted gain exceeds the model's error on the terms they differ in.
4. :func:`execution_plan`: the result as an :class:`~.execution_plan.ExecutionPlan`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import attrs
from torchrec.distributed.planner.planners import to_sharding_plan
from torchrec.distributed.planner.types import ShardingOption, Topology

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.model import CostContext
from torchrec_sparselift.cost.pipelines import step_factor, trainable_pipelines
from torchrec_sparselift.cost.two_d import check_sync_interval
from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.plan.baseline import (
    BaselineDecision, TermErrors, TermTimes, baseline_name, kept_plan_pipeline, never_slower, never_slower_with_precision,
    same_sharding_price, term_seconds, with_pipeline_term, with_rewrite_term,
)
from torchrec_sparselift.plan.compare import torchrec_plan
from torchrec_sparselift.plan.evaluate import GivenPlan, evaluate_given, evaluate_sharding_plan
from torchrec_sparselift.plan.execution_plan import ExecutionPlan
from torchrec_sparselift.plan.loader import loaded_options
from torchrec_sparselift.plan.request import PlanRequest
from torchrec_sparselift.plan.result import PlanResult
from torchrec_sparselift.plan.rewrites import choose_rewrites, no_rewrites, search_rewrites
from torchrec_sparselift.search.options import to_sharding_option
from torchrec_sparselift.search.problem import build_problem, device_caps
from torchrec_sparselift.search.solve import solve
from torchrec_sparselift.search.torchrec_objective import build_torchrec_problem, placed_options, solve_torchrec
from torchrec_sparselift.search.two_d import (
    choose_replica_sync, group_setting, search_groups, strategies_to_price, sync_pipelines,
)
from torchrec_sparselift.semantics.layout import Layout2D
from torchrec_sparselift.semantics.tables import TableHandle
from torchrec_sparselift.validation import callback_problem
from torchrec_sparselift.vocabulary import has_side_streams, pipeline as pipeline_kind

__all__ = ["plan", "plan_result", "with_rewrites", "require_tables", "solve_group", "apply_never_slower", "loaded_result", "execution_plan", "run_callbacks",
           "check_complete"]

logger = logging.getLogger("torchrec_sparselift.planner")


def plan(request: PlanRequest, started: Optional[float] = None) -> ExecutionPlan:
    """The execution plan for ``request`` (module docstring); ``started``: the ``time.monotonic()``
    the planning began at (the search's budget counts from it; default: now)."""
    return execution_plan(request, plan_result(request, started))


def plan_result(request: PlanRequest, started: Optional[float] = None) -> PlanResult:
    """The plan for ``request`` with its details (:class:`PlanResult`)."""
    t0 = time.monotonic() if started is None else started
    require_tables(request)
    topo = request.topology
    if request.sharding_group_size is None:
        res = with_rewrites(request, solve_group(request, topo.world_size, request.time_budget_s, t0))
    else:
        choice = search_groups(
            topo.world_size, topo.local_world_size, request.sharding_group_size, request.layout_2d,
            request.time_budget_s, t0,
            lambda g, lay, budget: solve_group(request, g, budget, time.monotonic(), lay))
        res = attrs.evolve(choice.best, alternatives_2d=choice.alternatives_2d,
                           alternatives_layout=choice.alternatives_layout)
        if request.rewrites:  # the reason is recorded like every other refusal
            res = attrs.evolve(res, rewrites=no_rewrites(
                res.search.step.total_s, "a 2D plan: the rewrites (batch split, ids on the wire) apply to 1D plans only"))
    if request.never_slower is not False:
        res = apply_never_slower(res, request)
    return res


def with_rewrites(request: PlanRequest, res: PlanResult) -> PlanResult:
    """``res`` with the rewrite stage's choice (:func:`~torchrec_sparselift.plan.rewrites.choose_rewrites`)
    where the request allows any rewrite; unchanged where it allows none (``rewrites=()``)."""
    if not request.rewrites:
        return res
    return attrs.evolve(res, rewrites=choose_rewrites(request, res))


def _judged_rewrites(request: PlanRequest, kept: PlanResult, times: TermTimes, errors: TermErrors) -> PlanResult:
    """TorchRec's sharding ``kept`` (priced ``times`` without rewrites) with the rewrites chosen on
    it where they clear the never-slower rule against it (one plan with and without them:
    ``same_plan``), else with none and the rule's reason among the notes."""
    if not request.rewrites:
        return kept
    choice = choose_rewrites(request, kept)
    if not choice.chosen or not choice.saving_s:
        return attrs.evolve(kept, rewrites=choice)
    rewritten, errs = with_rewrite_term(times, choice.saving_s, errors)
    d = never_slower(rewritten, times, errs, same_plan=True)
    if d.leave:
        return attrs.evolve(kept, rewrites=choice)
    return attrs.evolve(kept, rewrites=choice.dropped(
        f"the never-slower rule: the rewrites' predicted saving on TorchRec's sharding, {d.gain_s * 1e3:.3f} ms, "
        f"is within the model's error {d.margin_s * 1e3:.3f} ms"))


def _rewritten_sharding(request: PlanRequest, evaluated: Callable[[str], PlanResult],
                        pipelines: Sequence[str]) -> Dict[str, PlanResult]:
    """TorchRec's sharding (``evaluated(pipeline)``: its plan priced under that pipeline) with the
    rewrites chosen on it under each of ``pipelines``
    (:func:`~torchrec_sparselift.plan.rewrites.choose_rewrites`), for the pipelines where any
    rewrite is chosen and saves time; empty where the request allows none."""
    if not request.rewrites:
        return {}
    out = {}
    for p in pipelines:
        kept = evaluated(p)
        choice = choose_rewrites(request, kept)
        if choice.chosen and choice.saving_s > 0:
            out[p] = attrs.evolve(kept, rewrites=choice)
    return out


def require_tables(request: PlanRequest) -> None:
    """A request must hold at least one table to plan (``SparseLiftPlannerError`` naming the fix)."""
    if not request.handles:
        raise SparseLiftPlannerError(
            "the module has no embedding tables that the given sharders can shard; pass the "
            "model that holds the EmbeddingBagCollection/EmbeddingCollection and matching sharders",
            kind="other",
        )


def solve_group(request: PlanRequest, group: int, budget: float, t0: float,
                layout: Optional[Layout2D] = None) -> PlanResult:
    """Plan the request's tables over ``group`` ranks (the whole world for 1D) laid out as
    ``layout`` (2D: the group-local topology has ``layout.group_ranks_per_host`` ranks per host,
    which is what the sharding group's all-to-all really crosses), choosing among the request's
    pipelines and precisions."""
    topo = request.topology
    W = topo.world_size
    handles = request.handles
    layout, local, gtopo = group_setting(topo, group, layout, request.layout_2d)
    reserved = request.storage_reservation.reserve(
        gtopo, request.batch_size, request.module, list(request.sharder_objects), request.constraints or None)
    profile = request.hardware
    if request.cost_model != "sparselift":
        return _solve_group_torchrec(request, gtopo, reserved, budget, t0)
    ctx = CostContext(
        profile=profile,
        world_size=group,
        local_world_size=local,
        batch_size=request.batch_size,
        dense=request.dense,
        allreduce_world_size=W,  # 2D: DDP all-reduces the dense gradients over the whole world
    )
    device_cap, host_cap = device_caps(reserved)
    pipelines = request.pipelines
    two_d = request.sharding_group_size is not None and group < W
    if layout is not None and group < W:  # only these pipelines run DMPCollection's sync
        pipelines = sync_pipelines(pipelines)
    # the rewrites the search prices (plan.rewrites.search_rewrites): 1D, SparseLift's model
    wire, split = search_rewrites(request, handles, pipelines, two_d=request.sharding_group_size is not None)
    prob = build_problem([h.spec for h in handles], ctx, device_cap, host_cap,
                         pipelines=pipelines, precisions=request.precisions, wire=wire, split_overhead_s=split)
    result = solve(prob, time_budget_s=max(0.5, budget - (time.monotonic() - t0)), solver=request.solver)
    options = [to_sharding_option(h, prob, cid, ranks) for h, (cid, ranks) in zip(handles, result.assignment)]
    options = run_callbacks(request.callbacks, options)
    check_complete(handles, options)
    bound = check_sync_interval(request.sync_interval, request.max_sync_interval)
    sync_s, interval, sync = 0.0, 1, None
    if two_d:
        strategies, refused = strategies_to_price(request.strategy_2d, topo.compute_device, request.sync_interval)
        sync = choose_replica_sync(prob, result.assignment, group, layout, profile, result.step.total_s,
                                   strategies, refused, request.sync_interval, bound)
        sync_s, interval = sync.sync_s, sync.sync_interval
    return PlanResult(
        sharding_plan=to_sharding_plan(options, gtopo), sharding_options=tuple(options), search=result,
        problem=prob, handles=tuple(handles), topology=topo, profile=profile,
        sharding_group_size=group if two_d else None, sync_interval=interval, sync_s=sync_s,
        layout_2d=layout if two_d else None, max_sync_interval=bound, replica_sync=sync,
    )


def _solve_group_torchrec(request: PlanRequest, gtopo: Topology, reserved: Topology, budget: float,
                          t0: float) -> PlanResult:
    """``cost_model="torchrec"``: plan ``gtopo`` under TorchRec's estimators (1D only)."""
    if request.sharding_group_size is not None:
        raise ValueError("cost_model='torchrec' plans 1D only (TorchRec's rating has no 2D "
                         "replica sync); use sharding_group_size=None")
    handles = request.handles
    trp = build_torchrec_problem(request.module, list(request.sharder_objects), [h.spec for h in handles], gtopo,
                                 reserved, request.batch_size, request.hardware, request.constraints or None,
                                 request.estimator)
    # the search gets at least half the budget even when TorchRec's enumeration and
    # estimation took the rest (at 856 tables x 128 ranks they take ~10 s on 2 cores)
    result = solve_torchrec(trp, max(0.5 * budget, budget - (time.monotonic() - t0)), request.solver)
    options = run_callbacks(request.callbacks, placed_options(trp, result.assignment))
    check_complete(handles, options)
    return PlanResult(
        sharding_plan=to_sharding_plan(options, gtopo), sharding_options=tuple(options),
        search=result, problem=trp.problem, handles=tuple(handles), topology=request.topology,
        profile=trp.problem.ctx.profile, torchrec_problem=trp,
    )


def apply_never_slower(res: PlanResult, request: PlanRequest) -> PlanResult:
    """``res``, or TorchRec's plan for the same inputs where SparseLift's predicted gain over it
    is within the model's error (:func:`~torchrec_sparselift.plan.baseline.never_slower`, with the
    request's ``model_errors``), or TorchRec's sharding under ``res``'s pipeline and precisions
    where that is priced no slower than ``res``
    (:func:`~torchrec_sparselift.plan.baseline.same_sharding_price`); the decision is in the
    result's ``never_slower``."""
    if request.cost_model != "sparselift":
        return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
            "the plan optimizes TorchRec's own estimator (cost_model='torchrec')"))
    if res.sharding_group_size is not None:
        return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
            "a 2D plan (TorchRec's planner plans 1D only)"))
    errors = request.model_errors
    if errors is None:
        raise ValueError("PlanRequest.model_errors: the never-slower rule needs the model's error per term "
                         "(calibration.term_error.profile_errors(profile)); pass never_slower=False to plan "
                         "without the rule")
    if request.never_slower == "auto" and not errors.measured:
        return attrs.evolve(res, never_slower=BaselineDecision.not_applied(
            f"the profile {res.profile.name} has no measured error (not fitted from real steps; "
            "never_slower=True applies the rule with the 30% error assumed for it)"))
    t0 = time.monotonic()
    topo = request.topology
    module, sharders = request.module, list(request.sharder_objects)
    constraints, batch = request.constraints or None, request.batch_size
    pipelines = request.pipelines
    try:
        tr = torchrec_plan(module, sharders, topo, batch, constraints, request.storage_reservation,
                           list(request.callbacks), timeout_s=request.time_budget_s)
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
        ours = GivenPlan.of(module, res.sharding_plan, topo, batch, constraints, request.stats, sharders)
        theirs = GivenPlan.of(module, tr.plan, topo, batch, constraints, request.stats, sharders)
        # each breakdown without the pipelines' measured step factors (a term the same in both
        # plans cancels), each factor a term of its own (plan.baseline.with_pipeline_term)
        unscaled = attrs.evolve(profile, pipeline_factors=())
        spans = topo.world_size > topo.local_world_size

        def priced(given: GivenPlan, under: str, fwd: str, bwd: str) -> TermTimes:
            return with_pipeline_term(term_seconds(lambda p: given.step_time(p, under, fwd, bwd).total_s,
                                                   unscaled), under, step_factor(profile, under, spans))

        def theirs_at(fwd: str, bwd: str, under: str = pipeline) -> TermTimes:
            return priced(theirs, under, fwd, bwd)

        results: Dict[tuple, PlanResult] = {}  # TorchRec's plan as a PlanResult, once per setting

        def theirs_result(under: str, fwd: str, bwd: str) -> PlanResult:
            if (under, fwd, bwd) not in results:
                results[under, fwd, bwd] = evaluate_given(theirs, tr.plan, profile, under, fwd, bwd)
            return results[under, fwd, bwd]

        # with lossy comms, against TorchRec's plan with the same comms (qcomm by hand) and at
        # full precision (plan.baseline.never_slower_with_precision)
        full = (defaults.COMM_PRECISION, defaults.COMM_PRECISION)
        plain = priced(ours, s.pipeline, s.fwd_precision, s.bwd_precision)
        # the rewrites are settings of SparseLift's plan: their saving is a term of its own
        candidate, errors = with_rewrite_term(plain, res.rewrites.saving_s if res.rewrites else 0.0, errors)
        decision, kept_precision = never_slower_with_precision(
            candidate, theirs_at, (s.fwd_precision, s.bwd_precision), full, errors)
        fwd, bwd = kept_precision or full  # TorchRec's plan's comms, where it is kept
        kept_pipeline = pipeline
        # the pipelines that train TorchRec's plan exactly (its data-parallel tables' dense kernel)
        dense = any(getattr(o, "compute_kernel", None) == "dense" for o in tr.options)
        streams = has_side_streams(topo.compute_device)
        trainable = trainable_pipelines(pipelines, dense, streams=streams)
        # the module's feature processors are the same for both plans, and SparseLift's pipeline
        # passed them: only TorchRec's dense-kernel tables can conflict with it
        if (decision.leave and pipeline_kind(s.pipeline).conflict(dense, streams) is None
                and same_sharding_price(plain, theirs_at(s.fwd_precision, s.bwd_precision, s.pipeline))):
            # the gain is all in SparseLift's pipeline and precisions: TorchRec's sharding under them
            kept_pipeline, fwd, bwd = s.pipeline, s.fwd_precision, s.bwd_precision
            decision = attrs.evolve(decision, candidate_pipeline=s.pipeline, baseline_sharding=True)
        rewritten_kept: Optional[PlanResult] = None
        if not decision.leave:
            # TorchRec's plan is kept: under another of the planner's pipelines, with or without the
            # rewrites chosen on it there, where that clears the rule against TorchRec's plan under
            # its default one (plan.baseline.kept_plan_pipeline)
            others = [p for p in trainable if p != pipeline]
            under = {p: theirs_at(fwd, bwd, p) for p in trainable}
            rewritten = (_rewritten_sharding(request, lambda p: theirs_result(p, fwd, bwd), trainable)
                         if others else {})
            rewritten_times = {}
            for p, r in rewritten.items():
                rewritten_times[p], errors = with_rewrite_term(under[p], r.rewrites.saving_s, errors)
            theirs_default = under.pop(pipeline) if pipeline in under else theirs_at(fwd, bwd)
            alt = kept_plan_pipeline(theirs_default, under, errors,
                                     baseline_name((fwd, bwd), full), rewritten=rewritten_times,
                                     default=pipeline) if others else None
            if alt is not None:
                logger.info("SparseLiftPlanner: %s", decision.describe())
                kept_pipeline, decision = alt
                rewritten_kept = rewritten[kept_pipeline] if decision.with_rewrites else None
        # TorchRec's sharding, as it is kept, priced without rewrites (the rewrites on it are judged against it)
        kept_times = (None if (decision.leave and not decision.candidate_pipeline) or rewritten_kept is not None
                      else theirs_at(fwd, bwd, kept_pipeline))
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
    check_complete(res.handles, options)
    kept = rewritten_kept or theirs_result(kept_pipeline, fwd, bwd)
    search = attrs.evolve(kept.search, solver="torchrec(never_slower)", status="kept",
                          planning_time_s=s.planning_time_s + time.monotonic() - t0)
    if kept_times is not None:
        kept = _judged_rewrites(request, kept, kept_times, request.model_errors or errors)
    return attrs.evolve(kept, sharding_options=tuple(options), search=search, never_slower=decision)


def loaded_result(loader: Any, request: PlanRequest, callbacks: Sequence[Any] = ()) -> Optional[PlanResult]:
    """TorchRec ``PlanLoader`` ``loader``'s plan for ``request`` (its context already checked:
    :func:`~.loader.check_context`), validated against the tables (:func:`~.loader.loaded_options`),
    passed through ``callbacks`` and priced; ``None`` when the loader has none."""
    topo = request.topology
    options = loaded_options(loader.load(), request.handles, topo.world_size)
    if options is None:
        return None
    options = run_callbacks(callbacks, options)
    res = evaluate_sharding_plan(request.module, to_sharding_plan(options, topo), topo, request.batch_size,
                                 request.constraints or None, request.hardware, request.stats,
                                 list(request.sharder_objects))
    logger.info("SparseLiftPlanner: using the loaded plan %r (predicted step %.3f ms)",
                getattr(loader, "get_plan_id", lambda: None)(), res.step_time_s * 1e3)
    return attrs.evolve(res, sharding_options=tuple(options))


def execution_plan(request: PlanRequest, res: PlanResult) -> ExecutionPlan:
    """``res`` as the :class:`ExecutionPlan` the runtime applies and the cache stores."""
    s = res.search
    return ExecutionPlan(
        sharding_plan=res.sharding_plan,
        optimizations=res.optimizations(),
        prediction=res.prediction(),
        fingerprint=request.fingerprint(),
        stats=request.stats,
        planner_info={
            "planner": "SparseLiftPlanner",
            "solver": s.solver if s else "none",
            "status": s.status if s else "empty",
            "planning_time_s": round(s.planning_time_s, 4) if s else 0.0,
            "hardware": res.profile.name,
            "alternatives": {k: v for k, v in s.alternatives} if s else {},
            **({"never_slower": res.never_slower.to_dict()} if res.never_slower is not None else {}),
            **({"rewrites": res.rewrites.to_dict()} if res.rewrites is not None else {}),
        },
    )


def run_callbacks(callbacks: Sequence[Callable[[List[ShardingOption]], List[ShardingOption]]],
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


def check_complete(handles: Sequence[TableHandle], options: Sequence[ShardingOption]) -> None:
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

