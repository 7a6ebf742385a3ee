"""StepTimer: steady-state step time (warm-up excluded), stage means, records for calibration."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchrec_sparselift.runtime.timing import (
    StepRecord,
    StepTimer,
    load_records,
    save_records,
    steady_step_s,
    step_stats,
)

CPU = torch.device("cpu")


# Steps "take" the time the test advances a fake clock by (conftest.fake_clock): the timer's
# arithmetic is checked exactly, whatever the machine's load.


def test_warmup_steps_are_left_out_of_the_measurement(fake_clock) -> None:  # type: ignore[no-untyped-def]
    timer = StepTimer(CPU, warmup_steps=2)
    for seconds in (0.05, 0.05, 0.002, 0.003, 0.004):
        with timer.step():
            fake_clock.advance(seconds)
    assert timer.steps_timed == 5
    assert timer.steady_durations_s == pytest.approx([0.002, 0.003, 0.004])
    rec = timer.record()
    assert rec.steps == 3 and rec.warmup_steps == 2
    assert rec.measured_s == pytest.approx(0.003)  # the median; the 50 ms warm-up steps are not in it
    assert rec.mean_s == pytest.approx(0.003)


def test_ratio_is_measured_over_predicted_and_none_without_prediction(fake_clock) -> None:  # type: ignore[no-untyped-def]
    timer = StepTimer(CPU, warmup_steps=0, predicted_s=0.001, plan="p")
    for _ in range(3):
        with timer.step():
            fake_clock.advance(0.002)
    rec = timer.record()
    assert rec.ratio == pytest.approx(2.0)
    assert "measured/predicted" in rec.summary()
    no_pred = StepRecord(plan="p", predicted_s=None, measured_s=0.01, mean_s=0.01, stdev_s=0.0,
                         steps=1, warmup_steps=0, device="cpu")
    assert no_pred.ratio is None


def test_record_logs_one_line_unless_told_not_to(fake_clock, caplog) -> None:  # type: ignore[no-untyped-def]
    timer = StepTimer(CPU, warmup_steps=0, predicted_s=0.001, plan="p")
    with timer.step():
        fake_clock.advance(0.002)
    with caplog.at_level("INFO", logger="torchrec_sparselift.runtime.timing"):
        quiet = timer.record(log=False)
        assert not caplog.records
        loud = timer.record()
    assert [r.getMessage() for r in caplog.records] == [f"sparselift step time: {loud.summary()}"]
    assert quiet == loud  # the same measurement either way


def test_stage_means_are_per_steady_step_on_cpu(fake_clock) -> None:  # type: ignore[no-untyped-def]
    timer = StepTimer(CPU, warmup_steps=1)
    for step in range(4):
        with timer.step():
            with timer.stage("forward"):
                fake_clock.advance(0.5 if step == 0 else 0.01)  # the warm-up step's stages are left out
            with timer.stage("backward"):
                fake_clock.advance(0.002 * step)
            fake_clock.advance(0.001)  # outside every stage
    rec = timer.record()
    stages = dict(rec.stages)
    assert set(stages) == {"forward", "backward"}
    assert stages["forward"] == pytest.approx(0.01)  # a mean over 3 steady steps, not their 0.03 s sum
    assert stages["backward"] == pytest.approx(0.004)  # (0.002 + 0.004 + 0.006) / 3
    assert rec.measured_s == pytest.approx(0.01 + 0.004 + 0.001)


def test_failed_step_is_not_recorded_and_timer_stays_usable() -> None:
    timer = StepTimer(CPU, warmup_steps=0)
    with pytest.raises(StopIteration):
        with timer.step():
            raise StopIteration
    assert timer.steps_timed == 0
    with timer.step():
        pass
    assert timer.steps_timed == 1


def test_steps_do_not_nest_and_stages_need_a_step() -> None:
    timer = StepTimer(CPU)
    with pytest.raises(RuntimeError, match="inside StepTimer.step"):
        with timer.stage("x"):
            pass
    with pytest.raises(RuntimeError, match="do not nest"):
        with timer.step():
            with timer.step():
                pass


def test_too_few_steps_say_to_run_more_than_warmup() -> None:
    timer = StepTimer(CPU, warmup_steps=3)
    with timer.step():
        pass
    with pytest.raises(ValueError, match="more steps than warmup_steps"):
        timer.record()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        StepTimer(CPU, warmup_steps=-1)
    with pytest.raises(ValueError, match="predicted_s"):
        StepTimer(CPU, predicted_s=-0.1)
    with pytest.raises(ValueError, match="measured_s"):
        StepRecord(plan="p", predicted_s=None, measured_s=float("nan"), mean_s=0.0, stdev_s=0.0,
                   steps=1, warmup_steps=0, device="cpu")


def test_time_pipeline_stops_at_end_of_data() -> None:
    class Pipeline:
        def progress(self, it):  # type: ignore[no-untyped-def]
            return next(it)

    timer = StepTimer(CPU, warmup_steps=1)
    assert timer.time_pipeline(Pipeline(), iter(range(4)), steps=10) == 4
    assert timer.record().steps == 3


def test_step_stats_summarise_durations() -> None:
    s = step_stats([0.3, 0.1, 0.2])
    assert (s.steps, s.median_s, s.min_s, s.max_s) == (3, 0.2, 0.1, 0.3)
    assert s.mean_s == pytest.approx(0.2)
    assert s.stdev_s == pytest.approx(0.1)
    assert step_stats([0.5]).stdev_s == 0.0


def test_records_round_trip_through_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rec = StepRecord(plan="3 tables, pipeline=fused", predicted_s=0.004, measured_s=0.005, mean_s=0.0052,
                     stdev_s=0.0003, steps=20, warmup_steps=5, device="cpu", world_size=2,
                     stages={"forward": 0.002})
    path = tmp_path / "steps.json"
    save_records(str(path), [rec, rec])
    assert load_records(str(path)) == [rec, rec]
    raw = json.loads(path.read_text())
    assert raw["records"][0]["predicted_s"] == 0.004 and raw["records"][0]["measured_s"] == 0.005
    assert raw["records"][0]["stages"] == {"forward": 0.002}
    assert [p.name for p in tmp_path.iterdir()] == ["steps.json"]  # no temp file left behind


def test_foreign_json_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="step_records"):
        load_records(str(path))


@given(period=st.integers(1, 8), phase=st.integers(0, 7), windows=st.integers(1, 6),
       base=st.floats(1e-3, 1.0), spike=st.floats(0.0, 1.0))
def test_a_periodic_cost_is_in_the_steady_step_whatever_its_phase(period, phase, windows, base, spike) -> None:  # type: ignore[no-untyped-def]
    # one step in `period` pays `spike` more (a 2D replica sync): whichever step of the window it
    # falls on, the steady step is the cost per step over whole windows
    durations = [base + (spike if (i + phase) % period == 0 else 0.0) for i in range(windows * period)]
    assert steady_step_s(durations, period) == pytest.approx(base + spike / period)


def test_the_plain_median_would_leave_a_sync_every_fourth_step_out(fake_clock) -> None:  # type: ignore[no-untyped-def]
    plain, windowed = StepTimer(CPU, warmup_steps=0), StepTimer(CPU, warmup_steps=0, period=4)
    for i in range(8):
        for timer in (plain, windowed):
            with timer.step():
                fake_clock.advance(0.010 + (0.040 if i % 4 == 3 else 0.0))
    assert plain.record().measured_s == pytest.approx(0.010)
    assert windowed.record().measured_s == pytest.approx(0.020)


@pytest.mark.parametrize("period", [0, -1, 1.5, True])
def test_a_period_that_is_not_a_positive_whole_number_of_steps_is_refused(period) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="period must be a positive number of steps"):
        StepTimer(CPU, period=period)


def test_cpu_seconds_tell_a_waiting_step_from_a_computing_one() -> None:
    """Each step also records the process CPU time (what measure.probe.measure_plan reports beside
    the wall clock): a step that waits takes wall time without CPU time, a computing one both."""
    import time

    timer = StepTimer(torch.device("cpu"), warmup_steps=0)
    with timer.step():
        time.sleep(0.05)
    with timer.step():
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
    wall, cpu = timer.slowest_rank_durations_s(), timer.slowest_rank_cpu_durations_s()
    assert len(wall) == len(cpu) == 2
    assert wall[0] >= 0.05 and cpu[0] < 0.5 * wall[0]
    assert cpu[1] > 0.3 * wall[1] and cpu[1] > 2 * cpu[0]
