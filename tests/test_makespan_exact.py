"""The makespan bound and the exact makespan MILP against brute force on small random instances
(TorchRec's rating: the slowest rank's summed shard time, per-rank memory limits)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from torchrec_sparselift.cost.hardware import get_profile
from torchrec_sparselift.cost.model import DEV_MEM, FWD, K, ShardCost
from torchrec_sparselift.search.makespan_bound import analytic_makespan_bound, makespan_bound
from torchrec_sparselift.search.makespan_milp import solve_makespan_milp
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.search.torchrec_objective import makespan_context, perf_core
from torchrec_sparselift.semantics.graph import Candidate
from torchrec_sparselift.semantics.tables import TableSpec

GiB = float(1 << 30)


def _instance(rng: np.random.Generator, W: int, L: int, T: int, mem_tight: bool) -> PlanningProblem:
    ctx = makespan_context(get_profile("h100"), W, L, 64)
    cands, costs, per_table, specs = [], [], [], []
    for t in range(T):
        specs.append(TableSpec(module_path="", name=f"t{t}", num_embeddings=1000, embedding_dim=64,
                               feature_names=(f"f{t}",), pooling_factor=1.0, is_pooled=True,
                               elem_bytes=4, sharding_types=("table_wise",), compute_kernels=()))
        ids = []
        kinds = [("table_wise", 1, "free"), ("row_wise", W, "all"), ("column_wise", 2, "free"),
                 ("table_row_wise", L, "host"), ("column_wise", min(W, 3), "free")]
        for j in sorted(rng.choice(len(kinds), size=int(rng.integers(1, 4)), replace=False)):
            st, n, pl = kinds[j]
            base = float(rng.uniform(0.2, 3.0))
            p = base / n + float(rng.uniform(0.0, 0.3))  # a fixed cost per shard, as TorchRec's
            owner = np.zeros(K)
            owner[FWD] = p * 1e-3
            owner[DEV_MEM] = float(rng.uniform(0.5, 4.0)) / n * GiB
            ids.append(len(cands))
            cands.append(Candidate(table=t, sharding_type=st, compute_kernel="fused", num_shards=n,
                                   shard_rows=1000, shard_cols=64, placement=pl))
            costs.append(ShardCost(owner=owner, peers=np.zeros(K)))
        per_table.append(tuple(ids))
    cap = np.full(W, (3.0 if mem_tight else 1e3) * GiB)
    return PlanningProblem(specs=tuple(specs), ctx=ctx, cands=tuple(cands), costs=tuple(costs),
                           candidates=tuple(per_table), device_cap=cap, host_cap=np.full(W, np.inf),
                           pipelines=("base",))


def _brute_force(prob: PlanningProblem) -> float:
    """The exact optimum (seconds) by enumerating every choice and placement; inf if none fits."""
    W, L = prob.ctx.world_size, prob.ctx.local_world_size
    hosts = [tuple(range(h * L, (h + 1) * L)) for h in range(W // L)]
    per_table = []
    for ids in prob.candidates:
        opts = []
        for c in ids:
            cand = prob.cands[c]
            if cand.placement == "all":
                opts.append((c, tuple(range(W))))
            elif cand.placement == "host":
                opts.extend((c, h) for h in hosts)
            else:
                opts.extend((c, rk) for rk in itertools.combinations(range(W), cand.num_shards))
        per_table.append(opts)
    best = np.inf
    for plan in itertools.product(*per_table):
        load, mem = np.zeros(W), np.zeros(W)
        for c, ranks in plan:
            for r in ranks:
                load[r] += prob.costs[c].owner[FWD]
                mem[r] += prob.costs[c].owner[DEV_MEM]
        if np.all(mem <= prob.device_cap) and load.max() < best:
            best = float(load.max())
    return best


@pytest.mark.parametrize("seed", range(24))
def test_bounds_are_below_and_the_exact_milp_finds_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    W, L = [(2, 2), (4, 2), (4, 4), (3, 3)][seed % 4]
    prob = _instance(rng, W, L, T=int(rng.integers(2, 5)), mem_tight=bool(seed % 3 == 0))
    opt = _brute_force(prob)
    if not np.isfinite(opt):  # no plan fits: the exact MILP must not invent one
        assert not solve_makespan_milp(prob, time_limit_s=10).assignment
        return
    assert analytic_makespan_bound(prob) <= opt * (1 + 1e-9)
    lb = makespan_bound(prob, time_limit_s=10)
    assert lb.bound_s <= opt * (1 + 1e-9)
    assert makespan_bound(prob, time_limit_s=10, integral=False).bound_s <= opt * (1 + 1e-9)
    assert makespan_bound(prob, time_limit_s=10, upper=opt).bound_s <= opt * (1 + 1e-9)
    # the memory-free core is a relaxation: its bound is below too
    core, _ = perf_core(prob)
    assert makespan_bound(core, time_limit_s=10).bound_s <= opt * (1 + 1e-9)
    # the exact MILP (rank symmetry broken) reaches the optimum; on the memory-aware core too
    for (sub, keep), sym in itertools.product(((prob, list(range(len(prob.cands)))),
                                                perf_core(prob, memory=True)), (False, True)):
        m = solve_makespan_milp(sub, time_limit_s=20, lower=lb.bound_s, rel_gap=1e-9, symmetry=sym)
        assert m.status == "optimal"
        assert m.objective_s == pytest.approx(opt, rel=1e-6)
        assert m.bound_s <= opt * (1 + 1e-6)
        # its plan is a real plan with that makespan, within memory
        load, mem = np.zeros(W), np.zeros(W)
        for t, (c, ranks) in enumerate(m.assignment):
            assert keep[c] in prob.candidates[t]
            assert len(set(ranks)) == prob.cands[keep[c]].num_shards
            for r in ranks:
                load[r] += sub.costs[c].owner[FWD]
                mem[r] += sub.costs[c].owner[DEV_MEM]
        assert load.max() == pytest.approx(opt, rel=1e-6)
        assert np.all(mem <= prob.device_cap * (1 + 1e-9))


def test_upper_stops_the_bound_milp_and_the_exact_milp():
    rng = np.random.default_rng(7)
    prob = _instance(rng, 4, 2, T=4, mem_tight=False)
    opt = _brute_force(prob)
    free = makespan_bound(prob, time_limit_s=10)
    assert "reached upper" not in free.method
    # a cap below what the relaxation can reach: HiGHS proves nothing is below it and stops there
    low = 0.5 * free.bound_s
    capped = makespan_bound(prob, time_limit_s=10, upper=low)
    assert capped.bound_s == low and "reached upper" in capped.method
    # the exact MILP capped at the optimum: no plan is below it, the known plan is proven optimal
    m = solve_makespan_milp(prob, time_limit_s=10, upper=opt * (1 - 1e-6), rel_gap=1e-9)
    assert m.status == "upper_optimal" and not m.assignment
    assert m.bound_s == pytest.approx(opt, rel=1e-5)
    m2 = solve_makespan_milp(prob, time_limit_s=10, upper=opt * 1.5, rel_gap=1e-9)
    assert m2.status == "optimal" and m2.objective_s == pytest.approx(opt, rel=1e-6)
