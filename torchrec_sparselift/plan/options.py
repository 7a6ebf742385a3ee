"""SparseLift's own planner options, grouped into a few values that are validated once.

``SparseLiftPlanner`` takes ``EmbeddingShardingPlanner``'s arguments as TorchRec spells them and
SparseLift's extra keyword arguments; :func:`planner_options` checks all of them together (every
problem listed in one error, :mod:`torchrec_sparselift.validation`) and returns a
:class:`PlannerOptions`:

- :class:`SearchOptions`: what the search may choose and how long it runs (pipelines, lossy comms,
  staleness, solver, time budget, cost model);
- :class:`TwoDOptions`: 2D sparse parallelism (group size, sync interval and its bound, layout,
  strategy);
- :class:`RuleOptions`: the never-slower rule (``never_slower``, ``model_errors``);
- :class:`CacheOptions`: reuse of execution plans across runs (``cache_dir``, ``drift_tolerance``).

Each value checks its own fields on construction (types and choices); the checks that need the
topology or several values at once are :func:`planner_options`'s. :func:`build_request` makes
the plan request (:class:`~.request.PlanRequest`) from these values and the model's tables.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import attrs
from torchrec.distributed.planner.types import ParameterConstraints, Topology

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.cost.model import DenseWork
from torchrec_sparselift.cost.pipelines import trainable_pipelines
from torchrec_sparselift.cost.two_d import check_sync_interval
from torchrec_sparselift.cost.step_terms import CPU_STEP_TERMS
from torchrec_sparselift.plan.baseline import FIXED_TERM, REWRITE_TERM, TermErrors, pipeline_term
from torchrec_sparselift.plan.request import PlanRequest, describe_sharders
from torchrec_sparselift.plan.rewrites import REWRITES, rewrite_names, rewrite_problem
from torchrec_sparselift.search.torchrec_objective import estimator_identity
from torchrec_sparselift.search.two_d import strategies_to_price
from torchrec_sparselift.semantics.dense import dense_work
from torchrec_sparselift.semantics.tables import TableHandle, extract_tables, is_feature_processed
from torchrec_sparselift.semantics.workload import WorkloadStats
from torchrec_sparselift.validation import (
    Problems, argument_problems, option_problems, planner_option_problems, raise_problems, validate_inputs,
)
from torchrec_sparselift.vocabulary import (
    COST_MODELS, LAYOUT_2D_CHOICES, PIPELINES, SOLVERS, STALE_PIPELINES, STRATEGY_2D_CHOICES, SYNC_PIPELINES,
    comm_precision_pairs, has_side_streams, pipeline as pipeline_kind,
)

__all__ = ["SearchOptions", "TwoDOptions", "RuleOptions", "CacheOptions", "PlannerOptions", "planner_options",
           "check_term_names",
           "pipelines_for_cores", "exact_pipelines", "request_tables", "build_request"]

_bool = attrs.validators.instance_of(bool)
_opt_pos_int = attrs.validators.optional([attrs.validators.instance_of(int), attrs.validators.ge(1)])


def _choice(choices: Sequence[Any]) -> Any:
    return attrs.validators.in_(tuple(choices))


def _pipelines(value: Optional[Sequence[str]]) -> Optional[Tuple[str, ...]]:
    return None if value is None else tuple(value)


@attrs.frozen(kw_only=True)
class SearchOptions:
    """What the search may choose and how long it runs.

    ``pipelines``: the train-pipeline kinds to choose from (None: the synchronous ones, plus the
    stale ones with ``allow_staleness``); ``allow_lossy_comm``: fp16/bf16 communication (fp8 also
    with ``allow_fp8``); ``allow_staleness``: the one-step-stale pipelines; ``time_budget_s``: the
    search budget; ``solver``: "auto", "heuristic" or "milp"; ``cost_model``: "sparselift" or
    "torchrec" (optimize TorchRec's own rating, with ``estimator`` replacing its estimators);
    ``rewrites``: the rewrites the rewrite stage may choose (``plan.rewrites.REWRITES``; None given:
    all; ``()``: none); ``per_sample``: the user declares the model's dense part per-sample (the
    batch split then needs no proof from the module)."""

    pipelines: Optional[Tuple[str, ...]] = attrs.field(
        default=None, converter=_pipelines,
        validator=attrs.validators.optional(attrs.validators.deep_iterable(_choice(PIPELINES))))
    allow_lossy_comm: bool = attrs.field(default=False, validator=_bool)
    allow_fp8: bool = attrs.field(default=False, validator=_bool)
    allow_staleness: bool = attrs.field(default=False, validator=_bool)
    time_budget_s: float = attrs.field(default=defaults.TIME_BUDGET_S, converter=float,
                                       validator=attrs.validators.gt(0))
    solver: str = attrs.field(default=defaults.SOLVER, validator=_choice(SOLVERS))
    cost_model: str = attrs.field(default="sparselift", validator=_choice(COST_MODELS))
    estimator: Any = attrs.field(default=None, eq=False)
    rewrites: Tuple[str, ...] = attrs.field(default=REWRITES, converter=rewrite_names)
    per_sample: bool = attrs.field(default=False, validator=_bool)

    def __attrs_post_init__(self) -> None:
        if self.estimator is not None and self.cost_model != "torchrec":
            raise ValueError("estimator= is TorchRec's ShardEstimator: pass cost_model='torchrec' with it")

    @property
    def pipelines_by_default(self) -> bool:
        """No pipeline list was given: the planner may narrow the default set to what runs here."""
        return self.pipelines is None

    def requested_pipelines(self) -> Tuple[str, ...]:
        """The pipelines asked for: the user's list, else the default set."""
        if self.pipelines is not None:
            return self.pipelines
        return SYNC_PIPELINES + (STALE_PIPELINES if self.allow_staleness else ())

    def precisions(self, compute_device: str) -> Tuple[Tuple[str, str], ...]:
        """The (forward, backward) comm precisions the search may choose on ``compute_device``."""
        return comm_precision_pairs(self.allow_lossy_comm, self.allow_fp8, compute_device)


@attrs.frozen(kw_only=True)
class TwoDOptions:
    """2D sparse parallelism. ``sharding_group_size``: None (1D), "auto" or a divisor of the world
    size; ``sync_interval``: a pinned replica sync interval (steps); ``max_sync_interval``: the
    largest interval allowed (None: the measured default); ``layout_2d``: "auto", "strided" or
    "contiguous"; ``strategy_2d``: "auto", "default" or "fully_sharded"."""

    sharding_group_size: Union[None, int, str] = None
    sync_interval: Optional[int] = attrs.field(default=None, validator=_opt_pos_int)
    max_sync_interval: Optional[int] = attrs.field(default=None, validator=_opt_pos_int)
    layout_2d: str = attrs.field(default=defaults.LAYOUT_2D, validator=_choice(LAYOUT_2D_CHOICES))
    strategy_2d: str = attrs.field(default=defaults.STRATEGY_2D, validator=_choice(STRATEGY_2D_CHOICES))

    @property
    def is_2d(self) -> bool:
        return self.sharding_group_size is not None

    @property
    def sync_bound(self) -> int:
        """The sync-interval bound in force (:func:`~torchrec_sparselift.cost.two_d.check_sync_interval`)."""
        return check_sync_interval(self.sync_interval, self.max_sync_interval)


@attrs.frozen(kw_only=True)
class RuleOptions:
    """The never-slower rule: ``never_slower`` "auto", True or False; ``model_errors``: the
    model's error per term to apply it with (None: the profile store's for the profile)."""

    never_slower: Union[bool, str] = attrs.field(default=defaults.NEVER_SLOWER,
                                                 validator=_choice(defaults.NEVER_SLOWER_CHOICES))
    model_errors: Optional[TermErrors] = attrs.field(default=None)

    @model_errors.validator
    def _check_errors(self, attribute: Any, value: Any) -> None:
        if value is not None and not isinstance(value, TermErrors):
            raise ValueError(f"model_errors must be a TermErrors (calibration.term_error.profile_errors(...)), "
                             f"got {type(value).__name__}")


@attrs.frozen(kw_only=True)
class CacheOptions:
    """Reuse of execution plans: ``cache_dir`` (None: no cache) and ``drift_tolerance``, how far
    observed statistics may move before a stored plan is re-planned."""

    cache_dir: Optional[str] = None
    drift_tolerance: float = attrs.field(default=defaults.DRIFT_TOLERANCE, converter=float)


@attrs.frozen(kw_only=True)
class PlannerOptions:
    """Every SparseLift option of one planner: ``hardware`` (a profile, a preset name, a profile
    path, "auto" or None), ``workload`` (observed statistics) and the four groups."""

    hardware: Any = None
    workload: Optional[WorkloadStats] = None
    search: SearchOptions = attrs.field(factory=SearchOptions)
    two_d: TwoDOptions = attrs.field(factory=TwoDOptions)
    rule: RuleOptions = attrs.field(factory=RuleOptions)
    cache: CacheOptions = attrs.field(factory=CacheOptions)


# -- named things checked by name -----------------------------------------------------------


def check_term_names(errors: Optional[TermErrors]) -> None:
    """A given ``model_errors`` must name real terms: step-fit terms, ``fixed`` and the
    pipelines' factor terms; an unknown name (a typo would silently leave the real term at the
    default error) raises naming the valid ones."""
    if errors is None:
        return
    known = [t.name for t in CPU_STEP_TERMS] + [FIXED_TERM, REWRITE_TERM] + [pipeline_term(p) for p in PIPELINES]
    unknown = sorted(set(errors.errors) - set(known))
    if unknown:
        raise ValueError(f"model_errors names unknown terms {unknown}: the terms are {known}")


def planner_options(
    *, topology: Topology, batch_size: Any, constraints: Optional[Dict[str, ParameterConstraints]],
    storage_reservation: Any, callbacks: Any, stats: Any, timeout_seconds: Any,
    heuristical_storage_reservation_percentage: float, hardware: Any = None, workload: Any = None,
    pipelines: Optional[Sequence[str]] = None, allow_lossy_comm: bool = False, allow_fp8: bool = False,
    allow_staleness: bool = False, time_budget_s: Optional[float] = None, cache_dir: Optional[str] = None,
    drift_tolerance: float = defaults.DRIFT_TOLERANCE, solver: str = defaults.SOLVER,
    sharding_group_size: Any = None, sync_interval: Optional[int] = None, cost_model: str = "sparselift",
    estimator: Any = None, max_sync_interval: Optional[int] = None, layout_2d: str = defaults.LAYOUT_2D,
    never_slower: Any = defaults.NEVER_SLOWER, strategy_2d: str = defaults.STRATEGY_2D, model_errors: Any = None,
    rewrites: Optional[Sequence[str]] = None, per_sample: bool = False,
) -> PlannerOptions:
    """Check ``SparseLiftPlanner``'s arguments together (one ``ValueError`` listing every problem,
    TorchRec's arguments included) and group SparseLift's into a :class:`PlannerOptions`."""
    reservation_pct = heuristical_storage_reservation_percentage if storage_reservation is None else None
    raise_problems(argument_problems(
        topology=topology, constraints=constraints, hardware=hardware, workload=workload,
        pipelines=pipelines, callbacks=callbacks, stats=stats,
        storage_reservation=storage_reservation, cache_dir=cache_dir,
        flags={"allow_lossy_comm": allow_lossy_comm, "allow_fp8": allow_fp8, "allow_staleness": allow_staleness},
        choices={"cost_model": (cost_model, COST_MODELS), "layout_2d": (layout_2d, LAYOUT_2D_CHOICES)},
        required={
            "drift_tolerance": (drift_tolerance, f"drift_tolerance={defaults.DRIFT_TOLERANCE}"),
            "heuristical_storage_reservation_percentage": (
                heuristical_storage_reservation_percentage if storage_reservation is None else 0,
                f"heuristical_storage_reservation_percentage={defaults.STORAGE_RESERVATION_PERCENTAGE}"),
        },
        topology_type=Topology, constraint_type=ParameterConstraints,
        profile_type=HardwareProfile, workload_type=WorkloadStats,
    ) + planner_option_problems(
        topology=topology, batch_size=batch_size, timeout_seconds=timeout_seconds,
        time_budget_s=time_budget_s, pipelines=pipelines, known_pipelines=PIPELINES,
        stale_pipelines=STALE_PIPELINES, allow_staleness=allow_staleness, solver=solver,
        sharding_group_size=sharding_group_size, sync_interval=sync_interval,
        drift_tolerance=drift_tolerance, never_slower=never_slower, reservation_percentage=reservation_pct,
    ), "SparseLiftPlanner's arguments")
    given = dict(storage_reservation=storage_reservation, timeout_seconds=timeout_seconds,
                 heuristical_storage_reservation_percentage=heuristical_storage_reservation_percentage,
                 pipelines=pipelines, allow_lossy_comm=allow_lossy_comm, allow_fp8=allow_fp8,
                 allow_staleness=allow_staleness, time_budget_s=time_budget_s, cache_dir=cache_dir,
                 drift_tolerance=drift_tolerance, sharding_group_size=sharding_group_size, sync_interval=sync_interval,
                 cost_model=cost_model, estimator=estimator, max_sync_interval=max_sync_interval, layout_2d=layout_2d,
                 never_slower=never_slower, strategy_2d=strategy_2d, model_errors=model_errors,
                 rewrites=rewrites, per_sample=per_sample)
    errors, warned = option_problems(given)
    bad_rewrites = rewrite_problem(rewrites)
    if bad_rewrites:
        errors.append(bad_rewrites)
    if not isinstance(per_sample, bool):
        errors.append(f"per_sample must be True or False, got {per_sample!r}")
    if model_errors is not None and not isinstance(model_errors, TermErrors):
        errors.append(f"model_errors must be a TermErrors (calibration.term_error.profile_errors(...)), got "
                      f"{type(model_errors).__name__}")
    raise_problems(errors, "SparseLiftPlanner's arguments")
    for w in warned:
        warnings.warn(f"sparselift: {w}", stacklevel=3)
    search = SearchOptions(
        pipelines=pipelines, allow_lossy_comm=bool(allow_lossy_comm), allow_fp8=bool(allow_fp8),
        allow_staleness=bool(allow_staleness), time_budget_s=float(time_budget_s or timeout_seconds
                                                                   or defaults.TIME_BUDGET_S),
        solver=solver, cost_model=cost_model, estimator=estimator, rewrites=rewrites, per_sample=per_sample)
    check_sync_interval(sync_interval, max_sync_interval)
    if strategy_2d not in STRATEGY_2D_CHOICES:  # cost_model and layout_2d are argument_problems' choices
        raise ValueError(f"strategy_2d must be one of {', '.join(map(repr, STRATEGY_2D_CHOICES))}, got {strategy_2d!r}")
    # a 1D plan prices no 2D strategy; a 2D one must have one left on this device
    strategies_to_price(strategy_2d if sharding_group_size is not None else "auto", topology.compute_device,
                        sync_interval)
    two_d = TwoDOptions(sharding_group_size=sharding_group_size, sync_interval=sync_interval,
                        max_sync_interval=max_sync_interval, layout_2d=layout_2d, strategy_2d=strategy_2d)
    check_term_names(model_errors if isinstance(model_errors, TermErrors) else None)
    return PlannerOptions(hardware=hardware, workload=workload, search=search, two_d=two_d,
                          rule=RuleOptions(never_slower=never_slower, model_errors=model_errors),
                          cache=CacheOptions(cache_dir=cache_dir, drift_tolerance=drift_tolerance))


def pipelines_for_cores(search: SearchOptions, compute_device: str, ranks: int, cores: int
                        ) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(the pipelines a plan chooses among, those left out) where ``ranks`` ranks share a machine
    with ``cores`` CPU cores: on CPU with the default set, the kinds whose overlap runs beside the
    rank's compute (``needs_spare_cores``: gloo's threads move the collectives while the rank
    computes) are left out where ranks outnumber the cores (measured: docs/overlap.md); a list the
    user passed is kept as given."""
    asked = search.requested_pipelines()
    if not search.pipelines_by_default or compute_device != "cpu" or ranks <= cores:
        return asked, ()
    kept = tuple(p for p in asked if not pipeline_kind(p).needs_spare_cores)
    if not kept:
        return asked, ()
    return kept, tuple(p for p in asked if p not in kept)


def exact_pipelines(search: SearchOptions, compute_device: str, handles: Sequence[TableHandle],
                    pipelines: Tuple[str, ...]) -> Tuple[str, ...]:
    """``pipelines`` less, on a device with side streams, the kinds that look up the next batch
    before the dense optimizer's step where the model has feature processors
    (``cost.pipelines.trainable_pipelines``); a user's list that loses one is warned about."""
    fp = sorted({h.module[0] for h in handles if is_feature_processed(h.sharder_key)})
    kept = trainable_pipelines(pipelines, False, streams=has_side_streams(compute_device), feature_processors=bool(fp))
    if kept != pipelines and not search.pipelines_by_default:
        warnings.warn(f"sparselift: pipeline(s) {', '.join(p for p in pipelines if p not in kept)} left out: on "
                      f"{compute_device} they look up the next batch before the dense optimizer updates the feature "
                      f"processors of {', '.join(fp)} (TorchRec's TrainPipelineFusedSparseDist assumes none)",
                      stacklevel=5)
    return kept


def request_tables(options: PlannerOptions, topology: Topology, batch_size: int,
                   constraints: Optional[Dict[str, ParameterConstraints]], module: Any,
                   sharders: Sequence[Any]) -> Tuple[Tuple[TableHandle, ...], DenseWork]:
    """The tables ``sharders`` recover from ``module`` and its dense work, every input validated
    (all problems listed in one error)."""
    problems = Problems()
    handles = extract_tables(module, list(sharders), topology.compute_device, batch_size, constraints,
                             options.workload, problems=problems)
    validate_inputs(handles, topology, batch_size, constraints, options.workload, problems=problems)
    return tuple(handles), dense_work(module, handles)


def build_request(options: PlannerOptions, *, topology: Topology, batch_size: int,
                  constraints: Optional[Dict[str, ParameterConstraints]], storage_reservation: Any,
                  callbacks: Sequence[Any], hardware: HardwareProfile, pipelines: Tuple[str, ...],
                  handles: Sequence[TableHandle] = (), dense: Optional[DenseWork] = None, module: Any = None,
                  sharders: Sequence[Any] = (), model_errors: Optional[TermErrors] = None) -> PlanRequest:
    """The :class:`PlanRequest` for the tables ``handles`` of ``module`` (:func:`request_tables`)
    under ``options``, choosing among ``pipelines`` (those that train it exactly,
    :func:`exact_pipelines`), priced with ``hardware``, with the never-slower rule's
    ``model_errors``. Without tables: the planner's context alone."""
    if handles:
        pipelines = exact_pipelines(options.search, topology.compute_device, handles, pipelines)
    s, two_d = options.search, options.two_d
    return PlanRequest(
        tables=tuple(h.spec for h in handles), handles=tuple(handles), topology=topology, batch_size=batch_size,
        constraints=constraints, stats=options.workload, hardware=hardware, dense=dense or DenseWork(),
        sharders=describe_sharders(sharders), storage_reservation=storage_reservation, callbacks=tuple(callbacks),
        pipelines=pipelines, precisions=s.precisions(topology.compute_device), allow_lossy_comm=s.allow_lossy_comm,
        allow_fp8=s.allow_fp8, allow_staleness=s.allow_staleness, solver=s.solver, time_budget_s=s.time_budget_s,
        sharding_group_size=two_d.sharding_group_size, sync_interval=two_d.sync_interval,
        cost_model=s.cost_model if s.cost_model != "torchrec" else f"torchrec:{estimator_identity(s.estimator)}",
        max_sync_interval=two_d.sync_bound if two_d.is_2d else None,
        layout_2d=two_d.layout_2d if two_d.is_2d else "auto", never_slower=options.rule.never_slower,
        strategy_2d=two_d.strategy_2d if two_d.is_2d else "auto",
        rewrites=s.rewrites, per_sample=s.per_sample,
        module=module, sharder_objects=tuple(sharders), estimator=s.estimator, model_errors=model_errors,
    )
