"""PlanCache: reuse, refusal of bad files with one log line, drift, and safety under concurrent processes."""

from __future__ import annotations

import fcntl
import json
import logging
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
        (lambda t: t[: t.rindex(",", 0, len(t) // 2) + 1].encode(), "is not valid JSON: Expecting"),  # cut between fields
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


def _writer_reader(writer: int, n_writers: int, directory: str):
    """One writer: stores its plans and reads every key back; (plans read, bad reads)."""
    import torch.distributed as dist

    cache = PlanCache(directory)
    logging.getLogger(LOGGER).setLevel(logging.ERROR)
    fps = [_key_fingerprint(k) for k in range(N_KEYS)]
    dist.barrier()  # every writer starts together
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
    return seen, bad


@pytest.mark.multiprocess
def test_concurrent_writers_and_readers_only_ever_see_complete_plans(tmp_path):
    from launcher import run_ranks

    outcomes = run_ranks(_writer_reader, N_WRITERS, str(tmp_path), start_method="fork", timeout_s=300)
    assert all(not bad for _, bad in outcomes), outcomes
    assert sum(seen for seen, _ in outcomes) >= N_WRITERS * N_ITERS  # each reads back its own key at least
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if n.startswith(".tmp-")], names
    assert len([n for n in names if n.endswith(".json")]) == N_KEYS


def _racing_planner(worker: int, n_workers: int, directory: str):
    """One of several processes asking for the same plan at once; (cache hit, plan's author)."""
    import torch.distributed as dist

    logging.getLogger(LOGGER).setLevel(logging.ERROR)
    cache = PlanCache(directory, lock_timeout_s=60)
    fp = _key_fingerprint(0)

    def plan_fn():
        with open(os.path.join(directory, "calls.log"), "a") as f:
            f.write(f"{worker}\n")
        time.sleep(0.3)  # a slow planner: everyone else must wait, then reuse
        return _plan(fp, writer=worker, n_tables=BIG_TABLES)

    dist.barrier()  # every process asks at once
    plan, hit = cache.get_or_plan(fp, plan_fn)
    return hit, plan.planner_info["writer"]


@pytest.mark.multiprocess
def test_concurrent_get_or_plan_plans_once_and_everyone_gets_that_plan(tmp_path):
    from launcher import run_ranks

    outcomes = run_ranks(_racing_planner, N_WRITERS, str(tmp_path), start_method="fork", timeout_s=300)
    with open(tmp_path / "calls.log") as f:
        calls = f.read().split()
    assert len(calls) == 1
    assert sorted(hit for hit, _ in outcomes) == [False] + [True] * (N_WRITERS - 1)
    assert {author for _, author in outcomes} == {int(calls[0])}


def test_lock_held_too_long_plans_anyway_with_a_warning(tmp_path, caplog, fake_clock):
    cache = PlanCache(tmp_path, lock_timeout_s=30)
    fp = _fingerprint()
    lock_path = cache.path_for(fp)[: -len(".json")] + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a stuck planner elsewhere
        caplog.set_level(logging.INFO, logger=LOGGER)
        start = fake_clock()
        plan, hit = cache.get_or_plan(fp, Counter(_plan(fp)))
        assert hit is False and plan == _plan(fp)
        # it waited out lock_timeout_s (on the fake clock: backing off up to 0.5 s a try), no longer
        assert 30 <= fake_clock() - start <= 30.5 and max(fake_clock.slept) == 0.5
        assert any(r.levelno == logging.WARNING and "without waiting" in r.getMessage() for r in caplog.records)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# a stored plan is verified against the request before reuse
# ------------------------------------------------------------------------------------------------

import torch  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig  # noqa: E402
from torchrec.distributed.planner import Topology  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints  # noqa: E402
from torchrec.distributed.sharding_plan import get_default_sharders  # noqa: E402

from torchrec_sparselift import SparseLiftPlanner  # noqa: E402
from torchrec_sparselift.plan.loader import stored_plan_problem, tiling_problem  # noqa: E402

ROWS, DIM, RANKS = 40_000, 64, 4


def _small_model() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS * (i + 1),
                                   feature_names=[f"f{i}"]) for i in range(4)],
        device=torch.device("meta"),
    )


def _small_planner(cache_dir, **kw) -> SparseLiftPlanner:
    topo = Topology(world_size=RANKS, local_world_size=2, compute_device="cuda", hbm_cap=16 * 1024**3)
    return SparseLiftPlanner(
        topology=topo, batch_size=512, debug=False, cache_dir=str(cache_dir), solver="heuristic",
        time_budget_s=1.0, constraints={"t0": ParameterConstraints(sharding_types=["table_wise"])}, **kw)


def _row_wise(rows: int, ranks=range(RANKS)):
    ranks = list(ranks)
    cut = rows // len(ranks)
    return {"sharding_type": "row_wise", "compute_kernel": "fused", "ranks": ranks,
            "sharding_spec": {"kind": "enumerable", "shards": [
                {"offsets": [i * cut, 0], "sizes": [cut if i < len(ranks) - 1 else rows - i * cut, DIM],
                 "placement": f"rank:{r}/cuda:{r % 2}"} for i, r in enumerate(ranks)]}}


def _shrink_first_shard(ps):
    ps["sharding_spec"]["shards"][0]["sizes"][0] -= 1


def _move_shard_off_the_world(ps):
    ps["sharding_spec"]["shards"][0]["placement"] = f"rank:{RANKS + 5}/cuda:0"


def _overlap(ps):
    ps.update(_row_wise(ROWS * 2))
    shards = ps["sharding_spec"]["shards"]
    shards[1]["offsets"][0] -= 10  # overlaps shard 0 ...
    shards[-1]["sizes"][0] -= 10  # ... and the area still adds up


EDITS = {
    # the two examples: shards that no longer cover the rows, a table_wise table made row_wise
    "shards-miss-rows": ("t1", lambda ps: ps.update(_row_wise(ROWS * 2)) or _shrink_first_shard(ps),
                         "table 't1' (row_wise): shards cover"),
    "constrained-table-wise-made-row-wise": ("t0", lambda ps: ps.update(_row_wise(ROWS)),
                                             "table 't0' is sharded row_wise, which its sharders and constraints do not allow"),
    "kernel-not-offered": ("t2", lambda ps: ps.update(compute_kernel="key_value"),
                           "table 't2' uses compute kernel 'key_value'"),
    "rank-outside-topology": ("t1", lambda ps: ps.update(_row_wise(ROWS * 2)) or _move_shard_off_the_world(ps),
                              f"has rank {RANKS + 5}, outside 0..{RANKS - 1}"),
    "overlapping-shards": ("t1", _overlap, "overlap"),  # torch's EnumerableShardingSpec refuses it on reading
}


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_edited_cache_entry_is_not_reused_and_the_new_plan_is_valid(tmp_path, caplog, edit):
    table, damage, reason = EDITS[edit]
    model = _small_model()
    planner = _small_planner(tmp_path)
    first = planner.plan_execution(model, get_default_sharders())
    assert planner.last_cache_hit is False
    request = planner.request(model, get_default_sharders())
    assert stored_plan_problem(request, first) is None

    path = PlanCache(tmp_path).path_for(first.fingerprint)
    with open(path) as f:
        data = json.load(f)
    damage(data["sharding_plan"]["modules"][""]["params"][table])
    with open(path, "w") as f:
        json.dump(data, f)

    caplog.set_level(logging.INFO, logger=LOGGER)
    again = _small_planner(tmp_path).plan_execution(model, get_default_sharders())
    replans = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("re-planning")]
    assert len(replans) == 1 and reason in replans[0], replans
    assert stored_plan_problem(request, again) is None and request.refuses(again) is None
    assert again.sharding_plan == first.sharding_plan
    third = _small_planner(tmp_path)
    third.plan_execution(model, get_default_sharders())
    assert third.last_cache_hit is True  # the fresh plan replaced the edited one


def test_an_edited_entry_is_reported_by_the_planner_as_a_miss(tmp_path):
    model = _small_model()
    first = _small_planner(tmp_path).plan_execution(model, get_default_sharders())
    path = PlanCache(tmp_path).path_for(first.fingerprint)
    with open(path) as f:
        data = json.load(f)
    data["sharding_plan"]["modules"][""]["params"]["t0"].update(_row_wise(ROWS))
    with open(path, "w") as f:
        json.dump(data, f)
    planner = _small_planner(tmp_path)
    plan = planner.plan(model, get_default_sharders())
    assert planner.last_cache_hit is False
    assert plan.plan[""]["t0"].sharding_type == "table_wise"


@pytest.mark.parametrize("shards, rows, cols, world, problem", [
    ([([5, 4], [0, 0], 0), ([5, 4], [5, 0], 1)], 10, 4, 2, None),
    ([([3, 4], [0, 0], 0), ([3, 4], [3, 0], 1), ([3, 4], [6, 0], 2), ([1, 4], [9, 0], 3), ([0, 4], [10, 0], 4)],
     10, 4, 5, None),  # row-wise over more ranks than block rows: an empty last shard
    ([([10, 2], [0, 0], 0), ([10, 2], [0, 2], 0)], 10, 4, 1, None),  # column-wise, both on rank 0
    ([([5, 4], [0, 0], 0), ([4, 4], [5, 0], 1)], 10, 4, 2, "shards cover 36 of the table's 40 elements"),
    ([([6, 4], [0, 0], 0), ([4, 4], [7, 0], 1)], 10, 4, 2, "shard [4, 4] at [7, 0] lies outside the 10 x 4 table"),
    ([([4, 4], [0, 0], 0), ([4, 4], [6, 0], 1), ([0, 4], [10, 0], 1)], 10, 4, 2, "shards cover 32 of"),
    ([([6, 4], [0, 0], 0), ([2, 4], [4, 0], 1), ([2, 4], [8, 0], 1)], 10, 4, 2, "shards overlap at row 4"),
    ([([5, 4], [0, 0], 0), ([5, 4], [5, 0], 2)], 10, 4, 2, "rank 2, outside 0..1"),
    ([([5, 4], [0, 0], None), ([5, 4], [5, 0], 0)], 10, 4, 2, "rank None"),
    ([([10], [0], 0)], 10, 4, 1, "is not 2-D"),
    ([], 10, 4, 1, "no shards"),
])
def test_tiling_problem_accepts_exact_tilings_only(shards, rows, cols, world, problem):
    got = tiling_problem(shards, rows, cols, world)
    assert (got is None) if problem is None else (problem in got), got


# ------------------------------------------------------------------------------------------------
# the lock wait is bounded by the planning budget
# ------------------------------------------------------------------------------------------------


def test_lock_wait_is_bounded_by_the_planning_budget_and_names_the_holder(tmp_path, caplog):
    model = _small_model()
    planner = _small_planner(tmp_path)  # time_budget_s=1.0; PlanCache's own limit is 900 s
    fp = planner.fingerprint(model, get_default_sharders())
    lock_path = PlanCache(tmp_path).path_for(fp)[: -len(".json")] + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process planning the same inputs, stuck
        os.write(fd, b"424242\n")
        caplog.set_level(logging.INFO, logger=LOGGER)
        start = time.monotonic()
        plan = planner.plan(model, get_default_sharders())
        took = time.monotonic() - start
    finally:
        os.close(fd)
    assert planner.last_cache_hit is False and plan.plan
    assert took < 30, took  # the wait (1 s) plus planning, never 900 s
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    waiting = [m for m in msgs if "waiting up to 1.0 s" in m]
    gave_up = [m for m in msgs if "planning without waiting further" in m]
    assert len(waiting) == 1 and "pid 424242" in waiting[0], msgs
    assert len(gave_up) == 1 and "pid 424242" in gave_up[0], msgs
    assert PlanCache(tmp_path).load(fp) is not None  # the plan is stored for the next run


def test_stored_plans_follow_the_umask(tmp_path):
    import stat

    old = os.umask(0o022)
    try:
        path = PlanCache(tmp_path).store(_plan(_fingerprint()))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


# ------------------------------------------------------------------------------------------------
# property: any value anywhere in a stored plan gives a plan or a PlanFormatError, never more
# ------------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from torchrec_sparselift.errors import PlanFormatError  # noqa: E402

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=8)
    | st.sampled_from(["row_wise", "fused", "enumerable", "rank:0/cuda:0", "LRU", "FP16", "embedding", "object_pool"]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


_VALID = json.loads(_plan(_fingerprint(n_tables=2), n_tables=2).to_json())
_PLAN_PATHS = list(_paths(_VALID))[1:]


@settings(max_examples=600, deadline=None)
@given(where=st.sampled_from(_PLAN_PATHS), value=_VALUES)
def test_any_value_anywhere_in_a_stored_plan_gives_a_plan_or_a_plan_format_error(where, value):
    data = json.loads(json.dumps(_VALID))
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    try:
        ExecutionPlan.from_dict(data)
    except PlanFormatError as e:
        assert "\n" not in str(e)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=4000), flip=st.integers(min_value=0, max_value=255))
def test_damaged_cache_file_never_raises_from_load(tmp_path, cut, flip):
    cache = PlanCache(tmp_path)
    fp = _fingerprint(n_tables=2)
    text = bytearray(_plan(fp, n_tables=2).to_json(indent=1).encode())
    if cut < len(text):
        text[cut] = (text[cut] + flip) % 256
    with open(cache.path_for(fp), "wb") as f:
        f.write(bytes(text))
    logging.getLogger(LOGGER).setLevel(logging.ERROR)
    got = cache.load(fp)
    assert got is None or got.fingerprint == fp
