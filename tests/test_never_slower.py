"""The never-slower rule: the pure decision, the per-term error and split it reads, and the planner
keeping TorchRec's plan unless its predicted gain clears the model's error."""

import json
import warnings

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec.distributed.planner import Topology
from torchrec.distributed.sharding_plan import get_default_sharders

from search_helpers import meta_ebc
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift import planner as planner_module
from torchrec_sparselift.calibration import term_error
from torchrec_sparselift.calibration.step_fit import FitRecord, StepFitInfo
from torchrec_sparselift.calibration.term_error import term_errors, uncalibrated_errors
from torchrec_sparselift.cost.hardware import get_profile
from torchrec_sparselift.cost.step_terms import CPU_STEP_TERMS
from torchrec_sparselift.plan import sharding_plan_digest
from torchrec_sparselift.plan.baseline import (
    FIXED_TERM, BaselineDecision, TermErrors, TermTimes, decision_from_dict, kept_plan_pipeline, never_slower,
    never_slower_with_precision, same_sharding_price, term_seconds,
)
from torchrec_sparselift.plan.compare import torchrec_plan
from torchrec_sparselift.plan import planning
from torchrec_sparselift.plan.planning import plan_result

warnings.filterwarnings("ignore", category=FutureWarning)
GiB = 1024**3
TERMS = ("a", "b", "c", FIXED_TERM)

_seconds = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
_breakdown = st.fixed_dictionaries({t: _seconds for t in TERMS})
_errors = st.fixed_dictionaries({t: st.floats(min_value=0.0, max_value=2.0) for t in TERMS})


def _times(terms):
    return TermTimes(total_s=sum(terms.values()), terms=terms)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cand=_breakdown, base=_breakdown, errs=_errors, default=st.floats(min_value=0.0, max_value=1.0))
def test_the_rule_leaves_torchrec_only_when_the_gain_exceeds_the_margin(cand, base, errs, default):
    d = never_slower(_times(cand), _times(base), TermErrors(errs, default))
    margin = sum(errs[t] * max(cand[t], base[t]) for t in TERMS if abs(cand[t] - base[t]) > 1e-12)
    assert d.margin_s == pytest.approx(margin, abs=1e-12)
    assert d.leave == (d.gain_s > d.margin_s and bool(d.differing))
    if d.leave:
        assert d.gain_s > 0
    assert all(abs(x.candidate_s - x.baseline_s) > 1e-12 for x in d.differing)


@settings(max_examples=50, deadline=None)
@given(terms=_breakdown, errs=_errors)
def test_identical_plans_keep_torchrec(terms, errs):
    d = never_slower(_times(terms), _times(dict(terms)), TermErrors(errs, 0.1))
    assert not d.leave and d.differing == () and d.margin_s == 0.0 and d.gain_s == 0.0


def test_only_terms_that_differ_enter_the_margin():
    # the candidate trades 4 ms of all-to-all for 2 ms of data-parallel work; lookups are equal
    cand = _times({"a2a": 0.001, "dp": 0.002, "lookup": 0.010})
    base = _times({"a2a": 0.005, "dp": 0.0, "lookup": 0.010})
    d = never_slower(cand, base, TermErrors({"a2a": 0.2, "dp": 0.5, "lookup": 9.0}, 0.1))
    assert [x.term for x in d.differing] == ["a2a", "dp"]
    assert d.gain_s == pytest.approx(0.002)
    assert d.margin_s == pytest.approx(0.2 * 0.005 + 0.5 * 0.002)  # 2 ms: not more than the gain
    assert not d.leave
    d = never_slower(cand, base, TermErrors({"a2a": 0.1, "dp": 0.3}, 0.1))
    assert d.margin_s == pytest.approx(0.0011) and d.leave
    again = decision_from_dict(json.loads(json.dumps(d.to_dict())))
    assert again == d and "gain 2.00 ms" in again.describe() and "margin 1.10 ms" in again.describe()


def test_term_errors_reject_a_negative_error():
    with pytest.raises(ValueError, match="'a2a'.*>= 0"):
        TermErrors({"a2a": -0.1}, 0.1)


def test_term_seconds_split_a_linear_prediction_exactly():
    profile = get_profile("cpu-gloo")

    def predict(p):  # 1 ms fixed + 1e6 bytes of all-to-all + 3 step overheads
        return 1e-3 + 1e6 / p.intra_host_bw + 3 * p.step_overhead_s

    p = attrs.evolve(profile, step_overhead_s=2e-4)
    t = term_seconds(predict, p)
    assert t.total_s == pytest.approx(predict(p))
    assert t.terms["1/a2a_bw"] == pytest.approx(1e6 / p.intra_host_bw, rel=1e-6)
    assert t.terms["step_overhead_s"] == pytest.approx(6e-4, rel=1e-6)
    assert t.terms[FIXED_TERM] == pytest.approx(1e-3, rel=1e-6)
    assert set(t.terms) == {x.name for x in CPU_STEP_TERMS} | {FIXED_TERM}


def test_term_errors_follow_the_records_that_carry_each_term():
    values = {"1/a2a_bw": 1e-9, "dp_table_overhead_s": 1e-3}
    recs = [  # an all-to-all plan predicted exactly; a data-parallel plan 50% high
        FitRecord("a2a", {"1/a2a_bw": 1e7, "dp_table_overhead_s": 0.0}, 0.0, 0.010),
        FitRecord("dp", {"1/a2a_bw": 0.0, "dp_table_overhead_s": 15.0}, 0.0, 0.010),
        FitRecord("a2a:comm", {"1/a2a_bw": 1e7}, 0.0, 0.001, kind="comm"),  # parts are left out
    ]
    e = term_errors(StepFitInfo(fit={"values": values}, fit_records=recs), "p")
    assert e.of("1/a2a_bw") == pytest.approx(0.0)
    assert e.of("dp_table_overhead_s") == pytest.approx(0.5)
    assert e.default == pytest.approx(0.25) and e.of("bwd_row_s") == pytest.approx(0.25)
    assert "2 records" in e.source
    with pytest.raises(ValueError, match="calibrate"):
        term_errors(StepFitInfo(), "p")
    assert uncalibrated_errors("h100").of("anything") == 0.30 and not uncalibrated_errors("h100").measured


# -- the planner --------------------------------------------------------------------------------


def _topo(world_size, local=8):
    return Topology(world_size=world_size, local_world_size=min(local, world_size), compute_device="cuda",
                    hbm_cap=80 * GiB, ddr_cap=256 * GiB)


def test_planner_keeps_torchrecs_plan_when_the_gain_is_within_the_error():
    topo, module = _topo(2), meta_ebc(6, 1000)
    planner = SparseLiftPlanner(topology=topo, batch_size=512, debug=False, never_slower=True)
    res = planner.plan_with_result(module, get_default_sharders())
    d = res.never_slower
    assert d is not None and d.applied and not d.leave and d.gain_s <= d.margin_s
    theirs = torchrec_plan(module, get_default_sharders(), topo, 512)
    assert sharding_plan_digest(res.sharding_plan) == sharding_plan_digest(theirs.plan)
    assert len(res.sharding_options) == 6 and res.search.status == "kept"
    assert "TorchRec's plan kept" in res.summary() and "30%" in d.describe()  # a preset: uncalibrated
    info = planner.plan_execution(module).planner_info["never_slower"]
    assert info["rule"] == "never_slower" and info["leave"] is False
    off = SparseLiftPlanner(topology=topo, batch_size=512, debug=False, never_slower=False)
    assert off.plan_with_result(module, get_default_sharders()).never_slower is None
    # the default ("auto") applies the rule only where the profile's error is measured: not on a preset
    auto = SparseLiftPlanner(topology=topo, batch_size=512, debug=False).plan_with_result(module, get_default_sharders())
    assert not auto.never_slower.applied and "no measured error" in auto.never_slower.describe()


def test_never_slower_accepts_true_false_or_auto():
    with pytest.raises(ValueError, match="never_slower must be True, False or 'auto', got 'yes'"):
        SparseLiftPlanner(topology=_topo(2), batch_size=512, never_slower="yes")


def test_planner_keeps_the_lossy_comms_when_their_gain_clearly_exceeds_the_error(monkeypatch):
    # two hosts, lossy comm allowed: fp16 halves the all-to-all TorchRec's plan sends in fp32 (a
    # predicted gain of ~50%); a profile whose step fit measured 10% error per term ("auto" applies
    # it). SparseLift's lossy plan is priced as TorchRec's plan with the same comms (qcomm by hand),
    # so TorchRec's placement is kept, with the lossy comms
    monkeypatch.setattr(planner_module, "profile_errors", lambda *a, **k: TermErrors({}, 0.10, "a step fit"))
    topo, module = _topo(16), meta_ebc(16, 100000, 128)
    res = SparseLiftPlanner(topology=topo, batch_size=512, debug=False, allow_lossy_comm=True,
                            time_budget_s=2).plan_with_result(module, get_default_sharders())
    d = res.never_slower
    lossy = (res.search.fwd_precision, res.search.bwd_precision)
    assert d.applied and not d.leave and lossy != ("fp32", "fp32") and d.baseline == "torchrec+{}/{}".format(*lossy)
    assert sharding_plan_digest(res.sharding_plan) == sharding_plan_digest(
        torchrec_plan(module, get_default_sharders(), topo, 512).plan)
    assert "TorchRec's plan with {}/{} comms kept".format(*lossy) in res.summary()


def test_with_lossy_comms_the_plan_is_never_slower_than_torchrecs_with_them_or_without():
    errs = TermErrors({}, 0.10, "test")
    theirs = {("fp32", "fp32"): _times({"1/a2a_bw": 0.10, "fixed": 0.10}),
              ("fp16", "fp16"): _times({"1/a2a_bw": 0.05, "fixed": 0.10})}
    at = lambda f, b: theirs[(f, b)]  # noqa: E731
    full, lossy = ("fp32", "fp32"), ("fp16", "fp16")
    # clearly faster than TorchRec's plan with the same comms, and than at full precision
    d, kept = never_slower_with_precision(_times({"1/a2a_bw": 0.02, "fixed": 0.08}), at, lossy, full, errs)
    assert d.leave and kept is None
    # priced as TorchRec's plan with the same comms: TorchRec's plan, with the lossy comms (they pay)
    d, kept = never_slower_with_precision(_times({"1/a2a_bw": 0.05, "fixed": 0.10}), at, lossy, full, errs)
    assert not d.leave and kept == lossy and d.baseline == "torchrec+fp16/fp16"
    assert "TorchRec's plan with fp16/fp16 comms kept" in d.describe()
    # the lossy comms gain too little to pay (within the error): TorchRec's plan at full precision
    # (half the wire, but a codec that costs nearly as much: gain 2 ms, margin 0.1 * (50 + 48) ms)
    theirs[lossy] = _times({"1/a2a_bw": 0.050, "codec": 0.048, "fixed": 0.10})
    d, kept = never_slower_with_precision(_times({"1/a2a_bw": 0.050, "codec": 0.048, "fixed": 0.10}), at, lossy,
                                          full, errs)
    assert not d.leave and kept == full
    # at full precision it is the plain rule
    d, kept = never_slower_with_precision(_times({"1/a2a_bw": 0.02, "fixed": 0.08}), at, full, full, errs)
    assert d.leave and kept is None and d.baseline == "torchrec"


def test_planner_reads_the_error_it_is_given(monkeypatch):
    """The same inputs keep or leave TorchRec's plan depending only on the model's error."""
    topo, module = _topo(16), meta_ebc(16, 100000, 128)

    def plan(error):
        monkeypatch.setattr(planner_module, "profile_errors", lambda *a, **k: TermErrors({}, error, "test"))
        return SparseLiftPlanner(topology=topo, batch_size=512, debug=False, allow_lossy_comm=True,
                                 time_budget_s=2).plan_with_result(module, get_default_sharders())  # "auto"

    # no error: the lossy comms' gain stands (on TorchRec's placement, which SparseLift's prices the same)
    lossy = plan(0.0)
    assert lossy.never_slower.applied and lossy.search.fwd_precision != "fp32"
    kept = plan(5.0)
    assert not kept.never_slower.leave and kept.search.fwd_precision == "fp32"
    assert kept.never_slower.error_source == "test"


def test_planner_takes_the_errors_passed_to_it_over_the_store():
    # model_errors: for a profile the store cannot match (a stored one with its link terms
    # corrected); "auto" then applies the rule with them
    topo, module = _topo(16), meta_ebc(16, 100000, 128)

    def plan(error):
        return SparseLiftPlanner(topology=topo, batch_size=512, debug=False, allow_lossy_comm=True, time_budget_s=2,
                                 model_errors=TermErrors({}, error, "given")).plan_with_result(
            module, get_default_sharders())

    lossy, kept = plan(0.0), plan(5.0)
    assert lossy.never_slower.applied and lossy.search.fwd_precision != "fp32"
    assert not kept.never_slower.leave and kept.search.fwd_precision == "fp32"
    assert kept.never_slower.error_source == "given"
    with pytest.raises(ValueError, match="model_errors must be a TermErrors"):
        SparseLiftPlanner(topology=topo, batch_size=512, model_errors={"a": 0.1})


def _link(**kw):
    from torchrec_sparselift.calibration.link import LinkRates

    base = dict(intra_bw=None, intra_latency_s=None, inter_bw=40e6, inter_latency_s=700e-6, spread=0.18,
                allreduce_bw=118e6, allreduce_latency_s=5e-3, latency_spread_s=2e-3, hosts=2, ranks_per_host=1)
    base.update(kw)
    return LinkRates(**base)


def test_corrected_link_terms_carry_at_least_the_link_measurements_spread():
    from types import SimpleNamespace

    fit = TermErrors({"1/a2a_bw": 0.05, "1/allreduce_bw": 0.30, "collective_latency_s": 0.1, "1/dense_flops": 0.04},
                     0.08, "the step fit")
    corr = SimpleNamespace(changed=(("inter_host_bw", 2.3e9, 88e6), ("allreduce_bw", 7e8, 1.1e8),
                                    ("collective_latency_s", 9e-4, 1.25e-3), ("inter_reduce_scatter_factor", 2.8, 1.07),
                                    ("hbm_bw", 1e10, 5e9)))
    out = term_error.with_link_errors(fit, corr, _link())
    assert out.of("1/a2a_bw") == pytest.approx(0.18)  # the measurement's spread over the fit's 5%
    assert out.of("1/allreduce_bw") == pytest.approx(0.30)  # the fit's was larger already
    assert out.of("collective_latency_s") == 0.1  # the latency fits' wander is absolute: the fit's error
    assert out.of("reduce_scatter_factor") == pytest.approx(0.18)
    assert out.of("1/dense_flops") == 0.04 and out.default == 0.08  # compute terms as fitted
    assert "at least its measured spread: 1/a2a_bw 18%" in out.source and out.source.startswith("the step fit")
    # nothing corrected, or a correction within the fit's errors: the same errors
    assert term_error.with_link_errors(fit, SimpleNamespace(changed=()), _link()) is fit
    quiet = term_error.with_link_errors(fit, corr, _link(spread=0.01, latency_spread_s=1e-6))
    assert quiet.of("1/a2a_bw") == 0.05 and quiet is fit


def test_a_stored_profile_on_the_jobs_link_is_corrected_with_its_errors_in_one_place(monkeypatch):
    """profile_on_link: what hardware="auto", the DLRM example and the benchmarks plan with."""
    prof = attrs.evolve(get_profile("cpu-gloo"), name="stored")
    fit = TermErrors({"1/a2a_bw": 0.05}, 0.08, "the step fit")
    seen = []
    monkeypatch.setattr(term_error, "profile_errors", lambda p, path, store=None: seen.append(path) or fit)
    # no link record: the stored profile as it is, its fit's errors, a note saying the link is unknown
    unknown = term_error.profile_on_link(prof, None, _link(), "/p.json")
    assert unknown.profile is prof and unknown.correction is None and not unknown.corrected
    assert unknown.errors is fit and "no link record" in unknown.note and "/p.json" in unknown.note
    # the same link: nothing corrected, nothing to say
    same = term_error.profile_on_link(prof, _link(spread=0.01), _link(spread=0.01), "/p.json")
    assert same.profile == prof and not same.corrected and same.note is None and same.errors is fit
    # a slower inter-host link: corrected, the corrected all-to-all term at least the link's spread
    slow = term_error.profile_on_link(prof, _link(inter_bw=400e6, spread=0.01), _link(inter_bw=40e6, spread=0.3),
                                      "/p.json")
    assert slow.corrected and slow.profile.name == "stored+link"
    assert slow.profile.inter_host_bw < prof.inter_host_bw
    assert slow.errors.of("1/a2a_bw") == pytest.approx(0.3) and slow.errors.default == 0.08
    assert slow.note == slow.correction.describe("/p.json")
    assert seen == ["/p.json"] * 3  # the errors of the stored profile it came from
    # an unfitted stored profile keeps its assumed errors: the rule skips them anyway
    assumed = uncalibrated_errors("stored")
    monkeypatch.setattr(term_error, "profile_errors", lambda p, path, store=None: assumed)
    assert term_error.profile_on_link(prof, _link(inter_bw=400e6, spread=0.01), _link(spread=0.3),
                                      "/p.json").errors is assumed


def test_planner_on_another_link_prices_the_rule_with_the_links_spread(monkeypatch):
    """hardware="auto" corrected to this job's link: the rule's error of the corrected link terms
    is at least the link measurement's spread (here 10x the fit's), which keeps TorchRec's plan at
    fp32 where the fit's error alone would take the lossy comms' gain."""
    prof = attrs.evolve(get_profile("cpu-gloo"), name="stored")
    stored_link = _link(inter_bw=200e6, spread=0.01)
    monkeypatch.setattr(planner_module, "auto_profile_link", lambda *a, **k: (prof, "/stored.json", stored_link))
    monkeypatch.setattr(term_error, "profile_errors", lambda *a, **k: TermErrors({}, 0.02, "a step fit"))
    topo, module = _topo(16), meta_ebc(16, 100000, 128)

    def plan(spread):
        planner = SparseLiftPlanner(topology=topo, batch_size=512, debug=False, hardware="auto",
                                    allow_lossy_comm=True, time_budget_s=2)
        return plan_result(planner.request(module, get_default_sharders(), on_link=planner.on_link(_link(spread=spread))))

    tight, spread = plan(0.01), plan(5.0)
    # at 2% per term the lossy comms' gain over fp32 clears the rule (SparseLift's plan runs them
    # under fused, which across hosts on CPU issues the output all-to-all before the forward), with
    # the corrected a2a term at 500% it does not
    assert tight.never_slower.leave or tight.never_slower.baseline == "torchrec+fp16/fp16"
    assert (tight.search.fwd_precision, tight.search.bwd_precision) == ("fp16", "fp16")
    assert not spread.never_slower.leave and spread.never_slower.baseline == "torchrec"
    assert (spread.search.fwd_precision, spread.search.bwd_precision) == ("fp32", "fp32")
    assert "measured spread: 1/a2a_bw 500%" in spread.never_slower.error_source


def test_kept_plan_pipeline_takes_the_fastest_pipeline_that_clears_the_rule():
    # one plan under two pipelines: a term's error is common to both, so its margin is e * |difference|
    base = _times({"a2a": 0.010, "lat": 0.004, FIXED_TERM: 0.020})  # TorchRec's plan, its default pipeline
    fused = _times({"a2a": 0.007, "lat": 0.002, FIXED_TERM: 0.020})  # 5 ms faster; margin 0.1 * (3 + 2) ms
    slower = _times({"a2a": 0.010, "lat": 0.004, FIXED_TERM: 0.021})
    close = _times({"a2a": 0.0095, "lat": 0.004, FIXED_TERM: 0.020})  # 0.5 ms faster; margin 3 * 0.5 ms
    errs = TermErrors({"a2a": 0.1, "lat": 0.1}, 0.1)
    name, d = kept_plan_pipeline(base, {"fused": fused, "prefetch": slower, "base": close}, errs)
    assert name == "fused" and d.leave and d.candidate_pipeline == "fused" and d.baseline == "torchrec"
    assert d.gain_s == pytest.approx(0.005) and d.margin_s == pytest.approx(0.0005)
    assert all(x.same_plan for x in d.differing)
    text = d.describe()
    assert "TorchRec's plan under fused kept" in text and "TorchRec's plan under its default pipeline" in text
    assert decision_from_dict(json.loads(json.dumps(d.to_dict()))) == d
    wide = TermErrors({"a2a": 3.0, "lat": 0.1}, 0.1)
    assert kept_plan_pipeline(base, {"base": close, "prefetch": slower}, wide) is None  # within the error
    assert kept_plan_pipeline(base, {}, errs) is None
    # the fastest that clears: a faster pipeline whose gain is within its (larger) margin is passed over
    fast = _times({"a2a": 0.005, "lat": 0.002, "x": 0.001, FIXED_TERM: 0.020})  # 6 ms faster; margin 0.7 + 6 ms
    name, d = kept_plan_pipeline(base, {"fast": fast, "fused": fused}, TermErrors({"a2a": 0.1, "lat": 0.1, "x": 6.0}, 0.1),
                                 label="torchrec+fp16/fp16")
    assert name == "fused" and d.baseline == "torchrec+fp16/fp16" and "with fp16/fp16 comms" in d.describe()


def test_kept_plan_pipeline_weighs_each_pipeline_with_its_rewrites():
    """A pipeline with the rewrites chosen on it is a setting of its own (the split needs overlap);
    where the default pipeline with its rewrites clears the rule, another setting must beat it."""
    from torchrec_sparselift.plan.baseline import REWRITE_TERM, with_rewrite_term

    errs = TermErrors({"a2a": 0.1}, 0.1)
    base = _times({"a2a": 0.010, FIXED_TERM: 0.020})  # TorchRec's plan under sparse_dist
    fused = _times({"a2a": 0.008, FIXED_TERM: 0.020})  # 2 ms faster
    overlap = _times({"a2a": 0.011, FIXED_TERM: 0.020})  # slower unsplit ...
    split, rw_errs = with_rewrite_term(overlap, 0.005, errs)  # ... and 4 ms faster than base split
    name, d = kept_plan_pipeline(base, {"fused": fused, "overlap": overlap}, rw_errs, rewritten={"overlap": split},
                                 default="sparse_dist")
    assert name == "overlap" and d.with_rewrites and d.candidate_s == pytest.approx(0.026)
    assert "TorchRec's plan under overlap with its rewrites kept" in d.describe()
    assert REWRITE_TERM in [t.term for t in d.differing]
    # without the rewrites' setting: fused, as before
    name, d = kept_plan_pipeline(base, {"fused": fused, "overlap": overlap}, errs)
    assert name == "fused" and not d.with_rewrites
    # the rewrites' saving within its error (100%): the split does not clear, fused does
    doubt = attrs.evolve(rw_errs, errors={**rw_errs.errors, REWRITE_TERM: 2.0})
    assert kept_plan_pipeline(base, {"fused": fused, "overlap": overlap}, doubt,
                              rewritten={"overlap": split})[0] == "fused"
    # the default pipeline with the same rewrites is as fast: no other pipeline is kept for them
    own, _ = with_rewrite_term(base, 0.001, errs)
    same, _ = with_rewrite_term(_times({"a2a": 0.010, FIXED_TERM: 0.020}), 0.001, errs)
    assert kept_plan_pipeline(base, {"base": base}, rw_errs, rewritten={"base": same, "sparse_dist": own},
                              default="sparse_dist") is None
    assert kept_plan_pipeline(base, {"base": base}, rw_errs, rewritten={"base": same})[0] == "base"


def test_one_plan_under_two_settings_is_judged_on_the_difference_of_each_term():
    """Between two plans a differing term's margin is e * max(t); within one plan (two pipelines,
    or two comm precisions) the term's error moves both sides alike: e * |difference|. A term only
    one side has (a pipeline's measured factor) enters whole either way."""
    base = _times({"a2a": 0.040, FIXED_TERM: 0.020})
    cand = _times({"a2a": 0.038, "pipeline fused": 0.001, FIXED_TERM: 0.020})
    errs = TermErrors({"a2a": 0.2, "pipeline fused": 0.5}, 0.1)
    two_plans = never_slower(cand, base, errs)
    one_plan = never_slower(cand, base, errs, same_plan=True)
    assert two_plans.margin_s == pytest.approx(0.2 * 0.040 + 0.5 * 0.001) and not two_plans.leave
    assert one_plan.margin_s == pytest.approx(0.2 * 0.002 + 0.5 * 0.001) and one_plan.leave
    assert decision_from_dict(json.loads(json.dumps(one_plan.to_dict()))) == one_plan
    # the lossy comms alone (TorchRec's plan with fp16 against it at fp32) are one plan too
    theirs = {("fp32", "fp32"): _times({"1/a2a_bw": 0.100, "codec": 0.000, FIXED_TERM: 0.10}),
              ("fp16", "fp16"): _times({"1/a2a_bw": 0.050, "codec": 0.035, FIXED_TERM: 0.10})}
    at = lambda f, b: theirs[(f, b)]  # noqa: E731
    same = _times({"1/a2a_bw": 0.050, "codec": 0.035, FIXED_TERM: 0.10})  # SparseLift's = TorchRec's with fp16
    d, kept = never_slower_with_precision(same, at, ("fp16", "fp16"), ("fp32", "fp32"), TermErrors({}, 0.1, "t"))
    assert not d.leave and kept == ("fp16", "fp16")  # TorchRec's plan, with the lossy comms
    # they pay: gain 15 ms against 0.1 * (50 + 35) ms = 8.5 ms (two plans' margin would be 13.5 ms)
    comms = never_slower(theirs[("fp16", "fp16")], theirs[("fp32", "fp32")], TermErrors({}, 0.1), same_plan=True)
    assert comms.leave and comms.margin_s == pytest.approx(0.0085)
    assert never_slower(theirs[("fp16", "fp16")], theirs[("fp32", "fp32")], TermErrors({}, 0.1)).margin_s == \
        pytest.approx(0.0135)


def _sparselift_plan_fails_the_rule(monkeypatch) -> None:
    """Make SparseLift's own plan fail the rule (the planner imports the rule by name)."""
    def within_error(candidate, baseline_at, precision, full, errors):
        return BaselineDecision(leave=False, candidate_s=0.0, baseline_s=0.0), tuple(full)

    monkeypatch.setattr(planning, "never_slower_with_precision", within_error)


def test_where_torchrecs_plan_is_kept_it_runs_under_a_pipeline_that_clears_the_rule(monkeypatch):
    """Across hosts on CPU, TorchRec's fused issues the output all-to-all before the forward
    (docs/overlap.md section 9). Where SparseLift's plan does not clear the rule (here: made so),
    TorchRec's sharding is kept, under fused where that alone clears the rule against TorchRec's
    default pipeline, else under sparse_dist."""
    _sparselift_plan_fails_the_rule(monkeypatch)
    topo = Topology(world_size=4, local_world_size=2, compute_device="cpu")
    module = meta_ebc(8, 200000, 64)
    theirs = torchrec_plan(module, get_default_sharders(), topo, 512)

    def plan(error):
        planner = SparseLiftPlanner(topology=topo, batch_size=512, debug=False, hardware="cpu-gloo",
                                    never_slower=True, model_errors=TermErrors({}, error, "a test"), time_budget_s=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return planner.plan_with_result(module, get_default_sharders())

    res = plan(0.01)
    assert sharding_plan_digest(res.sharding_plan) == sharding_plan_digest(theirs.plan)
    assert res.search.pipeline == "fused" and res.search.solver == "torchrec(never_slower)"
    d = res.never_slower
    assert d.leave and d.candidate_pipeline == "fused" and d.gain_s > d.margin_s > 0.0
    assert "TorchRec's plan under fused with its rewrites kept" in d.describe()  # its int32 ids
    assert d.with_rewrites and res.rewrites.id_dtype == "int32" and res.rewrites.saving_s > 0
    assert res.rewritten_step_s == pytest.approx(d.candidate_s, rel=1e-6)  # priced under fused, with its rewrites
    assert d.gain_s == pytest.approx(plan(5.0).search.step.total_s - d.candidate_s, rel=1e-6)
    # with the error at 500% the pipeline's gain is within it: TorchRec's default pipeline
    from torchrec_sparselift.plan import planning

    settings = []
    real = planning.evaluate_given

    def counted(given, plan_, hardware, pipeline, fwd, bwd):  # type: ignore[no-untyped-def]
        settings.append((pipeline, fwd, bwd))
        return real(given, plan_, hardware, pipeline, fwd, bwd)

    monkeypatch.setattr(planning, "evaluate_given", counted)
    big = plan(5.0)
    assert sharding_plan_digest(big.sharding_plan) == sharding_plan_digest(theirs.plan)
    assert big.search.pipeline == "sparse_dist" and not big.never_slower.candidate_pipeline
    # TorchRec's plan is evaluated once per setting: the plan kept shares the evaluation weighed
    assert ("sparse_dist", "fp32", "fp32") in settings and len(settings) == len(set(settings))


def test_where_torchrecs_plan_is_kept_it_can_run_under_overlap_with_the_batch_split(monkeypatch):
    """TorchRec's sharding reaches the batch split only under ``overlap``: where overlap alone is
    priced slower than fused but overlap with the split chosen on it is faster, the rule weighs the
    pipeline with its rewrites (the split's saving a term of its own) and keeps TorchRec's
    sharding under overlap, split."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM

    from torchrec_sparselift.plan.baseline import REWRITE_TERM
    from torchrec_sparselift.plan.evaluate import evaluate_sharding_plan

    _sparselift_plan_fails_the_rule(monkeypatch)
    p = get_profile("cpu-gloo")
    prof = attrs.evolve(p, inter_host_bw=p.inter_host_bw / 2, chunk_overhead_s=2e-4, link_latency_s=2e-4)
    topo = Topology(world_size=2, local_world_size=1, compute_device="cpu")
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=32, num_embeddings=100_000, feature_names=[f"f{i}"])
              for i in range(12)]
    module = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                  dense_in_features=13, dense_arch_layer_sizes=[256, 32], over_arch_layer_sizes=[256, 1])
    theirs = torchrec_plan(module, get_default_sharders(), topo, 256)

    def plan(errors):
        planner = SparseLiftPlanner(topology=topo, batch_size=256, debug=False, hardware=prof, never_slower=True,
                                    model_errors=errors, per_sample=True, time_budget_s=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return planner.plan_with_result(module, get_default_sharders())

    def step(pipeline):
        return evaluate_sharding_plan(module, theirs.plan, topo, 256, hardware=prof, pipeline=pipeline).step_time_s

    res = plan(TermErrors({}, 0.05, "a test"))
    d, r = res.never_slower, res.rewrites
    assert sharding_plan_digest(res.sharding_plan) == sharding_plan_digest(theirs.plan)
    assert res.search.pipeline == "overlap" and r.batch_split > 1 and d.candidate_pipeline == "overlap"
    assert d.with_rewrites and "TorchRec's plan under overlap with its rewrites kept" in d.describe()
    assert REWRITE_TERM in [t.term for t in d.differing] and d.gain_s > d.margin_s
    # overlap alone is priced slower than fused; with the split it is faster (what the old rule missed)
    assert step("overlap") > step("fused") > res.rewritten_step_s
    assert res.rewritten_step_s == pytest.approx(d.candidate_s, rel=1e-6)
    # the rewrites' saving enters the margin at its error (one plan: error x the saving)
    rw = next(t for t in d.differing if t.term == REWRITE_TERM)
    assert rw.candidate_s == pytest.approx(r.saving_s) and rw.margin_s == pytest.approx(rw.error * r.saving_s)
    # every setting's gain within the error: TorchRec's plan under its default pipeline, no split
    doubt = plan(TermErrors({}, 5.0, "a test"))
    assert doubt.search.pipeline == "sparse_dist" and doubt.rewrites.batch_split == 1
    assert not doubt.never_slower.leave and not doubt.never_slower.with_rewrites


def test_same_sharding_price_is_true_only_where_torchrecs_sharding_is_no_slower():
    ours = _times({"a2a": 0.010, FIXED_TERM: 0.020})
    assert same_sharding_price(ours, _times({"a2a": 0.010, FIXED_TERM: 0.020}))  # a relabeling
    assert same_sharding_price(ours, _times({"a2a": 0.009, FIXED_TERM: 0.020}))  # TorchRec's is faster
    assert same_sharding_price(ours, TermTimes(total_s=0.030 * (1 + 1e-12), terms={}))  # float rounding
    assert not same_sharding_price(ours, _times({"a2a": 0.0101, FIXED_TERM: 0.020}))  # the sharding gains
    d = BaselineDecision(leave=True, candidate_s=0.03, baseline_s=0.04, margin_s=0.001,
                         candidate_pipeline="fused", baseline_sharding=True)
    assert decision_from_dict(json.loads(json.dumps(d.to_dict()))) == d
    assert "TorchRec's plan under fused kept: SparseLift's plan cleared the rule" in d.describe()


def test_a_plan_whose_gain_is_all_in_its_pipeline_hands_back_torchrecs_sharding():
    """Eight tables on 2 hosts x 2 ranks: SparseLift's plan clears the rule by its pipeline (fused
    across hosts), and TorchRec's sharding is priced the same under it, so the planner hands back
    TorchRec's sharding under that pipeline (no table moves for a gain the model does not
    predict); where its sharding gains under its own pipeline too, SparseLift's plan stays."""
    topo = Topology(world_size=4, local_world_size=2, compute_device="cpu")
    module = meta_ebc(8, 200000, 64)
    theirs = torchrec_plan(module, get_default_sharders(), topo, 512)
    planner = SparseLiftPlanner(topology=topo, batch_size=512, debug=False, hardware="cpu-gloo",
                                never_slower=True, model_errors=TermErrors({}, 0.01, "a test"), time_budget_s=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = planner.plan_with_result(module, get_default_sharders())
    d = res.never_slower
    assert d.leave and d.baseline_sharding and d.candidate_pipeline == res.search.pipeline != "sparse_dist"
    assert sharding_plan_digest(res.sharding_plan) == sharding_plan_digest(theirs.plan)
    assert res.search.solver == "torchrec(never_slower)" and len(res.sharding_options) == 8
    assert res.rewritten_step_s <= d.candidate_s * (1 + 1e-9)  # no slower than SparseLift's own plan
    assert "TorchRec's sharding is priced no slower" in d.describe()
    # small tables at batch 4096: SparseLift's sharding gains under its own pipeline too, so it stays
    small = SparseLiftPlanner(topology=topo, batch_size=4096, debug=False, hardware="cpu-gloo", never_slower=True,
                              model_errors=TermErrors({}, 0.01, "a test"), time_budget_s=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = small.plan_with_result(meta_ebc(16, 100, 64), get_default_sharders())
    assert other.never_slower.leave and not other.never_slower.baseline_sharding
    assert not other.never_slower.candidate_pipeline and other.search.solver != "torchrec(never_slower)"
    assert sharding_plan_digest(other.sharding_plan) != sharding_plan_digest(
        torchrec_plan(meta_ebc(16, 100, 64), get_default_sharders(), topo, 4096).plan)


def test_torchrecs_sharding_is_handed_back_only_under_a_pipeline_that_trains_it(monkeypatch):
    """A pinned stale pipeline (``semi_sync``) cannot train TorchRec's data-parallel tables (dense
    kernel): even priced the same (forced here), TorchRec's sharding is not handed back under it."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    monkeypatch.setattr(planning, "same_sharding_price", lambda *a, **k: True)
    rows = [3, 4, 10, 20, 100, 1000, 100000, 200000]  # TorchRec makes the five smallest data-parallel
    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=r,
                                                               feature_names=[f"f{i}"]) for i, r in enumerate(rows)],
                                    device=torch.device("meta"))
    topo = Topology(world_size=2, local_world_size=1, compute_device="cpu")
    theirs = torchrec_plan(module, get_default_sharders(), topo, 512)
    assert any(o.compute_kernel == "dense" for o in theirs.options)
    planner = SparseLiftPlanner(topology=topo, batch_size=512, debug=False, hardware="cpu-gloo", never_slower=True,
                                model_errors=TermErrors({}, 0.0, "a test"), pipelines=("semi_sync",),
                                allow_staleness=True, time_budget_s=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = planner.plan_with_result(module, get_default_sharders())
    d = res.never_slower
    assert d.applied and not d.baseline_sharding
    assert res.search.pipeline == "semi_sync"
    assert not any(getattr(o, "compute_kernel", None) == "dense" for o in res.sharding_options)
