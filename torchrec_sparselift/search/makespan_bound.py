"""Lower bounds for a per-rank makespan objective, with integrality.

For objectives that are the slowest rank's summed shard time (TorchRec's ``NoopPerfModel``
rating, see :mod:`.torchrec_objective`), every plan is a choice of one option per table and a
packing of its shards onto ranks. Relax the packing: a row-wise or data-parallel option puts its
shard time ``p`` on *every* rank (the uniform load ``U``); a table-wise, column-wise or
table-row-wise option brings ``n`` pieces of size ``p`` that may go anywhere. Then any plan's
makespan ``z`` satisfies, for its choice ``x``:

* average: ``z >= sum_c x_c n_c p_c / W``;
* largest piece: ``z >= U(x) + p_c`` for every chosen piece (it sits on a rank that also
  carries ``U``);
* bin packing: some rank holds ``k + 1`` of the ``k W + 1`` largest chosen pieces, whose sum is
  at least ``p_{kW+1} + k p_{kW}`` (sorted descending, the classic ``P||Cmax`` bound); with
  thresholds ``theta_a >= theta_b`` and binaries ``A(theta, m) = [at least m chosen pieces are
  >= theta]``: ``z >= U(x) + (k theta_a + theta_b)(A(theta_a, kW) + A(theta_b, kW + 1) - 1)``;
* memory: the chosen options' total storage fits the ranks' total.

The minimum of ``z`` over binary ``x`` under those rows is a lower bound on every plan; HiGHS's
dual bound of that MILP is one even when the time limit stops it, and with the integrality
dropped it is still one (the LP fallback). The pair/``k``-bound and the ``U`` in the piece rows
are what the aggregated LP of :mod:`.lp` cannot see.
"""

from __future__ import annotations

from typing import Optional, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.model import FWD
from torchrec_sparselift.search.equation import MS, Equation, choice_rows, total_memory_rows
from torchrec_sparselift.search.problem import PlanningProblem

__all__ = ["MakespanBound", "makespan_bound", "piece_bounds", "analytic_makespan_bound"]

THRESHOLDS_PER_K = 16
MAX_PAIR_K = 2
LP_MIN_TIME_S = 5.0
MAX_K = 6


@attrs.frozen
class MakespanBound:
    """``bound_s``: seconds; ``choice``: the relaxation's option per table (candidate ids), a
    search seed, () when no integral solution was found."""

    bound_s: float
    method: str
    choice: Tuple[int, ...] = ()


def piece_bounds(sizes: np.ndarray, world_size: int, uniform: float = 0.0) -> float:
    """The classic ``P||Cmax`` bounds for fixed pieces: ``U + max(sum/W, p_1,
    p_W + p_{W+1}, ...)`` (sizes in any order)."""
    p = np.sort(np.asarray(sizes, dtype=float))[::-1]
    W = world_size
    best = max(float(p.sum()) / W, float(p[0]) if len(p) else 0.0)
    k = 1
    while k * W < len(p):
        best = max(best, float(p[k * W - k: k * W + 1].sum()))
        k += 1
    return uniform + best


def makespan_bound(prob: PlanningProblem, time_limit_s: float = 5.0, upper: Optional[float] = None,
                   integral: bool = True) -> MakespanBound:
    """Lower bound (seconds) on the makespan of every plan of ``prob`` (see module docs).

    ``prob``'s candidates carry their shard time in the ``FWD`` column only (as
    :func:`~.torchrec_objective.makespan_problem` builds them). ``upper``: a known plan's
    makespan: ``z <= upper`` caps the MILP, so HiGHS prunes every branch that cannot go below
    it and stops once none is left; the bound is then ``upper`` itself (the known plan is optimal
    to the tolerance) and the method says ``reached upper``."""
    W = prob.ctx.world_size
    C = len(prob.cands)
    ms = MS
    p = np.array([c.owner[FWD] for c in prob.costs]) * ms
    n = np.array([c.num_shards for c in prob.cands], dtype=float)
    allp = np.array([c.placement == "all" for c in prob.cands])
    piece = ~allp
    # thresholds: a row (theta, k) can only matter when (k + 1) theta is near the floor, so per
    # k the distinct piece sizes above half of floor / (k + 1), spread evenly in value
    floor = analytic_makespan_bound(prob) * ms
    sizes = np.unique(p[piece & (p > 0)])
    tab = np.empty(C, dtype=int)
    for t, ids in enumerate(prob.candidates):
        tab[list(ids)] = t
    pc = np.nonzero(piece & (p > 0))[0]
    max_pieces = sum(max((n[i] for i in ids if piece[i]), default=0.0) for ids in prob.candidates)

    def cnt_max(th: float) -> float:  # the most pieces >= th any choice can bring
        sel = pc[p[pc] >= th]
        most = np.zeros(len(prob.candidates))
        np.maximum.at(most, tab[sel], n[sel])
        return float(most.sum())

    # per k, thresholds theta_a >= theta_b: with A(theta, m) = [at least m chosen pieces are
    # >= theta], A(theta_a, kW) and A(theta_b, kW + 1) give z >= U + k theta_a + theta_b
    levels = {}  # k -> thresholds (descending)
    for k in range(1, MAX_K + 1):
        if k * W + 1 > max_pieces:
            break
        cand = sizes[(sizes >= 0.5 * floor / (k + 1)) & (sizes <= 1.5 * floor / k)]
        if not len(cand):
            continue
        per_k = THRESHOLDS_PER_K if C <= 2000 else THRESHOLDS_PER_K // 2
        grid = np.geomspace(cand[0], cand[-1], per_k) if cand[-1] > cand[0] else cand[:1]
        idx = np.unique(np.minimum(np.searchsorted(cand, grid * (1 - 1e-12)), len(cand) - 1))
        ths = [float(th) for th in cand[idx][::-1] if cnt_max(float(th)) >= k * W]
        if ths:
            levels[k] = ths
    # variables: x[c] (one option per table), z (the makespan), u (the uniform load U(x)),
    # A(theta, m) (at least m chosen pieces are >= theta)
    eq = Equation()
    eq.vector("x", C, ub=1.0, integer=integral)
    iz = eq.var("z")
    iu = eq.var("u")
    keys = []
    for k, ths in levels.items():
        for th in ths:
            for m_ in (k * W, k * W + 1):
                if (th, m_) not in keys and cnt_max(th) >= m_:
                    keys.append((th, m_))
    ind = eq.block("at_least", keys, ub=1.0, integer=integral)  # (theta, m) -> binary variable
    # pairs of thresholds for k <= MAX_PAIR_K, theta_a = theta_b beyond
    pairs = [(k, ta, tb) for k, ths in levels.items() for ia, ta in enumerate(ths)
             for tb in (ths[ia:] if k <= MAX_PAIR_K else [ta])
             if (ta, k * W) in ind and (tb, k * W + 1) in ind]
    add = eq.add

    uc = np.nonzero(allp & (p > 0))[0]
    choice_rows(eq, prob.candidates)
    eq.add_arrays(np.append(uc, iu), np.append(p[uc], -1.0), 0.0, 0.0)  # u = U(x), the uniform load
    eq.add_arrays(np.append(np.arange(C), iz), np.append(n * p / W, -1.0), -np.inf, 0.0)
    for ids in prob.candidates:
        ent = [(i, p[i]) for i in ids if piece[i] and p[i] > 0]
        if ent:  # z >= U + piece; the table's own all-rank options are exclusive with the piece
            own = [(i, -p[i]) for i in ids if allp[i] and p[i] > 0]
            add(ent + own + [(iu, 1.0), (iz, -1.0)], -np.inf, 0.0)
    for (th, m_), v in ind.items():  # count(theta) <= m - 1 unless A(theta, m)
        sel = pc[p[pc] >= th]
        eq.add_arrays(np.append(sel, v), np.append(n[sel], -max_pieces), -np.inf, float(m_ - 1))
    for k, ta, tb in pairs:  # z - u >= c (A_a + A_b - 1), c = k theta_a + theta_b
        c = k * ta + tb
        add([(iz, 1.0), (iu, -1.0), (ind[ta, k * W], -c), (ind[tb, k * W + 1], -c)], -c, np.inf)
    ys = pairs
    total_memory_rows(eq, prob, n)
    opts = {"time_limit": max(0.2, float(time_limit_s)), "disp": False, "mip_rel_gap": 1e-4}
    capped = upper is not None and np.isfinite(upper)
    if capped:  # every plan's makespan is >= the bound; only z < upper is worth exploring
        eq.set_bounds(iz, ub=max(float(upper) * ms, floor))
    res = eq.solve_milp(iz, opts)
    kind = "milp" if integral else "lp"
    if capped and res.status == 2:  # infeasible under the cap: the relaxation cannot beat upper
        return MakespanBound(bound_s=float(upper), method=f"makespan-{kind}(reached upper)")
    choice: Tuple[int, ...] = ()
    if res.x is not None:  # the (relaxed) choice, rounded to each table's largest x
        choice = tuple(int(max(ids, key=lambda i: res.x[i])) for ids in prob.candidates)
    if integral:
        b = getattr(res, "mip_dual_bound", None)
        if b is None or not np.isfinite(b):
            b = res.fun if res.status == 0 else None
        if b is None or not np.isfinite(b):
            # the LP is cheap (a fraction of the MILP's time); its wall limit is generous so
            # that a loaded machine does not leave only the analytic floor
            return makespan_bound(prob, max(LP_MIN_TIME_S, time_limit_s), upper, integral=False)
        status = "optimal" if res.status == 0 else "time_limit"
        bound = max(float(b), floor) / ms * (1 - 1e-7)
        return MakespanBound(bound_s=min(bound, float(upper)) if capped else bound,
                             method=f"makespan-milp({status}, {len(ys)} packing rows)", choice=choice)
    if res.status != 0 or res.fun is None:
        return MakespanBound(bound_s=floor / ms, method="makespan-analytic (the LP did not finish)")
    return MakespanBound(bound_s=max(float(res.fun), floor) / ms * (1 - 1e-7), method="makespan-lp",
                         choice=choice)


def analytic_makespan_bound(prob: PlanningProblem) -> float:
    """Seconds: ``max(sum_t min_o n_o p_o / W, max_t min_o p_o)``: no solver, always finite."""
    W = prob.ctx.world_size
    avg, piece = 0.0, 0.0
    for ids in prob.candidates:
        avg += min(prob.costs[i].owner[FWD] * prob.cands[i].num_shards for i in ids) / W
        piece = max(piece, min(prob.costs[i].owner[FWD] for i in ids))
    return max(avg, piece)
