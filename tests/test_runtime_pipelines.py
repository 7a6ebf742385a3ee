"""lift(): DistributedModelParallel + comm codecs + the planned train pipeline, on 2 gloo ranks.

One 2-rank job (module fixture) runs every scenario and returns each rank's results; the tests read
them. Single-process tests at the bottom pin the settings/validation logic.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from launcher import run_ranks
from torchrec_sparselift.vocabulary import SYNC_PIPELINES
from torchrec_sparselift.vocabulary import pipeline as registry_pipeline

WORLD = 2
STEPS = 6
SEMI_SYNC_STEPS = 24
SEMI_SYNC_LR = dict(lr=8.0, dense_lr=0.05)  # learns the 4 cycled batches within 24 steps
SEED = 7
NUM_EMB = 64
DIM = 8
LOCAL_B = 8
FEATURES = ("f0", "f1", "f2")


def _tiny_model() -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    class TinyRec(torch.nn.Module):
        """EBC (3 tables) + dense layer + over layer; forward returns (loss, (loss, logits))."""

        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=NUM_EMB, feature_names=[f])
                    for i, f in enumerate(FEATURES)
                ]
            )
            self.dense = torch.nn.Linear(4, DIM)
            self.over = torch.nn.Linear(DIM * (1 + len(FEATURES)), 1)

        def forward(self, batch):  # type: ignore[no-untyped-def]
            kt = self.ebc(batch.sparse_features)
            x = torch.cat([self.dense(batch.dense_features)] + [kt[f] for f in FEATURES], dim=1)
            logits = self.over(x).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            return loss, (loss.detach(), logits.detach())

    return TinyRec()


def _batches(rank: int, n: int):  # type: ignore[no-untyped-def]
    """Deterministic local batches; the label is learnable from the single f0 id (id < NUM_EMB/2)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * rank + step)
        lengths = torch.randint(0, 4, (len(FEATURES) * LOCAL_B,), generator=g)
        lengths[:LOCAL_B] = 1  # one f0 id per sample: the label
        ids = torch.randint(0, NUM_EMB, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=ids, lengths=lengths)
        labels = (ids[:LOCAL_B] < NUM_EMB // 2).float()
        out.append(Batch(dense_features=torch.randn(LOCAL_B, 4, generator=g), sparse_features=kjt, labels=labels))
    return out


def _sharded(model: torch.nn.Module, t1: str):  # type: ignore[no-untyped-def]
    """t0 table-wise on rank 1, t2 column-wise (``_plan``) or table-wise on rank 0, and t1
    ``row_wise`` or ``data_parallel`` (a dense-kernel table the optimizer step updates)."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    dp = t1 == "data_parallel"
    ebc_plan = sp.construct_module_sharding_plan(
        model.ebc,
        {
            "t0": sp.table_wise(rank=1, compute_kernel="fused"),
            "t1": sp.data_parallel() if dp else sp.row_wise(compute_kernel="fused"),
            "t2": sp.table_wise(rank=0, compute_kernel="fused") if dp else sp.column_wise(ranks=[0, 1],
                                                                                           compute_kernel="fused"),
        },
        world_size=WORLD,
        local_size=WORLD,
        device_type="cpu",
    )
    return ShardingPlan({"ebc": ebc_plan})


def _load_unsharded(model: torch.nn.Module, state) -> None:  # type: ignore[no-untyped-def]
    """Copy an unsharded state dict into a sharded model, shard by shard (sharding builds its own
    initial table weights)."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            src = state[key[key.index("ebc."):] if "ebc." in key else key.split("module.", 1)[-1]]
            if hasattr(value, "local_shards"):  # ShardedTensor
                for shard in value.local_shards():
                    (r, c), (rows, cols) = shard.metadata.shard_offsets, shard.tensor.shape
                    shard.tensor.copy_(src[r:r + rows, c:c + cols])
            else:
                value.copy_(src)


def _table_wise_or_dp(model: torch.nn.Module, t1: str):  # type: ignore[no-untyped-def]
    """t0 table-wise on rank 1, t2 on rank 0, t1 table-wise on rank 0 or data-parallel."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    tw = sp.table_wise(rank=0, compute_kernel="fused")
    ebc_plan = sp.construct_module_sharding_plan(
        model.ebc,
        {"t0": sp.table_wise(rank=1, compute_kernel="fused"), "t1": sp.data_parallel() if t1 == "data_parallel" else tw,
         "t2": sp.table_wise(rank=0, compute_kernel="fused")},
        world_size=WORLD, local_size=WORLD, device_type="cpu",
    )
    return ShardingPlan({"ebc": ebc_plan})


def _plan(model: torch.nn.Module):  # type: ignore[no-untyped-def]
    return _sharded(model, "row_wise")


def _plan_with_data_parallel(model: torch.nn.Module):  # type: ignore[no-untyped-def]
    return _sharded(model, "data_parallel")


def _lift(plan_or_exec, lr: float = 0.5, dense_lr: float = 0.5, **kwargs):  # type: ignore[no-untyped-def]
    from torchrec_sparselift.runtime import lift

    torch.manual_seed(SEED)
    model = _tiny_model()
    plan = plan_or_exec(model) if callable(plan_or_exec) else plan_or_exec
    return lift(
        model,
        plan,
        device=torch.device("cpu"),
        embedding_optimizer=(torch.optim.SGD, {"lr": lr}),
        dense_optimizer_factory=lambda params: torch.optim.SGD(params, lr=dense_lr),
        **kwargs,
    )


def _plain_loop_losses(lifted, batches):  # type: ignore[no-untyped-def]
    """Forward / backward / optimizer step by hand, no pipeline."""
    losses = []
    for b in batches:
        loss, _ = lifted.model(b)
        loss.backward()
        lifted.optimizer.step()
        lifted.optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _pipeline_losses(lifted, batches):  # type: ignore[no-untyped-def]
    it = iter(batches)
    losses = []
    while True:
        try:
            loss, _ = lifted.pipeline.progress(it)
        except StopIteration:
            return losses
        losses.append(float(loss))


def _scenarios(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from torchrec_sparselift.runtime import StepTimer

    out: dict = {}
    batches = _batches(rank, STEPS)

    out["plain"] = _plain_loop_losses(_lift(_plan, pipeline="base"), batches)

    for kind in SYNC_PIPELINES:
        lifted = _lift(_plan, pipeline=kind)
        out[kind] = _pipeline_losses(lifted, batches)
        out[f"{kind}_class"] = type(lifted.pipeline).__name__

    # a data-parallel table (dense kernel, updated by the optimizer step, not in the backward):
    # every pipeline the registry lets train it must still compute the plain loop's losses
    out["plain_dp"] = _plain_loop_losses(_lift(_plan_with_data_parallel, pipeline="base"), batches)
    for kind in SYNC_PIPELINES:
        if registry_pipeline(kind).dense_kernel:
            out[f"{kind}_dp"] = _pipeline_losses(_lift(_plan_with_data_parallel, pipeline=kind), batches)

    # a data-parallel table trains with the embedding optimizer on the sharded tables' summed
    # gradients: the same losses as the same table table-wise (the dense optimizer differs on purpose)
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from torchrec_sparselift.runtime import lift

    for opt_name, spec in (("sgd", (torch.optim.SGD, {"lr": 0.5})), ("rowwise_adagrad", (RowWiseAdagrad, {"lr": 0.5}))):
        for t1 in ("table_wise", "data_parallel"):
            torch.manual_seed(SEED)
            model = _tiny_model()
            start = {k: v.detach().clone() for k, v in model.state_dict().items()}
            lifted = lift(model, _table_wise_or_dp(model, t1), device=torch.device("cpu"), pipeline="base",
                          embedding_optimizer=spec, dense_optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.05))
            _load_unsharded(lifted.model, start)
            out[f"t1_{t1}_{opt_name}"] = _plain_loop_losses(lifted, batches)
            out[f"t1_{t1}_{opt_name}_parts"] = [name for name, _opt in lifted.optimizer.optimizers]

    cycled = [b for _ in range(SEMI_SYNC_STEPS // 4) for b in _batches(rank, 4)]
    lifted = _lift(_plan, **SEMI_SYNC_LR, pipeline="semi_sync", pipeline_options={"start_batch": 0})
    out["semi_sync"] = _pipeline_losses(lifted, cycled)
    out["semi_sync_class"] = type(lifted.pipeline).__name__
    lifted = _lift(_plan, **SEMI_SYNC_LR, pipeline="sparse_dist")
    out["sparse_dist_cycled"] = _pipeline_losses(lifted, cycled)

    for prec in ("fp16", "bf16"):
        lifted = _lift(_plan, pipeline="sparse_dist", fwd_comm_precision=prec, bwd_comm_precision=prec)
        out[f"comm_{prec}"] = _pipeline_losses(lifted, batches)
        out[f"comm_{prec}_settings"] = [lifted.settings.fwd_comm_precision, lifted.settings.bwd_comm_precision]

    # an execution plan (duck-typed) chooses the pipeline and precision; keywords override it
    torch.manual_seed(SEED)
    exec_plan = SimpleNamespace(
        sharding_plan=_plan(_tiny_model()),
        optimizations=SimpleNamespace(
            pipeline="fused", fwd_comm_precision="fp16", bwd_comm_precision="fp32",
            sharding_group_size=None, sync_interval=1,
        ),
        prediction=SimpleNamespace(step_time_s=0.004),
        summary=lambda: "tiny plan",
    )
    lifted = _lift(exec_plan)
    out["exec_plan"] = [type(lifted.pipeline).__name__, lifted.settings.fwd_comm_precision,
                        lifted.settings.predicted_step_s, lifted.settings.label()]
    lifted = _lift(exec_plan, pipeline="base", fwd_comm_precision="fp32")
    out["exec_plan_override"] = [type(lifted.pipeline).__name__, lifted.settings.fwd_comm_precision,
                                 lifted.settings.predicted_step_s]

    # a 2D execution plan goes to runtime.two_d (DMPCollection): 2 replicas of a 1-rank group
    def plan_2d(pipeline: str):  # type: ignore[no-untyped-def]
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
        from torchrec.distributed.types import ShardingPlan

        ebc_plan = construct_module_sharding_plan(
            _tiny_model().ebc, {f"t{i}": table_wise(rank=0, compute_kernel="fused") for i in range(3)},
            world_size=1, local_size=1, device_type="cpu")
        return SimpleNamespace(sharding_plan=ShardingPlan({"ebc": ebc_plan}), optimizations=SimpleNamespace(
            pipeline=pipeline, fwd_comm_precision="fp32", bwd_comm_precision="fp32",
            sharding_group_size=1, sync_interval=2))

    lifted = _lift(plan_2d("sparse_dist"))
    # TorchRec syncs after the backward of steps whose 0-based index % sync_interval == 0: 0, 2, 4
    losses_2d = _pipeline_losses(lifted, _batches(rank, 5))
    local = lifted.model.state_dict()["ebc.embedding_bags.t0.weight"]
    local = local.to_local() if hasattr(local, "to_local") else local.local_tensor()
    local = torch.cat([t.flatten() for t in local.local_shards()]) if hasattr(local, "local_shards") else local
    gathered = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(gathered, local.contiguous())
    out["two_d"] = [type(lifted.model).__name__, type(lifted.pipeline).__name__, losses_2d,
                    all(torch.equal(gathered[0], g) for g in gathered)]
    try:
        _lift(plan_2d("base"))
        out["two_d_base"] = "no error"
    except ValueError as exc:
        out["two_d_base"] = str(exc)

    # end to end: SparseLiftPlanner's execution plan -> lift -> pipelined training, timed
    from torchrec.distributed.planner import Topology

    from torchrec_sparselift import SparseLiftPlanner

    torch.manual_seed(SEED)
    model = _tiny_model()
    planner = SparseLiftPlanner(topology=Topology(world_size=WORLD, compute_device="cpu"), batch_size=LOCAL_B,
                                pipelines=["fused"], time_budget_s=1.0)
    exec_plan = planner.collective_plan_execution(model, pg=dist.group.WORLD)
    lifted = _lift(exec_plan)
    timer = lifted.step_timer(warmup_steps=1)
    timer.time_pipeline(lifted.pipeline, iter(_batches(rank, 4)), steps=4)
    rec = timer.record(pg=dist.group.WORLD)
    out["planner"] = [exec_plan.optimizations.pipeline, type(lifted.pipeline).__name__, rec.predicted_s, rec.plan]

    # unpacking and the step timer on a real pipeline
    model, pipeline = _lift(_plan, pipeline="sparse_dist")
    timer = StepTimer(torch.device("cpu"), warmup_steps=2, predicted_s=0.004, plan="tiny")
    ran = timer.time_pipeline(pipeline, iter(_batches(rank, 8)), steps=20)
    rec = timer.record(pg=dist.group.WORLD)
    out["timer"] = [ran, rec.steps, rec.measured_s, rec.world_size, rec.ratio]
    return out


@pytest.fixture(scope="module")
def runs():  # type: ignore[no-untyped-def]
    return run_ranks(_scenarios, WORLD, timeout_s=600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_a_data_parallel_table_trains_as_it_would_table_wise(runs, optimizer: str) -> None:  # type: ignore[no-untyped-def]
    # the embedding optimizer (not the dense one, lr 0.05 vs 0.5) on the table's all-reduced gradient
    # (the sum over ranks, as a sharded table's): the plan's choice of data-parallel does not change
    # the training
    for res in runs:
        tw, dp = res[f"t1_table_wise_{optimizer}"], res[f"t1_data_parallel_{optimizer}"]
        assert len(tw) == STEPS and tw[0] == pytest.approx(dp[0], abs=1e-6)
        assert dp == pytest.approx(tw, rel=1e-5, abs=1e-6), f"{optimizer}: data-parallel t1 {dp} vs table-wise {tw}"
        assert res[f"t1_data_parallel_{optimizer}_parts"] == ["embeddings", "dense_kernel_embeddings", "dense"]
        assert res[f"t1_table_wise_{optimizer}_parts"] == ["embeddings", "dense"]


@pytest.mark.multiprocess
def test_exact_pipelines_that_train_data_parallel_tables_equal_the_plain_loop(runs) -> None:  # type: ignore[no-untyped-def]
    kinds = [k for k in SYNC_PIPELINES if registry_pipeline(k).dense_kernel]
    assert "fused" in kinds and "sparse_dist" in kinds
    for res in runs:
        assert len(res["plain_dp"]) == STEPS
        for kind in kinds:
            assert res[f"{kind}_dp"] == res["plain_dp"], f"{kind} diverged from the plain loop with a data-parallel table"


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", SYNC_PIPELINES)
def test_synchronous_pipeline_losses_equal_plain_loop(runs, kind) -> None:  # type: ignore[no-untyped-def]
    for res in runs:
        assert len(res[kind]) == STEPS
        assert res[kind] == res["plain"], f"{kind} ({res[f'{kind}_class']}) diverged from the plain loop"


@pytest.mark.multiprocess
def test_multistream_pipelines_use_cpu_adaptation_on_cpu(runs) -> None:  # type: ignore[no-untyped-def]
    res = runs[0]
    assert res["base_class"] == "TrainPipelineBase"
    assert res["sparse_dist_class"] == "TrainPipelineSparseDist"
    assert res["fused_class"] == "CpuTrainPipelineFusedSparseDist"
    assert res["prefetch_class"] == "CpuPrefetchTrainPipelineSparseDist"
    assert res["semi_sync_class"] == "CpuTrainPipelineSemiSync"


@pytest.mark.multiprocess
def test_semi_sync_trains_and_loss_falls(runs) -> None:  # type: ignore[no-untyped-def]
    for res in runs:
        losses = res["semi_sync"]
        assert len(losses) == SEMI_SYNC_STEPS and all(math.isfinite(x) for x in losses)
        first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
        assert last < 0.85 * first, f"semi-sync loss did not fall: {losses} (sync: {res['sparse_dist_cycled']})"
        # stale by one step: not the synchronous trajectory
        assert losses != res["sparse_dist_cycled"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("prec", ["fp16", "bf16"])
def test_quantized_comms_run_and_stay_close_to_fp32(runs, prec) -> None:  # type: ignore[no-untyped-def]
    for res in runs:
        q, ref = res[f"comm_{prec}"], res["plain"]
        assert len(q) == STEPS
        assert q != ref, "codecs were not installed: losses are bit-identical to fp32"
        assert all(abs(a - b) < 2e-2 for a, b in zip(q, ref)), (q, ref)
        assert res[f"comm_{prec}_settings"] == [prec, prec]


@pytest.mark.multiprocess
def test_execution_plan_optimizations_applied_and_overridable(runs) -> None:  # type: ignore[no-untyped-def]
    cls, fwd, predicted, label = runs[0]["exec_plan"]
    assert (cls, fwd, predicted, label) == ("CpuTrainPipelineFusedSparseDist", "fp16", 0.004, "tiny plan")
    assert runs[0]["exec_plan_override"] == ["TrainPipelineBase", "fp32", None]  # prediction was for "fused"


@pytest.mark.multiprocess
def test_step_timer_reports_slowest_rank_over_steady_steps(runs) -> None:  # type: ignore[no-untyped-def]
    ran0, steps0, measured0, world0, ratio0 = runs[0]["timer"]
    ran1, steps1, measured1, world1, _ = runs[1]["timer"]
    assert ran0 == ran1 == 8 and steps0 == steps1 == 6  # 8 batches, 2 warm-up steps left out
    assert measured0 == measured1 > 0 and world0 == world1 == WORLD
    assert ratio0 == pytest.approx(measured0 / 0.004)


@pytest.mark.multiprocess
def test_2d_plan_builds_dmp_collection_whose_pipeline_syncs_replicas(runs) -> None:  # type: ignore[no-untyped-def]
    for res in runs:
        model_cls, pipeline_cls, losses, replicas_equal = res["two_d"]
        assert (model_cls, pipeline_cls) == ("CpuDMPCollection", "TrainPipelineSparseDist")
        assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
        assert replicas_equal, "synced after the 5th step (sync_interval=2): the replicas should hold equal tables"
    assert runs[0]["two_d"][2] != runs[1]["two_d"][2]  # replicas saw different data
    assert "never syncs" in runs[0]["two_d_base"]


@pytest.mark.multiprocess
def test_planner_execution_plan_lifts_to_its_pipeline_and_is_timed(runs) -> None:  # type: ignore[no-untyped-def]
    chosen, cls, predicted, label = runs[0]["planner"]
    assert chosen == "fused" and cls == "CpuTrainPipelineFusedSparseDist"
    assert predicted is not None and predicted > 0
    assert "pipeline=fused" in label
    assert runs[1]["planner"] == runs[0]["planner"]


# ---- single-process -----------------------------------------------------------------------


def test_sharding_plan_defaults_to_sparse_dist_fp32() -> None:
    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.runtime import resolve_settings

    plan, settings = resolve_settings(ShardingPlan({}))
    assert (settings.pipeline, settings.fwd_comm_precision, settings.bwd_comm_precision) == ("sparse_dist", "fp32", "fp32")
    assert not settings.is_2d and settings.predicted_step_s is None


def test_unknown_pipeline_or_precision_is_refused_with_choices() -> None:
    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.runtime import resolve_settings

    with pytest.raises(ValueError, match="sparse_dist"):
        resolve_settings(ShardingPlan({}), pipeline="staged")
    with pytest.raises(ValueError, match="fp16"):
        resolve_settings(ShardingPlan({}), fwd_comm_precision="int4")


def test_plan_without_sharding_plan_is_refused() -> None:
    from torchrec_sparselift.runtime import resolve_settings

    with pytest.raises(TypeError, match="ShardingPlan"):
        resolve_settings(object())


def test_override_matching_the_plan_keeps_its_prediction() -> None:
    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.runtime import resolve_settings

    plan = SimpleNamespace(sharding_plan=ShardingPlan({}), optimizations=SimpleNamespace(pipeline="fused"),
                           prediction=SimpleNamespace(step_time_s=0.01), summary=lambda: "p")
    assert resolve_settings(plan, pipeline="fused")[1].predicted_step_s == 0.01
    changed = resolve_settings(plan, pipeline="base")[1]
    assert (changed.predicted_step_s, changed.label()) == (None, "pipeline=base, comm=fp32/fp32")


def test_2d_plan_keeps_group_and_interval_1d_drops_interval() -> None:
    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.runtime import resolve_settings

    def plan(group):  # type: ignore[no-untyped-def]
        return SimpleNamespace(sharding_plan=ShardingPlan({}), optimizations=SimpleNamespace(
            pipeline="semi_sync", fwd_comm_precision="bf16", bwd_comm_precision="fp16",
            sharding_group_size=group, sync_interval=4))

    _, s2 = resolve_settings(plan(2))
    assert (s2.sharding_group_size, s2.sync_interval, s2.pipeline) == (2, 4, "semi_sync")
    _, s1 = resolve_settings(plan(None))
    assert (s1.sharding_group_size, s1.sync_interval) == (None, None)


def test_2d_plan_refused_by_model_parallel_class() -> None:
    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.runtime import SparseLiftModelParallel

    plan = SimpleNamespace(sharding_plan=ShardingPlan({}), optimizations=SimpleNamespace(
        pipeline="sparse_dist", fwd_comm_precision="fp32", bwd_comm_precision="fp32",
        sharding_group_size=2, sync_interval=1))
    with pytest.raises(ValueError, match="lift"):
        SparseLiftModelParallel(torch.nn.Linear(1, 1), plan)


def test_pipeline_classes_unchanged_on_cuda_adapted_on_cpu() -> None:
    from torchrec.distributed.train_pipeline import TrainPipelineFusedSparseDist, TrainPipelineSparseDist

    from torchrec_sparselift.runtime import pipeline_class
    from torchrec_sparselift.runtime.cpu_compat import CpuTrainPipelineFusedSparseDist

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert pipeline_class("fused", cuda) is TrainPipelineFusedSparseDist
    assert pipeline_class("fused", cpu) is CpuTrainPipelineFusedSparseDist
    assert pipeline_class("sparse_dist", cpu) is TrainPipelineSparseDist
    with pytest.raises(ValueError, match="one of"):
        pipeline_class("staged", cpu)


def test_sync_interval_refused_for_pipelines_that_never_sync() -> None:
    from torchrec_sparselift.runtime import make_train_pipeline

    for kind in ("base", "fused", "prefetch"):
        with pytest.raises(ValueError, match="never syncs"):
            make_train_pipeline(kind, torch.nn.Linear(1, 1), None, torch.device("cpu"), sync_interval=2)  # type: ignore[arg-type]


def test_record_stream_noop_only_inside_context_and_restored() -> None:
    from torchrec_sparselift.runtime.cpu_compat import CpuStream, cpu_record_stream_noop

    before = torch.Tensor.__dict__.get("record_stream")
    t = torch.ones(2)
    with pytest.raises((RuntimeError, TypeError, NotImplementedError)):
        t.record_stream(CpuStream())
    with cpu_record_stream_noop():
        with cpu_record_stream_noop():  # reentrant
            t.record_stream(CpuStream())
        t.record_stream(CpuStream())
    assert torch.Tensor.__dict__.get("record_stream") is before
    with pytest.raises((RuntimeError, TypeError, NotImplementedError)):
        t.record_stream(CpuStream())


def test_fp32_comms_install_no_codecs_and_fp8_refused_on_cpu() -> None:
    from torchrec_sparselift.runtime import comm_codecs_registry, sharders_with_comm_codecs

    cpu = torch.device("cpu")
    assert comm_codecs_registry("fp32", "fp32", cpu) is None
    assert sharders_with_comm_codecs(None, None) is None
    with pytest.raises(ValueError, match="does not run on CPU"):
        comm_codecs_registry("fp8", "fp32", cpu)


def test_user_sharders_without_codecs_refused_when_plan_quantizes() -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_sparselift.runtime import comm_codecs_registry, sharders_with_comm_codecs

    reg = comm_codecs_registry("fp16", "fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="qcomm_codecs_registry"):
        sharders_with_comm_codecs(reg, [EmbeddingBagCollectionSharder()])
    ok = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=reg)]
    assert sharders_with_comm_codecs(reg, ok) == ok
    defaults = sharders_with_comm_codecs(reg, None)
    assert all(s.qcomm_codecs_registry is reg for s in defaults if isinstance(s, EmbeddingBagCollectionSharder))


def _add_feature_processor(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a ``FeatureProcessedEmbeddingBagCollection`` at ``model.fp`` (one weighted
    table, position-weighted), as a model with feature processors holds one."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    model.fp = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="w", embedding_dim=DIM, num_embeddings=NUM_EMB,
                                                          feature_names=["w_f"])], is_weighted=True),
        PositionWeightedModuleCollection({"w_f": 10}))
    return model


@pytest.mark.parametrize("table_plan", ["data_parallel", "dense_table_wise"])
def test_semi_sync_refuses_tables_on_the_dense_kernel(table_plan) -> None:  # type: ignore[no-untyped-def]
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.runtime import check_pipeline_supports_plan

    model = _tiny_model()
    gen = data_parallel() if table_plan == "data_parallel" else table_wise(rank=0, compute_kernel="dense")
    fused = {f"t{i}": table_wise(rank=i % WORLD, compute_kernel="fused") for i in (1, 2)}
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, {"t0": gen, **fused}, world_size=WORLD, local_size=WORLD, device_type="cpu")})
    with pytest.raises(ValueError, match=r"ebc\.t0.*compute_kernel='fused'"):
        check_pipeline_supports_plan("semi_sync", plan)
    for kind in SYNC_PIPELINES:  # every synchronous pipeline accepts it
        check_pipeline_supports_plan(kind, plan)
    fused_only = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, {"t0": table_wise(rank=0, compute_kernel="fused"), **fused},
        world_size=WORLD, local_size=WORLD, device_type="cpu")})
    check_pipeline_supports_plan("semi_sync", fused_only)


def test_fused_on_cuda_refuses_dense_kernel_tables_and_feature_processors() -> None:
    """On a device with side streams ``fused`` looks up before the dense optimizer's step: the
    runtime refuses it with dense-kernel tables or feature processors (naming them); on CPU, and
    with fused kernels only, it accepts. A pure check: no CUDA device is touched."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.runtime import check_pipeline_supports_plan

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    model = _tiny_model()
    fused = {f"t{i}": table_wise(rank=i % WORLD, compute_kernel="fused") for i in (1, 2)}
    dp = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, {"t0": data_parallel(), **fused}, world_size=WORLD, local_size=WORLD, device_type="cpu")})
    with pytest.raises(ValueError, match=r"'fused' on cuda:0 .*ebc\.t0 \(data_parallel\).*'sparse_dist'"):
        check_pipeline_supports_plan("fused", dp, cuda, model)
    check_pipeline_supports_plan("fused", dp, cpu, model)
    check_pipeline_supports_plan("sparse_dist", dp, cuda, model)
    fused_only = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, {"t0": table_wise(rank=0, compute_kernel="fused"), **fused},
        world_size=WORLD, local_size=WORLD, device_type="cpu")})
    check_pipeline_supports_plan("fused", fused_only, cuda, model)
    _add_feature_processor(model)
    with pytest.raises(ValueError, match=r"'fused' on cuda:0 .*\bfp\b.*feature processors.*'sparse_dist'"):
        check_pipeline_supports_plan("fused", fused_only, cuda, model)
    check_pipeline_supports_plan("fused", fused_only, cpu, model)
    check_pipeline_supports_plan("sparse_dist", fused_only, cuda, model)


def test_runtime_refuses_exactly_what_the_search_filters() -> None:
    """One rule (``vocabulary.Pipeline.conflict``): for every registry pipeline, plan (with and
    without a dense-kernel table), device (with and without side streams) and model (with and
    without a feature processor), ``check_pipeline_supports_plan`` refuses exactly the pairs that
    ``cost.pipelines.trainable_pipelines`` leaves out."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, table_wise
    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.cost.pipelines import trainable_pipelines
    from torchrec_sparselift.runtime import check_pipeline_supports_plan
    from torchrec_sparselift.vocabulary import PIPELINES, has_side_streams

    plain, with_fp = _tiny_model(), _add_feature_processor(_tiny_model())
    fused = {f"t{i}": table_wise(rank=i % WORLD, compute_kernel="fused") for i in (1, 2)}
    plans = {dense: ShardingPlan({"ebc": construct_module_sharding_plan(
        plain.ebc, {"t0": data_parallel() if dense else table_wise(rank=0, compute_kernel="fused"), **fused},
        world_size=WORLD, local_size=WORLD, device_type="cpu")}) for dense in (False, True)}
    refused = 0
    for name in PIPELINES:
        for dense, plan in plans.items():
            for device in (torch.device("cpu"), torch.device("cuda", 0)):
                for model, fp in ((plain, False), (with_fp, True)):
                    kept = name in trainable_pipelines((name, "sparse_dist"), dense,
                                                       streams=has_side_streams(device.type), feature_processors=fp)
                    try:
                        check_pipeline_supports_plan(name, plan, device, model)
                        accepted = True
                    except ValueError:
                        accepted, refused = False, refused + 1
                    assert accepted == kept, (name, dense, device, fp)
    assert refused >= 6  # the stale kinds with a dense table (x2 devices x2 models), fused on cuda
