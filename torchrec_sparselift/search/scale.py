"""The search at scale (thousands of tables on thousands of ranks), under SparseLift's own model.

:func:`.solve.solve` takes this path when ``num_tables * world_size`` is at least
:data:`SCALE_MIN_WORK`, where pricing every shard on every rank (the greedy of
:mod:`.place`, about 1 ms a shard at 4,096 ranks, plus one refresh of the evaluator's column
maxima per table) no longer fits the budget. The stages and what changes at scale:

1. **Choice and bound**: the LP of :mod:`.lp`. It has no per-rank variables (every rank is
   alike: loads enter as their average over ranks and as the largest single piece), so its size
   grows with the candidates, not with the world size; its optimum is the bound. Its choice is
   the only seed, rounded by :func:`.lp.round_choice` (a table whose largest-``x`` option has a
   shard above the LP's column maxima takes the option that raises the LP's step the least:
   the plain argmax leaves UVM table-wise shards of tens of milliseconds there). Its wall-clock
   safety limit is :data:`SCALE_LP_LIMIT_S`.
2. **Placement** (:func:`fast_place`): LPT over the LP's rounded choice, biggest shards first,
   on numpy arrays of the per-rank loads the cost model composes (no evaluator refresh per
   shard). Each shard is priced with the model's own step-time composition
   (:func:`~torchrec_sparselift.cost.model.step_total_batch`) on a shortlist only: the
   :data:`PRICE_RANKS` ranks that can take it in memory with the most room in the columns it
   loads (the fullest of them, after the shard, as a fraction of the plan's maximum there; a
   host-wide sharding: the least-loaded hosts); ties (most shards raise no column maximum) go
   to the rank whose squared per-column loads grow the least (each column balanced on its own;
   a host-wide shard: the least-loaded host). Per-rank memory is a hard limit; a table whose
   choice fits nowhere falls back to the other option that fits with the lowest step time
   (ties: the smallest memory); no table is dropped. The plan enters a
   :class:`~torchrec_sparselift.cost.evaluator.PlanEvaluator` in one bulk assignment, so the step time reported is the evaluator's.
3. **Local search** (:func:`scale_local_search`: :func:`.place.local_search` through its
   ``placer`` hook) with :func:`shortlist_placement` as its placer, first with one table per hot
   rank (its hottest), then, each time no move helps, with the next width of
   :data:`TABLES_PER_RANK`: it re-places or re-shards the tables that set each column's maximum,
   each priced on the shortlist of the ranks with the most room for it. At 10,000 tables this
   is what turns the LP's rounded choice (whose hottest tables keep big pieces) into a plan
   near the bound. It prices under ``prefetch`` when allowed (the pipeline that hides the
   most; the plan is then priced under every allowed pipeline as on the small path), and
   gets at least :data:`SCALE_SEARCH_S` seconds' worth of work units.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from torchrec_sparselift.cost.model import DEV_MEM, HOST_MEM, step_total_batch
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.search.place import _objectives, best_placement, local_search, rank_time
from torchrec_sparselift.search.place import _pick as _place_pick
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["fast_place", "shortlist_placement", "ShortlistPlacer", "use_scale_path", "scale_local_search",
           "SCALE_MIN_WORK", "SCALE_SEARCH_S", "SCALE_LP_LIMIT_S", "PRICE_RANKS", "TABLES_PER_RANK"]

#: ``num_tables * world_size`` from which solve() takes this path (production-2000 on 512
#: ranks is about 1e6; the per-shard greedy there takes a few seconds)
SCALE_MIN_WORK = 2_000_000
#: ranks (or hosts) each shard is priced on in the placement
PRICE_RANKS = 48
#: at scale the local search gets at least this many seconds' worth of work units
#: (solve.WORK_UNITS_PER_SECOND), even when building the model and the problem took the
#: caller's budget (the CLI's default is 10 s): without it the LP seed is left as placed
SCALE_SEARCH_S = 10.0
#: the LP's wall-clock safety limit at scale (it needs about 4 s of CPU at 10,000 tables x
#: 4,096 ranks; on a shared machine its wall time can be several times that, and without it
#: the plan falls back to the "least work" seed and the analytic bound)
SCALE_LP_LIMIT_S = 90.0
#: the local search's tables tried per hot rank, widened each time it converges (while the
#: work budget lasts): the hottest table first, which is cheap and settles the seed, then more
TABLES_PER_RANK = (1, 4, 12)


def use_scale_path(prob: PlanningProblem) -> bool:
    return prob.num_tables * prob.ctx.world_size >= SCALE_MIN_WORK


def fast_place(ev, prob: PlanningProblem, choice: Sequence[int],
               price_ranks: int = PRICE_RANKS) -> List[int]:
    """Place every table of ``prob`` with ``choice`` (see module docs) and load the plan into
    the empty evaluator ``ev`` in one bulk assignment. Returns the tables no option of which
    fits (empty when the plan is complete)."""
    W = ev.W
    K = ev.K
    owner = ev.owner
    loads = np.zeros((W, K))
    colmax = np.zeros(K)
    gpresent = np.zeros((W, ev.gcount.shape[1]), dtype=bool)
    uniform = np.zeros(K)
    state = {"allreduce": 0.0}
    groups = set()
    devcap = ev.device_cap + 1e-6
    hostcap = ev.host_cap + 1e-6
    w = _time_weights(prob)
    key = np.zeros(W)  # scalar load per rank (seconds): the host-wide shardings' shortlist and ties
    ovh = ev.overhead
    assignment: dict = {}

    def price(rows_new: np.ndarray, cand: int, nsh: int) -> np.ndarray:
        cm = np.maximum(colmax[None, :], rows_new)
        g = set(groups)
        if ev.types[cand] != DATA_PARALLEL:
            g.add(ev.types[cand])
        return step_total_batch(cm + (uniform + ev.peers[cand] * nsh)[None, :],
                                state["allreduce"] + ev.allreduce[cand] * nsh / W, len(g), ev.ctx,
                                ev.pipeline, ev.fwd_precision, ev.bwd_precision)

    all_ranks = np.arange(W, dtype=np.int64)

    def commit(t: int, cand: int, ranks: Sequence[int]) -> None:
        idx = np.asarray(ranks, dtype=np.int64)
        g = ev.group_of[cand]
        new = idx[~gpresent[idx, g]]
        ev.add_shards(loads, all_ranks, cand, idx)  # with a shared host link, its host mates too
        loads[new] += ovh
        gpresent[idx, g] = True
        rows = ev.host_ranks(idx)
        np.maximum(colmax, loads[rows].max(axis=0), out=colmax)
        key[rows] = loads[rows] @ w
        uniform[:] += ev.peers[cand] * len(idx)
        state["allreduce"] += ev.allreduce[cand] * len(idx) / W
        if ev.types[cand] != DATA_PARALLEL:
            groups.add(ev.types[cand])
        assignment[t] = (cand, tuple(int(r) for r in idx))

    def rows_for(idx: np.ndarray, cand: int, block: int = 1) -> np.ndarray:
        # a rank's row with the shard on it (and, block > 1, on each of block consecutive ranks)
        vec = ev.owner_eff[cand] if block == 1 else ev.block_vec(cand, block)
        return loads[idx] + vec + (~gpresent[idx, ev.group_of[cand]])[:, None] * ovh[None, :]

    def try_place(cand: int):
        c = prob.cands[cand]
        vec = owner[cand]
        dev_ok = loads[:, DEV_MEM] + vec[DEV_MEM] <= devcap
        host_ok = loads[:, HOST_MEM] + vec[HOST_MEM] <= hostcap
        fits = dev_ok & host_ok
        if c.placement == "all":
            k = c.num_shards
            if not bool(np.all(fits[:k])):
                return None
            rows = rows_for(all_ranks[:k], cand, ev.L)  # every host holds L of its shards
            return tuple(range(k)), float(price(rows.max(axis=0)[None, :], cand, k)[0])
        if c.placement == "host":
            Lc = c.num_shards
            short = host_shortlist(fits, key, Lc, price_ranks, np.max, in_host_order=False)
            if short is None:
                return None
            ok, hkey, idx = short
            r3 = rows_for(idx, cand, Lc).reshape(len(ok), Lc, K)
            obj = price(r3.max(axis=1), cand, Lc)
            j = _pick(obj, hkey)
            h = int(ok[j])
            return tuple(range(h * Lc, (h + 1) * Lc)), float(obj[j])
        # free shards on distinct ranks: the shortlist priced once per shard
        ok = np.nonzero(fits)[0]
        need = c.num_shards
        if len(ok) < need:
            return None
        m = min(len(ok), price_ranks + need)
        if len(ok) > m:  # the ranks with the most room in the columns the shard loads (_room_key)
            cols = np.nonzero(vec * w > 0)[0]
            inv = 1.0 / np.maximum(colmax[cols] + uniform[cols], 1e-30)
            add = vec[cols] + uniform[cols]
            fill = np.full(W, -np.inf)
            for j, col in enumerate(cols):  # column by column: a reduce over a few columns is slower
                np.maximum(fill, (loads[:, col] + add[j]) * inv[j], out=fill)
            sel = np.argpartition(fill[ok], m - 1)[:m]
        else:
            sel = np.arange(len(ok))
        idx = ok[sel]
        rows = rows_for(idx, cand)
        # ties: the rank whose squared per-column loads grow the least (each column balanced on
        # its own; the scalar load lets one column pile up to its maximum on ranks light in others)
        tie = ((rows * w[None, :]) ** 2).sum(axis=1) - ((loads[idx] * w[None, :]) ** 2).sum(axis=1)
        chosen: List[int] = []
        cm_local = colmax.copy()
        obj_last = float("inf")
        for _ in range(need):
            cm = np.maximum(cm_local[None, :], rows)
            g = set(groups)
            if ev.types[cand] != DATA_PARALLEL:
                g.add(ev.types[cand])
            obj = step_total_batch(cm + (uniform + ev.peers[cand] * need)[None, :],
                                   state["allreduce"] + ev.allreduce[cand] * need / W, len(g),
                                   ev.ctx, ev.pipeline, ev.fwd_precision, ev.bwd_precision)
            obj[[i for i in range(len(idx)) if int(idx[i]) in chosen]] = np.inf
            j = _pick(obj, tie)
            chosen.append(int(idx[j]))
            obj_last = float(obj[j])
            # (its host mates' real rows gain only the shared columns, equal to rows[j]'s there)
            cm_local = np.maximum(cm_local, rows[j])
            if len(ev.shared):  # a later shard on a host mate adds to the link share this one took
                mates = (idx // ev.L == idx[j] // ev.L) & (np.arange(len(idx)) != j)
                rows[mates] += ev.owner_host[cand]
        return tuple(chosen), obj_last

    def size(cand: int) -> float:
        c = prob.cands[cand]
        return 0.0 if c.placement == "all" else float(owner[cand] @ w)

    order = sorted(range(prob.num_tables),
                   key=lambda t: (prob.cands[choice[t]].placement != "all", -size(choice[t]),
                                  -owner[choice[t]][DEV_MEM], t))
    unplaced: List[int] = []
    for t in order:
        got = try_place(choice[t])
        if got is not None:
            commit(t, choice[t], got[0])
            continue
        # the choice fits nowhere: the other option that fits with the lowest step time (ties:
        # the smallest memory), as the greedy of .place falls back
        best = None
        for alt in sorted((i for i in prob.candidates[t] if i != choice[t]),
                          key=lambda i: (owner[i][DEV_MEM] * prob.cands[i].num_shards, i)):
            got = try_place(alt)
            if got is not None and (best is None or got[1] < best[2]):
                best = (alt, got[0], got[1])
        if best is None:
            unplaced.append(t)
        else:
            commit(t, best[0], best[1])
    ev.assign_many(assignment)
    return unplaced


def scale_local_search(ev, prob: PlanningProblem, deadline: float, budget,
                       tables_per_rank: Sequence[int] = TABLES_PER_RANK) -> Tuple[int, bool]:
    """:func:`.place.local_search` with :class:`ShortlistPlacer`, trying the hottest table of
    each hot rank until no move helps, then the ``tables_per_rank`` next widths in turn, all on
    the one ``budget``. Returns (moves applied, whether the budget stopped it)."""
    moves = 0
    placer = ShortlistPlacer()
    for k in tables_per_rank:
        more, cut = local_search(ev, prob, deadline=deadline, budget=budget, tables_per_rank=k, placer=placer)
        moves += more
        if cut:
            return moves, True
    return moves, False


def _time_weights(prob: PlanningProblem) -> np.ndarray:
    """Seconds per unit of each load column (output bytes count twice: output and grad)."""
    return layout().balance_weights(prob.ctx.profile)


def _pick(obj: np.ndarray, tie: np.ndarray) -> int:
    best = np.min(obj)
    ok = np.nonzero(obj <= best * (1 + 1e-9) + 1e-15)[0]
    return int(ok[np.argmin(tie[ok])])


def host_shortlist(fits: np.ndarray, key: np.ndarray, hosts_of: int, price_ranks: int, reduce,
                   in_host_order: bool) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The hosts (groups of ``hosts_of`` consecutive ranks) a host-placed shard fits on in
    memory (every rank of the host ``fits``), cut to the ``price_ranks`` with the smallest
    ``reduce(key)`` over their ranks: ``(hosts, their keys, their ranks flattened)``, None if it
    fits on no host. ``in_host_order``: the shortlist in host index order (the local search's
    placer breaks ties by it, as ``best_placement``), else in ``argpartition``'s order (the
    greedy's). The two callers keep their own tie keys (max / sum): merging them moved plans."""
    n_hosts = len(fits) // hosts_of
    ok = np.nonzero(fits.reshape(n_hosts, hosts_of).all(axis=1))[0]
    if not len(ok):
        return None
    hkey = reduce(key.reshape(n_hosts, hosts_of), axis=1)[ok]
    if len(ok) > price_ranks:
        sel = np.argpartition(hkey, price_ranks - 1)[:price_ranks]
        if in_host_order:
            sel = np.sort(sel)
        ok, hkey = ok[sel], hkey[sel]
    return ok, hkey, (ok[:, None] * hosts_of + np.arange(hosts_of)[None, :]).ravel()


def shortlist_placement(ev, prob: PlanningProblem, table: int, cand: int,
                        price_ranks: int = PRICE_RANKS,
                        cache: Optional[dict] = None) -> Optional[Tuple[Tuple[int, ...], float]]:
    """:func:`.place.best_placement` priced on a shortlist: the ``price_ranks`` ranks that fit
    the shard in memory with the most room for it (:func:`_room_key`; host-wide shardings: the
    least-loaded hosts by the scalar load), ties broken by the scalar load (the local search's
    placer at scale). Same contract: the best ranks for ``table`` as ``cand`` given the rest of
    the plan and the objective, None if it fits nowhere.

    ``cache``: a dict kept while the plan does not change (:class:`ShortlistPlacer` keeps one
    per table tried): the per-rank rows and tie-break loads of each TBE group are computed once
    for all of the table's options instead of once per option."""
    c = prob.cands[cand]
    if c.placement == "all" and len(ev.shared):
        return best_placement(ev, prob, table, cand)
    need_ovh, tie_all = _group_rows(ev, int(ev.group_of[cand]), {} if cache is None else cache)
    if c.placement == "all":
        # best_placement's rows for shard i on rank i, without its per-rank index arithmetic (no
        # shared host link: each rank's row gains its own shard's load, nothing else moves)
        n = c.num_shards
        new = _rows(ev, need_ovh, slice(0, n)) + ev.owner_local[cand]
        if np.any(new[:, DEV_MEM] > ev.device_cap[:n] + 1e-6) or np.any(
                new[:, HOST_MEM] > ev.host_cap[:n] + 1e-6):
            return None
        cm = np.maximum(ev._colmax, new.max(axis=0))
        return tuple(range(n)), float(_objectives(ev, cm[None, :], cand, n)[0])
    vec = ev.owner_eff[cand]  # on its own rank's row (cost.evaluator: shared host links)
    fits = ((ev.loads[:, DEV_MEM] + vec[DEV_MEM] <= ev.device_cap + 1e-6)
            & (ev.loads[:, HOST_MEM] + vec[HOST_MEM] <= ev.host_cap + 1e-6))

    if c.placement == "host":
        Lc = c.num_shards
        short = host_shortlist(fits, tie_all, Lc, price_ranks, np.sum, in_host_order=True)
        if short is None:
            return None
        ok, hkey, idx = short
        r3 = (_rows(ev, need_ovh, idx) + ev.block_vec(cand, Lc)).reshape(len(ok), Lc, ev.K)
        cm = np.maximum(ev._colmax[None, :], r3.max(axis=1))
        obj = _objectives(ev, cm, cand, Lc)
        j = _place_pick(obj, hkey)
        if j < 0:
            return None
        h = int(ok[j])
        return tuple(range(h * Lc, (h + 1) * Lc)), float(obj[j])
    ok = np.nonzero(fits)[0]
    need = c.num_shards
    if len(ok) < need:
        return None
    m = min(len(ok), price_ranks + need)
    if len(ok) > m:
        ok = np.sort(ok[np.argpartition(_room_key(ev, ok, vec, need_ovh), m - 1)[:m]])
    base = _rows(ev, need_ovh, ok)
    tie = tie_all[ok].copy()
    colmax = ev._colmax.copy()
    taken = np.zeros(len(ok), dtype=bool)
    chosen: List[int] = []
    obj_last = float("inf")
    for _ in range(need):
        rows = base + vec
        obj = _objectives(ev, np.maximum(colmax[None, :], rows), cand, need)
        obj[taken] = np.inf
        j = _place_pick(obj, tie)
        if j < 0:
            return None
        taken[j] = True
        chosen.append(int(ok[j]))
        # (its host mates' real rows gain only the shared columns, equal to rows[j]'s there)
        colmax = np.maximum(colmax, rows[j])
        if len(ev.shared):  # a later shard on a host mate adds to the link share this one took
            base[ok // ev.L == ok[j] // ev.L] += ev.owner_host[cand]
        obj_last = float(obj[j])
    return tuple(chosen), obj_last


def _group_rows(ev, g: int, cache: dict) -> Tuple[np.ndarray, np.ndarray]:
    """Which ranks lack TBE group ``g`` (a shard of it adds the group's fixed cost there) and
    every rank's tie-break load (:func:`.place.rank_time`) with that cost added, from ``cache``
    when there: the ranks that hold the group keep the plan's tie-break load, computed once per
    cache, the others are priced with the cost added (the same numbers, bit for bit, as
    pricing every row with it)."""
    got = cache.get(g)
    if got is None:
        plain = cache.get("plain")
        if plain is None:
            plain = cache["plain"] = rank_time(ev, ev.loads)
        need_ovh = ev.gcount[:, g] == 0
        tie = plain.copy()
        if need_ovh.any():
            tie[need_ovh] = rank_time(ev, ev.loads[need_ovh] + ev.overhead[None, :])
        got = cache[g] = (need_ovh, tie)
    return got


def _room_key(ev, ok: np.ndarray, vec: np.ndarray, need_ovh: np.ndarray) -> np.ndarray:
    """Per rank of ``ok``: how full the shard ``vec`` leaves the rank in the time columns it
    loads, the fullest of them as a fraction of the plan's maximum there. The shortlist takes
    the ranks with the most room: a scalar load (seconds summed over the columns) ranks a rank
    light in compute but at the output's maximum among the lightest, and a shard with a large
    output priced there raises the step, so it stays where it is."""
    cols = np.nonzero(vec * layout().balance_weights(ev.ctx.profile) > 0)[0]
    inv = 1.0 / np.maximum(ev._colmax[cols] + ev.uniform[cols], 1e-30)
    add = vec[cols] + ev.uniform[cols]
    sub = ev.loads[ok]
    lack = need_ovh[ok]
    out = np.full(len(ok), -np.inf)
    for j, c in enumerate(cols):  # column by column: a reduce over a few columns is slower
        np.maximum(out, ((sub[:, c] + lack * ev.overhead[c]) + add[j]) * inv[j], out=out)
    return out


def _rows(ev, need_ovh: np.ndarray, idx) -> np.ndarray:
    """The rows of ranks ``idx`` (a slice or indices) with the group's fixed cost where needed."""
    return ev.loads[idx] + need_ovh[idx, None] * ev.overhead[None, :]


class ShortlistPlacer:
    """:func:`shortlist_placement` as the local search's placer
    (:func:`.place.local_search`'s ``placer``): :meth:`for_table` gives the placer of one table
    tried against an unchanging plan, sharing the per-rank rows over the table's options."""

    def __init__(self, price_ranks: int = PRICE_RANKS) -> None:
        self.price_ranks = price_ranks

    def __call__(self, ev, prob: PlanningProblem, table: int, cand: int):
        return shortlist_placement(ev, prob, table, cand, self.price_ranks)

    def for_table(self, ev, prob: PlanningProblem, table: int):
        cache: dict = {}
        return lambda ev_, prob_, t, cand: shortlist_placement(ev_, prob_, t, cand, self.price_ranks, cache)
