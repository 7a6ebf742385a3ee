"""Ids on the wire (runtime.wire_ids): narrow and deduplicated ids train exactly, on 2 gloo ranks.

One 2-rank job (module fixture) trains a 3-table EmbeddingBagCollection model for STEPS steps
under each sharding (table-wise, row-wise, table-row-wise, column-wise, data-parallel) with the
fused row-wise AdaGrad, once unrewritten and once per rewrite (int32 ids; dedup of every feature
at int64 and at int32), from the same weights on the same batches; the ids are skewed (many
repeat within a batch, so dedup has duplicates to remove and the fused update sees rows hit
several times). The tests compare losses and every rank's final weights (embedding shards and
dense) with the unrewritten run, bit for bit (the receiver's KJT equals TorchRec's and the lookup
runs on it, so nothing downstream differs; the opt-in lookup on the distinct rows within
floating-point tolerance), count the input all-to-all's bytes with ``CommCounter``, and
check the exchange delivers TorchRec's KJT exactly (weighted too). The pure prices have their
hypothesis properties at the bottom.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher import run_ranks
from torchrec_sparselift.cost import wire_ids as W

WORLD = 2
STEPS = 50
SEED = 11
DIM = 8
LOCAL_B = 8
BYTES_B = 256
TABLES = (("t0", 64, "f0"), ("t1", 96, "f1"), ("t2", 40, "f2"))  # name, rows, feature; t1 mean-pooled
FEATURES = tuple(f for _, _, f in TABLES)
SHARDINGS = ("table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel")
#: rewrite -> (id dtype, dedup features, lookup on the distinct rows: ``apply_wire_ids(...,
#: unique_rows=True)`` after lift; else through lift's keywords, the lookup on the rebuilt ids)
REWRITES = {"int32": ("int32", (), False), "dedup_int64": ("int64", FEATURES, False),
            "dedup_int32": ("int32", FEATURES, False), "dedup_int32_unique": ("int32", FEATURES, True)}
#: rewrites whose floating-point sums run in another order (pooling from the distinct rows)
REORDERED = {"dedup_int32_unique"}
CLOSE = dict(rtol=1e-5, atol=1e-6)
TOL = dict(rtol=0.0, atol=0.0)  # bit for bit
#: pipeline runs: (sharding, lift keywords); batch split does not split t1's mean-pooled row-wise output
PIPELINES = {"sparse_dist": ("row_wise", dict(pipeline="sparse_dist")),
             "overlap": ("row_wise", dict(pipeline="overlap")),
             "batch_split": ("table_wise", dict(pipeline="overlap", batch_split=2,
                                                pipeline_options={"per_sample": True}))}


def _model() -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    class Rec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f],
                                   pooling=PoolingType.MEAN if n == "t1" else PoolingType.SUM)
                for n, r, f in TABLES])
            self.dense = torch.nn.Linear(4, DIM)
            self.over = torch.nn.Linear(DIM * (1 + len(FEATURES)), 1)

        def forward(self, batch):  # type: ignore[no-untyped-def]
            kt = self.ebc(batch.sparse_features)
            x = torch.cat([self.dense(batch.dense_features)] + [kt[f] for f in FEATURES], dim=1)
            logits = self.over(x).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            return loss, (loss.detach(), logits.detach())

    return Rec()


def _kjt(rank: int, step: int, weighted: bool = False, b: int = LOCAL_B):  # type: ignore[no-untyped-def]
    """Skewed ids (a cube of a uniform draw: low rows repeat), int64 ids and lengths as TorchRec's
    dataloaders give them, 0-5 ids per bag."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(7919 * rank + step)
    lengths = torch.randint(0, 6, (len(FEATURES) * b,), generator=g)
    per_key = lengths.view(len(FEATURES), b).sum(1).tolist()
    ids = torch.cat([(torch.rand(n, generator=g) ** 3 * rows).long() for (_, rows, _), n in zip(TABLES, per_key)])
    weights = torch.rand(ids.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=ids, lengths=lengths, weights=weights)


def _batches(rank: int, n: int, b: int = LOCAL_B):  # type: ignore[no-untyped-def]
    from torchrec.datasets.utils import Batch

    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(31 * rank + step)
        kjt = _kjt(rank, step, b=b)
        labels = (torch.rand(b, generator=g) < 0.5).float()
        out.append(Batch(dense_features=torch.randn(b, 4, generator=g), sparse_features=kjt, labels=labels))
    return out


def _plan(model: torch.nn.Module, sharding: str):  # type: ignore[no-untyped-def]
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    def gen(i: int):  # type: ignore[no-untyped-def]
        if sharding == "table_wise":
            return sp.table_wise(rank=i % WORLD, compute_kernel="fused")
        if sharding == "row_wise":
            return sp.row_wise(compute_kernel="fused")
        if sharding == "table_row_wise":
            return sp.table_row_wise(host_index=0)
        if sharding == "column_wise":
            return sp.column_wise(ranks=[i % WORLD, (i + 1) % WORLD], compute_kernel="fused")
        return sp.data_parallel()

    ebc_plan = sp.construct_module_sharding_plan(
        model.ebc, {n: gen(i) for i, (n, _, _) in enumerate(TABLES)}, world_size=WORLD, local_size=WORLD,
        device_type="cpu")
    for n, _, _ in TABLES:
        if sharding == "table_row_wise":  # its generator takes no kernel
            ebc_plan[n].compute_kernel = "fused"
    return ShardingPlan({"ebc": ebc_plan})


def _lift(sharding: str, start, pipeline: str = "base", wire=("int64", (), False), **kwargs):  # type: ignore[no-untyped-def]
    """The model lifted under ``sharding`` from the weights ``start``; ``wire``: (id dtype, dedup
    features, lookup on the distinct rows), through lift's keywords as a plan applies it, or
    (with distinct-row lookups, which no plan sets) applied after lift."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from torchrec_sparselift.runtime import copy_full_state, lift
    from torchrec_sparselift.runtime.wire_ids import apply_wire_ids

    dtype, dedup, unique_rows = wire
    model = _model()
    lifted = lift(model, _plan(model, sharding), device=torch.device("cpu"), pipeline=pipeline,
                  embedding_optimizer=(RowWiseAdagrad, {"lr": 0.3}),
                  dense_optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1),
                  **(dict(id_dtype=dtype, dedup_features=dedup) if not unique_rows else {}), **kwargs)
    if unique_rows:
        lifted.model.wire_ids_tables = apply_wire_ids(lifted.model, dtype, dedup, unique_rows=True)
    copy_full_state(lifted.model, start)
    return lifted


def _train(lifted, batches):  # type: ignore[no-untyped-def]
    losses = []
    for b in batches:
        loss, _ = lifted.model(b)
        loss.backward()
        lifted.optimizer.step()
        lifted.optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _weights(model: torch.nn.Module) -> dict:
    """This rank's weights: every embedding shard it holds and every dense parameter."""
    out = {}
    for key, value in model.state_dict().items():
        if not key.endswith("weight") and not key.endswith("bias"):
            continue
        if hasattr(value, "local_shards"):
            for i, s in enumerate(value.local_shards()):
                out[f"{key}#{i}"] = s.tensor.detach().clone()
        else:
            out[key] = value.detach().clone()
    return out


def _input_bytes(lifted, batch) -> dict:  # type: ignore[no-untyped-def]
    from torchrec_sparselift.runtime.comm_counter import CommCounter

    with CommCounter(lifted.model) as counter, torch.no_grad():  # forward only: no update
        lifted.model(batch)
    calls = [c for c in counter.calls if c.kind == "input_dist"]
    return {"bytes": counter.link_bytes().get("input_dist", 0), "dtypes": sorted({c.dtype for c in calls})}


def _exchange(rank: int) -> dict:
    """TorchRec's KJTAllToAll and WireIdsAllToAll (narrow; dedup) on one weighted KJT each."""
    import torch.distributed as dist
    from torchrec.distributed.dist_data import KJTAllToAll

    from torchrec_sparselift.runtime.wire_ids import WireIdsAllToAll

    out = {}
    for name, splits in (("tw", [2, 1]), ("rw", [3, 3])):
        kjt = _kjt(rank, 99, weighted=True)
        if name == "rw":  # every feature to every rank, as a bucketized KJT is
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=kjt.keys() * 2, values=torch.cat([kjt.values(), kjt.values().flip(0)]),
                lengths=torch.cat([kjt.lengths(), kjt.lengths().flip(0)]),
                weights=torch.cat([kjt.weights(), kjt.weights().flip(0)]))
        inner = KJTAllToAll(dist.group.WORLD, splits)
        results = {"torchrec": inner(kjt).wait().wait(),
                   "int32": WireIdsAllToAll(inner, "int32")(kjt).wait().wait(),
                   "dedup": WireIdsAllToAll(inner, "int32", ["f0", "f2"])(kjt).wait().wait()}
        out[name] = {k: (v.keys(), v.lengths().long(), v.values().long(), v.weights(), v.stride(),
                         str(v.values().dtype), str(v.lengths().dtype)) for k, v in results.items()}
    return out


def _job(rank: int, world_size: int) -> dict:
    from torchrec_sparselift.runtime.wire_ids import UniqueRowsLookup, WireFeaturesDist

    torch.manual_seed(SEED)
    start = {k: v.detach().clone() for k, v in _model().state_dict().items()}
    batches = _batches(rank, STEPS)
    big = _batches(rank, 1, b=BYTES_B)[0]  # bytes are counted on a larger batch (headers amortized)
    out: dict = {"exchange": _exchange(rank)}
    for sharding in SHARDINGS:
        base = _lift(sharding, start)
        out[(sharding, "base", "bytes")] = _input_bytes(base, big)
        out[(sharding, "base")] = (_train(base, batches), _weights(base.model))
        for name, (dtype, dedup, unique_rows) in REWRITES.items():
            lifted = _lift(sharding, start, wire=(dtype, dedup, unique_rows))
            out[(sharding, name, "bytes")] = _input_bytes(lifted, big)
            out[(sharding, name)] = (_train(lifted, batches), _weights(lifted.model))
            wrapped = sum(isinstance(d, WireFeaturesDist) for m in lifted.model.modules()
                          for d in getattr(m, "_input_dists", ()))  # built at the first forward
            unique = sum(isinstance(getattr(lk, "forward", None), UniqueRowsLookup) for m in lifted.model.modules()
                         for lk in getattr(m, "_lookups", ()))
            out[(sharding, name, "applied")] = (list(lifted.model.wire_ids_tables), wrapped,
                                                lifted.settings.label(), unique)
    # the pipelines call input_dist themselves, a batch ahead (batch split: the overlap pipeline's
    # output all-to-alls in 2 chunks, runtime.batch_split)
    for kind, (sharding, extra) in PIPELINES.items():
        for name in ("base", "int32", "dedup_int32", "dedup_int32_unique"):
            wire = REWRITES.get(name, ("int64", (), False))
            lifted = _lift(sharding, start, wire=wire, **extra)
            it = iter(batches[:20])
            losses = []
            while True:
                try:
                    losses.append(float(lifted.pipeline.progress(it)[0]))
                except StopIteration:
                    break
            out[("pipeline", kind, name)] = (losses, _weights(lifted.model))
    return out


@pytest.fixture(scope="module")
def runs():  # type: ignore[no-untyped-def]
    return run_ranks(_job, WORLD, timeout_s=900)


def _assert_same(a, b, what: str, tol=TOL) -> None:  # type: ignore[no-untyped-def]
    (la, wa), (lb, wb) = a, b
    assert len(la) == len(lb) and la, what
    for i, (x, y) in enumerate(zip(la, lb)):
        assert math.isclose(x, y, rel_tol=tol["rtol"], abs_tol=tol["atol"]), f"{what}: loss {i} {x} != {y}"
    assert set(wa) == set(wb), what
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], **tol, msg=lambda m: f"{what}: {k}: {m}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", [s for s in SHARDINGS if s != "data_parallel"])
@pytest.mark.parametrize("rewrite", list(REWRITES))
def test_rewrite_trains_exactly_as_unrewritten(runs, sharding: str, rewrite: str) -> None:  # type: ignore[no-untyped-def]
    for rank, out in enumerate(runs):
        _assert_same(out[(sharding, rewrite)], out[(sharding, "base")], f"rank {rank} {sharding} {rewrite}",
                     CLOSE if rewrite in REORDERED else TOL)
        tables, wrapped, label, unique = out[(sharding, rewrite, "applied")]
        assert tables == [f"ebc.{n}" for n, _, _ in TABLES]
        assert wrapped >= 1
        if not REWRITES[rewrite][2]:  # through lift's keywords: in the settings' label
            assert "ids int32" in label or "dedup f0,f1,f2" in label, label
        # the groups that deduplicate look up their distinct rows once (t1 is mean-pooled: its
        # group too, unweighted)
        assert (unique >= 1) == (rewrite in REORDERED), (rewrite, unique)
    # the losses moved: the comparison is over real training, not a frozen model
    losses = runs[0][(sharding, "base")][0]
    assert losses[-1] != losses[0]


def _empty_job(rank: int, world_size: int) -> dict:
    """Row-wise tables whose ids all fall in rank 0's rows: rank 1's group receives no ids (its
    lookup pools only empty bags). Unrewritten and with dedup's distinct-row lookup, 6 steps."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(SEED)
    start = {k: v.detach().clone() for k, v in _model().state_dict().items()}
    batches = []
    for b in _batches(rank, 6):
        kjt = b.sparse_features
        low = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % 8, lengths=kjt.lengths(), stride=kjt.stride())
        batches.append(Batch(dense_features=b.dense_features, sparse_features=low, labels=b.labels))
    base = _lift("row_wise", start)
    unique = _lift("row_wise", start, wire=("int32", FEATURES, True))
    return {"base": (_train(base, batches), _weights(base.model)),
            "unique": (_train(unique, batches), _weights(unique.model))}


@pytest.mark.multiprocess
def test_distinct_row_lookup_trains_where_a_rank_receives_no_ids() -> None:
    for rank, out in enumerate(run_ranks(_empty_job, WORLD, timeout_s=120)):
        _assert_same(out["unique"], out["base"], f"rank {rank} row-wise, no ids on rank 1", CLOSE)


@pytest.mark.multiprocess
def test_data_parallel_is_left_alone(runs) -> None:  # type: ignore[no-untyped-def]
    for out in runs:
        for rewrite in REWRITES:
            tables, wrapped, _, unique = out[("data_parallel", rewrite, "applied")]
            assert tables == [] and wrapped == 0 and unique == 0
            _assert_same(out[("data_parallel", rewrite)], out[("data_parallel", "base")], f"dp {rewrite}")
            assert out[("data_parallel", rewrite, "bytes")]["bytes"] == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", [s for s in SHARDINGS if s != "data_parallel"])
def test_narrow_ids_halve_the_input_all_to_all(runs, sharding: str) -> None:  # type: ignore[no-untyped-def]
    for out in runs:
        base, narrow = out[(sharding, "base", "bytes")], out[(sharding, "int32", "bytes")]
        assert base["dtypes"] == ["torch.int64"] and narrow["dtypes"] == ["torch.int32"]
        assert base["bytes"] > 0 and narrow["bytes"] * 2 == base["bytes"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_dedup_sends_fewer_bytes_than_narrow_on_repeating_ids(runs, sharding: str) -> None:  # type: ignore[no-untyped-def]
    for out in runs:
        narrow = out[(sharding, "int32", "bytes")]["bytes"]
        dedup = out[(sharding, "dedup_int32", "bytes")]["bytes"]
        assert out[(sharding, "dedup_int32", "bytes")]["dtypes"] == ["torch.int32", "torch.uint8"]
        assert 0 < dedup < narrow


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(PIPELINES))
@pytest.mark.parametrize("rewrite", ["int32", "dedup_int32", "dedup_int32_unique"])
def test_pipelines_with_ids_on_the_wire_train_exactly(runs, kind: str, rewrite: str) -> None:  # type: ignore[no-untyped-def]
    for rank, out in enumerate(runs):
        _assert_same(out[("pipeline", kind, rewrite)], out[("pipeline", kind, "base")], f"rank {rank} {kind}",
                     CLOSE if rewrite in REORDERED else TOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tw", "rw"])
def test_exchange_delivers_torchrecs_kjt_weighted_too(runs, layout: str) -> None:  # type: ignore[no-untyped-def]
    for out in runs:
        ref = out["exchange"][layout]["torchrec"]
        for name in ("int32", "dedup"):
            got = out["exchange"][layout][name]
            assert got[0] == ref[0] and got[4] == ref[4], name
            for a, b in zip(got[1:4], ref[1:4]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            assert got[5] == "torch.int32" and got[6] == "torch.int32"


# -- single process ----------------------------------------------------------------------------------


def test_fused_rowwise_adagrad_sums_a_batchs_duplicate_rows_before_its_one_update() -> None:
    """Why dedup cannot change the update: TBE's backward (fbgemm, CPU) adds the gradients of a
    row's every occurrence in the batch and updates the row and its AdaGrad state once with the
    sum; one update per occurrence would give other weights."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
    )  # fmt: skip

    rows, dim, lr, eps = 8, 4, 0.1, 1e-8
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=lr, eps=eps, pooling_mode=PoolingMode.SUM)
    w0 = tbe.split_embedding_weights()[0].detach().clone()
    out = tbe(torch.tensor([3, 3, 5, 3]), torch.tensor([0, 3, 4]))  # bags [3, 3, 5] and [3]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    out.backward(g)
    w1 = tbe.split_embedding_weights()[0]

    def adagrad(w: torch.Tensor, state: torch.Tensor, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        state = state + (grad * grad).mean()
        return w - lr * grad / (state.sqrt() + eps), state

    summed, _ = adagrad(w0[3], torch.zeros(()), 2 * g[0] + g[1])
    torch.testing.assert_close(w1[3], summed, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w1[5], adagrad(w0[5], torch.zeros(()), g[0])[0], rtol=1e-6, atol=1e-6)
    w, state = w0[3], torch.zeros(())
    for grad in (g[0], g[0], g[1]):  # one update per occurrence: not what TBE does
        w, state = adagrad(w, state, grad)
    assert not torch.allclose(w1[3], w, rtol=1e-4, atol=1e-5)


def test_narrow_ids_refused_for_a_table_past_int32_naming_it() -> None:
    assert W.narrow_refusal([("small", 1000), ("edge", 2**31)]) is None
    why = W.narrow_refusal([("small", 1000), ("huge", 2**31 + 1)])
    assert why is not None and "huge" in why and "small" not in why and "int64" in why


def test_unknown_id_dtype_refused_with_choices() -> None:
    from torchrec_sparselift.runtime.model_parallel import RuntimeSettings

    with pytest.raises(ValueError, match="int64, int32"):
        RuntimeSettings(id_dtype="int16")
    with pytest.raises(ValueError, match="int64, int32"):
        W.ids_bytes(10, "int8")


ratios = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
counts = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(ids=counts, samples=counts, r=st.one_of(st.none(), ratios), messages=st.integers(1, 64))
def test_narrow_ids_never_send_more_bytes(ids: float, samples: float, r, messages: int) -> None:  # type: ignore[no-untyped-def]
    f = W.FeatureWire(feature="f", ids=ids, samples=samples, unique_ratio=r, messages=messages)
    assert W.feature_input_bytes(f, "int32") <= W.feature_input_bytes(f, "int64")
    assert W.ids_bytes(ids, "int32") * 2 == pytest.approx(W.ids_bytes(ids, "int64"))
    if r is not None:
        assert W.feature_input_bytes(f, "int32", True) <= W.feature_input_bytes(f, "int64", True)


@settings(max_examples=300, deadline=None)
@given(ids=st.floats(min_value=1.0, max_value=1e7), r=ratios, dtype=st.sampled_from(W.ID_DTYPES),
       width=st.sampled_from([1, 2, 4]), dedup_id_s=st.floats(min_value=0.0, max_value=1e-8),
       bandwidth=st.floats(min_value=1e6, max_value=1e11))
def test_dedup_pays_exactly_below_its_threshold(ids: float, r: float, dtype: str, width: int,  # type: ignore[no-untyped-def]
                                               dedup_id_s: float, bandwidth: float) -> None:
    """At a fixed inverse width the saving is ``ids * (id_bytes (1 - r) - width) / bw - ids *
    dedup_id_s``: positive exactly below :func:`dedup_threshold`'s ratio, and falling with r."""
    t = W.dedup_threshold(dtype, width, dedup_id_s, bandwidth)
    idb = W.ID_BYTES[dtype]
    saving = ids * (idb * (1 - r) - width) / bandwidth - ids * dedup_id_s
    scale = ids * idb / bandwidth
    if r < t - 1e-9:
        assert saving > -1e-9 * scale
    elif r > t + 1e-9:
        assert saving < 1e-9 * scale
    assert 0.0 <= t < 1.0


@settings(max_examples=200, deadline=None)
@given(ids=st.integers(1, 10**6), r=ratios, dtype=st.sampled_from(W.ID_DTYPES), messages=st.integers(1, 16))
def test_dedup_saving_matches_its_threshold_at_the_priced_width(ids: int, r: float, dtype: str,  # type: ignore[no-untyped-def]
                                                               messages: int) -> None:
    bw = 1e9
    f = W.FeatureWire(feature="f", ids=ids, samples=10, unique_ratio=r, messages=messages)
    width = W.inverse_bytes(math.ceil(r * ids / messages))
    t = W.dedup_threshold(dtype, width, 1e-10, bw)
    s = W.dedup_saving_s(f, dtype, 1e-10, bw)
    if r < t - 1e-9:
        assert s > 0
    elif r > t + 1e-9:
        assert s < 0


def test_dedup_never_pays_for_int32_ids_with_an_int32_inverse() -> None:
    assert W.dedup_threshold("int32", 4, 0.0, 1e9) == 0.0
    assert W.dedup_threshold("int64", 4, 0.0, 1e9) == 0.5
    assert W.dedup_threshold("int32", 2, 0.0, 1e9) == 0.5
    assert W.inverse_bytes(256) == 1 and W.inverse_bytes(257) == 2 and W.inverse_bytes(40000) == 4


def test_choice_narrows_when_tables_fit_and_dedups_repeating_features_only() -> None:
    feats = [W.FeatureWire(feature="rep", ids=4096, samples=1024, unique_ratio=0.1),
             W.FeatureWire(feature="uniq", ids=4096, samples=1024, unique_ratio=0.95),
             W.FeatureWire(feature="unseen", ids=4096, samples=1024)]
    c = W.choose_wire_ids(feats, {"t": 10**6}, dedup_id_s=1e-9, bandwidth=1.25e8)
    assert c.id_dtype == "int32" and c.dedup_features == ("rep",) and c.bytes_after < c.bytes_before
    c = W.choose_wire_ids(feats, {"t": 10**6, "big": 2**32}, dedup_id_s=1e-9, bandwidth=1.25e8)
    assert c.id_dtype == "int64" and "big" in c.refused and c.dedup_features == ("rep",)
    c = W.choose_wire_ids(feats, {"t": 10**6}, dedup_id_s=1e-3, bandwidth=1.25e8)
    assert c.dedup_features == ()  # a kernel this slow never pays


def test_optimizations_carry_ids_on_the_wire_through_json() -> None:
    from test_execution_plan import _constructed_plan, _execution_plan

    from torchrec_sparselift.plan.execution_plan import ExecutionPlan, Optimizations

    plan = _execution_plan(_constructed_plan(), id_dtype="int32", dedup_features=["f_rw", "f_cw"])
    assert plan.optimizations.dedup_features == ("f_cw", "f_rw")
    back = ExecutionPlan.from_json(plan.to_json())
    assert back == plan and back.optimizations.id_dtype == "int32"
    assert "ids int32, dedup 2 features" in back.summary()
    assert Optimizations().id_dtype == "int64" and Optimizations().dedup_features == ()
    with pytest.raises(ValueError, match="id_dtype.*'int64', 'int32'"):
        Optimizations(id_dtype="int16")
    with pytest.raises(ValueError, match=r"write \['f0'\]"):
        Optimizations(dedup_features="f0")
    with pytest.raises(ValueError, match="twice"):
        Optimizations(dedup_features=["f0", "f0"])
    with pytest.raises(ValueError, match="1D plans only"):
        Optimizations(id_dtype="int32", sharding_group_size=2)


def test_runtime_reads_the_plans_ids_on_the_wire_and_keywords_override() -> None:
    from types import SimpleNamespace

    from torchrec.distributed.types import ShardingPlan

    from torchrec_sparselift.plan.execution_plan import Optimizations
    from torchrec_sparselift.runtime.model_parallel import resolve_settings

    plan = SimpleNamespace(sharding_plan=ShardingPlan({}),
                           optimizations=Optimizations(id_dtype="int32", dedup_features=("f1",)))
    _, s = resolve_settings(plan)
    assert (s.id_dtype, s.dedup_features) == ("int32", ("f1",))
    assert s.label().endswith("ids int32, dedup f1")
    _, s = resolve_settings(plan, id_dtype="int64", dedup_features=[])
    assert (s.id_dtype, s.dedup_features) == ("int64", ())
    _, s = resolve_settings(ShardingPlan({}))
    assert (s.id_dtype, s.dedup_features) == ("int64", ())


def test_wire_features_follow_the_sharding() -> None:
    from types import SimpleNamespace

    from torchrec_sparselift.semantics.workload import FeatureStats, WorkloadStats

    def table(name, feats, pf=2.0, r=None):  # type: ignore[no-untyped-def]
        return SimpleNamespace(name=name, feature_names=feats, pooling_factor=pf, batch_size=None, unique_ratio=r,
                               num_embeddings=1000)

    tables = [table("tw", ["a"]), table("cw", ["b"]), table("rw", ["c"]), table("dp", ["d"]),
              table("declared", ["e", "g"], pf=6.0, r=0.5)]
    stats = WorkloadStats([FeatureStats(feature=f, pooling_factor=2.0, unique_ratio=0.25) for f in "abcd"])
    sharding = {"tw": ("table_wise", 1), "cw": ("column_wise", 2), "rw": ("row_wise", 4),
                "dp": ("data_parallel", 4), "declared": ("table_wise", 1)}
    feats = W.wire_features(tables, stats, sharding, batch_size=100, world_size=4, local_world_size=2)
    by = {f.feature: f for f in feats}
    assert set(by) == {"a", "b", "c", "e", "g"}  # data-parallel sends nothing
    assert (by["a"].ids, by["a"].messages, by["a"].unique_ratio) == (200, 1, 0.25)
    assert (by["b"].ids, by["b"].messages) == (400, 2)  # every column shard gets every id
    assert (by["c"].ids, by["c"].messages) == (200, 4)
    assert (by["e"].ids, by["e"].unique_ratio) == (300, 0.5)  # no stats: the table's share
    with pytest.raises(ValueError, match="'x'"):
        W.wire_features([table("x", ["h"])], None, {}, batch_size=1, world_size=1, local_world_size=1)
    request = SimpleNamespace(tables=tables, stats=stats, batch_size=100,
                              topology=SimpleNamespace(world_size=4, local_world_size=2),
                              hardware=SimpleNamespace(inter_host_bw=1.25e8, intra_host_bw=1e12))
    choice = W.choose_for_request(request, sharding, dedup_id_s=1e-9)
    assert choice.id_dtype == "int32" and set(choice.dedup_features) == {"a", "b", "c", "e", "g"}
    request.topology.local_world_size = 4  # one host: the fast link, where the kernel costs more
    assert W.choose_for_request(request, sharding, dedup_id_s=1e-9).dedup_features == ()


def test_apply_refuses_narrow_ids_for_a_huge_model_parallel_table_and_unknown_dedup_features() -> None:
    from types import SimpleNamespace

    from torch import nn
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from torchrec_sparselift.runtime.wire_ids import apply_wire_ids

    def holder(types):  # type: ignore[no-untyped-def]
        """A model holding a sharded EBC's table view (no weights: the checks read configs and plan)."""
        ebc = ShardedEmbeddingBagCollection.__new__(ShardedEmbeddingBagCollection)
        nn.Module.__init__(ebc)
        ebc._embedding_bag_configs = [
            EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=4, feature_names=[f"{n}_f"])
            for n, rows in (("small", 1000), ("huge", 2**31 + 1))]
        ebc.module_sharding_plan = {n: SimpleNamespace(sharding_type=t) for n, t in types.items()}
        model = nn.Module()
        model.ebc = ebc
        return model

    with pytest.raises(ValueError, match=r"ebc\.huge \(2147483649 rows\)") as err:
        apply_wire_ids(holder({"small": "table_wise", "huge": "row_wise"}), "int32")
    assert "ebc.small" not in str(err.value)
    with pytest.raises(ValueError, match=r"\['nope'\].*huge_f"):
        apply_wire_ids(holder({"small": "table_wise", "huge": "row_wise"}), "int64", ["nope"])
    with pytest.raises(ValueError, match="int64, int32"):
        apply_wire_ids(holder({"small": "table_wise", "huge": "row_wise"}), "int8")
    # a data-parallel table sends no ids: narrow ids do not look at its rows; nothing to rewrite
    assert apply_wire_ids(holder({"small": "data_parallel", "huge": "data_parallel"}), "int32") == []
    # a feature-processed EBC is left alone (its processors read the received KJT)
    from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection

    fp = ShardedFeatureProcessedEmbeddingBagCollection.__new__(ShardedFeatureProcessedEmbeddingBagCollection)
    nn.Module.__init__(fp)
    fp._embedding_bag_collection = holder({"small": "table_wise", "huge": "row_wise"}).ebc
    model = nn.Module()
    model.fp = fp
    assert apply_wire_ids(model, "int32") == []


def _pad8(n: int) -> int:
    return n + (-n % 8)


@pytest.mark.multiprocess
def test_dedup_bytes_counted_equal_the_exchange_and_the_price(runs) -> None:  # type: ignore[no-untyped-def]
    """Table-wise (f0, f2 on rank 0; f1 on rank 1): each rank sends the other its features'
    header (int32: stride, then ids sent and ids per feature) and one payload (distinct ids at
    int32, lengths at int32, the inverse index at its width, each section 8-byte aligned).
    CommCounter's bytes (sent + received) equal that exactly, and
    :func:`feature_input_bytes` prices the same bytes but the header and the padding."""
    to = {0: ["f1"], 1: ["f0", "f2"]}  # what each rank sends: the features the other rank holds
    exact, priced = {}, {}
    for src in (0, 1):
        kjt = _kjt(src, 0, b=BYTES_B)
        per = kjt.to_dict()
        keys = to[src]
        distinct = {f: int(torch.unique(per[f].values()).numel()) for f in keys}
        n = {f: int(per[f].values().numel()) for f in keys}
        width = W.inverse_bytes(max(distinct.values()))
        exact[src] = (4 * (1 + 2 * len(keys)) + _pad8(4 * sum(distinct.values())) + _pad8(4 * len(keys) * BYTES_B)
                      + _pad8(width * sum(n.values())))
        priced[src] = sum(W.feature_input_bytes(
            W.FeatureWire(feature=f, ids=n[f], samples=BYTES_B, unique_ratio=distinct[f] / n[f]), "int32", dedup=True)
            for f in keys)
        # the price's inverse width is the feature's own; the message's is its widest feature's
        assert all(W.inverse_bytes(distinct[f]) <= width for f in keys)
    for rank, out in enumerate(runs):
        counted = out[("table_wise", "dedup_int32_unique", "bytes")]["bytes"]
        assert counted == exact[0] + exact[1], rank
        overhead = sum(4 * (1 + 2 * len(to[s])) + 3 * 7 for s in (0, 1))  # headers, padding at most
        assert 0 <= counted - (priced[0] + priced[1]) <= overhead
