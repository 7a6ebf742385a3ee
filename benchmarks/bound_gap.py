"""Is it the plan or the bound? Offline check of the gap under SparseLift's own model.

Run::

    python -m benchmarks.bound_gap --scenarios dcnv2@8,dcnv2@16,kaggle@8 --limit 60

Per scenario (inputs of :mod:`benchmarks.planners`: meta module, 80 GiB GPUs, 8 per host, h100
profile, default 8 s budget) it plans with ``SparseLiftPlanner`` and then, offline and with
``--limit`` seconds each:

1. ``lp``: the LP bound (:func:`torchrec_sparselift.search.lp.solve_lp`);
2. ``choice``: the integral-choice bound (:mod:`torchrec_sparselift.search.choice_bound`) run to
   optimality or the limit;
3. ``placement``: an exact MILP of the evaluator's cost model (option choice + placement + one TBE
   fixed cost per rank and (sharding type, kernel) group + one collective latency per sharding
   type + the pipeline's composition rows, symmetry broken over identical ranks) restricted to
   the choice bound's options: the best plan with that choice, proven when ``status`` is 0;
4. ``exact`` (``--exact``): the same MILP over every option: the true optimum when it finishes,
   else its incumbent and dual bound.

The plan is at fault when a better plan is found (``placement``/``exact`` below the plan); the
bound is at fault when the plan is proven optimal for the bound's choice but the bound stays
below. Results are printed as JSON lines (and written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Dict, List, Optional, Sequence

import attrs
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from benchmarks import planners as B
from benchmarks.harness import write_report
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.cost.model import (
    BWD, DEV_MEM, FWD, HOST_MEM, IN_INTER, IN_INTRA, OUT_INTER, OUT_INTRA, PRECISION_BYTES, UVM,
)
from torchrec_sparselift.search.choice_bound import choice_bound_solution
from torchrec_sparselift.search.lp import (
    RangeRows, allreduce_rows, column_scale, composition_rows, fixed_terms, solve_lp, term_entries,
)
from torchrec_sparselift.search.milp import choice_and_placement_rows, placement_vars
from torchrec_sparselift.search.solve import new_evaluator

_T7 = (FWD, BWD, UVM, IN_INTRA, IN_INTER, OUT_INTRA, OUT_INTER)


def exact(prob, pipeline, fwd="fp32", bwd="fp32", time_limit=60.0, sym=True):
    """Exact MILP of the evaluator's objective for ``prob`` under ``pipeline`` (see module docs):
    ``obj_ms`` (HiGHS's incumbent), ``eval_ms`` (that plan priced by the evaluator: equal when
    the model is exact), ``bound_ms`` (dual bound), ``status`` (0: optimal)."""
    ctx = prob.ctx; p = ctx.profile; W = ctx.world_size; L = min(ctx.local_world_size, W); H = W // L
    C = len(prob.cands)
    ft = fixed_terms(ctx)
    scale = column_scale(p, 9)
    own = np.stack([c.owner for c in prob.costs]) * scale
    per = np.stack([c.peers for c in prob.costs]) * scale
    mem = np.stack([c.owner for c in prob.costs])[:, [DEV_MEM, HOST_MEM]] / 2.0**30
    n = np.array([c.num_shards for c in prob.cands], float)
    kern = [c.compute_kernel for c in prob.cands]; types = [c.sharding_type for c in prob.cands]
    keys = sorted(set(zip(types, kern))); gid = {k: i for i, k in enumerate(keys)}; G = len(keys)
    grp = [gid[k] for k in zip(types, kern)]
    ovh = ft.lookup
    place, nv = placement_vars(prob, C)
    io = nv; nv += W * G   # o[r,g]
    iz = {j: nv + i for i, j in enumerate(_T7)}; nv += 7
    iy_in, iy_out, ia, itot = nv, nv + 1, nv + 2, nv + 3; nv += 4
    st_types = sorted({t for t in types if t != "data_parallel"})
    ig = {s: nv + i for i, s in enumerate(st_types)}; nv += len(st_types)
    ilat = nv; nv += 1
    idp = nv; nv += 1  # an option in the gradient all-reduce is chosen
    rr = RangeRows(); add = rr.add
    rt = choice_and_placement_rows(prob, place, add)
    for r in range(W):
        for v, c in rt[r]:
            add([(io + r * G + grp[c], 1.0), (v, -1.0)], 0.0, np.inf)
    uni = {j: [(c, n[c] * per[c, j]) for c in range(C) if per[c, j] != 0] for j in _T7}
    symexpr = []
    for r in range(W):
        for j in _T7:
            ent = [(v, own[c, j]) for v, c in rt[r] if own[c, j] != 0]
            if j in (FWD, BWD) and ovh:
                ent += [(io + r * G + g, ovh) for g in range(G)]
            add(ent + uni[j] + [(iz[j], -1.0)], -np.inf, 0.0)
        for m, cap in ((0, prob.device_cap[r]), (1, prob.host_cap[r])):
            if np.isfinite(cap):
                ent = [(v, mem[c, m]) for v, c in rt[r] if mem[c, m] != 0]
                if ent: add(ent, -np.inf, float(cap) / 2.0**30)
        e = {}
        for v, c in rt[r]:
            e[v] = e.get(v, 0.0) + float(own[c, list(_T7)].sum()) + 1e-3 * mem[c, 0]
        symexpr.append(e)
    for j in _T7:
        add(uni[j] + [(iz[j], -1.0)], -np.inf, 0.0)
    same_caps = np.all(prob.device_cap == prob.device_cap[0]) and np.all(prob.host_cap == prob.host_cap[0])
    if sym and same_caps:
        def diff(a, b):
            d = dict(symexpr[a])
            for v, x in symexpr[b].items(): d[v] = d.get(v, 0.0) - x
            return list(d.items())
        for h in range(H):
            for i in range(L - 1):
                add(diff(h * L + i, h * L + i + 1), 0.0, np.inf)
        for h in range(H - 1):
            add(diff(h * L, (h + 1) * L), 0.0, np.inf)
    for iy, ci, ce in ((iy_in, IN_INTRA, IN_INTER), (iy_out, OUT_INTRA, OUT_INTER)):
        add([(iz[ci], 1.0), (iy, -1.0)], -np.inf, 0.0); add([(iz[ce], 1.0), (iy, -1.0)], -np.inf, 0.0)
    # no all-reduce (nor its latency) without dense parameters or an option in it
    allr = np.array([c.allreduce_bytes for c in prob.costs]) * n / W
    for ent, rhs in allreduce_rows(ft, allr, ia, idp=idp):
        add(ent, -np.inf, rhs)
    for c in range(C):
        if types[c] in ig: add([(c, 1.0), (ig[types[c]], -1.0)], -np.inf, 0.0)
    add([(ig[s], ft.latency) for s in st_types] + [(ilat, -1.0)], -np.inf, 0.0)
    forms = term_entries(iz, iy_in, iy_out, ia, PRECISION_BYTES[fwd] / 4, PRECISION_BYTES[bwd] / 4,
                         ft.dense_fwd, ft.dense_bwd, ilat=ilat, step_overhead=ft.step_overhead)
    for ent, rhs in composition_rows(pipeline, forms, itot, ft.overlap):
        add(ent, -np.inf, rhs)
    A = rr.matrix(nv)
    cv = np.zeros(nv); cv[itot] = 1
    integ = np.zeros(nv); integ[:io] = 1
    ub = np.full(nv, np.inf); ub[:io + W * G] = 1.0
    for s in st_types: integ[ig[s]] = 1; ub[ig[s]] = 1
    t0 = time.time()
    res = milp(cv, constraints=LinearConstraint(A, rr.lo, rr.hi), integrality=integ, bounds=Bounds(np.zeros(nv), ub),
               options={"time_limit": time_limit, "disp": False, "mip_rel_gap": 1e-5})
    el = time.time() - t0
    b = getattr(res, "mip_dual_bound", np.nan)
    out = {"status": res.status, "msg": res.message, "bound_ms": b, "obj_ms": res.fun if res.x is not None else np.nan, "secs": el, "nv": nv}
    if res.x is not None:
        x = res.x; ev = new_evaluator(prob, pipeline, fwd, bwd)
        for t, ids in enumerate(prob.candidates):
            c = max(ids, key=lambda i: x[i]); cand = prob.cands[c]
            if cand.placement == "all": ranks = tuple(range(cand.num_shards))
            else: ranks = tuple(r for v, cc, rk in place if cc == c and x[v] > 0.5 for r in rk)
            ev.assign(t, c, ranks)
        out["eval_ms"] = ev.objective() * 1e3; out["mem_ok"] = ev.memory_ok()
    return out


def check(name: str, limit: float, with_exact: bool) -> Dict[str, Any]:
    sc = B.Scenario.parse(name)
    wl, module, topo, batch, cons, sharders = B._inputs(sc, 80.0)
    planner = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=cons,
                                hardware=B.resolve_hardware("h100"), debug=False)
    c0 = time.process_time()
    res = planner.plan_with_result(module, sharders)
    s, prob = res.search, res.problem
    rec: Dict[str, Any] = {"scenario": name, "plan_ms": s.step.total_s * 1e3,
                           "plan_bound_ms": s.lower_bound_s * 1e3, "pipeline": s.pipeline,
                           "solver": s.solver, "plan_cpu_s": time.process_time() - c0}
    pl, f, b = s.pipeline, s.fwd_precision, s.bwd_precision
    rec["lp_ms"] = solve_lp(prob, pl, f, b).lower_bound_s * 1e3
    c0 = time.process_time()
    cb = choice_bound_solution(prob, pl, f, b, time_limit_s=limit)
    rec["choice_ms"], rec["choice_cpu_s"] = cb.bound_s * 1e3, time.process_time() - c0
    if cb.choice:
        sub = attrs.evolve(prob, candidates=tuple((c,) for c in cb.choice))
        o = exact(sub, pl, f, b, time_limit=limit)
        rec["placement"] = {k: o[k] for k in ("obj_ms", "eval_ms", "bound_ms", "status", "secs") if k in o}
    if with_exact:
        o = exact(prob, pl, f, b, time_limit=limit)
        rec["exact"] = {k: o[k] for k in ("obj_ms", "eval_ms", "bound_ms", "status", "secs") if k in o}
    return rec


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bound_gap", description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="dcnv2@8,dcnv2@16,dcnv2@64,dcnv2@128,kaggle@8")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds per MILP (default 60)")
    ap.add_argument("--exact", action="store_true", help="also run the full exact MILP")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    B._quiet()
    rows: List[Dict[str, Any]] = []
    for name in args.scenarios.split(","):
        rows.append(check(name.strip(), args.limit, args.exact))
        print(json.dumps(rows[-1], default=float), flush=True)
        if args.out:
            write_report(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
