"""2D strategies (DMPCollection's ShardingStrategy): priced, chosen, recorded, built; per-module 2D settings."""

import attrs
import pytest
import torch

from torchrec_sparselift import vocabulary as v
from torchrec_sparselift.cost.hardware import get_profile
from torchrec_sparselift.cost.two_d import fully_sharded_s, replica_sync_s, two_d_memory
from torchrec_sparselift.search.two_d import strategies_to_price
from torchrec_sparselift.semantics.layout import Layout2D

GiB = 1 << 30


def test_fully_sharded_moves_the_weights_twice_every_step_and_default_once_per_interval():
    prof = attrs.evolve(get_profile("h100"), supports_overlap=False, collective_latency_s=0.0)
    lay = Layout2D(16, 8, 8, "contiguous")  # 2 replicas, replica groups across the hosts
    w = 1e9
    one_way = (lay.num_replicas - 1) / lay.num_replicas * w * prof.reduce_scatter_factor / prof.inter_host_bw
    assert fully_sharded_s(w, lay, prof) == pytest.approx(2 * one_way)
    # the default strategy's all-reduce moves the same bytes, once per sync
    assert replica_sync_s(w, lay, prof) == pytest.approx(2 * one_way / prof.reduce_scatter_factor)
    # where communication overlaps, the reduce-scatter hides behind the dense work
    overlapping = attrs.evolve(prof, supports_overlap=True)
    assert fully_sharded_s(w, lay, overlapping, dense_s=10.0) == pytest.approx(one_way)
    assert fully_sharded_s(w, Layout2D(16, 8, 16), prof) == 0.0  # one replica: nothing to sync


def test_fully_sharded_frees_weights_only_through_the_dense_part():
    fs = two_d_memory("fully_sharded", weight_bytes=4000, optimizer_bytes=100, num_replicas=4)
    d = two_d_memory("default", weight_bytes=4000, optimizer_bytes=100, num_replicas=4)
    assert fs.peak_bytes == d.peak_bytes == 4100  # the embedding backward needs the full weights
    assert (fs.dense_phase_bytes, d.dense_phase_bytes) == (1100, 4100)
    assert fs.freed_bytes == 3000 and d.freed_bytes == 0


def test_fully_sharded_is_never_offered_on_cpu_and_the_reason_is_the_measured_one():
    offered, refused = strategies_to_price("auto", "cpu")
    assert offered == ("default",)
    assert [n for n, _ in refused] == ["fully_sharded"] and "torch.cuda.Stream" in refused[0][1]
    assert strategies_to_price("auto", "cuda") == (v.STRATEGIES_2D, ())
    with pytest.raises(ValueError, match="torch.cuda.Stream"):
        strategies_to_price("fully_sharded", "cpu")
    with pytest.raises(ValueError, match="drop sync_interval"):
        strategies_to_price("fully_sharded", "cuda", sync_interval=4)


def _gpu_planner(**kw):
    from torchrec.distributed.planner.types import Topology

    from torchrec_sparselift import SparseLiftPlanner

    topo = Topology(world_size=16, local_world_size=8, compute_device="cuda", hbm_cap=80 * GiB, ddr_cap=256 * GiB)
    return SparseLiftPlanner(topology=topo, batch_size=256, debug=False, time_budget_s=1.5, **kw)


def test_gpu_planner_prices_both_strategies_keeps_the_faster_and_the_plan_records_it():
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.plan import ExecutionPlan
    from torchrec_sparselift.semantics.reference_workloads import production

    wl = production(8, seed=1)
    planner = _gpu_planner(constraints=wl.constraints(), sharding_group_size=8, layout_2d="contiguous")
    ep = planner.plan_execution(wl.module(), get_default_sharders())
    res = planner.last_result
    priced = dict(res.replica_sync.alternatives)
    assert set(priced) == {"default", "fully_sharded"}
    assert res.sync_s == pytest.approx(min(priced.values()))
    assert ep.optimizations.strategy_2d == res.strategy_2d == min(priced, key=priced.get)
    assert ExecutionPlan.from_json(ep.to_json()).optimizations.strategy_2d == res.strategy_2d
    assert "2D strategy" in res.summary()
    # pinned: the plan keeps it, and a cached plan of the other strategy is refused
    pinned = _gpu_planner(constraints=wl.constraints(), sharding_group_size=8, layout_2d="contiguous",
                          strategy_2d="fully_sharded").plan_with_result(wl.module(), get_default_sharders())
    assert pinned.strategy_2d == "fully_sharded" and pinned.sync_interval == 1
    req = _gpu_planner(constraints=wl.constraints(), sharding_group_size=8, strategy_2d="default").request(
        wl.module(), get_default_sharders())
    other = attrs.evolve(ep, optimizations=attrs.evolve(ep.optimizations, strategy_2d="fully_sharded"))
    assert "strategy" in (req.refuses(other) or "")


def test_cpu_planner_refuses_a_pinned_fully_sharded_and_plans_default():
    from torchrec.distributed.planner.types import Topology

    from torchrec_sparselift import SparseLiftPlanner

    topo = Topology(world_size=4, local_world_size=2, compute_device="cpu")
    with pytest.raises(ValueError, match="does not run on CPU|cannot be planned"):
        SparseLiftPlanner(topology=topo, sharding_group_size=2, strategy_2d="fully_sharded")
    with pytest.raises(ValueError, match="strategy_2d has no effect here: it needs sharding_group_size"):
        SparseLiftPlanner(topology=topo, strategy_2d="fully_sharded")  # 1D: a 2D strategy does not apply


# -- runtime: 2 gloo ranks ------------------------------------------------------------------


def _nets():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="t0", embedding_dim=8, num_embeddings=40, feature_names=["f0"])], device=torch.device("meta"))
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
                name="s0", embedding_dim=8, num_embeddings=30, feature_names=["g0"])], device=torch.device("meta"))
            self.lin = torch.nn.Linear(16, 1)

        def forward(self, pooled, seq):
            a = self.ebc(pooled)["f0"]
            b = self.ec(seq)["g0"].values()  # one id per sample
            return self.lin(torch.cat([a, b], dim=1)).squeeze(1)

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    ebc_sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    ec_sharder = EmbeddingCollectionSharder(fused_params=fused)
    net = Net()
    ebc_plan = construct_module_sharding_plan(net.ebc, {"t0": table_wise(rank=0, compute_kernel="fused")},
                                              sharder=ebc_sharder, local_size=1, world_size=1, device_type="cpu")
    ec_plan = construct_module_sharding_plan(net.ec, {"s0": table_wise(rank=1, compute_kernel="fused")},
                                             sharder=ec_sharder, local_size=2, world_size=2, device_type="cpu")
    return net, ShardingPlan({"ebc": ebc_plan}), ShardingPlan({"ec": ec_plan}), [ebc_sharder, ec_sharder]


def _per_module_worker(rank, world):
    import torch.distributed as dist
    from torchrec import EmbeddingCollection, KeyedJaggedTensor

    from torchrec_sparselift.plan import Optimizations
    from torchrec_sparselift.runtime.model_parallel import lift
    from torchrec_sparselift.runtime.two_d import ModuleTwoD

    @attrs.frozen
    class Plan:  # what lift reads of an execution plan
        sharding_plan: object
        optimizations: object

    out = {}
    net, ebc_plan, ec_plan, sharders = _nets()
    fs = Optimizations(sharding_group_size=1, strategy_2d="fully_sharded", layout_2d=Layout2D(2, 2, 1))
    try:
        lift(net, Plan(ebc_plan, fs), pg=dist.group.WORLD, device=torch.device("cpu"), sharders=sharders)
    except ValueError as e:
        out["fully_sharded"] = str(e)

    torch.manual_seed(rank)  # replicas start apart on purpose
    net, ebc_plan, ec_plan, sharders = _nets()
    opt = Optimizations(sharding_group_size=1, sync_interval=3, layout_2d=Layout2D(2, 2, 1))
    lifted = lift(net, Plan(ebc_plan, opt), pg=dist.group.WORLD, device=torch.device("cpu"), sharders=sharders,
                  submodule_configs=[ModuleTwoD(EmbeddingCollection, ec_plan, sharding_group_size=2)],
                  pipeline="sparse_dist", dense_optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
    model = lifted.model
    out["periods"] = (lifted.sync_period, lifted.step_timer().period)
    out["groups"] = [(ctx.module.__name__ if ctx.module else None, dist.get_world_size(ctx.replica_pg),
                      dist.get_world_size(ctx.sharding_pg)) for ctx in model._ctxs]
    gen = torch.Generator().manual_seed(100 + rank)
    opt_ = lifted.optimizer
    for _ in range(3):
        ids = torch.randint(0, 30, (6,), generator=gen)
        pooled = KeyedJaggedTensor(keys=["f0"], values=ids, lengths=torch.ones(6, dtype=torch.long))
        seq = KeyedJaggedTensor(keys=["g0"], values=ids, lengths=torch.ones(6, dtype=torch.long))
        loss = model(pooled, seq).pow(2).mean()
        loss.backward()
        opt_.step()
        opt_.zero_grad()
        model.step_done()
    ebc_w = model._ctxs[0].weights_by_dtype[torch.float32][0].detach().clone()
    both = [torch.empty_like(ebc_w) for _ in range(2)]
    dist.all_gather(both, ebc_w)
    out["ebc_replicas_equal"] = bool(torch.equal(both[0], both[1]))
    out["finite"] = bool(torch.isfinite(loss))
    return out


@pytest.mark.multiprocess
def test_lift_refuses_fully_sharded_on_cpu_and_gives_modules_their_own_2d_settings():
    from launcher import run_ranks

    for res in run_ranks(_per_module_worker, 2, timeout_s=240, retry_native_abort=True):
        assert "torch.cuda.Stream" in res["fully_sharded"] and "'default'" in res["fully_sharded"]
        # default context: groups of 1 rank, 2 replicas; EmbeddingCollection: one group of 2 ranks
        assert res["groups"] == [(None, 2, 1), ("EmbeddingCollection", 1, 2)]
        assert res["ebc_replicas_equal"] and res["finite"]  # the third step synced
        assert res["periods"] == (3, 3)  # its steps are timed over whole sync intervals
