"""Exact MILP for a per-rank makespan objective: option choice + shard-to-rank assignment.

For objectives that are the slowest rank's summed shard time (TorchRec's ``NoopPerfModel``
rating, :mod:`.torchrec_objective`), with each candidate's shard time in the ``FWD`` column:

* ``x[c]`` binary, one candidate per table;
* free candidates (table-wise, column-wise): ``a[c, r]`` binary, ``sum_r a[c, r] = n_c x[c]``
  (distinct ranks); host candidates (table-row-wise): ``h[c, H]`` binary, ``sum_H h = x[c]``;
  all-rank candidates (row-wise, data-parallel) load every rank with ``p_c x[c]``;
* ``z >= load_r`` on every rank, per-rank device/host memory as hard rows; minimize ``z``.

Ranks are identical (same memory, same placement rules) up to hosts, so every plan can be
permuted so that hosts are sorted by their summed load and, within a host, ranks by their
free-piece load: with ``symmetry=True`` those ordering rows cut the ``W!``-fold symmetry without
cutting off an optimum (applied only where the memory limits agree; tested against brute force).
They are off by default: on the DCNv2 scenarios (8-64 ranks) they slowed HiGHS's search for
plans below the cap more than they raised its bound (dcnv2@8, 5 s: 4.023 ms with them, 3.900
without; dcnv2@64 on TorchRec's options: optimal in 0.9 s CPU with, 0.2 s without). Valid cuts from :mod:`.makespan_bound`
(``z >= U + piece`` per table, a known lower bound) tighten the relaxation; a known plan's
makespan caps ``z`` (``upper``), so HiGHS prunes everything that cannot beat it. HiGHS's dual
bound is a lower bound on every plan (also when the time limit stops it); when the cap makes the
MILP infeasible, no plan beats ``upper`` (the known plan is optimal to HiGHS's tolerance).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.model import FWD
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.search.equation import GIB, MS, Equation, choice_rows
from torchrec_sparselift.search.problem import PlanningProblem

__all__ = ["MakespanMILP", "solve_makespan_milp", "makespan_milp_size"]


@attrs.frozen
class MakespanMILP:
    """``assignment``: per table (candidate id, ranks), () when HiGHS found no plan below the
    cap; ``objective_s``: its makespan; ``bound_s``: a lower bound on every plan's makespan
    (``upper`` itself when the cap was proven unbeatable); ``status``: optimal / time_limit /
    upper_optimal (nothing beats ``upper``) / no_solution."""

    assignment: Tuple[Tuple[int, Tuple[int, ...]], ...]
    objective_s: float
    bound_s: float
    status: str


def makespan_milp_size(prob: PlanningProblem) -> int:
    """Binary variables of :func:`solve_makespan_milp` on ``prob``."""
    W = prob.ctx.world_size
    n = len(prob.cands)
    for c in prob.cands:
        if c.placement == "free":
            n += W
        elif c.placement == "host":
            n += W // c.num_shards
    return n


def _groups_equal(cap: np.ndarray, groups: Sequence[Sequence[int]]) -> bool:
    return all(np.all(cap[list(g)] == cap[g[0]]) for g in groups if len(g))


def solve_makespan_milp(prob: PlanningProblem, time_limit_s: float = 10.0, upper: Optional[float] = None,
                        lower: float = 0.0, rel_gap: float = 1e-4, memory: bool = True,
                        symmetry: bool = False) -> MakespanMILP:
    """Solve the makespan MILP of ``prob`` (see module docs). ``upper``/``lower``: seconds, a
    known plan's makespan and a known lower bound (cuts); ``memory``: keep the per-rank memory
    rows (off: a relaxation, for bounds only); ``symmetry``: the rank-ordering rows."""
    W = prob.ctx.world_size
    C = len(prob.cands)
    ms = MS
    p = np.array([c.owner[FWD] for c in prob.costs]) * ms
    n = np.array([c.num_shards for c in prob.cands], dtype=int)
    place = [c.placement for c in prob.cands]
    L = next((c.num_shards for c in prob.cands if c.placement == "host"), None)
    L = L if L else min(max(1, prob.ctx.local_world_size), W)
    if W % L:
        L = W
    hosts = [list(range(h * L, (h + 1) * L)) for h in range(W // L)]
    host_of = np.repeat(np.arange(W // L), L)

    # variables: x[c], a[c, r] / h[c, H] (placement binaries, in candidate order), the free load
    # per rank, z (the makespan)
    eq = Equation()
    eq.vector("x", C, ub=1.0, integer=True)
    keys = []
    for c in range(C):
        if place[c] == "free":
            keys.extend(("a", c, r) for r in range(W))
        elif place[c] == "host":
            if n[c] != L:
                raise ValueError(f"host candidate {c} has {n[c]} shards, a host has {L} ranks")
            keys.extend(("h", c, H) for H in range(len(hosts)))
    pvar = eq.block("place", keys, ub=1.0, integer=True)
    a_var = {(c, r): v for (kind, c, r), v in pvar.items() if kind == "a"}  # (c, r) -> var
    h_var = {(c, H): v for (kind, c, H), v in pvar.items() if kind == "h"}  # (c, H) -> var
    il = eq.vector("free_load", W)  # free load per rank
    iz = eq.var("z")

    add = eq.add
    choice_rows(eq, prob.candidates)
    free_on = [[] for _ in range(W)]
    host_on = [[] for _ in range(len(hosts))]
    for c in range(C):
        if place[c] == "free":
            add([(a_var[c, r], 1.0) for r in range(W)] + [(c, -float(n[c]))], 0.0, 0.0)
            for r in range(W):
                free_on[r].append(c)
        elif place[c] == "host":
            add([(h_var[c, H], 1.0) for H in range(len(hosts))] + [(c, -1.0)], 0.0, 0.0)
            for H in range(len(hosts)):
                host_on[H].append(c)
    allc = [c for c in range(C) if place[c] == "all" and p[c] > 0]
    U = [(c, p[c]) for c in allc]
    for r in range(W):
        add([(a_var[c, r], p[c]) for c in free_on[r] if p[c] > 0] + [(il + r, -1.0)], 0.0, 0.0)
        add([(il + r, 1.0)] + [(h_var[c, host_of[r]], p[c]) for c in host_on[host_of[r]] if p[c] > 0]
            + U + [(iz, -1.0)], -np.inf, 0.0)
    caps = []
    if memory:
        lay = layout()
        for col in lay.memory:
            cap = np.asarray(prob.device_cap if lay.columns[col].capacity == "device" else prob.host_cap, dtype=float)
            if len(cap) != W or not np.all(np.isfinite(cap)):
                continue
            m = np.array([c.owner[col] for c in prob.costs]) / GIB
            if not np.any(m):
                continue
            caps.append(cap)
            mall = [(c, m[c]) for c in range(C) if place[c] == "all" and m[c]]
            for r in range(W):
                ent = [(a_var[c, r], m[c]) for c in free_on[r] if m[c]]
                ent += [(h_var[c, host_of[r]], m[c]) for c in host_on[host_of[r]] if m[c]]
                add(ent + mall, -np.inf, float(cap[r]) / GIB)
    if symmetry:
        within = all(_groups_equal(cap, hosts) for cap in caps)
        across = within and all(np.all(cap == cap[0]) for cap in caps)
        if within:
            for g in hosts:
                for r, s in zip(g, g[1:]):
                    add([(il + r, 1.0), (il + s, -1.0)], 0.0, np.inf)
        if across:
            for H in range(len(hosts) - 1):
                ent = [(il + r, 1.0) for r in hosts[H]] + [(il + r, -1.0) for r in hosts[H + 1]]
                ent += [(h_var[c, H], L * p[c]) for c in host_on[H] if p[c] > 0]
                ent += [(h_var[c, H + 1], -L * p[c]) for c in host_on[H + 1] if p[c] > 0]
                add(ent, 0.0, np.inf)
    for ids in prob.candidates:  # z >= U + this table's piece (its own all-rank options exclude it)
        ent = [(c, p[c]) for c in ids if place[c] != "all" and p[c] > 0]
        if ent:
            add(ent + [e for e in U if e[0] not in ids] + [(iz, -1.0)], -np.inf, 0.0)
    z_lb = max(0.0, float(lower) * ms)
    eq.set_bounds(iz, lb=z_lb)
    cap_z = upper is not None and np.isfinite(upper)
    if cap_z:
        eq.set_bounds(iz, ub=max(z_lb, float(upper) * ms))
    res = eq.solve_milp(iz, {"time_limit": max(0.2, float(time_limit_s)), "disp": False,
                             "mip_rel_gap": float(rel_gap)})
    if res.x is None:
        if cap_z and res.status == 2:  # infeasible under the cap: nothing beats ``upper``
            return MakespanMILP((), float("inf"), float(upper), "upper_optimal")
        b = getattr(res, "mip_dual_bound", None)
        b = float(b) / ms if b is not None and np.isfinite(b) else float(lower)
        b = max(b, float(lower))
        return MakespanMILP((), float("inf"), min(b, float(upper)) if cap_z else b, "no_solution")
    x = res.x
    out = []
    for t, ids in enumerate(prob.candidates):
        c = max(ids, key=lambda i: x[i])
        if place[c] == "all":
            ranks = tuple(range(n[c]))
        elif place[c] == "host":
            H = max(range(len(hosts)), key=lambda h: x[h_var[c, h]])
            ranks = tuple(hosts[H])
        else:
            ranks = tuple(sorted(range(W), key=lambda r: -x[a_var[c, r]])[: n[c]])
        out.append((int(c), ranks))
    b = getattr(res, "mip_dual_bound", None)
    bound = float(b) / ms if b is not None and np.isfinite(b) else float(lower)
    obj = float(res.fun) / ms
    status = "optimal" if res.status == 0 else "time_limit"
    return MakespanMILP(tuple(out), obj, min(max(bound, float(lower)), obj), status)
