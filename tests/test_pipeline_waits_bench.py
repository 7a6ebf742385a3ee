"""benchmarks/pipeline_waits.py: its command line and how it sums the profiler's regions (its runs
need torchrun: a benchmark, not a test)."""

from types import SimpleNamespace

import pytest

from benchmarks import pipeline_waits


def test_defaults_compare_sparse_dist_and_fused():
    a = pipeline_waits.parse_args([])
    assert a.pipelines == ["sparse_dist", "fused"] and a.workloads == ["kaggle"] and a.rounds == 2


@pytest.mark.parametrize("argv, flag", [(["--workloads", "nope"], "--workloads"), (["--pipelines", "turbo"], "--pipelines"),
                                        (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup")])
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        pipeline_waits.parse_args(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_outside_torchrun_it_says_how_to_run(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert pipeline_waits.main([]) == 2 and "testbed" in capsys.readouterr().err


def test_regions_are_ms_per_step_with_the_batch_index_left_out():
    ev = [SimpleNamespace(name="## forward 3 ##", cpu_time_total=4000.0),
          SimpleNamespace(name="## forward 4 ##", cpu_time_total=6000.0),
          SimpleNamespace(name="## PooledEmbeddingsAwaitable wait() ##", cpu_time_total=2000.0),
          SimpleNamespace(name="aten::mm", cpu_time_total=9e9)]
    assert pipeline_waits.regions(ev, steps=2) == {"forward": 5.0, "PooledEmbeddingsAwaitable wait()": 1.0}
