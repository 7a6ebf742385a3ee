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

from typing import Tuple

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.batch_split import BATCH_SPLIT_PIPELINE
from torchrec_sparselift.cost.model import phase_table, step_total_batch
from torchrec_sparselift.cost.pipelines import PHASE_NAMES, exposed, step_factor
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.search.equation import (  # noqa: F401  (re-exported: one definition)
    Equation,
    FixedTerms,
    RangeRows,
    StepVars,
    allreduce_rows,
    choice_rows,
    column_scale,
    composition_rows,
    fixed_terms,
    link_rows,
    load_maxima,
    phase_forms,
    piece_loads,
    split_floor_s,
    step_rows,
    step_vars,
    total_memory_rows,
)
from torchrec_sparselift.search.problem import PlanningProblem

__all__ = ["LPResult", "solve_lp", "term_entries", "composition_rows", "analytic_bound", "RangeRows", "column_scale",
           "FixedTerms", "fixed_terms", "allreduce_rows"]

MAX_PIECE_ROWS = 4000


@attrs.frozen
class LPResult:
    lower_bound_s: float
    choice: Tuple[int, ...]  # chosen candidate id per table (argmax of x)
    x: np.ndarray = attrs.field(eq=False)
    status: str = "optimal"
    #: the choice rounded by :func:`round_choice` against the LP's column maxima (solve_lp's
    #: ``fit``; () without): the seed at scale
    fitted_choice: Tuple[int, ...] = ()


def term_entries(z, iy_in, iy_out, ia, fs, bs, dense_fwd, dense_bwd, ilat=None, step_overhead=0.0,
                 iany=None, latency=0.0, fused_splits=True, lossy=None):
    """:func:`.equation.phase_forms` with the variables given by position (``iy_in`` / ``iy_out``:
    the input's and the output's link groups, in cost.terms order), the comm precisions as byte
    scales ``fs`` / ``bs`` (each a fraction of fp32) and what those precisions add on the link
    columns, ``lossy`` (:func:`.equation.lossy_coefficients`; None: nothing)."""
    groups = [phases for phases, _ in layout().link_groups]
    sv = StepVars(z=z, link=dict(zip(groups, (iy_in, iy_out))), allreduce=ia, total=-1,
                  latency=ilat, any_group=iany)
    return phase_forms(sv, {"dense_fwd": dense_fwd, "dense_bwd": dense_bwd, "step_overhead": step_overhead},
                       {"fwd": fs, "bwd": bs}, latency=latency, fused_splits=fused_splits, lossy=lossy)


def solve_lp(
    prob: PlanningProblem,
    pipeline: str,
    fwd_precision: str = defaults.COMM_PRECISION,
    bwd_precision: str = defaults.COMM_PRECISION,
    time_limit_s: float = 30.0,
    fit: bool = False,
) -> LPResult:
    """The LP's bound and choice (module docs); ``fit``: also round it by :func:`round_choice`
    (``LPResult.fitted_choice``, the seed at scale)."""
    ctx = prob.ctx
    p = ctx.profile
    W = ctx.world_size
    lay = layout()
    nx = len(prob.cands)
    nshards = np.array([c.num_shards for c in prob.cands], dtype=float)
    owner = np.stack([c.owner for c in prob.costs]) if nx else np.zeros((0, lay.width))
    peers = np.stack([c.peers for c in prob.costs]) if nx else np.zeros((0, lay.width))
    allreduce = np.array([c.allreduce_bytes for c in prob.costs]) * nshards / W
    eq = Equation()
    eq.vector("x", nx, ub=1.0)  # x[c] is variable c
    iz = load_maxima(eq)
    sv = step_vars(eq, iz)
    # Units: milliseconds for time, link columns pre-divided by their bandwidth, GiB for memory.
    ft = fixed_terms(ctx, split=prob.split_overhead_s is not None)
    scale = column_scale(p)
    own = owner * scale[None, :]
    per = peers * scale[None, :]
    # averages: sum_x x * n * (owner/W + peers) - z_c <= 0
    for c in lay.time:
        coef = nshards * (own[:, c] / W + per[:, c])
        nz = np.nonzero(coef)[0]
        eq.add(list(zip(nz.tolist(), coef[nz].tolist())) + [(iz[c], -1.0)], -np.inf, 0.0)
    # largest pieces: for the tables with the biggest shards, sum_o x[t,o]*owner_c <= z_c (a
    # shared host link's columns hold host means: a piece adds owner_c / L there)
    own = piece_loads(own, ctx)
    for c in lay.time:
        best_piece = []
        for t, ids in enumerate(prob.candidates):
            m = min(own[i, c] for i in ids) if ids else 0.0
            if m > 0:
                best_piece.append((m, t))
        best_piece.sort(reverse=True)
        # the rank holding the piece also pays at least one TBE group's fixed cost
        fixed = ft.group_cost[c]
        for _, t in best_piece[: MAX_PIECE_ROWS // len(lay.time)]:
            ids = prob.candidates[t]
            eq.add([(i, own[i, c]) for i in ids] + [(iz[c], -1.0)], -np.inf, -fixed)
    link_rows(eq, sv)  # link phases (z already in ms): y >= z_intra, y >= z_inter
    # exposed all-reduce: a >= lat + 2(W-1)/W * (bytes + dense) / bw - dense_bwd
    for entries, rhs in allreduce_rows(ft, allreduce, sv.allreduce):
        eq.add(entries, -np.inf, rhs)
    total_memory_rows(eq, prob, nshards)  # memory, aggregated over ranks (GiB)
    # step composition (the pipeline's description, as cost.model.step_time uses it)
    step_rows(eq, sv, pipeline, ft, fwd_precision, bwd_precision)
    choice_rows(eq, prob.candidates)  # one option per table
    res = eq.solve_lp(sv.total, {"time_limit": max(1.0, time_limit_s), "presolve": True})
    if res.status not in (0, 1) or res.x is None:
        # infeasible aggregated memory means no plan can fit
        return LPResult(lower_bound_s=float("nan"), choice=(), x=np.zeros(nx), status=f"lp:{res.message}")
    x = res.x[:nx]
    choice = [int(ids[int(np.argmax(x[list(ids)]))]) for ids in prob.candidates]
    zmax = lay.zeros()  # the LP's column maxima in the evaluator's units (seconds, bytes)
    for c in lay.time:
        zmax[c] = res.x[iz[c]] / scale[c] if scale[c] else 0.0
    fitted = (round_choice(prob, x, zmax, float(x @ allreduce), pipeline, fwd_precision, bwd_precision)
              if fit else ())
    # linprog's optimum is feasible-primal; its objective is the bound (small tolerance). The
    # all-reduce row charges its latency always; a plan without dense parameters or
    # data-parallel tables has no all-reduce, so that latency is taken off the bound (the
    # composition adds the all-reduce once per path, so the optimum moves by at most that much)
    spare = 0.0 if ft.dense_allreduce else ft.latency
    bound = max(0.0, float(res.fun) - spare) / 1e3 * (1 - 1e-6)
    return LPResult(lower_bound_s=bound, choice=tuple(choice), x=x,
                    status="optimal" if res.status == 0 else "time_limit", fitted_choice=fitted)


def round_choice(prob: PlanningProblem, x: np.ndarray, zmax: np.ndarray, allreduce_bytes: float,
                 pipeline: str, fwd_precision: str, bwd_precision: str) -> Tuple[int, ...]:
    """The LP's fractional choice ``x`` rounded to one option per table against the LP's column
    maxima ``zmax`` (seconds and bytes, the evaluator's units).

    A table keeps its largest-``x`` option (ties: the lower id) when that option's single shard
    fits under ``zmax`` in every time column (``piece``: the shard's increment of its rank, with
    one TBE group's fixed cost and its peers' load). Otherwise it takes the option that raises
    the step time of ``zmax`` the least: per option ``o`` of table ``t``, column maxima
    ``max(zmax + avg_o - avg_t(x), piece_o)`` (``avg``: the load over all ranks divided by the
    ranks, ``avg_t(x)`` the table's fractional share), composed by
    :func:`~torchrec_sparselift.cost.model.step_total_batch`; ties (within 1e-9) go to the larger
    ``x``, then to the lower id.

    Why: the LP has largest-piece rows for the tables with the biggest pieces only, so for the
    others its optimum is degenerate (any option is optimal while the averages have room) and
    the plain argmax can pick an option whose one shard alone exceeds every column maximum (a
    table-wise UVM shard whose backward is tens of milliseconds). Only those tables move, one
    at a time against the same ``zmax``: re-pricing every table independently lets each take
    a little of the same slack (thousands of small moves that together overload a column)."""
    ctx = prob.ctx
    W = ctx.world_size
    lay = layout()
    nx = len(prob.cands)
    if not nx:
        return ()
    n = np.array([c.num_shards for c in prob.cands], dtype=float)
    owner = np.stack([c.owner for c in prob.costs])
    peers = np.stack([c.peers for c in prob.costs])
    time_cols = np.zeros(lay.width, dtype=bool)
    time_cols[list(lay.time)] = True
    avg = (n[:, None] * (owner / W + peers)) * time_cols[None, :]
    piece = (piece_loads(owner, ctx) + lay.group_costs(ctx.profile)[None, :] + peers) * time_cols[None, :]
    share = np.zeros((prob.num_tables, lay.width))
    tab = np.empty(nx, dtype=np.int64)
    for t, ids in enumerate(prob.candidates):
        tab[list(ids)] = t
    np.add.at(share, tab, x[:, None] * avg)
    rows = np.maximum(np.maximum(zmax[None, :] + avg - share[tab], 0.0), piece)
    groups = len({c.sharding_type for c in prob.cands})
    price = step_total_batch(rows, allreduce_bytes, groups, ctx, pipeline, fwd_precision, bwd_precision)
    fits = np.all(piece <= zmax[None, :] * (1 + 1e-6) + 1e-15, axis=1)
    out = []
    for ids in prob.candidates:
        top = max(ids, key=lambda i: (float(x[i]), -i))
        if fits[top]:
            out.append(top)
            continue
        best = min(float(price[i]) for i in ids)
        ok = [i for i in ids if price[i] <= best * (1 + 1e-9) + 1e-15]
        out.append(min(ok, key=lambda i: (-float(x[i]), i)))
    return tuple(out)


def analytic_bound(prob: PlanningProblem, pipeline: str, fwd_precision: str = defaults.COMM_PRECISION,
                   bwd_precision: str = defaults.COMM_PRECISION) -> float:
    """A lower bound without an LP: each column's maximum over ranks is at least the smallest
    possible average load and at least the biggest unavoidable single shard; the step time is
    non-decreasing in every column maximum, so composing those gives a bound (looser than the
    LP's, used when the LP cannot finish)."""
    W = prob.ctx.world_size
    lay = layout()
    time_cols = list(lay.time)
    lb = lay.zeros()
    allreduce = 0.0
    for ids in prob.candidates:
        n = np.array([prob.cands[i].num_shards for i in ids], dtype=float)
        own = np.stack([prob.costs[i].owner for i in ids])
        per = np.stack([prob.costs[i].peers for i in ids])
        avg = n[:, None] * (own / W + per)
        lb[time_cols] += avg[:, time_cols].min(axis=0)
        allreduce += min(prob.costs[i].allreduce_bytes * prob.cands[i].num_shards / W for i in ids)
    piece = lay.zeros()
    for ids in prob.candidates:
        own = piece_loads(np.stack([prob.costs[i].owner for i in ids]), prob.ctx)
        piece = np.maximum(piece, own.min(axis=0))
    if prob.candidates:  # the rank holding a piece pays at least one TBE group's fixed cost
        piece += lay.group_costs(prob.ctx.profile)
    colmax = np.maximum(lb, piece)
    step = float(step_total_batch(colmax[None, :], allreduce, 0, prob.ctx, pipeline,
                                  fwd_precision, bwd_precision)[0])
    if prob.split_overhead_s is not None and pipeline == BATCH_SPLIT_PIPELINE:  # every k: equation.split_floor_rows
        ctx = prob.ctx
        table = phase_table(colmax[None, :], allreduce, 0, ctx, fwd_precision, bwd_precision, pipeline)
        row = exposed(table, getattr(ctx.profile, "supports_overlap", True))[0]
        floor = split_floor_s(dict(zip(PHASE_NAMES, row.tolist())))
        step = min(step, min(1.0, step_factor(ctx.profile, pipeline, ctx.num_hosts > 1)) * floor)
    return step
