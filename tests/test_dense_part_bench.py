"""benchmarks/dense_part.py: the dense part's price against its forward + backward timed alone."""

from __future__ import annotations

import json
import warnings

import attrs
import pytest

from benchmarks import dense_part
from torchrec_sparselift.calibration.store import base_profile


def test_the_price_reads_the_profiles_interaction_rate():
    base = attrs.evolve(base_profile("cpu"), interaction_flops=2e10)
    slower = attrs.evolve(base, interaction_flops=5e9)
    assert dense_part.priced_dense_s("kaggle", slower) > dense_part.priced_dense_s("kaggle", base) > 0


def test_a_one_round_run_times_and_prices_each_workload(tmp_path):
    out = tmp_path / "dense.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert dense_part.main(["--workloads", "few_large,hot_skewed", "--rounds", "1", "--repeats", "1",
                                "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["workloads"]) == {"few_large", "hot_skewed"}
    for row in data["workloads"].values():
        assert row["timed_ms"] > 0 and row["priced_ms"] > 0
        assert row["ratio"] == pytest.approx(row["priced_ms"] / row["timed_ms"])


def test_an_unknown_workload_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        dense_part.main(["--workloads", "nope"])
    err = capsys.readouterr().err
    assert "nope" in err and "kaggle" in err
