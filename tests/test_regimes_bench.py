"""Pure parts of benchmarks/regimes.py: its command line, the runs per regime, ratios, geomeans,
the targets and the merge of the regimes' JSON. No real runs."""

import math

import pytest
import torch

from benchmarks import regimes


def _row(ms, pred=None, **kw):
    return dict(measured_ms=ms, runs_ms=[ms], predicted_ms=pred or {"regime": ms, "unshaped": ms}, **kw)


def _workload(rows, **extra):
    return dict(rows=rows, ratios=regimes.summarize_workload(rows), **extra)


def test_defaults_run_every_regime_and_workload(tmp_path):
    a = regimes.parse_args(["--store", str(tmp_path)])
    assert a.regimes == ["R1", "R2", "R3", "R4"] and a.workloads == list(regimes.WORKLOADS)
    assert (a.reps, a.steps, a.warmup, a.profile_from, a.keep_models) == (4, 6, 2, "both", False)
    assert regimes.parse_args(["--keep-models", "--store", str(tmp_path)]).keep_models
    q = regimes.parse_args(["--quick", "--regimes", "R1,R2", "--store", str(tmp_path)])
    assert q.quick and q.reps == 1 and q.workloads == list(regimes.QUICK_WORKLOADS) and q.regimes == ["R1", "R2"]


@pytest.mark.parametrize("argv, word", [
    (["--regimes", "R5"], "--regimes"),
    (["--workloads", "dcnv2,nope"], "--workloads"),
    (["--reps", "0"], "--reps"),
    (["--job"], "--regime"),
])
def test_bad_arguments_name_the_flag(argv, word, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        regimes.parse_args(argv + ["--store", str(tmp_path)])
    assert e.value.code == 2 and word in capsys.readouterr().err


def test_unshaped_profile_without_r1_or_a_stored_one_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        regimes.parse_args(["--regimes", "R2", "--store", str(tmp_path / "empty")])
    assert "include R1" in capsys.readouterr().err
    assert regimes.parse_args(["--regimes", "R2", "--profile-from", "regime", "--store", str(tmp_path)]).regimes == ["R2"]


def test_runs_per_regime():
    r1 = regimes.run_names("R1", "both")
    assert "sparselift_unshaped" not in r1 and "sparselift_2d" not in r1  # R1 is the unshaped box
    r2 = regimes.run_names("R2", "both")
    assert {"torchrec", "torchrec_again", "torchrec_base", "torchrec_fused", "torchrec_prefetch", "torchrec_fp16",
            "torchrec_bf16", "sparselift", "sparselift_unshaped", "sparselift_lossy", "table_wise", "dp_small",
            "row_wise"} == set(r2)
    assert "sparselift_unshaped" not in regimes.run_names("R2", "regime")
    assert {"sparselift_2d", "sparselift_auto"} <= set(regimes.run_names("R4", "both"))
    assert "torchrec_prefetch" not in regimes.run_names("R2", "both", quick=True)


def test_testbed_command_shapes_each_regime():
    r2 = regimes.testbed_command("R2", ["--x"], 60)
    assert r2[1:3] == ["-m", "torchrec_sparselift.measure.testbed"]
    assert r2[r2.index("--rate") + 1] == "1gbit" and "--shared" in r2 and r2[-4:] == ["--job", "--regime", "R2", "--x"]
    r4 = regimes.testbed_command("R4", [], 60)
    assert r4[r4.index("--ranks-per-host") + 1] == "2" and "--shared" not in r4
    assert "--rate" not in regimes.testbed_command("R1", [], 60)
    # --burst reaches the shaped regimes' testbed (the unshaped one has no bucket), before the job
    r3 = regimes.testbed_command("R3", ["--x"], 60, burst="512kb")
    assert r3[r3.index("--burst") + 1] == "512kb" and r3.index("--burst") < r3.index("--")
    assert "--burst" not in regimes.testbed_command("R1", [], 60, burst="512kb")
    assert "--burst" not in r2


def test_ratios_of_one_workload():
    rows = {
        "torchrec": _row(200.0), "torchrec_base": _row(180.0), "torchrec_fused": _row(190.0),
        "torchrec_fp16": _row(150.0), "torchrec_bf16": dict(failed="RuntimeError: no"),
        "sparselift": _row(120.0), "sparselift_unshaped": _row(160.0), "sparselift_lossy": _row(100.0),
        "table_wise": _row(115.0),
    }
    x = regimes.summarize_workload(rows)
    assert x["torchrec_over_sparselift"] == pytest.approx(200 / 120)
    assert x["torchrec_best_pipeline"] == "base" and x["torchrec_best_pipeline_over_sparselift"] == pytest.approx(1.5)
    # the best plan is the fastest lossless run: lossy runs are not candidates
    assert x["best_run"] == "table_wise" and x["sparselift_over_best"] == pytest.approx(120 / 115)
    assert x["torchrec_best_qcomm"] == "fp16" and x["torchrec_qcomm_over_lossy"] == pytest.approx(1.5)
    assert x["sparselift_unshaped_over_best"] == pytest.approx(160 / 115)
    assert "two_d_faster" not in x


def test_the_a_a_control_is_reported_and_neither_a_candidate_nor_priced_twice():
    """torchrec_again, a second model of TorchRec's run: its ratio to the first is the A/A spread;
    it is not "the best plan measured" and does not count again in MAPE."""
    rows = {"torchrec": _row(100.0), "torchrec_again": _row(90.0, {"regime": 200.0, "unshaped": 200.0}),
            "torchrec_fused": _row(95.0), "sparselift": _row(92.0)}
    x = regimes.summarize_workload(rows)
    assert x["control_over_torchrec"] == pytest.approx(0.9)
    assert x["best_run"] == "sparselift" and x["torchrec_best_pipeline"] == "fused"
    s = regimes.summarize_regime("R2", [_workload(rows)])
    assert s["plans_priced_regime"] == 3 and s["mape_regime"] == pytest.approx(0.0)
    assert s["min_control_over_torchrec"] == s["max_control_over_torchrec"] == pytest.approx(0.9)
    # a second model is its own run: the same plan and pipeline, another key
    tr = dict(plan=_Plan(), pipeline="sparse_dist", instance=1)
    assert regimes._run_key(tr) != regimes._run_key(dict(tr, instance=2))
    assert regimes._run_key(tr) == regimes._run_key(dict(plan=_Plan(), pipeline="sparse_dist"))


class _Plan:
    """A stand-in ShardingPlan: the run key reads its digest only."""

    plan: dict = {}


def test_two_d_decision_is_right_when_the_pick_matches_the_measurement():
    base = {"torchrec": _row(100.0), "sparselift": _row(100.0)}
    faster = regimes.summarize_workload({**base, "sparselift_2d": _row(80.0), "sparselift_auto": _row(80.0, is_2d=True)})
    assert faster["two_d_faster"] and faster["two_d_decision_right"]
    wrong = regimes.summarize_workload({**base, "sparselift_2d": _row(80.0), "sparselift_auto": _row(100.0, is_2d=False)})
    assert wrong["two_d_decision_right"] is False


def test_regime_summary_geomeans_mape_and_targets():
    w1 = _workload({"torchrec": _row(200.0), "sparselift": _row(100.0, {"regime": 110.0, "unshaped": 90.0}),
                    "table_wise": _row(100.0, same_as="sparselift")})
    w2 = _workload({"torchrec": _row(100.0), "sparselift": _row(125.0, {"regime": 100.0, "unshaped": 125.0})})
    s = regimes.summarize_regime("R2", [w1, w2])
    assert s["geo_torchrec_over_sparselift"] == pytest.approx(math.sqrt(2.0 * 0.8))
    assert s["min_torchrec_over_sparselift"] == pytest.approx(0.8)
    # a run measured as another (same_as) is priced once
    assert s["plans_priced_regime"] == 4 and s["mape_regime"] == pytest.approx((0 + 0.1 + 0 + 0.2) / 4)
    assert s["mape_unshaped"] == pytest.approx(0.1 / 4)
    t = {x["key"]: x for x in regimes.check_targets(s)}
    assert t["geo_torchrec_over_sparselift"]["met"] is False and t["mape_regime"]["met"] is True
    assert "min_torchrec_over_sparselift" not in t and "two_d_loss_gap" not in t  # compute-bound / R4 only
    assert t["geo_torchrec_qcomm_over_lossy"]["met"] is None  # no lossy runs: no value, not a pass


def test_compute_bound_targets_every_workload():
    s = regimes.summarize_regime("R1", [_workload({"torchrec": _row(100.0), "sparselift": _row(101.0)})])
    t = {x["key"]: x for x in regimes.check_targets(s)}
    assert t["min_torchrec_over_sparselift"]["met"] is True and "geo_torchrec_over_sparselift" not in t


def test_r4_targets_two_d_decisions_and_loss_parity():
    rows = {"torchrec": _row(100.0), "sparselift": _row(100.0), "sparselift_2d": _row(90.0),
            "sparselift_auto": _row(90.0, is_2d=True)}
    s = regimes.summarize_regime("R4", [_workload(rows, parity=dict(loss_gap=0.001))])
    t = {x["key"]: x for x in regimes.check_targets(s)}
    assert t["two_d_decisions_right"]["met"] is True and t["two_d_loss_gap"]["met"] is False
    # the planner's own 1D/2D choice (sparselift_auto) is reported and targeted beside the 1D plan
    assert s["geo_torchrec_over_sparselift_auto"] == pytest.approx(100.0 / 90.0)
    assert s["geo_sparselift_auto_over_best"] == pytest.approx(1.0)
    assert t["geo_torchrec_over_sparselift_auto"]["met"] is False and t["geo_sparselift_auto_over_best"]["met"] is True
    merged = regimes.merge_results({"R4": dict(regime="R4", workloads=[_workload(rows, parity=dict(loss_gap=0.001))])},
                                   dict(quick=True))
    assert "R4 with 2D allowed (the planner's 1D/2D choice, sparselift_auto): TR/SL 1.111" in regimes.format_summary(merged)
    r2 = {x["key"] for x in regimes.check_targets(regimes.summarize_regime("R2", [_workload(rows)]))}
    assert "geo_torchrec_over_sparselift_auto" not in r2  # one host: no 2D


def test_parity_control_is_another_exact_1d_plan_and_its_gap_is_summarized():
    from torchrec.distributed.types import ParameterSharding, ShardingPlan

    def plan(rank):
        return ShardingPlan({"ebc": {"t0": ParameterSharding(sharding_type="table_wise", compute_kernel="fused",
                                                             ranks=[rank])}})

    specs = {"sparselift": {"plan": plan(0)}, "torchrec": {"plan": plan(0)}, "table_wise": {"plan": plan(1)},
             "dp_small": {"plan": plan(0)}}
    assert regimes.parity_control(specs) == "table_wise"  # TorchRec's plan is SparseLift's here
    specs["torchrec"] = {"plan": plan(1)}
    assert regimes.parity_control(specs) == "torchrec"
    assert regimes.parity_control({"sparselift": {"plan": plan(0)}, "torchrec": {"plan": plan(0)}}) is None
    rows = {"torchrec": _row(100.0), "sparselift": _row(100.0), "sparselift_2d": _row(120.0)}
    s = regimes.summarize_regime("R4", [_workload(rows, parity=dict(loss_gap=0.0004, control_gap=-0.0003)),
                                        _workload(rows, parity=dict(loss_gap=0.0001, control_gap=0.0001))])
    assert s["two_d_loss_gap"] == pytest.approx(0.0004) and s["one_d_control_loss_gap"] == pytest.approx(0.0003)
    merged = regimes.merge_results({"R4": dict(regime="R4", workloads=[
        _workload(rows, parity=dict(loss_gap=0.0004, control_gap=-0.0003))])}, dict(quick=True))
    assert "R4 loss parity: 2D - 1D up to +0.00040; two exact 1D plans differ by up to 0.00030" in \
        regimes.format_summary(merged)


def test_loss_gap_standard_error_from_blocks_of_the_last_half():
    one = [1.0] * 64
    # the last half's per-step gaps: blocks of 16 average 0.001 and 0.003 -> se = stdev / sqrt(2) = 0.001
    two = [9.0] * 32 + [1.001] * 16 + [1.003] * 16
    assert regimes.paired_gap_se(one, two) == pytest.approx(0.001)
    assert regimes.paired_gap_se(one[:40], two[:40]) is None  # one block: no spread


def test_merge_recomputes_summaries_in_regime_order():
    job = dict(regime="R2", workloads=[_workload({"torchrec": _row(150.0), "sparselift": _row(100.0)})])
    r1 = dict(regime="R1", workloads=[_workload({"torchrec": _row(100.0), "sparselift": _row(100.0)})])
    merged = regimes.merge_results({"R2": job, "R1": r1}, dict(quick=True))
    assert list(merged["regimes"]) == ["R1", "R2"]
    assert merged["regimes"]["R2"]["summary"]["geo_torchrec_over_sparselift"] == pytest.approx(1.5)
    assert merged["settings"]["quick"] and merged["regimes"]["R1"]["targets"]
    text = regimes.format_summary(merged)
    assert "R2" in text and "MET" in text and "n/a" in text and "1.500" in text and "MISSED" not in text


def test_dp_small_only_where_its_replicas_fit():
    from benchmarks.real_runs import _workloads

    table = _workloads()
    assert "dp_small" not in regimes.run_names("R2", "both", tables=table["few_large"][0].tables)
    assert "dp_small" in regimes.run_names("R2", "both", tables=table["many_small"][0].tables)


def test_with_only_the_unshaped_profile_sparselift_is_the_unshaped_run():
    rows = {"torchrec": _row(150.0), "sparselift": _row(100.0, profile="unshaped")}
    assert regimes.summarize_workload(rows)["torchrec_over_sparselift_unshaped"] == pytest.approx(1.5)
    rows["sparselift"]["profile"] = "regime"
    assert regimes.summarize_workload(rows)["torchrec_over_sparselift_unshaped"] is None


def test_workload_table_shows_ratios_to_torchrec_default_and_best_pipeline():
    rows = {"torchrec": _row(200.0, types="tax4", settings="sparse_dist fp32/fp32"),
            "torchrec_base": _row(100.0, types="tax4", settings="base fp32/fp32"),
            "sparselift": _row(50.0, types="tax4", settings="overlap fp32/fp32")}
    res = dict(regime="R2", workload="w", tables=4, batch_size=8, rows=rows, ratios=regimes.summarize_workload(rows))
    line = [ln for ln in regimes.format_workload(res).splitlines() if ln.startswith("sparselift")][0]
    assert "4.00" in line and "2.00" in line


def test_bf16_on_gloo_is_measured_as_the_fp16_run():
    assert regimes.on_gloo("bf16") == "fp16" and regimes.on_gloo("fp16") == "fp16" and regimes.on_gloo("fp32") == "fp32"


def _timed_run_worker(rank, world):
    """timed_run on a fake built model that syncs every 3 steps: steps are rounded up to whole
    intervals of the model's own period (and not when ``whole_intervals`` is False)."""
    import torch
    import torch.distributed as dist

    class _Pipe:
        def __init__(self):
            self.calls = 0

        def progress(self, it):
            next(it)
            self.calls += 1
            return torch.tensor(float(self.calls))

    class _Lifted:
        sync_period = 3

        def __init__(self):
            self.pipeline = _Pipe()

    out = []
    for whole in (True, False):
        built = []
        _s, losses, _b = regimes.timed_run(lambda: built.append(_Lifted()) or built[-1], [0, 1], 4, 1,
                                           dist.group.WORLD, whole_intervals=whole)
        out.append((built[0].pipeline.calls, len(losses)))
    return out


def test_a_run_is_timed_over_whole_sync_intervals_of_the_model_it_built():
    from launcher import run_ranks

    for res in run_ranks(_timed_run_worker, 2, timeout_s=120):
        # 1 warm-up + 4 steps rounded up to 6 (two intervals of 3); the parity runs keep their count
        assert res == [(7, 7), (5, 5)]


# ------------------------------------------------------------------------------------------------
# the sparse-path rewrites forced, and the overlap bound
# ------------------------------------------------------------------------------------------------


def test_rewrite_runs_are_named_after_their_base_and_what_they_force(tmp_path):
    full = regimes.rewrite_runs()
    assert full == ["sparselift_split2", "sparselift_split4", "sparselift_split8", "torchrec_split2",
                    "torchrec_split4", "torchrec_split8", "sparselift_int32", "sparselift_dedup", "torchrec_int32",
                    "torchrec_dedup"]
    assert regimes.rewrite_runs(quick=True) == ["sparselift_split4", "torchrec_split4", "sparselift_int32",
                                                "torchrec_int32"]
    assert regimes.rewrite_of("torchrec_split8") == ("torchrec", {"batch_split": 8})
    assert regimes.rewrite_of("sparselift_dedup") == ("sparselift", {"id_dtype": "int32", "dedup": True})
    for other in ("torchrec", "torchrec_fused", "sparselift_lossy", "sparselift_2d", "torchrec_splitx"):
        assert regimes.rewrite_of(other) is None
    names = regimes.run_names("R2", "both", rewrites=True)
    assert names[-len(full):] == full and names.index("sparselift") < names.index("sparselift_split2")
    assert not any(regimes.rewrite_of(n) for n in regimes.run_names("R2", "both"))
    assert regimes.parse_args(["--store", str(tmp_path)]).rewrites
    assert not regimes.parse_args(["--no-rewrites", "--store", str(tmp_path)]).rewrites


def test_gap_closed_is_the_share_of_the_gap_to_the_bound():
    assert regimes.gap_closed(100.0, 60.0, 50.0) == pytest.approx(0.8)
    assert regimes.gap_closed(100.0, 110.0, 50.0) == pytest.approx(-0.2)
    assert regimes.gap_closed(100.0, 90.0, 100.0) is None  # no gap to close


def test_overlap_bounds_take_the_unshaped_regimes_step_of_the_same_run():
    r1 = {"workload": "kaggle", "rows": {"torchrec": _row(40.0, key="K"), "torchrec_split4": _row(42.0, key="K4")}}
    r2 = {"workload": "kaggle", "rows": {
        "torchrec": _row(100.0, key="K", comm_part_ms=55.0),
        "torchrec_split4": _row(70.0, key="K4", base="torchrec", comm_part_ms=56.0),
        "sparselift": _row(80.0, key="S", comm_part_ms=30.0),  # never run unshaped: no bound
        "sparselift_split4": _row(75.0, key="S4", base="sparselift", comm_part_ms=30.0)}}
    jobs = {"R1": {"workloads": [r1]}, "R2": {"workloads": [r2]}}
    regimes.add_overlap_bounds(jobs)
    rows = jobs["R2"]["workloads"][0]["rows"]
    assert rows["torchrec"]["compute_part_ms"] == 40.0 and rows["torchrec"]["overlap_bound_ms"] == 55.0
    assert rows["torchrec_split4"]["gap_closed"] == pytest.approx((100.0 - 70.0) / (100.0 - 55.0))
    assert rows["sparselift"]["overlap_bound_ms"] is None and rows["sparselift_split4"]["gap_closed"] is None
    x = regimes.summarize_workload(rows)
    assert x["best_rewrite"] == "torchrec_split4" and x["torchrec_over_best_rewrite"] == pytest.approx(100.0 / 70.0)
    assert x["best_gap_closed_run"] == "torchrec_split4"
    s = regimes.summarize_regime("R2", [dict(rows=rows, ratios=x)])
    t = {v["key"]: v for v in regimes.check_targets(s)}
    assert t["geo_best_gap_closed"]["met"] is False and t["min_best_gap_closed"]["value"] == pytest.approx(30 / 45)


def test_peer_splits_send_each_ranks_bytes_evenly_to_the_others():
    from benchmarks.harness.replay import peer_splits

    sent = [10, 7, 0]
    for rank in range(3):
        inp, out = peer_splits(sent, rank)
        assert inp[rank] == 0 == out[rank] and sum(inp) == sent[rank]
        assert out == [peer_splits(sent, q)[0][rank] for q in range(3)]  # what each peer sends this rank
    assert peer_splits([5], 0) == ([0], [0])


def _replay_rank(rank, world):
    import torch.distributed as dist

    from benchmarks.harness.replay import replay_collectives
    from torchrec_sparselift.runtime.comm_counter import CollectiveCall

    calls = [CollectiveCall(op="all_to_all_single", kind="output_dist", dtype="float32",
                            sent_bytes=40_000 * (rank + 1), recv_bytes=0) for _ in range(3)]
    return replay_collectives(calls, 4096, dist.group.WORLD, reps=3)


def test_replay_collectives_runs_the_counted_bytes_on_every_rank():
    from launcher import run_ranks

    times = run_ranks(_replay_rank, 2, timeout_s=60)
    assert times[0] == times[1] > 0  # the slowest rank's median, the same on both


def test_the_network_regimes_runs_r1_did_not_run_are_replayed_unshaped():
    entry = {"plan": {"modules": {}}, "pipeline": "overlap"}
    r1 = {"workload": "kaggle", "rows": {"torchrec": _row(40.0, key="K")}}
    r2 = {"workload": "kaggle", "rows": {"torchrec": _row(100.0, key="K", comm_part_ms=55.0, replay=entry),
                                         "sparselift": _row(80.0, key="S", comm_part_ms=30.0, replay=entry),
                                         "sparselift_2d": _row(90.0, key="D", replay=None),
                                         "row_wise": dict(failed="boom", key="R", replay=entry)}}
    jobs = {"R1": {"workloads": [r1]}, "R2": {"workloads": [r2]}}
    assert regimes.replays_wanted(jobs) == {"kaggle": {"S": entry}}
    regimes.add_overlap_bounds(jobs, replayed={"kaggle": {"S": 50.0}})
    rows = jobs["R2"]["workloads"][0]["rows"]
    assert rows["sparselift"]["compute_part_ms"] == 50.0 and rows["sparselift"]["overlap_bound_ms"] == 50.0
    assert rows["torchrec"]["compute_part_ms"] == 40.0  # R1's own run of the same key comes first


def _ddp_bytes_rank(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.harness.replay import ddp_bytes

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2 + rank))  # the last one differs per rank
    net._ddp_params_and_buffers_to_ignore = ["1.weight", "1.bias"]
    return ddp_bytes(torch.nn.Sequential(DistributedDataParallel(net)))


def test_ddp_bytes_count_what_ddp_all_reduces_not_what_it_ignores():
    from launcher import run_ranks

    assert run_ranks(_ddp_bytes_rank, 2, timeout_s=60) == [(4 * 3 + 3) * 4] * 2


def test_rewritten_plans_have_their_own_mape_and_target():
    w = _workload({"torchrec": _row(100.0), "sparselift": _row(80.0, {"regime": 60.0, "unshaped": 80.0},
                                                                   rewrites="split4+int32"),
                   "torchrec_split4": _row(70.0, {"regime": 77.0, "unshaped": 70.0}, rewrites="split4", base="torchrec"),
                   "torchrec_split8": _row(90.0, {"regime": None, "unshaped": None}, rewrites="split8", base="torchrec")})
    s = regimes.summarize_regime("R2", [w])
    # the unpriced run counts in neither MAPE; the plain run only in the whole one
    assert s["rewritten_priced_regime"] == 2
    assert s["mape_rewrites_regime"] == pytest.approx((0.25 + 0.1) / 2)
    assert s["mape_regime"] == pytest.approx((0 + 0.25 + 0.1) / 3)
    t = {x["key"]: x for x in regimes.check_targets(s)}
    assert t["mape_rewrites_regime"]["met"] is False
