"""Shard placement: greedy seeding and local search, both driven by the incremental evaluator.

Placement rules follow the sharding type (see :mod:`torchrec_sparselift.semantics.graph`):
``free`` shards go one by one to the rank that keeps the step time lowest (ties: the least
loaded rank), ``host`` candidates take the best host, ``all`` candidates put shard ``i`` on
rank ``i``. Every placement respects per-rank device and host memory.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from torchrec_sparselift.cost.evaluator import PlanEvaluator
from torchrec_sparselift.cost.model import DEV_MEM, HOST_MEM
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.search.split_pricing import move_pricing
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["best_placement", "greedy_place", "local_search", "rank_time", "WorkBudget"]

_REL_TIE = 1e-9


def rank_time(ev: PlanEvaluator, rows: np.ndarray) -> np.ndarray:
    """A per-rank scalar load (seconds) used to break ties between equally good ranks: the
    compute columns plus each link column over its bandwidth (cost.terms.LoadLayout.rank_seconds)."""
    return layout().rank_seconds(rows, ev.ctx.profile)


def _objectives(ev: PlanEvaluator, colmax_rows: np.ndarray, cand: int, n: int) -> np.ndarray:
    uniform = ev.uniform + ev.peers[cand] * n
    allreduce = ev.allreduce_bytes + ev.allreduce[cand] * n / ev.W
    groups = set(ev.groups)
    if ev.types[cand] != DATA_PARALLEL:
        groups.add(ev.types[cand])
    # the pipeline's step, or what the local search prices its moves on (ev.row_price)
    return ev.objective_rows(colmax_rows + uniform[None, :], allreduce, len(groups))


def _pick(obj: np.ndarray, tie: np.ndarray) -> int:
    best = np.min(obj)
    if not np.isfinite(best):
        return -1
    ok = np.nonzero(obj <= best * (1 + _REL_TIE) + 1e-15)[0]
    return int(ok[np.argmin(tie[ok])])


def best_placement(
    ev: PlanEvaluator, prob: PlanningProblem, table: int, cand: int
) -> Optional[Tuple[Tuple[int, ...], float]]:
    """Best ranks for ``table`` as candidate ``cand`` given the rest of the plan, and the
    resulting objective; None if it cannot fit. The table must not be assigned."""
    c = prob.cands[cand]
    # one shard's load on its own rank's row (with a shared host link, its host mates' rows gain
    # ev.owner_host[cand]: the evaluator's rows hold the host's mean in the shared columns)
    vec = ev.owner_eff[cand]
    W = ev.W
    # a rank without this TBE group yet also pays the group's fixed cost
    loads = ev.loads + (ev.gcount[:, ev.group_of[cand]] == 0)[:, None] * ev.overhead[None, :]
    if c.placement == "all":
        ranks = tuple(range(c.num_shards))
        touched = ev.host_ranks(ranks)
        new = loads[touched].copy()
        ev.add_shards(new, touched, cand, ranks)
        mine = np.searchsorted(touched, np.asarray(ranks, dtype=np.int64))
        if np.any(new[mine, DEV_MEM] > ev.device_cap[: c.num_shards] + 1e-6) or np.any(
            new[mine, HOST_MEM] > ev.host_cap[: c.num_shards] + 1e-6
        ):
            return None
        cm = np.maximum(ev._colmax, new.max(axis=0))
        return ranks, float(_objectives(ev, cm[None, :], cand, c.num_shards)[0])
    if c.placement == "host":
        L = c.num_shards
        H = W // L
        rows = (loads + ev.block_vec(cand, L)).reshape(H, L, -1)
        fits = np.all(rows[:, :, DEV_MEM] <= ev.device_cap.reshape(H, L) + 1e-6, axis=1) & np.all(
            rows[:, :, HOST_MEM] <= ev.host_cap.reshape(H, L) + 1e-6, axis=1
        )
        cm = np.maximum(ev._colmax[None, :], rows.max(axis=1))
        obj = _objectives(ev, cm, cand, L)
        obj[~fits] = np.inf
        tie = rank_time(ev, loads).reshape(H, L).sum(axis=1)
        h = _pick(obj, tie)
        if h < 0:
            return None
        return tuple(range(h * L, (h + 1) * L)), float(obj[h])
    # free shards, one at a time on distinct ranks
    tmp = loads.copy()
    colmax = ev._colmax.copy()
    chosen: List[int] = []
    obj_last = float("inf")
    for _ in range(c.num_shards):
        rows = tmp + vec
        cm = np.maximum(colmax[None, :], rows)
        obj = _objectives(ev, cm, cand, c.num_shards)
        bad = (rows[:, DEV_MEM] > ev.device_cap + 1e-6) | (rows[:, HOST_MEM] > ev.host_cap + 1e-6)
        if chosen:
            bad[chosen] = True
        obj[bad] = np.inf
        r = _pick(obj, rank_time(ev, tmp))
        if r < 0:
            return None
        chosen.append(r)
        # its host mates' rows gain only the shared columns, equal to tmp[r]'s there (their rows in
        # tmp may carry a TBE group's overhead they would not pay: not in the maximum)
        ev.add_shards(tmp, ev._all_ranks, cand, (r,))
        colmax = np.maximum(colmax, tmp[r])
        obj_last = float(obj[r])
    return tuple(chosen), obj_last


def greedy_place(
    ev: PlanEvaluator, prob: PlanningProblem, choice: Sequence[int], order_key=None
) -> List[int]:
    """Place every table with its chosen candidate, biggest shards first (LPT). A table whose
    choice does not fit falls back to its other candidates, smallest memory first. Returns the
    tables that could not be placed at all (empty when the plan is complete)."""
    order = sorted(
        range(prob.num_tables),
        key=lambda t: (-prob.shard_time(choice[t]) * (1 if prob.cands[choice[t]].placement != "all" else 0.0),
                       -ev.owner[choice[t]][DEV_MEM], t),
    )
    unplaced = []
    for t in order:
        got = best_placement(ev, prob, t, choice[t])
        if got is not None:
            ev.assign(t, choice[t], got[0])
            continue
        alts = sorted(prob.candidates[t], key=lambda i: (ev.owner[i][DEV_MEM] * prob.cands[i].num_shards, i))
        best = None
        for alt in alts:
            if alt == choice[t]:
                continue
            g = best_placement(ev, prob, t, alt)
            if g is not None and (best is None or g[1] < best[2]):
                best = (alt, g[0], g[1])
        if best is None:
            unplaced.append(t)
        else:
            ev.assign(t, best[0], best[1])
    return unplaced


def _time_weights(ev: PlanEvaluator) -> np.ndarray:
    """Seconds per unit of each load column, once per phase it feeds (output bytes count for the
    output and the gradient); 0 for memory columns."""
    return layout().balance_weights(ev.ctx.profile)


def _spread(ev: PlanEvaluator, rows: np.ndarray, w: np.ndarray) -> float:
    """Sum of squared per-rank loads (seconds): lower means better balanced. Breaks ties when
    several ranks share the maximum and no single move lowers the step time."""
    x = rows * w[None, :]
    return float(np.sum(x * x))


def _spread_delta(ev: PlanEvaluator, t: int, cand: int, ranks: Sequence[int], w: np.ndarray) -> float:
    old_c, old_r = ev.assignment[t]
    touched = ev.host_ranks(tuple(old_r) + tuple(int(r) for r in ranks))
    before = ev.loads[touched]
    after = before.copy()
    ev.add_shards(after, touched, old_c, old_r, -1.0)
    ev.add_shards(after, touched, cand, ranks, 1.0)
    return _spread(ev, after, w) - _spread(ev, before, w)


def _try_table(ev: PlanEvaluator, prob: PlanningProblem, t: int, current: float,
               switch_options: bool, w: np.ndarray, placer=None):
    """Best improving re-placement (same or other candidate) of table ``t``: lower step time,
    or equal step time and better balance. Returns (cand, ranks, objective, spread delta)."""
    cand, ranks = ev.assignment[t]
    ev.unassign(t)
    found = []
    options = prob.candidates[t] if switch_options else (cand,)
    # a placer with ``for_table`` prices the table's options against the plan without it in one
    # setting (search/scale.py's shares the per-rank rows over the options)
    place = (placer.for_table(ev, prob, t) if hasattr(placer, "for_table") else placer) or best_placement
    for alt in options:
        g = place(ev, prob, t, alt)
        if g is not None and g[1] <= current * (1 + 1e-12):
            found.append((alt, g[0], g[1]))
    ev.assign(t, cand, ranks)
    best = None
    for alt, rk, obj in found:
        if alt == cand and tuple(rk) == tuple(ranks):
            continue
        d = _spread_delta(ev, t, alt, rk, w)
        better_time = obj < current * (1 - 1e-9)
        if not better_time and d >= -1e-9 * max(1e-30, abs(_spread(ev, ev.loads[list(ranks)], w))):
            continue
        key = (round(obj / max(current, 1e-30), 9), d)
        if best is None or key < best[4]:
            best = (alt, tuple(rk), obj, d, key)
    return best


def _hot_ranks(ev: PlanEvaluator, w: np.ndarray, extra: int = 2) -> List[int]:
    """Ranks worth unloading: the argmax rank of each time column (most critical column first)
    and the ranks with the largest total load."""
    loads = ev.loads
    colmax_s = (ev._colmax + ev.uniform) * w
    order = [c for c in np.argsort(-colmax_s, kind="stable") if w[c] > 0]
    hot: List[int] = []
    shared = set(int(j) for j in ev.shared)
    for c in order:
        r = int(np.argmax(loads[:, c]))
        # a shared host link's column ties across the host: every rank of it may load the link
        for h in (ev.host_ranks((r,)) if c in shared else (r,)):
            if int(h) not in hot:
                hot.append(int(h))
    for r in np.argsort(-rank_time(ev, loads), kind="stable")[:extra]:
        if int(r) not in hot:
            hot.append(int(r))
    return hot


class WorkBudget:
    """A deterministic budget of search work (priced placements), with the wall clock only as a
    safety net: the same problem and budget give the same plan on a fast or a loaded machine."""

    def __init__(self, units: int, deadline: float) -> None:
        self.units = units
        self.deadline = deadline
        self.used = 0
        self.cut = False

    def spend(self, n: int = 1) -> bool:
        """Spend ``n`` units; False once the budget (or the safety deadline) is exhausted."""
        self.used += n
        if self.used > self.units or time.monotonic() > self.deadline:
            self.cut = True
            return False
        return True


def local_search(
    ev: PlanEvaluator, prob: PlanningProblem, deadline: float, max_rounds: Optional[int] = None,
    tables_per_rank: int = 12, budget: Optional[WorkBudget] = None, placer=None,
) -> Tuple[int, bool]:
    """Improve the plan move by move until no move helps (or ``deadline``, time.monotonic()).

    Each round looks at the most loaded ranks (the argmax rank of every time column, then the
    busiest ranks) and, for each, applies the best re-placement or re-sharding of one of its
    largest tables that lowers the step time, or keeps it and balances the ranks better (so
    plateaus where many ranks share the maximum can be left). Deterministic: the result depends
    only on the problem, unless the deadline cuts the search short.

    ``budget`` bounds the work deterministically (priced candidate placements); ``deadline``
    is a wall-clock safety net. ``placer`` replaces :func:`best_placement` (same signature;
    the search at scale prices a shortlist of ranks; a placer with a ``for_table(ev, prob,
    table)`` method gives the placer of each table tried). Returns (moves applied, whether a budget
    stopped it).

    The moves are priced at the pipeline's step. Under the ``overlap`` pipeline with the batch
    split allowed (``prob.split_overhead_s``), once no such move helps, a second pass prices every
    move, and the plan it is compared against, at the split at the incumbent's best k
    (``search.split_pricing.move_pricing``: chosen when that pass starts and again after every
    round that applies a move), each pass with up to ``max_rounds`` rounds: the plan ends at or
    below the split price of the first pass's plan, and takes the moves only the split step
    rewards (more output traffic the chunks hide, less exposed all-reduce).
    """
    saved = ev.row_price
    try:
        ev.row_price = None
        moves, cut = _local_search(ev, prob, deadline, max_rounds, tables_per_rank, budget, placer)
        split = None if cut else move_pricing(ev, prob)
        if split is not None and split.k > 1:  # (at k = 1 the split prices as the first pass did)
            ev.row_price = split
            more, cut = _local_search(ev, prob, deadline, max_rounds, tables_per_rank, budget, placer)
            moves += more
        return moves, cut
    finally:
        ev.row_price = saved


def _local_search(ev: PlanEvaluator, prob: PlanningProblem, deadline: float, max_rounds: Optional[int],
                  tables_per_rank: int, budget: Optional[WorkBudget], placer) -> Tuple[int, bool]:
    w = _time_weights(ev)
    moves = 0
    current = ev.objective()
    rounds = max_rounds if max_rounds is not None else 4 * prob.num_tables + 50
    budget = budget or WorkBudget(10**12, deadline)
    for _ in range(rounds):
        applied = False
        for r in _hot_ranks(ev, w):
            if not budget.spend(0):
                return moves, True
            tabs = ev.tables_on(int(r))
            tabs.sort(key=lambda t: (-prob.shard_time(ev.assignment[t][0]), t))
            best = None
            for t in tabs[:tables_per_rank]:
                if not budget.spend(len(prob.candidates[t])):
                    return moves, True
                got = _try_table(ev, prob, t, current, switch_options=True, w=w, placer=placer)
                if got is not None and (best is None or got[4] < best[1][4]):
                    best = (t, got)
            if best is None:
                continue
            t, (alt, rk, _, _, _) = best
            old = ev.assignment[t]
            ev.assign(t, alt, rk)
            new = ev.objective()
            if new <= current * (1 + 1e-12):
                current = min(current, new)
                moves += 1
                applied = True
            else:  # priced against a stale maximum: undo
                ev.assign(t, old[0], old[1])
        if not applied:
            if not budget.spend(0) or not _try_swaps(ev, prob, w, current, budget):
                break
            current = ev.objective()
            moves += 1
        if ev.row_price is not None:  # the split's k of the plan the round's moves left
            ev.row_price = move_pricing(ev, prob)
            current = ev.objective()
    return moves, False


def _try_swaps(ev: PlanEvaluator, prob: PlanningProblem, w: np.ndarray, current: float,
               budget: "WorkBudget", partners: int = 8, per_rank: int = 6) -> bool:
    """Exchange a single-shard table on a hot rank with a smaller one on a cool rank, when no
    single move helps (typically when memory is tight). Applies the first improving swap."""
    loads = ev.rank_loads()
    busy = rank_time(ev, loads)
    cool = [int(r) for r in np.argsort(busy, kind="stable")[:partners]]
    spread0 = _spread(ev, ev.loads, w)
    for r in _hot_ranks(ev, w):
        mine = [t for t in ev.tables_on(r) if len(ev.assignment[t][1]) == 1]
        mine.sort(key=lambda t: (-prob.shard_time(ev.assignment[t][0]), t))
        for t1 in mine[:per_rank]:
            c1, _ = ev.assignment[t1]
            for r2 in cool:
                if r2 == r:
                    continue
                theirs = [t for t in ev.tables_on(r2) if len(ev.assignment[t][1]) == 1
                          and prob.shard_time(ev.assignment[t][0]) < prob.shard_time(c1)]
                theirs.sort(key=lambda t: (-prob.shard_time(ev.assignment[t][0]), t))
                for t2 in theirs[:per_rank]:
                    if not budget.spend(2):
                        return False
                    c2, _ = ev.assignment[t2]
                    ev.assign(t1, c1, (r2,))
                    ev.assign(t2, c2, (r,))
                    new = ev.objective()
                    ok = ev.memory_ok() and (
                        new < current * (1 - 1e-9)
                        or (new <= current * (1 + 1e-12) and _spread(ev, ev.loads, w) < spread0 * (1 - 1e-6))
                    )
                    if ok:
                        return True
                    ev.assign(t1, c1, (r,))
                    ev.assign(t2, c2, (r2,))
    return False
