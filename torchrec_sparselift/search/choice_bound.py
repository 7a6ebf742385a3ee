"""A tighter lower bound under SparseLift's own model: integral option choice with packing rows.

The LP bound of :mod:`.lp` relaxes each column's per-rank maximum to (a) the average and (b) the
largest single shard. With few shards per rank both are loose. This module keeps the LP's rows
and adds what integrality and placement rules imply, per time column ``c``:

* the rank holding a piece also carries every row-wise/data-parallel shard (they sit on every
  rank) and every rank's share of peer traffic: ``z_c >= piece + U_c``, where ``U_c`` is that
  uniform load;
* bin packing: if at least ``k W + 1`` chosen pieces have ``own_c >= theta``, some rank holds
  ``k + 1`` of them: ``z_c >= U_c + (k + 1) theta`` (one binary per ``(c, theta, k)``);
* the evaluator's fixed costs: one TBE fixed cost (``lookup_overhead_s``, forward and backward)
  per rank and (sharding type, kernel) group, so every rank pays it for each group that sits on
  every rank, and a rank holding a piece pays its group's too; one collective latency per
  sharding type used in the output and gradient phases, two in the input plus the shared splits
  call when any type is used (``cost.model.collective_calls``); the all-reduce latency only when there are dense
  parameters or a chosen option joins the all-reduce;
* the option choice is binary. Its choice at the best solution (:func:`choice_bound_solution`) is
  a seed for the placement (``search.solve``).

``tests/test_choice_bound.py`` checks bound <= the exhaustive optimum of the evaluator on random
small instances. See docs/cost_model.md ("How the integral-choice bound is built").

The step-time rows are the step equation's (:mod:`.equation`: ``step_rows``, the same as the
LP's), so the MILP's optimum, or HiGHS's dual bound when the time limit stops it, is a lower
bound on every plan's step time under the model, and never below the LP's (same rows, more).
"""

from __future__ import annotations

from typing import Tuple

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.pipelines import pipeline_kind
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.search.equation import (
    MS, Equation, allreduce_rows, choice_rows, column_scale, fixed_terms, link_rows, load_maxima,
    piece_loads, step_rows, step_vars, total_memory_rows,
)
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["ChoiceBound", "choice_bound", "choice_bound_solution"]

MAX_PIECE_TABLES = 400
THRESHOLDS = 8
MAX_K = 4


@attrs.frozen
class ChoiceBound:
    """The integral-choice bound and the option choice at its best solution (``()`` if HiGHS
    found none): a seed for the placement, often the optimal plan's choice."""

    bound_s: float
    choice: Tuple[int, ...] = ()


def choice_bound(prob: PlanningProblem, pipeline: str, fwd_precision: str = defaults.COMM_PRECISION,
                 bwd_precision: str = defaults.COMM_PRECISION, time_limit_s: float = 2.0) -> float:
    """Lower bound (seconds) on the step time of every plan of ``prob`` under ``pipeline``
    (see module docs); NaN if HiGHS gives none within ``time_limit_s``."""
    return choice_bound_solution(prob, pipeline, fwd_precision, bwd_precision, time_limit_s).bound_s


def choice_bound_solution(prob: PlanningProblem, pipeline: str, fwd_precision: str = defaults.COMM_PRECISION,
                          bwd_precision: str = defaults.COMM_PRECISION, time_limit_s: float = 2.0) -> ChoiceBound:
    """:func:`choice_bound` with the option choice of the MILP's best solution."""
    ctx = prob.ctx
    p = ctx.profile
    W = ctx.world_size
    C = len(prob.cands)
    if C == 0:
        return ChoiceBound(float("nan"))
    lay = layout()
    scale = column_scale(p)
    own = np.stack([c.owner for c in prob.costs]) * scale[None, :]
    per = np.stack([c.peers for c in prob.costs]) * scale[None, :]
    n = np.array([c.num_shards for c in prob.cands], dtype=float)
    allp = np.array([c.placement == "all" and c.num_shards == W for c in prob.cands])
    ft = fixed_terms(ctx, split=prob.split_overhead_s is not None)
    fixed = {c: ft.group_cost[c] for c in lay.time}
    # TBE groups (sharding type, kernel) as the evaluator counts them, and the collective types
    kern = [c.compute_kernel for c in prob.cands]
    types = [c.sharding_type for c in prob.cands]
    gkeys = sorted(set(zip(types, kern)))
    gid = {k: i for i, k in enumerate(gkeys)}
    grp = np.array([gid[k] for k in zip(types, kern)], dtype=int)
    all_group = np.array([bool(np.all(allp[grp == g])) for g in range(len(gkeys))])
    ctypes = sorted({t for t in types if t != DATA_PARALLEL})
    # variables: x[c], z[col], u[col] (what every rank carries), the step equation's, group used,
    # free group used, type used, latency, data-parallel used, any type used, packing binaries
    eq = Equation()
    eq.vector("x", C, ub=1.0, integer=True)
    iz = load_maxima(eq)
    iu = eq.block("u", lay.time, labels=[lay.columns[j].name for j in lay.time])
    sv = step_vars(eq, iz)
    ig = eq.vector("group_used", len(gkeys))
    ifree = eq.var("free_group_used")
    ity = eq.vector("type_used", len(ctypes))
    ilat = eq.var("latency")
    idp = eq.var("dp_used")  # any option that joins the gradient all-reduce chosen
    iany = eq.var("any_group")  # any sharding type used (the input's shared splits all-to-all)
    sv = attrs.evolve(sv, latency=ilat, any_group=iany)
    # what a piece adds to its rank's row (a shared host link's columns: own / L, the host's mean)
    piece = piece_loads(own, ctx)
    packing_keys = []  # (col, theta, k)
    for c in lay.time:
        sizes = np.unique(piece[~allp, c][piece[~allp, c] > 0])[::-1]
        if not len(sizes):
            continue
        sel = sizes[np.unique(np.geomspace(1, len(sizes), min(THRESHOLDS, len(sizes))).astype(int) - 1)]
        for th in sel:
            cnt_max = sum(max((n[i] for i in ids if not allp[i] and piece[i, c] >= th), default=0.0)
                          for ids in prob.candidates)
            for k in range(1, MAX_K + 1):
                if k * W + 1 > cnt_max:
                    break
                packing_keys.append((c, float(th), k))
    pvar = eq.block("packing", packing_keys, ub=1.0, integer=True)
    packing = [(c, th, k, pvar[c, th, k]) for c, th, k in packing_keys]

    def add(entries, ub, lb=-np.inf):
        eq.add(entries, lb, float(ub))

    choice_rows(eq, prob.candidates)
    # group g used >= x[i] for its options; any free (not on every rank) group used; type used
    for i in range(C):
        add([(i, 1.0), (ig + grp[i], -1.0)], 0.0)
        if types[i] != DATA_PARALLEL:
            add([(i, 1.0), (ity + ctypes.index(types[i]), -1.0)], 0.0)
    for g in range(len(gkeys)):
        if not all_group[g]:
            add([(ig + g, 1.0), (ifree, -1.0)], 0.0)
    # one latency per sharding type used (the evaluator's groups), times each link phase's calls
    add([(ity + j, ft.latency) for j in range(len(ctypes))] + [(ilat, -1.0)], 0.0)
    for j in range(len(ctypes)):  # any >= type used
        add([(ity + j, 1.0), (iany, -1.0)], 0.0)
    for c in lay.time:
        # u_c: what every rank carries (shards on every rank, peers' share, and in FWD/BWD the fixed
        # cost of each TBE group that sits on every rank); z_c >= u_c + the average of the rest,
        # and the ranks holding the rest pay at least one more group's fixed cost
        ucoef = np.where(allp, own[:, c], 0.0) + n * per[:, c]
        nz = np.nonzero(ucoef)[0]
        gent = [(ig + g, -fixed[c]) for g in range(len(gkeys)) if all_group[g] and fixed[c]]
        add(list(zip(nz.tolist(), (-ucoef[nz]).tolist())) + gent + [(iu[c], 1.0)], np.inf, 0.0)
        coef = np.where(allp, 0.0, n * own[:, c] / W)
        nz = np.nonzero(coef)[0]
        add(list(zip(nz.tolist(), coef[nz].tolist())) + [(iu[c], 1.0), (ifree, fixed[c]), (iz[c], -1.0)], 0.0)
        best = []  # tables with a piece option, biggest smallest piece first
        for t, ids in enumerate(prob.candidates):
            pieces = [piece[i, c] for i in ids if not allp[i]]
            if pieces and max(pieces) > 0:
                best.append((min(pieces), t))
        best.sort(reverse=True)
        for _, t in best[:MAX_PIECE_TABLES]:
            ids = prob.candidates[t]
            # the piece's rank also pays its group's fixed cost (only when a piece is chosen)
            ent = [(i, piece[i, c] + fixed[c]) for i in ids if not allp[i]] + [(i, -own[i, c]) for i in ids if allp[i]]
            add(ent + [(iu[c], 1.0), (iz[c], -1.0)], 0.0)
    for c, th, k, v in packing:
        cnt = [(i, n[i]) for i in range(C) if not allp[i] and piece[i, c] >= th]
        big = float(sum(n[i] for i, _ in cnt))
        add(cnt + [(v, -big)], float(k * W))
        add([(iu[c], 1.0), (v, (k + 1) * th + fixed[c]), (iz[c], -1.0)], 0.0)
    link_rows(eq, sv)
    # the all-reduce runs (and pays its latency) when there are dense parameters or a chosen
    # option joins it
    allreduce = np.array([c.allreduce_bytes for c in prob.costs]) * n / W
    for entries, rhs in allreduce_rows(ft, allreduce, sv.allreduce, idp=idp):
        add(entries, rhs)
    total_memory_rows(eq, prob, n)
    step_rows(eq, sv, pipeline, ft, fwd_precision, bwd_precision,
              fused_splits=pipeline_kind(pipeline).fused_input_splits)
    res = eq.solve_milp(sv.total, {"time_limit": max(0.2, float(time_limit_s)), "disp": False,
                                   "mip_rel_gap": 1e-4})
    choice: Tuple[int, ...] = ()
    if res.x is not None:
        choice = tuple(int(max(ids, key=lambda i: res.x[i])) for ids in prob.candidates)
    b = getattr(res, "mip_dual_bound", None)
    if (b is None or not np.isfinite(b)) and res.status == 0:
        b = res.fun
    if b is None or not np.isfinite(b):
        return ChoiceBound(float("nan"), choice)
    return ChoiceBound(float(b) / MS * (1 - 1e-6), choice)
