"""The overlap train pipeline (runtime/overlap.py) on 2 gloo ranks: exact (losses and final weights
equal TrainPipelineBase's over 50 steps of TorchRec's DLRM) and really reordered (the output
all-to-all is issued before the bottom MLP runs, the gradient all-to-all is waited on only after
the bottom MLP's backward, the dense all-reduce is in flight during the embedding backward)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from launcher import run_ranks
from training_helpers import local_values, sharded_with_optimizers

WORLD = 2
STEPS = 50
LOCAL_B = 16
DIM = 8
ROWS = 200
TABLES = ("t0", "t1", "t2", "t3")
DENSE_IN = 13
TRACED_STEPS = 6
MADE_STEPS = 12


def _model() -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
                for i, t in enumerate(TABLES)],
        device=torch.device("meta"),
    )
    return DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN,
                          dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1]))


def _batches(rank: int, n: int) -> List[Any]:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * rank + step)
        lengths = torch.randint(0, 4, (len(TABLES) * LOCAL_B,), generator=g)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(TABLES))], values=ids, lengths=lengths)
        dense = torch.randn(LOCAL_B, DENSE_IN, generator=g)
        labels = (dense[:, 0] + (ids[: LOCAL_B] % 2).float() > 0.5).float() if len(ids) >= LOCAL_B else torch.zeros(LOCAL_B)
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


def _sharded(state: Dict[str, Any] = None):  # type: ignore[assignment]
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, row_wise, table_wise,
    )  # fmt: skip
    from torchrec.distributed.types import ShardingPlan

    torch.manual_seed(3)
    model = _model()
    ebc = model.model.sparse_arch.embedding_bag_collection
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=0, compute_kernel="fused"), "t1": table_wise(rank=1, compute_kernel="fused"),
         "t2": row_wise(compute_kernel="fused"), "t3": column_wise(ranks=[0, 1], compute_kernel="fused")},
        world_size=WORLD, local_size=WORLD, device_type="cpu",
    )})  # fmt: skip
    return sharded_with_optimizers(model, plan, model.model.sparse_arch.parameters(), state)


def _train(dmp, opt, cls, batches, steps, traced):  # type: ignore[no-untyped-def]
    """``steps`` steps of pipeline ``cls``; returns (losses, trace events of the first
    TRACED_STEPS steps, or [] when not ``traced``)."""
    from torchrec_sparselift.runtime.overlap import CommTimeline

    pipe = cls(dmp, opt, torch.device("cpu"))
    it = iter(batches)
    timeline = CommTimeline()
    if traced:
        timeline.install(dmp, pipe)
    losses = []
    for step in range(steps):
        if step == TRACED_STEPS:
            timeline.uninstall()
        if step < TRACED_STEPS:
            timeline.mark("step_start")
        losses.append(float(pipe.progress(it)[0]))
        if step < TRACED_STEPS:
            timeline.mark("step_end")
    timeline.uninstall()
    if steps == len(batches):
        with pytest.raises(StopIteration):
            pipe.progress(it)
    return losses, [(what, kind) for _t, what, kind, _c in timeline.events] if traced else []


def _run(rank: int, world: int) -> Dict[str, Any]:
    import copy
    import warnings

    from torchrec.distributed.train_pipeline import TrainPipelineBase

    from torchrec_sparselift.runtime.overlap import TrainPipelineOverlap

    warnings.filterwarnings("ignore")
    batches = _batches(rank, STEPS)
    base_dmp, base_opt = _sharded()
    start = copy.deepcopy(dict(base_dmp.state_dict()))
    ov_dmp, ov_opt = _sharded(copy.deepcopy(start))  # loading consumes the dict's entries
    out: Dict[str, Any] = {}
    # exactness: TorchRec's base pipeline untouched (DDP's built-in all-reduce, no tracing) against
    # the overlap pipeline traced for its first steps (tracing only records)
    out["base"], _ = _train(base_dmp, base_opt, TrainPipelineBase, batches, STEPS, traced=False)
    out["overlap"], out["overlap_trace"] = _train(ov_dmp, ov_opt, TrainPipelineOverlap, batches, STEPS, traced=True)
    for name, dmp in (("base", base_dmp), ("overlap", ov_dmp)):
        out[name + "_weights"] = {k: local_values(v).clone() for k, v in dmp.state_dict().items()}
    # the kind as the runtime builds it from a plan's pipeline name
    from torchrec_sparselift.runtime.pipelines import make_train_pipeline

    made_dmp, made_opt = _sharded(copy.deepcopy(start))
    built: List[str] = []

    def made(dmp, opt, device):  # type: ignore[no-untyped-def]
        pipe = make_train_pipeline("overlap", dmp, opt, device)
        built.append(type(pipe).__name__)
        return pipe

    out["made"], _ = _train(made_dmp, made_opt, made, batches, MADE_STEPS, traced=False)
    out["made_class"] = built
    # the order TorchRec's base pipeline runs in, for contrast (a third model, a few steps)
    traced_dmp, traced_opt = _sharded(copy.deepcopy(start))
    _, out["base_trace"] = _train(traced_dmp, traced_opt, TrainPipelineBase, batches, TRACED_STEPS + 1, traced=True)
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_ranks(_run, WORLD, timeout_s=300)


def test_overlap_losses_equal_base_over_50_steps(results):
    for rank, r in enumerate(results):
        assert len(r["overlap"]) == len(r["base"]) == STEPS
        torch.testing.assert_close(torch.tensor(r["overlap"]), torch.tensor(r["base"]), rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert r["base"][0] != r["base"][-1]  # it trains


def test_make_train_pipeline_overlap_trains_like_base(results):
    for r in results:
        assert r["made_class"] == ["TrainPipelineOverlap"]
        assert r["made"] == pytest.approx(r["base"][:MADE_STEPS], rel=1e-6)
        assert r["made"][-1] < r["made"][0]  # it trains


def test_the_planner_finds_dlrm_s_bottom_mlp_independent_of_the_embeddings():
    from torchrec_sparselift.semantics.dense import independent_modules

    model = _model()
    ebc = model.model.sparse_arch.embedding_bag_collection
    assert independent_modules(model, [ebc]) == [model.model.dense_arch]
    assert independent_modules(model, []) == []


def test_a_bare_sharded_module_is_not_traced(monkeypatch):
    # The scale workloads plan a bare EmbeddingBagCollection: tracing its forward over 10,000 features
    # took ~3.5 s of `sparselift plan` and can only find nothing beside it.
    from torchrec_sparselift.semantics.dense import independent_modules

    ebc = _model().model.sparse_arch.embedding_bag_collection

    calls = []
    monkeypatch.setattr(type(ebc), "forward", lambda self, *a, **k: calls.append(1))
    assert independent_modules(ebc, [ebc]) == []
    assert calls == []  # (a failed trace would also give [], so the call itself is what is checked)


def test_overlap_final_weights_equal_base(results):
    for rank, r in enumerate(results):
        assert r["overlap_weights"].keys() == r["base_weights"].keys()
        for k, v in r["base_weights"].items():
            torch.testing.assert_close(r["overlap_weights"][k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"rank {rank} {k}: {m}")


def _steps(trace):
    """The traced steps' events, one list per step (the first, which fills the pipeline, dropped)."""
    steps, cur = [], None
    for what, kind in trace:
        if what == "step_start":
            cur = []
        elif what == "step_end":
            steps.append(cur)
        elif cur is not None:
            cur.append((what, kind))
    return steps[1:TRACED_STEPS]


def _pos(step, what, kind=""):
    return next(i for i, e in enumerate(step) if e == (what, kind))


def test_output_all_to_all_in_flight_during_bottom_mlp(results):
    """Overlap: the output all-to-all is issued before the bottom MLP's forward and waited on
    after it; the gradient all-to-all is issued before the bottom MLP's backward and waited on
    after it, and the dense all-reduce is issued after it and before the embedding backward.
    Base: none of this."""
    for r in results:
        steps = _steps(r["overlap_trace"])
        assert len(steps) == TRACED_STEPS - 1
        for st in steps:
            assert _pos(st, "issue", "output_dist") < _pos(st, "dense_fwd_start") < _pos(st, "dense_fwd_end") \
                < _pos(st, "wait_start", "output_dist"), st
            assert _pos(st, "issue", "grad_dist") < _pos(st, "dense_bwd_start") < _pos(st, "dense_bwd_end") \
                < _pos(st, "wait_start", "grad_dist"), st
            # gloo: the dense all-reduce goes after the gradient all-to-all (not beside it on the
            # link) and is in flight during the embedding backward, before the graph ends
            assert _pos(st, "wait_end", "grad_dist") < _pos(st, "issue", "allreduce") < _pos(st, "graph_done"), st
        for st in _steps(r["base_trace"]):
            assert _pos(st, "dense_fwd_end") < _pos(st, "issue", "output_dist"), st
            assert _pos(st, "wait_end", "grad_dist") < _pos(st, "dense_bwd_start"), st


def test_overlap_refuses_a_model_pipelined_elsewhere():
    from torchrec_sparselift.runtime.overlap import TrainPipelineOverlap

    pipe = TrainPipelineOverlap.__new__(TrainPipelineOverlap)

    class _M:
        forward = object()

    pipe._pipelined_modules = [_M()]
    with pytest.raises(RuntimeError, match="detach"):
        pipe._overlap_forwards()
