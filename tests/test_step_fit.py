"""The step-level profile fit recovers known coefficients; profiles are keyed by machine."""

import attrs
import numpy as np
import pytest

from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.calibration.step_fit import (
    CPU_STEP_TERMS,
    STEP_MODEL_VERSION,
    FitCase,
    FitRecord,
    StepFitInfo,
    fit_step_profile,
    fit_terms,
    linearize,
    term_value,
    with_terms,
)
from torchrec_sparselift.calibration.store import MachineFingerprint, ProfileStore

TRUE = {
    "1/lookup_bw": 1 / 20e9,
    "lookup_overhead_s": 300e-6,
    "1/a2a_bw": 1 / 2e9,
    "collective_latency_s": 250e-6,
    "1/allreduce_bw": 1 / 1e9,
    "1/dense_flops": 1 / 25e9,
    "step_overhead_s": 4e-3,
    "feature_overhead_s": 120e-6,
    "table_overhead_s": 80e-6,
    "dp_table_overhead_s": 1.5e-3,
    "1/dense_update_bw": 1 / 5e9,
    "bucketize_id_s": 20e-9,
    "1/interaction_flops": 1 / 8e9,
    "1/dense_mem_bw": 1 / 3e9,
    "bwd_row_s": 0.6e-6,
    "reduce_scatter_factor": 3.0,
    "cold_row_s": 70e-9,
}
# plausible magnitudes of each term's quantity in one step (bytes, calls, features, ...)
MAGNITUDE = {
    "1/lookup_bw": 2e7, "lookup_overhead_s": 4, "1/a2a_bw": 2e6, "collective_latency_s": 6,
    "1/allreduce_bw": 1e6, "1/dense_flops": 2e8, "step_overhead_s": 1, "feature_overhead_s": 20,
    "table_overhead_s": 10, "dp_table_overhead_s": 10, "1/dense_update_bw": 1e7, "bucketize_id_s": 5e4,
    "1/interaction_flops": 5e7, "1/dense_mem_bw": 1e7, "bwd_row_s": 5e3,
    "reduce_scatter_factor": 2e-3, "cold_row_s": 5e3,
}


def _records(n, rng, noise=0.0):
    recs = []
    for i in range(n):
        q = {k: float(MAGNITUDE[k] * rng.uniform(0, 2)) for k in TRUE}
        q["step_overhead_s"] = 1.0
        fixed = float(rng.uniform(0, 2e-3))
        m = fixed + sum(q[k] * TRUE[k] for k in TRUE)
        recs.append(FitRecord(label=f"plan{i}", quantities=q, fixed_s=fixed, measured_s=m * (1 + noise * rng.normal())))
    return recs


def test_fit_terms_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    recs = _records(40, rng)
    prior = {k: 0.0 for k in TRUE}  # no prior: the data alone decide
    fit = fit_terms(recs, prior)
    for k, v in TRUE.items():
        assert fit.values[k] == pytest.approx(v, rel=1e-6), k
    assert fit.mape < 1e-9
    assert set(fit.determined) == set(TRUE)


def test_fit_terms_with_noise_and_prior_stays_close():
    rng = np.random.default_rng(1)
    recs = _records(200, rng, noise=0.01)  # 16 terms: 200 records recover the big four within 15% on 11 of 12 seeds (17% on one)
    prior = {k: v * 3 for k, v in TRUE.items()}  # a wrong prior is overruled by the data
    fit = fit_terms(recs, prior)
    big = ["1/lookup_bw", "step_overhead_s", "dp_table_overhead_s", "1/dense_flops"]
    for k in big:
        assert fit.values[k] == pytest.approx(TRUE[k], rel=0.15), k
    assert fit.mape < 0.03


def test_term_no_record_depends_on_keeps_its_prior():
    rng = np.random.default_rng(2)
    recs = [attrs.evolve(r, quantities={**r.quantities, "bucketize_id_s": 0.0}) for r in _records(30, rng)]
    prior = {k: 0.0 for k in TRUE}
    prior["bucketize_id_s"] = 7e-9
    fit = fit_terms(recs, prior)
    assert fit.values["bucketize_id_s"] == 7e-9
    assert "bucketize_id_s" not in fit.determined


def test_fit_profile_recovers_a_piecewise_linear_model():
    """A max-over-ranks model (the shape of the real one): linearize + refit finds the truth."""
    base = PRESETS["cpu-gloo"]
    truth = with_terms(base, TRUE, CPU_STEP_TERMS)
    rng = np.random.default_rng(3)
    cases = []
    for i in range(40):
        ranks = [{k: float(MAGNITUDE[k] * rng.uniform(0, 2)) for k in TRUE} for _ in range(2)]

        def predict(p, ranks=ranks):
            v = [sum(q[t.name] * term_value(p, t) for t in CPU_STEP_TERMS) for q in ranks]
            return max(v) + 1e-3

        cases.append(FitCase(f"plan{i}", predict(truth), predict))
    fitted, fit = fit_step_profile(cases, base, CPU_STEP_TERMS, iterations=6, prior_weight=1e-6)
    assert fit.mape < 0.01
    for k in ("1/lookup_bw", "step_overhead_s", "dp_table_overhead_s"):
        t = next(t for t in CPU_STEP_TERMS if t.name == k)
        assert term_value(fitted, t) == pytest.approx(TRUE[k], rel=0.1), k


def test_linearize_is_exact_for_a_linear_prediction():
    p = PRESETS["cpu-gloo"]

    def predict(prof):
        return 2e-3 + 5.0 * prof.step_overhead_s + 1e7 / prof.hbm_bw

    base, q, fixed = linearize(predict, p, CPU_STEP_TERMS)
    assert q["step_overhead_s"] == pytest.approx(5.0)
    assert q["1/lookup_bw"] == pytest.approx(1e7, rel=1e-6)
    assert fixed == pytest.approx(2e-3, abs=1e-9)
    assert base == pytest.approx(predict(p))


def _fp(**kw):
    d = dict(device="cpu", processor="Test CPU", cores=2, devices=0, backend="gloo", ranks=2,
             torch="2.0", fbgemm_gpu="1.0", torchrec="1.0")
    d.update(kw)
    return MachineFingerprint(**d)


def test_profile_store_matches_by_fingerprint_and_names_differences(tmp_path):
    store = ProfileStore(str(tmp_path))
    assert store.lookup(_fp()) == (None, [])
    prof = attrs.evolve(PRESETS["cpu-gloo"], name="fitted", step_overhead_s=3e-3)
    store.save(prof, _fp(), info={"mape": 0.05})
    s, diff = store.lookup(_fp())
    assert diff == [] and s.profile == prof and s.info["mape"] == 0.05
    s, diff = store.lookup(_fp(cores=8, torch="2.1"))
    assert s.profile == prof
    assert diff == ["cores: 8 vs 2", "torch: 2.1 vs 2.0"]
    assert store.lookup(_fp(device="cuda")) == (None, [])


# --- identifiability of the probe set itself (measure/probe.py PROBE_WORKLOADS x PLAN_KINDS) ---

# a machine where per-table work is cheap and each collective dear (what the held-out kaggle plan
# showed), far from the base profile the fit starts from
PROBE_TRUTH = {
    "table_overhead_s": 60e-6,
    "collective_latency_s": 900e-6,
    "dp_table_overhead_s": 150e-6,
    "step_overhead_s": 6e-3,
    "lookup_overhead_s": 500e-6,
    "feature_overhead_s": 30e-6,
}
_SEPARATED = ("table_overhead_s", "collective_latency_s", "step_overhead_s", "lookup_overhead_s")


@pytest.fixture(scope="module")
def probe_pricers():
    """(kind, label, PlanPricer) of every probe plan, placed without a process group."""
    pytest.importorskip("torchrec")
    import warnings

    from torchrec_sparselift.calibration.pricer import PlanPricer
    from torchrec_sparselift.calibration.store import base_profile
    from torchrec_sparselift.measure import probe
    from torchrec_sparselift.measure.steps import forced_plan, probe_topology

    warnings.filterwarnings("ignore")
    topo = probe_topology(2, "cpu")
    base = base_profile("cpu")
    out = []
    for w in probe.PROBE_WORKLOADS:
        for kind in w.kinds():
            plan, cons = forced_plan(probe.probe_model(w), w.tables, kind, topo, w.batch_size, None, base)
            out.append((kind, f"{w.name}/{kind}", PlanPricer(probe.probe_model(w), plan, topo, w.batch_size, cons)))
    return base, out


def _min_singular(pricers, profile, names):
    """Smallest singular value of the probes' relative design matrix (columns normalized) over
    the terms ``names``: 0 when some combination of them is invisible to every probe plan."""
    rows = []
    for _k, _l, pr in pricers:
        b, q, _f = linearize(pr, profile, CPU_STEP_TERMS)
        rows.append([q[n] / b for n in names])
    A = np.array(rows)
    A = A / np.linalg.norm(A, axis=0)
    return float(np.linalg.svd(A, compute_uv=False)[-1])


def test_probe_plans_recover_per_table_per_collective_and_data_parallel_costs(probe_pricers):
    """Synthetic measurements of the real probe plans (priced by the cost model at a known
    profile): the step fit recovers the per-table, per-collective, per-data-parallel-table,
    per-step and per-lookup costs from the base profile's far-off values."""
    base, pricers = probe_pricers
    truth = with_terms(base, PROBE_TRUTH, CPU_STEP_TERMS)
    cases = [FitCase(label, pr(truth), pr) for _k, label, pr in pricers]
    fitted, fit = fit_step_profile(cases, base, CPU_STEP_TERMS, iterations=3, prior_weight=1e-8)
    assert fit.mape < 0.005
    for k, v in PROBE_TRUTH.items():
        t = next(t for t in CPU_STEP_TERMS if t.name == k)
        assert term_value(fitted, t) == pytest.approx(v, rel=0.05), (k, term_value(fitted, t))


def test_new_probe_kinds_span_the_per_collective_direction(probe_pricers):
    """``two_groups`` (the table-wise shards in two sharding groups) and ``dp_small`` are what
    separates per-collective from per-table / per-step / per-lookup cost: without them the
    probe set is close to blind along a combination of those terms."""
    base, pricers = probe_pricers
    old = [p for p in pricers if p[0] not in ("two_groups", "dp_small")]
    names = _SEPARATED + ("dp_table_overhead_s", "feature_overhead_s")
    s_old = _min_singular(old, base, names)
    s_new = _min_singular(pricers, base, names)
    # over _SEPARATED alone: 0.158 -> 0.249 when written; 0.181 -> 0.196 once data-parallel tables
    # also paid the per-table TBE work; 0.209 -> 0.204 once the input paid two latencies per group
    # plus the shared splits call (the old kinds' mixed plan, two groups, then separates the
    # latency by itself). With the data-parallel per-table and per-feature terms: 0.086 -> 0.168.
    assert s_new > 1.5 * s_old, (s_old, s_new)
    # two_groups differs from table-wise in the collectives only: priced with no collective
    # latency the two plans of a workload cost the same (placement aside, within 2%: probe_large's
    # four tables of 0.5-51 MB place differently in two groups, 1.5% apart)
    free = attrs.evolve(base, collective_latency_s=0.0)
    by = {label: pr for _k, label, pr in pricers}
    for label, pr in by.items():
        if label.endswith("/two_groups"):
            tw = by[label.replace("/two_groups", "/table_wise")]
            assert pr(free) == pytest.approx(tw(free), rel=0.02), label
            assert pr(base) > tw(base) + base.collective_latency_s


def test_floors_bound_a_term_from_below_and_keep_an_identified_value():
    rng = np.random.default_rng(3)
    recs = _records(40, rng)
    prior = {k: 0.0 for k in TRUE}
    # a floor below the true value changes nothing; one above it is where the fit stops
    low = fit_terms(recs, prior, floors={"dp_table_overhead_s": 0.5e-3})
    assert low.values["dp_table_overhead_s"] == pytest.approx(TRUE["dp_table_overhead_s"], rel=1e-6)
    assert low.mape < 1e-9
    high = fit_terms(recs, prior, floors={"dp_table_overhead_s": 3e-3})
    assert high.values["dp_table_overhead_s"] >= 3e-3 - 1e-15
    assert high.mape > 1e-6  # the data disagree with the floor: the error shows it
    # predictions in the residuals are those of the returned values (the shift is undone)
    for (label, _k, pred, meas), r in zip(high.residuals, recs):
        assert pred == pytest.approx(r.fixed_s + sum(r.quantities[n] * high.values[n] for n in TRUE), rel=1e-9)


def test_fit_profile_takes_group_cases_and_judges_on_the_steps():
    """Cases with a kind and a weight (attributed parts of a step) join the fit; the reported
    error is over the whole-step cases only."""
    base = PRESETS["cpu-gloo"]
    terms = [t for t in CPU_STEP_TERMS if t.name in ("1/lookup_bw", "step_overhead_s")]
    true = with_terms(base, {"1/lookup_bw": 1 / 10e9, "step_overhead_s": 2e-3}, terms)

    def lookup(p):
        return 3e7 / p.hbm_bw

    def rest(p):
        return p.step_overhead_s + 1e-3

    cases = []
    for i, k in enumerate((1.0, 2.0, 3.0)):
        step = (lambda p, k=k: k * lookup(p) + rest(p))
        cases.append(FitCase(f"p{i}", step(true), step))
        cases.append(FitCase(f"p{i}:sparse", k * lookup(true), (lambda p, k=k: k * lookup(p)), "sparse", 0.5))
    fitted, fit = fit_step_profile(cases, base, terms, prior_weight=1e-9)
    assert fitted.hbm_bw == pytest.approx(10e9, rel=1e-4)
    assert fitted.step_overhead_s == pytest.approx(2e-3, rel=1e-3)
    assert [r[1] for r in fit.residuals] == ["step"] * 3


def _check(store_dir):
    from torchrec_sparselift.measure.commands import main

    return main(["check", "--store", str(store_dir)])


def test_a_profile_fitted_before_the_current_terms_is_stale(tmp_path, monkeypatch):
    """A stored step fit that lacks a current term (an older cost model's) makes ``calibrate check``
    fail (run_dlrm.sh recalibrates) and ``auto_profile`` warn, naming the term."""
    from torchrec_sparselift.calibration import store as st
    from torchrec_sparselift.measure import steps

    store = ProfileStore(str(tmp_path))
    for module in (st, steps):
        monkeypatch.setattr(module, "current_fingerprint", lambda device, ranks, **kw: _fp())
    monkeypatch.setenv("NPROC", "2")
    prof = attrs.evolve(PRESETS["cpu-gloo"], name="fitted")
    old_terms = {t.name: 1e-6 for t in CPU_STEP_TERMS if t.name not in ("1/dense_mem_bw", "bucketize_id_s")}
    store.save(prof, _fp(), info={"fit": {"values": old_terms},
                                  "host_terms": {"bucketize_id_s": 1e-8, "codec_byte_s": 1e-10, "chunk_overhead_s": 3e-4, "dedup_id_s": 7e-8},
                                  "model_version": STEP_MODEL_VERSION})
    assert store.lookup(_fp())[0].step_fit.missing_terms() == ["1/dense_mem_bw"]
    assert _check(tmp_path) == 1
    warned = []
    got, _where = st.auto_profile("cpu", 2, store=store, warn=warned.append)
    # the term the old fit lacks takes the base profile's value (the prior a calibration starts from)
    assert got == attrs.evolve(prof, dense_mem_bw=st.base_profile("cpu").dense_mem_bw)
    assert len(warned) == 1 and "1/dense_mem_bw" in warned[0] and "base profile's values" in warned[0]
    assert "torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate steps" in warned[0]
    store.save(prof, _fp(), info={"fit": {"values": {**old_terms, "1/dense_mem_bw": 1e-9}},
                                  "host_terms": {"bucketize_id_s": 1e-8, "codec_byte_s": 1e-10, "chunk_overhead_s": 3e-4, "dedup_id_s": 7e-8},
                                  "model_version": STEP_MODEL_VERSION})
    assert store.lookup(_fp())[0].step_fit.missing_terms() == []
    assert _check(tmp_path) == 0
    warned.clear()
    st.auto_profile("cpu", 2, store=store, warn=warned.append)
    assert warned == []
    # a calibration whose machine sped up or slowed down more than MAX_DRIFT_SPREAD is redone too
    info = {"fit": {"values": {**old_terms, "1/dense_mem_bw": 1e-9}},
            "host_terms": {"bucketize_id_s": 1e-8, "codec_byte_s": 1e-10, "chunk_overhead_s": 3e-4, "dedup_id_s": 7e-8},
            "model_version": STEP_MODEL_VERSION}
    store.save(prof, _fp(), info={**info, "drift_spread": 2.1})
    assert _check(tmp_path) == 1
    st.auto_profile("cpu", 2, store=store, warn=warned.append)
    assert len(warned) == 1 and "moved 2.10x" in warned[0]
    store.save(prof, _fp(), info={**info, "drift_spread": 1.1})
    assert _check(tmp_path) == 0


def test_a_profile_fitted_under_an_older_model_structure_is_stale_and_takes_no_feedback(tmp_path, monkeypatch):
    """A stored step fit made under another ``STEP_MODEL_VERSION`` (its terms multiplied other
    quantities, e.g. one input latency per group) makes ``calibrate check`` fail, ``auto_profile``
    warn with both structures, and guard feedback refuse to mix its records with new ones."""
    from types import SimpleNamespace

    from torchrec_sparselift.calibration import feedback
    from torchrec_sparselift.calibration import store as st
    from torchrec_sparselift.measure import steps

    store = ProfileStore(str(tmp_path))
    for module in (st, steps, feedback):
        monkeypatch.setattr(module, "current_fingerprint", lambda device, ranks, **kw: _fp())
    monkeypatch.setenv("NPROC", "2")
    topo = SimpleNamespace(compute_device="cpu", local_world_size=2)
    prof = attrs.evolve(PRESETS["cpu-gloo"], name="fitted")
    values = {t.name: 1e-6 for t in CPU_STEP_TERMS}
    store.save(prof, _fp(), info={"fit": {"values": values}, "fit_records": []})  # stored before versions
    assert store.lookup(_fp())[0].step_fit.fitted_model_version() == 1
    assert _check(tmp_path) == 1
    warned = []
    st.auto_profile("cpu", 2, store=store, warn=warned.append)
    assert len(warned) == 1 and f"structure 1 (this code prices structure {STEP_MODEL_VERSION}" in warned[0]
    rec = FitRecord(label="guard/x", quantities={"step_overhead_s": 1.0}, fixed_s=0.01, measured_s=0.02)
    assert feedback.add_feedback([rec], prof, topo, store=store) is None
    store.save(prof, _fp(), info={"fit": {"values": values}, "fit_records": [], "model_version": STEP_MODEL_VERSION})
    assert _check(tmp_path) == 0
    assert feedback.add_feedback([rec], prof, topo, store=store) is not None
    assert StepFitInfo.from_dict({"fit": {}}).fitted_model_version() is None  # a microbenchmark profile has no step fit


def test_stored_step_fit_info_round_trips_and_keeps_unknown_fields():
    rec = FitRecord(label="p", quantities={"step_overhead_s": 1.0}, fixed_s=0.01, measured_s=0.02, kind="comm",
                    weight=0.5)
    stored = {"fit": {"values": {"step_overhead_s": 1e-3}, "mape": 0.1}, "model_version": STEP_MODEL_VERSION,
              "host_terms": {"bucketize_id_s": 1e-8, "codec_byte_s": 1e-10, "chunk_overhead_s": 3e-4, "dedup_id_s": 7e-8}, "fit_records": [attrs.asdict(rec)], "drift_spread": 1.2,
              "feedback_records": 3, "created": "2000-01-01T00:00:00Z", "mape_after": 0.07}
    info = StepFitInfo.from_dict(stored)
    assert info.fit_records == (rec,) and info.drift_spread == 1.2 and info.extra["mape_after"] == 0.07
    assert info.to_dict() == stored
    assert StepFitInfo.from_dict(info.to_dict()) == info


def test_a_fingerprint_counts_the_cores_it_is_given():
    """A process pinned to one core for a whole run fingerprints the cores it could use before (the
    example passes them), so it finds the profile its calibration stored."""
    from torchrec_sparselift.calibration.store import current_fingerprint, usable_cores

    assert current_fingerprint("cpu", 2).cores == usable_cores()
    assert current_fingerprint("cpu", 2, cores=usable_cores() + 3).cores == usable_cores() + 3
    assert current_fingerprint("cpu", 2, cores=7).digest() != current_fingerprint("cpu", 2, cores=8).digest()


def test_plan_pricer_prices_each_profile_once_for_its_step_and_group_cases(probe_pricers):
    """The fit's finite differences ask one plan's step case and each of its group cases for the
    same profiles: the plan is evaluated once per profile, and the answers are a fresh pricer's."""
    import copy

    base, pricers = probe_pricers
    _k, _label, pr = pricers[0]
    pr = copy.copy(pr)
    pr.__dict__.pop("_step_by_profile", None)
    pr.__dict__.pop("_groups_by_profile", None)
    calls = []
    evaluate = pr._evaluate
    pr._evaluate = lambda profile: calls.append(profile) or evaluate(profile)
    profiles = [base] + [with_terms(base, {t.name: term_value(base, t) * 1.05 + 1e-9}, CPU_STEP_TERMS)
                         for t in CPU_STEP_TERMS]
    for p in profiles:
        total = pr(p)
        groups = pr.groups(p)
        assert sum(groups.values()) == pytest.approx(total, rel=1e-9)
        assert pr(attrs.evolve(p)) == total  # an equal profile, another object: no new evaluation
    assert len(calls) == len(set(profiles))
    fresh = copy.copy(pricers[0][2])
    fresh.__dict__.pop("_step_by_profile", None)
    assert fresh(profiles[-1]) == pr(profiles[-1])


def test_probe_plans_recover_the_cold_row_cost_apart_from_the_row_bytes(probe_pricers):
    """The per-id cost of lookups in tables beyond the cache (``cold_row_s``) is recovered from
    synthetic measurements of the real probe plans, next to the lookup bytes and the per-call and
    per-row costs; ``probe_large`` (tables of 0.5-51 MB, miss shares up to 0.98) is the probe it
    weighs most in."""
    base, pricers = probe_pricers
    truth = with_terms(base, {**PROBE_TRUTH, "cold_row_s": 120e-9, "1/lookup_bw": 1 / 20e9}, CPU_STEP_TERMS)
    cases = [FitCase(label, pr(truth), pr) for _k, label, pr in pricers]
    fitted, fit = fit_step_profile(cases, base, CPU_STEP_TERMS, iterations=3, prior_weight=1e-8)
    assert fit.mape < 0.005
    assert fitted.cold_row_s == pytest.approx(120e-9, rel=0.05)
    share = {}
    for _k, label, pr in pricers:
        b, q, _f = linearize(pr, truth, CPU_STEP_TERMS)
        share.setdefault(label.split("/")[0], []).append(q["cold_row_s"] * 120e-9 / b)
    assert max(share, key=lambda w: np.mean(share[w])) == "probe_large", share
