"""The ``sparselift`` command line: plan, compare, explain (text and PNG), calibrate, and errors.

Most tests call :func:`torchrec_sparselift.cli.main` in-process (importing torchrec once); one
runs the real console entry point in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from torchrec_sparselift import cli
from torchrec_sparselift.cli import CliError, load_table_file, main, parse_table_entries
from torchrec_sparselift.explain import critical_path, step_timeline, timeline_end

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "tables")
TINY = os.path.join(EXAMPLES, "cpu_tiny.json")
CPU = ["--topology", "cpu-gloo", "--world-size", "2", "--quiet"]


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """A plan of the tiny CPU table file, written by `sparselift plan` (shared by explain tests)."""
    out = str(tmp_path_factory.mktemp("plan") / "plan.json")
    rc = main(["plan", "--tables", TINY, *CPU, "--out", out, "--time-budget", "2"])
    assert rc == 0
    return out


# ---------------------------------------------------------------------------------------------
# table files
# ---------------------------------------------------------------------------------------------


def test_table_file_gives_per_feature_pooling_and_constraints():
    entries = {e.name: e for e in load_table_file(os.path.join(EXAMPLES, "small.json"))}
    hist = entries["item_history"]
    assert hist.features == ("clicked_items", "viewed_items")
    assert hist.pooling_factor == (20.0, 50.0)
    assert entries["user_id"].features == ("user_id",)  # one feature named after the table
    c = entries["query_terms"].constraints()
    assert c.sharding_types == ["row_wise", "column_wise", "table_wise"]
    assert c.min_partition == 16
    assert c.pooling_factors == [12.0]


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "not valid JSON"),
        ("[]", "non-empty list"),
        ('[{"name": "a", "dim": 8}]', "missing rows"),
        ('[{"name": "a", "rows": -3, "dim": 8}]', "rows must be a positive integer"),
        ('[{"name": "a", "rows": 10, "dim": 8, "colour": 1}]', "unknown key(s) ['colour']"),
        ('[{"name": "a", "rows": 10, "dim": 8}, {"name": "a", "rows": 5, "dim": 8}]', "appears twice"),
        ('[{"name": "a", "rows": 10, "dim": 8, "features": ["f"]}, '
         '{"name": "b", "rows": 10, "dim": 8, "features": ["f"]}]', "feature 'f' is used by tables"),
        ('[{"name": "a", "rows": 10, "dim": 8, "sharding_types": ["diagonal"]}]', "unknown sharding_types"),
        ('[{"name": "a", "rows": 10, "dim": 8, "features": ["x", "y"], "pooling_factor": [1]}]',
         "one per feature"),
    ],
)
def test_malformed_table_file_is_one_error_line_and_exit_2(tmp_path, capsys, text, says):
    path = write(tmp_path, "t.json", text)
    rc, out, err = run_cli(capsys, "plan", "--tables", path, *CPU, "--out", str(tmp_path / "p.json"))
    assert rc == 2
    assert err.startswith("sparselift plan: error: ") and says in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


def test_missing_table_file_is_named(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "plan", "--tables", str(tmp_path / "nope.json"), *CPU)
    assert rc == 2 and "nope.json" in err and "does not exist" in err


def test_yaml_tables_parse_or_say_how_to_install_pyyaml(capsys):
    path = os.path.join(EXAMPLES, "small.yaml")
    try:
        import yaml  # noqa: F401
    except ImportError:
        with pytest.raises(CliError, match="pip install pyyaml"):
            load_table_file(path)
        return
    assert load_table_file(path) == load_table_file(os.path.join(EXAMPLES, "small.json"))


def test_constraint_entries_need_only_a_name():
    got = parse_table_entries([{"name": "t1", "sharding_types": "table_wise"}], "c.json", constraint_only=True)
    assert got[0].sharding_types == ("table_wise",)
    with pytest.raises(CliError, match="unknown key"):
        parse_table_entries([{"name": "t1", "rows": 5}], "c.json", constraint_only=True)


# ---------------------------------------------------------------------------------------------
# topology and input errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["plan", "compare"])
def test_unknown_topology_name_is_one_line_listing_presets(tmp_path, capsys, cmd):
    rc, _, err = run_cli(capsys, cmd, "--tables", TINY, "--topology", "h300", "--world-size", "8", "--quiet")
    assert rc == 2
    assert err.strip() == (f"sparselift {cmd}: error: unknown topology 'h300'; choose one of a100, cpu-gloo, "
                           "h100, h200 or pass a calibrated profile .json (from `sparselift calibrate`)")


def test_world_size_must_be_a_multiple_of_ranks_per_host(capsys):
    rc, _, err = run_cli(capsys, "plan", "--tables", TINY, "--topology", "h100", "--world-size", "12", "--quiet")
    assert rc == 2 and "not a multiple of --local-world-size 8" in err


def test_exactly_one_input_is_required(capsys):
    rc, _, err = run_cli(capsys, "plan", "--tables", TINY, "--workload", "dcnv2", *CPU)
    assert rc == 2 and "exactly one input" in err


def test_table_too_big_for_any_rank_exits_1_naming_it(tmp_path, capsys):
    path = write(tmp_path, "big.json", json.dumps(
        [{"name": "huge", "rows": 100_000_000, "dim": 128, "sharding_types": ["table_wise"]},
         {"name": "small", "rows": 100, "dim": 8}]))
    rc, _, err = run_cli(capsys, "plan", "--tables", path, *CPU, "--out", str(tmp_path / "p.json"))
    assert rc == 1
    assert err.startswith("sparselift plan: error: no plan fits") and "huge" in err
    assert "Traceback" not in err


def test_model_factory_with_unknown_table_in_constraints_exits_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_model.py").write_text(
        "import torch\n"
        "from torchrec import EmbeddingBagCollection, EmbeddingBagConfig\n"
        "def make():\n"
        "    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(name='ads', embedding_dim=16,\n"
        "        num_embeddings=1000, feature_names=['ad'])], device=torch.device('meta'))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cons = write(tmp_path, "c.json", '[{"name": "adz", "pooling_factor": 3}]')
    rc, _, err = run_cli(capsys, "plan", "--model", "my_model:make", "--constraints", cons, *CPU,
                         "--out", str(tmp_path / "p.json"))
    assert rc == 2 and "adz" in err and "ads" in err
    rc, out, _ = run_cli(capsys, "plan", "--model", "my_model:make", *CPU, "--out", str(tmp_path / "p.json"))
    assert rc == 0 and "ads" in out
    rc, _, err = run_cli(capsys, "plan", "--model", "my_model:missing", *CPU)
    assert rc == 2 and "no callable 'missing'" in err


def test_debug_shows_the_exception_instead_of_one_line(tmp_path):
    with pytest.raises(CliError):
        main(["--debug", "plan", "--tables", TINY, "--topology", "h300", "--world-size", "8"])


# ---------------------------------------------------------------------------------------------
# plan / explain / compare / calibrate
# ---------------------------------------------------------------------------------------------


def test_plan_writes_an_execution_plan_that_carries_its_inputs(tiny_plan, capsys):
    from torchrec_sparselift.plan import ExecutionPlan

    with open(tiny_plan) as f:
        ep = ExecutionPlan.from_json(f.read())
    names = {n for m in ep.sharding_plan.plan.values() for n in m}
    assert names == {"t0", "t1", "t2", "t3"}
    inputs = cli.PlanInputs.from_dict(ep.planner_info["inputs"])
    assert inputs.topology.hardware == "cpu-gloo" and inputs.topology.world_size == 2
    assert [e.name for e in inputs.tables] == ["t0", "t1", "t2", "t3"]
    assert len(ep.prediction.per_rank) == 2


def test_plan_prints_a_summary_table(tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "plan", "--tables", TINY, *CPU, "--out", str(tmp_path / "p.json"))
    assert rc == 0
    assert "predicted step" in out and "peak per-rank memory" in out
    for name in ("t0", "t1", "t2", "t3"):
        assert any(line.startswith(name + " ") for line in out.splitlines())


def test_explain_shows_ranks_critical_path_gap_and_table_alternatives(tiny_plan, capsys):
    rc, out, err = run_cli(capsys, "explain", tiny_plan, "--quiet")
    assert rc == 0, err
    assert "Per-rank breakdown" in out and "exposed comm ms" in out
    assert "critical path (" in out
    assert "gap to the lower bound" in out
    assert "Why the 4 tables with the most modelled work" in out
    assert "t3 (50,000 x 32" in out
    assert " ms  +" in out or "same step time" in out  # alternatives priced against the choice


def test_explain_png_is_written_and_not_empty(tiny_plan, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    rc, out, err = run_cli(capsys, "explain", tiny_plan, "--png", str(png), "--top", "1", "--quiet")
    assert rc == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_explain_without_stored_inputs_still_shows_the_rank_breakdown(tiny_plan, tmp_path, capsys):
    with open(tiny_plan) as f:
        data = json.load(f)
    del data["planner_info"]["inputs"]
    bare = write(tmp_path, "bare.json", json.dumps(data))
    rc, out, _ = run_cli(capsys, "explain", bare, "--quiet")
    assert rc == 0 and "Per-rank breakdown" in out and "carries no planning inputs" in out
    rc, out, _ = run_cli(capsys, "explain", bare, "--tables", TINY, *CPU)
    assert rc == 0 and "critical path (" in out


def test_explain_rejects_a_corrupt_plan_file(tmp_path, capsys):
    bad = write(tmp_path, "bad.json", '{"schema": "something else"}')
    rc, _, err = run_cli(capsys, "explain", bad, "--quiet")
    assert rc == 2 and "not a SparseLift execution plan" in err


def test_compare_scores_both_planners_side_by_side(tmp_path, capsys):
    out_json = tmp_path / "c.json"
    rc, out, err = run_cli(capsys, "compare", "--tables", TINY, *CPU, "--time-budget", "2",
                           "--json", str(out_json))
    assert rc == 0, err
    assert "SparseLift" in out and "TorchRec" in out
    for row in ("SparseLift model, sparse_dist/fp32 (ms)", "lower bound", "TorchRec estimator: slowest rank",
                "peak memory/rank", "planning time (s)"):
        assert row in out
    data = json.loads(out_json.read_text())
    assert data["sparselift"]["step_sparse_dist_s"] > 0 and data["torchrec"]["step_sparse_dist_s"] > 0
    assert data["sparselift"]["planning_time_s"] > 0 and data["torchrec"]["planning_time_s"] > 0


def test_compare_saves_both_plans_and_explain_reads_torchrecs(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "compare", "--tables", TINY, *CPU, "--time-budget", "2",
                           "--save-plans", str(tmp_path))
    assert rc == 0, err
    assert (tmp_path / "sparselift.json").exists()
    rc, out, err = run_cli(capsys, "explain", str(tmp_path / "torchrec.json"), "--top", "2", "--quiet")
    assert rc == 0, err
    assert "EmbeddingShardingPlanner" not in err and "critical path (" in out


def test_plan_cache_dir_reuses_the_stored_plan_and_says_so(tmp_path, capsys):
    argv = ["plan", "--tables", TINY, *CPU, "--out", str(tmp_path / "p.json"), "--cache-dir", str(tmp_path / "c")]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0 and "reused from cache" not in out and "re-planning: no cached plan" in err
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0 and "(reused from cache)" in out and "reusing cached execution plan" in err
    rc, out, err = run_cli(capsys, *argv[:-2], "--batch-size", "64", "--cache-dir", str(tmp_path / "c"))
    assert rc == 0 and "reused from cache" not in out and "re-planning: no cached plan" in err


def test_calibrate_delegates_to_the_calibration_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--help"])
    assert e.value.code == 0
    assert "sparselift calibrate" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", [[], ["plan"], ["compare"], ["explain"]])
def test_every_command_has_help(capsys, cmd):
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    assert "usage: sparselift" in capsys.readouterr().out


def test_module_entry_point_runs_and_reports_errors_without_traceback():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "torchrec_sparselift", "plan", "--tables", TINY,
                        "--topology", "nope", "--world-size", "2"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2
    assert "unknown topology 'nope'" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------
# explain's pure parts
# ---------------------------------------------------------------------------------------------


def test_step_timeline_ends_at_the_modelled_step_time_for_every_pipeline():
    from torchrec_sparselift.cost.hardware import PRESETS
    from torchrec_sparselift.cost.model import K, PIPELINES, CostContext, DenseWork, step_time

    rng = np.random.default_rng(7)
    for _ in range(300):
        prof = PRESETS[str(rng.choice(["h100", "cpu-gloo"]))]
        ctx = CostContext(profile=prof, world_size=8, local_world_size=prof.local_world_size,
                          batch_size=int(rng.integers(1, 8192)),
                          dense=DenseWork(param_bytes=float(rng.uniform(0, 1e9)),
                                          fwd_flops_per_sample=float(rng.uniform(0, 1e8))))
        colmax = rng.uniform(0, 1, K) * rng.choice([1e-5, 1e-3, 1e-2], K)
        colmax[3:7] *= 1e10  # bytes columns
        if rng.random() < 0.3:
            colmax[2] = 0.0
        for pl in PIPELINES:
            st = step_time(colmax, float(rng.uniform(0, 1e8)), 3, ctx, pl)
            segs = step_timeline(st.phases, pl, prof.supports_overlap, ctx.num_hosts > 1)
            crit = critical_path(segs)
            assert max(s.end_s for s in crit) == pytest.approx(st.total_s, rel=1e-9, abs=1e-15)
            assert sum(s.duration_s for s in crit) == pytest.approx(st.total_s, rel=1e-9, abs=1e-15)
            assert timeline_end(segs) == pytest.approx(st.total_s, rel=1e-9, abs=1e-15)


def test_no_alternative_beats_a_converged_sparselift_choice():
    import attrs

    from torchrec_sparselift.explain import explain_tables
    from torchrec_sparselift.planner import SparseLiftPlanner, evaluate_sharding_plan

    entries = load_table_file(os.path.join(EXAMPLES, "small.json"))
    inputs = cli.PlanInputs(topology=cli.TopologySpec("h100", 8), tables=entries)
    module, constraints = inputs.build()
    topo = inputs.topology.topology()
    res = SparseLiftPlanner(topology=topo, batch_size=512, constraints=constraints, hardware="h100",
                            debug=False, time_budget_s=5).plan_with_result(module)
    assert res.search.status == "converged"
    ev = evaluate_sharding_plan(module, res.sharding_plan, topo, 512, constraints, hardware="h100",
                                pipeline=res.search.pipeline)
    expl = explain_tables(ev, res.problem.device_cap, res.problem.host_cap, top=6)
    assert len(expl) == 6 and all(e.step_s == pytest.approx(res.search.step.total_s) for e in expl)
    assert any(e.alternatives for e in expl)
    for e in expl:
        for a in e.alternatives:
            assert a.step_s is None or a.step_s >= e.step_s * (1 - 1e-9), (e.fqn, a)
    assert attrs.has(type(expl[0]))


def test_main_in_process_leaves_logging_and_warning_filters_as_they_were(tmp_path, capsys):
    import logging
    import warnings

    levels = {n: logging.getLogger(n or None).level for n in ("", "torchrec", "torchrec_sparselift.planner")}
    cache_log = logging.getLogger("torchrec_sparselift.plan.cache")
    handlers = list(cache_log.handlers)
    filters = list(warnings.filters)
    rc, _, _ = run_cli(capsys, "plan", "--tables", TINY, *CPU, "--out", str(tmp_path / "p.json"))
    assert rc == 0
    assert {n: logging.getLogger(n or None).level for n in levels} == levels
    assert cache_log.handlers == handlers and cache_log.propagate
    assert warnings.filters == filters


def test_plan_and_explain_a_2d_plan_show_groups_sync_and_evidence(tmp_path, capsys):
    out = str(tmp_path / "plan2d.json")
    rc, _, err = run_cli(capsys, "plan", "--tables", TINY, "--topology", "h100", "--world-size", "16",
                         "--sharding-group-size", "8", "--time-budget", "2", "--out", out, "--quiet")
    assert rc == 0, err
    with open(out) as f:
        opt = json.load(f)["optimizations"]
    assert opt["sharding_group_size"] == 8 and opt["layout_2d"]["group_size"] == 8
    assert opt["sync_interval"] <= opt["max_sync_interval"] == 2  # the default bound (defaults.MAX_SYNC_INTERVAL)
    assert opt["strategy_2d"] in ("default", "fully_sharded")
    rc, text, err = run_cli(capsys, "explain", out, "--quiet")
    assert rc == 0, err
    assert "sharding groups [" in text and "replica groups [" in text and f"strategy {opt['strategy_2d']}" in text
    if opt["strategy_2d"] == "default":
        assert "replica sync every" in text
    # fully_sharded is refused on CPU, with the reason
    rc, _, err = run_cli(capsys, "plan", "--tables", TINY, *CPU, "--world-size", "4", "--sharding-group-size", "2",
                         "--2d-strategy", "fully_sharded", "--out", out, "--quiet")
    assert rc != 0 and "torch.cuda.Stream" in err
    assert "use_inter_host_allreduce=" in text and "critical path (" in text
    # an interval above the bound needs the bound raised
    rc, _, err = run_cli(capsys, "plan", "--tables", TINY, "--topology", "h100", "--world-size", "16",
                         "--sharding-group-size", "auto", "--max-sync-interval", "0", "--out", out, "--quiet")
    assert rc != 0 and "max_sync_interval" in err
    with pytest.raises(SystemExit):
        main(["plan", "--tables", TINY, "--sharding-group-size", "many"])


@pytest.mark.parametrize("flags, says", [
    (["--world-size", "0"], "--world-size must be a whole number >= 1, got 0; e.g. --world-size 8"),
    (["--time-budget", "-1"], "--time-budget must be a number > 0, got -1.0; e.g. --time-budget 10"),
    (["--time-budget", "nan"], "--time-budget must be a number > 0, got nan"),
    (["--hbm-gib", "0"], "--hbm-gib must be a number > 0, got 0.0"),
    (["--local-world-size", "-2"], "--local-world-size must be a whole number >= 1, got -2"),
], ids=["world-0", "budget-negative", "budget-nan", "hbm-0", "local-negative"])
def test_zero_and_negative_sizes_and_budgets_are_refused_with_the_fix(capsys, flags, says):
    # --world-size 0 used to become an 8-rank plan without a word; --time-budget -1 was accepted.
    rc, out, err = run_cli(capsys, "plan", "--tables", TINY, "--topology", "cpu-gloo", *flags, "--quiet")
    assert rc == 2 and not out
    assert says in err


def test_every_bad_flag_is_listed_at_once(capsys):
    rc, _, err = run_cli(capsys, "plan", "--workload", "dcnv2", "--world-size", "0", "--batch-size", "-3",
                         "--time-budget", "-1", "--quiet")
    assert rc == 2
    assert "3 problems with the command line" in err
    assert "--world-size" in err and "--batch-size" in err and "--time-budget" in err


def test_stored_inputs_round_trip_and_a_malformed_record_is_named():
    from torchrec_sparselift.plan import INPUTS_SCHEMA, PlanInputs, TopologySpec

    inputs = PlanInputs(topology=TopologySpec("cpu-gloo", 2, hbm_gib=4.0), tables=load_table_file(TINY),
                        constraints=parse_table_entries([{"name": "t1", "pooling_factor": 3}], "c", True),
                        batch_size=64, allow_staleness=True, time_budget_s=3.0, source="x.json",
                        sharding_group_size="auto", max_sync_interval=8, layout_2d="strided",
                        strategy_2d="fully_sharded")
    data = json.loads(json.dumps(inputs.to_dict()))
    assert data["schema"] == INPUTS_SCHEMA and PlanInputs.from_dict(data) == inputs
    with pytest.raises(CliError, match="is not a sparselift.cli_inputs/1 record"):
        PlanInputs.from_dict({**data, "schema": "other"})
    with pytest.raises(CliError, match="stored inputs: planner_info.inputs.batch_size: is missing"):
        PlanInputs.from_dict({k: v for k, v in data.items() if k != "batch_size"})
    with pytest.raises(CliError, match="stored inputs"):  # an entry's problem names where it came from
        PlanInputs.from_dict({**data, "tables": [{"name": "a", "rows": -1, "dim": 8}]})


def test_a_stored_table_entry_problem_names_the_plan_file_and_the_field():
    from torchrec_sparselift.plan import PlanInputs, TopologySpec

    inputs = PlanInputs(topology=TopologySpec("cpu-gloo", 2), tables=load_table_file(TINY), batch_size=64)
    data = json.loads(json.dumps(inputs.to_dict()))
    data["tables"][0]["rows"] = 2**70
    with pytest.raises(CliError) as e:
        PlanInputs.from_dict(data, file="p.json")
    assert str(e.value).startswith("the plan's stored inputs p.json: planner_info.inputs.tables[0].rows: "), str(e.value)


@pytest.mark.parametrize("flags, named", [
    (["--max-sync-interval", "4"], "--max-sync-interval"),
    (["--layout-2d", "strided"], "--layout-2d"),
    (["--2d-strategy", "default"], "--2d-strategy"),
], ids=["max-sync-interval", "layout-2d", "2d-strategy"])
def test_a_2d_flag_without_a_sharding_group_is_refused_naming_the_flag(capsys, tmp_path, flags, named):
    # the planner's rule (plan.options.OPTION_NEEDS) in the command line's words, before planning
    rc, _, err = run_cli(capsys, "plan", "--tables", TINY, "--world-size", "8", *flags,
                         "--out", str(tmp_path / "p.json"), "--quiet")
    assert rc == 2 and f"{named} has no effect here: it needs --sharding-group-size auto|N" in err
    assert not (tmp_path / "p.json").exists()
    rc, _, err = run_cli(capsys, "plan", "--tables", TINY, "--world-size", "8", "--sharding-group-size", "4",
                         *flags, "--out", str(tmp_path / "p.json"), "--quiet", "--time-budget", "2")
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------
# the sparse-path rewrites from the command line
# ---------------------------------------------------------------------------------------------


def test_plan_takes_the_rewrites_and_the_per_sample_declaration(tmp_path, capsys):
    from torchrec_sparselift.plan.stored_inputs import PlanInputs

    out = str(tmp_path / "none.json")
    rc, _o, err = run_cli(capsys, "plan", "--tables", TINY, *CPU, "--out", out, "--time-budget", "2",
                          "--rewrites", "none")
    assert rc == 0, err
    plan = json.loads(open(out).read())
    o = plan["optimizations"]
    assert (o["batch_split"], o["id_dtype"], o["dedup_features"]) == (1, "int64", [])
    inputs = plan["planner_info"]["inputs"]
    assert inputs["rewrites"] == [] and inputs["per_sample"] is False
    # the stored inputs read back with them (explain and compare plan again from them)
    assert PlanInputs.from_dict(inputs).rewrites == ()
    out = str(tmp_path / "declared.json")
    rc, _o, err = run_cli(capsys, "plan", "--tables", TINY, *CPU, "--out", out, "--time-budget", "2", "--per-sample")
    assert rc == 0, err
    inputs = json.loads(open(out).read())["planner_info"]["inputs"]
    assert inputs["rewrites"] is None and PlanInputs.from_dict(inputs).per_sample
    # a declaration with no batch split to declare it for is refused, naming the flags
    rc, _o, err = run_cli(capsys, "plan", "--tables", TINY, *CPU, "--out", out, "--rewrites", "id_dtype", "--per-sample")
    assert rc == 2 and "--per-sample" in err and "Traceback" not in err
    assert cli._rewrites_arg(argparse.Namespace(rewrites="id_dtype, dedup")) == ("id_dtype", "dedup")
    assert cli._rewrites_arg(argparse.Namespace(rewrites=None)) is None


@pytest.mark.parametrize("flag, word", [("bogus", "unknown rewrite"), ("id_dtype,id_dtype", "twice"), (",", "none")])
def test_plan_refuses_unknown_rewrites_naming_the_valid_ones(tmp_path, capsys, flag, word):
    rc, _o, err = run_cli(capsys, "plan", "--tables", TINY, *CPU, "--out", str(tmp_path / "p.json"), "--rewrites", flag)
    assert rc == 2 and word in err and "batch_split,id_dtype,dedup" in err and "Traceback" not in err


def test_stored_inputs_refuse_a_mistyped_rewrites_field():
    from torchrec_sparselift.plan.stored_inputs import PlanInputs

    with pytest.raises(CliError, match="rewrites"):
        PlanInputs.from_dict({"schema": "sparselift.cli_inputs/1", "topology": {"hardware": "h100", "world_size": 8},
                              "workload": "kaggle", "batch_size": 512, "rewrites": "id_dtype"})
