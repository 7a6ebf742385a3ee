"""The plan request is the one carrier: ``plan(request)`` decides, the planner only builds the
request, and SparseLift's options are grouped into values checked once.

Also the one table from a link measurement to profile fields to step-fit terms
(``cost.step_terms.LINK_TERMS``), read by the link correction and by the rule's errors.
"""

from __future__ import annotations

import inspect
import os
import warnings

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders

from search_helpers import meta_ebc
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.calibration.link import LinkRates, correct_link_terms
from torchrec_sparselift.calibration.term_error import with_link_errors
from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile
from torchrec_sparselift.cost.step_terms import CPU_STEP_TERMS, LINK_TERMS, TWO_D_ONLY_FIELDS, LinkTerm, link_terms
from torchrec_sparselift.plan import sharding_plan_digest
from torchrec_sparselift.plan.baseline import TermErrors
from torchrec_sparselift.plan.options import (
    PlannerOptions, RuleOptions, SearchOptions, TwoDOptions, pipelines_for_cores, planner_options,
)
from torchrec_sparselift.plan.planning import plan, plan_result
from torchrec_sparselift.validation import OPTION_NEEDS
from torchrec_sparselift.vocabulary import PIPELINES, SYNC_PIPELINES, pipeline as pipeline_kind

warnings.filterwarnings("ignore", category=FutureWarning)


def _topo(world: int = 4, local: int = 4, device: str = "cuda") -> Topology:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Topology(world_size=world, local_world_size=local, compute_device=device)


def test_plan_of_the_planners_request_is_the_planners_plan():
    # the planner adds nothing to the decision: the pure function on its request plans the same
    planner = SparseLiftPlanner(topology=_topo(), batch_size=256, debug=False, time_budget_s=2, never_slower=False)
    module = meta_ebc(6, 20_000, 64)
    request = planner.request(module, get_default_sharders())
    assert request.module is module and len(request.sharder_objects) == len(get_default_sharders())
    ep = plan(request)
    via_planner = planner.plan_execution(module, get_default_sharders())
    assert sharding_plan_digest(ep.sharding_plan) == sharding_plan_digest(via_planner.sharding_plan)
    assert ep.prediction.step_time_s == pytest.approx(via_planner.prediction.step_time_s, rel=1e-12)
    assert ep.optimizations == via_planner.optimizations
    assert ep.fingerprint == via_planner.fingerprint == request.fingerprint()


def test_the_request_carries_the_rules_errors_and_they_decide():
    # the same request with other errors decides differently, and nothing else changes its identity
    planner = SparseLiftPlanner(topology=_topo(16, 8), batch_size=512, debug=False, time_budget_s=2,
                                allow_lossy_comm=True, never_slower=True)
    module = meta_ebc(16, 100_000, 128)
    request = planner.request(module, get_default_sharders())
    assert request.model_errors is not None and not request.model_errors.measured  # a preset: assumed
    sure = attrs.evolve(request, model_errors=TermErrors({}, 0.0, "exact"))
    unsure = attrs.evolve(request, model_errors=TermErrors({}, 5.0, "wild"))
    assert sure.digest() == unsure.digest() == request.digest()
    kept = plan_result(unsure)
    assert not kept.never_slower.leave and kept.never_slower.error_source == "wild"
    assert kept.search.fwd_precision == "fp32"  # TorchRec's plan at full precision
    left = plan_result(sure)
    assert left.never_slower.applied and left.never_slower.error_source == "exact"


def test_without_the_rule_the_request_has_no_errors_and_plan_refuses_to_guess():
    off = SparseLiftPlanner(topology=_topo(), batch_size=64, debug=False, time_budget_s=1, never_slower=False)
    request = off.request(meta_ebc(3, 1000, 16))
    assert request.model_errors is None
    with pytest.raises(ValueError, match="model_errors"):
        plan_result(attrs.evolve(request, never_slower=True))


def test_options_are_grouped_and_each_value_checks_its_fields():
    planner = SparseLiftPlanner(topology=_topo(8, 4), batch_size=64, debug=False, time_budget_s=3, solver="heuristic",
                                sharding_group_size=4, sync_interval=2, allow_lossy_comm=True)
    o = planner.options
    assert isinstance(o, PlannerOptions)
    assert o.search.time_budget_s == 3.0 and o.search.solver == "heuristic" and o.search.allow_lossy_comm
    assert o.two_d.is_2d and o.two_d.sync_interval == 2 and o.two_d.sync_bound >= 2
    assert o.rule.never_slower == "auto" and o.cache.cache_dir is None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        o.search.solver = "milp"  # type: ignore[misc]
    with pytest.raises(ValueError):
        SearchOptions(solver="simulated-annealing")
    with pytest.raises(ValueError, match="estimator"):
        SearchOptions(estimator=object())
    with pytest.raises(ValueError):
        TwoDOptions(layout_2d="diagonal")
    with pytest.raises(ValueError, match="TermErrors"):
        RuleOptions(model_errors={"1/a2a_bw": 0.1})


def test_every_problem_of_the_arguments_is_named_in_one_error():
    with pytest.raises(ValueError) as e:
        planner_options(topology=_topo(), batch_size=-1, constraints=None, storage_reservation=None, callbacks=None,
                        stats=None, timeout_seconds=None, heuristical_storage_reservation_percentage=0.15,
                        solver="nope", pipelines=["warp"])
    text = str(e.value)
    assert "batch_size" in text and "solver" in text and "warp" in text


@settings(max_examples=200, deadline=None)
@given(pipelines=st.one_of(st.none(), st.lists(st.sampled_from(PIPELINES), min_size=1, max_size=4, unique=True)),
       stale=st.booleans(), device=st.sampled_from(["cpu", "cuda"]), ranks=st.integers(1, 8),
       cores=st.integers(1, 8))
def test_pipelines_for_cores_only_narrows_the_default_set_where_ranks_outnumber_cores(pipelines, stale, device,
                                                                                     ranks, cores):
    search = SearchOptions(pipelines=pipelines, allow_staleness=stale or any(
        pipeline_kind(p).stale for p in pipelines or ()))
    kept, left = pipelines_for_cores(search, device, ranks, cores)
    asked = search.requested_pipelines()
    assert kept and set(kept) | set(left) == set(asked) and not set(kept) & set(left)
    if pipelines is not None or device != "cpu" or ranks <= cores:
        assert kept == asked and left == ()
    assert all(pipeline_kind(p).needs_spare_cores for p in left)
    if pipelines is None and not stale:
        assert asked == SYNC_PIPELINES


def test_the_link_table_names_real_fields_rates_and_terms():
    profile_fields = {f.name for f in attrs.fields(HardwareProfile)}
    rates = {f.name for f in attrs.fields(LinkRates)}
    terms = {t.name for t in CPU_STEP_TERMS}
    for row in LINK_TERMS:
        assert row.field in profile_fields, row
        assert row.measured in rates, row
        assert row.error_term is None or row.error_term in terms, row
    assert TWO_D_ONLY_FIELDS == ("replica_intra_bw", "replica_inter_bw")
    with pytest.raises(ValueError):
        LinkTerm("inter_bw", "inter_host_bw", "teleport")


def _rates(**kw):
    base = dict(hosts=2, ranks_per_host=1, intra_bw=None, inter_bw=430e6, allreduce_bw=300e6,
                intra_latency_s=None, inter_latency_s=60e-6, allreduce_latency_s=80e-6, spread=0.02,
                latency_spread_s=5e-6)
    base.update(kw)
    return LinkRates(**base)


def test_a_corrected_bandwidth_moves_the_field_and_the_term_its_row_names():
    # the slow inter-host link moves inter_host_bw (its row's field) and raises the error of the
    # row's term (1/a2a_bw) to the measurement's spread; the all-reduce row's field is untouched
    profile = attrs.evolve(get_profile("cpu-gloo"), inter_host_bw=400e6)
    stored, measured = _rates(), _rates(inter_bw=12.5e6, spread=0.25)
    corr = correct_link_terms(profile, stored, measured)
    moved = {f for f, _a, _b in corr.changed}
    (row,) = [r for r in link_terms("bandwidth") if r.measured == "inter_bw"]
    assert row.field in moved and "allreduce_bw" not in moved
    errors = with_link_errors(TermErrors({}, 0.05, "fit"), corr, measured)
    assert errors.of(row.error_term) == pytest.approx(0.25) and errors.of("1/allreduce_bw") == 0.05


# -- options that do not apply ------------------------------------------------------------------
NOT_APPLYING = [
    (dict(sync_interval=2), "sync_interval"),
    (dict(max_sync_interval=4), "max_sync_interval"),
    (dict(layout_2d="strided"), "layout_2d"),
    (dict(strategy_2d="default"), "strategy_2d"),
    (dict(allow_fp8=True), "allow_fp8"),
    (dict(never_slower=True, cost_model="torchrec"), "never_slower"),
    (dict(model_errors=TermErrors({}, 0.1, "given"), never_slower=False), "model_errors"),
    (dict(drift_tolerance=0.3), "drift_tolerance"),
    (dict(timeout_seconds=5, time_budget_s=2), "timeout_seconds"),
    (dict(allow_staleness=True, pipelines=["sparse_dist"]), "allow_staleness"),
    (dict(rewrites=["id_dtype"], sharding_group_size=4), "rewrites"),
    (dict(per_sample=True, rewrites=["id_dtype"]), "per_sample"),
]


@pytest.mark.parametrize("kwargs,option", NOT_APPLYING, ids=[o for _k, o in NOT_APPLYING])
def test_an_option_that_does_not_apply_is_refused_naming_it_and_what_it_needs(kwargs, option):
    with pytest.raises(ValueError) as e:
        SparseLiftPlanner(topology=_topo(8, 4), batch_size=64, **kwargs)
    assert f"{option} has no effect here: it needs" in str(e.value)
    # with what it needs it is accepted
    needs = {"sync_interval": dict(sharding_group_size=4), "max_sync_interval": dict(sharding_group_size=4),
             "layout_2d": dict(sharding_group_size=4), "strategy_2d": dict(sharding_group_size=4),
             "allow_fp8": dict(allow_lossy_comm=True), "never_slower": dict(cost_model="sparselift"),
             "model_errors": dict(never_slower=True), "drift_tolerance": dict(cache_dir="/tmp/sparselift-cache-test"),
             "timeout_seconds": dict(time_budget_s=5), "allow_staleness": dict(pipelines=["sparse_dist", "semi_sync"]),
             "rewrites": dict(sharding_group_size=None), "per_sample": dict(rewrites=["id_dtype", "batch_split"])}
    SparseLiftPlanner(topology=_topo(8, 4), batch_size=64, **{**kwargs, **needs[option]})


def test_a_storage_reservation_passed_with_a_percentage_is_refused():
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation

    with pytest.raises(ValueError, match="heuristical_storage_reservation_percentage has no effect"):
        SparseLiftPlanner(topology=_topo(), storage_reservation=HeuristicalStorageReservation(0.2),
                          heuristical_storage_reservation_percentage=0.3)


def test_every_row_of_the_table_is_tested_and_names_its_needs():
    # batch_split, id_dtype, dedup_features: runtime.lift's rewrites, forced by the DLRM example's flags
    # (tests/test_dlrm_rewrites.py); the planner chooses them itself
    assert {r.option for r in OPTION_NEEDS} == {o for _k, o in NOT_APPLYING} | {
        "estimator", "heuristical_storage_reservation_percentage", "batch_split", "id_dtype", "dedup_features"}
    for row in OPTION_NEEDS:
        assert row.needs and not row.given_without({})  # nothing given: nothing refused


def test_model_errors_name_real_terms():
    with pytest.raises(ValueError, match=r"unknown terms \['1/a2a_bandwidth'\].*1/a2a_bw"):
        SparseLiftPlanner(topology=_topo(), model_errors=TermErrors({"1/a2a_bandwidth": 0.1}, 0.1, "typo"))
    ok = TermErrors({"1/a2a_bw": 0.1, "fixed": 0.2, "pipeline fused": 0.05}, 0.1, "fine")
    assert SparseLiftPlanner(topology=_topo(), model_errors=ok).options.rule.model_errors is ok


def test_troubleshooting_lists_every_option_with_what_it_needs():
    # docs/troubleshooting.md's table is the rule's table: the same options, the same needs
    doc = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "troubleshooting.md")
    table = open(doc).read().split("<!-- option-needs -->", 1)[1].strip().split("\n\n", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    documented = {r[0].strip().strip("`"): r[2].strip() for r in rows}
    assert documented == {row.option: row.needs for row in OPTION_NEEDS}


_WEIRD = st.sampled_from([None, 0, -1, 1.5, float("nan"), "auto", "x", "", [], {}, [1], {"a": 1}, True, object(),
                          b"b", 10**20, ("sparse_dist",), ["semi_sync"]])
_ARGS = [p for p in inspect.signature(SparseLiftPlanner.__init__).parameters
         if p not in ("self", "topology", "enumerator", "proposer", "partitioner", "performance_model", "plan_loader")]


@settings(max_examples=300, deadline=None)
@given(kwargs=st.dictionaries(st.sampled_from(_ARGS), _WEIRD, min_size=1, max_size=3))
def test_no_internal_exception_type_reaches_the_user_from_the_planners_arguments(kwargs):
    # any mix of wrong values is accepted or refused with ValueError / TorchRec's PlannerError,
    # never a TypeError, KeyError, AttributeError ... from inside
    try:
        SparseLiftPlanner(topology=_topo(4, 2), **kwargs)
    except (ValueError, PlannerError):
        pass
