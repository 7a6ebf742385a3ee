"""SparseLiftPlanner on simulated topologies (meta-device modules, no GPU needed)."""

import logging
import warnings

import pytest
import torch
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ShardingPlan, ShardingPlanner

from torchrec_sparselift import SparseLiftPlanner, SparseLiftPlannerError
from torchrec_sparselift.semantics.reference_workloads import dcnv2, production

warnings.filterwarnings("ignore", category=FutureWarning)
GiB = 1024**3


def _topo(world_size, device="cuda", local=8, hbm=80 * GiB):
    return Topology(world_size=world_size, local_world_size=min(local, world_size),
                    compute_device=device, hbm_cap=hbm, ddr_cap=256 * GiB)


def _ebc(n=6, rows=1000, dim=64):
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows * (i + 1),
                                   feature_names=[f"f{i}"]) for i in range(n)],
        device=torch.device("meta"),
    )


def _plan(module, topology, batch_size=512, constraints=None, **kw):
    planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=constraints,
                                debug=False, **kw)
    result = planner.plan_with_result(module, get_default_sharders())
    return planner, result


def _check_plan(result, module_tables, topology):
    plan = result.sharding_plan
    assert isinstance(plan, ShardingPlan)
    seen = []
    for path, module_plan in plan.plan.items():
        for name, ps in module_plan.items():
            seen.append(name)
            assert ps.ranks and all(0 <= r < topology.world_size for r in ps.ranks)
    assert sorted(seen) == sorted(module_tables)
    # memory: every rank within its capacity (device memory on GPU)
    used = {}
    for opt in result.sharding_options:
        for s in opt.shards:
            used[s.rank] = used.get(s.rank, 0) + (s.storage.hbm if topology.compute_device != "cpu" else s.storage.ddr)
    cap = topology.devices[0].storage.hbm if topology.compute_device != "cpu" else topology.devices[0].storage.ddr
    assert max(used.values()) <= cap


def test_is_a_torchrec_sharding_planner():
    assert issubclass(SparseLiftPlanner, ShardingPlanner)


@pytest.mark.parametrize("world_size", [8, 16, 64])
def test_dcnv2_plan_places_every_table_once(world_size):
    wl = dcnv2()
    _, res = _plan(wl.module(), _topo(world_size), wl.per_rank_batch(world_size), wl.constraints())
    _check_plan(res, [t[0] for t in wl.tables], _topo(world_size))
    s = res.search
    assert s.lower_bound_s <= s.step.total_s
    assert s.gap >= 0


def test_plans_512_simulated_ranks():
    # how long it takes depends on the machine's load: benchmarks/load_sensitive.py prints it
    wl = production(120, seed=3)
    topo = _topo(512)
    _, res = _plan(wl.module(), topo, wl.per_rank_batch(512), wl.constraints(), time_budget_s=20)
    _check_plan(res, [t[0] for t in wl.tables], topo)


def test_same_input_gives_identical_plan():
    wl = production(40, seed=1)
    topo = _topo(16)
    _, a = _plan(wl.module(), topo, 1024, wl.constraints())
    _, b = _plan(wl.module(), topo, 1024, wl.constraints())
    assert str(a.sharding_plan) == str(b.sharding_plan)
    assert a.search.pipeline == b.search.pipeline


def test_row_wise_and_table_row_wise_offered_on_cpu():
    _, res = _plan(_ebc(4), _topo(4, device="cpu", local=2, hbm=0), 64)
    types = {c.sharding_type for c in res.problem.cands}
    assert {"row_wise", "table_row_wise", "table_wise", "column_wise", "data_parallel"} <= types


def test_cpu_plan_follows_constraint_to_row_wise():
    cons = {"t0": ParameterConstraints(sharding_types=["row_wise"])}
    topo = _topo(2, device="cpu", local=2, hbm=0)
    _, res = _plan(_ebc(3), topo, 64, cons)
    ps = res.sharding_plan.plan[""]["t0"]
    assert ps.sharding_type == "row_wise" and ps.ranks == [0, 1]


def test_constraints_restrict_sharding_types_and_kernels():
    cons = {
        "t1": ParameterConstraints(sharding_types=["column_wise"], min_partition=16),
        "t2": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm_caching"]),
    }
    _, res = _plan(_ebc(4), _topo(8), 512, cons)
    plan = res.sharding_plan.plan[""]
    assert plan["t1"].sharding_type == "column_wise"
    assert plan["t2"].sharding_type == "table_wise" and plan["t2"].compute_kernel == "fused_uvm_caching"


def test_embedding_collection_and_bags_in_one_model_are_planned():
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="seq0", embedding_dim=32, num_embeddings=5000, feature_names=["s0"])],
        device=torch.device("meta"),
    )
    model = torch.nn.ModuleDict({"bags": _ebc(3), "seq": ec})
    _, res = _plan(model, _topo(8), 256)
    assert set(res.sharding_plan.plan) == {"bags", "seq"}
    assert "seq0" in res.sharding_plan.plan["seq"]


def test_sequence_tables_never_get_the_dense_kernel_on_cpu():
    # TorchRec 1.8's dense kernel for EmbeddingCollection tables does not train on CPU
    # (tests/test_comm_semantics.py): small sequence tables, where data-parallel would be cheap,
    # must still come back with a fused model-parallel sharding.
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name=f"seq{i}", embedding_dim=16, num_embeddings=20, feature_names=[f"s{i}"])
                for i in range(4)],
        device=torch.device("meta"),
    )
    _, res = _plan(ec, Topology(world_size=2, local_world_size=2, compute_device="cpu"), 64)
    for ps in res.sharding_plan.plan[""].values():
        assert ps.compute_kernel != "dense" and ps.sharding_type != "data_parallel"
    with pytest.raises(ValueError, match="dense kernel of sequence tables"):
        _plan(ec, Topology(world_size=2, local_world_size=2, compute_device="cpu"), 64,
              {"seq0": ParameterConstraints(compute_kernels=["dense"])})


def test_table_too_big_names_the_table():
    model = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="huge", embedding_dim=128, num_embeddings=10**9, feature_names=["f"]),
                EmbeddingBagConfig(name="small", embedding_dim=16, num_embeddings=100, feature_names=["g"])],
        device=torch.device("meta"),
    )
    cons = {"huge": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])}
    with pytest.raises(PlannerError) as e:
        _plan(model, _topo(2, hbm=8 * GiB), 64, cons)
    assert "huge" in str(e.value) and "GiB" in str(e.value)
    assert isinstance(e.value, SparseLiftPlannerError)


def test_unknown_constraint_table_is_an_error():
    with pytest.raises(ValueError, match="nope"):
        _plan(_ebc(2), _topo(8), 64, {"nope": ParameterConstraints()})


def test_zero_batch_size_is_an_error():
    with pytest.raises(ValueError, match="batch_size"):
        SparseLiftPlanner(topology=_topo(8), batch_size=0)


def test_torchrec_search_components_are_reported_not_silently_used(caplog):
    from torchrec.distributed.planner.proposers import GreedyProposer

    with caplog.at_level(logging.WARNING, logger="torchrec_sparselift.planner"):
        SparseLiftPlanner(topology=_topo(8), batch_size=64, proposer=GreedyProposer())
    assert "not used" in caplog.text


def test_lossy_comm_only_when_allowed():
    wl = dcnv2()
    _, strict = _plan(wl.module(), _topo(64), wl.per_rank_batch(64), wl.constraints())
    assert (strict.search.fwd_precision, strict.search.bwd_precision) == ("fp32", "fp32")
    _, lossy = _plan(wl.module(), _topo(64), wl.per_rank_batch(64), wl.constraints(), allow_lossy_comm=True)
    assert lossy.search.step.total_s <= strict.search.step.total_s * (1 + 1e-9)


def test_semi_sync_requires_allow_staleness():
    with pytest.raises(ValueError, match="allow_staleness"):
        SparseLiftPlanner(topology=_topo(8), batch_size=64, pipelines=["semi_sync"])


def test_exact_milp_never_worse_than_heuristic_and_tightens_bound():
    wl = production(6, seed=5)
    topo = _topo(4, local=4)
    _, heur = _plan(wl.module(), topo, 512, wl.constraints(), solver="heuristic")
    _, exact = _plan(wl.module(), topo, 512, wl.constraints(), solver="milp", time_budget_s=8)
    assert exact.search.step.total_s <= heur.search.step.total_s * (1 + 1e-9)
    assert exact.search.lower_bound_s >= heur.search.lower_bound_s * (1 - 1e-6)
    assert exact.search.lower_bound_s <= exact.search.step.total_s * (1 + 1e-9)


def test_2d_planning_returns_group_local_plan_with_sync_interval():
    wl = production(20, seed=2)
    topo = _topo(16)
    planner, res = _plan(wl.module(), topo, 256, wl.constraints(), sharding_group_size=4, sync_interval=8,
                         max_sync_interval=8)  # above the default bound (4): the explicit allowance
    assert res.sharding_group_size == 4 and res.sync_interval == 8
    ranks = {r for mp in res.sharding_plan.plan.values() for ps in mp.values() for r in ps.ranks}
    assert ranks <= set(range(4))
    assert res.sync_s > 0
    opt = res.optimizations()
    assert opt.sharding_group_size == 4 and opt.sync_interval == 8


def test_auto_group_size_considers_1d_and_2d():
    wl = production(20, seed=2)
    _, res = _plan(wl.module(), _topo(32), 256, wl.constraints(), sharding_group_size="auto")
    sizes = [g for g, _ in res.alternatives_2d]
    assert 32 in sizes and min(sizes) < 32
    best = min(s for _, s in res.alternatives_2d)
    assert res.step_time_s <= best * (1 + 1e-9)


def test_group_size_must_divide_world():
    with pytest.raises(ValueError, match="divisor"):
        SparseLiftPlanner(topology=_topo(16), batch_size=64, sharding_group_size=3)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_memory_caps_are_the_caps_the_search_planned_under(device):
    import numpy as np

    topo = _topo(4, device=device, hbm=2 * GiB)
    planner, result = _plan(_ebc(), topo, time_budget_s=1)
    dev, host = planner.memory_caps(_ebc())
    assert np.array_equal(dev, result.problem.device_cap) and np.array_equal(host, result.problem.host_cap)
    assert len(dev) == 4 and dev.max() < (2 * GiB if device == "cuda" else 256 * GiB)  # reservation applied
    if device == "cpu":
        assert np.array_equal(dev, host)
