"""Solve a :class:`PlanningProblem`: choose options, place shards, pick optimizations, bound.

``solve(problem, time_budget_s)`` is the one call; it returns a :class:`SearchResult` with the
plan, its predicted step time, a lower bound under the same model, and the gap. Deterministic:
the same problem gives the same result (no randomness, ties broken by index).

Strategy (large-scale path, any size):
1. LP relaxation on aggregated loads (:mod:`.lp`) -> option per table + lower bound.
2. Greedy LPT placement of the LP's choice and of a "least work" choice; keep the better.
3. Local search on the hottest ranks (re-place or re-shard their biggest tables).
4. Price every allowed pipeline kind and comm precision on the final loads; keep the best,
   and polish with local search under it.

The rewrites the problem allows are in every price: the ids on the wire in the options' input-dist
columns (``PlanningProblem.wire``), which every move's price reads; the batch split
(``PlanningProblem.split_overhead_s``) in the price of the ``overlap`` pipeline wherever the search
compares pipelines and final candidates (:func:`split_price` at the best k on the plan's phases,
:func:`priced_s`), and in the local search under ``overlap``: once the moves priced at the
pipeline's step converge, a second pass prices each move, and the plan it is compared against, at
the split at a fixed k, the incumbent's best k (chosen when that pass starts and again after every
round that applies a move), over every candidate rank at once (``search.split_pricing``:
``SplitMovePrice``, ``cost.batch_split.split_step_batch``; ``.place.local_search``). The final
price is the best k again (:func:`priced_split`). The bound's rows for a split ``overlap`` hold at
every k (``search.equation.split_floor_rows``).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.batch_split import BATCH_SPLIT_PIPELINE
from torchrec_sparselift.cost.evaluator import PlanEvaluator
from torchrec_sparselift.cost.model import DEV_MEM, HOST_MEM, StepTime
from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.cost.pipelines import trainable_pipelines
from torchrec_sparselift.vocabulary import PREFETCH, SPARSE_DIST, has_side_streams
from torchrec_sparselift.search.choice_bound import choice_bound_solution
from torchrec_sparselift.search.lp import analytic_bound, solve_lp
from torchrec_sparselift.search.milp import milp_size, solve_milp
from torchrec_sparselift.search.place import WorkBudget, greedy_place, local_search
from torchrec_sparselift.search.problem import PlanningProblem, no_plan_kind, storage_summary
from torchrec_sparselift.search.split_pricing import split_floor_terms, split_price, split_terms
from torchrec_sparselift.search.scale import (
    SCALE_LP_LIMIT_S, SCALE_SEARCH_S, ShortlistPlacer, fast_place, scale_local_search, use_scale_path,
)

__all__ = ["SearchResult", "solve", "new_evaluator", "split_terms", "split_price", "split_floor_terms",
           "priced_s", "priced_split"]


@attrs.frozen
class SearchResult:
    """A solved plan under the cost model."""

    assignment: Tuple[Tuple[int, Tuple[int, ...]], ...]  # per table: (candidate id, ranks)
    step: StepTime
    lower_bound_s: float
    pipeline: str
    fwd_precision: str
    bwd_precision: str
    solver: str
    status: str
    planning_time_s: float
    moves: int
    rank_loads: np.ndarray = attrs.field(eq=False, repr=False)
    alternatives: Tuple[Tuple[str, float], ...] = ()
    #: the batch split the search priced for the plan (``PlanningProblem.split_overhead_s`` set
    #: and the pipeline ``overlap``): its chunk count and step (:func:`split_price`); 1 and None
    #: where it priced none (``step`` is the unsplit step either way)
    split_chunks: int = 1
    split_s: Optional[float] = None

    @property
    def priced_step_s(self) -> float:
        """The plan's step as the search priced it: with its batch split where it priced one."""
        return self.step.total_s if self.split_s is None else min(self.step.total_s, self.split_s)

    @property
    def gap(self) -> float:
        if not self.lower_bound_s or not np.isfinite(self.lower_bound_s):
            return float("nan")
        return self.priced_step_s / self.lower_bound_s - 1.0


def new_evaluator(prob: PlanningProblem, pipeline: str, fwd: str = defaults.COMM_PRECISION, bwd: str = defaults.COMM_PRECISION) -> PlanEvaluator:
    return PlanEvaluator(
        prob.ctx, prob.costs, [c.sharding_type for c in prob.cands], prob.device_cap,
        prob.host_cap, pipeline, fwd, bwd, kernels=[c.compute_kernel for c in prob.cands],
    )


def priced_split(ev: PlanEvaluator, prob: PlanningProblem, pipeline: Optional[str] = None,
                 fwd: Optional[str] = None, bwd: Optional[str] = None) -> Tuple[int, float]:
    """``(k, step)`` of ``ev``'s plan under ``pipeline`` (default: ``ev``'s) as the search prices
    it: :func:`split_price` where the problem allows the split and the pipeline is ``overlap``,
    else ``(1, its step)``."""
    pl = pipeline or ev.pipeline
    f, b = fwd or ev.fwd_precision, bwd or ev.bwd_precision
    step = ev.step_time(pl, f, b).total_s
    if prob.split_overhead_s is None or pl != BATCH_SPLIT_PIPELINE:
        return 1, step
    if (f, b) != (ev.fwd_precision, ev.bwd_precision):
        saved = ev.fwd_precision, ev.bwd_precision
        ev.fwd_precision, ev.bwd_precision = f, b
        try:
            terms = split_terms(ev, prob.split_overhead_s)
        finally:
            ev.fwd_precision, ev.bwd_precision = saved
    else:
        terms = split_terms(ev, prob.split_overhead_s)
    return split_price(step, terms, prob.ctx.batch_size)


def priced_s(ev: PlanEvaluator, prob: PlanningProblem) -> float:
    """``ev``'s plan's step under its own pipeline and precisions as the search prices final
    candidates (:func:`priced_split`)."""
    return priced_split(ev, prob)[1]


def _least_work_choice(prob: PlanningProblem) -> List[int]:
    out = []
    for ids in prob.candidates:
        out.append(min(ids, key=lambda i: (prob.shard_time(i) * prob.cands[i].num_shards, i)))
    return out


def _optimizations(ev: PlanEvaluator, prob: PlanningProblem, pipelines: Sequence[str],
                   precisions: Sequence[Tuple[str, str]]):
    """Every (pipeline, precision) that can train the plan priced on its loads, and the best:
    (alternatives, (pipeline, fwd, bwd, seconds)).

    Ties go to ``defaults.PIPELINE`` (``sparse_dist``: TorchRec's usual pipeline, and the one the
    step calibration measures its probe plans under, so its predictions are the measured ones),
    then to the earlier pipeline. On hardware without overlap (CPU gloo on one host) every kind
    prices as ``base`` and ties are the rule; a plan should then run the pipeline its
    prediction was calibrated under, not the first in the registry."""
    alts: List[Tuple[str, float]] = []
    best_combo = None
    has_dense_kernel = any(prob.cands[c].compute_kernel == "dense" for c, _ in ev.assignment.values())
    trainable = trainable_pipelines(tuple(pipelines), has_dense_kernel,
                                    streams=has_side_streams(prob.ctx.profile.compute_device))
    ordered = sorted(trainable, key=lambda p: p != defaults.PIPELINE)  # stable: the rest keep their order
    for pl in ordered:
        for f, b in precisions:
            _k, total = priced_split(ev, prob, pl, f, b)  # overlap at its best batch split, where allowed
            alts.append((f"{pl}/{f}/{b}", total))
            if best_combo is None or total < best_combo[3] * (1 - 1e-12):
                best_combo = (pl, f, b, total)
    return alts, best_combo


def _place(prob: PlanningProblem, choice: Sequence[int], pipeline: str, fwd: str, bwd: str):
    ev = new_evaluator(prob, pipeline, fwd, bwd)
    # at scale (thousands of tables x ranks) the shortlist placement of search/scale.py
    unplaced = (fast_place if use_scale_path(prob) else greedy_place)(ev, prob, choice)
    return ev, unplaced


AUTO_MILP_MAX_VARS = 400
# Search work per second of time budget: priced candidate placements. Measured on the 2-core
# development VM at about 2,000 per second for 1,000-rank problems, so the default budget
# finishes in roughly the budget there and faster on bigger machines.
WORK_UNITS_PER_SECOND = 1500
AUTO_MILP_NODES = 300
# the integral-choice bound (choice_bound) runs below this size; its choice is also placed as a
# seed (docs/cost_model.md, "How the integral-choice bound is built"). Up to ROOM tables HiGHS
# solves it at the root in 0.1-1.2 s CPU on the planner benchmark and its wall limit, max(2 s,
# half the budget), is a safety net; above, it gets min(1 s, 10% of the budget)
CHOICE_BOUND_MAX_TABLES = 1000
CHOICE_BOUND_ROOM_TABLES = 300


def solve(
    prob: PlanningProblem,
    time_budget_s: float = 30.0,
    pipeline: Optional[str] = None,
    precision: Optional[Tuple[str, str]] = None,
    solver: str = "auto",
) -> SearchResult:
    """Plan ``prob`` within about ``time_budget_s`` seconds (the LP and one greedy pass always
    run; local search stops at the budget).

    ``solver``: ``"heuristic"`` (LP + greedy + local search), ``"milp"`` (also run the exact MILP
    over choice and placement with half the budget, keep the better plan and the tighter bound),
    or ``"auto"`` (MILP only for tiny instances, <= 400 placement variables).
    """
    if solver not in ("auto", "heuristic", "milp"):
        raise ValueError(f"solver must be 'auto', 'heuristic' or 'milp', got {solver!r}")
    t0 = time.monotonic()
    pipelines = (pipeline,) if pipeline else prob.pipelines
    precisions = (precision,) if precision else prob.precisions
    search_pl = SPARSE_DIST if SPARSE_DIST in pipelines else pipelines[0]
    at_scale = use_scale_path(prob)  # thousands of tables x ranks: search/scale.py
    # the pipeline the placement and local search price under: at scale the one that hides the
    # most (prefetch), as there is no budget for a second full search under it (scale.py)
    place_pl = PREFETCH if at_scale and PREFETCH in pipelines else search_pl
    fwd, bwd = precisions[0]

    # the LP is deterministic when it finishes: give it room (its limit is a safety net; at
    # scale its choice is the seed and its bound the only one, so more room: scale.py)
    lp_limit = max(SCALE_LP_LIMIT_S if at_scale else 20.0, 2.0 * time_budget_s)
    # at scale the LP is solved under the placement's pipeline: its bound is then the plan's
    # when the search keeps that pipeline (the usual case), and the second LP below is not needed
    lp_pl = place_pl if at_scale else search_pl
    lp = solve_lp(prob, lp_pl, fwd, bwd, time_limit_s=lp_limit, fit=at_scale)
    seeds: List[Tuple[str, Sequence[int]]] = []
    if lp.choice:  # at scale rounded against the LP's column maxima (lp.round_choice)
        seeds.append(("lp", lp.fitted_choice if at_scale and lp.fitted_choice else lp.choice))
    if not (seeds and at_scale):  # at scale the LP's choice is far better (docs/concepts.md)
        seeds.append(("least_work", _least_work_choice(prob)))
    best_ev: Optional[PlanEvaluator] = None
    best_name = ""
    failures: Dict[str, List[int]] = {}
    for name, choice in seeds:
        ev, unplaced = _place(prob, choice, place_pl, fwd, bwd)
        if unplaced:
            failures[name] = unplaced
            continue
        if best_ev is None or ev.objective() < best_ev.objective():
            best_ev, best_name = ev, name
    if best_ev is None:
        bad = sorted({t for v in failures.values() for t in v})
        names = ", ".join(prob.specs[t].fqn for t in bad[:20])
        need_dev = sum(float(np.min([prob.costs[i].owner[DEV_MEM] * prob.cands[i].num_shards for i in prob.candidates[t]])) for t in bad)
        need_host = sum(float(np.min([prob.costs[i].owner[HOST_MEM] * prob.cands[i].num_shards for i in prob.candidates[t]])) for t in bad)
        dev_kind = prob.ctx.profile.compute_device
        kind = no_plan_kind(prob.lowest_storage, prob.device_cap, prob.host_cap, dev_kind)
        raise SparseLiftPlannerError(
            f"no plan because of {kind.replace('_', ' ')}: "
            f"{storage_summary(prob.lowest_storage, prob.device_cap, prob.host_cap, dev_kind)}.\n"
            f"Could not place {len(bad)} table(s) within per-rank memory: {names}"
            f"{' ...' if len(bad) > 20 else ''}. Their smallest options take {need_dev / 2**30:.2f} GiB "
            f"of device memory and {need_host / 2**30:.2f} GiB of host memory, more than is free "
            f"after the other tables (device {float(np.sum(prob.device_cap)) / 2**30:.2f} GiB, host "
            f"{float(np.sum(prob.host_cap)) / 2**30:.2f} GiB over {prob.ctx.world_size} ranks). "
            "To fix: add ranks or memory, allow row-wise/column-wise sharding or UVM caching for "
            "large tables, or reduce batch size (comm buffers scale with it).",
            kind=kind,
        )
    ev = best_ev
    # deterministic work budget (priced placements), proportional to the time budget; the wall
    # clock (3x the budget) is only a safety net on very slow or loaded machines
    search_s = max(time_budget_s, SCALE_SEARCH_S) if at_scale else time_budget_s
    # (at scale the safety net counts from here: the LP and the placement may have taken long)
    work = WorkBudget(int(WORK_UNITS_PER_SECOND * search_s),
                      (time.monotonic() if at_scale else t0) + 3.0 * search_s)
    # at scale: the hottest table of each hot rank, priced on a shortlist of ranks (scale.py)
    ls_kw = {"tables_per_rank": 1, "placer": ShortlistPlacer()} if at_scale else {}
    if at_scale:  # widening the tables tried per hot rank as it converges (scale.py)
        moves, cut = scale_local_search(ev, prob, work.deadline, work)
    else:
        moves, cut = local_search(ev, prob, deadline=work.deadline, budget=work)

    # choose the optimizations on the final loads
    alts, best_combo = _optimizations(ev, prob, pipelines, precisions)
    pl, f, b, _ = best_combo
    if (pl, f, b) != (place_pl, fwd, bwd):
        ev.pipeline, ev.fwd_precision, ev.bwd_precision = pl, f, b
        polish = WorkBudget(max(200, work.units // 4), max(t0 + 3.5 * search_s, work.deadline))
        more, cut2 = local_search(ev, prob, deadline=polish.deadline, budget=polish, **ls_kw)
        moves += more
        cut = cut or cut2
    bound = lp.lower_bound_s
    if (pl, f, b) != (lp_pl, fwd, bwd) or lp.status != "optimal":
        lp2 = solve_lp(prob, pl, f, b, time_limit_s=lp_limit)
        bound = lp2.lower_bound_s if lp2.status == "optimal" else float("nan")
    if not np.isfinite(bound):
        bound = analytic_bound(prob, pl, f, b)
    if prob.num_tables <= CHOICE_BOUND_MAX_TABLES and ev.objective() > bound * (1 + 1e-4):
        # integral choice + packing rows (search/choice_bound.py): never below the LP's bound
        room = prob.num_tables <= CHOICE_BOUND_ROOM_TABLES
        cb = choice_bound_solution(prob, pl, f, b, time_limit_s=(
            max(2.0, 0.5 * time_budget_s) if room else min(1.0, 0.1 * time_budget_s)))
        if np.isfinite(cb.bound_s) and (not np.isfinite(bound) or cb.bound_s > bound):
            bound = cb.bound_s
        if cb.choice and ev.objective() > bound * (1 + 1e-4):
            # its choice is often the optimum's (docs/cost_model.md): place it, polish, keep if better
            alt, unplaced = _place(prob, cb.choice, pl, f, b)
            if not unplaced:
                polish = WorkBudget(max(200, work.units // 4), t0 + 3.5 * time_budget_s)
                more, cut3 = local_search(alt, prob, deadline=polish.deadline, budget=polish, **ls_kw)
                if alt.memory_ok() and priced_s(alt, prob) < priced_s(ev, prob) * (1 - 1e-9):
                    ev, best_name, moves, cut = alt, "choice_bound", moves + more, cut or cut3
                    alts, _ = _optimizations(ev, prob, pipelines, precisions)
    solver_name = f"lp+greedy({best_name})+local_search"
    if solver == "milp" or (solver == "auto" and milp_size(prob) <= AUTO_MILP_MAX_VARS):
        if solver == "milp":
            m = solve_milp(prob, pl, f, b, time_limit_s=max(1.0, 0.5 * time_budget_s))
        else:  # tiny instance: a node-limited (deterministic) search, time only as a safety net
            m = solve_milp(prob, pl, f, b, time_limit_s=max(5.0, time_budget_s), node_limit=AUTO_MILP_NODES)
        if np.isfinite(m.bound_s):
            bound = max(bound, m.bound_s) if np.isfinite(bound) else m.bound_s
        if m.assignment:
            alt = new_evaluator(prob, pl, f, b)
            for t, (c, rk) in enumerate(m.assignment):
                alt.assign(t, c, rk)
            if alt.memory_ok() and priced_s(alt, prob) < priced_s(ev, prob) * (1 - 1e-9):
                ev = alt
                solver_name = f"milp({m.status})"
            else:
                solver_name += f"; milp({m.status}) not better"
    step = ev.step_time()
    chunks, priced = priced_split(ev, prob)
    assignment = tuple(ev.assignment[t] for t in range(prob.num_tables))
    return SearchResult(
        assignment=assignment,
        step=step,
        lower_bound_s=float(min(bound, priced)) if np.isfinite(bound) else float("nan"),
        pipeline=pl,
        fwd_precision=f,
        bwd_precision=b,
        solver=solver_name,
        status=("time_limit" if cut else "converged") if ev.memory_ok() else "memory_violation",
        planning_time_s=time.monotonic() - t0,
        moves=moves,
        rank_loads=ev.rank_loads(),
        alternatives=tuple(alts),
        split_chunks=chunks,
        split_s=priced if prob.split_overhead_s is not None and pl == BATCH_SPLIT_PIPELINE else None,
    )
