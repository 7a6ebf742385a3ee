"""The host-work terms real steps revealed are priced where the graph puts them."""

import attrs
import numpy as np
import pytest

from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import BWD, FWD, K, CostContext, shard_cost, step_time
from torchrec_sparselift.semantics.graph import candidate_for, shard_nodes
from torchrec_sparselift.semantics.tables import TableSpec

TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")


def _spec(nf=3, pf=2.0):
    return TableSpec(module_path="m", name="t", num_embeddings=1000, embedding_dim=64,
                     feature_names=tuple(f"f{i}" for i in range(nf)), pooling_factor=pf, is_pooled=True,
                     elem_bytes=4, sharding_types=TYPES,
                     compute_kernels=tuple((t, ("dense",) if t == "data_parallel" else ("fused",)) for t in TYPES),
                     batch_size=256)


BASE = attrs.evolve(PRESETS["cpu-gloo"], feature_overhead_s=0.0, table_overhead_s=0.0)
TERMS = dict(feature_overhead_s=1e-4, table_overhead_s=2e-4, dp_table_overhead_s=3e-3, bucketize_id_s=1e-7)


def _delta(st, W=2):
    spec = _spec()
    kernel = "dense" if st == "data_parallel" else "fused"
    cand = candidate_for(0, spec, st, kernel, W, W, 2 if st == "column_wise" else 1)
    a = shard_cost(spec, cand, CostContext(profile=BASE, world_size=W, local_world_size=W, batch_size=256))
    b = shard_cost(spec, cand, CostContext(profile=attrs.evolve(BASE, **TERMS), world_size=W, local_world_size=W,
                                           batch_size=256))
    return b.owner - a.owner, b.peers - a.peers, cand


def test_table_wise_pays_features_on_every_rank_and_a_table_on_its_owner():
    own, peers, _ = _delta("table_wise")
    assert own[FWD] == pytest.approx(2e-4)
    assert peers[FWD] == pytest.approx(3 * 1e-4)  # 3 features, every rank
    assert own[BWD] == peers[BWD] == 0


def test_row_wise_pays_bucketize_per_own_id_split_over_shards():
    own, peers, cand = _delta("row_wise")
    assert cand.num_shards == 2
    # per shard: features/W and B*pf/W ids on every rank (x W shards = each rank's own)
    assert peers[FWD] == pytest.approx(3 / 2 * 1e-4 + 256 * 2.0 / 2 * 1e-7)
    assert own[FWD] == pytest.approx(2e-4)


def test_data_parallel_pays_a_replica_cost_in_the_backward_and_its_dense_update_rate():
    own, peers, _ = _delta("data_parallel")
    assert own[BWD] == pytest.approx(3e-3)
    # and its TBE's per-table work and its 3 features' KJT work, as a sharded table's (a replica's
    # owner vector lands on every rank)
    assert own[FWD] == pytest.approx(2e-4 + 3 * 1e-4) and not peers.any()
    spec = _spec()
    cand = candidate_for(0, spec, "data_parallel", "dense", 2, 2)
    upd = [n for n in shard_nodes(spec, cand, 2, 2) if n.kind == "backward_update" and n.unit == "bytes"]
    assert upd and upd[0].resource == "dense_update"
    slow = attrs.evolve(BASE, dense_update_bw=1e6)
    c1 = shard_cost(spec, cand, CostContext(profile=BASE, world_size=2, local_world_size=2, batch_size=256))
    c2 = shard_cost(spec, cand, CostContext(profile=slow, world_size=2, local_world_size=2, batch_size=256))
    assert c2.owner[BWD] - c1.owner[BWD] == pytest.approx(upd[0].quantity * (1 / 1e6 - 1 / BASE.hbm_bw))


@pytest.mark.parametrize("pipeline", ["base", "sparse_dist", "fused", "prefetch"])
def test_step_overhead_is_on_every_pipelines_critical_path(pipeline):
    colmax = np.zeros(K)
    colmax[FWD] = 1e-3
    for overlap in (True, False):
        p = attrs.evolve(PRESETS["h100"], supports_overlap=overlap)
        ctx = CostContext(profile=p, world_size=2, local_world_size=2, batch_size=256)
        ctx2 = CostContext(profile=attrs.evolve(p, step_overhead_s=5e-3), world_size=2, local_world_size=2,
                           batch_size=256)
        t1 = step_time(colmax, 0.0, 1, ctx, pipeline).total_s
        t2 = step_time(colmax, 0.0, 1, ctx2, pipeline).total_s
        assert t2 - t1 == pytest.approx(5e-3)


def test_without_overlap_the_gradient_all_reduce_is_not_hidden_under_the_dense_backward():
    from torchrec_sparselift.cost.model import DenseWork
    from torchrec_sparselift.cost.pipelines import COMPUTE_PHASES, LINK_PHASES

    colmax = np.zeros(K)
    dense = DenseWork(param_bytes=0.0, fwd_flops_per_sample=1e6)  # a dense backward that could hide it
    for overlap in (True, False):
        p = attrs.evolve(PRESETS["cpu-gloo"], supports_overlap=overlap)
        ctx = CostContext(profile=p, world_size=2, local_world_size=2, batch_size=256, dense=dense)
        st = step_time(colmax, 1e5, 1, ctx, "base")
        ar = st.phases["allreduce"]
        assert 0 < ar < st.phases["dense_bwd"]
        rest = sum(st.phases[k] for k in COMPUTE_PHASES + LINK_PHASES)  # the split dense phases' wholes
        assert st.total_s == pytest.approx(rest + (0.0 if overlap else ar))
