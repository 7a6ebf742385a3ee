"""Measured pipeline step factors: on hardware the model prices without overlap (CPU gloo) every
pipeline composes as the plain loop, yet TorchRec's pipelines still differ per step (``fused`` ran
0.77-0.96x ``sparse_dist`` on the 2-core CPU). The step calibration measures each pipeline's step
over ``sparse_dist``'s on probe plans; the profile keeps the factors, every step total and solver
row takes them from ``cost.pipelines.step_factor``, the never-slower rule counts a factor's
measured error, and the planner picks a pipeline by them."""

from __future__ import annotations

import json
import warnings

import attrs
import numpy as np
import pytest
from torchrec.distributed.planner import Topology
from torchrec.distributed.sharding_plan import get_default_sharders

from launcher import run_ranks
from search_helpers import meta_ebc
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.calibration.step_fit import FitRecord, StepFitInfo
from torchrec_sparselift.calibration.term_error import term_errors
from torchrec_sparselift.cost.hardware import PRESETS, HardwareProfile
from torchrec_sparselift.cost.pipelines import step_factor
from torchrec_sparselift.plan.baseline import TermErrors, TermTimes, never_slower, pipeline_term, with_pipeline_term

warnings.filterwarnings("ignore", category=FutureWarning)
CPU = PRESETS["cpu-gloo"]
FACTORS = (("base", 1.05), ("fused", 0.9), ("prefetch", 1.02), ("overlap", 0.97))


def test_the_profile_keeps_factors_and_refuses_bad_ones(tmp_path):
    p = attrs.evolve(CPU, pipeline_factors={"fused": 0.9, "base": 1.05})
    assert p.pipeline_factors == (("fused", 0.9), ("base", 1.05))
    assert p.pipeline_factor("fused") == 0.9 and p.pipeline_factor("sparse_dist") == 1.0
    path = tmp_path / "p.json"
    p.save(str(path))
    assert HardwareProfile.load(str(path)) == p
    assert json.loads(path.read_text())["pipeline_factors"] == [["fused", 0.9], ["base", 1.05]]
    data = json.loads(path.read_text())
    del data["pipeline_factors"]  # a profile written before the factors were measured: none
    path.write_text(json.dumps(data))
    assert HardwareProfile.load(str(path)).pipeline_factors == ()
    bad_values = [
        ((("nope", 1.0),), "unknown pipeline 'nope'"),
        ((("fused", 0.0),), "fused"),
        ((("fused", 0.9), ("fused", 0.8)), "twice"),
        ("fused", "pairs"),
    ]
    for bad, culprit in bad_values:
        with pytest.raises(ValueError, match=culprit):
            attrs.evolve(CPU, pipeline_factors=bad)


def test_a_factor_applies_where_the_model_prices_the_pipeline_as_the_plain_loop():
    cpu = attrs.evolve(CPU, pipeline_factors=FACTORS)
    assert not cpu.supports_overlap
    assert step_factor(cpu, "fused") == 0.9 and step_factor(cpu, "sparse_dist") == 1.0
    assert step_factor(cpu, "overlap") == 0.97  # one host: overlap prices as the plain loop there
    assert step_factor(cpu, "overlap", spans_hosts=True) == 1.0  # the composition prices its overlap
    # across hosts fused's composition prices what it overlaps there (its output all-to-all
    # beside the next batch's input_dist and the bottom MLP): no one-host factor on top
    assert step_factor(cpu, "fused", spans_hosts=True) == 1.0
    assert step_factor(cpu, "prefetch", spans_hosts=True) == step_factor(cpu, "prefetch")
    gpu = attrs.evolve(PRESETS["h100"], pipeline_factors=FACTORS)
    assert step_factor(gpu, "fused") == 1.0 and step_factor(gpu, "base") == 1.05
    assert step_factor(CPU, "fused") == 1.0  # no factors measured


def _cpu_topo():
    return Topology(world_size=2, local_world_size=2, compute_device="cpu")


def test_the_planner_picks_the_pipeline_the_factors_say_and_prices_it_with_them():
    module = meta_ebc(6, 2000, 32)

    def plan(profile, solver="auto"):
        return SparseLiftPlanner(topology=_cpu_topo(), batch_size=256, hardware=profile, never_slower=False,
                                 time_budget_s=2, solver=solver, debug=False).plan_with_result(
            module, get_default_sharders())

    plain = plan(CPU)
    assert plain.search.pipeline == "sparse_dist"  # alike without factors: the calibrated one
    for solver in ("auto", "milp"):
        measured = plan(attrs.evolve(CPU, pipeline_factors=FACTORS), solver)
        assert measured.search.pipeline == "fused", solver
        # the step: 0.9x the plain loop's composition of the same plan, and the bound under it
        step = measured.search.step
        assert step.total_s == pytest.approx(0.9 * sum(step.phases[p] for p in (
            "input_dist", "uvm_fetch", "lookup", "output_dist", "dense_fwd", "dense_bwd", "grad_dist",
            "backward_update", "allreduce", "step_overhead")), rel=1e-9)
        assert measured.search.lower_bound_s <= step.total_s * (1 + 1e-6)
    slower = plan(attrs.evolve(CPU, pipeline_factors=(("fused", 1.1), ("base", 1.2), ("prefetch", 1.3),
                                                      ("overlap", 1.05))))
    assert slower.search.pipeline == "sparse_dist"


def test_a_factor_is_a_term_of_its_own_in_the_never_slower_rule():
    # the same plan: the terms cancel, only the factor's gain and error remain
    same = TermTimes(total_s=0.1, terms={"a": 0.06, "fixed": 0.04})
    fused = with_pipeline_term(same, "fused", 0.9)
    assert fused.total_s == pytest.approx(0.09) and fused.terms[pipeline_term("fused")] == 0.1
    assert with_pipeline_term(same, "sparse_dist", 1.0) is same
    sure = never_slower(fused, same, TermErrors({pipeline_term("fused"): 0.02}, 0.3))
    assert sure.leave and sure.margin_s == pytest.approx(0.002) and [d.term for d in sure.differing] == ["pipeline fused"]
    unsure = never_slower(fused, same, TermErrors({pipeline_term("fused"): 0.15}, 0.3))
    assert not unsure.leave
    # the stored calibration's measured factor errors are the terms' errors
    values = {"1/a2a_bw": 1e-9}
    recs = [FitRecord("a2a", {"1/a2a_bw": 1e7}, 0.0, 0.010)]
    info = StepFitInfo(fit={"values": values}, fit_records=recs,
                       extra={"pipeline_factors": {"fused": {"factor": 0.9, "error": 0.03, "ratios": [0.9, 0.88, 0.93]}}})
    e = term_errors(info, "p")
    assert e.of("pipeline fused") == 0.03 and e.of("pipeline base") == e.default


def test_the_planner_leaves_torchrecs_pipeline_only_past_the_factors_error(monkeypatch):
    from torchrec_sparselift import planner as planner_module

    module = meta_ebc(6, 2000, 32)
    profile = attrs.evolve(CPU, pipeline_factors=(("fused", 0.8),))

    def plan(factor_error):
        monkeypatch.setattr(planner_module, "profile_errors", lambda *a, **k: TermErrors(
            {pipeline_term("fused"): factor_error}, 0.05, "test"))
        return SparseLiftPlanner(topology=_cpu_topo(), batch_size=256, hardware=profile, time_budget_s=2,
                                 debug=False).plan_with_result(module, get_default_sharders())

    sure = plan(0.02)
    assert sure.never_slower.leave and sure.search.pipeline == "fused"
    assert "pipeline fused" in [d.term for d in sure.never_slower.differing]
    unsure = plan(0.5)  # the factor's gain within its error: TorchRec's plan with its sparse_dist
    assert not unsure.never_slower.leave and unsure.search.pipeline == "sparse_dist"


def test_factors_reduce_to_the_median_with_the_largest_distance_as_error():
    from torchrec_sparselift.measure.steps import MIN_FACTOR_ERROR, pipeline_factors

    out = pipeline_factors({"fused": [0.9, 0.8, 0.95], "base": [1.0, 1.0, 1.0], "overlap": [0.85, 0.88, 0.9]})
    assert out["fused"] == {"factor": 0.9, "error": 0.1, "ratios": [0.9, 0.8, 0.95], "significant": False}
    assert out["base"]["error"] == MIN_FACTOR_ERROR and not out["base"]["significant"]
    assert out["overlap"]["factor"] == 0.88 and out["overlap"]["significant"]  # 0.12 from 1, error 0.03
    with pytest.raises(ValueError, match="'fused'"):
        pipeline_factors({"fused": [0.9, float("nan")]})
    # the A/A control: two sparse_dist models 8% apart make a factor of 0.88 +- 0.03 unusable
    aa = pipeline_factors({"overlap": [0.85, 0.88, 0.9]}, control=[1.02, 0.92, 1.0])
    assert aa["overlap"]["error"] == pytest.approx(0.08) and aa["overlap"]["significant"]
    aa = pipeline_factors({"overlap": [0.85, 0.88, 0.9]}, control=[1.13, 1.0, 1.0])
    assert aa["overlap"]["error"] == pytest.approx(0.13) and not aa["overlap"]["significant"]


def _measure_factors(rank: int, world: int):
    import torch.distributed as dist

    from torchrec_sparselift.measure.steps import StepTiming, measure_pipeline_factors

    return measure_pipeline_factors(dist.group.WORLD, pipelines=("fused", "base"), workloads=("probe_many",),
                                    timing=StepTiming(instances=2, block_steps=2, warmup=1))


def test_two_gloo_ranks_measure_the_same_factors():
    results = run_ranks(_measure_factors, 2, timeout_s=240)
    assert results[0] == results[1]
    assert set(results[0]) == {"fused", "base"}
    for rec in results[0].values():
        assert 0.2 < rec["factor"] < 5 and len(rec["ratios"]) == 1 and np.isfinite(rec["error"])


@pytest.mark.parametrize("kw", [dict(instances=0), dict(block_steps=0), dict(warmup=-1)])
def test_measuring_factors_needs_at_least_one_model_and_step(kw):
    from torchrec_sparselift.measure.steps import StepTiming

    with pytest.raises(ValueError, match="instances and block_steps must be >= 1"):
        StepTiming(**kw)
