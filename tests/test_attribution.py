"""Runtime attribution: a step's exclusive time split by sparse-path node kind, next to the model."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from torchrec_sparselift.calibration.attribution import (
    KINDS,
    RankAttribution,
    StepAttribution,
    compare,
    format_attribution,
    format_comparison,
    load_attribution,
    predicted_by_kind,
    save_attribution,
)
from torchrec_sparselift.measure.attribution import STEP_LABEL, ProfEvent, attribute_events, classify


def _tree() -> List[ProfEvent]:
    """One 100 us step on thread 1: forward [0, 50) and backward [50, 100); an all-reduce on
    thread 9 during [85, 95) overlaps the backward's bare time [80, 100)."""
    ev = [
        ProfEvent(STEP_LABEL, 1, 0, 100),  # 0
        ProfEvent("## forward ##", 1, 0, 50, 0),  # 1
        ProfEvent("[lookup]_[model.ebc]_[row_wise]", 1, 2, 12, 1),  # 2
        ProfEvent("fbgemm::split_embedding_codegen_forward_cpu", 1, 3, 11, 2),  # 3
        ProfEvent("[splits_dist]_[model.ebc]_[row_wise]", 1, 12, 20, 1),  # 4
        ProfEvent("fbgemm::block_bucketize_sparse_features", 1, 13, 16, 4),  # 5
        ProfEvent("c10d::alltoall_base_", 1, 16, 19, 4),  # 6
        ProfEvent("aten::mm", 1, 20, 40, 1),  # 7 dense forward
        ProfEvent("## backward ##", 1, 50, 100, 0),  # 8
        ProfEvent("autograd::engine::evaluate_function: AddmmBackward0", 1, 50, 60, 8),  # 9
        ProfEvent("autograd::engine::evaluate_function: ReduceScatterBase_WaitBackward", 1, 60, 70, 8),  # 10
        ProfEvent("ReduceScatterBase_WaitBackward", 1, 61, 69, 10),  # 11
        ProfEvent("torch::autograd::CppNode<SplitLookupFunction_rowwise_adagrad_Op_pt2>", 1, 70, 80, 8),  # 12
        ProfEvent("gloo:all_reduce", 9, 85, 95),  # 13 on the comm thread
    ]
    return ev


def test_kinds_partition_the_step_by_exclusive_time() -> None:
    att = attribute_events(_tree(), rank=3)
    k = att.kinds_ms
    us = 1e-3  # ms per us
    assert att.rank == 3 and att.steps == 1
    assert att.step_ms == pytest.approx(100 * us)
    assert sum(k.values()) == pytest.approx(100 * us)
    assert k["lookup"] == pytest.approx(10 * us)
    assert k["kjt"] == pytest.approx(3 * us)  # bucketize inside input_dist is KJT work
    assert k["input_dist"] == pytest.approx(5 * us)  # 8 us stage minus the 3 us bucketize
    assert k["dense_fwd"] == pytest.approx(20 * us)
    assert k["dense_bwd"] == pytest.approx(10 * us)
    assert k["grad_dist"] == pytest.approx(10 * us)
    assert k["backward_update"] == pytest.approx(10 * us)
    assert k["grad_allreduce"] == pytest.approx(10 * us)  # [85, 95) of the backward's bare [80, 100)
    # bare time: forward [0,2) + [40,50) = 12 us, backward [80,85) + [95,100) = 10 us
    assert k["rest"] == pytest.approx(22 * us)


def test_torchrec_labels_map_to_node_kinds() -> None:
    assert classify("[output_dist]_[m]_[table_wise]", None)[0] == "output_dist"
    # TorchRec labels the input awaitables' waits output_dist_wait: the enclosing kind wins
    assert classify("[output_dist_wait]_[m]_[row_wise]", "input_dist")[0] == "input_dist"
    assert classify("## KJTListSplitsAwaitable wait() ##", "ctx:fwd")[0] == "input_dist"
    assert classify("## EmbeddingBagCollectionAwaitable wait() ##", "ctx:fwd")[0] == "output_dist"
    assert classify("All2All_Pooled_ReqBackward", "ctx:bwd")[0] == "grad_dist"
    assert classify("fbgemm::permute_2D_sparse_data", "input_dist")[0] == "kjt"
    assert classify("c10d::allreduce_", "ctx:bwd")[0] == "grad_allreduce"
    assert classify("## optimizer ##", None)[0] == "dense_optimizer"
    assert classify("## load batch 7 from dataloader (host) ##", None)[0] == "data"
    assert classify("## copy_batch_to_gpu ##", None)[0] == "pipeline"
    assert classify("aten::mm", "ctx:fwd")[0] == "dense_fwd"


def test_no_step_range_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="attribute_steps"):
        attribute_events([ProfEvent("aten::mm", 1, 0, 1)])


def test_attribution_round_trips_and_rejects_kinds_that_do_not_sum(tmp_path: Any) -> None:
    r0 = attribute_events(_tree(), rank=0, unprofiled_step_ms=0.09)
    r1 = RankAttribution(rank=1, steps=1, step_ms=0.2, kinds_ms={"dense_fwd": 0.15, "rest": 0.05})
    att = StepAttribution(ranks=(r0, r1), label="plan", pipeline="sparse_dist")
    assert att.slowest.rank == 1 and att.step_ms == pytest.approx(0.2)
    path = tmp_path / "att.json"
    save_attribution(str(path), att)
    assert load_attribution(str(path)) == att
    assert json.loads(path.read_text())["ranks"][0]["unprofiled_step_ms"] == 0.09
    with pytest.raises(ValueError, match="sum to"):
        RankAttribution(rank=0, steps=1, step_ms=1.0, kinds_ms={"lookup": 0.5})
    with pytest.raises(ValueError, match="unknown attribution kinds"):
        RankAttribution(rank=0, steps=1, step_ms=1.0, kinds_ms={"lookups": 1.0})
    text = format_attribution(att)
    assert "rank 0" in text and "rank 1" in text and "unprofiled step" in text


def test_predicted_kinds_sum_to_the_modelled_step() -> None:
    from torchrec_sparselift.cost.model import StepTime

    phases = {"input_dist": 1e-3, "lookup": 2e-3, "output_dist": 1e-3, "dense_fwd": 4e-3, "dense_bwd": 8e-3,
              "grad_dist": 1e-3, "backward_update": 3e-3, "allreduce": 10e-3, "uvm_fetch": 0.0}
    total = sum(v for k, v in phases.items() if k != "allreduce") + (10e-3 - 8e-3)
    step = StepTime(total_s=total, phases=phases, compute_s=0.0, exposed_comm_s=0.0, overlapped_s=8e-3,
                    pipeline="base")
    pred = predicted_by_kind(step, dp_optimizer_s=1e-3)
    assert sum(pred.values()) == pytest.approx(total)
    assert pred["grad_allreduce"] == pytest.approx(2e-3)  # the part longer than the dense backward
    # where nothing overlaps (CPU gloo: the step is the sum of its phases) all of it is exposed
    serial = sum(phases.values())
    flat = StepTime(total_s=serial, phases=phases, compute_s=0.0, exposed_comm_s=0.0, overlapped_s=0.0,
                    pipeline="base")
    pf = predicted_by_kind(flat)
    assert pf["grad_allreduce"] == pytest.approx(10e-3) and pf["rest"] == pytest.approx(0.0)
    assert sum(pf.values()) == pytest.approx(serial)
    assert pred["dense_optimizer"] == pytest.approx(1e-3)
    assert pred["backward_update"] == pytest.approx(2e-3)
    att = StepAttribution(ranks=(attribute_events(_tree()),))
    rows = compare(att, pred)
    assert [r.kind for r in rows][: len(KINDS)] == list(KINDS)
    assert rows[-1].kind == "step" and rows[-1].predicted_ms == pytest.approx(total * 1e3)
    table = format_comparison(rows, att)
    assert "kjt" in table and "(not modelled)" in table


# ---------------------------------------------------------------------------------------------
# a real 2-rank gloo run
# ---------------------------------------------------------------------------------------------

def _attribute_real_steps(rank: int, world: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan, data_parallel, row_wise, table_wise,
    )  # fmt: skip
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from torchrec_sparselift.runtime import lift
    from torchrec_sparselift.measure.attribution import attribute_steps

    dim, batch = 8, 32
    tables = {"t_rw": (200, row_wise()), "t_tw": (100, table_wise(rank=1)), "t_dp": (50, data_parallel())}
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=r, feature_names=[f"f_{n}"])
                for n, (r, _) in tables.items()],
        device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, dim],
                           over_arch_layer_sizes=[16, 1]))
    mp = construct_module_sharding_plan(ebc, {n: g for n, (_, g) in tables.items()},
                                        sharder=EmbeddingBagCollectionSharder(), local_size=world,
                                        world_size=world, device_type="cpu")
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": mp})
    lifted = lift(model, plan, pg=dist.GroupMember.WORLD, device=torch.device("cpu"),
                  embedding_optimizer=(RowWiseAdagrad, {"lr": 0.1}),
                  dense_optimizer_factory=lambda p: torch.optim.Adagrad(p, lr=0.01))

    def batches():
        g = torch.Generator().manual_seed(rank)
        while True:
            lengths = torch.full((len(tables) * batch,), 2, dtype=torch.int32)
            values = torch.cat([torch.randint(0, r, (2 * batch,), generator=g) for r, _ in tables.values()])
            kjt = KeyedJaggedTensor(keys=[f"f_{n}" for n in tables], values=values, lengths=lengths)
            yield Batch(dense_features=torch.rand(batch, 4, generator=g), sparse_features=kjt,
                        labels=torch.randint(0, 2, (batch,), generator=g).float())

    att = attribute_steps(lifted.pipeline, batches(), steps=3, warmup_steps=2, pg=dist.GroupMember.WORLD,
                          label="rw+tw+dp", pipeline=lifted.settings.pipeline)
    return att.to_dict()


@pytest.mark.multiprocess
def test_attribute_steps_on_a_real_sharded_model_finds_every_sparse_path_kind() -> None:
    from launcher import run_ranks

    results = run_ranks(_attribute_real_steps, 2, timeout_s=240)
    assert results[0] == results[1]  # every rank gets every rank's attribution
    att = StepAttribution.from_dict(results[0])
    assert [r.rank for r in att.ranks] == [0, 1]
    for r in att.ranks:
        k = r.kinds_ms
        assert r.steps == 3 and r.unprofiled_step_ms > 0
        assert sum(k.values()) == pytest.approx(r.step_ms)
        for kind in ("input_dist", "kjt", "lookup", "output_dist", "grad_dist", "backward_update",
                     "dense_optimizer", "dense_fwd", "dense_bwd"):
            assert k[kind] > 0, f"rank {r.rank}: no {kind} time measured ({dict(k)})"
        # the unlabelled remainder is a minority of the step
        assert k["rest"] < 0.5 * r.step_ms, dict(k)


# ---------------------------------------------------------------------------------------------
# sparselift explain --attribution
# ---------------------------------------------------------------------------------------------

def test_explain_shows_measured_next_to_predicted_per_kind_and_draws_it(tmp_path: Any, capsys: Any) -> None:
    import os

    from torchrec_sparselift.cli import main

    tiny = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "tables", "cpu_tiny.json")
    cpu = ["--topology", "cpu-gloo", "--world-size", "2", "--quiet"]
    plan = str(tmp_path / "plan.json")
    assert main(["plan", "--tables", tiny, *cpu, "--out", plan, "--time-budget", "2"]) == 0
    att = StepAttribution(ranks=(attribute_events(_tree(), rank=0), attribute_events(_tree(), rank=1)),
                          label="tiny", pipeline="base")
    path = str(tmp_path / "att.json")
    save_attribution(path, att)
    capsys.readouterr()
    args = ["explain", plan, "--attribution", path, "--top", "1", "--quiet"]
    png = tmp_path / "plan.png"
    try:
        import matplotlib  # noqa: F401

        args += ["--png", str(png)]
    except ImportError:
        png = None
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Measured vs predicted per sparse-path node kind" in out
    block = out[out.index("Measured vs predicted"):]
    for kind in ("input_dist", "lookup", "grad_dist", "dense_bwd", "step"):
        assert f"\n{kind}" in block
    assert "predicted ms" in block
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["explain", plan, "--attribution", str(bad), "--quiet"]) != 0
    assert "not a SparseLift attribution file" in capsys.readouterr().err


def test_fit_groups_partition_the_kinds_and_scale_to_the_unprofiled_step() -> None:
    from torchrec_sparselift.calibration.attribution import FIT_GROUPS, group_kinds, measured_groups

    listed = [k for kinds in FIT_GROUPS.values() for k in kinds]
    assert sorted(listed) == sorted(list(KINDS) + ["overlap"]) and len(listed) == len(set(listed))
    busy = {k: 0.0 for k in KINDS}
    busy.update(lookup=4.0, backward_update=6.0, dense_fwd=5.0, dense_bwd=5.0, output_dist=2.0)
    idle = dict(busy, lookup=1.0, backward_update=2.0, output_dist=9.0)  # waits for the busy rank
    att = StepAttribution(ranks=(RankAttribution(rank=0, steps=2, step_ms=22.0, kinds_ms=busy),
                                 RankAttribution(rank=1, steps=2, step_ms=22.0, kinds_ms=idle)))
    g = measured_groups(att, 0.011)  # the unprofiled step was half the profiled one
    assert g == pytest.approx({"sparse": 0.005, "dense": 0.005, "comm": 0.001})  # rank 0's kinds, halved
    assert group_kinds({"lookup": 1.0, "overlap": -0.5, "grad_allreduce": 2.0}) == {
        "dense": 0.0, "comm": 1.5, "sparse": 1.0}
    with pytest.raises(ValueError, match="positive"):
        measured_groups(att, 0.0)


def test_profiler_notices_are_dropped_and_other_stderr_passed_on(capfd) -> None:
    import os

    from torchrec_sparselift.measure.attribution import _without_profiler_notices

    with _without_profiler_notices():
        os.write(2, b"USDT:2026-12-01 14:56:07 11350:11350 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
        os.write(2, b"STAGE:2026-12-01 14:56:00 11342:11342 SyncActivityProfilerHandler.cpp:51] Completed Stage\n")
    err = capfd.readouterr().err
    assert err == "a real warning\n"
