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
* bin packing: if at least ``k W + 1`` chosen pieces are ``>= theta``, some rank holds ``k + 1``
  of them, so ``z >= U(x) + (k + 1) theta`` (one binary per ``(theta, k)``);
* memory: the chosen options' total storage fits the ranks' total.

The minimum of ``z`` over binary ``x`` under those rows is a lower bound on every plan; HiGHS's
dual bound of that MILP is one even when the time limit stops it, and with the integrality
dropped it is still one (the LP fallback). The pair/``k``-bound and the ``U`` in the piece rows
are what the aggregated LP of :mod:`.lp` cannot see.
"""

from __future__ import annotations

from typing import Optional

import attrs
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from torchrec_sparselift.cost.model import DEV_MEM, FWD, HOST_MEM
from torchrec_sparselift.search.lp import RangeRows
from torchrec_sparselift.search.problem import PlanningProblem

__all__ = ["MakespanBound", "makespan_bound", "piece_bounds", "analytic_makespan_bound"]

MAX_THRESHOLDS = 24
MAX_K = 6


@attrs.frozen
class MakespanBound:
    bound_s: float
    method: str


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
    makespan, to stop the MILP once the bound reaches it."""
    W = prob.ctx.world_size
    C = len(prob.cands)
    ms = 1e3
    p = np.array([c.owner[FWD] for c in prob.costs]) * ms
    n = np.array([c.num_shards for c in prob.cands], dtype=float)
    allp = np.array([c.placement == "all" for c in prob.cands])
    piece = ~allp
    # thresholds: distinct piece sizes among the largest
    cand_sizes = np.unique(p[piece & (p > 0)])[::-1]
    if len(cand_sizes) > MAX_THRESHOLDS:
        idx = np.unique(np.geomspace(1, len(cand_sizes), MAX_THRESHOLDS).astype(int) - 1)
        cand_sizes = cand_sizes[idx]
    max_pieces = sum(max((n[i] for i in ids if piece[i]), default=0.0) for ids in prob.candidates)
    ys = []  # (theta, k)
    for th in cand_sizes:
        cnt_max = sum(max((n[i] for i in ids if piece[i] and p[i] >= th), default=0.0)
                      for ids in prob.candidates)
        for k in range(1, MAX_K + 1):
            if k * W + 1 > cnt_max or k * W + 1 > max_pieces:
                break
            ys.append((float(th), k))
    iz = C
    iy0 = C + 1
    nv = C + 1 + len(ys)
    rr = RangeRows()
    add = rr.add

    U = [(i, p[i]) for i in range(C) if allp[i] and p[i] > 0]
    negU = [(i, -v) for i, v in U]
    for ids in prob.candidates:
        add([(i, 1.0) for i in ids], 1.0, 1.0)
    add([(i, n[i] * p[i] / W) for i in range(C)] + [(iz, -1.0)], -np.inf, 0.0)
    for ids in prob.candidates:
        ent = [(i, p[i]) for i in ids if piece[i] and p[i] > 0]
        if ent:  # z >= U + piece (a table's own all-placement options are exclusive with it)
            add(ent + [e for e in U if e[0] not in ids] + [(iz, -1.0)], -np.inf, 0.0)
    for j, (th, k) in enumerate(ys):
        cnt = [(i, n[i]) for i in range(C) if piece[i] and p[i] >= th]
        big = max_pieces
        add(cnt + [(iy0 + j, -big)], -np.inf, float(k * W))
        add([(iz, 1.0)] + negU + [(iy0 + j, -(k + 1) * th)], 0.0, np.inf)
    for col, cap in ((DEV_MEM, prob.device_cap), (HOST_MEM, prob.host_cap)):
        if len(cap) and np.all(np.isfinite(cap)):
            m = np.array([c.owner[col] for c in prob.costs]) * n / 2.0**30
            add([(i, m[i]) for i in range(C) if m[i]], -np.inf, float(np.sum(cap)) / 2.0**30)
    A = rr.matrix(nv)
    cvec = np.zeros(nv)
    cvec[iz] = 1.0
    integrality = np.ones(nv) if integral else np.zeros(nv)
    integrality[iz] = 0
    ub = np.ones(nv)
    ub[iz] = np.inf
    opts = {"time_limit": max(0.2, float(time_limit_s)), "disp": False, "mip_rel_gap": 1e-4}
    if upper is not None and np.isfinite(upper):
        opts["mip_rel_gap"] = 1e-4
    res = milp(cvec, constraints=LinearConstraint(A, rr.lo, rr.hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub), options=opts)
    floor = analytic_makespan_bound(prob) * ms
    if integral:
        b = getattr(res, "mip_dual_bound", None)
        if b is None or not np.isfinite(b):
            b = res.fun if res.status == 0 else None
        if b is None or not np.isfinite(b):
            return makespan_bound(prob, time_limit_s, upper, integral=False)
        status = "optimal" if res.status == 0 else "time_limit"
        return MakespanBound(bound_s=max(float(b), floor) / ms * (1 - 1e-7),
                             method=f"makespan-milp({status}, {len(ys)} packing rows)")
    if res.status != 0 or res.fun is None:
        return MakespanBound(bound_s=floor / ms, method="makespan-analytic (the LP did not finish)")
    return MakespanBound(bound_s=max(float(res.fun), floor) / ms * (1 - 1e-7), method="makespan-lp")


def analytic_makespan_bound(prob: PlanningProblem) -> float:
    """Seconds: ``max(sum_t min_o n_o p_o / W, max_t min_o p_o)``: no solver, always finite."""
    W = prob.ctx.world_size
    avg, piece = 0.0, 0.0
    for ids in prob.candidates:
        avg += min(prob.costs[i].owner[FWD] * prob.cands[i].num_shards for i in ids) / W
        piece = max(piece, min(prob.costs[i].owner[FWD] for i in ids))
    return max(avg, piece)
