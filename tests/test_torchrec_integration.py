"""SparseLiftEnumerator and SparseLiftProposer inside TorchRec's own EmbeddingShardingPlanner."""

import warnings

import pytest
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ShardingOption
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_sparselift.semantics.reference_workloads import dcnv2
from torchrec_sparselift.search.enumerator import SparseLiftEnumerator
from torchrec_sparselift.search.proposer import SparseLiftProposer, problem_from_options

warnings.filterwarnings("ignore")
GiB = 1024**3


@pytest.fixture(scope="module")
def setup():
    wl = dcnv2()
    topo = Topology(world_size=16, local_world_size=8, compute_device="cuda", hbm_cap=80 * GiB)
    return wl, topo, wl.per_rank_batch(16)


def _tables(plan):
    return sorted(n for mp in plan.plan.values() for n in mp)


def test_enumerator_options_carry_our_costs_and_cover_every_table(setup):
    wl, topo, B = setup
    enum = SparseLiftEnumerator(topology=topo, batch_size=B, constraints=wl.constraints())
    opts = enum.enumerate(wl.module(), get_default_sharders())
    assert all(isinstance(o, ShardingOption) for o in opts)
    assert {o.name for o in opts} == {t[0] for t in wl.tables}
    for o in opts:
        assert all(s.perf is not None and s.storage is not None and s.rank is None for s in o.shards)
        assert o.total_perf > 0
    # column-wise splits beyond TorchRec's single choice are offered
    cw = {len(o.shards) for o in opts if o.name == "t20" and o.sharding_type == "column_wise"}
    assert {2, 4} <= cw


def test_populate_estimates_restores_costs(setup):
    wl, topo, B = setup
    enum = SparseLiftEnumerator(topology=topo, batch_size=B, constraints=wl.constraints())
    opts = enum.enumerate(wl.module(), get_default_sharders())
    before = [o.total_perf for o in opts[:10]]
    for o in opts[:10]:
        for s in o.shards:
            s.perf = None
    enum.populate_estimates(opts[:10])
    assert [o.total_perf for o in opts[:10]] == pytest.approx(before)


def test_proposer_works_inside_embedding_sharding_planner_with_torchrec_enumerator(setup):
    wl, topo, B = setup
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=B, constraints=wl.constraints(),
                                       proposer=SparseLiftProposer(topology=topo))
    plan = planner.plan(wl.module(), get_default_sharders())
    assert _tables(plan) == sorted(t[0] for t in wl.tables)


def test_enumerator_and_proposer_together_in_torchrec_planner(setup):
    wl, topo, B = setup
    planner = EmbeddingShardingPlanner(
        topology=topo, batch_size=B, constraints=wl.constraints(),
        enumerator=SparseLiftEnumerator(topology=topo, batch_size=B, constraints=wl.constraints()),
        proposer=SparseLiftProposer(topology=topo),
    )
    plan = planner.plan(wl.module(), get_default_sharders())
    assert _tables(plan) == sorted(t[0] for t in wl.tables)


def test_proposer_shrinks_memory_when_told_a_proposal_does_not_fit(setup):
    wl, topo, B = setup
    enum = SparseLiftEnumerator(topology=topo, batch_size=B, constraints=wl.constraints())
    opts = enum.enumerate(wl.module(), get_default_sharders())
    prop = SparseLiftProposer(topology=topo)
    prop.load(opts, enum)
    first = prop.propose()
    assert first is not None and len(first) == len(wl.tables)
    mem = lambda p: sum(s.storage.hbm for o in p for s in o.shards)  # noqa: E731
    seen = [mem(first)]
    for _ in range(4):
        prop.feedback(partitionable=False, plan=first, perf_rating=None)
        nxt = prop.propose()
        if nxt is None:
            break
        seen.append(mem(nxt))
    assert min(seen[1:]) <= seen[0]
    prop.feedback(partitionable=True, plan=first, perf_rating=1.0)
    assert prop.best_perf_rating == 1.0


def test_problem_from_options_infers_world_size_without_topology(setup):
    wl, topo, B = setup
    enum = SparseLiftEnumerator(topology=topo, batch_size=B, constraints=wl.constraints())
    opts = enum.enumerate(wl.module(), get_default_sharders())
    prob, index = problem_from_options(opts)
    assert prob.ctx.world_size == 16 and prob.ctx.local_world_size == 8
    assert len(index) == len(wl.tables)
