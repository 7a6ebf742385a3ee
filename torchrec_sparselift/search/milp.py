"""Exact MILP over option choice *and* shard placement, for small and medium instances.

Variables (HiGHS via ``scipy.optimize.milp``): ``x[c]`` binary, one candidate per table;
``n[c, r]`` binary, a shard of free-placement candidate ``c`` on rank ``r`` (``sum_r n = k x``);
``h[c, host]`` binary, host of a host-placement candidate; ``z_j`` the maximum over ranks of
column ``j``'s load (in ms, links divided by their bandwidth) plus the peers' uniform share;
the link, all-reduce and composition variables and rows of the step equation (:mod:`.equation`).
Per-rank device/host memory is a hard constraint. Objective: the pipeline's step time, including each link phase's collective latencies per
sharding-type group (binary ``g[type]``; ``cost.model.collective_calls``: two in the input, one
in the output and gradient, and the input's shared splits call when any group is used). The MILP's dual bound is a valid lower bound of the step time
under the model.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.pipelines import pipeline_kind
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.search.equation import (
    GIB, MS, Equation, allreduce_rows, column_scale, fixed_terms, link_rows, load_maxima, rank_load_rows,
    step_rows, step_vars,
)
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["MILPResult", "solve_milp", "milp_size", "placement_vars", "choice_and_placement_rows"]


@attrs.frozen
class MILPResult:
    assignment: Tuple[Tuple[int, Tuple[int, ...]], ...]  # per table (candidate, ranks); () if none
    objective_s: float
    bound_s: float
    status: str


def milp_size(prob: PlanningProblem) -> int:
    """Number of placement variables the MILP would have."""
    W = prob.ctx.world_size
    n = 0
    for c in prob.cands:
        n += W if c.placement == "free" else (W // c.num_shards if c.placement == "host" else 0)
    return n + len(prob.cands)


def placement_vars(prob: PlanningProblem, first) -> Tuple[List[Tuple[int, int, List[int]]], int]:
    """The placement binaries: ``(var, cand, ranks it loads)`` for every rank of a free candidate
    and every host of a host candidate; and the next free index. ``first``: an :class:`Equation`
    (they are declared on it as ``place[c, ranks]``) or the first free index."""
    W = prob.ctx.world_size
    keys: List[Tuple[int, Tuple[int, ...]]] = []
    for c, cand in enumerate(prob.cands):
        if cand.placement == "free":
            keys.extend((c, (r,)) for r in range(W))
        elif cand.placement == "host":
            L = cand.num_shards
            keys.extend((c, tuple(range(h * L, (h + 1) * L))) for h in range(W // L))
    if isinstance(first, Equation):
        idx = first.block("place", keys, ub=1.0, integer=True)
        return [(idx[k], k[0], list(k[1])) for k in keys], first.nv
    return [(first + i, c, list(rk)) for i, (c, rk) in enumerate(keys)], first + len(keys)


def choice_and_placement_rows(prob: PlanningProblem, place: List[Tuple[int, int, List[int]]],
                              add) -> List[List[Tuple[int, int]]]:
    """Add the rows every placement MILP shares (one candidate per table, ``x[c] = 1`` on
    ``prob.candidates``; free: ``sum_r n[c,r] = k x[c]``; host: ``sum_h h[c,h] = x[c]``) and return
    each rank's ``(var, cand)`` load terms (replicated candidates load ranks ``0..k-1`` by ``x``)."""
    for ids in prob.candidates:
        add([(c, 1.0) for c in ids], 1.0, 1.0)
    by_cand: dict = {}
    for v, c, _rk in place:
        by_cand.setdefault(c, []).append(v)
    for c, vs in by_cand.items():
        k = prob.cands[c].num_shards if prob.cands[c].placement == "free" else 1
        add([(v, 1.0) for v in vs] + [(c, -float(k))], 0.0, 0.0)
    rank_terms: List[List[Tuple[int, int]]] = [[] for _ in range(prob.ctx.world_size)]
    for v, c, rk in place:
        for r in rk:
            rank_terms[r].append((v, c))
    for c, cand in enumerate(prob.cands):
        if cand.placement == "all":
            for r in range(cand.num_shards):
                rank_terms[r].append((c, c))
    return rank_terms


def solve_milp(prob: PlanningProblem, pipeline: str, fwd: str = defaults.COMM_PRECISION, bwd: str = defaults.COMM_PRECISION,
               time_limit_s: float = 10.0, node_limit: Optional[int] = None) -> MILPResult:
    """Solve the MILP. ``node_limit`` (branch-and-bound nodes) makes a limited search
    deterministic; ``time_limit_s`` is a wall-clock safety net."""
    ctx = prob.ctx
    p = ctx.profile
    W = ctx.world_size
    C = len(prob.cands)
    lay = layout()
    ft = fixed_terms(ctx, split=prob.split_overhead_s is not None)
    scale = column_scale(p)
    owner = np.stack([c.owner for c in prob.costs]) * scale[None, :]
    peers = np.stack([c.peers for c in prob.costs]) * scale[None, :]
    mem_cols = [lay.capacity_column("device"), lay.capacity_column("host")]
    mem = np.stack([c.owner for c in prob.costs])[:, mem_cols] / GIB
    nshards = np.array([c.num_shards for c in prob.cands], dtype=float)

    # variables: x[c] (one candidate per table), placement, the step equation's, ...
    eq = Equation()
    eq.vector("x", C, ub=1.0, integer=True)
    place, _ = placement_vars(prob, eq)
    iz = load_maxima(eq)
    sv = step_vars(eq, iz)
    idp = eq.var("dp_used")  # an option that joins the gradient all-reduce is chosen
    # one binary per sharding type used (collective groups) and the per-phase latency
    types = sorted({c.sharding_type for c in prob.cands if c.sharding_type != DATA_PARALLEL})
    ig = eq.block("type_used", types, ub=1.0, integer=True)
    sv = attrs.evolve(sv, latency=eq.var("latency"),
                      any_group=eq.var("any_group"))  # any sharding group used (the input's shared splits all-to-all)
    add = eq.add

    rank_terms = choice_and_placement_rows(prob, place, add)
    # per-rank loads
    uniform = {j: [(c, nshards[c] * peers[c, j]) for c in range(C) if peers[c, j] != 0] for j in lay.time}
    for j in lay.time:  # each rank's (a shared host link's columns: each host's mean) load
        for ranks, weight in rank_load_rows(ctx, j):
            coef: dict = {}
            for r in ranks:
                for v, c in rank_terms[r]:
                    if owner[c, j] != 0:
                        coef[v] = coef.get(v, 0.0) + weight * owner[c, j]
            if coef:
                add(list(coef.items()) + uniform[j] + [(iz[j], -1.0)], -np.inf, 0.0)
    for r in range(W):
        for m, cap in ((0, prob.device_cap[r]), (1, prob.host_cap[r])):
            if np.isfinite(cap):
                ent = [(v, mem[c, m]) for v, c in rank_terms[r] if mem[c, m] != 0]
                if ent:
                    add(ent, -np.inf, float(cap) / GIB)
    for j in lay.time:  # z_j >= uniform even on a rank with nothing
        add(uniform[j] + [(iz[j], -1.0)], -np.inf, 0.0)
    link_rows(eq, sv)
    # the all-reduce (and its latency) runs only with dense parameters or a chosen option in it
    allreduce = np.array([c.allreduce_bytes for c in prob.costs]) * nshards / W
    for ent, rhs in allreduce_rows(ft, allreduce, sv.allreduce, idp=idp):
        add(ent, -np.inf, rhs)
    for c, cand in enumerate(prob.cands):  # g_type >= x[c]
        if cand.sharding_type in ig:
            add([(c, 1.0), (ig[cand.sharding_type], -1.0)], -np.inf, 0.0)
    add([(ig[st], ft.latency) for st in types] + [(sv.latency, -1.0)], -np.inf, 0.0)
    for st in types:  # any >= g_type
        add([(ig[st], 1.0), (sv.any_group, -1.0)], -np.inf, 0.0)
    step_rows(eq, sv, pipeline, ft, fwd, bwd, fused_splits=pipeline_kind(pipeline).fused_input_splits)

    res = eq.solve_milp(sv.total, {"time_limit": max(0.5, time_limit_s), "disp": False, "mip_rel_gap": 1e-4,
                                   **({"node_limit": int(node_limit)} if node_limit is not None else {})})
    bound = getattr(res, "mip_dual_bound", None)
    bound_s = float(bound) / MS if bound is not None and np.isfinite(bound) else float("nan")
    if res.x is None:
        return MILPResult(assignment=(), objective_s=float("inf"), bound_s=bound_s,
                          status=f"no solution ({res.message})")
    x = res.x
    assignment = []
    for t, ids in enumerate(prob.candidates):
        c = max(ids, key=lambda i: x[i])
        cand = prob.cands[c]
        if cand.placement == "all":
            ranks = tuple(range(cand.num_shards))
        else:
            chosen = [rk for v, cc, rk in place if cc == c and x[v] > 0.5]
            ranks = tuple(r for rk in chosen for r in rk)
        assignment.append((c, ranks))
    status = "optimal" if res.status == 0 else "time_limit"
    return MILPResult(assignment=tuple(assignment), objective_s=float(res.fun) / MS,
                      bound_s=bound_s, status=status)
