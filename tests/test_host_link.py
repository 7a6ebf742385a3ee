"""A host's ranks sharing one inter-host link (``HardwareProfile.host_link_shared``) and
table-row-wise's sequential intra-host stage (``out_stage_s``): the evaluator, every solver and
the bounds price them alike."""

import warnings

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_sparselift.cost import terms
from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import (
    OUT_INTER,
    PIPELINES,
    CostContext,
    DenseWork,
    host_mean_rows,
    shard_cost,
    shared_link_columns,
)
from torchrec_sparselift.search.choice_bound import choice_bound
from torchrec_sparselift.search.lp import analytic_bound, solve_lp
from torchrec_sparselift.search.milp import solve_milp
from torchrec_sparselift.search.problem import build_problem
from torchrec_sparselift.search.solve import new_evaluator, solve
from torchrec_sparselift.semantics.graph import candidate_for, shard_nodes
from search_helpers import exhaustive_optimum, random_moves, table_spec

warnings.filterwarnings("ignore", category=FutureWarning)

SHARED = attrs.evolve(PRESETS["h100"], host_link_shared=True, inter_host_bw=2e9)


def _ctx(W, L, profile=SHARED, **kw):
    return CostContext(profile=attrs.evolve(profile, **kw) if kw else profile, world_size=W, local_world_size=L,
                       batch_size=512, dense=DenseWork(1e9, 4e6))


def test_shared_columns_only_with_several_hosts_of_several_ranks():
    inter = [j for j, c in enumerate(terms.layout().columns) if c.bandwidth == "inter_host_bw"]
    assert shared_link_columns(_ctx(4, 2)) == tuple(inter) and OUT_INTER in inter
    assert shared_link_columns(_ctx(4, 4)) == ()  # one host
    assert shared_link_columns(_ctx(4, 1)) == ()  # a link per rank already
    assert shared_link_columns(_ctx(4, 2, PRESETS["h100"])) == ()  # not shared


def test_host_mean_rows_averages_only_the_shared_columns():
    ctx = _ctx(4, 2)
    loads = np.arange(4 * terms.layout().width, dtype=float).reshape(4, -1)
    out = host_mean_rows(loads, ctx)
    cols = list(shared_link_columns(ctx))
    other = [j for j in range(loads.shape[1]) if j not in cols]
    np.testing.assert_array_equal(out[:, other], loads[:, other])
    np.testing.assert_allclose(out[0, cols], loads[:2, cols].mean(axis=0))
    np.testing.assert_allclose(out[1, cols], out[0, cols])
    np.testing.assert_allclose(out[3, cols], loads[2:, cols].mean(axis=0))
    assert host_mean_rows(loads, _ctx(4, 2, PRESETS["h100"])) is loads


def _two_table_problem(profile):
    # a hot table, 2 hosts x 2 ranks, offered table-wise and column-wise
    specs = [table_spec(0, 50_000, 128, 20.0, types=("table_wise", "column_wise"))]
    ctx = CostContext(profile=profile, world_size=4, local_world_size=2, batch_size=512,
                      dense=DenseWork(1e9, 4e6))
    cap = np.full(4, 1e12)
    return build_problem(specs, ctx, cap, cap.copy(), pipelines=("base",))


def test_splitting_a_table_over_one_host_buys_no_shared_link_time():
    """One rank sending a table's outputs across or two ranks of its host sending half each: the
    same bytes cross the host's link (measured on the testbed: 36 ms and 36 ms)."""
    for profile, split_gains in ((SHARED, False), (attrs.evolve(SHARED, host_link_shared=False), True)):
        prob = _two_table_problem(profile)
        tw = next(c for c in prob.candidates[0] if prob.cands[c].sharding_type == "table_wise")
        cw = next(c for c in prob.candidates[0] if prob.cands[c].sharding_type == "column_wise"
                  and prob.cands[c].num_shards == 2)
        out = {}
        for name, (cand, ranks) in {"tw": (tw, (0,)), "cw": (cw, (0, 1))}.items():
            ev = new_evaluator(prob, "base")
            ev.assign(0, cand, ranks)
            out[name] = ev.colmax()[OUT_INTER]
        if split_gains:
            assert out["cw"] < 0.75 * out["tw"]
        else:
            assert out["cw"] == pytest.approx(out["tw"], rel=1e-9)


tables = st.lists(
    st.tuples(st.integers(10, 10**6), st.sampled_from([16, 64, 128]), st.floats(1, 50), st.booleans()),
    min_size=1, max_size=10,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables, st.sampled_from([(4, 2), (8, 4), (16, 8), (16, 2)]), st.integers(0, 2**31 - 1),
       st.sampled_from(PIPELINES))
def test_incremental_equals_full_recomputation_on_a_shared_link(tabs, topo, seed, pipeline):
    W, L = topo
    specs = [table_spec(i, r, d, pf, pooled=pooled, batch_size=256) for i, (r, d, pf, pooled) in enumerate(tabs)]
    ctx = CostContext(profile=SHARED, world_size=W, local_world_size=L, batch_size=256, dense=DenseWork(4e6, 2e6))
    cap = np.full(W, 1e15)
    prob = build_problem(specs, ctx, cap, cap.copy(), pipelines=PIPELINES)
    ev = new_evaluator(prob, pipeline)
    rng = np.random.default_rng(seed)
    cols = list(shared_link_columns(ctx))
    for predicted in random_moves(ev, prob, rng, 3 * len(tabs)):
        assert ev.objective() == pytest.approx(predicted, rel=1e-9, abs=1e-15)
        loads, uniform, _allreduce, _groups = ev.full_recompute()
        np.testing.assert_allclose(ev.loads, loads, rtol=1e-9, atol=1e-6)
        # the shared columns hold the host's mean: equal on every rank of a host
        np.testing.assert_allclose(np.ptp(ev.loads[:, cols].reshape(W // L, L, -1), axis=1), 0.0, atol=1e-6)
        assert ev.objective() == pytest.approx(ev.full_objective(), rel=1e-9, abs=1e-15)


def _random_problem(seed, W, L):
    rng = np.random.default_rng(seed)
    specs = [table_spec(i, int(rng.integers(10**3, 10**6)), int(rng.choice([32, 64])), float(rng.uniform(1, 30)))
             for i in range(int(rng.integers(2, 4)))]
    # no TBE group fixed cost: the placement MILP then prices exactly what the evaluator does
    profile = attrs.evolve(SHARED, lookup_overhead_s=0.0)
    ctx = CostContext(profile=profile, world_size=W, local_world_size=L, batch_size=512, dense=DenseWork(1e9, 4e6))
    cap = np.full(W, 1e12)
    return build_problem(specs, ctx, cap, cap.copy(), pipelines=("base", "sparse_dist"))


@pytest.mark.parametrize("seed", range(3))
def test_milp_bounds_and_search_agree_with_the_evaluator_on_a_shared_link(seed):
    prob = _random_problem(seed, 4, 2)
    assert shared_link_columns(prob.ctx)
    for pl in ("base", "sparse_dist"):
        opt = exhaustive_optimum(prob, pl)
        m = solve_milp(prob, pl, time_limit_s=60)
        ev = new_evaluator(prob, pl)
        for t, (c, rk) in enumerate(m.assignment):
            ev.assign(t, c, rk)
        assert m.status == "optimal"
        assert m.objective_s == pytest.approx(ev.objective(), rel=1e-6)  # the MILP prices as the evaluator
        assert m.objective_s == pytest.approx(opt, rel=2e-4)  # and finds the optimum
        for name, b in (("lp", solve_lp(prob, pl).lower_bound_s), ("cb", choice_bound(prob, pl, time_limit_s=30)),
                        ("analytic", analytic_bound(prob, pl))):
            assert b <= opt * (1 + 1e-6), (pl, name, b, opt)
        res = solve(prob, time_budget_s=1.0, pipeline=pl)
        assert res.step.total_s >= opt * (1 - 1e-9)
        assert res.lower_bound_s <= opt * (1 + 1e-6)


def test_table_row_wise_intra_host_stage_adds_to_the_link_phase():
    """On several hosts table-row-wise reduces its partial sums inside the host, then sends them
    across: two collectives one after the other, so the intra-host stage's seconds add to the
    output (and gradient) phases instead of hiding under the slower inter-host link."""
    spec = table_spec(0, 100_000, 64, 4.0, types=("table_row_wise",))
    prof = attrs.evolve(PRESETS["h100"], compute_device="cpu", intra_host_bw=1e9, inter_host_bw=1e8,
                        reduce_scatter_factor=3.0)
    stage = terms.layout().index["out_stage_s"]
    two = CostContext(profile=prof, world_size=4, local_world_size=2, batch_size=512)
    cand = candidate_for(0, spec, "table_row_wise", "fused", 4, 2)
    rs = [n for n in shard_nodes(spec, cand, 4, 2) if n.kind == "output_dist" and n.collective == "reduce_scatter"]
    assert len(rs) == 1 and rs[0].stage and rs[0].resource == "intra_host"
    cost = shard_cost(spec, cand, two)
    assert cost.owner[stage] == pytest.approx(rs[0].quantity * 3.0 / 1e9)
    # a slower inter-host link's corrected factor (inter_reduce_scatter_factor) leaves the
    # intra-host stage at the calibrated reduce_scatter_factor
    slow = CostContext(profile=attrs.evolve(prof, inter_reduce_scatter_factor=1.1), world_size=4,
                       local_world_size=2, batch_size=512)
    assert shard_cost(spec, cand, slow).owner[stage] == pytest.approx(cost.owner[stage])
    assert cost.owner[terms.layout().index["out_intra_bytes"]] == 0.0  # not in the concurrent link columns
    # one host: the reduce-scatter is the whole output distribution (no stage)
    one = CostContext(profile=prof, world_size=2, local_world_size=2, batch_size=512)
    cand1 = candidate_for(0, spec, "table_row_wise", "fused", 2, 2)
    assert not any(n.stage for n in shard_nodes(spec, cand1, 2, 2))
    assert shard_cost(spec, cand1, one).owner[stage] == 0.0
    # the stage is in the output and the gradient phases of the evaluator's step
    prob = build_problem([spec], two, np.full(4, 1e12), np.full(4, 1e12), pipelines=("base",))
    c = next(i for i in prob.candidates[0] if prob.cands[i].sharding_type == "table_row_wise")
    ev = new_evaluator(prob, "base")
    ev.assign(0, c, (0, 1))
    with_stage = ev.phases()
    colmax = ev.colmax().copy()
    colmax[stage] = 0.0
    from torchrec_sparselift.cost.model import phase_times

    without = phase_times(colmax, ev.allreduce_bytes, ev.comm_groups, two, pipeline="base")
    for ph in ("output_dist", "grad_dist"):
        assert with_stage[ph] - without[ph] == pytest.approx(cost.owner[stage], rel=1e-9)
