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
from torchrec_sparselift.cost.model import DEV_MEM, HOST_MEM, step_total_batch
from torchrec_sparselift.search.problem import PlanningProblem

__all__ = ["best_placement", "greedy_place", "local_search", "rank_time"]

_REL_TIE = 1e-9


def rank_time(ev: PlanEvaluator, rows: np.ndarray) -> np.ndarray:
    """A per-rank scalar load (seconds) used to break ties between equally good ranks."""
    p = ev.ctx.profile
    return (
        rows[:, 0] + rows[:, 1] + rows[:, 2]
        + (rows[:, 3] + rows[:, 5]) / p.intra_host_bw
        + (rows[:, 4] + rows[:, 6]) / p.inter_host_bw
    )


def _objectives(ev: PlanEvaluator, colmax_rows: np.ndarray, cand: int, n: int) -> np.ndarray:
    uniform = ev.uniform + ev.peers[cand] * n
    allreduce = ev.allreduce_bytes + ev.allreduce[cand] * n / ev.W
    groups = set(ev.groups)
    if ev.types[cand] != "data_parallel":
        groups.add(ev.types[cand])
    return step_total_batch(
        colmax_rows + uniform[None, :], allreduce, len(groups), ev.ctx, ev.pipeline,
        ev.fwd_precision, ev.bwd_precision,
    )


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
    vec = ev.owner[cand]
    W = ev.W
    loads = ev.loads
    if c.placement == "all":
        ranks = tuple(range(c.num_shards))
        new = loads[: c.num_shards] + vec
        if np.any(new[:, DEV_MEM] > ev.device_cap[: c.num_shards] + 1e-6) or np.any(
            new[:, HOST_MEM] > ev.host_cap[: c.num_shards] + 1e-6
        ):
            return None
        cm = np.maximum(ev._colmax, new.max(axis=0))
        return ranks, float(_objectives(ev, cm[None, :], cand, c.num_shards)[0])
    if c.placement == "host":
        L = c.num_shards
        H = W // L
        rows = (loads + vec).reshape(H, L, -1)
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
        tmp[r] += vec
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


def _try_table(ev: PlanEvaluator, prob: PlanningProblem, t: int, current: float,
               switch_options: bool) -> Optional[Tuple[int, Tuple[int, ...], float]]:
    """Best improving re-placement (same or other candidate) of table ``t``."""
    cand, ranks = ev.assignment[t]
    ev.unassign(t)
    best = None
    options = prob.candidates[t] if switch_options else (cand,)
    for alt in options:
        g = best_placement(ev, prob, t, alt)
        if g is None:
            continue
        if g[1] < current * (1 - 1e-9) and (best is None or g[1] < best[2]):
            best = (alt, g[0], g[1])
    ev.assign(t, cand, ranks)
    return best


def local_search(
    ev: PlanEvaluator, prob: PlanningProblem, deadline: float, max_rounds: int = 10_000,
    tables_per_rank: int = 24,
) -> int:
    """Improve the plan move by move until no move helps or ``deadline`` (time.monotonic()).

    Each round looks at the most loaded ranks and tries to re-place (or re-shard) their largest
    tables, applying the best improving move. Returns the number of moves applied.
    """
    moves = 0
    current = ev.objective()
    for _ in range(max_rounds):
        if time.monotonic() > deadline:
            break
        loads = ev.rank_loads()
        hot = np.argsort(-rank_time(ev, loads), kind="stable")[:3]
        improved = False
        for r in hot:
            tabs = ev.tables_on(int(r))
            tabs.sort(key=lambda t: -prob.shard_time(ev.assignment[t][0]))
            best = None
            for t in tabs[:tables_per_rank]:
                if time.monotonic() > deadline:
                    break
                got = _try_table(ev, prob, t, current, switch_options=True)
                if got is not None and (best is None or got[2] < best[3]):
                    best = (t, got[0], got[1], got[2])
            if best is not None:
                ev.assign(best[0], best[1], best[2])
                new = ev.objective()
                if new < current * (1 - 1e-9):
                    current = new
                    moves += 1
                    improved = True
                    break
        if not improved:
            break
    return moves
