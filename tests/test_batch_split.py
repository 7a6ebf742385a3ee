"""Batch-split pipelining (runtime/batch_split.py) on 2 gloo ranks: exact (losses and final dense
and embedding weights equal the unsplit overlap pipeline's over 50 steps of TorchRec's DLRM, for
k = 2 and 4, table-wise alone, table-wise + row-wise + column-wise + data-parallel, and
table-row-wise + table-wise + row-wise), really
split (k output all-to-alls, all issued before the first chunk's dense forward, and k gradient
all-to-alls, each issued before the dense backward of the chunk before it), and refused with its
reason for models it cannot prove per-sample."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from launcher import run_ranks
from training_helpers import local_values, plan_with_fused, sharded_with_optimizers

WORLD = 2
STEPS = 50
LOCAL_B = 18  # k = 4 splits it unevenly: 5, 5, 4, 4
DIM = 8
ROWS = 120
DENSE_IN = 5
TABLES = ("t0", "t1", "t2", "t3", "t4")
KS = (2, 4)
#: table -> sharding of each tested plan
PLANS = {
    "table_wise": {"t0": ("tw", 0), "t1": ("tw", 1), "t2": ("tw", 0), "t3": ("tw", 1), "t4": ("tw", 0)},
    "mixed": {"t0": ("tw", 0), "t1": ("tw", 1), "t2": ("rw", None), "t3": ("cw", None), "t4": ("dp", None)},
    "table_row_wise": {"t0": ("twrw", None), "t1": ("tw", 1), "t2": ("twrw", None), "t3": ("tw", 0),
                       "t4": ("rw", None)},
}


def _model(batch_norm: bool = False) -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
                for i, t in enumerate(TABLES)],
        device=torch.device("meta"),
    )
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN,
                           dense_arch_layer_sizes=[8, DIM], over_arch_layer_sizes=[8, 1]))
    if batch_norm:
        model.model.dense_arch.model = torch.nn.Sequential(torch.nn.BatchNorm1d(DENSE_IN),
                                                           model.model.dense_arch.model)
    return model


def _batches(rank: int, n: int) -> List[Any]:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * rank + step)
        lengths = torch.randint(0, 4, (len(TABLES) * LOCAL_B,), generator=g)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(TABLES))], values=ids,
                                                  lengths=lengths)
        dense = torch.randn(LOCAL_B, DENSE_IN, generator=g)
        labels = (dense[:, 0] + 0.3 * dense[:, 1] > 0).float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


def _sharded(plan_name: str, state: Dict[str, Any] = None):  # type: ignore[assignment]
    torch.manual_seed(3)
    model = _model()
    plan, fused = plan_with_fused(model.model.sparse_arch.embedding_bag_collection, PLANS[plan_name], WORLD)
    return sharded_with_optimizers(model, plan, fused, state)


def _train(dmp, opt, chunks: int, batches, count=None, chain=None):  # type: ignore[no-untyped-def]
    """STEPS steps: the unsplit overlap pipeline (``chunks`` 0) or batch split into ``chunks``;
    losses, and the collectives per step when ``count`` is a list."""
    import torch.distributed as dist

    from torchrec_sparselift.runtime.batch_split import TrainPipelineBatchSplit
    from torchrec_sparselift.runtime.overlap import TrainPipelineOverlap
    from torchrec_sparselift.runtime.pipelines import make_train_pipeline

    device = torch.device("cpu")
    # the unsplit pipeline built directly; the split one as the runtime builds it from a plan
    pipe = (TrainPipelineOverlap(dmp, opt, device) if chunks == 0
            else make_train_pipeline("overlap", dmp, opt, device, batch_split=chunks,
                                     options=None if chain is None else {"chain_chunks": chain,
                                                                         "serial_link": False}))
    assert type(pipe) is (TrainPipelineOverlap if chunks == 0 else TrainPipelineBatchSplit)
    it = iter(batches)
    losses = []
    a2a = dist.all_to_all_single
    for step in range(STEPS):
        if count is not None and step == 3:
            calls: List[str] = []

            def traced(*args: Any, **kwargs: Any) -> Any:
                from torchrec_sparselift.runtime.overlap import _a2a_kind

                calls.append(_a2a_kind())
                return a2a(*args, **kwargs)

            def fwd(_m: Any, _i: Any, y: torch.Tensor) -> None:
                calls.append("over_arch_fwd")
                y.register_hook(lambda g: calls.append("over_arch_bwd"))

            over_arch = next(m for n, m in dmp.named_modules() if n.endswith("over_arch"))
            handle = over_arch.register_forward_hook(fwd)
            dist.all_to_all_single = traced
            try:
                losses.append(float(pipe.progress(it)[0]))
            finally:
                dist.all_to_all_single = a2a
                handle.remove()
            count.extend(calls)
        else:
            losses.append(float(pipe.progress(it)[0]))
    with pytest.raises(StopIteration):
        pipe.progress(it)
    return losses


def _run(rank: int, world: int) -> Dict[str, Any]:
    import copy
    import warnings

    warnings.filterwarnings("ignore")
    batches = _batches(rank, STEPS)
    out: Dict[str, Any] = {}
    for plan_name in PLANS:
        ref_dmp, ref_opt = _sharded(plan_name)
        start = copy.deepcopy(dict(ref_dmp.state_dict()))
        if plan_name == "table_wise":
            start_tw = copy.deepcopy(start)
        out[plan_name, "start"] = {k: local_values(v).clone() for k, v in ref_dmp.state_dict().items()}
        ref_calls: List[str] = []
        out[plan_name, 0] = _train(ref_dmp, ref_opt, 0, batches, count=ref_calls)
        out[plan_name, 0, "calls"] = ref_calls
        out[plan_name, 0, "weights"] = {k: local_values(v).clone() for k, v in ref_dmp.state_dict().items()}
        for k in KS:
            dmp, opt = _sharded(plan_name, copy.deepcopy(start))
            calls: List[str] = []
            out[plan_name, k] = _train(dmp, opt, k, batches, count=calls)
            out[plan_name, k, "calls"] = calls
            out[plan_name, k, "weights"] = {n: local_values(v).clone() for n, v in dmp.state_dict().items()}
            out[plan_name, k, "serial"] = _serial_groups(dmp)
    # the wrapper from an execution plan's optimizations: lift() reads batch_split and builds the split pipeline
    out["lifted"], out["lifted", "class"] = _lifted(copy.deepcopy(start_tw), batches)
    # chained: chunk j+1 issued when chunk j is read, on gloo's two-thread group
    dmp, opt = _sharded("table_wise", copy.deepcopy(start_tw))
    calls = []
    out["upfront"] = _train(dmp, opt, 4, batches, count=calls, chain=True)
    out["upfront", "calls"] = calls
    out["upfront", "weights"] = {n: local_values(v).clone() for n, v in dmp.state_dict().items()}
    from torchrec_sparselift.runtime.batch_split import serial_groups
    out["serial groups"] = len(serial_groups())
    return out


def _serial_groups(dmp) -> List[str]:  # type: ignore[no-untyped-def]
    """Per output dist of the model's sharded EBC: "serial" where it runs on a one-thread gloo
    group of :func:`serialize_output_collectives`, else its group's name."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from torchrec_sparselift.runtime.batch_split import serial_groups

    ebc = next(m for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection))
    serial = [id(g) for g in serial_groups()]
    return ["serial" if id(d._pg) in serial and id(getattr(d, "_dist", d)._pg) in serial
            else type(d).__name__ for d in ebc._output_dists if hasattr(d, "_pg")]


def _lifted(state: Dict[str, Any], batches: List[Any]):  # type: ignore[no-untyped-def]
    """Table-wise, through ``lift`` from a plan whose optimizations ask for batch split 2: losses
    and the pipeline's class."""
    import attrs
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from torchrec_sparselift.plan.execution_plan import Optimizations
    from torchrec_sparselift.runtime import lift

    dmp, _opt = _sharded("table_wise")

    @attrs.frozen
    class Plan:  # the two attributes the runtime reads of an execution plan
        sharding_plan: Any
        optimizations: Optimizations

    torch.manual_seed(3)
    lifted = lift(_model(), Plan(dmp.plan, Optimizations(pipeline="overlap", batch_split=2)),
                  device=torch.device("cpu"), embedding_optimizer=(RowWiseAdagrad, {"lr": 0.1}),
                  dense_optimizer_factory=lambda params: torch.optim.Adagrad(params, lr=0.05))
    lifted.model.load_state_dict(state)
    it = iter(batches)
    losses = [float(lifted.pipeline.progress(it)[0]) for _ in range(STEPS)]
    return losses, type(lifted.pipeline).__name__


def test_every_split_model_on_one_group_shares_one_serial_group(results):
    """The models of the run (each plan at each k, and lift's) all use the world group: one
    one-thread group serves them all (one per model would accumulate gloo groups in a process
    that builds many models, as a benchmark or a calibration does)."""
    for r in results:
        assert r["serial groups"] == 1
        assert all(r[p, k, "serial"] and set(r[p, k, "serial"]) == {"serial"} for p in PLANS for k in KS)


def test_lift_applies_the_plan_s_batch_split_and_trains_like_the_unsplit_pipeline(results):
    for rank, r in enumerate(results):
        assert r["lifted", "class"] == "TrainPipelineBatchSplit"
        torch.testing.assert_close(torch.tensor(r["lifted"]), torch.tensor(r["table_wise", 0]), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"rank {rank}: {m}")


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_ranks(_run, WORLD, timeout_s=600)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("k", KS)
def test_batch_split_losses_equal_the_unsplit_pipeline_over_50_steps(results, plan_name, k):
    for rank, r in enumerate(results):
        ref, split = r[plan_name, 0], r[plan_name, k]
        assert len(ref) == len(split) == STEPS
        torch.testing.assert_close(torch.tensor(split), torch.tensor(ref), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} {plan_name} k={k}: {m}")
        assert sum(ref[-10:]) < sum(ref[:10])  # it trains


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("k", KS)
def test_batch_split_final_weights_equal_the_unsplit_pipeline(results, plan_name, k):
    for rank, r in enumerate(results):
        ref, split = r[plan_name, 0, "weights"], r[plan_name, k, "weights"]
        assert split.keys() == ref.keys()
        assert any("embedding_bags" in n for n in ref) and any("over_arch" in n for n in ref)
        for n in ref:  # every table trains (a table that never updates would compare equal trivially)
            if "embedding_bags" in n and ref[n].numel():
                assert not torch.equal(ref[n], r[plan_name, "start"][n]), f"rank {rank} {plan_name}: {n} never trained"
        for n, v in ref.items():
            torch.testing.assert_close(split[n], v, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=n: f"rank {rank} {plan_name} k={k} {n}: {m}")


@pytest.mark.parametrize("k", KS)
def test_batch_split_issues_k_output_and_k_gradient_all_to_alls(results, k):
    """Table-wise: one pooled all-to-all per chunk forward and one gradient per chunk backward (the
    ids' all-to-alls are the next batch's, unchanged)."""
    for r in results:
        calls = r["table_wise", k, "calls"]
        assert calls.count("output_dist") == k
        assert calls.count("grad_dist") == k
        sparse = [c for c in calls if c in ("output_dist", "grad_dist", "over_arch_fwd", "over_arch_bwd")]
        # every chunk's output all-to-all is issued before the first chunk's dense forward (on a
        # one-thread gloo group: they travel one at a time); in backward (last chunk first) each
        # chunk's gradient all-to-all is issued before the dense backward of the chunk before it
        assert sparse == (["output_dist"] * k + ["over_arch_fwd"] * k + ["over_arch_bwd", "grad_dist"] * k)


def test_the_split_collectives_run_on_a_one_thread_gloo_group(results):
    for r in results:
        assert r["table_wise", 2, "serial"] == ["serial"]
        assert set(r["mixed", 4, "serial"]) == {"serial"} and len(r["mixed", 4, "serial"]) >= 2


def test_chained_chunks_are_exact_too(results):
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["upfront"]), torch.tensor(r["table_wise", 0]), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        for n, v in r["table_wise", 0, "weights"].items():
            torch.testing.assert_close(r["upfront", "weights"][n], v, rtol=1e-4, atol=1e-5)
        sparse = [c for c in r["upfront", "calls"] if c in ("output_dist", "grad_dist", "over_arch_fwd",
                                                              "over_arch_bwd")]
        # chunk j+1's output all-to-all issued when chunk j's embeddings are read, before its over arch
        assert sparse == (["output_dist"] + ["output_dist", "over_arch_fwd"] * 3 + ["over_arch_fwd"]
                          + ["over_arch_bwd", "grad_dist"] * 4)


def test_the_unsplit_pipeline_issues_one_of_each(results):
    for r in results:
        calls = [c for c in r["table_wise", 0, "calls"] if c != "input_dist"]
        assert calls == ["output_dist", "over_arch_fwd", "over_arch_bwd", "grad_dist"]


# ------------------------------------------------------------------------------------------------
# the per-sample rule (no processes)
# ------------------------------------------------------------------------------------------------


def test_a_model_with_batch_norm_is_refused_with_the_reason():
    from torchrec_sparselift.runtime.batch_split import NotPerSample, TrainPipelineBatchSplit, per_sample_violation

    model = _model(batch_norm=True)
    why = per_sample_violation(model)
    assert why is not None and "BatchNorm1d" in why and "model.dense_arch.model.0" in why
    assert "normalizes over the batch" in why
    with pytest.raises(NotPerSample, match="BatchNorm1d"):
        TrainPipelineBatchSplit(model, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1),
                                torch.device("cpu"), chunks=2)
    # a declaration does not lift it: BatchNorm mixes samples whatever the user says
    assert per_sample_violation(model, declared=True) == why


def test_dlrm_is_per_sample_and_an_unknown_module_needs_the_declaration():
    from torchrec_sparselift.runtime.batch_split import per_sample_violation

    assert per_sample_violation(_model()) is None

    class InBatchNegatives(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ x.T

    model = _model()
    model.model.over_arch.extra = InBatchNegatives()
    why = per_sample_violation(model)
    assert why is not None and "model.over_arch.extra (InBatchNegatives)" in why and "per_sample=True" in why
    assert per_sample_violation(model, declared=True) is None
    model.model.over_arch.drop = torch.nn.Dropout(0.2)
    assert "Dropout" in per_sample_violation(model, declared=True)
    model.loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
    del model.model.over_arch.drop
    assert "reduction='sum'" in per_sample_violation(model)


def test_chunk_sizes_cover_the_batch_in_order():
    from hypothesis import given
    from hypothesis import strategies as st

    from torchrec_sparselift.runtime.batch_split import MAX_CHUNKS, chunk_sizes

    @given(st.integers(1, MAX_CHUNKS), st.integers(0, 500))
    def check(k: int, extra: int) -> None:
        sizes = chunk_sizes(k + extra, k)
        assert len(sizes) == k and sum(sizes) == k + extra
        assert max(sizes) - min(sizes) <= 1 and list(sizes) == sorted(sizes, reverse=True)

    check()
    for bad in (0, MAX_CHUNKS + 1, 2.0, True):
        with pytest.raises(ValueError, match="chunks must be an int"):
            chunk_sizes(100, bad)
    with pytest.raises(ValueError, match="at most 3 chunks"):
        chunk_sizes(3, 4)


def test_slice_batch_and_merge_outputs_invert_each_other():
    from torchrec_sparselift.runtime.batch_split import chunk_sizes, merge_outputs, slice_batch

    batch = _batches(0, 1)[0]
    sizes = chunk_sizes(LOCAL_B, 4)
    parts, start = [], 0
    for b in sizes:
        parts.append(slice_batch(batch, start, start + b, LOCAL_B))
        start += b
    assert torch.equal(torch.cat([p.dense_features for p in parts]), batch.dense_features)
    assert torch.equal(torch.cat([p.labels for p in parts]), batch.labels)
    whole = batch.sparse_features.to_dict()
    for key in whole:
        got = [p.sparse_features.to_dict()[key] for p in parts]
        assert torch.equal(torch.cat([g.lengths() for g in got]), whole[key].lengths())
        assert torch.equal(torch.cat([g.values() for g in got]), whole[key].values())
    means = [p.dense_features.mean() for p in parts]
    merged = merge_outputs([(m, p.labels) for m, p in zip(means, parts)], sizes)
    torch.testing.assert_close(merged[0], batch.dense_features.mean())
    assert torch.equal(merged[1], batch.labels)
    with pytest.raises(ValueError, match="no batch dimension first"):
        slice_batch(torch.zeros(3, LOCAL_B), 0, 2, LOCAL_B)


def test_split_batch_cuts_every_key_of_a_jagged_tensor_as_a_per_key_slice_does():
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_sparselift.runtime.batch_split import chunk_sizes, split_batch

    @settings(max_examples=80, deadline=None)
    @given(st.integers(1, 6), st.integers(1, 20), st.integers(1, 8), st.booleans(), st.integers(0, 2 ** 16),
           st.booleans())
    def check(keys: int, batch: int, k: int, weighted: bool, seed: int, empty: bool) -> None:
        k = min(k, batch)
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 4, (keys * batch,), generator=g, dtype=torch.int32)
        n = int(lengths.sum())
        kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(keys)], values=torch.randint(0, 99, (n,), generator=g),
                                weights=torch.rand(n, generator=g) if weighted else None, lengths=lengths,
                                stride=batch)
        sizes = list(chunk_sizes(batch, k))
        if empty:  # chunks of no sample (slice_batch cuts [0, start), [start, stop), [stop, B))
            cut = int(torch.randint(0, len(sizes) + 1, (1,), generator=g))
            sizes = sizes[:cut] + [0] + sizes[cut:]
        parts = split_batch(kjt, sizes, batch)
        assert [p.stride() for p in parts] == list(sizes)
        whole, start = kjt.to_dict(), 0
        for p, b in zip(parts, sizes):
            assert p.keys() == kjt.keys()
            if b == 0:  # (TorchRec's to_dict does not take a jagged tensor of no sample)
                assert p.lengths().numel() == 0 and p.values().numel() == 0
                continue
            got = p.to_dict()
            for key, jt in whole.items():  # the reference: one key's samples [start, start + b)
                offs = jt.offsets()
                lo, hi = int(offs[start]), int(offs[start + b])
                assert torch.equal(got[key].lengths(), jt.lengths()[start:start + b])
                assert torch.equal(got[key].values(), jt.values()[lo:hi])
                if weighted:
                    assert torch.equal(got[key].weights(), jt.weights()[lo:hi])
            start += b

    check()
    with pytest.raises(ValueError, match="do not cover a batch of 5"):
        split_batch(torch.zeros(5, 2), [2, 2], 5)


# ------------------------------------------------------------------------------------------------
# the GPU check script (no GPU here: it must import, judge, and refuse cleanly)
# ------------------------------------------------------------------------------------------------


def _gpu_script():  # type: ignore[no-untyped-def]
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_the_gpu_check_refuses_cleanly_without_cuda():
    import os
    import subprocess
    import sys

    _module, path = _gpu_script()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for check in ("overlap", "batch-split"):
        done = subprocess.run([sys.executable, path, check, "--chunks", "2,4"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == _module.NO_CUDA, done.stderr
        assert "no CUDA device visible, nothing checked" in done.stderr and "Traceback" not in done.stderr
    bad = subprocess.run([sys.executable, path, "batch-split", "--chunks", "1"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "--chunks must name k in 2..16" in bad.stderr


def test_the_gpu_check_judges_losses_and_weights():
    module, _path = _gpu_script()
    w = {"a": torch.tensor([1.0, 2.0])}

    def result(split_losses, split_w, cls="TrainPipelineBatchSplit"):  # type: ignore[no-untyped-def]
        return [{"rank": 0, "runs": {"k=1": {"losses": [1.0, 0.5], "class": "TrainPipelineOverlap"},
                                     "k=2": {"losses": split_losses, "class": cls}},
                 "weights": {"k=1": w, "k=2": split_w}}]

    checked = [("k=2", module.SPLIT_CLASS)]
    assert module.check(result([1.0, 0.5], w), checked, 1e-4, 1e-2)[0].startswith("ok")
    assert module.check(result([1.0, 0.51], w), checked, 1e-4, 1e-2)[0].startswith("FAILED")
    assert module.check(result([1.0, 0.5], {"a": torch.tensor([1.0, 2.5])}), checked, 1e-4, 1e-2)[0].startswith("FAILED")
    assert module.check(result([1.0, 0.5], w, cls="TrainPipelineOverlap"), checked, 1e-4, 1e-2)[0].startswith("FAILED")
    # losses only (the overlap check): the weights do not count
    assert module.check(result([1.0, 0.5], {"a": torch.tensor([1.0, 2.5])}), checked, 1e-4)[0].startswith("ok")
