"""benchmarks.harness: interleaved rounds, the timed loop, the statistics and the JSON report
(what every benchmark runs on). The timed loop runs on 2 gloo ranks; the rest is pure."""

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from launcher import run_ranks

from benchmarks.harness import (geomean, interleaved_rounds, median_step, paired_ratio, rotated, spread, timed_steps,
                                write_report)
from benchmarks.harness.report import REPO


@given(st.lists(st.integers(), min_size=1, max_size=7), st.integers(min_value=0, max_value=50))
def test_a_rotated_round_holds_every_item_once_and_starts_at_the_round(items, r):
    out = rotated(items, r)
    assert sorted(out) == sorted(items) and out[0] == items[r % len(items)]


def test_every_item_runs_once_per_round_and_no_item_always_goes_first():
    calls = []
    done = interleaved_rounds(["a", "b", "c"], lambda item, r: calls.append((r, item)), 3)
    assert done == 3
    assert [item for r, item in calls if r == 0] == ["a", "b", "c"]
    assert [item for r, item in calls if r == 1] == ["b", "c", "a"]
    firsts = [next(item for q, item in calls if q == r) for r in range(3)]
    assert firsts == ["a", "b", "c"] and len(calls) == 9


def test_more_rounds_run_while_asked_and_progress_is_told_after_each():
    runs = {"a": [], "b": []}
    told = []

    def measure(item, r):
        runs[item].append(1.0 if r < 2 else 1.001)

    done = interleaved_rounds(list(runs), measure, 1, more=lambda n: n < 4 and spread(runs["a"]) < 0.0005,
                              after_round=told.append)
    # round 3 (index 2) brings the spread above the bound: no fourth round
    assert done == 3 and told == [1, 2, 3] and len(runs["a"]) == len(runs["b"]) == 3


def test_statistics():
    assert spread([]) == 0.0 and spread([2.0, 3.0]) == pytest.approx(0.5)
    assert paired_ratio([2.0, 4.0, 3.0], [1.0, 4.0, 2.0]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="rounds where both plans ran"):
        paired_ratio([1.0], [0.0])
    assert geomean([2.0, 8.0]) == pytest.approx(4.0) and math.isnan(geomean([]))
    assert median_step([{"x": 1.0, "y": 5.0}, {"x": 3.0, "y": 1.0}, {"x": 2.0, "y": 2.0}]) == {"x": 2.0, "y": 2.0}


def test_the_report_says_what_ran_where_and_keeps_the_results_keys(tmp_path):
    path = tmp_path / "sub" / "r.json"
    out = write_report(str(path), {"rows": [1, 2], "nested": {3: (4, 5)}}, argv=["python", "-m", "benchmarks.x"])
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(out, default=str))
    assert data["command"] == "python -m benchmarks.x" and data["rows"] == [1, 2] and data["nested"] == {"3": [4, 5]}
    assert data["date"].endswith("Z") and data["machine"]["cpu_count"] >= 1
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    assert data["git_commit"] is None or data["git_commit"].startswith(head)
    with pytest.raises(ValueError, match=r"header's keys \['date'\]"):
        write_report(str(path), {"date": "today"})


def test_every_benchmark_runs_as_a_module_of_the_benchmarks_package():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.regimes", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "--regimes" in proc.stdout


def _timed_worker(rank, world):
    import time

    import torch
    import torch.distributed as dist

    calls = []

    def step():
        calls.append(1)
        time.sleep(0.002 if rank == 0 else 0.02)  # rank 1 is the slow one
        return len(calls)

    seen = []
    timer = timed_steps(step, 4, dist.group.WORLD, torch.device("cpu"), warmup=1, untimed=2, on_step=seen.append)
    record = timer.record(dist.group.WORLD, log=False)
    return len(calls), seen, record.steps, record.measured_s


def test_the_timed_loop_times_the_steps_after_the_untimed_ones_at_the_slowest_rank():
    out = run_ranks(_timed_worker, 2, timeout_s=120)
    for calls, seen, steps, measured_s in out:
        assert calls == 2 + 1 + 4 and seen == [3, 4, 5, 6, 7] and steps == 4
        assert measured_s >= 0.02  # every rank reports the slowest rank's median
    assert out[0][3] == out[1][3]


def test_the_report_names_a_module_run_as_python_m(monkeypatch):
    from types import ModuleType, SimpleNamespace

    from benchmarks.harness.report import command_line

    main = ModuleType("__main__")
    main.__spec__ = SimpleNamespace(name="benchmarks.real_runs")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/repo/benchmarks/real_runs.py", "--quick"])
    assert command_line() == "python -m benchmarks.real_runs --quick"
    main.__spec__ = None  # a script run by path: its command line as given
    assert command_line() == "/repo/benchmarks/real_runs.py --quick"
    assert command_line(["a", "b"]) == "a b"
