"""The fused backward updates each distinct row once: how the graph counts those rows (from the
ids' observed statistics) and how the cost model and the step fit price them."""

import math

import attrs
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_sparselift.measure import microbench
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.calibration.records import HostTermRecord
from torchrec_sparselift.measure.microbench import bench_tbe_backward
from torchrec_sparselift.cost.model import node_time
from torchrec_sparselift.measure.probe import ProbeTable, ProbeWorkload, prebuilt_batches, probe_stats
from torchrec_sparselift.semantics.graph import Node, candidate_for, shard_nodes
from torchrec_sparselift.semantics.tables import TableSpec, _id_statistics
from torchrec_sparselift.semantics.workload import FeatureStats, WorkloadStats, distinct_ids, observe
from torchrec_sparselift.calibration.step_fit import host_fit_setup
from torchrec_sparselift.calibration.store import base_profile


def _kjt(values_by_key, batch):
    keys = list(values_by_key)
    values = torch.cat([values_by_key[k] for k in keys])
    lengths = torch.cat([torch.full((batch,), values_by_key[k].numel() // batch, dtype=torch.int32) for k in keys])
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def test_observe_measures_how_distinct_ids_grow_over_pooled_batches():
    g = torch.Generator().manual_seed(0)
    batches = [_kjt({"fresh": torch.randint(0, 2**40, (256,), generator=g),
                     "tiny": torch.randint(0, 10, (256,), generator=g)}, 64) for _ in range(8)]
    stats = observe(batches)
    assert stats["fresh"].unique_growth == pytest.approx(1.0, abs=1e-3)  # nothing repeats across batches
    assert stats["tiny"].unique_growth < 0.05  # every batch hits the same 10 rows
    assert observe(batches[:1])["fresh"].unique_growth is None  # one batch cannot say
    again = WorkloadStats.from_dict(stats.to_dict())
    assert again == stats and again.digest() == stats.digest()
    with pytest.raises(ValueError, match="unique_growth"):
        FeatureStats(feature="f", pooling_factor=1.0, unique_growth=1.5)


def test_distinct_ids_uniform_default_matches_sampling_and_heaps_caps():
    g = torch.Generator().manual_seed(1)
    for rows, n in ((1000, 5000), (50_000, 4096), (300, 1000)):
        measured = torch.randint(0, rows, (n,), generator=g).unique().numel()
        assert distinct_ids(n, 1, rows) == pytest.approx(measured, rel=0.03)
    # measured ratio and growth: u n b^g, never more rows than the table has or ids than arrive
    assert distinct_ids(1000, 4, 10**6, unique_ratio=0.5, unique_growth=0.5) == pytest.approx(0.5 * 1000 * 2)
    assert distinct_ids(1000, 4, 700, unique_ratio=0.5, unique_growth=1.0) == 700
    assert distinct_ids(1000, 1, 10**6, unique_ratio=1.0) == 1000
    assert distinct_ids(0, 4, 100) == 0.0


def _spec(**kw):
    d = dict(module_path="", name="t", num_embeddings=20_000, embedding_dim=64, feature_names=("f",),
             pooling_factor=8.0, is_pooled=True, elem_bytes=4,
             sharding_types=("table_wise", "row_wise", "table_row_wise", "column_wise", "data_parallel"),
             compute_kernels=(("table_wise", ("fused",)), ("row_wise", ("fused",)), ("table_row_wise", ("fused",)),
                              ("column_wise", ("fused",)), ("data_parallel", ("dense",))),
             batch_size=512, unique_ratio=0.3, unique_growth=0.6)
    d.update(kw)
    return TableSpec(**d)


def _distinct(spec, st, kernel="fused", W=4, L=2, splits=1):
    cand = candidate_for(0, spec, st, kernel, W, L, column_splits=splits)
    nodes = [n for n in shard_nodes(spec, cand, W, L) if n.kind == "backward_update" and n.unit == "rows"]
    assert len(nodes) == 1
    return nodes[0].distinct_rows, cand.num_shards


def test_graph_counts_the_distinct_rows_each_shard_updates_per_sharding_type():
    spec = _spec()
    W, L = 4, 2
    whole = spec.distinct_rows(W)  # one table-wise shard serves all W ranks' batches
    assert whole == pytest.approx(0.3 * 512 * 8 * W ** 0.6)
    assert _distinct(spec, "table_wise")[0] == pytest.approx(whole)
    d, n = _distinct(spec, "row_wise")
    assert d * n == pytest.approx(whole)  # the row buckets split the rows, not the ids' repeats
    d, n = _distinct(spec, "table_row_wise")
    assert n == L and d * n == pytest.approx(whole)
    d, n = _distinct(spec, "column_wise", splits=2)
    assert n == 2 and d == pytest.approx(whole)  # every column shard updates every distinct row
    assert _distinct(spec, "data_parallel", kernel="dense")[0] == 0.0  # not a fused TBE
    # a hotter table updates fewer rows for the same ids; none more than its rows or its ids
    assert _distinct(_spec(unique_ratio=0.05), "table_wise")[0] < whole
    uniform = _spec(unique_ratio=None, unique_growth=None, num_embeddings=1000)
    assert _distinct(uniform, "table_wise")[0] <= 1000


def test_node_time_adds_the_per_distinct_row_cost_to_the_backward():
    p = attrs.evolve(HardwareProfile(name="t", compute_device="cpu"), bwd_row_s=0.6e-6)
    a = Node("backward_update", "hbm", 10_000, unit="rows", width_bytes=256, backward=True, distinct_rows=1000)
    b = attrs.evolve(a, distinct_rows=6000)
    assert node_time(b, p) - node_time(a, p) == pytest.approx(5000 * 0.6e-6)
    fwd = Node("lookup", "hbm", 10_000, unit="rows", width_bytes=256, distinct_rows=6000)
    assert node_time(fwd, attrs.evolve(p, bwd_row_s=1.0)) == node_time(fwd, p)  # forward: per id only


def test_table_statistics_weight_features_and_count_shared_features_as_pooled_batches():
    stats = WorkloadStats((FeatureStats(feature="a", pooling_factor=2.0, unique_ratio=0.5, unique_growth=0.5),
                           FeatureStats(feature="b", pooling_factor=6.0, unique_ratio=0.25, unique_growth=0.5),
                           FeatureStats(feature="c", pooling_factor=1.0)))
    one = _id_statistics(("a",), stats)
    assert one == {"unique_ratio": 0.5, "unique_growth": 0.5}
    two = _id_statistics(("a", "b"), stats)
    # distinct 1 + 1.5 of 8 ids, the union of 2 features as 2 pooled batches at growth 0.5
    assert two["unique_growth"] == pytest.approx(0.5)
    assert two["unique_ratio"] == pytest.approx(2.5 * 2 ** -0.5 / 8)
    assert _id_statistics(("a", "c"), stats) == {"unique_ratio": None, "unique_growth": None}  # c not observed
    assert _id_statistics(("a",), None) == {"unique_ratio": None, "unique_growth": None}


@pytest.mark.parametrize("alpha", [1.05, 1.3])
def test_graph_distinct_rows_match_the_ids_a_table_wise_shard_really_receives(alpha):
    """The statistics one rank observes predict the rows a table-wise shard's backward updates from
    the batches of W ranks: within 15% (power-law ids, one table of one feature, one shared by two)."""
    w = ProbeWorkload("d", (ProbeTable("big", 50_000, 16, ("big_f",), 8.0), ProbeTable("small", 2_000, 16, ("small_f",), 2.0),
                            ProbeTable("shared", 20_000, 16, ("s1", "s2"), 4.0)), batch_size=256)
    stats = probe_stats(w, alpha, n=8, seed=3)
    for W in (2, 4):
        received = {t.name: [] for t in w.tables}
        for rank in range(W):
            kjt = prebuilt_batches(w, 1, seed=11, rank=rank, alpha=alpha)[0].sparse_features
            for t in w.tables:
                received[t.name] += [kjt[f].values() for f in t.features]
        for t in w.tables:
            spec = _spec(num_embeddings=t.rows, feature_names=t.features, batch_size=w.batch_size,
                         pooling_factor=t.pooling_factor * len(t.features), **_id_statistics(t.features, stats))
            true = torch.cat(received[t.name]).unique().numel()
            assert spec.distinct_rows(W) == pytest.approx(true, rel=0.15), (t.name, W)


def test_bench_tbe_backward_recovers_known_per_row_and_per_id_costs(monkeypatch):
    def fake(rows, ids, device, trials, dim=64, passes=1):
        d = int(round(rows * -math.expm1(-ids / rows)))
        return 0.3e-3 + 0.6e-6 * d + 5e-9 * ids, d

    monkeypatch.setattr(microbench, "_tbe_backward_s", fake)
    per_row, per_id = bench_tbe_backward()
    assert per_row == pytest.approx(0.6e-6, rel=1e-3)
    assert per_id == pytest.approx(5e-9, rel=1e-2)


def test_host_fit_setup_floors_the_backward_row_cost_at_fbgemms():
    host = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9, tbe_row_s=0.6e-6)
    _b, terms, floors = host_fit_setup(base_profile("cpu"), host.to_dict())
    assert floors["bwd_row_s"] == 0.6e-6 and "bwd_row_s" in {t.name for t in terms}
    old = {k: v for k, v in host.to_dict().items() if not k.startswith("tbe_")}  # stored before it existed
    assert "bwd_row_s" not in host_fit_setup(base_profile("cpu"), old)[2]


def test_row_wise_pooled_outputs_are_reduce_scatters_priced_at_their_own_factor():
    from torchrec_sparselift.cost.model import OUT_INTER, OUT_INTRA, CostContext, shard_cost

    W, L = 4, 2
    links = lambda spec, st: [n for n in shard_nodes(spec, candidate_for(0, spec, st, "fused", W, L), W, L)
                              if n.kind in ("output_dist", "grad_dist")]
    pooled, seq = _spec(), _spec(is_pooled=False)
    assert {(n.kind, n.collective) for n in links(pooled, "row_wise")} == {("output_dist", "reduce_scatter"),
                                                                          ("grad_dist", "all_gather")}
    assert {n.collective for n in links(seq, "row_wise")} == {"all_to_all"}  # sequence outputs: all-to-all
    assert {n.collective for n in links(pooled, "table_wise")} == {"all_to_all"}
    twrw = {(n.kind, n.resource, n.collective) for n in links(pooled, "table_row_wise")}
    assert ("output_dist", "intra_host", "reduce_scatter") in twrw and ("output_dist", "inter_host", "all_to_all") in twrw

    def out_bytes(spec, st, factor):
        p = attrs.evolve(HardwareProfile(name="t", compute_device="cpu", local_world_size=L), reduce_scatter_factor=factor)
        ctx = CostContext(profile=p, world_size=W, local_world_size=L, batch_size=spec.batch_size)
        c = shard_cost(spec, candidate_for(0, spec, st, "fused", W, L), ctx)
        return c.owner[[OUT_INTRA, OUT_INTER]].sum() + c.peers[[OUT_INTRA, OUT_INTER]].sum()

    assert out_bytes(pooled, "row_wise", 3.0) == pytest.approx(3.0 * out_bytes(pooled, "row_wise", 1.0))
    assert out_bytes(pooled, "table_wise", 3.0) == out_bytes(pooled, "table_wise", 1.0)
    assert out_bytes(seq, "row_wise", 3.0) == out_bytes(seq, "row_wise", 1.0)


def test_fit_measurements_can_leave_terms_out(monkeypatch):
    from torchrec_sparselift.calibration import step_fit as sf

    seen = {}

    def fake_fit_step_profile(cases, base, terms, **kw):
        seen.update(base=base, terms=[t.name for t in terms], floors=kw.get("floors"))
        raise RuntimeError("stop")

    monkeypatch.setattr(sf, "fit_step_profile", fake_fit_step_profile)
    host = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9, tbe_row_s=0.6e-6)
    base = attrs.evolve(base_profile("cpu"), bwd_row_s=1e-6, reduce_scatter_factor=2.0)
    with pytest.raises(RuntimeError, match="stop"):
        sf.fit_probe_plans([], [], base, host=host, exclude=("bwd_row_s", "reduce_scatter_factor"))
    assert "bwd_row_s" not in seen["terms"] and "reduce_scatter_factor" not in seen["terms"]
    assert seen["base"].bwd_row_s == 0.0 and seen["base"].reduce_scatter_factor == 1.0  # the model without them
    assert "bwd_row_s" not in seen["floors"] and "1/a2a_bw" in seen["terms"]
    with pytest.raises(ValueError, match="not step-fit terms"):
        sf.fit_probe_plans([], [], base, host=host, exclude=("no_such_term",))


def test_table_statistics_move_a_ratio_observed_at_another_batch_size_along_its_growth():
    fs = FeatureStats(feature="a", pooling_factor=4.0, batch_size=128, unique_ratio=0.5, unique_growth=0.5)
    stats = WorkloadStats((fs,))
    assert _id_statistics(("a",), stats, 128)["unique_ratio"] == pytest.approx(0.5)
    # 4x the samples per batch: 4^0.5 = 2x the distinct ids for 4x the ids
    assert _id_statistics(("a",), stats, 512)["unique_ratio"] == pytest.approx(0.25)
    assert _id_statistics(("a",), stats, 32)["unique_ratio"] == pytest.approx(1.0)  # capped: at most every id
    # what the table-wise shard updates then equals Heaps' law from the observed batch
    spec = _spec(batch_size=512, pooling_factor=4.0, **_id_statistics(("a",), stats, 512))
    assert spec.distinct_rows(2) == pytest.approx(0.5 * 128 * 4 * (512 * 2 / 128) ** 0.5)
