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

The step-time composition rows are the pipeline's (:func:`.lp.composition_rows`, called, not
changed), so the MILP's optimum, or HiGHS's dual bound when the time limit stops it, is a lower
bound on every plan's step time under the model, and never below the LP's (same rows, more).
"""

from __future__ import annotations

from typing import Tuple

import attrs
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from torchrec_sparselift.cost.model import (
    BWD, DEV_MEM, FWD, HOST_MEM, IN_INTER, IN_INTRA, OUT_INTER, OUT_INTRA, PRECISION_BYTES, UVM,
)
from torchrec_sparselift.cost.pipelines import pipeline_kind
from torchrec_sparselift.search.lp import (
    RangeRows, allreduce_rows, column_scale, composition_rows, fixed_terms, term_entries,
)
from torchrec_sparselift.search.problem import PlanningProblem

__all__ = ["ChoiceBound", "choice_bound", "choice_bound_solution"]

_TIME_COLS = (FWD, BWD, UVM, IN_INTRA, IN_INTER, OUT_INTRA, OUT_INTER)
MAX_PIECE_TABLES = 400
THRESHOLDS = 8
MAX_K = 4


@attrs.frozen
class ChoiceBound:
    """The integral-choice bound and the option choice at its best solution (``()`` if HiGHS
    found none): a seed for the placement, often the optimal plan's choice."""

    bound_s: float
    choice: Tuple[int, ...] = ()


def choice_bound(prob: PlanningProblem, pipeline: str, fwd_precision: str = "fp32",
                 bwd_precision: str = "fp32", time_limit_s: float = 2.0) -> float:
    """Lower bound (seconds) on the step time of every plan of ``prob`` under ``pipeline``
    (see module docs); NaN if HiGHS gives none within ``time_limit_s``."""
    return choice_bound_solution(prob, pipeline, fwd_precision, bwd_precision, time_limit_s).bound_s


def choice_bound_solution(prob: PlanningProblem, pipeline: str, fwd_precision: str = "fp32",
                          bwd_precision: str = "fp32", time_limit_s: float = 2.0) -> ChoiceBound:
    """:func:`choice_bound` with the option choice of the MILP's best solution."""
    ctx = prob.ctx
    p = ctx.profile
    W = ctx.world_size
    C = len(prob.cands)
    if C == 0:
        return ChoiceBound(float("nan"))
    ms = 1e3
    scale = column_scale(p, 9)
    own = np.stack([c.owner for c in prob.costs]) * scale[None, :]
    per = np.stack([c.peers for c in prob.costs]) * scale[None, :]
    n = np.array([c.num_shards for c in prob.cands], dtype=float)
    allp = np.array([c.placement == "all" and c.num_shards == W for c in prob.cands])
    ft = fixed_terms(ctx)
    fixed = {c: (ft.lookup if c in (FWD, BWD) else 0.0) for c in _TIME_COLS}
    # TBE groups (sharding type, kernel) as the evaluator counts them, and the collective types
    kern = [c.compute_kernel for c in prob.cands]
    types = [c.sharding_type for c in prob.cands]
    gkeys = sorted(set(zip(types, kern)))
    gid = {k: i for i, k in enumerate(gkeys)}
    grp = np.array([gid[k] for k in zip(types, kern)], dtype=int)
    all_group = np.array([bool(np.all(allp[grp == g])) for g in range(len(gkeys))])
    ctypes = sorted({t for t in types if t != "data_parallel"})
    # variables: x[C], z[7], u[7], y_in, y_out, a, tot, group used[G], free group used, type
    # used[T], latency, packing binaries
    iz = {c: C + i for i, c in enumerate(_TIME_COLS)}
    iu = {c: C + 7 + i for i, c in enumerate(_TIME_COLS)}
    iy_in, iy_out, ia, itot = C + 14, C + 15, C + 16, C + 17
    ig = C + 18
    ifree = ig + len(gkeys)
    ity = ifree + 1
    ilat = ity + len(ctypes)
    idp = ilat + 1  # any option that joins the gradient all-reduce chosen
    iany = idp + 1  # any sharding type used (the input's shared splits all-to-all)
    nv = iany + 1
    packing = []  # (col, theta, k, var)
    for c in _TIME_COLS:
        sizes = np.unique(own[~allp, c][own[~allp, c] > 0])[::-1]
        if not len(sizes):
            continue
        sel = sizes[np.unique(np.geomspace(1, len(sizes), min(THRESHOLDS, len(sizes))).astype(int) - 1)]
        for th in sel:
            cnt_max = sum(max((n[i] for i in ids if not allp[i] and own[i, c] >= th), default=0.0)
                          for ids in prob.candidates)
            for k in range(1, MAX_K + 1):
                if k * W + 1 > cnt_max:
                    break
                packing.append((c, float(th), k, nv))
                nv += 1
    gib = 2.0**30
    rr = RangeRows()

    def add(entries, ub, lb=-np.inf):
        rr.add(entries, lb, float(ub))

    for ids in prob.candidates:
        add([(i, 1.0) for i in ids], 1.0, 1.0)
    # group g used >= x[i] for its options; any free (not on every rank) group used; type used
    for i in range(C):
        add([(i, 1.0), (ig + grp[i], -1.0)], 0.0)
        if types[i] != "data_parallel":
            add([(i, 1.0), (ity + ctypes.index(types[i]), -1.0)], 0.0)
    for g in range(len(gkeys)):
        if not all_group[g]:
            add([(ig + g, 1.0), (ifree, -1.0)], 0.0)
    # one latency per sharding type used (the evaluator's groups), times each link phase's calls
    add([(ity + j, ft.latency) for j in range(len(ctypes))] + [(ilat, -1.0)], 0.0)
    for j in range(len(ctypes)):  # any >= type used
        add([(ity + j, 1.0), (iany, -1.0)], 0.0)
    for c in _TIME_COLS:
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
            pieces = [own[i, c] for i in ids if not allp[i]]
            if pieces and max(pieces) > 0:
                best.append((min(pieces), t))
        best.sort(reverse=True)
        for _, t in best[:MAX_PIECE_TABLES]:
            ids = prob.candidates[t]
            # the piece's rank also pays its group's fixed cost (only when a piece is chosen)
            ent = [(i, own[i, c] + fixed[c]) for i in ids if not allp[i]] + [(i, -own[i, c]) for i in ids if allp[i]]
            add(ent + [(iu[c], 1.0), (iz[c], -1.0)], 0.0)
    for c, th, k, v in packing:
        cnt = [(i, n[i]) for i in range(C) if not allp[i] and own[i, c] >= th]
        big = float(sum(n[i] for i, _ in cnt))
        add(cnt + [(v, -big)], float(k * W))
        add([(iu[c], 1.0), (v, (k + 1) * th + fixed[c]), (iz[c], -1.0)], 0.0)
    for iy, ci, ce in ((iy_in, IN_INTRA, IN_INTER), (iy_out, OUT_INTRA, OUT_INTER)):
        add([(iz[ci], 1.0), (iy, -1.0)], 0.0)
        add([(iz[ce], 1.0), (iy, -1.0)], 0.0)
    # the all-reduce runs (and pays its latency) when there are dense parameters or a chosen
    # option joins it
    allreduce = np.array([c.allreduce_bytes for c in prob.costs]) * n / W
    for entries, rhs in allreduce_rows(ft, allreduce, ia, idp=idp):
        add(entries, rhs)
    for col, cap in ((DEV_MEM, prob.device_cap), (HOST_MEM, prob.host_cap)):
        coef = n * np.array([c.owner[col] for c in prob.costs]) / gib
        nz = np.nonzero(coef)[0]
        if len(nz) and np.all(np.isfinite(cap)):
            add(list(zip(nz.tolist(), coef[nz].tolist())), float(np.sum(cap)) / gib)
    forms = term_entries(iz, iy_in, iy_out, ia, PRECISION_BYTES[fwd_precision] / 4,
                         PRECISION_BYTES[bwd_precision] / 4, ft.dense_fwd, ft.dense_bwd, ilat=ilat,
                         step_overhead=ft.step_overhead, iany=iany, latency=ft.latency,
                         fused_splits=pipeline_kind(pipeline).fused_input_splits)
    for entries, rhs in composition_rows(pipeline, forms, itot, ft.overlap):
        add(entries, rhs)
    A = rr.matrix(nv)
    cvec = np.zeros(nv)
    cvec[itot] = 1.0
    integrality = np.zeros(nv)
    integrality[:C] = 1
    ub = np.full(nv, np.inf)
    ub[:C] = 1.0
    for _, _, _, v in packing:
        integrality[v] = 1
        ub[v] = 1.0
    res = milp(cvec, constraints=LinearConstraint(A, rr.lo, rr.hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub),
               options={"time_limit": max(0.2, float(time_limit_s)), "disp": False, "mip_rel_gap": 1e-4})
    choice: Tuple[int, ...] = ()
    if res.x is not None:
        choice = tuple(int(max(ids, key=lambda i: res.x[i])) for ids in prob.candidates)
    b = getattr(res, "mip_dual_bound", None)
    if (b is None or not np.isfinite(b)) and res.status == 0:
        b = res.fun
    if b is None or not np.isfinite(b):
        return ChoiceBound(float("nan"), choice)
    return ChoiceBound(float(b) / ms * (1 - 1e-6), choice)
