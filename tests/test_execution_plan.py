"""ExecutionPlan: value validation, fingerprints, and lossless JSON round trips of real TorchRec plans."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from torch import nn

from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
    MultiPassPrefetchConfig,
)
from fbgemm_gpu.tbe.monitoring import StdLogStatsReporterConfig
from fbgemm_gpu.tbe.ssd import KVZCHTBEConfig
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import (
    KernelConfig,
    ParameterConstraints,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import (
    CacheParams,
    EmbeddingModuleShardingPlan,
    KeyValueParams,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.types import DataType

from torchrec_sparselift.plan import (
    EXECUTION_PLAN_SCHEMA,
    ExecutionPlan,
    Fingerprint,
    Optimizations,
    PlanFormatError,
    Prediction,
    RankPrediction,
    Versions,
    fingerprint_inputs,
    sharding_plan_from_dict,
    sharding_plan_to_dict,
    table_specs,
)
from torchrec_sparselift.semantics.workload import declare

META = torch.device("meta")
WORLD, LOCAL = 4, 2


class TwoModules(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="tw", embedding_dim=64, num_embeddings=50_000, feature_names=["f_tw"]),
                EmbeddingBagConfig(name="cw", embedding_dim=128, num_embeddings=20_000, feature_names=["f_cw"]),
                EmbeddingBagConfig(name="rw", embedding_dim=64, num_embeddings=4_000_000, feature_names=["f_rw"]),
                EmbeddingBagConfig(name="dp", embedding_dim=16, num_embeddings=100, feature_names=["f_dp"]),
            ],
            device=META,
        )
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="seq_tw", embedding_dim=32, num_embeddings=1000, feature_names=["s_tw"]),
                EmbeddingConfig(name="seq_rw", embedding_dim=32, num_embeddings=2_000_000, feature_names=["s_rw"]),
            ],
            device=META,
        )


def _topology(world: int = WORLD, local: int = LOCAL, hbm: int = 2 * 1024**3):
    return TopologyFactory.create_topology(
        TrainerConfig(world_size=world, local_world_size=local, hbm_cap_bytes=hbm),
        kernel_config=KernelConfig(compute_device="cuda"),
    )


def _planner_plan() -> ShardingPlan:
    constraints = {
        "tw": ParameterConstraints(sharding_types=["table_wise"]),
        "cw": ParameterConstraints(sharding_types=["column_wise"], min_partition=32),
        "rw": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused_uvm_caching"],
                                   cache_params=CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.25)),
        "dp": ParameterConstraints(sharding_types=["data_parallel"]),
        "seq_tw": ParameterConstraints(sharding_types=["table_wise"]),
        "seq_rw": ParameterConstraints(sharding_types=["row_wise"]),
    }
    planner = EmbeddingShardingPlanner(topology=_topology(), batch_size=256, constraints=constraints)
    return planner.plan(TwoModules(), [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])


def _constructed_plan() -> ShardingPlan:
    model = TwoModules()
    ebc_plan = construct_module_sharding_plan(
        model.ebc,
        {"tw": table_wise(rank=3), "cw": column_wise(ranks=[0, 2]), "rw": row_wise(), "dp": data_parallel()},
        local_size=LOCAL, world_size=WORLD, device_type="cuda",
    )
    ec_plan = construct_module_sharding_plan(
        model.ec, {"seq_tw": table_wise(rank=1), "seq_rw": table_row_wise(host_index=1)},
        local_size=LOCAL, world_size=WORLD, device_type="cuda",
    )
    grid_ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="grid", embedding_dim=256, num_embeddings=10_000, feature_names=["g"])],
        device=META,
    )
    grid_plan = construct_module_sharding_plan(
        grid_ebc, {"grid": grid_shard(host_indexes=[0, 1])}, local_size=LOCAL, world_size=WORLD, device_type="cuda"
    )
    fp_ebc = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="fp", embedding_dim=32, num_embeddings=500, feature_names=["fp_f"])],
            is_weighted=True, device=META,
        ),
        PositionWeightedModuleCollection({"fp_f": 10}),
    )
    fp_plan = construct_module_sharding_plan(
        fp_ebc, {"fp": row_wise()}, local_size=LOCAL, world_size=WORLD, device_type="cuda"
    )
    return ShardingPlan(plan={"ebc": ebc_plan, "ec": ec_plan, "grid.ebc": grid_plan, "fp_ebc": fp_plan})


def _every_field_plan() -> ShardingPlan:
    spec = EnumerableShardingSpec(
        [ShardMetadata(shard_offsets=[0, 0], shard_sizes=[10, 8], placement="rank:1/cuda:1"),
         ShardMetadata(shard_offsets=[10, 0], shard_sizes=[6, 8], placement="rank:0/cuda:0")]
    )
    full = ParameterSharding(
        sharding_type="row_wise",
        compute_kernel="fused_uvm_caching",
        ranks=[1, 0],
        sharding_spec=spec,
        cache_params=CacheParams(
            algorithm=CacheAlgorithm.LRU, load_factor=0.125, reserved_memory=1.5,
            precision=DataType.FP16, prefetch_pipeline=True,
            multipass_prefetch_config=MultiPassPrefetchConfig(num_passes=3, min_splitable_pass_size=1024),
        ),
        enforce_hbm=True,
        stochastic_rounding=False,
        bounds_check_mode=BoundsCheckMode.WARNING,
        output_dtype=DataType.BF16,
        key_value_params=KeyValueParams(
            ssd_storage_directory="/data@local_rank", ssd_rocksdb_shards=4, gather_ssd_cache_stats=True,
            stats_reporter_config=StdLogStatsReporterConfig(interval=7), l2_cache_size=2,
            kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=1,
                                            optimizer_state_dtypes_for_st=frozenset({("momentum1", 5)})),
            ps_hosts=(("::1", 2000), ("::1", 2001)), ps_client_thread_num=3,
        ),
    )
    bare = ParameterSharding(sharding_type="data_parallel", compute_kernel="dense", ranks=None)
    return ShardingPlan(plan={"m": EmbeddingModuleShardingPlan({"full": full, "bare": bare})})


def _execution_plan(sharding_plan: ShardingPlan, stats=None, **optimizations) -> ExecutionPlan:
    fp = fingerprint_inputs(table_specs(TwoModules()), _topology(), 256, stats=stats)
    return ExecutionPlan(
        sharding_plan=sharding_plan,
        optimizations=Optimizations(**optimizations),
        prediction=Prediction(
            step_time_s=4.25e-3, lower_bound_s=3.5e-3, cost_model="h100",
            per_rank=[RankPrediction(rank=r, compute_s=1e-3 * (r + 1), exposed_comm_s=2e-4, overlapped_comm_s=1e-4,
                                     hbm_bytes=10**9 + r, ddr_bytes=r) for r in range(WORLD)],
        ),
        fingerprint=fp,
        stats=stats,
        planner_info={"solver": "milp", "status": "optimal", "planning_time_s": 0.5, "moves": [1, 2]},
    )


# ------------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------------


def test_torchrec_planner_plan_round_trips_to_an_equal_sharding_plan():
    plan = _planner_plan()
    kinds = {ps.sharding_type for m in plan.plan.values() for ps in m.values()}
    assert kinds == {"table_wise", "column_wise", "row_wise", "data_parallel"}
    assert plan.plan["ebc"]["rw"].cache_params is not None  # the UVM-caching constraint reached the plan
    back = sharding_plan_from_dict(json.loads(json.dumps(sharding_plan_to_dict(plan))))
    assert back == plan
    assert set(back.plan) == set(plan.plan)
    assert all(isinstance(m, EmbeddingModuleShardingPlan) for m in back.plan.values())


def test_constructed_plans_of_every_sharding_type_round_trip():
    plan = _constructed_plan()
    kinds = {ps.sharding_type for m in plan.plan.values() for ps in m.values()}
    assert {"table_wise", "column_wise", "row_wise", "data_parallel", "table_row_wise", "grid_shard"} <= kinds
    back = sharding_plan_from_dict(json.loads(json.dumps(sharding_plan_to_dict(plan))))
    assert back == plan
    # a changed shard must make them differ: equality really compares shards
    back.plan["ebc"]["rw"].sharding_spec.shards[0].shard_sizes[0] += 1
    assert back != plan


def test_every_parameter_sharding_field_survives_the_round_trip():
    plan = _every_field_plan()
    back = sharding_plan_from_dict(json.loads(json.dumps(sharding_plan_to_dict(plan))))
    assert back == plan
    full = back.plan["m"]["full"]
    assert full.key_value_params.stats_reporter_config == StdLogStatsReporterConfig(interval=7)
    assert full.key_value_params.ps_hosts == (("::1", 2000), ("::1", 2001))
    assert full.bounds_check_mode is BoundsCheckMode.WARNING
    assert str(full.sharding_spec.shards[0].placement) == "rank:1/cuda:1"


def test_execution_plan_json_round_trip_is_equal_including_stats():
    stats = declare(f_tw=2.0, f_cw=1.0, f_rw=30.5, f_dp=1.0, s_tw=4.0, s_rw=8.25)
    plan = _execution_plan(_constructed_plan(), stats=stats, pipeline="semi_sync", fwd_comm_precision="fp16",
                           bwd_comm_precision="bf16", sharding_group_size=2, sync_interval=16)
    text = plan.to_json()
    assert json.loads(text)["schema"] == EXECUTION_PLAN_SCHEMA
    back = ExecutionPlan.from_json(text)
    assert back == plan
    assert back.prediction.per_rank[3].hbm_bytes == 10**9 + 3
    assert back.stats.digest() == stats.digest()


def test_from_json_rejects_other_schemas_and_garbage_with_plan_format_error():
    data = json.loads(_execution_plan(_every_field_plan()).to_json())
    data["schema"] = "sparselift.execution_plan/0"
    with pytest.raises(PlanFormatError, match="execution_plan/0"):
        ExecutionPlan.from_dict(data)
    with pytest.raises(PlanFormatError, match="JSON"):
        ExecutionPlan.from_json(_execution_plan(_every_field_plan()).to_json()[:200])
    del data["prediction"]
    data["schema"] = EXECUTION_PLAN_SCHEMA
    with pytest.raises(PlanFormatError, match="prediction"):
        ExecutionPlan.from_dict(data)


# ------------------------------------------------------------------------------------------------
# value validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pipeline": "async"}, "pipeline"),
        ({"fwd_comm_precision": "int8"}, "fwd_comm_precision"),
        ({"bwd_comm_precision": "fp64"}, "bwd_comm_precision"),
        ({"sharding_group_size": 0}, "sharding_group_size"),
        ({"sync_interval": 0}, "sync_interval"),
        ({"table_grouping": "yes"}, "table_grouping"),
    ],
)
def test_optimizations_refuse_invalid_choices_naming_the_field(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Optimizations(**kwargs)


def test_prediction_gap_and_bound_consistency():
    assert Prediction(step_time_s=3.0, lower_bound_s=2.0).gap == pytest.approx(0.5)
    assert Prediction(step_time_s=0.0, lower_bound_s=0.0).gap == 0.0
    assert math.isinf(Prediction(step_time_s=1.0, lower_bound_s=0.0).gap)
    with pytest.raises(ValueError, match="lower bound"):
        Prediction(step_time_s=1.0, lower_bound_s=1.5)
    with pytest.raises(ValueError, match="rank twice"):
        Prediction(step_time_s=1.0, lower_bound_s=0.5,
                   per_rank=[RankPrediction(rank=0, compute_s=1, exposed_comm_s=0)] * 2)
    with pytest.raises(ValueError, match="compute_s"):
        RankPrediction(rank=0, compute_s=-1.0, exposed_comm_s=0.0)


def test_planner_info_must_survive_json_unchanged():
    with pytest.raises(ValueError, match="planner_info"):
        _execution_plan(_every_field_plan()).__class__(
            sharding_plan=_every_field_plan(), optimizations=Optimizations(),
            prediction=Prediction(step_time_s=1, lower_bound_s=1),
            fingerprint=_execution_plan(_every_field_plan()).fingerprint,
            planner_info={"ranks": (0, 1)},
        )


def test_plan_refuses_stats_that_do_not_match_its_fingerprint():
    plan = _execution_plan(_every_field_plan())
    with pytest.raises(ValueError, match="stats_digest"):
        ExecutionPlan(sharding_plan=plan.sharding_plan, optimizations=plan.optimizations,
                      prediction=plan.prediction, fingerprint=plan.fingerprint, stats=declare(x=1.0))


# ------------------------------------------------------------------------------------------------
# fingerprints
# ------------------------------------------------------------------------------------------------


def test_table_specs_lists_every_table_at_its_module_path():
    specs = table_specs(TwoModules())
    assert [(s[0], s[1]) for s in specs] == [
        ("ebc", "tw"), ("ebc", "cw"), ("ebc", "rw"), ("ebc", "dp"), ("ec", "seq_tw"), ("ec", "seq_rw")
    ]
    assert specs[2][2:6] == (4_000_000, 64, ["f_rw"], True)
    assert specs[4][5] is False


def test_fingerprint_changes_with_every_planning_input():
    tables = table_specs(TwoModules())
    base = fingerprint_inputs(tables, _topology(), 256)
    assert fingerprint_inputs(list(reversed(tables)), _topology(), 256) == base  # order is irrelevant
    bigger = [t if t[1] != "rw" else t[:2] + (t[2] + 1,) + t[3:] for t in tables]
    variants = [
        fingerprint_inputs(bigger, _topology(), 256),
        fingerprint_inputs(tables, _topology(world=8), 256),
        fingerprint_inputs(tables, _topology(hbm=4 * 1024**3), 256),
        fingerprint_inputs(tables, _topology(), 512),
        fingerprint_inputs(tables, _topology(), 256, constraints={"tw": ParameterConstraints(min_partition=8)}),
    ]
    for v in variants:
        assert v.cache_key() != base.cache_key()
        assert base.mismatch(v) is not None
    with_stats = fingerprint_inputs(tables, _topology(), 256, stats=declare(f_tw=3.0))
    assert with_stats.cache_key() == base.cache_key()  # statistics are compared, not keyed
    assert with_stats.digest() != base.digest()
    newer = Fingerprint(**{**_fields(base), "versions": Versions(torch="9.9", torchrec="1.8.0",
                                                                 torchrec_sparselift="0.1.0")})
    assert "torch version changed" in base.mismatch(newer)


def _fields(fp: Fingerprint) -> dict:
    import attrs

    return attrs.asdict(fp, recurse=False)


def test_fingerprint_inputs_reject_bad_tables_naming_them():
    tables = table_specs(TwoModules())
    with pytest.raises(ValueError, match="'rw'.*rows"):
        fingerprint_inputs([t if t[1] != "rw" else t[:2] + (0,) + t[3:] for t in tables], _topology(), 256)
    with pytest.raises(ValueError, match="'cw'.*dim"):
        fingerprint_inputs([t if t[1] != "cw" else t[:3] + (-4,) + t[4:] for t in tables], _topology(), 256)
    with pytest.raises(ValueError, match="'tw' listed twice"):
        fingerprint_inputs(tables + tables[:1], _topology(), 256)
    with pytest.raises(ValueError, match="batch_size"):
        fingerprint_inputs(tables, _topology(), 0)


@dataclasses.dataclass
class _Constraint:  # torchrec-independent stand-in, so the golden digest survives torchrec upgrades
    sharding_types: list
    min_partition: Optional[int] = None


def _golden_fingerprint() -> Fingerprint:
    storage = SimpleNamespace(hbm=80 * 2**30, ddr=512 * 2**30, ssd=0)
    topology = SimpleNamespace(world_size=2, compute_device="cuda", local_world_size=2,
                               devices=[SimpleNamespace(storage=storage)] * 2,
                               intra_host_bw=6e11, inter_host_bw=1.25e10)
    return fingerprint_inputs(
        [("ebc", "t1", 1000, 64, ["a", "b"], True), ("ec", "t2", 50, 16, ["c"], False, "FP16")], topology, 256,
        constraints={"t1": _Constraint(sharding_types=["row_wise"], min_partition=8)},
        stats=declare(a=2.5, b=1.0), versions=Versions(torch="x", torchrec="y", torchrec_sparselift="z"),
        options={"pipelines": ["sparse_dist"], "allow_staleness": False, "sharding_group_size": None},
    )


def test_fingerprint_digests_are_pinned_canonical_json_hashes():
    # Computed once in another process; Python's per-process hash randomization cannot move them.
    # If you change the canonical form on purpose, bump EXECUTION_PLAN_SCHEMA and update these.
    fp = _golden_fingerprint()
    # Schema 2 (planner options keyed: options_digest) moved them once from 6b3a1541.../8381e1c8...;
    # FeatureStats.unique_growth moved the stats digest (and so the digest) from 8a2218a4.../0cd590f7...
    assert fp.cache_key() == "dddfdb6e4dd84dc3d0b3bcda61b49af916b86cf843ec3345062caef3f1f40cb0"
    assert fp.stats_digest == "e9a7ebf1d65f537bc08ba1b6e6e4bc815343436646c03cf2531155d164728202"
    assert fp.digest() == "9a0963e99871f604232bba878b12872e138146f6f2765b22b69ae754e23e3d27"


@pytest.mark.slow
def test_fingerprint_is_identical_in_another_process_with_another_hash_seed():
    script = textwrap.dedent(
        """
        import torch
        from test_execution_plan import TwoModules, _topology
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec_sparselift.plan import fingerprint_inputs, table_specs
        from torchrec_sparselift.semantics.workload import declare
        fp = fingerprint_inputs(table_specs(TwoModules()), _topology(), 256,
                                constraints={"tw": ParameterConstraints(sharding_types=["table_wise"])},
                                stats=declare(f_tw=2.5))
        print(fp.digest())
        """
    )
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)  # the tests import this module
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    local = fingerprint_inputs(table_specs(TwoModules()), _topology(), 256,
                               constraints={"tw": ParameterConstraints(sharding_types=["table_wise"])},
                               stats=declare(f_tw=2.5))
    assert out.stdout.strip().splitlines()[-1] == local.digest()


def test_table_specs_reports_wrapped_tables_at_the_wrapper_path():
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    cfg = [EmbeddingBagConfig(name="mc_t", embedding_dim=8, num_embeddings=100, feature_names=["mc_f"])]
    model = nn.Module()
    model.fp = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="w", embedding_dim=8, num_embeddings=10, feature_names=["g"])],
            is_weighted=True, device=META,
        ),
        PositionWeightedModuleCollection({"g": 4}),
    )
    model.mc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=cfg),
        ManagedCollisionCollection(
            {"mc_t": MCHManagedCollisionModule(zch_size=100, device=torch.device("cpu"), eviction_interval=1,
                                               eviction_policy=DistanceLFU_EvictionPolicy())},
            embedding_configs=cfg,
        ),
    )
    assert table_specs(model) == [
        ("fp", "w", 10, 8, ["g"], True, "FP32"),
        ("mc", "mc_t", 100, 8, ["mc_f"], True, "FP32"),
    ]
