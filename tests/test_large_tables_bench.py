"""The large-table benchmark's pure parts: each workload's prediction relative to the calibration's
probe in the same round, and the ids it draws for its kernel sweep."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import large_tables as bench
from torchrec_sparselift.measure import probe


def test_relative_ratios_pair_rounds_with_the_reference():
    pred = {"probe_large": 20.0, "few_large": 30.0}
    meas = {"probe_large": [20.0, 40.0], "few_large": [30.0, 75.0]}
    rel = bench.relative_ratios(pred, meas)
    # round 0: both priced exactly; round 1: the machine halves both, few_large measures 25% slower on top
    assert rel == {"few_large": [pytest.approx(1.0), pytest.approx(0.8)]}


@settings(max_examples=50, deadline=None)
@given(speed=st.floats(0.2, 5.0), ratio=st.floats(0.5, 2.0), pr=st.floats(1.0, 100.0), pw=st.floats(1.0, 100.0))
def test_a_machine_slowing_every_plan_alike_leaves_the_relative_ratio(speed, ratio, pr, pw):
    meas = {"probe_large": [pr * speed], "xl": [pw * speed * ratio]}
    rel = bench.relative_ratios({"probe_large": pr, "xl": pw}, meas)["xl"][0]
    assert rel == pytest.approx(1.0 / ratio)


def test_relative_ratios_name_what_is_missing():
    with pytest.raises(ValueError, match="probe_large"):
        bench.relative_ratios({"a": 1.0}, {"a": [1.0]})
    with pytest.raises(ValueError, match="rounds must pair"):
        bench.relative_ratios({"probe_large": 1.0, "a": 1.0}, {"probe_large": [1.0], "a": [1.0, 2.0]})


def test_the_power_law_ids_stay_in_the_table_and_repeat_like_the_probes_batches():
    rows = 200_000
    ids = bench.power_law_ids(rows, 4096, seed=3)
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < rows
    # skewed: far fewer distinct rows than uniform ids would touch (~4,055 of 4,096)
    assert int(torch.unique(ids).numel()) < 0.8 * 4096
    assert torch.equal(ids, bench.power_law_ids(rows, 4096, seed=3))


def test_xl_tables_are_larger_than_every_probe_table():
    largest_probe = max(t.rows for w in probe.PROBE_WORKLOADS for t in w.tables)
    assert min(t.rows for t in bench.XL.tables) > largest_probe
