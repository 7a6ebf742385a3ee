"""Layout2D: the groups priced are the groups TorchRec's DMPCollection forms (2 and 4 hosts)."""

import types

import pytest
import torch

from torchrec_sparselift.semantics.layout import Layout2D, layouts_to_price


class _RecordingMesh:
    """Stands in for DeviceMesh inside DMPCollection._create_process_groups: keeps the rank matrix."""

    last = None

    def __init__(self, device_type, mesh, mesh_dim_names):
        assert tuple(mesh_dim_names) == ("replicate", "shard")
        _RecordingMesh.last = [list(row) for row in mesh]

    def get_group(self, mesh_dim):
        return None

    def __getitem__(self, name):
        return name


def _dmp_groups(monkeypatch, world, group, use_inter_host_allreduce):
    """(sharding groups, replica groups) from TorchRec's own group-forming and plan-remapping code."""
    import torchrec.distributed.model_parallel as mp
    from torchrec.distributed.types import ParameterSharding, ShardingPlan

    monkeypatch.setattr(mp, "DeviceMesh", _RecordingMesh)
    fake = types.SimpleNamespace(_device=torch.device("cpu"))
    mp.DMPCollection._create_process_groups(
        fake, global_rank=0, world_size=world, local_size=group,
        use_inter_host_allreduce=use_inter_host_allreduce,
    )
    mesh = _RecordingMesh.last  # rows: one per sharding group ("shard" dim), columns: replicas
    sharding = {tuple(row) for row in mesh}
    replica = {tuple(row[s] for row in mesh) for s in range(group)}
    # the plan remapping must place each rank's shards on the ranks of its mesh row
    for rank in range(world):
        plan = ShardingPlan({"m": {"t": ParameterSharding(
            sharding_type="row_wise", compute_kernel="fused", ranks=list(range(group)))}})
        mp.DMPCollection._remap_sharding_plan(
            fake, plan, rank, world // group, group, use_inter_host_allreduce)
        holders = tuple(plan.plan["m"]["t"].ranks)
        assert rank in holders and holders in sharding
    return sharding, replica


@pytest.mark.parametrize("world,hosts", [(16, 2), (32, 4)])
@pytest.mark.parametrize("kind", ["strided", "contiguous"])
def test_layout_groups_are_the_groups_dmpcollection_forms(monkeypatch, world, hosts, kind):
    per_host = world // hosts
    for group in (2, 4, 8, 16):
        layout = Layout2D(world, per_host, group, kind)
        sharding, replica = _dmp_groups(monkeypatch, world, group, layout.use_inter_host_allreduce)
        assert set(layout.sharding_groups) == sharding
        assert set(layout.replica_groups) == replica


def test_where_each_collective_runs_on_two_hosts():
    strided = Layout2D(16, 8, 8, "strided")
    contiguous = Layout2D(16, 8, 8, "contiguous")
    # TorchRec's default: all-to-all over both hosts, replica all-reduce inside a host
    assert (strided.group_hosts, strided.group_ranks_per_host, strided.replica_hosts) == (2, 4, 1)
    assert (contiguous.group_hosts, contiguous.group_ranks_per_host, contiguous.replica_hosts) == (1, 8, 2)
    assert not strided.use_inter_host_allreduce and contiguous.use_inter_host_allreduce


def test_layout_round_trips_and_refuses_with_the_fix():
    layout = Layout2D(32, 8, 4, "contiguous")
    assert Layout2D.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="pick one of"):
        Layout2D(16, 8, 3)
    with pytest.raises(ValueError, match="contiguous"):
        Layout2D(16, 8, 8, "diagonal")
    with pytest.raises(ValueError, match="ranks per host"):
        Layout2D(24, 8, 12, "contiguous")  # 8 ranks on one host, 4 on the next
    assert [lay.kind for lay in layouts_to_price(8, 8, 4)] == ["strided"]  # one host: one layout
    assert [lay.kind for lay in layouts_to_price(16, 8, 4)] == ["contiguous", "strided"]


# -- the planner prices the layout it returns --------------------------------------------------

GiB = 1024**3


def _planner(world, **kw):
    from torchrec.distributed.planner import Topology

    from torchrec_sparselift import SparseLiftPlanner

    topo = Topology(world_size=world, local_world_size=8, compute_device="cuda",
                    hbm_cap=80 * GiB, ddr_cap=256 * GiB)
    return SparseLiftPlanner(topology=topo, batch_size=256, debug=False, time_budget_s=2, **kw)


@pytest.mark.parametrize("world", [16, 32])
def test_planner_prices_both_layouts_and_returns_the_layout_it_priced(world):
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.cost.two_d import replica_sync_s
    from torchrec_sparselift.semantics.reference_workloads import production

    wl = production(12, seed=3)
    planner = _planner(world, constraints=wl.constraints(), sharding_group_size=8)
    res = planner.plan_with_result(wl.module(), get_default_sharders())
    kinds = {kind: step for g, kind, step in res.alternatives_layout if g == 8}
    assert set(kinds) == {"strided", "contiguous"}
    assert res.step_time_s == pytest.approx(min(kinds.values()), rel=1e-6) or res.step_time_s < min(kinds.values())
    lay = res.layout_2d
    assert lay is not None and lay.world_size == world and lay.group_size == 8
    # the all-to-all was priced on the hosts the group really spans
    assert res.problem.ctx.local_world_size == lay.group_ranks_per_host
    # and the sync on the link the replica group really uses
    other = Layout2D(world, 8, 8, "strided" if lay.contiguous else "contiguous")
    assert (replica_sync_s(1e9, lay, res.profile) < replica_sync_s(1e9, other, res.profile)) == (
        lay.replica_sync_intra_host and not other.replica_sync_intra_host
    ) or lay.replica_sync_intra_host == other.replica_sync_intra_host
    opt = res.optimizations()
    assert opt.layout_2d == lay and opt.max_sync_interval == res.max_sync_interval


def test_sync_interval_is_bounded_and_going_beyond_needs_the_bound_raised():
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.cost.two_d import DEFAULT_MAX_SYNC_INTERVAL, choose_sync_interval
    from torchrec_sparselift.semantics.reference_workloads import production

    # a sync 1000x the step would want the longest interval: the bound caps it
    assert choose_sync_interval(1e-3, 1.0) == DEFAULT_MAX_SYNC_INTERVAL
    assert choose_sync_interval(1e-3, 1.0, max_sync_interval=100) == 100
    assert choose_sync_interval(1e-3, 1e-6) == 1
    with pytest.raises(ValueError, match="max_sync_interval=100"):
        _planner(16, sharding_group_size=8, sync_interval=100)
    wl = production(8, seed=1)
    res = _planner(16, constraints=wl.constraints(), sharding_group_size=8, layout_2d="contiguous",
                   sync_interval=64, max_sync_interval=64).plan_with_result(wl.module(), get_default_sharders())
    assert res.sync_interval == 64 and res.layout_2d.kind == "contiguous"
    assert "NOT covered" in res.summary() or "measured" in res.summary()


# -- lift builds DMPCollection from the plan's layout (4 gloo ranks, 2 simulated hosts) --------


def _lift_worker(rank, world, kind):
    import attrs
    import torch.distributed as dist
    from test_two_d_runtime import _model_and_plan

    from torchrec_sparselift.plan import Optimizations
    from torchrec_sparselift.runtime.model_parallel import lift

    layout = Layout2D(world, 2, 2, kind)

    @attrs.frozen
    class Plan:  # duck-typed execution plan: what lift reads
        sharding_plan: object
        optimizations: object

    net, plan, sharder = _model_and_plan()
    opt = Optimizations(sharding_group_size=2, sync_interval=2, layout_2d=layout)
    lifted = lift(net, Plan(plan, opt), pg=dist.group.WORLD, device=torch.device("cpu"),
                  sharders=[sharder], pipeline="sparse_dist",
                  dense_optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1))
    ctx = lifted.model._default_ctx
    return (ctx.use_inter_host_allreduce, dist.get_process_group_ranks(ctx.sharding_pg),
            dist.get_process_group_ranks(ctx.replica_pg))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["contiguous", pytest.param("strided", marks=pytest.mark.slow)])
def test_lift_builds_dmpcollection_with_the_plans_layout(kind):
    from launcher import run_ranks

    layout = Layout2D(4, 2, 2, kind)
    for rank, (inter, sharding, replica) in enumerate(run_ranks(_lift_worker, 4, kind, timeout_s=240)):
        assert inter == layout.use_inter_host_allreduce
        assert tuple(sharding) in layout.sharding_groups and rank in sharding
        assert tuple(replica) in layout.replica_groups and rank in replica


def test_2d_plans_use_a_pipeline_that_runs_the_replica_sync():
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.cost.two_d import SYNC_PIPELINES_2D
    from torchrec_sparselift.runtime.pipelines import _SYNC_INTERVAL_KINDS
    from torchrec_sparselift.semantics.reference_workloads import production

    assert set(SYNC_PIPELINES_2D) == set(_SYNC_INTERVAL_KINDS)
    wl = production(8, seed=1)
    res = _planner(16, constraints=wl.constraints(), sharding_group_size=8).plan_with_result(
        wl.module(), get_default_sharders())
    assert res.optimizations().pipeline in SYNC_PIPELINES_2D


def test_a_cached_2d_plan_must_match_the_asked_layout_and_bound(tmp_path):
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.semantics.reference_workloads import production

    wl = production(6, seed=4)
    kw = dict(constraints=wl.constraints(), sharding_group_size=8, cache_dir=str(tmp_path))
    ep = _planner(16, layout_2d="contiguous", **kw).plan_execution(wl.module(), get_default_sharders())
    assert ep.optimizations.layout_2d.kind == "contiguous"
    req = _planner(16, layout_2d="strided", **kw).request(wl.module(), get_default_sharders())
    assert "layout" in req.refuses(ep)
    assert req.max_sync_interval == 2  # the default bound (defaults.MAX_SYNC_INTERVAL)
