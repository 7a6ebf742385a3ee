"""Workload statistics: what observe() measures, declarations, serialization, digest and drift."""

from __future__ import annotations

import itertools
import math
import pickle
from types import SimpleNamespace

import pytest
import torch
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_sparselift.semantics.workload import (
    FeatureStats,
    WorkloadStats,
    declare,
    from_constraints,
    observe,
)


def _kjt(per_feature, weighted: bool = False) -> KeyedJaggedTensor:
    """per_feature: {feature: [[ids of sample 0], [ids of sample 1], ...]} (same sample count)."""
    keys = list(per_feature)
    lengths = [len(s) for k in keys for s in per_feature[k]]
    values = [i for k in keys for s in per_feature[k] for i in s]
    kwargs = {}
    if weighted:
        kwargs["weights"] = torch.rand(len(values))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32), **kwargs,
    )


def test_observe_measures_pooling_unique_ratio_and_tail_per_feature():
    b1 = _kjt({"a": [[1], [2], [3], [4]], "b": [[1, 1, 2], [], [5, 6, 7, 8], [9]]})
    b2 = _kjt({"a": [[1], [1], [1], [1]], "b": [[1], [1], [1], [1]]})
    stats = observe([b1, b2])
    a, b = stats["a"], stats["b"]
    assert a.batch_size == 4 and a.num_batches == 2
    assert a.pooling_factor == 1.0 and a.pooling_max == 1.0 and a.pooling_p99 == 1.0
    assert a.unique_ratio == pytest.approx((4 / 4 + 1 / 4) / 2)
    # b lengths over both batches: 3,0,4,1,1,1,1,1 -> mean 1.5; sorted [0,1,1,1,1,1,3,4]
    assert b.pooling_factor == pytest.approx(12 / 8)
    assert b.pooling_max == 4.0
    assert b.pooling_p95 == pytest.approx(3 + 0.65 * (4 - 3))  # position 0.95*7 = 6.65
    assert b.pooling_p99 == pytest.approx(3 + 0.93 * (4 - 3))
    assert b.unique_ratio == pytest.approx((7 / 8 + 1 / 4) / 2)
    # id 1 is the hottest of 8 distinct ids (top 1% -> 1 id): 6 of 12 lookups
    assert b.hot_row_skew == pytest.approx(6 / 12)


def test_hot_row_skew_separates_uniform_from_power_law_ids():
    g = torch.Generator().manual_seed(0)
    n, rows = 20_000, 1_000_000
    uniform = torch.randint(0, rows, (n,), generator=g)
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    zipf = torch.multinomial(ranks.pow(-1.2), n, replacement=True, generator=g)
    lengths = torch.ones(n, dtype=torch.int32)
    batch = KeyedJaggedTensor.from_lengths_sync(
        keys=["uniform", "zipf"], values=torch.cat([uniform, zipf]), lengths=torch.cat([lengths, lengths])
    )
    stats = observe([batch])
    assert stats["uniform"].hot_row_skew < 0.03
    assert stats["zipf"].hot_row_skew > 0.5
    assert stats["zipf"].unique_ratio < stats["uniform"].unique_ratio


def test_observe_reads_batches_with_sparse_features_and_weighted_kjts():
    kjt = _kjt({"a": [[1, 2], [3]]}, weighted=True)
    stats = observe([SimpleNamespace(sparse_features=kjt, dense_features=None)])
    assert stats["a"].pooling_factor == 1.5
    with pytest.raises(TypeError, match="sparse_features"):
        observe([torch.zeros(3)])


def test_observe_draws_at_most_max_batches():
    drawn = []

    def batches():
        for i in itertools.count():
            drawn.append(i)
            yield _kjt({"a": [[i]] * 2})

    stats = observe(batches(), max_batches=3)
    assert stats["a"].num_batches == 3
    assert len(drawn) == 3


def test_observe_handles_variable_batch_kjts():
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([2, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [3]], inverse_indices=(["a", "b"], torch.tensor([[0, 1, 1], [0, 1, 2]])),
    )
    stats = observe([kjt])
    assert stats["a"].batch_size == 2 and stats["a"].pooling_factor == 1.5
    assert stats["b"].batch_size == 3 and stats["b"].pooling_factor == 1.0


def test_observe_refuses_empty_input_and_bad_arguments():
    with pytest.raises(ValueError, match="no batches"):
        observe([])
    with pytest.raises(ValueError, match="max_batches"):
        observe([_kjt({"a": [[1]]})], max_batches=0)


def test_declare_and_constraints_give_pooling_factors():
    stats = declare(a=2.5, b=1.0, batch_size=512)
    assert stats.pooling_factor("a") == 2.5
    assert stats.pooling_factor("zzz", default=7.0) == 7.0
    assert stats["b"].batch_size == 512 and stats["b"].unique_ratio is None and not stats["b"].observed
    assert declare({"odd name": 3.0})["odd name"].pooling_factor == 3.0

    from_pc = from_constraints(
        {
            "t1": ParameterConstraints(pooling_factors=[3.0, 1.5], feature_names=["x", "y"]),
            "t2": ParameterConstraints(pooling_factors=[20.0], batch_sizes=[64]),
        },
        feature_names={"t2": ["z"]},
    )
    assert dict((k, v.pooling_factor) for k, v in from_pc.items()) == {"x": 3.0, "y": 1.5, "z": 20.0}
    assert from_pc["z"].batch_size == 64


def test_invalid_declarations_name_the_feature_or_table():
    with pytest.raises(ValueError, match="'bad'"):
        declare(good=1.0, bad=-2.0)
    with pytest.raises(ValueError, match="'nan_feature'"):
        declare(nan_feature=float("nan"))
    with pytest.raises(ValueError, match="table 't1'.*2 pooling_factors for 1 features"):
        from_constraints({"t1": ParameterConstraints(pooling_factors=[1.0, 2.0], feature_names=["x"])})
    with pytest.raises(ValueError, match="table 't9'.*feature_names"):
        from_constraints({"t9": ParameterConstraints(pooling_factors=[2.0])})
    with pytest.raises(ValueError, match="feature 'f'.*unique_ratio"):
        FeatureStats(feature="f", pooling_factor=1.0, unique_ratio=1.5)
    with pytest.raises(ValueError, match="feature 'f'.*p95 <= p99 <= max"):
        FeatureStats(feature="f", pooling_factor=1.0, pooling_p95=5.0, pooling_p99=4.0, pooling_max=6.0)
    with pytest.raises(ValueError, match="feature 'x' appears twice"):
        WorkloadStats([FeatureStats(feature="x", pooling_factor=1.0)] * 2)


def test_stats_round_trip_and_digest_ignores_feature_order():
    stats = observe([_kjt({"a": [[1, 2], [3]], "b": [[4], [4, 4, 5]]})])
    back = WorkloadStats.from_dict(stats.to_dict())
    assert back == stats and back.digest() == stats.digest()
    assert pickle.loads(pickle.dumps(stats)) == stats
    reordered = WorkloadStats([stats["b"], stats["a"]])
    assert reordered == stats and reordered.digest() == stats.digest()
    assert declare(a=1.0).digest() != declare(a=1.0000001).digest()
    with pytest.raises(ValueError, match="schema"):
        WorkloadStats.from_dict({"schema": "other/1", "features": []})


def test_drift_is_the_largest_relative_change_and_infinite_for_other_features():
    base = WorkloadStats([
        FeatureStats(feature="a", pooling_factor=10.0, unique_ratio=0.5),
        FeatureStats(feature="b", pooling_factor=2.0),
    ])
    moved = WorkloadStats([
        FeatureStats(feature="a", pooling_factor=11.0, unique_ratio=0.65),
        FeatureStats(feature="b", pooling_factor=2.0),
    ])
    assert base.drift(base) == 0.0
    assert base.drift(moved) == pytest.approx(0.3)  # unique ratio 0.5 -> 0.65
    assert math.isinf(base.drift(declare(a=10.0)))
    assert math.isinf(declare(a=0.0).drift(declare(a=1.0)))


def test_constraints_that_keep_torchrec_default_pooling_declare_nothing():
    stats = from_constraints(
        {"only_sharding": ParameterConstraints(sharding_types=["table_wise"]),
         "t": ParameterConstraints(pooling_factors=[4.0], feature_names=["x"])}
    )
    assert list(stats) == ["x"]
    with pytest.raises(ValueError, match="no table's ParameterConstraints sets pooling_factors"):
        from_constraints({"only_sharding": ParameterConstraints(sharding_types=["table_wise"])})
