"""The integral-choice bound under SparseLift's own model (search/choice_bound.py): never above
the exhaustive optimum of the same cost model (the evaluator), and its choice as a seed."""

import warnings

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import DEV_MEM, PIPELINES, CostContext, DenseWork
from torchrec_sparselift.cost.pipelines import SYNC_PIPELINES, trainable_pipelines
from torchrec_sparselift.search.choice_bound import choice_bound, choice_bound_solution
from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.search.lp import solve_lp
from torchrec_sparselift.search.problem import build_problem
from torchrec_sparselift.search.solve import solve
from search_helpers import exhaustive_optimum, table_spec

warnings.filterwarnings("ignore", category=FutureWarning)

_spec = table_spec


tables = st.lists(
    st.tuples(st.integers(10, 4 * 10**7), st.sampled_from([32, 64, 128]), st.floats(1, 40)),
    min_size=1, max_size=3,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables, st.sampled_from([(2, 2), (4, 2), (4, 4)]), st.sampled_from(SYNC_PIPELINES),
       st.floats(0.05, 1.0), st.sampled_from([0.0, 20e-6, 200e-6]), st.sampled_from([0.0, 1e9]))
def test_choice_bound_never_above_the_exhaustive_optimum(tabs, topo, pipeline, mem_frac, overhead, flops):
    W, L = topo
    specs = [_spec(i, r, d, pf) for i, (r, d, pf) in enumerate(tabs)]
    profile = attrs.evolve(PRESETS["h100"], lookup_overhead_s=overhead)
    ctx = CostContext(profile=profile, world_size=W, local_world_size=L, batch_size=512,
                      dense=DenseWork(flops, 4e6))
    total = sum(s.num_embeddings * s.embedding_dim * 4 for s in specs)
    cap = np.full(W, max(1e6, mem_frac * 2.5 * total))  # sometimes too small to hold a table alone
    try:
        prob = build_problem(specs, ctx, cap, cap.copy(), pipelines=(pipeline,))
    except SparseLiftPlannerError as e:  # the planner's no-fit error (tested in test_planner)
        assert "No sharding of these tables fits" in str(e), e
        assert e.kind in ("insufficient_storage", "strict_constraints"), e.kind
        return  # no option of some table fits on one rank
    opt = exhaustive_optimum(prob, pipeline)
    cb = choice_bound(prob, pipeline, time_limit_s=20)
    if not np.isfinite(opt):
        return  # no plan fits per rank; the bound may say anything
    assert np.isfinite(cb)
    assert cb <= opt * (1 + 1e-6), (cb, opt)
    assert cb >= solve_lp(prob, pipeline).lower_bound_s * (1 - 1e-5)
    try:
        res = solve(prob, time_budget_s=1.0)
    except SparseLiftPlannerError as e:  # the greedy placement may miss a tight packing
        assert "no plan" in str(e) and e.kind in ("insufficient_storage", "strict_constraints"), e
        return  # (the bound is checked above)
    assert res.lower_bound_s <= opt * (1 + 1e-6)
    assert res.step.total_s >= opt * (1 - 1e-9)


def test_group_fixed_costs_and_collective_latency_tighten_the_bound():
    """Twelve small tables on 4 ranks: the evaluator charges each rank one TBE fixed cost per
    group it holds and one collective latency per sharding type; the bound counts both, so it
    proves the plan within 2% (the LP alone is far below)."""
    specs = [_spec(i, 1000 + 50 * i, 32, 2.0, ("table_wise", "data_parallel")) for i in range(12)]
    ctx = CostContext(profile=PRESETS["h100"], world_size=4, local_world_size=4, batch_size=512,
                      dense=DenseWork(0.0, 0.0))
    cap = np.full(4, 1e12)
    prob = build_problem(specs, ctx, cap, cap.copy(), pipelines=("sparse_dist",))
    res = solve(prob, time_budget_s=2.0)
    lp = solve_lp(prob, "sparse_dist").lower_bound_s
    cb = choice_bound(prob, "sparse_dist", time_limit_s=10)
    assert lp <= cb <= res.step.total_s * (1 + 1e-9)
    assert res.step.total_s / cb - 1 < 0.02
    assert res.step.total_s / lp - 1 > 0.10


def test_choice_is_a_seed_that_reaches_the_bound():
    """The bound MILP's option choice, placed by the greedy, is a complete plan; on a case where
    all-on-every-rank is optimal the search returns a plan equal to the bound."""
    specs = [_spec(i, 200 + i, 64, 1.0) for i in range(6)]
    ctx = CostContext(profile=PRESETS["h100"], world_size=8, local_world_size=8, batch_size=512,
                      dense=DenseWork(0.0, 1e5))
    cap = np.full(8, 1e12)
    prob = build_problem(specs, ctx, cap, cap.copy(), pipelines=("fused",))
    sol = choice_bound_solution(prob, "fused", time_limit_s=10)
    assert len(sol.choice) == prob.num_tables
    assert all(c in prob.candidates[t] for t, c in enumerate(sol.choice))
    res = solve(prob, time_budget_s=2.0)
    assert res.step.total_s <= sol.bound_s * (1 + 1e-4)


def test_semi_sync_rule_lives_in_the_pipeline_description():
    assert trainable_pipelines(("sparse_dist", "semi_sync"), dense_kernel=True) == ("sparse_dist",)
    assert trainable_pipelines(("sparse_dist", "semi_sync"), dense_kernel=False) == ("sparse_dist", "semi_sync")
    assert trainable_pipelines(("semi_sync",), dense_kernel=True) == ("semi_sync",)  # as asked
    assert [n for n in PIPELINES if not trainable_pipelines((n, "base"), True)[:1] == (n,)] == ["semi_sync", "overlap_stale"]
    # the search reads it: a data-parallel table never gets semi_sync when another pipeline is allowed
    specs = [_spec(0, 100, 64, 1.0, ("data_parallel",)), _spec(1, 10**6, 64, 5.0, ("table_wise",))]
    ctx = CostContext(profile=PRESETS["h100"], world_size=2, local_world_size=2, batch_size=512,
                      dense=DenseWork(1e9, 1e6))
    cap = np.full(2, 1e12)
    prob = build_problem(specs, ctx, cap, cap.copy(), pipelines=("sparse_dist", "semi_sync"))
    res = solve(prob, time_budget_s=1.0)
    assert res.pipeline == "sparse_dist"
    assert all(not a.startswith("semi_sync/") for a, _ in res.alternatives)
    only = build_problem(specs, ctx, cap, cap.copy(), pipelines=("semi_sync",))
    assert solve(only, time_budget_s=1.0).pipeline == "semi_sync"
    # without a dense-kernel table semi_sync is priced
    tw = build_problem(specs[1:], ctx, cap[:2], cap[:2].copy(), pipelines=("sparse_dist", "semi_sync"))
    assert any(a.startswith("semi_sync/") for a, _ in solve(tw, time_budget_s=1.0).alternatives)
    assert float(np.max(res.rank_loads[:, DEV_MEM])) > 0


def test_fused_on_a_streams_device_never_trains_dense_kernel_tables_or_feature_processors():
    """TorchRec's ``fused`` looks up the next batch on a side stream that does not wait for the
    dense optimizer (``Pipeline.lookup_before_dense_step``): on CUDA it is left out for plans with
    a dense-kernel table and for models with feature processors; on CPU it stays."""
    names = ("sparse_dist", "fused")
    assert trainable_pipelines(names, dense_kernel=True, streams=False) == names
    assert trainable_pipelines(names, dense_kernel=True, streams=True) == ("sparse_dist",)
    assert trainable_pipelines(names, dense_kernel=False, streams=True) == names
    assert trainable_pipelines(names, dense_kernel=False, streams=True, feature_processors=True) == ("sparse_dist",)
    assert trainable_pipelines(names, dense_kernel=False, streams=False, feature_processors=True) == names
    assert trainable_pipelines(("fused",), dense_kernel=True, streams=True) == ("fused",)  # as asked
    # the search reads it: on the h100 preset fused wins a table-wise plan, not a data-parallel one
    ctx = CostContext(profile=PRESETS["h100"], world_size=2, local_world_size=2, batch_size=512,
                      dense=DenseWork(1e9, 1e6))
    cap = np.full(2, 1e12)

    def chosen(types):
        specs = [_spec(0, 1000, 64, 1.0, types), _spec(1, 10**6, 64, 5.0, ("table_wise",))]
        res = solve(build_problem(specs, ctx, cap, cap.copy(), pipelines=names), time_budget_s=1.0)
        return res.pipeline, {a.split("/")[0] for a, _ in res.alternatives}

    assert chosen(("table_wise",))[0] == "fused"
    pipeline, offered = chosen(("data_parallel",))
    assert pipeline == "sparse_dist" and "fused" not in offered
