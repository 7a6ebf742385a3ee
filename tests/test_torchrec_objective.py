"""cost_model="torchrec": TorchRec's estimators as the objective, the makespan bound, and
SparseLiftProposer inside EmbeddingShardingPlanner."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from torchrec.distributed.planner import EmbeddingShardingPlanner  # noqa: E402
from torchrec.distributed.planner.perf_models import NoopPerfModel  # noqa: E402
from torchrec.distributed.planner.shard_estimators import (  # noqa: E402
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import Topology  # noqa: E402
from torchrec.distributed.sharding_plan import get_default_sharders  # noqa: E402

from torchrec_sparselift.cost.torchrec_score import BestPlanCapture, torchrec_score  # noqa: E402
from torchrec_sparselift.planner import SparseLiftPlanner  # noqa: E402
from torchrec_sparselift.search.makespan_bound import makespan_bound, piece_bounds  # noqa: E402
from torchrec_sparselift.search.milp import solve_milp  # noqa: E402
from torchrec_sparselift.search.proposer import SparseLiftProposer  # noqa: E402
from torchrec_sparselift.search.torchrec_objective import (  # noqa: E402
    estimate_options,
    estimator_identity,
    rate_placed,
)
from torchrec_sparselift.semantics.reference_workloads import kaggle, production  # noqa: E402

GiB = 1 << 30


def _inputs(wl, world_size):
    topo = Topology(world_size=world_size, local_world_size=min(8, world_size), compute_device="cuda",
                    hbm_cap=80 * GiB)
    return wl.module(), topo, wl.per_rank_batch(world_size), wl.constraints(), get_default_sharders()


@pytest.fixture(scope="module")
def kaggle8():
    return _inputs(kaggle(), 8)


def test_objective_is_torchrecs_rating_and_bound_is_below(kaggle8):
    module, topo, batch, cons, sharders = kaggle8
    pl = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                           cost_model="torchrec", time_budget_s=4)
    res = pl.plan_with_result(module, sharders)
    judged = torchrec_score(res.sharding_options, topo, sharders, cons)
    fast = rate_placed(res.sharding_options, topo, sharders, cons)
    assert fast["perf_ms"] == pytest.approx(judged.perf_ms, rel=1e-12)
    assert fast["peak_hbm_bytes"] == judged.peak_hbm_bytes
    assert res.search.step.total_s * 1e3 == pytest.approx(judged.perf_ms, rel=1e-9)
    assert res.search.step.total_s * 1e3 == pytest.approx(NoopPerfModel(topology=topo).rate(
        list(res.sharding_options)), rel=1e-9)
    assert 0 < res.search.lower_bound_s <= res.search.step.total_s
    assert judged.peak_hbm_bytes <= 0.85 * 80 * GiB
    # every table planned once, with a real TorchRec plan
    assert sorted(res.sharding_plan.plan[""].keys()) == sorted(n for n, *_ in kaggle().tables)
    # the request records the cost model and the estimators, so cached plans do not mix
    req = pl.request(module, sharders).cost_model
    assert req.startswith("torchrec:torchrec-default/")
    assert SparseLiftPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                             ).request(module, sharders).cost_model == "sparselift"


class _SlowPerf(EmbeddingPerfEstimator):
    """A user estimator: TorchRec's perf, row-wise made 10x dearer."""

    def estimate(self, sharding_options, sharder_data_map=None):
        super().estimate(sharding_options, sharder_data_map=sharder_data_map)
        for o in sharding_options:
            if o.sharding_type == "row_wise":
                for s in o.shards:
                    s.perf = copy.copy(s.perf)
                    s.perf.fwd_compute *= 10
                    s.perf.bwd_compute *= 10


def test_user_estimators_drive_the_plan_and_the_cache_key(kaggle8):
    module, topo, batch, cons, sharders = kaggle8
    est = [_SlowPerf(topology=topo, constraints=cons), EmbeddingStorageEstimator(topology=topo, constraints=cons)]
    pl = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                           cost_model="torchrec", estimator=est, time_budget_s=2)
    res = pl.plan_with_result(module, sharders)
    assert "_SlowPerf" in estimator_identity(est) and "_SlowPerf" in pl.request(module, sharders).cost_model
    # the objective is the user's estimate of the chosen shards (not TorchRec's default)
    per = np.zeros(8)
    for o in res.sharding_options:
        for s in o.shards:
            per[s.rank] += s.perf.total
    assert res.search.step.total_s * 1e3 == pytest.approx(per.max(), rel=1e-9)
    with pytest.raises(ValueError, match="cost_model='torchrec'"):
        SparseLiftPlanner(topology=topo, batch_size=batch, estimator=est)
    with pytest.raises(ValueError, match="cost_model"):
        SparseLiftPlanner(topology=topo, batch_size=batch, cost_model="other")


def test_shared_estimates_equal_per_shard_estimates():
    wl = production(12)
    module, topo, batch, cons, sharders = _inputs(wl, 16)
    shared, t1 = estimate_options(module, sharders, topo, batch, cons, share_estimates=True, prune_uvm=False)
    full, t2 = estimate_options(module, sharders, topo, batch, cons, share_estimates=False)
    assert t1["shard_estimates"] < t2["shard_estimates"]
    key = lambda o: (o.name, o.sharding_type, o.compute_kernel)  # noqa: E731
    full_by = {key(o): o for o in full}
    assert {key(o) for o in shared} == set(full_by)
    for o in shared:
        f = full_by[key(o)]
        for a, b in zip(o.shards, f.shards):
            assert a.perf.total == pytest.approx(b.perf.total, rel=1e-12)
            assert a.storage.hbm == b.storage.hbm and a.storage.ddr == b.storage.ddr


def test_makespan_bound_is_a_bound_and_closes_small_instances():
    from torchrec_sparselift.search.torchrec_objective import makespan_problem, specs_from_options

    wl = production(6)
    module, topo, batch, cons, sharders = _inputs(wl, 4)
    opts, _ = estimate_options(module, sharders, topo, batch, cons)
    specs, _ = specs_from_options(opts)
    # memory tight enough to matter
    trp = makespan_problem(opts, specs, SparseLiftPlanner(topology=topo, batch_size=batch).profile(),
                           4, 4, batch, np.full(4, 60.0 * GiB), np.full(4, 128.0 * GiB))
    exact = solve_milp(trp.problem, "base", time_limit_s=30)
    assert exact.status == "optimal"
    lb = makespan_bound(trp.problem, time_limit_s=10)
    assert lb.bound_s <= exact.objective_s * (1 + 1e-6)
    assert lb.bound_s >= 0.5 * exact.objective_s
    # the whole search on it: the exact makespan MILP proves its plan optimal (gap ~0)
    from torchrec_sparselift.search.torchrec_objective import solve_torchrec

    res = solve_torchrec(trp, 20.0)
    assert res.step.total_s == pytest.approx(exact.objective_s, rel=1e-3)
    assert res.lower_bound_s <= exact.objective_s * (1 + 1e-6)
    assert res.gap <= 2e-3, res.solver
    # classic P||Cmax bounds: 3 pieces of 5 on 2 ranks -> some rank holds two
    assert piece_bounds(np.array([5.0, 5.0, 5.0]), 2) == pytest.approx(10.0)
    assert piece_bounds(np.array([4.0, 1.0, 1.0]), 2, uniform=1.0) == pytest.approx(5.0)


def test_proposer_inside_embedding_sharding_planner_beats_torchrecs_proposers(kaggle8):
    module, topo, batch, cons, sharders = kaggle8
    theirs = BestPlanCapture()
    EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                             stats=theirs).plan(module, sharders)
    ours = BestPlanCapture()
    prop = SparseLiftProposer(topology=topo, cost_model="torchrec", time_budget_s=3)
    EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                             proposer=prop, stats=ours).plan(module, sharders)
    rate = NoopPerfModel(topology=topo).rate
    assert prop.best_perf_rating is not None
    assert rate(ours.best_plan) == pytest.approx(prop.best_perf_rating)
    assert rate(ours.best_plan) < rate(theirs.best_plan) * 0.99


def test_choice_bound_under_our_model_is_between_the_lp_and_the_optimum():
    from torchrec_sparselift.search.choice_bound import choice_bound
    from torchrec_sparselift.search.lp import solve_lp

    wl = production(6)
    module, topo, batch, cons, sharders = _inputs(wl, 4)
    res = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                            pipelines=("sparse_dist",), time_budget_s=2).plan_with_result(module, sharders)
    prob = res.problem
    exact = solve_milp(prob, "sparse_dist", time_limit_s=60)
    assert exact.status == "optimal"
    cb = choice_bound(prob, "sparse_dist", time_limit_s=20)
    lp = solve_lp(prob, "sparse_dist")
    assert lp.lower_bound_s * (1 - 1e-5) <= cb <= exact.objective_s * (1 + 1e-5)
    assert res.search.lower_bound_s <= res.search.step.total_s
