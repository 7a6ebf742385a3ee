"""PlanRequest: every field changes the key, and no cached plan bypasses the request's guards.

The bug these pin: the fingerprint left out the planner's options, so with a shared
``cache_dir`` a plan made by a planner allowing staleness, lossy/fp8 comms or 2D was handed to one
that forbids them (or expects a 1D plan).
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from typing import Any, Callable, Dict

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import get_default_sharders
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.cost.hardware import PRESETS, profile_for_topology
from torchrec_sparselift.cost.model import DenseWork
from torchrec_sparselift.plan import (
    COMM_PRECISIONS,
    PIPELINES,
    ExecutionPlan,
    Optimizations,
    PlanCache,
    PlanRequest,
    Prediction,
)
from torchrec_sparselift.plan.request import LIVE_FIELDS
from torchrec_sparselift.semantics.tables import TableSpec
from torchrec_sparselift.semantics.workload import declare

warnings.filterwarnings("ignore", category=FutureWarning)
GiB = 1024**3
LOGGER = "torchrec_sparselift.plan.cache"
ALL_PRECISIONS = [(f, b) for f in COMM_PRECISIONS for b in COMM_PRECISIONS]


def _topo(world: int = 8, local: int = 4, hbm: int = 16 * GiB) -> Topology:
    return Topology(world_size=world, local_world_size=local, compute_device="cuda", hbm_cap=hbm,
                    ddr_cap=64 * GiB)


def _spec(i: int, rows: int = 1000, dim: int = 64) -> TableSpec:
    return TableSpec(module_path="ebc", name=f"t{i}", num_embeddings=rows * (i + 1), embedding_dim=dim,
                     feature_names=(f"f{i}",), pooling_factor=1.0, is_pooled=True, elem_bytes=4,
                     sharding_types=("table_wise", "row_wise"),
                     compute_kernels=(("table_wise", ("fused",)), ("row_wise", ("fused",))),
                     batch_size=128)


def _cb_a(options: Any) -> Any:
    return options


def _cb_b(options: Any) -> Any:
    return options


def _request(**kw: Any) -> PlanRequest:
    topo = kw.pop("topology", _topo())
    base: Dict[str, Any] = dict(
        tables=tuple(_spec(i) for i in range(3)), topology=topo, batch_size=128,
        hardware=profile_for_topology(topo, PRESETS["h100"]),
        storage_reservation=HeuristicalStorageReservation(percentage=0.15),
    )
    base.update(kw)
    return PlanRequest(**base)


def _other(choices: Any, value: Any) -> Any:
    return next(c for c in choices if c != value)


# One mutation per field: each returns a value that differs from the request's. A new field
# without an entry here fails test_every_field_has_a_mutation.
MUTATIONS: Dict[str, Callable[[PlanRequest], Any]] = {
    "tables": lambda r: r.tables[:-1] + (attrs.evolve(r.tables[-1], num_embeddings=r.tables[-1].num_embeddings + 1),),
    "topology": lambda r: _topo(world=r.topology.world_size * 2, local=r.topology.local_world_size),
    "batch_size": lambda r: r.batch_size + 1,
    "constraints": lambda r: {**r.constraints, "t0": ParameterConstraints(min_partition=8 + len(r.constraints))},
    "stats": lambda r: declare(f0=2.0 if r.stats is None else r.stats.pooling_factor("f0", 1.0) + 1.0),
    "hardware": lambda r: attrs.evolve(r.hardware, hbm_bw=r.hardware.hbm_bw * 1.5),
    "dense": lambda r: DenseWork(param_bytes=r.dense.param_bytes + 1.0,
                                 fwd_flops_per_sample=r.dense.fwd_flops_per_sample),
    "sharders": lambda r: r.sharders + ("my.Sharder",),
    "storage_reservation": lambda r: HeuristicalStorageReservation(
        percentage=0.3 if r.storage_reservation is None or r.storage_reservation._percentage != 0.3 else 0.2),
    "callbacks": lambda r: r.callbacks + ((_cb_b,) if _cb_a in r.callbacks else (_cb_a,)),
    "pipelines": lambda r: r.pipelines[:-1] if len(r.pipelines) > 1 else _other(
        [("base",), ("fused",)], r.pipelines),
    "precisions": lambda r: r.precisions + (next(p for p in ALL_PRECISIONS if p not in r.precisions),),
    "allow_lossy_comm": lambda r: not r.allow_lossy_comm,
    "allow_fp8": lambda r: not r.allow_fp8,
    "allow_staleness": lambda r: not r.allow_staleness,
    "solver": lambda r: _other(["auto", "heuristic", "milp"], r.solver),
    "time_budget_s": lambda r: r.time_budget_s + 1.0,
    "sharding_group_size": lambda r: _other([None, "auto", 2, 4], r.sharding_group_size),
    "sync_interval": lambda r: _other([None, 1, 3], r.sync_interval),
    "cost_model": lambda r: _other(["sparselift", "torchrec"], r.cost_model),
    "max_sync_interval": lambda r: _other([None, 4, 16], r.max_sync_interval),
    "layout_2d": lambda r: _other(["auto", "contiguous", "strided"], r.layout_2d),
    "strategy_2d": lambda r: _other(["auto", "default", "fully_sharded"], r.strategy_2d),
    "measured_guard": lambda r: _other([None, 0.1, 0.2], r.measured_guard),
    "never_slower": lambda r: _other(["auto", True, False], r.never_slower),
    "rewrites": lambda r: r.rewrites[1:] if r.rewrites else ("batch_split",),
    "per_sample": lambda r: not r.per_sample,
}


def test_every_field_has_a_mutation():
    fields = {f.name for f in attrs.fields(PlanRequest)} - {"handles", *LIVE_FIELDS}
    assert fields == set(MUTATIONS), (
        f"add a mutation for {sorted(fields - set(MUTATIONS))} (and drop {sorted(set(MUTATIONS) - fields)})"
    )


_pipelines = st.lists(st.sampled_from(PIPELINES), min_size=1, max_size=5, unique=True).map(tuple)
_precisions = st.lists(st.sampled_from(ALL_PRECISIONS), min_size=1, max_size=4, unique=True).map(tuple)
_requests = st.builds(
    _request,
    batch_size=st.integers(1, 4096),
    pipelines=_pipelines,
    precisions=_precisions,
    allow_lossy_comm=st.booleans(), allow_fp8=st.booleans(), allow_staleness=st.booleans(),
    solver=st.sampled_from(["auto", "heuristic", "milp"]),
    time_budget_s=st.floats(0.5, 60),
    sharding_group_size=st.sampled_from([None, "auto", 2, 4]),
    sync_interval=st.sampled_from([None, 1, 5]),
    stats=st.sampled_from([None, declare(f0=3.0)]),
    callbacks=st.sampled_from([(), (_cb_a,)]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=_requests, field=st.sampled_from(sorted(MUTATIONS)))
def test_requests_differing_in_any_one_field_get_different_keys(base, field):
    changed = attrs.evolve(base, **{field: MUTATIONS[field](base)})
    assert changed != base
    assert changed.digest() != base.digest()  # what ranks compare: every field
    if field == "stats":
        # Statistics are compared after loading, within the drift tolerance (not keyed).
        assert changed.cache_key() == base.cache_key()
    else:
        assert changed.cache_key() != base.cache_key()


def test_equal_requests_get_equal_keys_and_live_objects_compare_by_description():
    a = _request(callbacks=(_cb_a,))
    b = _request(callbacks=(_cb_a,), tables=tuple(reversed(a.tables)))  # order is irrelevant
    assert a == b and hash(a) == hash(b)
    assert a.cache_key() == b.cache_key() and a.digest() == b.digest()
    # the state reserve() leaves on the reservation is not configuration
    used = HeuristicalStorageReservation(percentage=0.15)
    used._dense_storage = object()
    assert _request(storage_reservation=used).cache_key() == _request().cache_key()


def test_request_validators_name_the_field():
    with pytest.raises(ValueError, match="pipelines"):
        _request(pipelines=("warp",))
    with pytest.raises(ValueError, match="precisions"):
        _request(precisions=(("fp32", "int3"),))
    with pytest.raises(ValueError, match="solver"):
        _request(solver="fast")
    with pytest.raises(ValueError, match="sharding_group_size"):
        _request(sharding_group_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        _request(batch_size=0)


# ------------------------------------------------------------------------------------------------
# no cached plan bypasses the guards
# ------------------------------------------------------------------------------------------------


def _sharding_plan(request: PlanRequest, ranks: int) -> ShardingPlan:
    params = {
        t.name: ParameterSharding(
            sharding_type="table_wise", compute_kernel="fused", ranks=[i % ranks],
            sharding_spec=EnumerableShardingSpec([ShardMetadata(
                [0, 0], [t.num_embeddings, t.embedding_dim], f"rank:{i % ranks}/cuda:{i % ranks}")]))
        for i, t in enumerate(request.tables)
    }
    return ShardingPlan(plan={"ebc": EmbeddingModuleShardingPlan(params)})


def _stored(request: PlanRequest, opt: Optimizations) -> ExecutionPlan:
    ranks = opt.sharding_group_size or request.world_size
    return ExecutionPlan(
        sharding_plan=_sharding_plan(request, ranks), optimizations=opt,
        prediction=Prediction(step_time_s=1e-3, lower_bound_s=1e-3, cost_model="test"),
        fingerprint=request.fingerprint(), stats=request.stats,
    )


def _admissible(request: PlanRequest, opt: Optimizations) -> bool:
    """Written independently of PlanRequest.refuses: what the request allows."""
    if opt.pipeline not in request.pipelines:
        return False
    if (opt.fwd_comm_precision, opt.bwd_comm_precision) not in request.precisions:
        return False
    g, want = opt.sharding_group_size, request.sharding_group_size
    if g is not None and request.sync_interval is not None and opt.sync_interval != request.sync_interval:
        return False  # a pinned sync interval binds whatever the group size setting
    if g is not None and request.max_sync_interval is not None and opt.sync_interval > request.max_sync_interval:
        return False
    if want is None:
        return g is None
    if want == "auto":
        return g is None or (g < request.world_size and request.world_size % g == 0)
    return g == (None if want >= request.world_size else want)


_optimizations = st.builds(
    lambda p, prec, g, si: Optimizations(pipeline=p, fwd_comm_precision=prec[0], bwd_comm_precision=prec[1],
                                         sharding_group_size=g, sync_interval=si if g else 1),
    st.sampled_from(PIPELINES), st.sampled_from(ALL_PRECISIONS), st.sampled_from([None, 2, 4, 8]),
    st.sampled_from([1, 3, 5]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_requests, stored=_optimizations)
def test_no_cached_plan_comes_back_with_what_the_request_does_not_allow(tmp_path_factory, request, stored):
    """Even a stored plan filed under the request's own key (a collision, an older SparseLift,
    a hand-copied file) comes back only if the request allows its pipeline, precision and layout."""
    cache = PlanCache(tmp_path_factory.mktemp("cache"))
    cache.store(_stored(request, stored))
    got = cache.load(request.fingerprint(), request.stats, request=request)
    if got is None:
        assert not _admissible(request, stored)
        fresh = _stored(request, Optimizations(pipeline=request.pipelines[0],
                                               fwd_comm_precision=request.precisions[0][0],
                                               bwd_comm_precision=request.precisions[0][1]))
        plan, hit = cache.get_or_plan(request.fingerprint(), lambda: fresh, request.stats, request=request)
        assert not hit and plan is fresh
    else:
        assert _admissible(request, stored)
        o = got.optimizations
        assert o.pipeline in request.pipelines
        assert (o.fwd_comm_precision, o.bwd_comm_precision) in request.precisions
        assert request.sharding_group_size is not None or o.sharding_group_size is None


def test_refused_plan_replans_with_one_log_line(tmp_path, caplog):
    request = _request(pipelines=("sparse_dist",))
    cache = PlanCache(tmp_path)
    cache.store(_stored(request, Optimizations(pipeline="semi_sync")))
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert cache.load(request.fingerprint(), request=request) is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and lines[0].startswith("re-planning:")
    assert "pipeline 'semi_sync' is not allowed" in lines[0]


@pytest.mark.parametrize("damage, reason", [
    (lambda plan: {"other": plan.plan["ebc"]}, "does not place tables"),
    (lambda plan: {"ebc": EmbeddingModuleShardingPlan({**plan.plan["ebc"], "ghost": plan.plan["ebc"]["t0"]})},
     "the model does not have"),
    (lambda plan: {"ebc": EmbeddingModuleShardingPlan({
        k: ParameterSharding(sharding_type=v.sharding_type, compute_kernel=v.compute_kernel, ranks=[99])
        for k, v in plan.plan["ebc"].items()})}, "outside 0..7"),
])
def test_plan_for_other_tables_or_ranks_is_refused(damage, reason):
    request = _request()
    good = _stored(request, Optimizations())
    assert request.refuses(good) is None
    bad = attrs.evolve(good, sharding_plan=ShardingPlan(plan=damage(good.sharding_plan)))
    assert reason in request.refuses(bad)


# ------------------------------------------------------------------------------------------------
# the bug through the planner, with a shared cache_dir
# ------------------------------------------------------------------------------------------------


def _model() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=200_000 * (i + 1),
                                   feature_names=[f"f{i}"]) for i in range(4)],
        device=torch.device("meta"),
    )


def _planner(cache_dir, **kw) -> SparseLiftPlanner:
    return SparseLiftPlanner(topology=_topo(world=8, local=2), batch_size=2048, debug=False,
                             cache_dir=str(cache_dir), solver="heuristic", time_budget_s=1.0, **kw)


PERMISSIVE = [
    dict(allow_staleness=True, pipelines=["semi_sync"]),
    dict(allow_lossy_comm=True, allow_fp8=True),
    dict(sharding_group_size=2),
]


@pytest.mark.parametrize("options", PERMISSIVE, ids=["staleness", "lossy-fp8", "2d"])
def test_plan_cached_by_a_permissive_planner_is_not_reused_by_a_strict_one(tmp_path, caplog, options):
    model = _model()
    loose = _planner(tmp_path, **options)
    loose_plan = loose.plan_execution(model, get_default_sharders())
    o = loose_plan.optimizations
    if "pipelines" in options:
        assert o.pipeline == "semi_sync"
    if "sharding_group_size" in options:
        assert o.sharding_group_size == 2
    if options.get("allow_lossy_comm"):
        assert o.fwd_comm_precision != "fp32"  # the permissive plan really uses what it may

    strict = _planner(tmp_path)  # forbids staleness, lossy comms, fp8 and 2D
    assert strict.fingerprint(model).cache_key() != loose.fingerprint(model).cache_key()
    caplog.set_level(logging.INFO, logger=LOGGER)
    plan = strict.plan_execution(model, get_default_sharders())
    assert strict.last_cache_hit is False
    s = plan.optimizations
    assert s.pipeline in ("base", "sparse_dist", "fused", "prefetch")
    assert (s.fwd_comm_precision, s.bwd_comm_precision) == ("fp32", "fp32")
    assert s.sharding_group_size is None

    # Defense in depth: the permissive plan copied under the strict planner's key is refused too.
    cache = PlanCache(tmp_path)
    shutil.copy(cache.path_for(loose_plan.fingerprint), cache.path_for(plan.fingerprint))
    with open(cache.path_for(plan.fingerprint)) as f:
        data = json.load(f)
    data["fingerprint"] = json.loads(plan.to_json())["fingerprint"]
    with open(cache.path_for(plan.fingerprint), "w") as f:
        json.dump(data, f)
    caplog.clear()
    again = strict.plan_execution(model, get_default_sharders())
    assert strict.last_cache_hit is False
    assert again.optimizations == s
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("re-planning")]
    assert len(msgs) == 1 and "does not fit this request" in msgs[0]
    # ... and the fresh plan it stored is reused by the same planner (its reservation's state
    # after reserve() is not part of the key).
    strict.plan_execution(model, get_default_sharders())
    assert strict.last_cache_hit is True
