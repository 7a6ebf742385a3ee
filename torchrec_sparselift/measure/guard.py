"""Measured guard: the model proposes, a few real steps decide.

::

    ep, result, reused = guarded_execution_plan(
        lambda: build_model(...), pg, device, batches, topology=topo, batch_size=256,
        constraints=cons, hardware=profile, guard=MeasuredGuard(candidates=3, steps=8),
        cache_dir=".sparselift_cache")
    print(result.format())

:func:`choose_measured` is the rule, independent of how plans are made or run: it calls
``trial(label, plan)`` (seconds per steady-state step, measured) for each candidate, in the given
order, and keeps the candidate with the lowest measured time (ties: the earlier candidate, i.e. the
one the model ranked first). Candidates whose plans are the same (equal ``key``) are measured once:
the later ones share the first one's trials (TorchRec's plan is often exactly SparseLift's;
measuring it twice would only let noise pick between a plan and itself). :class:`GuardResult`
records every trial (label, source, predicted and measured seconds) as plain JSON, which the
execution plan stores so a cached plan is reused without measuring again.

:func:`guarded_execution_plan` makes the candidates: SparseLift's plan, then SparseLift's best plans
under alternative restrictions (no data-parallel tables; table-wise only; no row-wise),
de-duplicated and ordered by predicted step time, ``guard.candidates`` of them in all; plus
TorchRec's ``EmbeddingShardingPlanner`` plan (``guard.torchrec``). Each is trained for
``guard.warmup + guard.steps`` steps on the real model and the given pre-built batches, with the
train pipeline its plan runs (:func:`torchrec_sparselift.measure.probe.measure_plan`, the median
step of the per-step slowest rank), ``guard.rounds`` times interleaved, and the fastest is kept.

The returned :class:`~torchrec_sparselift.plan.ExecutionPlan` is SparseLift's, with the kept plan's
sharding and prediction and the trials in ``planner_info["measured_guard"]``. With ``cache_dir`` it is
stored under the fingerprint of the planner's ``PlanRequest`` with its ``measured_guard`` field set to
the guard settings (``guarded-<digest>.json``) and a later call with the same inputs reuses it
without planning or measuring (guarded and unguarded plans never share a cache entry). With
``guard.feedback`` the trials, linearized in the profile's terms, join this machine's stored
step-fit records and its profile is refitted (:func:`torchrec_sparselift.calibration.feedback.add_feedback`).

Cost: ``guard.rounds`` x (one DMP build plus ``warmup + steps`` steps) per candidate (measured on
the 2-core machine, defaults 2 x (5 + 16): 2.6-3.0 s per trial for the default DLRM example, 17 s for
3 candidates under load), and one planner run per alternative.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.atomic import write_text
from torchrec_sparselift.errors import FileFormatError
from torchrec_sparselift.files import canonical_digest, read_attrs
from torchrec_sparselift.calibration.feedback import feedback_records
from torchrec_sparselift.cost.hardware import HardwareProfile, profile_for_topology
from torchrec_sparselift.vocabulary import (
    DATA_PARALLEL,
    OPT_IN_SHARDING_TYPES,
    ROW_WISE,
    SHARDING_TYPES,
    TABLE_WISE,
)
from torchrec_sparselift.validation import int_at_least
from torchrec_sparselift.calibration.feedback import add_feedback
from torchrec_sparselift.calibration.pricer import PlanPricer
from torchrec_sparselift.calibration.store import current_fingerprint
from torchrec_sparselift.measure.probe import measure_plan
from torchrec_sparselift.plan import ExecutionPlan, sharding_plan_digest, table_specs
from torchrec_sparselift.plan.rewrites import with_rewrites_of
from torchrec_sparselift.planner import SparseLiftPlanner, evaluate_sharding_plan
from torchrec_sparselift.runtime.pipelines import make_train_pipeline

__all__ = ["MeasuredGuard", "GuardTrial", "GuardResult", "Candidate", "choose_measured", "guarded_execution_plan",
           "guard_cache_path", "guard_fingerprint", "ALTERNATIVES", "feedback_records"]

logger = logging.getLogger(__name__)



@attrs.frozen(kw_only=True)
class MeasuredGuard:
    """Guard settings. ``candidates``: SparseLift plans measured (its plan and the next-best
    alternatives the model ranks); ``torchrec``: also measure ``EmbeddingShardingPlanner``'s plan;
    ``steps`` / ``warmup``: timed and untimed steps per trial; ``rounds``: trials per candidate,
    interleaved (every candidate once per round), a candidate's time being its fastest round (a
    disturbance only ever slows a trial down); ``feedback``: add the trials to this machine's
    stored step-fit records and refit its profile."""

    candidates: int = attrs.field(default=3, validator=int_at_least(1))
    torchrec: bool = True
    steps: int = attrs.field(default=16, validator=int_at_least(1))
    warmup: int = attrs.field(default=5, validator=int_at_least(0))
    rounds: int = attrs.field(default=2, validator=int_at_least(1))
    feedback: bool = True

    def to_dict(self) -> Dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Candidate:
    """A plan to try: ``label`` (unique), ``source`` ("sparselift" or "torchrec"), the plan and
    the model's prediction (seconds; None when not priced)."""

    label: str
    source: str
    plan: Any = attrs.field(eq=False, repr=False)
    predicted_s: Optional[float] = None


@attrs.frozen
class GuardTrial:
    """A candidate's measured step time (its fastest round) and every round's (``runs_s``).
    ``same_as``: the label of an earlier candidate with the same plan, whose trials these are (the
    plan was not measured again); None when this candidate was measured itself."""

    label: str
    source: str
    predicted_s: Optional[float]
    measured_s: float
    runs_s: Tuple[float, ...] = attrs.field(default=(), converter=tuple)
    same_as: Optional[str] = None


@attrs.frozen
class GuardResult:
    """Every trial and the chosen label."""

    chosen: str
    trials: Tuple[GuardTrial, ...]
    settings: Dict[str, Any] = attrs.field(factory=dict)

    def trial(self, label: str) -> GuardTrial:
        return next(t for t in self.trials if t.label == label)

    @property
    def chosen_trial(self) -> GuardTrial:
        return self.trial(self.chosen)

    def torchrec_over_chosen(self) -> Optional[float]:
        """TorchRec's measured step time / the chosen plan's (None without a TorchRec trial)."""
        tr = [t for t in self.trials if t.source == "torchrec"]
        if not tr:
            return None
        return tr[0].measured_s / self.chosen_trial.measured_s

    def to_dict(self) -> Dict[str, Any]:
        return dict(chosen=self.chosen, settings=dict(self.settings),
                    trials=[dict(attrs.asdict(t), runs_s=list(t.runs_s)) for t in self.trials])

    @classmethod
    def from_dict(cls, data: Any) -> "GuardResult":
        """The result :meth:`to_dict` wrote (a dict, or a file's reader)."""
        trial_kinds = {"label": str, "source": str, "predicted_s": float, "measured_s": float, "runs_s": list,
                       "same_as": str}
        return read_attrs(cls, data, kinds={"chosen": str, "settings": dict},
                          trials=lambda r: tuple(read_attrs(GuardTrial, t, kinds=trial_kinds) for t in r.objs("trials")))

    def format(self) -> str:
        """One line per trial: measured and predicted ms, the chosen one marked."""
        lines = []
        for t in self.trials:
            pred = "" if t.predicted_s is None else f", predicted {t.predicted_s * 1e3:.2f} ms"
            mark = "  <- kept" if t.label == self.chosen else ""
            same = f" (the same plan as {t.same_as})" if t.same_as else ""
            lines.append(f"  {t.label:<28} measured {t.measured_s * 1e3:8.2f} ms/step{pred}{same}{mark}")
        ratio = self.torchrec_over_chosen()
        if ratio is not None:
            lines.append(f"  TorchRec / kept plan: {ratio:.3f}x")
        return "\n".join(lines)


def choose_measured(candidates: Sequence[Candidate], trial: Callable[[str, Any], float],
                    settings: Optional[Dict[str, Any]] = None, rounds: int = 1,
                    key: Optional[Callable[[Any], Any]] = None) -> Tuple[Candidate, GuardResult]:
    """Measure every candidate ``rounds`` times, interleaved (round r trials every candidate in the
    given order), with ``trial(label, plan) -> seconds``; a candidate's time is its fastest round;
    keep the fastest candidate (ties: the earlier one). Labels must be unique; a trial must return
    a positive finite time. ``key(plan)``: plan identity (e.g.
    :func:`~torchrec_sparselift.plan.sharding_plan_digest`); a candidate whose key equals an earlier
    one's is not measured but shares its trials (``GuardTrial.same_as``), so the earlier is kept."""
    if not candidates:
        raise ValueError("the measured guard needs at least one candidate plan")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    labels = [c.label for c in candidates]
    if len(set(labels)) != len(labels):
        raise ValueError(f"candidate labels must be unique, got {labels}")
    first: Dict[Any, int] = {}
    owner = [first.setdefault(key(c.plan), i) if key is not None else i for i, c in enumerate(candidates)]
    runs: List[List[float]] = [[] for _ in candidates]
    for _ in range(rounds):
        for i, (c, r) in enumerate(zip(candidates, runs)):
            if owner[i] != i:
                continue
            s = float(trial(c.label, c.plan))
            if not (s > 0 and math.isfinite(s)):
                raise ValueError(f"trial of {c.label!r} returned {s!r}: expected a positive step time in seconds")
            r.append(s)
    runs = [runs[o] for o in owner]
    trials = tuple(GuardTrial(label=c.label, source=c.source, predicted_s=c.predicted_s, measured_s=min(r),
                              runs_s=tuple(r), same_as=None if o == i else candidates[o].label)
                   for i, (c, r, o) in enumerate(zip(candidates, runs, owner)))
    i = min(range(len(candidates)), key=lambda k: (trials[k].measured_s, k))
    return candidates[i], GuardResult(chosen=candidates[i].label, trials=trials, settings=dict(settings or {}))


#: Alternative restrictions SparseLift plans under to propose more candidates: name -> sharding
#: types removed (``None``: only table-wise allowed).
ALTERNATIVES: Tuple[Tuple[str, Optional[Tuple[str, ...]]], ...] = (
    ("no_data_parallel", (DATA_PARALLEL,)),
    ("table_wise_only", None),
    ("no_row_wise", (ROW_WISE,)),
)
#: What a table without a user restriction may use in an alternative: every sharding type the
#: planner offers by default (semantics.tables leaves grid_shard out unless a constraint names it).
_ALL_TYPES = tuple(t for t in SHARDING_TYPES if t not in OPT_IN_SHARDING_TYPES)


def _restricted(constraints: Optional[Dict[str, Any]], table_names: Sequence[str],
                removed: Optional[Tuple[str, ...]]) -> Dict[str, Any]:
    """The user's constraints with sharding types restricted (per table; a table whose user
    constraint would become empty keeps it)."""
    from torchrec.distributed.planner.types import ParameterConstraints

    out: Dict[str, Any] = {}
    for name in table_names:
        base = (constraints or {}).get(name)
        c = copy.deepcopy(base) if base is not None else ParameterConstraints()
        allowed = list(c.sharding_types) if c.sharding_types else list(_ALL_TYPES)
        keep = [TABLE_WISE] if removed is None else [t for t in allowed if t not in removed]
        keep = [t for t in keep if t in allowed] or allowed
        c.sharding_types = keep
        if c.compute_kernels and DATA_PARALLEL not in keep:
            c.compute_kernels = [k for k in c.compute_kernels if k != "dense"] or c.compute_kernels
        out[name] = c
    return out


def guard_fingerprint(planner: Any, model: Any, sharders: Sequence[Any], guard: MeasuredGuard,
                      cores: Optional[int] = None) -> Any:
    """The fingerprint of the planner's ``PlanRequest`` with its ``measured_guard`` field set to
    the guard's settings (guarded and unguarded plans, or two guard settings, never share a key)
    and its hardware replaced by this machine's fingerprint (``cores``: see
    :func:`~torchrec_sparselift.calibration.store.current_fingerprint`)."""
    req = planner.request(model, list(sharders))
    # A guarded plan is a measured decision on this machine: key it by the machine's fingerprint,
    # not by the profile's rates (the guard's own feedback refits those, which must not turn the
    # next run into a cache miss).
    topo = req.topology
    machine = current_fingerprint(topo.compute_device, ranks_per_host(topo), cores=cores)
    hw = HardwareProfile(name=f"machine:{machine.digest()}", compute_device=req.hardware.compute_device,
                         local_world_size=req.hardware.local_world_size,
                         hbm_cap_bytes=req.hardware.hbm_cap_bytes, ddr_cap_bytes=req.hardware.ddr_cap_bytes)
    return attrs.evolve(req, hardware=hw, measured_guard=guard.to_dict()).fingerprint()


def guard_cache_path(cache_dir: str, fingerprint: Any, guard: MeasuredGuard) -> str:
    """``cache_dir/guarded-<digest>.json``; ``fingerprint`` is :func:`guard_fingerprint`'s."""
    key = canonical_digest({"plan": fingerprint.digest(), "guard": guard.to_dict()}, chars=20, spaced=True)
    return os.path.join(cache_dir, f"guarded-{key}.json")


def _table_names(model: Any) -> List[str]:
    return [s[1] for s in table_specs(model)]  # (module_path, table_name, ...)


def _prediction(model: Any, plan: Any, opt: Any, topology: Any, batch_size: int,
                constraints: Optional[Dict[str, Any]], profile: HardwareProfile, sharders: Sequence[Any],
                workload: Any = None) -> Any:
    """The prediction of ``plan`` run as an execution plan with optimizations ``opt`` does: under
    ``profile``, with the run's ``sharders`` (the tables they shard), ``opt``'s pipeline and comm
    precisions, and the run's ``workload`` statistics (the planners' ``workload=``: the distinct ids
    price the fused backward; without them a cached plan's step printed 14 ms above the planner's
    price of the same plan). One pricing for a cached guarded plan and for TorchRec's plan when it
    is kept (it runs with the SparseLift plan's optimizations, so its comm precisions and rewrites
    too: :func:`~torchrec_sparselift.plan.rewrites.with_rewrites_of`, priced as the planner prices them)."""
    evaluated = evaluate_sharding_plan(model, plan, topology, batch_size, constraints, hardware=profile,
                                       workload=workload, sharders=list(sharders), pipeline=opt.pipeline,
                                       fwd_precision=opt.fwd_comm_precision, bwd_precision=opt.bwd_comm_precision)
    if not opt.is_2d:
        planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=constraints,
                                    hardware=profile, workload=workload, debug=False)
        request = attrs.evolve(planner.request(model, list(sharders)), hardware=evaluated.profile)
        evaluated = with_rewrites_of(opt, request, evaluated)
    return evaluated.prediction()


def guarded_execution_plan(
    model_factory: Callable[[], Any],
    pg: Any,
    device: Any,
    batches: Sequence[Any],
    *,
    topology: Any,
    batch_size: int,
    constraints: Optional[Dict[str, Any]] = None,
    hardware: Any = None,
    guard: MeasuredGuard = MeasuredGuard(),
    cache_dir: Optional[str] = None,
    allow_lossy_comm: bool = False,
    sharders: Optional[Sequence[Any]] = None,
    log: Callable[[str], None] = lambda m: None,
    workload: Any = None,
    cores: Optional[int] = None,
) -> Tuple[Any, GuardResult, bool]:
    """``(execution plan, guard result, reused)``; see the module docstring. Every rank of ``pg``
    must call it with the same arguments (plans are made collectively, trials run on all ranks).
    ``workload``: the planners' ``workload=`` (:class:`~torchrec_sparselift.semantics.workload.WorkloadStats`
    of the run's ids, e.g. ``observe(batches)``); it also prices every trial. ``cores``: the cores
    this process could use before it pinned itself (the machine's fingerprint, for the cache key
    and the feedback; see :func:`~torchrec_sparselift.calibration.store.current_fingerprint`)."""
    import torch.distributed as dist
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.sharding_plan import get_default_sharders

    sharders = list(sharders) if sharders is not None else get_default_sharders()
    rank = dist.get_rank(pg)

    def planner_for(cons: Optional[Dict[str, Any]]) -> SparseLiftPlanner:
        # the search's plans: the guard measures TorchRec's plan itself (the never-slower rule's measured form)
        return SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=cons, hardware=hardware,
                                 allow_lossy_comm=allow_lossy_comm, workload=workload, never_slower=False)

    main = planner_for(constraints)
    profile = profile_for_topology(topology, main.profile())
    model = model_factory()
    path = guard_cache_path(cache_dir, guard_fingerprint(main, model, sharders, guard, cores), guard) if cache_dir else None
    # rank 0 decides whether the cache holds the guarded plan; everyone follows
    box: List[Any] = [None]
    if rank == 0 and path and os.path.isfile(path):
        try:
            box[0] = ExecutionPlan.load(path).to_json()
        except FileFormatError as e:  # names the file and the field
            logger.warning("measured guard: ignoring an unusable cached guarded plan (it is planned again): %s", e)
            box[0] = None
    dist.broadcast_object_list(box, src=0, group=pg)
    if box[0] is not None:
        ep = ExecutionPlan.from_json(box[0])
        opt = ep.optimizations
        if opt.sharding_group_size is None:
            # the trials are this machine's measurements and stay; the prediction is the current
            # profile's (a recalibrated profile must not print the old profile's step time)
            ep = attrs.evolve(ep, prediction=_prediction(model, ep.sharding_plan, opt, topology, batch_size,
                                                         constraints, profile, sharders, workload))
        return ep, GuardResult.from_dict(ep.planner_info["measured_guard"]), True

    ep = main.collective_plan_execution(model, sharders, pg)
    cands: List[Tuple[Candidate, Any]] = [(Candidate("sparselift", "sparselift", ep.sharding_plan,
                                                     ep.prediction.step_time_s), ep)]
    seen = {sharding_plan_digest(ep.sharding_plan)}
    names = _table_names(model)
    alts: List[Tuple[Candidate, Any]] = []
    for alt, removed in (ALTERNATIVES if guard.candidates > 1 else ()):
        try:
            aep = planner_for(_restricted(constraints, names, removed)).collective_plan_execution(
                model_factory(), sharders, pg)
        except Exception as e:  # noqa: BLE001 - an alternative that cannot be planned is skipped
            log(f"[guard] alternative {alt} not planned: {str(e).splitlines()[0]}")
            continue
        key = sharding_plan_digest(aep.sharding_plan)
        if key in seen:
            continue
        seen.add(key)
        alts.append((Candidate(f"sparselift:{alt}", "sparselift", aep.sharding_plan, aep.prediction.step_time_s), aep))
    alts.sort(key=lambda c: c[0].predicted_s)
    cands += alts[: max(0, guard.candidates - 1)]
    if guard.torchrec:
        tplan = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size,
                                         constraints=constraints).collective_plan(model_factory(), sharders, pg)
        pred = PlanPricer(model, tplan, topology, batch_size, constraints, sharders, stats=workload)(profile)
        cands.append((Candidate("torchrec", "torchrec", tplan, pred), None))

    # each trial runs the train pipeline its plan will run (the SparseLift plan's; TorchRec's plan
    # would be lifted with the SparseLift plan's pipeline)
    kinds = {c.label: (e.optimizations.pipeline if e is not None else ep.optimizations.pipeline) for c, e in cands}

    def trial(label: str, plan: Any) -> float:
        kind = kinds[label]
        m = measure_plan(label, model_factory, plan, batches, guard.steps, guard.warmup, pg=pg, device=device,
                         pipeline_factory=lambda d, o, dev: make_train_pipeline(kind, d, o, dev))
        log(f"[guard] {label}: {m.median_s * 1e3:.2f} ms/step ({m.wall_s:.1f} s, pipeline {kind})")
        return m.median_s

    chosen, result = choose_measured([c for c, _ in cands], trial, settings=guard.to_dict(), rounds=guard.rounds,
                                     key=sharding_plan_digest)
    for t in result.trials:
        if t.same_as:
            log(f"[guard] {t.label}: the same plan as {t.same_as} (not measured again)")
    # one feedback record per plan measured (a plan shared by two candidates counts once)
    pricers = [(t.label, t.measured_s, PlanPricer(model, c.plan, topology, batch_size, constraints, sharders,
                                                  stats=workload))
               for t, (c, _e) in zip(result.trials, cands) if not t.same_as]
    chosen_ep = dict((c.label, e) for c, e in cands)[chosen.label]
    info = dict(ep.planner_info)
    info["measured_guard"] = result.to_dict()
    if chosen_ep is ep:
        final = attrs.evolve(ep, planner_info=info)
    elif chosen_ep is not None:
        final = attrs.evolve(ep, sharding_plan=chosen_ep.sharding_plan, prediction=chosen_ep.prediction,
                             optimizations=chosen_ep.optimizations, planner_info=info)
    else:
        # TorchRec's plan, run with the SparseLift plan's optimizations (comm precisions included)
        final = attrs.evolve(ep, sharding_plan=chosen.plan, planner_info=info,
                             prediction=_prediction(model, chosen.plan, ep.optimizations, topology, batch_size,
                                                    constraints, profile, sharders, workload))
    if rank == 0:
        if path:
            write_text(path, final.to_json(indent=1), prefix=".guarded-")
        if guard.feedback:
            try:
                where = add_feedback(feedback_records(pricers, profile), profile, topology, cores=cores)
                if where:
                    log(f"[guard] trials added to the step-fit records of {where}")
            except Exception as e:  # noqa: BLE001 - feedback must never fail the run
                logger.warning("measured guard: feedback to calibration failed: %s", e)
    return final, result, False
