"""PlanCache: reuse, refusal of bad files with one log line, drift, and safety under concurrent processes."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing as mp
import os
import time

import pytest
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

from torchrec_sparselift.plan import (
    ExecutionPlan,
    Optimizations,
    PlanCache,
    Prediction,
    RankPrediction,
    Versions,
    fingerprint_inputs,
)
from torchrec_sparselift.semantics.workload import declare

LOGGER = "torchrec_sparselift.plan.cache"
WORLD = 8


def _topology():
    return TopologyFactory.create_topology(
        TrainerConfig(world_size=WORLD, local_world_size=4, hbm_cap_bytes=16 * 1024**3),
        kernel_config=KernelConfig(compute_device="cuda"),
    )


TOPOLOGY = _topology()


def _tables(n: int):
    return [("sparse.ebc", f"t{i}", 1000 * (i + 1), 64, [f"f{i}"], True) for i in range(n)]


def _fingerprint(batch_size: int = 128, stats=None, versions=None, n_tables: int = 4):
    return fingerprint_inputs(_tables(n_tables), TOPOLOGY, batch_size, stats=stats, versions=versions)


def _sharding_plan(n_tables: int, salt: int) -> ShardingPlan:
    """Row-wise tables over all ranks; ``salt`` moves one shard boundary so plans differ."""
    params = {}
    for i in range(n_tables):
        rows = 1000 * (i + 1)
        cut = rows // WORLD + (salt % 7 if i == 0 else 0)
        sizes = [cut] + [(rows - cut) // (WORLD - 1)] * (WORLD - 1)
        sizes[-1] += rows - sum(sizes)
        offsets = [sum(sizes[:r]) for r in range(WORLD)]
        shards = [ShardMetadata([offsets[r], 0], [sizes[r], 64], f"rank:{r}/cuda:{r % 4}") for r in range(WORLD)]
        params[f"t{i}"] = ParameterSharding(
            sharding_type="row_wise", compute_kernel="fused", ranks=list(range(WORLD)),
            sharding_spec=EnumerableShardingSpec(shards),
        )
    return ShardingPlan(plan={"sparse.ebc": EmbeddingModuleShardingPlan(params)})


def _plan(fingerprint, stats=None, writer: int = 0, iteration: int = 0, n_tables: int = 4) -> ExecutionPlan:
    return ExecutionPlan(
        sharding_plan=_sharding_plan(n_tables, salt=writer * 31 + iteration),
        optimizations=Optimizations(pipeline="sparse_dist"),
        prediction=Prediction(
            step_time_s=2e-3 + writer * 1e-6 + iteration * 1e-9, lower_bound_s=1e-3, cost_model="test",
            per_rank=[RankPrediction(rank=r, compute_s=1e-3, exposed_comm_s=5e-4) for r in range(WORLD)],
        ),
        fingerprint=fingerprint,
        stats=stats,
        created_at="2026-01-01T00:00:00+00:00",
        planner_info={"solver": "test", "writer": writer, "iteration": iteration},
    )


class Counter:
    def __init__(self, plan):
        self.calls = 0
        self.plan = plan

    def __call__(self):
        self.calls += 1
        return self.plan


def _replan_records(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]


# ------------------------------------------------------------------------------------------------
# reuse
# ------------------------------------------------------------------------------------------------


def test_second_call_hits_the_cache_and_skips_planning(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    cache = PlanCache(tmp_path)
    fp = _fingerprint()
    plan_fn = Counter(_plan(fp))
    first, hit1 = cache.get_or_plan(fp, plan_fn)
    second, hit2 = cache.get_or_plan(fp, plan_fn)
    assert (hit1, hit2) == (False, True)
    assert plan_fn.calls == 1
    assert second == first == plan_fn.plan
    assert PlanCache(tmp_path).load(fp) == first  # a new cache object (a new run) sees it too
    messages = [r.getMessage() for r in _replan_records(caplog)]
    assert len(messages) == 3  # one line per call
    assert messages[0].startswith("re-planning: no cached plan")
    assert all(m.startswith("reusing cached execution plan") for m in messages[1:])


def test_store_is_atomic_and_leaves_no_temporary_files(tmp_path):
    cache = PlanCache(tmp_path)
    fp = _fingerprint()
    path = cache.store(_plan(fp))
    assert path == cache.path_for(fp)
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    with open(path) as f:
        assert json.load(f)["fingerprint"]["batch_size"] == 128


def test_other_inputs_miss(tmp_path):
    cache = PlanCache(tmp_path)
    cache.store(_plan(_fingerprint(batch_size=128)))
    assert cache.load(_fingerprint(batch_size=256)) is None
    assert cache.load(_fingerprint(n_tables=5)) is None


def test_plan_fn_must_return_a_plan_for_the_requested_inputs(tmp_path):
    cache = PlanCache(tmp_path)
    with pytest.raises(ValueError, match="batch size changed"):
        cache.get_or_plan(_fingerprint(batch_size=128), lambda: _plan(_fingerprint(batch_size=64)))


# ------------------------------------------------------------------------------------------------
# bad files: re-plan, one clear line, no crash
# ------------------------------------------------------------------------------------------------


def _valid_text(fp) -> str:
    return _plan(fp).to_json(indent=1)


@pytest.mark.parametrize(
    "content, reason",
    [
        (lambda t: t[: len(t) // 2].encode(), "is not valid JSON: Expecting"),
        (lambda t: t[:-3].encode(), "(the file ends early: truncated?)"),
        (lambda t: b"", "is empty"),
        (lambda t: b"\x00\xff\xfe garbage \x81", "is not UTF-8 text: byte 0xff at offset 1"),
        (lambda t: b"{this is not json", "not valid JSON"),
        (lambda t: b"[1, 2, 3]", "must be a JSON object"),
        (lambda t: t.replace("sparselift.execution_plan/2", "sparselift.execution_plan/0").encode(),
         "schema 'sparselift.execution_plan/0'"),
        (lambda t: t.replace("sparselift.execution_plan/2", "sparselift.execution_plan/3").encode(),
         "schema 'sparselift.execution_plan/3'"),
        (lambda t: t.replace("sparselift.execution_plan/2", "sparselift.execution_plan/1").encode(),
         "schema 'sparselift.execution_plan/1' is older than 'sparselift.execution_plan/2': it was "
         "keyed without the planner's options"),
        (lambda t: t.replace('"sharding_type": "row_wise"', '"sharding_type": 5, "x": 1', 1).encode(),
         "is unusable: sharding_plan.modules[\"sparse.ebc\"].params.t0: unknown key(s) ['x']"),
        (lambda t: t.replace('"sharding_type": "row_wise"', '"sharding_type": 5', 1).encode(),
         "is unusable: sharding_plan.modules[\"sparse.ebc\"].params.t0.sharding_type: must be a string, got 5"),
        (lambda t: t.replace('"sharding_type": "row_wise"', '"sharding_type": "row_wise", "sharding_type": "row_wise"',
                             1).encode(), "is unusable: duplicate key 'sharding_type'"),
    ],
    ids=["truncated", "truncated-end", "empty", "binary", "not-json", "not-object", "older-schema", "newer-schema",
         "schema-1", "unknown-field", "wrong-type", "duplicate-key"],
)
def test_unusable_file_replans_with_one_log_line_naming_the_reason(tmp_path, caplog, content, reason):
    cache = PlanCache(tmp_path)
    fp = _fingerprint()
    with open(cache.path_for(fp), "wb") as f:
        f.write(content(_valid_text(fp)))
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert cache.load(fp) is None
    records = _replan_records(caplog)
    assert len(records) == 1
    assert records[0].getMessage().startswith("re-planning: ")
    assert reason in records[0].getMessage()

    caplog.clear()
    plan_fn = Counter(_plan(fp))
    plan, hit = cache.get_or_plan(fp, plan_fn)
    assert (hit, plan_fn.calls) == (False, 1)
    assert len(_replan_records(caplog)) == 1
    assert cache.load(fp) == plan  # the bad file was replaced


def test_plan_from_other_library_versions_replans_naming_the_version(tmp_path, caplog):
    cache = PlanCache(tmp_path)
    old = Versions(torch="2.9.0", torchrec="1.8.0", torchrec_sparselift="0.1.0")
    cache.store(_plan(_fingerprint(versions=old)))
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert cache.load(_fingerprint()) is None
    (record,) = _replan_records(caplog)
    assert "torch version changed (2.9.0 -> " in record.getMessage()


def test_unreadable_path_replans_without_raising(tmp_path, caplog):
    cache = PlanCache(tmp_path)
    fp = _fingerprint()
    os.mkdir(cache.path_for(fp))  # a directory where the file should be
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert cache.load(fp) is None
    (record,) = _replan_records(caplog)
    assert "cannot read cached plan" in record.getMessage()


# ------------------------------------------------------------------------------------------------
# statistics drift
# ------------------------------------------------------------------------------------------------


def test_statistics_within_tolerance_reuse_and_beyond_tolerance_replan(tmp_path, caplog):
    cache = PlanCache(tmp_path)
    planned_with = declare(f0=2.0, f1=10.0)
    cache.store(_plan(_fingerprint(stats=planned_with), stats=planned_with))

    near = declare(f0=2.2, f1=10.0)  # 10% drift
    caplog.set_level(logging.INFO, logger=LOGGER)
    hit = cache.load(_fingerprint(stats=near), stats=near, drift_tolerance=0.2)
    assert hit is not None and hit.stats == planned_with
    assert "drift 10.0%" in _replan_records(caplog)[-1].getMessage()

    far = declare(f0=3.0, f1=10.0)  # 50% drift
    caplog.clear()
    assert cache.load(_fingerprint(stats=far), stats=far, drift_tolerance=0.2) is None
    (record,) = _replan_records(caplog)
    assert "re-planning: workload statistics drifted by 50.0% (tolerance 20.0%)" in record.getMessage()

    other_features = declare(f0=2.0, f9=1.0)
    assert cache.load(_fingerprint(stats=other_features), stats=other_features) is None

    plan_fn = Counter(_plan(_fingerprint(stats=far), stats=far))
    assert cache.get_or_plan(_fingerprint(stats=far), plan_fn, stats=far)[1] is False
    assert cache.get_or_plan(_fingerprint(stats=far), plan_fn, stats=far)[1] is True
    assert plan_fn.calls == 1


def test_statistics_appearing_or_disappearing_replans_saying_so(tmp_path, caplog):
    cache = PlanCache(tmp_path)
    caplog.set_level(logging.INFO, logger=LOGGER)
    stats = declare(f0=2.0)
    cache.store(_plan(_fingerprint()))
    assert cache.load(_fingerprint(stats=stats), stats=stats) is None
    assert "has no statistics and this run has statistics" in _replan_records(caplog)[-1].getMessage()
    cache.store(_plan(_fingerprint(stats=stats), stats=stats))
    assert cache.load(_fingerprint()) is None
    assert "planned with statistics and this run has none" in _replan_records(caplog)[-1].getMessage()
    other = declare(f0=2.1)
    assert cache.load(_fingerprint(stats=other)) is None  # no stats= given: drift cannot be measured
    assert "pass stats=" in _replan_records(caplog)[-1].getMessage()
    assert cache.load(_fingerprint(stats=other), stats=other) is not None


def test_stats_that_contradict_the_fingerprint_are_a_caller_error(tmp_path):
    with pytest.raises(ValueError, match="stats_digest"):
        PlanCache(tmp_path).load(_fingerprint(), stats=declare(f0=1.0))


# ------------------------------------------------------------------------------------------------
# concurrency
# ------------------------------------------------------------------------------------------------

N_KEYS, N_WRITERS, N_ITERS, BIG_TABLES = 3, 4, 6, 40


def _key_fingerprint(k: int):
    return _fingerprint(batch_size=64 * (k + 1), n_tables=BIG_TABLES)


def _writer_reader(directory: str, writer: int, barrier, results) -> None:
    try:
        cache = PlanCache(directory)
        logging.getLogger(LOGGER).setLevel(logging.ERROR)
        fps = [_key_fingerprint(k) for k in range(N_KEYS)]
        barrier.wait()
        seen, bad = 0, []
        ever_seen = [False] * N_KEYS
        for i in range(N_ITERS):
            k = (writer + i) % N_KEYS
            cache.store(_plan(fps[k], writer=writer, iteration=i, n_tables=BIG_TABLES))
            ever_seen[k] = True  # files are only ever replaced, so from now on a complete plan must load
            for kk in range(N_KEYS):
                got = cache.load(fps[kk])
                if got is None:
                    if ever_seen[kk]:
                        bad.append((kk, "partial or missing file after a complete one existed"))
                    continue
                seen += 1
                ever_seen[kk] = True
                info = got.planner_info
                expected = _plan(fps[kk], writer=info["writer"], iteration=info["iteration"], n_tables=BIG_TABLES)
                if got != expected:
                    bad.append((kk, info))
        results.put((writer, seen, bad, None))
    except BaseException as e:  # report, never hang the parent
        results.put((writer, 0, [], repr(e)))


@pytest.mark.multiprocess
def test_concurrent_writers_and_readers_only_ever_see_complete_plans(tmp_path):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(N_WRITERS), ctx.Queue()
    procs = [ctx.Process(target=_writer_reader, args=(str(tmp_path), w, barrier, results)) for w in range(N_WRITERS)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(err is None for _, _, _, err in outcomes), outcomes
    assert all(not bad for _, _, bad, _ in outcomes), outcomes
    assert sum(seen for _, seen, _, _ in outcomes) >= N_WRITERS * N_ITERS  # each reads back its own key at least
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if n.startswith(".tmp-")], names
    assert len([n for n in names if n.endswith(".json")]) == N_KEYS


def _racing_planner(directory: str, worker: int, barrier, results) -> None:
    try:
        logging.getLogger(LOGGER).setLevel(logging.ERROR)
        cache = PlanCache(directory, lock_timeout_s=60)
        fp = _key_fingerprint(0)

        def plan_fn():
            with open(os.path.join(directory, "calls.log"), "a") as f:
                f.write(f"{worker}\n")
            time.sleep(0.3)  # a slow planner: everyone else must wait, then reuse
            return _plan(fp, writer=worker, n_tables=BIG_TABLES)

        barrier.wait()
        plan, hit = cache.get_or_plan(fp, plan_fn)
        results.put((worker, hit, plan.planner_info["writer"], None))
    except BaseException as e:
        results.put((worker, None, None, repr(e)))


@pytest.mark.multiprocess
def test_concurrent_get_or_plan_plans_once_and_everyone_gets_that_plan(tmp_path):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(N_WRITERS), ctx.Queue()
    procs = [ctx.Process(target=_racing_planner, args=(str(tmp_path), w, barrier, results)) for w in range(N_WRITERS)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(err is None for *_, err in outcomes), outcomes
    with open(tmp_path / "calls.log") as f:
        calls = f.read().split()
    assert len(calls) == 1
    assert sorted(hit for _, hit, _, _ in outcomes) == [False] + [True] * (N_WRITERS - 1)
    assert {author for _, _, author, _ in outcomes} == {int(calls[0])}


def test_lock_held_too_long_plans_anyway_with_a_warning(tmp_path, caplog):
    cache = PlanCache(tmp_path, lock_timeout_s=0.2)
    fp = _fingerprint()
    lock_path = cache.path_for(fp)[: -len(".json")] + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a stuck planner elsewhere
        caplog.set_level(logging.INFO, logger=LOGGER)
        start = time.monotonic()
        plan, hit = cache.get_or_plan(fp, Counter(_plan(fp)))
        assert hit is False and plan == _plan(fp)
        assert time.monotonic() - start < 5
        assert any(r.levelno == logging.WARNING and "without waiting" in r.getMessage() for r in caplog.records)
    finally:
        os.close(fd)
