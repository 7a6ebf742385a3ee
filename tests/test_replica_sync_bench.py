"""Pure parts of benchmarks/replica_sync.py: its command line and its verdict. No real runs."""

import pytest

from benchmarks import replica_sync


def test_defaults_and_bad_counts():
    a = replica_sync.parse_args([])
    assert a.workloads == ["kaggle", "hot_skewed", "few_large", "shared"] and (a.steps, a.warmup, a.syncs) == (12, 3, 5)
    with pytest.raises(SystemExit):
        replica_sync.parse_args(["--syncs", "0"])


def _res(one_ms, one_pred, two_ms, two_pred):
    return dict(workload="w", **{"1d": dict(step_ms=one_ms, predicted_ms=one_pred),
                                 "2d": dict(step_ms=two_ms, predicted_ms=two_pred, period=4, median_ms=two_ms / 2,
                                            sync_measured_ms=[20.0, 25.0, 30.0], sync_predicted_ms=26.0)})


def test_the_verdict_compares_the_2d_step_over_whole_intervals_with_1d():
    text = replica_sync._format(_res(70.0, 70.0, 80.0, 72.0))
    assert "one sync measured 20.0-30.0 ms (median 25.0), predicted 26.0" in text
    assert "2D faster: measured False, predicted False -> right" in text
    assert "-> WRONG" in replica_sync._format(_res(70.0, 70.0, 80.0, 60.0))
