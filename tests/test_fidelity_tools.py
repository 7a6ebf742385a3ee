"""Pure helpers of benchmarks/fidelity.py: plan kinds, constraints, imbalance, MAPE, Spearman."""

import math

import pytest

from benchmarks import fidelity as F
from torchrec_sparselift.semantics.table_file import TableEntry


def _T(name, rows, pooling_factor=1):
    return TableEntry(name=name, rows=rows, dim=8, features=(name,), pooling_factor=(float(pooling_factor),))


TABLES = [_T("big", 40_000, 3), _T("mid", 3_000, 8), _T("tiny", 10, 1)]


def test_mape_is_mean_relative_error():
    assert F.mape([110.0, 90.0], [100.0, 100.0]) == pytest.approx(0.10)
    assert F.mape([50.0], [100.0]) == pytest.approx(0.5)


def test_mape_rejects_mismatched_or_nonpositive_measurements():
    with pytest.raises(ValueError):
        F.mape([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        F.mape([1.0], [0.0])


def test_spearman_is_one_for_same_order_and_minus_one_for_reversed():
    assert F.spearman([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert F.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_spearman_matches_scipy_with_ties():
    from scipy import stats as scipy_stats  # a dependency of the package: never skipped
    a, b = [1.0, 2.0, 2.0, 5.0, 3.0, 0.5], [3.0, 1.0, 4.0, 4.0, 9.0, 2.0]
    assert F.spearman(a, b) == pytest.approx(scipy_stats.spearmanr(a, b).statistic)


def test_spearman_of_a_constant_sequence_is_nan():
    assert math.isnan(F.spearman([1, 1, 1], [1, 2, 3]))


def test_fidelity_summary_reports_signed_bias():
    s = F.fidelity_summary([100.0, 200.0], [50.0, 100.0])
    assert s["bias"] == pytest.approx(-0.5) and s["mape"] == pytest.approx(0.5) and s["spearman"] == pytest.approx(1.0)


def test_size_classes_split_at_the_thresholds():
    assert F.size_class(F.LARGE_ROWS) == "large"
    assert F.size_class(F.SMALL_ROWS) == "small"
    assert F.size_class(F.SMALL_ROWS + 1) == "medium"


def test_mixed_plan_forces_row_column_and_table_wise_by_size():
    assert F.sharding_types_for("mixed", TABLES) == {"big": "row_wise", "mid": "column_wise", "tiny": "table_wise"}
    assert F.sharding_types_for("auto", TABLES) == {"big": None, "mid": None, "tiny": None}
    with pytest.raises(ValueError, match="unknown plan kind"):
        F.sharding_types_for("diagonal", TABLES)


def test_default_kinds_cover_the_six_required_plans():
    assert set(F.DEFAULT_KINDS) >= {"table_wise", "row_wise", "column_wise", "mixed", "imbalanced", "dp_small"}
    assert all(k in F.PLAN_KINDS for k in F.DEFAULT_KINDS)


def test_constraints_carry_pooling_factor_kernel_and_column_partition():
    cons = F.table_constraints(TABLES, F.sharding_types_for("dp_small", TABLES) | {"mid": "column_wise"}, 64)
    assert cons["big"].pooling_factors == [3.0] and cons["big"].sharding_types == ["table_wise"]
    assert cons["big"].compute_kernels == ["fused"]
    assert cons["tiny"].sharding_types == ["data_parallel"] and cons["tiny"].compute_kernels == ["dense"]
    assert cons["mid"].min_partition == 64
    free = F.table_constraints(TABLES, {}, 64)
    assert free["mid"].sharding_types is None and free["mid"].pooling_factors == [8.0]


def test_imbalance_puts_all_but_the_smallest_table_on_rank_zero():
    assert F.imbalance_ranks(["a", "b", "c"], [500, 7, 90]) == {"a": 0, "b": 1, "c": 0}
    assert F.imbalance_ranks([], []) == {}


def test_measured_per_plan_takes_the_median_over_repetitions():
    recs = [dict(name="x", step_ms=v) for v in (5.0, 1.0, 3.0)] + [dict(name="y", step_ms=v) for v in (2.0, 4.0)]
    assert F.measured_per_plan(recs) == {"x": 3.0, "y": 3.0}


def test_fit_fields_recovers_the_values_that_explain_linear_measurements():
    # predicted = 10 + 100 * a + 50 * b around x0 = (0.1, 0.1); the truth is a = 0.02, b = 0.2
    x0 = {"a": 0.1, "b": 0.1}
    slopes = [{"a": 100.0, "b": 50.0}, {"a": 300.0, "b": 10.0}, {"a": 20.0, "b": 80.0}]
    points = []
    for sl in slopes:
        base = 10 + sl["a"] * x0["a"] + sl["b"] * x0["b"]
        truth = 10 + sl["a"] * 0.02 + sl["b"] * 0.2
        points.append((base, sl, truth))
    fitted = F.fit_fields(points, x0)
    assert fitted["a"] == pytest.approx(0.02, rel=1e-6) and fitted["b"] == pytest.approx(0.2, rel=1e-6)


def test_fit_fields_never_returns_a_negative_value():
    x0 = {"a": 1.0}
    fitted = F.fit_fields([(10.0, {"a": 5.0}, 1.0), (20.0, {"a": 5.0}, 2.0)], x0)
    assert fitted["a"] >= 0.0


def test_fit_fields_keeps_a_field_that_no_training_plan_depends_on():
    x0 = {"a": 0.1, "b": 0.5}
    points = [(10.0, {"a": 100.0, "b": 0.0}, 12.0), (20.0, {"a": 50.0, "b": 0.0}, 21.0)]
    assert F.fit_fields(points, x0)["b"] == 0.5


def test_measured_per_plan_min_is_the_fastest_repetition():
    recs = [dict(name="x", step_ms=v) for v in (5.0, 1.5, 3.0)]
    assert F.measured_per_plan(recs, stat="min") == {"x": 1.5}
    with pytest.raises(ValueError):
        F.measured_per_plan(recs, stat="mean")
