"""benchmarks.rewrite_pairs: its variants and the run it replays (the timing itself is a benchmark)."""

from __future__ import annotations

import pytest

from benchmarks.rewrite_pairs import parse_rows, parse_variants, replay_of, same_plan_first, variant_spec

RESULT = {"regimes": {"R3": {"workloads": [
    {"workload": "many_small", "rows": {
        "sparselift": {"replay": {"plan": {"modules": {}}, "pipeline": "fused", "fwd": "fp32", "bwd": "fp32",
                                  "batch_split": 1, "id_dtype": "int32", "dedup_features": []}},
        "sparselift_2d": {"replay": None}}}]}}}


def test_variants_are_chunk_counts_with_or_without_dedup():
    assert parse_variants("1,4,4d, 16") == [(1, False), (4, False), (4, True), (16, False)]
    for bad, what in (("0", "'0' is not K or Kd"), ("17", "'17'"), ("4x", "'4x'"), ("d", "'d'"), ("", "''"),
                      ("2,2", "'2' is given twice")):
        with pytest.raises(ValueError, match=what):
            parse_variants(bad)


def test_the_replayed_run_is_found_or_the_error_names_what_there_is():
    assert replay_of(RESULT, "R3", "many_small", "sparselift")["pipeline"] == "fused"
    with pytest.raises(ValueError, match=r"--regime R2: the result holds \['R3'\]"):
        replay_of(RESULT, "R2", "many_small", "sparselift")
    with pytest.raises(ValueError, match=r"--workload kaggle: R3 of the result holds \['many_small'\]"):
        replay_of(RESULT, "R3", "kaggle", "sparselift")
    with pytest.raises(ValueError, match=r"--row torchrec: R3 many_small has the runs"):
        replay_of(RESULT, "R3", "many_small", "torchrec")
    with pytest.raises(ValueError, match="stored no replay"):
        replay_of(RESULT, "R3", "many_small", "sparselift_2d")


def test_a_split_variant_runs_the_overlap_pipeline_and_dedup_the_model_parallel_features():
    replay = replay_of(RESULT, "R3", "many_small", "sparselift")
    one = variant_spec(replay, "PLAN", 1, False, ["f0", "f1"])
    assert (one["pipeline"], one["batch_split"], one["dedup_features"], one["id_dtype"]) == ("fused", None, None,
                                                                                          "int32")
    split = variant_spec(replay, "PLAN", 8, True, ["f0", "f1"])
    assert (split["pipeline"], split["batch_split"], split["dedup_features"]) == ("overlap", 8, ["f0", "f1"])
    assert split["plan"] == "PLAN" and split["fwd"] == "fp32"


def test_several_rows_are_named_once_each():
    assert parse_rows("torchrec, sparselift") == ["torchrec", "sparselift"]
    assert parse_rows("sparselift") == ["sparselift"]
    for bad, what in (("torchrec,,sparselift", "an empty row name"), ("a,b,a", "'a' is given twice"), ("", "empty")):
        with pytest.raises(ValueError, match=what):
            parse_rows(bad)


def test_a_variants_loss_is_compared_with_the_first_variant_of_the_same_plan():
    plans = {"torchrec": "P", "sparselift": "P", "table_wise": "Q"}
    items = [("torchrec", 1, False), ("table_wise", 1, False), ("sparselift", 1, False), ("table_wise", 8, False)]
    first = [same_plan_first(items, lambda x: plans[x[0]], it) for it in items]
    assert first == [items[0], items[1], items[0], items[1]]
