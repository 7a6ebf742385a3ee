"""Planner benchmark (SparseLift vs TorchRec): scoring, one tiny side-by-side row, target checks."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

from torchrec.distributed.planner.perf_models import NoopPerfModel

from benchmarks import planners as pb
from torchrec_sparselift.cost.torchrec_score import torchrec_score

TINY = pb.Scenario("production-6", 8)
_RUN_TORCHREC_IN_CHILD = pb.run_torchrec


def test_scenario_text_round_trips_and_bad_text_says_the_format():
    for text in ("dcnv2@64", "production-5000@1024:sl"):
        assert pb.Scenario.parse(text).name == text
    assert not pb.Scenario.parse("production-5000@1024:sl").torchrec
    assert [s.name for s in pb.parse_scenarios("small")][0] == "dcnv2@8"
    with pytest.raises(ValueError, match="WORKLOAD@WORLD_SIZE"):
        pb.Scenario.parse("dcnv2-64")
    with pytest.raises(ValueError, match=":sl"):
        pb.Scenario.parse("dcnv2@64:x")


@pytest.fixture(scope="module")
def tiny_row():
    mp = pytest.MonkeyPatch()
    # the same TorchRec run, in process (the child process costs ~10 s of imports)
    mp.setattr(pb, "run_torchrec", lambda sc, t, m, h=80.0: pb.run_torchrec_in_process(sc, h))
    try:
        yield pb.compare(TINY, hardware="h100")
    finally:
        mp.undo()


def test_side_by_side_row_has_both_plans_scored_both_ways(tiny_row):
    sl, tr, ra = tiny_row["sparselift"], tiny_row["torchrec"], tiny_row["ratios"]
    assert sl["status"] == "ok" and tr["status"] == "ok"
    # our estimator-score of TorchRec's own plan equals TorchRec's own rating of it
    assert tr["torchrec_perf_ms"] == pytest.approx(tr["own_rating_ms"], rel=1e-9)
    # our plan re-priced through evaluate_sharding_plan equals what the search predicted
    assert sl["repriced_step_ms"] == pytest.approx(sl["step_ms"], rel=1e-6)
    assert ra["torchrec_estimator"] == pytest.approx(tr["torchrec_perf_ms"] / sl["torchrec_perf_ms"])
    assert ra["our_model_same_pipeline"] == pytest.approx(tr["step_ms_same_pipeline"] / sl["step_ms"])
    assert sl["plan_wall_s"] > 0 and tr["plan_wall_s"] > 0
    assert 0 < sl["peak_dev_bytes"] <= sl["hbm_cap_bytes"]
    table = pb.format_table([tiny_row])
    assert TINY.name in table and "timeout" not in table


def test_torchrec_score_leaves_the_plan_untouched_and_matches_noop_rating():
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    from torchrec_sparselift.cost.torchrec_score import BestPlanCapture

    wl, module, topo, batch, cons, sharders = pb._inputs(TINY, 80.0)
    cap = BestPlanCapture()
    EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                             stats=cap).plan(module, sharders)
    before = [[(s.rank, s.perf) for s in o.shards] for o in cap.best_plan]
    score = torchrec_score(cap.best_plan, topo, sharders, cons)
    assert [[(s.rank, s.perf) for s in o.shards] for o in cap.best_plan] == before
    assert score.perf_ms == pytest.approx(NoopPerfModel(topology=topo).rate(cap.best_plan))
    assert score.perf_ms == pytest.approx(max(score.rank_perf_ms))
    cap.best_plan[0].shards[0].rank = None
    with pytest.raises(ValueError, match="without a rank"):
        torchrec_score(cap.best_plan, topo, sharders, cons)


def test_torchrec_past_its_wall_limit_is_reported_as_timeout():
    res = _RUN_TORCHREC_IN_CHILD(TINY, timeout_s=0.5, mem_gib=0)
    assert res["status"] == "timeout" and res["limit_s"] == 0.5


def test_stored_torchrec_result_is_reused_unless_its_limit_was_tighter(tmp_path, monkeypatch):
    import json

    import torchrec

    calls = []
    monkeypatch.setattr(pb, "run_torchrec", lambda sc, t, m, h=80.0: calls.append(t) or {"status": "timeout", "limit_s": t})
    key = tmp_path / f"production-6@8_hbm80_torchrec-{torchrec.__version__}.json"
    key.write_text(json.dumps({"status": "timeout", "limit_s": 300.0, "measured_at": "then"}))
    assert pb.cached_run_torchrec(TINY, 200.0, 8.0, 80.0, str(tmp_path))["cached"] == "then"
    assert calls == []
    res = pb.cached_run_torchrec(TINY, 900.0, 8.0, 80.0, str(tmp_path))
    assert calls == [900.0] and "cached" not in res
    assert json.loads(key.read_text())["limit_s"] == 900.0


def _row(name, wl, ws, est, model, gap, sl_t=1.0, tr_t=30.0, tr_status="ok"):
    return {
        "scenario": name, "workload": wl, "world_size": ws,
        "sparselift": {"status": "ok", "gap": gap, "plan_wall_s": sl_t, "plan_cpu_s": sl_t,
                       "peak_dev_bytes": 1.0, "hbm_cap_bytes": 2.0},
        "torchrec": {"status": tr_status, "plan_wall_s": tr_t, "limit_s": tr_t},
        "ratios": {"torchrec_estimator": est, "our_model_same_pipeline": model,
                   "planning_wall": tr_t / sl_t if tr_status == "ok" else None,
                   "planning_wall_at_least": tr_t / sl_t},
    }


def test_targets_pass_and_miss_on_the_numbers():
    rows = [
        _row("dcnv2@64", "dcnv2", 64, 1.1, 1.3, 0.01),
        _row("dcnv2@128", "dcnv2", 128, 0.9, 1.1, 0.02),
        _row("production-200@64", "production-200", 64, 1.2, 1.0, 0.10, sl_t=2.0, tr_t=30.0, tr_status="timeout"),
    ]
    lines = {t.name: t for t in pb.check_targets(rows)}
    assert lines["never worse than TorchRec under TorchRec's estimator"].verdict == "MISS"
    assert "dcnv2@128 (0.900x)" in lines["never worse than TorchRec under TorchRec's estimator"].detail
    assert lines["better on geomean under TorchRec's estimator"].verdict == "PASS"
    assert lines[">= 1.26x geomean under our model, DLRM-DCNv2 64+ GPUs"].verdict == "MISS"  # sqrt(1.43)
    assert lines["median gap to lower bound < 5%"].verdict == "PASS"
    t = lines["200 tables x 64: planning >= 20x faster than TorchRec"]
    assert t.verdict == "MISS" and t.detail.startswith(">= 15.0x")
    assert lines["856 tables x 128: SparseLift plans in < 10 s"].verdict == "N/A"
