"""benchmarks/pipeline_models.py's command line (its runs need torchrun: a benchmark, not a test)."""

import pytest

from benchmarks import pipeline_models


def test_defaults_compare_sparse_dist_and_fused_on_four_models_each():
    a = pipeline_models.parse_args([])
    assert a.pipelines == ["sparse_dist", "fused"] and a.models == 4 and "hot_skewed" in a.workloads


@pytest.mark.parametrize("argv, flag", [(["--workloads", "nope"], "--workloads"), (["--pipelines", "turbo"], "--pipelines"),
                                        (["--models", "0"], "--models"), (["--block-steps", "0"], "--block-steps")])
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        pipeline_models.parse_args(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_outside_torchrun_it_says_how_to_run(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert pipeline_models.main([]) == 2 and "torchrun" in capsys.readouterr().err
