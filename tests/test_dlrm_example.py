"""The DLRM example (examples/dlrm/train.py): end to end under torchrun with 2 gloo ranks, its
synthetic data and table sets, and its one-line errors."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dlrm")
TRAIN = os.path.join(EXAMPLE, "train.py")

from torchrec_sparselift.dlrm.data import (
    PrefetchedBatches,
    criteo_batches,
    hidden_id_weight,
    power_law_ids,
    synthetic_batch,
)
from torchrec_sparselift.dlrm.model import planner_constraints
from torchrec_sparselift.dlrm.options import UsageError
from torchrec_sparselift.dlrm.tables import (
    DCNV2_MULTI_HOT,
    DCNV2_ROWS,
    MIN_SCALED_ROWS,
    TableSetError,
    TableSpec,
    load_constraints_file,
    load_table_file,
    preset_tables,
    scale_tables,
)

TINY = ["--tables", "kaggle", "--scale", "0.0001", "--embedding-dim", "16", "--batch-size", "128"]


def _env():
    # no stored step-fitted profiles: --hardware auto falls back to the committed CPU profile
    no_profiles = os.path.join(tempfile.gettempdir(), "sparselift-test-no-profiles")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHREC_SPARSELIFT_PROFILE_DIR=no_profiles)
    env.pop("RANK", None)
    return env


def _torchrun(args):
    from launcher import run_script

    return run_script(TRAIN, args, 2, torchrun=True, env=_env(), timeout_s=600)


def _python(args, timeout=60):
    return subprocess.run(
        [sys.executable, TRAIN, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env()
    )


def _check_result(path, planner):
    with open(path) as f:
        res = json.load(f)
    assert res["planner"] == planner
    assert res["world_size"] == 2 and res["global_batch_size"] == 256
    assert len(res["losses"]) == res["steps"]
    assert all(math.isfinite(x) for x in res["losses"])
    assert res["steps_per_s"] > 0 and res["step_time_ms"] > 0
    # every step's slowest rank: its steady median is at least the slowest rank's median step
    times = res["step_times_ms"]
    assert len(times) == len(res["losses"]) and all(t > 0 for t in times)
    assert statistics.median(times[res["warmup_steps"]:]) >= res["measured_step_time_ms"] - 1e-3  # rounded to 1 us
    assert {r["table"] for r in res["plan"]} == {f"t_cat_{i}" for i in range(26)}
    assert all(r["sharding_type"] and r["compute_kernel"] for r in res["plan"])
    # the planted signal is learnable: the loss falls within a few dozen steps
    assert res["loss_last"] < res["loss_first"] - 0.05, (res["loss_first"], res["loss_last"])
    return res


def _run_and_check(tmp_path, planner, *extra):
    out = tmp_path / f"{planner}.json"
    args = ["--planner", planner, *TINY, "--steps", "30", "--warmup-steps", "5", "--out", str(out), *extra]
    proc = _torchrun(args)
    assert proc.ok, proc.tail()
    assert "sharding types:" in proc.stdout and "steps/s" in proc.stdout
    return _check_result(out, planner), proc.stdout


def test_example_trains_with_the_runtime_wrapper_and_reuses_its_cached_plan(tmp_path):
    """First run: plans (solver runs), stores the execution plan, trains with the planned
    pipeline through ``lift`` and reports predicted vs measured step time. Second run with the
    same inputs (fewer steps: not part of the plan's fingerprint): loads the stored plan, so the
    solver is not invoked, and gets the identical plan and prediction."""
    cache = tmp_path / "plans"
    res, stdout = _run_and_check(tmp_path, "sparselift", "--plan-cache", str(cache))
    assert "plan: planned in" in stdout and "plan: reused" not in stdout
    assert res["plan_reused"] is False and os.listdir(cache)
    pred = res["prediction"]
    assert pred["step_time_ms"] > 0 and pred["applies"] and pred["solver"] not in (None, "none")
    assert res["pipeline"] == pred["pipeline"] and res["comm_precision"] == pred["comm_precision"]
    assert res["predicted_step_time_ms"] == pytest.approx(pred["step_time_ms"])
    assert res["measured_step_time_ms"] > 0
    assert res["measured_over_predicted"] == pytest.approx(res["measured_step_time_ms"] / pred["step_time_ms"])
    assert "measured/predicted" in stdout
    assert res["hardware"] == "cpu-2core-gloo" and pred["hardware"] == "cpu-2core-gloo"
    assert "no calibrated profile for this machine" in stdout  # auto says it fell back

    out2 = tmp_path / "again.json"
    args = ["--planner", "sparselift", *TINY, "--steps", "3", "--warmup-steps", "1", "--plan-cache", str(cache)]
    proc = _torchrun([*args, "--out", str(out2)])
    assert proc.ok, proc.tail()
    assert "plan: reused cached execution plan" in proc.stdout and "plan: planned in" not in proc.stdout
    again = json.loads(out2.read_text())
    assert again["plan_reused"] is True
    assert again["plan"] == res["plan"] and again["prediction"] == res["prediction"]


@pytest.mark.slow
def test_example_trains_two_ranks_with_torchrec_planner(tmp_path):
    res, stdout = _run_and_check(tmp_path, "torchrec")
    assert res["prediction"] is None and res["plan_reused"] is None and res["pipeline"] == "sparse_dist"
    assert res["measured_step_time_ms"] > 0 and res["measured_over_predicted"] is None


def test_unknown_flag_exits_nonzero_with_one_line_under_torchrun():
    proc = _torchrun(["--planner", "sparselift", "--no-such-flag"])
    assert not proc.ok
    assert "error: unrecognized arguments: --no-such-flag" in proc.stderr
    assert proc.stderr.count("error: unrecognized") == 1  # rank 0 speaks, not every rank


@pytest.mark.parametrize(
    "content, message",
    [
        ("[{\"name\": \"a\", \"rows\": 10}]", "missing dim"),
        ("[{\"name\": \"a\", \"rows\": 0, \"dim\": 8}]", "rows must be a positive integer"),
        ("[{\"name\": \"a\", \"rows\": 10, \"dim\": 8, \"colour\": 1}]", "unknown key(s) ['colour']"),
        ("[{\"name\": \"a\", \"rows\": 10, \"dim\": 8}, {\"name\": \"b\", \"rows\": 10, \"dim\": 16}]", "one embedding dim"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_table_file_exits_with_a_clear_message(tmp_path, dlrm_main, content, message):
    path = tmp_path / "tables.json"
    path.write_text(content)
    code, err = dlrm_main(["--table-file", str(path), "--check"])
    assert code == 2
    assert message in err and "Traceback" not in err


def test_a_bad_input_exits_2_with_one_error_line_from_the_command_line(tmp_path):
    # the other bad-input tests call the example's main in this process; this one runs the command
    path = tmp_path / "tables.json"
    path.write_text("[{\"name\": \"a\", \"rows\": 10}]")
    proc = _python(["--table-file", str(path), "--check"])
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "missing dim" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bad_values_exit_with_a_clear_message(dlrm_main):
    for args, message in [
        (["--scale", "2"], "--scale must be in (0, 1]"),
        (["--steps", "5", "--warmup-steps", "5"], "--warmup-steps must be in [0, --steps)"),
        (["--table-file", "/no/such/file.json"], "does not exist"),
        (["--hardware", "tpu-v9"], "--hardware tpu-v9: unknown hardware profile 'tpu-v9'"),
        (["--hardware", "/no/such/profile.json"], "--hardware /no/such/profile.json"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
        (["--steps", "10", "--warmup-steps", "2", "--fail-at-step", "11"], "--fail-at-step must be in [1, --steps]"),
        (["--planner", "torchrec", "--pipeline", "fused"], "--pipeline applies to --planner sparselift"),
    ]:
        code, err = dlrm_main([*args, "--check"])
        assert code == 2 and message in err, (args, err)


def test_table_file_lists_tables_features_and_pooling(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tables": [
        {"name": "user", "rows": 1000, "dim": 32, "features": ["user_id", "friend_ids"], "pooling_factor": 4},
        {"name": "item", "rows": 50, "dim": 32},
    ]}))  # fmt: skip
    user, item = load_table_file(str(path))
    assert user == TableSpec("user", 1000, 32, ("user_id", "friend_ids"), (4.0, 4.0))
    assert item.features == ("item",) and item.pooling_factor is None and item.bag_sizes() == (1,)


def test_table_file_rejects_a_feature_shared_by_two_tables(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([
        {"name": "a", "rows": 10, "dim": 8, "features": ["f"]},
        {"name": "b", "rows": 10, "dim": 8, "features": ["f"]},
    ]))  # fmt: skip
    with pytest.raises(TableSetError, match="feature 'f' is used by tables 'a' and 'b'"):
        load_table_file(str(path))


def test_dcnv2_preset_has_the_mlperf_shapes():
    tables = preset_tables("dcnv2")
    assert [t.rows for t in tables] == list(DCNV2_ROWS)
    assert [t.bag_sizes() for t in tables] == [(b,) for b in DCNV2_MULTI_HOT]
    assert {t.dim for t in tables} == {128}
    assert [t.features for t in tables] == [(f"cat_{i}",) for i in range(26)]
    assert {t.dim for t in preset_tables("kaggle", embedding_dim=16)} == {16}


def test_scale_shrinks_big_tables_but_keeps_a_minimum_and_small_tables():
    scaled = {t.name: t.rows for t in scale_tables(preset_tables("dcnv2"), 0.001)}
    assert scaled["t_cat_0"] == 40000  # 40M * 0.001
    assert scaled["t_cat_1"] == MIN_SCALED_ROWS  # 39060 * 0.001 = 40 -> raised to the minimum
    assert scaled["t_cat_5"] == 3  # already below the minimum: unchanged
    with pytest.raises(TableSetError, match="--scale"):
        scale_tables(preset_tables("dcnv2"), 0.0)


def test_synthetic_batches_are_reproducible_and_fresh_every_step_and_rank():
    tables = scale_tables(preset_tables("dcnv2"), 0.0001)
    a = synthetic_batch(tables, 32, seed=3, rank=0, step=7)
    b = synthetic_batch(tables, 32, seed=3, rank=0, step=7)
    assert a.sparse_features.values().equal(b.sparse_features.values()) and a.labels.equal(b.labels)
    for other in (synthetic_batch(tables, 32, 3, 0, 8), synthetic_batch(tables, 32, 3, 1, 7)):
        assert not other.sparse_features.values().equal(a.sparse_features.values())
        assert not other.dense_features.equal(a.dense_features)


def test_synthetic_bags_follow_each_tables_pooling_factor():
    tables = scale_tables(preset_tables("dcnv2"), 0.0001)
    kjt = synthetic_batch(tables, 16, seed=0, rank=0, step=0).sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    for t in tables:
        lengths = kjt[t.features[0]].lengths()
        assert lengths.tolist() == [t.bag_sizes()[0]] * 16
        vals = kjt[t.features[0]].values()
        assert int(vals.min()) >= 0 and int(vals.max()) < t.rows


def test_power_law_ids_concentrate_on_a_few_hot_rows():
    ids = power_law_ids(np.random.default_rng(0), rows=100_000, n=50_000, alpha=1.05, salt=1)
    counts = np.sort(np.bincount(ids, minlength=100_000))[::-1]
    assert counts[:100].sum() > 0.3 * len(ids)  # top 0.1% of rows get > 30% of lookups
    assert (counts > 0).sum() > 5_000  # and a long tail is still touched


def test_hidden_id_weights_are_a_fixed_uniform_function_of_the_id():
    ids = np.arange(20_000)
    w = hidden_id_weight(ids, 3, seed=0)
    assert np.array_equal(w, hidden_id_weight(ids, 3, seed=0))
    assert -1.0 <= w.min() and w.max() < 1.0 and abs(w.mean()) < 0.02
    assert not np.array_equal(w, hidden_id_weight(ids, 4, seed=0))


def _write_fake_criteo(directory, days=2, rows=300, seed=0):
    rng = np.random.default_rng(seed)
    for d in range(days):
        np.save(directory / f"day_{d}_dense.npy", rng.random((rows, 13), dtype=np.float32))
        np.save(directory / f"day_{d}_sparse.npy", rng.integers(0, 2**40, (rows, 26), dtype=np.int64))
        np.save(directory / f"day_{d}_labels.npy", rng.integers(0, 2, (rows, 1), dtype=np.int32))


def test_criteo_loader_reads_npy_days_hashes_ids_and_repeats(tmp_path):
    _write_fake_criteo(tmp_path)
    tables = scale_tables(preset_tables("kaggle"), 0.0001)
    batches = list(criteo_batches(str(tmp_path), tables, 64, rank=1, world_size=2, steps=7))
    assert len(batches) == 7  # 600 rows / (2 ranks x 64) = 4 batches per pass: the files repeat
    for b in batches:
        assert tuple(b.dense_features.shape) == (64, 13) and tuple(b.labels.shape) == (64,)
        kjt = b.sparse_features
        assert kjt.keys() == [f"cat_{i}" for i in range(26)]
        for t in tables:
            vals = kjt[t.features[0]].values()
            assert vals.numel() == 64 and int(vals.max()) < t.rows and int(vals.min()) >= 0


def test_criteo_loader_refuses_other_tables_and_missing_files(tmp_path):
    _write_fake_criteo(tmp_path, days=1)
    with pytest.raises(TableSetError, match="cat_0..cat_25"):
        criteo_batches(str(tmp_path), [TableSpec("a", 10, 8, ("a",))], 64, 0, 2, 1)
    with pytest.raises(TableSetError, match="is not a directory"):
        criteo_batches(str(tmp_path / "missing"), preset_tables("kaggle"), 64, 0, 2, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TableSetError, match="holds no day_<i>_dense.npy"):
        criteo_batches(str(tmp_path / "empty"), preset_tables("kaggle"), 64, 0, 2, 1)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"no_such_table": {"sharding_types": ["row_wise"]}}', "is not one of the run's tables"),
        ('{"t_cat_0": {"colour": 1}}', "unknown key(s) ['colour']"),
        ('{"t_cat_0": {"min_partition": 0}}', "min_partition: must be an integer in 1.."),
        ('{"t_cat_0": {"sharding_types": []}}', "must be a non-empty list of strings"),
        ("[1]", "top level must be an object"),
        ('{"t_cat_0": {"min_partition": 2, "min_partition": 4}}', "duplicate key 'min_partition'"),
    ],
)
def test_bad_constraints_file_exits_with_a_clear_message(tmp_path, dlrm_main, content, message):
    path = tmp_path / "c.json"
    path.write_text(content)
    code, err = dlrm_main(["--constraints", str(path), "--check"])
    assert code == 2
    assert message in err and "Traceback" not in err


def test_constraints_map_to_torchrec_parameter_constraints_with_pooling_factors(tmp_path):

    tables = scale_tables(preset_tables("dcnv2"), 0.0001)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"t_cat_0": {"sharding_types": "row_wise", "compute_kernels": ["fused"], "min_partition": 4}}))
    pc = planner_constraints(tables, load_constraints_file(str(path), tables))
    assert pc["t_cat_0"].sharding_types == ["row_wise"] and pc["t_cat_0"].compute_kernels == ["fused"]
    assert pc["t_cat_0"].min_partition == 4
    assert pc["t_cat_1"].sharding_types is None and pc["t_cat_20"].pooling_factors == [100.0]
    assert planner_constraints(tables, [], one_hot=True)["t_cat_20"].pooling_factors == [1.0]
    path.write_text(json.dumps({"t_cat_0": {"sharding_types": ["diagonal"]}}))
    with pytest.raises(UsageError, match="unknown sharding type 'diagonal'"):
        planner_constraints(tables, load_constraints_file(str(path), tables))


def test_prefetched_batches_build_between_steps_and_keep_the_order():
    built = []

    def source():
        for i in range(7):
            built.append(i)
            yield i

    it = PrefetchedBatches(source(), depth=3)
    assert built == [0, 1, 2]  # ready before the first step
    assert next(it) == 0 and built == [0, 1, 2]  # a step only pops: nothing is built inside it
    it.top_up()  # between steps
    assert built == [0, 1, 2, 3]
    assert [next(it) for _ in range(3)] == [1, 2, 3]
    assert next(it) == 4  # buffer dry: built inline rather than failing
    it.top_up()
    assert list(it) == [5, 6]
    with pytest.raises(ValueError, match="depth"):
        PrefetchedBatches(iter([]), depth=0)


def test_prefetched_batches_refill_in_chunks_between_steps():
    built = []

    def source():
        for i in range(10):
            built.append(i)
            yield i

    it = PrefetchedBatches(source(), depth=4, refill_below=2)
    assert built == [0, 1, 2, 3]
    assert [next(it) for _ in range(2)] == [0, 1]
    it.top_up()  # 2 still ready: nothing built
    assert built == [0, 1, 2, 3]
    next(it)
    it.top_up()  # 1 ready: a whole chunk up to depth
    assert built == [0, 1, 2, 3, 4, 5, 6]
    assert list(it) == [3, 4, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="refill_below"):
        PrefetchedBatches(iter([]), depth=2, refill_below=3)
