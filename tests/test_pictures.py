"""The pictures: each is drawn from small data to a temporary PNG; the file is a PNG of the size
the drawing reports, and what the figure holds (bars, points, segments, read back from its
artists) equals the inputs. The measured timeline's segments are checked against the runtime's
own step attribution and for invariants that hold for any events."""

from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_sparselift import pictures
from torchrec_sparselift.cli import main
from torchrec_sparselift.calibration.attribution import KindComparison
from torchrec_sparselift.calibration.records import ProbeRecord
from torchrec_sparselift.explain import step_timeline
from torchrec_sparselift.pictures import (
    TERMS,
    FitPoint,
    fit_points,
    fit_png,
    measured_steps,
    measured_timeline,
    plan_png,
    plans_png,
    png_size,
    timeline_png,
)
from torchrec_sparselift.plan.execution_plan import Prediction, RankPrediction
from torchrec_sparselift.runtime.overlap import step_attribution

pytest.importorskip("matplotlib")

MIB = 2 ** 20
GIB = 2 ** 30


def _prediction(rows, step_s, lower_s=0.0):
    """rows: (compute s, exposed s, overlapped s, device bytes, host bytes) per rank."""
    return Prediction(step_time_s=step_s, lower_bound_s=lower_s, per_rank=[
        RankPrediction(rank=r, compute_s=c, exposed_comm_s=e, overlapped_comm_s=o, hbm_bytes=d, ddr_bytes=h)
        for r, (c, e, o, d, h) in enumerate(rows)])


SL = _prediction([(2e-3, 1e-3, 0.5e-3, 3 * GIB, 0), (1.5e-3, 0.8e-3, 0.0, 2 * GIB, 0),
                  (1.0e-3, 0.2e-3, 0.1e-3, 1 * GIB, 0)], step_s=4e-3, lower_s=3.5e-3)
TR = _prediction([(2.5e-3, 1.2e-3, 0.0, 5 * GIB, 0), (0.5e-3, 0.1e-3, 0.0, GIB // 2, 0),
                  (1.2e-3, 0.6e-3, 0.0, 2 * GIB, 0)], step_s=5e-3)


def _assert_png(path, size):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_size(path) == size


# ---------------------------------------------------------------------------------------------
# plans side by side, memory against capacity
# ---------------------------------------------------------------------------------------------


def test_compare_bars_stack_each_plans_terms_per_rank_first_plan_left(tmp_path):
    path = str(tmp_path / "compare.png")
    caps = ([8 * GIB] * 3, [64 * GIB] * 3)
    got = plans_png([("SparseLift", SL), ("TorchRec", TR)], path, capacity=caps, title="t")
    _assert_png(path, got.size_px)
    assert got.size_px[0] >= 1000 and got.size_px[1] >= 700
    for bars, pred in zip(got.time, (SL, TR)):
        below = [0.0] * 3
        for term, field in TERMS:
            want = [getattr(r, field) * 1e3 for r in pred.per_rank]
            assert bars.heights[term] == pytest.approx(want, abs=1e-9)
            assert bars.bottoms[term] == pytest.approx(below, abs=1e-9)
            below = [a + b for a, b in zip(below, want)]
    sl, tr = got.time
    assert all(a < b < a + 1 for a, b in zip(sl.x, tr.x))  # SparseLift left, TorchRec right, per rank
    assert sl.ranks == tr.ranks == (0, 1, 2)
    assert got.step_ms == pytest.approx({"SparseLift": 4.0, "TorchRec": 5.0})
    # memory in GiB (a rank holds more than half a GiB) against the device capacity per rank
    assert got.memory_unit == "GiB"
    assert got.memory[0].heights["device"] == pytest.approx([3.0, 2.0, 1.0])
    assert got.memory[1].heights["device"] == pytest.approx([5.0, 0.5, 2.0])
    assert got.capacity == {"device": pytest.approx((8.0, 8.0, 8.0))}  # no host bytes: no host panel


def test_memory_is_drawn_in_mib_with_a_host_panel_when_plans_use_host_memory(tmp_path):
    small = _prediction([(1e-3, 0.0, 0.0, 3 * MIB, 5 * MIB), (1e-3, 0.0, 0.0, 1 * MIB, 0)], step_s=2e-3)
    got = plans_png([("one", small)], str(tmp_path / "m.png"), capacity=([GIB, GIB / 2], [4 * GIB, 4 * GIB]))
    assert got.memory_unit == "MiB"
    assert got.memory[0].heights["device"] == pytest.approx([3.0, 1.0])
    assert got.memory[0].heights["host"] == pytest.approx([5.0, 0.0])
    assert got.capacity["device"] == pytest.approx((1024.0, 512.0))
    assert got.capacity["host"] == pytest.approx((4096.0, 4096.0))


def test_plans_png_refuses_what_it_cannot_draw(tmp_path):
    with pytest.raises(ValueError, match="no plan to draw"):
        plans_png([], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="names must differ"):
        plans_png([("a", SL), ("a", TR)], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="capacity lists 2 ranks, the plans 3"):
        plans_png([("a", SL)], str(tmp_path / "x.png"), capacity=([GIB, GIB], [GIB, GIB]))


def test_a_missing_matplotlib_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plans_png([("a", SL)], str(tmp_path / "x.png"))


# ---------------------------------------------------------------------------------------------
# one plan (explain)
# ---------------------------------------------------------------------------------------------


def test_plan_picture_shows_the_ranks_the_modelled_timeline_and_the_measured_kinds(tmp_path):
    phases = {"input_dist": 0.4e-3, "lookup": 1.0e-3, "output_dist": 0.6e-3, "dense_fwd": 0.5e-3,
              "dense_bwd": 1.0e-3, "grad_dist": 0.6e-3, "backward_update": 1.2e-3, "allreduce": 0.3e-3}
    segments = step_timeline(phases, "sparse_dist")
    rows = [KindComparison("lookup", 1.3, 1.0), KindComparison("output_dist", 0.7, None),
            KindComparison("step", 9.0, 8.0)]
    path = str(tmp_path / "plan.png")
    got = plan_png(SL, segments, path, title="plan", comparison=rows, capacity=([4 * GIB] * 3, [GIB] * 3))
    _assert_png(path, got.size_px)
    assert got.memory == {"device": pytest.approx((3.0, 2.0, 1.0))}  # no host bytes: no host panel
    assert got.capacity == {"device": pytest.approx((4.0, 4.0, 4.0))} and got.memory_unit == "GiB"
    assert plan_png(SL, segments, path).memory == {}  # without a capacity: no memory panel
    assert got.bars.heights["compute"] == pytest.approx([2.0, 1.5, 1.0])
    assert got.step_ms == pytest.approx(4.0)
    assert [(lane, phase) for lane, phase, *_ in got.segments] == [(s.lane, s.phase) for s in segments]
    assert [x for _l, _p, a, d, _c in got.segments for x in (a, d)] == pytest.approx(
        [x for s in segments for x in (s.start_s * 1e3, s.duration_s * 1e3)])
    assert [c for *_x, c in got.segments] == [s.critical for s in segments]
    assert got.comparison == (("lookup", pytest.approx(1.3), pytest.approx(1.0)),
                              ("output_dist", pytest.approx(0.7), None))  # the step row is the title's


# ---------------------------------------------------------------------------------------------
# calibration fit
# ---------------------------------------------------------------------------------------------


def test_fit_picture_puts_each_probe_plan_at_measured_predicted_with_the_mape_in_the_title(tmp_path):
    recs = [ProbeRecord("probe_wide", "table_wise", 0.010, 0.013, 0.011),
            ProbeRecord("probe_wide", "row_wise", 0.020, 0.030, 0.018),
            ProbeRecord("probe_many", "table_wise", 0.005, 0.004, 0.0055)]
    path = str(tmp_path / "fit.png")
    got = fit_png(fit_points(recs), path)
    _assert_png(path, got.size_px)
    assert [x for p in got.points_ms for x in p] == pytest.approx([10.0, 11.0, 20.0, 18.0, 5.0, 5.5])
    assert [x for p in got.before_ms for x in p] == pytest.approx([10.0, 13.0, 20.0, 30.0, 5.0, 4.0])
    mape = (0.1 + 0.1 + 0.1) / 3
    assert got.mape == pytest.approx(mape)
    assert "MAPE 10.0% over 3 probe plans" in got.title


def test_fit_refuses_an_empty_fit_and_a_non_positive_time(tmp_path):
    with pytest.raises(ValueError, match="no probe plan"):
        fit_png([], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="probe plan 'w/tw': measured_s must be a positive time"):
        FitPoint("w/tw", "w", 0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# measured timeline: hidden and exposed communication
# ---------------------------------------------------------------------------------------------

#: one step as CommTimeline records it (ms, what, kind, id): input_dist hidden; output_dist issued
#: during the bottom MLP, waited for after it (2 ms hidden, 2 exposed); grad_dist waited 1 ms;
#: the all-reduce hidden until the graph ends, exposed while DDP waits for it
STEP = [
    (0.0, "step_start", "", -1), (1.0, "issue", "input_dist", 0), (3.0, "done", "input_dist", 0),
    (4.0, "dense_fwd_start", "", -1), (5.0, "issue", "output_dist", 1), (6.0, "dense_fwd_end", "", -1),
    (7.0, "wait_start", "output_dist", 1), (9.0, "done", "output_dist", 1), (9.0, "wait_end", "output_dist", 1),
    (10.0, "backward_start", "", -1), (11.0, "issue", "grad_dist", 2), (12.0, "dense_bwd_start", "", -1),
    (13.0, "dense_bwd_end", "", -1), (14.0, "wait_start", "grad_dist", 2), (15.0, "done", "grad_dist", 2),
    (15.0, "wait_end", "grad_dist", 2), (16.0, "issue", "allreduce", 3), (18.0, "graph_done", "", -1),
    (20.0, "done", "allreduce", 3), (20.0, "backward_end", "", -1), (21.0, "opt_start", "", -1),
    (22.0, "opt_end", "", -1), (23.0, "step_end", "", -1),
]


def test_measured_hidden_and_exposed_equal_the_runtimes_step_attribution():
    att = step_attribution([(t / 1e3, w, k, c) for t, w, k, c in STEP],
                           {c: t / 1e3 for t, w, _k, c in STEP if w == "done"})
    for events in (STEP, [e[:3] for e in STEP]):  # with ids, and as the benchmark stores them
        got = measured_timeline(events)
        assert got.step_ms == pytest.approx(att["step"] * 1e3)
        for kind in ("input_dist", "output_dist", "grad_dist", "allreduce"):
            hidden, exposed = got.comm_ms[kind]
            assert hidden == pytest.approx(att[f"{kind}_hidden"] * 1e3), kind
            assert exposed == pytest.approx(att[f"{kind}_exposed"] * 1e3), kind
        main = [(s.what, s.start_ms, s.end_ms) for s in got.segments if s.lane == "main"]
        assert main == [("forward", 0.0, 4.0), ("bottom MLP fwd", 4.0, 6.0), ("forward", 6.0, 7.0),
                        ("waiting", 7.0, 9.0), ("forward", 9.0, 10.0), ("backward", 10.0, 12.0),
                        ("bottom MLP bwd", 12.0, 13.0), ("backward", 13.0, 14.0), ("waiting", 14.0, 15.0),
                        ("backward", 15.0, 18.0), ("waiting", 18.0, 20.0), ("after backward", 20.0, 21.0),
                        ("optimizer", 21.0, 22.0), ("after backward", 22.0, 23.0)]


def test_a_collective_from_the_step_before_and_one_into_the_next_are_clipped_to_the_step():
    events = [(0.0, "step_start", ""), (2.0, "done", "input_dist"), (3.0, "wait_start", "input_dist"),
              (3.5, "wait_end", "input_dist"), (8.0, "issue", "input_dist"), (10.0, "step_end", "")]
    got = measured_timeline(events)
    segs = [(s.what, s.start_ms, s.end_ms) for s in got.segments if s.lane == "input_dist"]
    assert segs == [("hidden", 0.0, 2.0), ("hidden", 8.0, 10.0)]  # the wait after its done exposes nothing
    assert got.comm_ms["input_dist"] == (pytest.approx(4.0), 0.0)


_times = st.floats(0.0, 100.0, allow_nan=False)


@st.composite
def _steps(draw):
    events = [(0.0, "step_start", "", -1), (100.0, "step_end", "", -1)]
    for cid in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(("input_dist", "output_dist", "grad_dist", "allreduce")))
        a, b = sorted((draw(_times), draw(_times)))
        events += [(a, "issue", kind, cid), (b, "done", kind, cid)]
        if draw(st.booleans()):
            c, d = sorted((draw(_times), draw(_times)))
            events += [(c, "wait_start", kind, cid), (d, "wait_end", kind, cid)]
    for start, end in (("dense_fwd_start", "dense_fwd_end"), ("opt_start", "opt_end")):
        if draw(st.booleans()):
            a, b = sorted((draw(_times), draw(_times)))
            events += [(a, start, "", -1), (b, end, "", -1)]
    return events


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps())
def test_measured_segments_tile_the_step_and_never_overlap_on_a_lane(events):
    for form in (events, [e[:3] for e in events]):  # collectives paired by id, and in order per kind
        _check_tiling(measured_timeline(form))


def _check_tiling(got):
    lanes = {}
    for s in got.segments:
        assert 0.0 <= s.start_ms < s.end_ms <= got.step_ms + 1e-9, s
        lanes.setdefault(s.lane, []).append(s)
    main = sorted(lanes.pop("main"), key=lambda s: s.start_ms)
    assert main[0].start_ms == 0.0 and main[-1].end_ms == pytest.approx(100.0)
    assert all(a.end_ms == pytest.approx(b.start_ms) for a, b in zip(main, main[1:]))
    for kind, segs in lanes.items():
        segs.sort(key=lambda s: s.start_ms)
        assert all(a.end_ms <= b.start_ms + 1e-9 for a, b in zip(segs, segs[1:])), kind
        hidden, exposed = got.comm_ms[kind]
        assert hidden == pytest.approx(sum(s.duration_ms for s in segs if s.what == "hidden"))
        assert exposed == pytest.approx(sum(s.duration_ms for s in segs if s.what == "exposed"))
        # exposed only while the main thread waits
        waits = [(s.start_ms, s.end_ms) for s in main if s.what == "waiting"]
        for s in segs:
            if s.what == "exposed":
                assert any(a - 1e-9 <= s.start_ms and s.end_ms <= b + 1e-9 for a, b in waits), s


def test_timeline_picture_draws_every_ranks_segments(tmp_path):
    report = {"timeline_per_rank": [{"sparse_dist": [e[:3] for e in STEP], "overlap": [e[:3] for e in STEP[:6]]
                                     + [(8.0, "step_end", "")]},
                                    {"sparse_dist": [e[:3] for e in STEP], "overlap": [e[:3] for e in STEP]}]}
    steps = {k: measured_steps(report, k) for k in ("sparse_dist", "overlap")}
    path = str(tmp_path / "timeline.png")
    got = timeline_png(steps, path, title="two ranks")
    _assert_png(path, got.size_px)
    assert got.panels == ("sparse_dist", "overlap")
    for p, name in enumerate(got.panels):
        for r, step in enumerate(steps[name]):
            assert got.segments[p][r] == tuple(
                (s.lane, s.what, pytest.approx(s.start_ms), pytest.approx(s.duration_ms)) for s in step.segments)
    with pytest.raises(ValueError, match=r"no timeline of pipeline 'fused' on rank\(s\) \[0, 1\]"):
        measured_steps(report, "fused")


def test_the_timeline_command_draws_a_report_and_names_a_bad_one(tmp_path, capsys):
    report = tmp_path / "overlap.json"
    report.write_text(json.dumps({"regimes": {"1gbit": {"timeline_per_rank": [{"overlap": [e[:3] for e in STEP]}]}}}))
    png = tmp_path / "t.png"
    assert pictures.main(["timeline", str(report), "--png", str(png), "--kinds", "overlap"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert pictures.main(["timeline", str(report), "--png", str(png), "--regime", "300mbit"]) == 2
    assert "no regime '300mbit' in the report: it holds ['1gbit']" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the commands
# ---------------------------------------------------------------------------------------------


def test_compare_png_draws_both_planners_per_rank_bars(tmp_path, capsys):
    tiny = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "tables", "cpu_tiny.json")
    png = tmp_path / "compare.png"
    rc = main(["compare", "--tables", tiny, "--topology", "cpu-gloo", "--world-size", "2", "--quiet",
               "--time-budget", "2", "--png", str(png)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"wrote {png}" in out
    width, height = png_size(str(png))
    assert width >= 1000 and height >= 700


def test_calibrate_steps_png_draws_the_refit_probe_plans_at_their_measured_steps(tmp_path, capsys, monkeypatch):
    import re

    from torchrec_sparselift.calibration.records import ProbeMeasurement
    from torchrec_sparselift.measure import probe, steps
    from torchrec_sparselift.measure.commands import main as calibrate

    w = next(x for x in probe.PROBE_WORKLOADS if x.name == "probe_wide")
    topo = steps.probe_topology(2, "cpu")
    measured = {"table_wise": 0.045, "row_wise": 0.056, "column_wise": 0.044, "data_parallel": 0.235}
    ms = []
    for kind, seconds in measured.items():
        plan, cons = steps.forced_plan(probe.probe_model(w), w.tables, kind, topo, w.batch_size)
        ms.append(ProbeMeasurement(workload=w.name, kind=kind, plan=plan, constraints=cons, measured_s=seconds))
    saved = str(tmp_path / "set.pkl")
    steps.save_measurement_set(saved, ms, None)
    drawn = []
    monkeypatch.setattr(steps, "fit_png", lambda points, path, title="": drawn.append(
        fit_png(points, path, title=title)) or drawn[-1])
    png = tmp_path / "fit.png"
    rc = calibrate(["steps", "--from-measurements", saved, "--store", str(tmp_path / "store"), "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    (pic,) = drawn
    assert png_size(str(png)) == pic.size_px
    assert sorted(m for m, _p in pic.points_ms) == pytest.approx(sorted(s * 1e3 for s in measured.values()))
    printed = float(re.search(r"fit error \(MAPE\) ([0-9.]+)%", out).group(1))
    assert pic.mape * 100 == pytest.approx(printed, abs=0.05)
    assert f"MAPE {printed:.1f}% over 4 probe plans" in pic.title


@pytest.mark.parametrize("argv", [
    ["compare", "--tables", "TINY", "--topology", "cpu-gloo", "--world-size", "2", "--quiet"],
    ["explain", "PLAN", "--quiet"],
    ["calibrate", "steps", "--from-measurements", "SET"],
    ["calibrate", "kernels", "--from-records", "SET", "--out", "OUT"],
])
def test_png_commands_refuse_a_missing_folder_or_matplotlib_before_their_work(argv, tmp_path, capsys, monkeypatch):
    tiny = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "tables", "cpu_tiny.json")
    # a plan and a measurement set that do not exist: the check must come before they are read
    argv = [{"TINY": tiny, "PLAN": str(tmp_path / "plan.json"), "SET": str(tmp_path / "set.pkl"),
             "OUT": str(tmp_path / "out.json")}.get(a, a) for a in argv]
    assert main(argv + ["--png", str(tmp_path / "no" / "x.png")]) == 2
    assert f"the folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(argv + ["--png", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_kernel_fit_picture_groups_the_shipped_records_by_family_with_the_printed_mape(tmp_path, capsys):
    from torchrec_sparselift.calibration.kernel_fit import fit_kernel_profile, load_records
    from torchrec_sparselift.cost.hardware import get_profile
    from torchrec_sparselift.measure.commands import main as calibrate

    shipped = os.path.join(os.path.dirname(__file__), os.pardir, "profiles", "cpu-2core-gloo.records.json")
    records, previous = load_records(shipped)
    _profile, report = fit_kernel_profile(get_profile(previous.get("base") or "cpu-gloo"), records)
    got = fit_png(pictures.kernel_fit_points(report), str(tmp_path / "k.png"), what="kernel measurements")
    assert len(got.points_ms) == sum(f.points for f in report.fits) == len(records.lookups) + len(
        records.collectives) + len(records.dense)
    assert got.group_mape == {f.family: pytest.approx(f.mape) for f in report.fits}
    png = tmp_path / "kernels.png"
    rc = calibrate(["kernels", "--from-records", shipped, "--out", str(tmp_path / "p.json"), "--png", str(png)])
    assert rc == 0, capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_pictures_module_imports_without_torchrec():
    import subprocess

    code = "import sys, torchrec_sparselift.pictures; print('torchrec' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), os.pardir)]
                                                        + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False", out.stderr
