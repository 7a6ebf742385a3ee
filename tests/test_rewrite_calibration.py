"""The sparse-path rewrites' machine constants: ``HardwareProfile.chunk_overhead_s`` (one more batch
chunk's fixed cost) and ``dedup_id_s`` (seconds per id of the id-deduplication kernels).

The fields validate and round-trip (profile JSON, the profile store) and stay out of a profile's
record and digests while they are None; the fits recover known slopes from synthetic timings; the
measuring functions run in a quick mode; the step calibration's host terms carry them, and a
stored profile calibrated before they were measured says so.
"""

from __future__ import annotations

import json
import math
import time

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_sparselift.calibration.kernel_fit import fit_kernel_profile
from torchrec_sparselift.calibration.records import (
    ChunkRecord,
    DedupRecord,
    HostTermRecord,
    LookupRecord,
    MicrobenchRecords,
)
from torchrec_sparselift.calibration.rewrite_fit import fit_chunk_overhead, fit_dedup_id_s, fit_slope
from torchrec_sparselift.calibration.step_fit import StepFitInfo, host_fit_setup
from torchrec_sparselift.calibration.store import (
    MachineFingerprint,
    ProfileStore,
    base_profile,
    stored_profile_problems,
)
from torchrec_sparselift.cost.hardware import PRESETS, HardwareProfile, with_slower_compute
from torchrec_sparselift.errors import CalibrationError, FileFormatError
from torchrec_sparselift.files import canonical_digest
from torchrec_sparselift.measure.microbench import (
    RewriteSweep,
    _dedup_ids,
    _dedup_round_trip,
    bench_rewrite_constants,
)

FIELDS = ("chunk_overhead_s", "chunk_feature_s", "dedup_id_s", "link_latency_s")


def _fp() -> MachineFingerprint:
    return MachineFingerprint(device="cpu", processor="test cpu", cores=2, devices=0, backend="gloo", ranks=2,
                              torch="2.x", fbgemm_gpu="1.x", torchrec="1.x")


@pytest.mark.parametrize("name", FIELDS)
def test_the_fields_are_none_by_default_and_take_non_negative_finite_seconds(name):
    assert getattr(PRESETS["h100"], name) is None
    assert getattr(base_profile("cpu"), name) is None
    for ok in (0, 0.0, 3e-9, 1.5e-3):
        assert getattr(attrs.evolve(PRESETS["h100"], **{name: ok}), name) == ok
    for bad in (-1e-9, float("nan"), float("inf"), True, "1e-3"):
        with pytest.raises(ValueError, match=rf"HardwareProfile.{name} must be None \(not calibrated\) or a "
                                             "non-negative finite number") as err:
            attrs.evolve(PRESETS["h100"], **{name: bad})
        assert ("calibrate steps" if name in ("chunk_feature_s", "link_latency_s") else "calibrate kernels") \
            in str(err.value)


def test_an_uncalibrated_profile_has_the_record_and_digest_it_had_without_the_fields():
    for prof in (*PRESETS.values(), base_profile("cpu")):
        d = prof.to_dict()
        assert not set(FIELDS) & set(d)
        full = attrs.asdict(prof)
        assert d == {k: v for k, v in full.items() if k not in FIELDS}
    prof = attrs.evolve(PRESETS["h100"], chunk_overhead_s=2e-4, dedup_id_s=None)
    assert prof.to_dict()["chunk_overhead_s"] == 2e-4 and "dedup_id_s" not in prof.to_dict()
    assert canonical_digest(prof.to_dict()) != canonical_digest(PRESETS["h100"].to_dict())


@pytest.mark.parametrize("values", [(None, None, None), (2.5e-4, None, None), (None, 4e-9, None), (0.0, 0.0, 0.0),
                                    (1e-3, 7.5e-9, 3.5e-5), (1e-3, None, 2e-5)])
def test_the_fields_round_trip_through_a_profile_file_and_the_store(tmp_path, values):
    prof = attrs.evolve(base_profile("cpu"), chunk_overhead_s=values[0], dedup_id_s=values[1],
                        chunk_feature_s=values[2])
    path = tmp_path / "p.json"
    prof.save(str(path))
    assert HardwareProfile.load(str(path)) == prof
    store = ProfileStore(str(tmp_path / "store"))
    stored = store.load(store.save(prof, _fp()))
    assert stored.profile == prof
    assert HardwareProfile.from_dict(prof.to_dict()) == prof


def test_an_old_profile_without_the_fields_loads_with_none_and_a_bad_value_is_named(tmp_path):
    path = tmp_path / "p.json"
    base_profile("cpu").save(str(path))
    data = json.loads(path.read_text())
    assert not set(FIELDS) & set(data)
    assert HardwareProfile.load(str(path)).chunk_overhead_s is None
    for name in FIELDS:
        for bad, says in ((-1.0, "non-negative"), ("fast", "float"), (float("nan"), "")):
            path.write_text(json.dumps({**data, name: bad}))
            with pytest.raises(FileFormatError, match=rf"p.json.*{name}"):
                HardwareProfile.load(str(path))
        path.write_text(json.dumps({**data, name: None}))
        assert getattr(HardwareProfile.load(str(path)), name) is None


def test_slower_compute_scales_the_calibrated_fields_and_keeps_none():
    prof = attrs.evolve(PRESETS["cpu-gloo"], chunk_overhead_s=1e-3, dedup_id_s=None)
    slow = with_slower_compute(prof, 2.0)
    assert slow.chunk_overhead_s == pytest.approx(2e-3) and slow.dedup_id_s is None
    assert math.isclose(with_slower_compute(attrs.evolve(prof, dedup_id_s=5e-9), 0.5).dedup_id_s, 2.5e-9)


# -- the fits -----------------------------------------------------------------------------------

NOISE = st.lists(st.floats(-0.02, 0.02), min_size=16, max_size=16)


def _chunk_records(base_s: float, per_chunk_s: float, noise, ks=(1, 2, 4, 8), held=(16,), batch=256):
    return [ChunkRecord(batch_size=batch, chunks=k, held_out=k in held,
                        seconds=(base_s + (k - 1) * per_chunk_s) * (1 + noise[i]))
            for i, k in enumerate(tuple(ks) + tuple(held))]


def _dedup_records(call_s: float, per_id_s: float, noise, ns=(1024, 4096, 16384), ratios=(0.1, 0.5, 0.9),
                   held=((8192, 0.3),)):
    cases = [(n, r, False) for n in ns for r in ratios] + [(n, r, True) for n, r in held]
    return [DedupRecord(ids=n, unique_ratio=r, held_out=h, seconds=(call_s + n * per_id_s) * (1 + noise[i]))
            for i, (n, r, h) in enumerate(cases)]


@settings(max_examples=60, deadline=None)
@given(base=st.floats(1e-4, 5e-2), per_chunk=st.floats(1e-6, 2e-3), noise=NOISE)
def test_the_chunk_fit_recovers_the_per_chunk_slope_and_predicts_the_held_out_k(base, per_chunk, noise):
    fit = fit_chunk_overhead(_chunk_records(base, per_chunk, noise))
    span = base + 7 * per_chunk  # the largest fitted time: a 2% noise moves the slope by ~2% of it per chunk
    assert abs(fit.slope - per_chunk) <= 0.04 * span / 3 + 1e-12
    assert fit.points == 4 and fit.rms_error <= 0.03 and fit.max_error <= 0.05
    (label, predicted, measured), = fit.held_out
    truth = base + 15 * per_chunk
    assert label == "k=16" and measured == pytest.approx(truth, rel=0.021)
    assert abs(predicted - truth) <= 0.04 * span * 15 / 3 + 0.03 * truth
    assert fit.held_out_error == pytest.approx(abs(predicted - measured) / measured)


@settings(max_examples=60, deadline=None)
@given(call=st.floats(0.0, 5e-5), per_id=st.floats(1e-9, 5e-7), noise=NOISE)
def test_the_dedup_fit_recovers_the_per_id_slope_over_id_counts_and_ratios(call, per_id, noise):
    fit = fit_dedup_id_s(_dedup_records(call, per_id, noise))
    assert fit.points == 9 and fit.slope == pytest.approx(per_id, rel=0.08, abs=0.05 * call / 1024)
    (label, predicted, measured), = fit.held_out
    assert label == "8192 ids at unique ratio 0.3"
    assert predicted == pytest.approx(call + 8192 * per_id, rel=0.08)


def test_exact_lines_are_fitted_exactly_and_the_output_names_the_held_out_points():
    fit = fit_chunk_overhead(_chunk_records(4e-3, 300e-6, [0.0] * 16))
    assert fit.slope == pytest.approx(300e-6, rel=1e-9) and fit.intercept == pytest.approx(4e-3, rel=1e-9)
    assert fit.rms_error < 1e-9 and fit.held_out_error < 1e-9
    text = "\n".join(fit.lines())
    assert "chunk_overhead_s 300 us per extra chunk" in text and "held out k=16: predicted 8.500 ms" in text
    dedup = fit_dedup_id_s(_dedup_records(10e-6, 70e-9, [0.0] * 16))
    assert dedup.slope == pytest.approx(70e-9, rel=1e-9) and "dedup_id_s 70 ns per id" in dedup.lines()[0]


def test_a_fit_the_records_cannot_determine_is_refused_naming_what_to_measure():
    with pytest.raises(CalibrationError, match="at least two"):
        fit_slope([1.0, 1.0], [1e-3, 2e-3], field="dedup_id_s", unit="id")
    with pytest.raises(CalibrationError, match="positive and finite"):
        fit_slope([1.0, 2.0], [1e-3, float("nan")], field="dedup_id_s", unit="id")
    with pytest.raises(CalibrationError, match="no chunked dense steps"):
        fit_chunk_overhead([])
    mixed = _chunk_records(1e-3, 1e-4, [0.0] * 16) + [ChunkRecord(batch_size=512, chunks=2, seconds=1e-3)]
    with pytest.raises(CalibrationError, match="one fixed batch"):
        fit_chunk_overhead(mixed)
    with pytest.raises(ValueError, match="a chunk needs a sample"):
        ChunkRecord(batch_size=4, chunks=8, seconds=1e-3)
    with pytest.raises(ValueError, match=r"unique_ratio must be a ratio in \(0, 1\]"):
        DedupRecord(ids=10, unique_ratio=1.5, seconds=1e-3)


def test_times_that_do_not_grow_fit_a_zero_slope_and_the_kernel_report_says_so():
    flat = [ChunkRecord(batch_size=256, chunks=k, seconds=5e-3 - k * 1e-5) for k in (1, 2, 4, 8)]
    assert fit_chunk_overhead(flat).slope == 0.0
    _prof, report = fit_kernel_profile(PRESETS["cpu-gloo"], MicrobenchRecords(
        lookups=_lookups(), chunks=flat, dedup=_dedup_records(1e-5, 7e-8, [0.0] * 16)))
    assert any("chunk_overhead_s: the chunked dense steps' times did not grow" in n for n in report.notes)


def _lookups():
    return [LookupRecord(kernel="fbgemm_tbe", device="cpu", phase="fwd", rows=1000, dim=d, batch_size=128,
                         pooling=p, seconds=2e-5 + 128 * p * d * 4 / 4e9) for d in (16, 64) for p in (1, 8)]


def test_the_kernel_fit_stores_both_constants_and_the_records_round_trip(tmp_path):
    records = MicrobenchRecords(lookups=_lookups(), chunks=_chunk_records(4e-3, 250e-6, [0.0] * 16),
                                dedup=_dedup_records(5e-6, 60e-9, [0.0] * 16))
    prof, report = fit_kernel_profile(PRESETS["cpu-gloo"], records)
    assert prof.chunk_overhead_s == pytest.approx(250e-6) and prof.dedup_id_s == pytest.approx(60e-9)
    assert {"chunk_overhead_s", "dedup_id_s"} <= {f.family for f in report.fits}
    assert "held out 8192 ids at unique ratio 0.3" in report.summary()
    assert MicrobenchRecords.from_dict(json.loads(json.dumps(records.to_dict()))) == records
    old = {k: v for k, v in records.to_dict().items() if k not in ("chunks", "dedup")}  # records from before
    again = MicrobenchRecords.from_dict(old)
    assert again.chunks == () and again.dedup == ()
    prof_old, report_old = fit_kernel_profile(PRESETS["cpu-gloo"], again)
    assert prof_old.chunk_overhead_s is None and prof_old.dedup_id_s is None
    assert any("no dedup kernels measured: dedup_id_s kept from the base profile" in n for n in report_old.notes)
    assert json.loads(json.dumps(report.to_dict()))["slopes"][0]["field"] == "chunk_overhead_s"


# -- the step calibration's path ----------------------------------------------------------------

HOST = dict(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9)


def test_host_terms_carry_the_constants_into_the_step_fit_and_an_older_record_says_what_it_lacks():
    host = HostTermRecord(**HOST, chunk_overhead_s=3e-4, dedup_id_s=7e-8)
    base, _terms, _floors = host_fit_setup(base_profile("cpu"), host.to_dict())
    assert base.chunk_overhead_s == 3e-4 and base.dedup_id_s == 7e-8
    old = HostTermRecord(**HOST)
    assert set(old.to_dict()) & set(FIELDS) == set()
    base_old, _t, _f = host_fit_setup(base_profile("cpu"), old.to_dict())
    assert base_old.chunk_overhead_s is None and base_old.dedup_id_s is None
    mean = HostTermRecord.mean_of([host, attrs.evolve(host, chunk_overhead_s=5e-4, dedup_id_s=9e-8)])
    assert mean.chunk_overhead_s == pytest.approx(4e-4) and mean.dedup_id_s == pytest.approx(8e-8)
    assert HostTermRecord.mean_of([host, old]).chunk_overhead_s is None
    fit = {"values": {"step_overhead_s": 1e-3}}
    new_info = StepFitInfo(fit=fit, host_terms={**host.to_dict(), "codec_byte_s": 1e-10})
    old_info = StepFitInfo(fit=fit, host_terms={**old.to_dict(), "codec_byte_s": 1e-10})
    assert not new_info.before_rewrites() and old_info.before_rewrites()
    assert not any("rewrites" in p for p in stored_profile_problems(new_info))
    assert any("before the sparse-path rewrites' constants were measured (chunk_overhead_s, dedup_id_s"
               in p for p in stored_profile_problems(old_info))


# -- the measuring side -------------------------------------------------------------------------


def test_the_dedup_kernels_rebuild_the_ids_they_were_given():
    gen = torch.Generator().manual_seed(3)
    for n, r in ((1000, 0.1), (600, 1.0), (300000, 0.05)):  # the inverse at uint8, int16 and int32
        ids = _dedup_ids(n, r, torch.device("cpu"), gen)
        assert ids.numel() == n and torch.unique(ids).numel() == max(1, round(r * n))
        a, b = ids[: n // 2], ids[n // 2:]
        assert torch.equal(_dedup_round_trip([a, b]), ids)


def test_the_quick_measurement_runs_in_seconds_and_its_fits_give_the_profile_fields():
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    chunks, dedup = bench_rewrite_constants(torch.device("cpu"), RewriteSweep.quick())
    assert time.perf_counter() - t0 < 10
    assert [(r.chunks, r.held_out) for r in chunks] == [(1, False), (2, False), (4, False), (8, True)]
    assert len(dedup) == 5 and [r.held_out for r in dedup].count(True) == 1
    assert all(r.seconds > 0 for r in chunks + dedup)
    prof, _report = fit_kernel_profile(PRESETS["cpu-gloo"], MicrobenchRecords(lookups=_lookups(), chunks=chunks,
                                                                              dedup=dedup))
    assert prof.chunk_overhead_s >= 0 and prof.dedup_id_s > 0  # dedup time always grows with the ids


def test_a_rewrite_sweep_that_cannot_determine_the_slopes_is_refused():
    with pytest.raises(ValueError, match="at least two chunk counts"):
        RewriteSweep(chunks=(4,))
    with pytest.raises(ValueError, match="chunk count 512"):
        RewriteSweep(batch_size=256, held_out_chunks=(512,))
    with pytest.raises(ValueError, match="ratio in"):
        RewriteSweep(unique_ratios=(0.0,))


# ---------------------------------------------------------------------------------------------
# what one more chunk costs a real step (the step calibration's batch-split steps)
# ---------------------------------------------------------------------------------------------


def test_the_step_chunk_cost_is_a_line_over_the_workloads_feature_counts():
    from torchrec_sparselift.calibration.rewrite_fit import step_chunk_cost

    # slopes 1.5 + 0.05 * F ms (F = 10, 30, 50) beside 0.5 ms of latency, each workload its own intercept
    times = {"a": {1: 0.040, 2: 0.042, 4: 0.046}, "b": {1: 0.080, 2: 0.083, 4: 0.089},
             "c": {1: 0.060, 2: 0.064, 4: 0.072}}
    fit = step_chunk_cost(times, {"a": 10, "b": 30, "c": 50}, {"a": 5e-4, "b": 5e-4, "c": 5e-4})
    assert fit.slopes["a"].slope == pytest.approx(0.002) and fit.slopes["c"].slope == pytest.approx(0.004)
    assert fit.overhead_s == pytest.approx(1.0e-3) and fit.feature_s == pytest.approx(5e-5)
    assert all(abs(r) < 1e-9 for r in fit.residuals.values())
    assert fit.dense_s(60) == pytest.approx(1e-3 + 60 * 5e-5) and fit.predicted_slope_s("c") == pytest.approx(0.004)
    # what the model already predicts per chunk (here: it hides 1 ms of a's) is not charged twice
    hid = step_chunk_cost(times, {"a": 10, "b": 30, "c": 50}, {"a": -5e-4, "b": 5e-4, "c": 5e-4})
    assert hid.predicted_slope_s("a") < fit.predicted_slope_s("a") + 1e-12 and hid.overhead_s > 0
    with pytest.raises(CalibrationError, match="must be finite numbers"):
        step_chunk_cost(times, {"a": 10, "b": 30, "c": 50}, {"a": float("nan"), "b": 0.0, "c": 0.0})
    assert "us per feature" in fit.lines()[0] and len(fit.lines()) == 4
    with pytest.raises(CalibrationError, match="no batch-split steps"):
        step_chunk_cost({}, {})
    with pytest.raises(CalibrationError, match="at least two feature counts"):
        step_chunk_cost({"a": times["a"], "b": times["b"]}, {"a": 16, "b": 16})
    with pytest.raises(CalibrationError, match=r"none for \['c'\]"):
        step_chunk_cost(times, {"a": 10, "b": 30})


def test_the_step_chunk_cost_is_never_negative_and_grows_with_the_slopes():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from torchrec_sparselift.calibration.rewrite_fit import step_chunk_cost

    ms = st.floats(0.0, 10.0)

    @settings(max_examples=80, deadline=None)
    @given(ms, ms, ms, st.floats(0.0, 0.5))
    def check(sa: float, sb: float, extra: float, lat: float) -> None:
        times = {"a": {1: 0.05, 3: 0.05 + 2 * sa * 1e-3}, "b": {1: 0.05, 3: 0.05 + 2 * sb * 1e-3}}
        fit = step_chunk_cost(times, {"a": 4, "b": 40}, {"a": lat * 1e-3, "b": lat * 1e-3})
        assert fit.overhead_s >= 0 and fit.feature_s >= 0
        more = dict(times, b={1: 0.05, 3: 0.05 + 2 * (sb + extra) * 1e-3})  # more cost at many features
        assert step_chunk_cost(more, {"a": 4, "b": 40}, {"a": lat * 1e-3, "b": lat * 1e-3}).predicted_slope_s(
            "b") >= fit.predicted_slope_s("b") - 1e-12

    check()


def test_the_profile_takes_the_step_chunk_cost_less_the_collectives_latency():
    import attrs as _attrs

    from torchrec_sparselift.cost.hardware import PRESETS
    from torchrec_sparselift.cost.model import collective_calls
    from torchrec_sparselift.measure.steps import chunk_workload_features, with_step_chunk_cost

    feats = chunk_workload_features(["probe_wide", "probe_many", "probe_features"])
    assert feats == {"probe_wide": 4, "probe_many": 16, "probe_features": 48}
    base = _attrs.evolve(PRESETS["cpu-gloo"], collective_latency_s=1e-4, chunk_overhead_s=3e-4)
    lat = 2e-4 * collective_calls("output_dist", 1)
    slope = {w: lat + 1e-3 + 4e-5 * f for w, f in feats.items()}
    out = with_step_chunk_cost(base, {w: {1: 0.040, 2: 0.040 + s, 4: 0.040 + 3 * s} for w, s in slope.items()})
    assert out.chunk_overhead_s == pytest.approx(1e-3) and out.chunk_feature_s == pytest.approx(4e-5)
    # the fixed part never below the dense calls' own reading
    flat = {w: {1: 0.040, 2: 0.040 + lat + 1e-4 + 1e-5 * f} for w, f in feats.items()}
    low = with_step_chunk_cost(base, flat)
    assert low.chunk_overhead_s == pytest.approx(3e-4) and low.chunk_feature_s == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="no probe workload 'nope'"):
        chunk_workload_features(["nope"])


def _chunk_times_rank(rank, world):
    import torch.distributed as dist

    from torchrec_sparselift.measure.steps import StepTiming, measure_chunk_times

    return measure_chunk_times(dist.group.WORLD, workloads=("probe_features",), chunks=(1, 2),
                               timing=StepTiming(instances=1, block_steps=2, warmup=1))


def test_two_gloo_ranks_time_the_batch_split_steps():
    from launcher import run_ranks

    out = run_ranks(_chunk_times_rank, 2, timeout_s=300)
    assert out[0].keys() == {"probe_features"} and set(out[0]["probe_features"]) == {1, 2}
    assert all(t > 0 for t in out[0]["probe_features"].values())


def test_the_model_s_own_slope_per_chunk_grows_with_the_collectives_latency():
    import attrs as _attrs

    from torchrec_sparselift.calibration.store import base_profile
    from torchrec_sparselift.measure.steps import model_chunk_slopes

    prof = base_profile("cpu")
    low = model_chunk_slopes(_attrs.evolve(prof, collective_latency_s=1e-5), ["probe_many"])
    high = model_chunk_slopes(_attrs.evolve(prof, collective_latency_s=1e-3), ["probe_many"])
    assert set(low) == {"probe_many"} and np.isfinite(low["probe_many"])
    assert high["probe_many"] > low["probe_many"]
    assert high["probe_many"] <= 2 * 1e-3 + 1e-12  # at most the two collectives' latency per chunk


def _chunk_cost_rank(rank, world):
    import attrs as _attrs
    import torch.distributed as dist

    from torchrec_sparselift.calibration.store import base_profile
    from torchrec_sparselift.measure.steps import StepTiming, calibrate_chunk_cost

    lines = []
    prof = _attrs.evolve(base_profile("cpu"), chunk_overhead_s=1e-4)  # the dense calls' reading: the floor
    out = calibrate_chunk_cost(dist.group.WORLD, prof, workloads=("probe_many", "probe_features"), chunks=(1, 2),
                               timing=StepTiming(instances=1, block_steps=2, warmup=1, say=lines.append))
    return out.chunk_overhead_s, out.chunk_feature_s, lines


def test_two_gloo_ranks_calibrate_the_chunk_price_alike():
    from launcher import run_ranks

    out = run_ranks(_chunk_cost_rank, 2, timeout_s=300)
    assert out[0][:2] == out[1][:2]
    overhead, per_feature, lines = out[0]
    assert overhead >= 1e-4 and per_feature is not None and per_feature >= 0
    assert any("us per feature per extra chunk" in line for line in lines) and out[1][2] == []
