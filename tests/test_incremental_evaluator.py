"""Incremental cost evaluation equals full recomputation (property tests)."""

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_sparselift.cost import terms
from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import PIPELINES, CostContext, DenseWork, step_time, step_total_batch
from torchrec_sparselift.search.lp import analytic_bound
from torchrec_sparselift.search.problem import build_problem
from torchrec_sparselift.search.solve import new_evaluator, solve
from search_helpers import random_moves, table_spec

warnings.filterwarnings("ignore", category=FutureWarning)

def _spec(i, rows, dim, pf, pooled=True):
    return table_spec(i, rows, dim, pf, pooled=pooled, batch_size=256)


tables = st.lists(
    st.tuples(st.integers(10, 10**6), st.sampled_from([16, 32, 64, 128]), st.floats(1, 50), st.booleans()),
    min_size=1, max_size=12,
)


def _problem(tabs, world, local):
    specs = [_spec(i, r, d, pf, pooled) for i, (r, d, pf, pooled) in enumerate(tabs)]
    ctx = CostContext(profile=PRESETS["h100"], world_size=world, local_world_size=local,
                      batch_size=256, dense=DenseWork(4e6, 2e6))
    cap = np.full(world, 1e15)
    return build_problem(specs, ctx, cap, cap.copy(), pipelines=PIPELINES)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables, st.sampled_from([(2, 2), (8, 8), (16, 8), (32, 8)]), st.integers(0, 2**31 - 1),
       st.sampled_from(PIPELINES))
def test_incremental_equals_full_recomputation(tabs, topo, seed, pipeline):
    world, local = topo
    prob = _problem(tabs, world, local)
    ev = new_evaluator(prob, pipeline)
    rng = np.random.default_rng(seed)
    for predicted in random_moves(ev, prob, rng, 3 * len(tabs)):
        assert ev.objective() == pytest.approx(predicted, rel=1e-9, abs=1e-15)
        loads, uniform, allreduce, groups = ev.full_recompute()
        np.testing.assert_allclose(ev.loads, loads, rtol=1e-9, atol=1e-6)
        np.testing.assert_allclose(ev.uniform, uniform, rtol=1e-9, atol=1e-6)
        assert ev.allreduce_bytes == pytest.approx(allreduce, rel=1e-9, abs=1e-6)
        assert ev.comm_groups == groups
        assert ev.objective() == pytest.approx(ev.full_objective(), rel=1e-9, abs=1e-15)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0, 1e9), min_size=terms.layout().width, max_size=terms.layout().width),
       st.sampled_from(PIPELINES),
       st.sampled_from(["fp32", "fp16", "bf16", "fp8"]))
def test_batched_step_time_equals_scalar(colmax, pipeline, prec):
    ctx = CostContext(profile=PRESETS["a100"], world_size=16, local_world_size=8, batch_size=512,
                      dense=DenseWork(1e7, 5e6))
    cm = np.array(colmax)
    cm[list(terms.layout().compute)] *= 1e-12  # seconds columns
    scalar = step_time(cm, 1e6, 2, ctx, pipeline, prec, "fp32").total_s
    batch = step_total_batch(cm[None, :], 1e6, 2, ctx, pipeline, prec, "fp32")[0]
    assert batch == pytest.approx(scalar, rel=1e-12)


@settings(max_examples=15, deadline=None)
@given(tables, st.sampled_from([(8, 8), (16, 8)]))
def test_plans_respect_memory_and_lower_bound(tabs, topo):
    world, local = topo
    prob = _problem(tabs, world, local)
    res = solve(prob, time_budget_s=5)
    assert res.lower_bound_s <= res.step.total_s * (1 + 1e-9)
    assert analytic_bound(prob, res.pipeline, res.fwd_precision, res.bwd_precision) <= res.step.total_s * (1 + 1e-9)
    assert res.status in ("converged", "time_limit")
    assert len(res.assignment) == prob.num_tables
