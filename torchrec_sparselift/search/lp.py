"""LP relaxation over aggregated per-rank loads: option choice and a lower bound.

Any integral plan's per-rank maximum of each load column is at least (a) the average over ranks
and (b) the largest single shard. Writing the step-time composition of the chosen pipeline with
those two facts as linear constraints, over fractional option choices ``x[t, o]`` (one option per
table, ``sum_o x[t, o] = 1``), gives a linear program whose optimum is a **lower bound** on the
step time of every plan under the same cost model (the composition's rows come from the
pipeline's description in :mod:`torchrec_sparselift.cost.pipelines`). Its (rounded) solution is also an excellent
option choice: it trades compute balance against communication volume globally instead of one
table at a time. This is the DESIGN's decomposition: choose options on aggregated loads, then
place shards.
"""

from __future__ import annotations

from typing import List, Tuple

import attrs
import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from torchrec_sparselift.cost.model import (
    BWD,
    DEV_MEM,
    FWD,
    HOST_MEM,
    IN_INTER,
    IN_INTRA,
    OUT_INTER,
    OUT_INTRA,
    PRECISION_BYTES,
    UVM,
    collective_call_form,
    dense_fwd_s,
    step_total_batch,
)
from torchrec_sparselift.cost.pipelines import effective_pipeline, paths
from torchrec_sparselift.search.problem import PlanningProblem

__all__ = ["LPResult", "solve_lp", "term_entries", "composition_rows", "analytic_bound", "RangeRows", "column_scale",
           "FixedTerms", "fixed_terms", "allreduce_rows"]

_TIME_COLS = (FWD, BWD, UVM, IN_INTRA, IN_INTER, OUT_INTRA, OUT_INTER)
MAX_PIECE_ROWS = 4000


def column_scale(profile, ncols: int) -> np.ndarray:
    """Per cost column, the factor from the cost vectors to the LP/MILP units: milliseconds for
    time, the link columns pre-divided by their bandwidth (HiGHS drops matrix coefficients below
    ~1e-9, so raw bytes / bandwidth would vanish). One definition for the LP, the MILP and the
    integral-choice bound."""
    ms = 1e3
    scale = np.ones(ncols) * ms
    scale[[IN_INTRA, OUT_INTRA]] = ms / profile.intra_host_bw
    scale[[IN_INTER, OUT_INTER]] = ms / profile.inter_host_bw
    return scale


@attrs.frozen
class FixedTerms:
    """The step time's constants in the LP/MILP units (milliseconds), one definition for the LP,
    the MILP and the integral-choice bound (the evaluator's are :func:`cost.model.phase_table`'s):
    ``dense_fwd`` / ``dense_bwd`` (twice the forward), ``step_overhead``, ``lookup`` (one TBE
    group's fixed cost, forward and backward columns), ``latency`` (one collective call; 0 on one
    rank), ``allreduce_per_byte`` (ring all-reduce, ``2 (W-1)/W / allreduce_bw``),
    ``dense_param_bytes``, ``hidden`` (what the dense backward hides of the all-reduce: 0 without
    overlap, pipelines.terms) and ``overlap``. Build it with :func:`fixed_terms`."""

    world_size: int
    dense_fwd: float
    dense_bwd: float
    step_overhead: float
    lookup: float
    latency: float
    allreduce_per_byte: float
    dense_param_bytes: float
    hidden: float
    overlap: bool

    @property
    def dense_allreduce(self) -> bool:
        """Dense parameters exist, so the all-reduce (and its latency) runs in every plan."""
        return self.dense_param_bytes > 0

    def allreduce_const(self, with_latency: bool) -> float:
        """The all-reduce row's constant: the dense parameters' ring time less ``hidden``, plus one
        latency when ``with_latency``."""
        return ((self.latency if with_latency else 0.0)
                + self.allreduce_per_byte * self.dense_param_bytes) - self.hidden


def fixed_terms(ctx) -> FixedTerms:
    """:class:`FixedTerms` of a :class:`~torchrec_sparselift.cost.model.CostContext`."""
    ms = 1e3
    p = ctx.profile
    W = ctx.world_size
    dense_fwd = ms * dense_fwd_s(ctx)
    dense_bwd = 2 * dense_fwd
    overlap = bool(getattr(p, "supports_overlap", True))
    return FixedTerms(
        world_size=W, dense_fwd=dense_fwd, dense_bwd=dense_bwd,
        step_overhead=ms * p.step_overhead_s, lookup=ms * p.lookup_overhead_s,
        latency=ms * p.collective_latency_s if W > 1 else 0.0,
        allreduce_per_byte=ms * 2 * (W - 1) / W / p.allreduce_bw,
        dense_param_bytes=float(ctx.dense.param_bytes),
        hidden=dense_bwd if overlap else 0.0, overlap=overlap,
    )


def allreduce_rows(fixed: FixedTerms, allreduce: np.ndarray, ia: int, idp=None):
    """Rows ``(entries, ub)``, each ``sum(entries) <= ub``, that make variable ``ia`` >= the
    exposed all-reduce (ms): ``sum_c allreduce_per_byte * allreduce[c] x_c + allreduce_const``,
    ``allreduce[c]`` the bytes option ``c`` (variable ``c``) adds per rank. Its latency is in the
    constant when there are dense parameters; otherwise, with ``idp`` (a binary every option in
    the all-reduce forces to 1) it is charged through ``idp``, and without (the LP) always, which
    the LP takes off its bound. No rows on one rank."""
    if fixed.world_size <= 1:
        return []
    k = fixed.allreduce_per_byte
    nz = np.nonzero(allreduce)[0]
    rows = []
    lat_ent = []
    if idp is not None and not fixed.dense_allreduce:
        lat_ent = [(idp, fixed.latency)]
        rows.extend(([(int(i), 1.0), (idp, -1.0)], 0.0) for i in nz)
    const = fixed.allreduce_const(with_latency=idp is None or fixed.dense_allreduce)
    rows.append(([(int(i), k * allreduce[i]) for i in nz] + lat_ent + [(ia, -1.0)], -const))
    return rows


@attrs.frozen
class LPResult:
    lower_bound_s: float
    choice: Tuple[int, ...]  # chosen candidate id per table (argmax of x)
    x: np.ndarray = attrs.field(eq=False)
    status: str = "optimal"


class RangeRows:
    """Sparse constraint rows ``lb <= sum_j v x_j <= ub`` for ``scipy.optimize.milp``: ``add``
    one row (zero coefficients dropped), then ``matrix(nv)`` with ``lo``/``hi`` for
    ``LinearConstraint``."""

    def __init__(self) -> None:
        self.rows: List[int] = []
        self.cols: List[int] = []
        self.vals: List[float] = []
        self.lo: List[float] = []
        self.hi: List[float] = []

    def add(self, entries, lb, ub) -> None:
        r = len(self.lo)
        for j, v in entries:
            if v != 0.0:
                self.rows.append(r)
                self.cols.append(int(j))
                self.vals.append(float(v))
        self.lo.append(lb)
        self.hi.append(ub)

    def matrix(self, nv: int):
        return coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), nv)).tocsr()


def term_entries(z, iy_in, iy_out, ia, fs, bs, dense_fwd, dense_bwd, ilat=None, step_overhead=0.0,
                 iany=None, latency=0.0, fused_splits=True):
    """Each phase of :data:`~torchrec_sparselift.cost.pipelines.PHASES` as a linear form in the
    LP's variables (milliseconds): ``{phase: (entries, constant)}``. ``z``: column-maximum
    variables, ``iy_in`` / ``iy_out``: link-time variables, ``ia``: the exposed all-reduce,
    ``fs`` / ``bs``: forward / backward comm precision scale, ``ilat``: optional variable
    holding one latency per sharding group (``latency * groups``), ``iany``: optional binary that
    is 1 when any sharding group is used, with ``latency`` one collective's (ms);
    ``fused_splits``: the pipeline's ``PipelineKind.fused_input_splits``. Each link phase pays its
    calls' latencies in the form :func:`torchrec_sparselift.cost.model.collective_call_form` gives
    (``per_group * ilat + once * latency * iany``)."""

    def lat(phase):
        if ilat is None:
            return []
        per_group, once = collective_call_form(phase, fused_splits)
        out = [(ilat, float(per_group))]
        if once and iany is not None and latency:
            out.append((iany, latency * once))
        return out

    return {
        "input_dist": ([(iy_in, 1.0)] + lat("input_dist"), 0.0),
        "uvm_fetch": ([(z[UVM], 1.0)], 0.0),
        "lookup": ([(z[FWD], 1.0)], 0.0),
        "output_dist": ([(iy_out, fs)] + lat("output_dist"), 0.0),
        "dense_fwd": ([], dense_fwd),
        "dense_bwd": ([], dense_bwd),
        "grad_dist": ([(iy_out, bs)] + lat("grad_dist"), 0.0),
        "backward_update": ([(z[BWD], 1.0)], 0.0),
        "allreduce": ([(ia, 1.0)], 0.0),
        "step_overhead": ([], step_overhead),
    }


def composition_rows(pl, forms, itot, supports_overlap=True):
    """``A_ub`` rows ``(entries, rhs)`` that make variable ``itot`` >= the step time of pipeline
    ``pl``: one row ``sum(path) - total <= -constants`` per path of its composition
    (:func:`torchrec_sparselift.cost.pipelines.paths`), ``forms`` from :func:`term_entries`."""
    kind = effective_pipeline(pl, supports_overlap)
    out = []
    for path in paths(kind.step):
        entries, const = [], 0.0
        for t in path:
            e, c = forms[t]
            entries.extend(e)
            const += c
        out.append((entries + [(itot, -1.0)], -const))
    return out


def solve_lp(
    prob: PlanningProblem,
    pipeline: str,
    fwd_precision: str = "fp32",
    bwd_precision: str = "fp32",
    time_limit_s: float = 30.0,
) -> LPResult:
    ctx = prob.ctx
    p = ctx.profile
    W = ctx.world_size
    nx = len(prob.cands)
    nshards = np.array([c.num_shards for c in prob.cands], dtype=float)
    owner = np.stack([c.owner for c in prob.costs]) if nx else np.zeros((0, 9))
    peers = np.stack([c.peers for c in prob.costs]) if nx else np.zeros((0, 9))
    allreduce = np.array([c.allreduce_bytes for c in prob.costs]) * nshards / W
    # variable layout: x[0:nx], z[7], y_in, y_out, a (exposed all-reduce), total
    iz = {c: nx + i for i, c in enumerate(_TIME_COLS)}
    iy_in, iy_out, ia, itot = nx + 7, nx + 8, nx + 9, nx + 10
    nv = nx + 11
    rows: List[int] = []
    cols: List[int] = []
    vals: List[float] = []
    b_ub: List[float] = []
    r = 0

    def add_row(entries, rhs):
        nonlocal r
        for j, v in entries:
            if v != 0.0:
                rows.append(r)
                cols.append(j)
                vals.append(float(v))
        b_ub.append(float(rhs))
        r += 1

    # Units: milliseconds for time, link columns pre-divided by their bandwidth, GiB for memory
    # (HiGHS drops matrix coefficients below ~1e-9, so raw bytes/bandwidth would vanish).
    ft = fixed_terms(ctx)
    scale = column_scale(p, owner.shape[1])
    own = owner * scale[None, :]
    per = peers * scale[None, :]
    # averages: sum_x x * n * (owner/W + peers) - z_c <= 0
    for c in _TIME_COLS:
        coef = nshards * (own[:, c] / W + per[:, c])
        nz = np.nonzero(coef)[0]
        add_row(list(zip(nz.tolist(), coef[nz].tolist())) + [(iz[c], -1.0)], 0.0)
    # largest pieces: for the tables with the biggest shards, sum_o x[t,o]*owner_c <= z_c
    for c in _TIME_COLS:
        best_piece = []
        for t, ids in enumerate(prob.candidates):
            m = min(own[i, c] for i in ids) if ids else 0.0
            if m > 0:
                best_piece.append((m, t))
        best_piece.sort(reverse=True)
        # the rank holding the piece also pays at least one TBE group's fixed cost
        fixed = ft.lookup if c in (FWD, BWD) else 0.0
        for _, t in best_piece[: MAX_PIECE_ROWS // len(_TIME_COLS)]:
            ids = prob.candidates[t]
            add_row([(i, own[i, c]) for i in ids] + [(iz[c], -1.0)], -fixed)
    # link phases (z already in ms): y >= z_intra, y >= z_inter
    for iy, ci, ce in ((iy_in, IN_INTRA, IN_INTER), (iy_out, OUT_INTRA, OUT_INTER)):
        add_row([(iz[ci], 1.0), (iy, -1.0)], 0.0)
        add_row([(iz[ce], 1.0), (iy, -1.0)], 0.0)
    # exposed all-reduce: a >= lat + 2(W-1)/W * (bytes + dense) / bw - dense_bwd
    for entries, rhs in allreduce_rows(ft, allreduce, ia):
        add_row(entries, rhs)
    # memory, aggregated over ranks (GiB)
    gib = 2.0**30
    for col, cap in ((DEV_MEM, prob.device_cap), (HOST_MEM, prob.host_cap)):
        coef = nshards * owner[:, col] / gib
        nz = np.nonzero(coef)[0]
        if len(nz) and np.all(np.isfinite(cap)):
            add_row(list(zip(nz.tolist(), coef[nz].tolist())), float(np.sum(cap)) / gib)
    # step composition (the pipeline's description, as cost.model.step_time uses it)
    forms = term_entries(iz, iy_in, iy_out, ia, PRECISION_BYTES[fwd_precision] / 4,
                         PRECISION_BYTES[bwd_precision] / 4, ft.dense_fwd, ft.dense_bwd,
                         step_overhead=ft.step_overhead)
    for entries, rhs in composition_rows(pipeline, forms, itot, ft.overlap):
        add_row(entries, rhs)
    A_ub = coo_matrix((vals, (rows, cols)), shape=(r, nv)).tocsr()
    # one option per table
    er, ec = [], []
    for t, ids in enumerate(prob.candidates):
        er.extend([t] * len(ids))
        ec.extend(ids)
    A_eq = coo_matrix((np.ones(len(er)), (er, ec)), shape=(len(prob.candidates), nv)).tocsr()
    b_eq = np.ones(len(prob.candidates))
    cvec = np.zeros(nv)
    cvec[itot] = 1.0
    bounds = [(0.0, 1.0)] * nx + [(0.0, None)] * (nv - nx)
    res = linprog(
        cvec, A_ub=A_ub, b_ub=np.array(b_ub), A_eq=A_eq, b_eq=b_eq, bounds=bounds,
        method="highs", options={"time_limit": max(1.0, time_limit_s), "presolve": True},
    )
    if res.status not in (0, 1) or res.x is None:
        # infeasible aggregated memory means no plan can fit
        return LPResult(lower_bound_s=float("nan"), choice=(), x=np.zeros(nx), status=f"lp:{res.message}")
    x = res.x[:nx]
    choice = []
    for ids in prob.candidates:
        vals_t = x[list(ids)]
        choice.append(int(ids[int(np.argmax(vals_t))]))
    # linprog's optimum is feasible-primal; its objective is the bound (small tolerance). The
    # all-reduce row charges its latency always; a plan without dense parameters or
    # data-parallel tables has no all-reduce, so that latency is taken off the bound (the
    # composition adds the all-reduce once per path, so the optimum moves by at most that much)
    spare = 0.0 if ft.dense_allreduce else ft.latency
    bound = max(0.0, float(res.fun) - spare) / 1e3 * (1 - 1e-6)
    return LPResult(lower_bound_s=bound, choice=tuple(choice), x=x,
                    status="optimal" if res.status == 0 else "time_limit")


def analytic_bound(prob: PlanningProblem, pipeline: str, fwd_precision: str = "fp32",
                   bwd_precision: str = "fp32") -> float:
    """A lower bound without an LP: each column's maximum over ranks is at least the smallest
    possible average load and at least the biggest unavoidable single shard; the step time is
    non-decreasing in every column maximum, so composing those gives a bound (looser than the
    LP's, used when the LP cannot finish)."""
    W = prob.ctx.world_size
    lb = np.zeros(9)
    allreduce = 0.0
    for ids in prob.candidates:
        n = np.array([prob.cands[i].num_shards for i in ids], dtype=float)
        own = np.stack([prob.costs[i].owner for i in ids])
        per = np.stack([prob.costs[i].peers for i in ids])
        avg = n[:, None] * (own / W + per)
        lb[list(_TIME_COLS)] += avg[:, list(_TIME_COLS)].min(axis=0)
        allreduce += min(prob.costs[i].allreduce_bytes * prob.cands[i].num_shards / W for i in ids)
    piece = np.zeros(9)
    for ids in prob.candidates:
        own = np.stack([prob.costs[i].owner for i in ids])
        piece = np.maximum(piece, own.min(axis=0))
    if prob.candidates:  # the rank holding a piece pays at least one TBE group's fixed cost
        piece[FWD] += prob.ctx.profile.lookup_overhead_s
        piece[BWD] += prob.ctx.profile.lookup_overhead_s
    colmax = np.maximum(lb, piece)
    return float(step_total_batch(colmax[None, :], allreduce, 0, prob.ctx, pipeline,
                                  fwd_precision, bwd_precision)[0])
