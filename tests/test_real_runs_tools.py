"""Pure helpers of benchmarks/real_runs.py: one plan, one measurement; paired ratios; the report's
argument checks."""

import pytest

from benchmarks import real_runs
from benchmarks.harness import paired_ratio


def _plan(order, rank_of_b=1, kernel="fused"):
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    ps = {"a": ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[0]),
          "b": ParameterSharding(sharding_type="table_wise", compute_kernel=kernel, ranks=[rank_of_b])}
    return ShardingPlan(plan={"ebc": EmbeddingModuleShardingPlan({k: ps[k] for k in order})})


def test_distinct_plans_groups_plans_that_shard_every_table_the_same_way():
    plans = [_plan("ab"), _plan("ab", rank_of_b=0), _plan("ba"), _plan("ab", kernel="dense"), _plan("ba", 0)]
    # the same plan listed in another order is the first plan; a moved table or another kernel is not
    assert real_runs.distinct_plans(plans) == [0, 1, 0, 3, 1]


def test_paired_ratio_is_the_median_of_same_round_ratios():
    assert paired_ratio([2.0, 4.0, 3.0], [1.0, 4.0, 2.0]) == pytest.approx(1.5)
    same = [1.0, 2.0, 3.0]
    assert paired_ratio(same, same) == 1.0  # a plan against itself
    with pytest.raises(ValueError, match="rounds where both plans ran"):
        paired_ratio([], [])


@pytest.mark.parametrize("argv, message", [
    (["--host-terms", "dense_flop_s=7e-12"], "need --refit"),
    (["--refit", "--host-terms", "dense_flop_s=fast"], "is not NAME=SECONDS"),
    (["--refit", "--host-terms", "dense_flop_s=-1"], "is not NAME=SECONDS"),
])
def test_report_rejects_host_terms_it_cannot_use(argv, message, capsys):
    with pytest.raises(SystemExit):
        real_runs.main(["report", "--measured", "missing.json"] + argv)
    assert message in capsys.readouterr().err
