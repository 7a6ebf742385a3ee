"""Host-work microbenchmarks that the step fit takes instead of guessing (measure.microbench.bench_host_terms)."""

import math

import pytest

from torchrec_sparselift.calibration.records import HostTermRecord
from torchrec_sparselift.calibration.step_fit import (FitRecord, StepFitInfo, host_fit_setup, host_fixed_terms, term_value,
                                                     with_a2a_host_split)
from torchrec_sparselift.cost.step_terms import CPU_STEP_TERMS
from torchrec_sparselift.calibration.store import base_profile
from torchrec_sparselift.measure.microbench import bench_dense_terms, bench_host_terms


def test_bench_host_terms_runs_the_real_kernels_and_gives_finite_non_negative_costs():
    # Each cost is a slope between two timed cases, so the machine's load moves it either way:
    # their magnitudes are printed against the usual ranges by benchmarks/load_sensitive.py, the
    # arithmetic is checked on synthetic timings (test_bench_host_terms_recovers_...).
    rec = bench_host_terms(trials=3)
    values = rec.to_dict()
    assert all(math.isfinite(v) and v >= 0 for v in values.values()), values
    # TorchRec's fp16 codec over an 8 MiB tensor: hundreds of microseconds, never free
    assert rec.codec_byte_s > 0, values


def test_bench_host_terms_recovers_known_per_tensor_byte_and_id_costs(monkeypatch):
    """The slopes between the small and large cases, on synthetic timings of known cost: the
    per-byte and per-id costs come back; the per-tensor cost includes a small tensor's bytes."""
    from torchrec_sparselift.measure import microbench

    per_tensor, per_byte, per_id = 5e-6, 0.3e-9, 2e-9

    def adagrad(shapes, device, trials):
        return 1e-4 + per_tensor * len(shapes) + per_byte * sum(r * c * 4 for r, c in shapes)

    monkeypatch.setattr(microbench, "_table_optimizer_step_s", adagrad)
    monkeypatch.setattr(microbench, "_bucketize_s", lambda n, device, trials: 3e-5 + per_id * n)
    monkeypatch.setattr(microbench, "bench_dense_terms", lambda *a, **k: (1.2e-9, 3e-11))
    monkeypatch.setattr(microbench, "bench_tbe_backward", lambda *a, **k: (0.6e-6, 1e-8))
    monkeypatch.setattr(microbench, "bench_dense_flops", lambda *a, **k: 7e-12)
    per_codec_byte = 0.15e-9  # encode + decode of one fp32 byte
    monkeypatch.setattr(microbench, "_codec_s", lambda n, device, trials: 2e-5 + per_codec_byte * 4 * n)
    # the rewrites' constants: the slopes of their records (calibration.rewrite_fit)
    chunks = [microbench.ChunkRecord(batch_size=256, chunks=k, seconds=4e-3 + (k - 1) * 2e-4) for k in (1, 2, 4, 8)]
    dedup = [microbench.DedupRecord(ids=n, unique_ratio=0.5, seconds=1e-5 + n * 6e-8) for n in (1024, 4096)]
    monkeypatch.setattr(microbench, "bench_rewrite_constants", lambda *a, **k: (chunks, dedup))
    rec = microbench.bench_host_terms(trials=1, passes=1)
    assert rec.chunk_overhead_s == pytest.approx(2e-4, rel=1e-9) and rec.dedup_id_s == pytest.approx(6e-8, rel=1e-9)
    # per byte a rank sends or receives: it encodes what it sends and decodes what it receives
    assert rec.codec_byte_s == pytest.approx(per_codec_byte / 2, rel=1e-9)
    assert rec.optimizer_tensor_s == pytest.approx(per_tensor + per_byte * 16 * 64 * 4, rel=1e-9)
    assert rec.optimizer_byte_s == pytest.approx(per_byte, rel=1e-9)
    if microbench.fbgemm_available():
        assert rec.bucketize_id_s == pytest.approx(per_id, rel=1e-9)
    assert (rec.dense_act_byte_s, rec.interaction_flop_s, rec.tbe_row_s, rec.dense_flop_s) == (
        1.2e-9, 3e-11, 0.6e-6, 7e-12)


def test_host_fit_setup_fixes_bucketize_and_floors_the_data_parallel_optimizer():
    base = base_profile("cpu")
    same, terms, floors = host_fit_setup(base, None)
    assert same is base and tuple(terms) == tuple(CPU_STEP_TERMS) and floors == {}
    host = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9,
                          codec_byte_s=0.1e-9)
    fixed, terms, floors = host_fit_setup(base, host.to_dict())  # the stored dict form too
    assert fixed.bucketize_id_s == 15e-9
    assert fixed.codec_byte_s == 0.1e-9  # measured alone, taken as it is (no probe runs a lossy comm)
    assert "bucketize_id_s" not in {t.name for t in terms}
    assert floors == {"dp_table_overhead_s": 30e-6, "1/dense_update_bw": pytest.approx(0.2e-9),
                      "reduce_scatter_factor": 1.0}


def test_add_feedback_refits_above_the_floors_with_the_measured_terms_fixed(tmp_path, monkeypatch):
    """A profile calibrated with host terms refits guard feedback with the same terms and floors:
    the measured bucketize cost stays, the per-table optimizer term never drops below its floor."""
    import attrs

    from torchrec_sparselift.calibration.feedback import add_feedback
    from torchrec_sparselift.calibration.store import ProfileStore, current_fingerprint

    host = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9,
                          a2a_byte_s=0.1e-9)
    base, terms, floors = host_fit_setup(base_profile("cpu"), host)
    prof = attrs.evolve(base, dp_table_overhead_s=40e-6)
    store = ProfileStore(str(tmp_path))
    fp = current_fingerprint("cpu", 2)
    store.save(prof, fp, dict(fit_records=[], host_terms=host.to_dict()))

    class Topo:
        compute_device = "cpu"
        local_world_size = 2

    # the record says data-parallel tables cost nothing per table (below the floor) and carries a
    # bucketize quantity: the refit keeps the floor and prices bucketize at the measured value
    rec = FitRecord(label="guard/p", quantities={"dp_table_overhead_s": 10.0, "bucketize_id_s": 1e5,
                                                  "step_overhead_s": 1.0},
                    fixed_s=1e-3, measured_s=1e-3 + 1e5 * 15e-9 + term_value(prof, CPU_STEP_TERMS[6]))
    path = add_feedback([rec], prof, Topo(), store=store)
    assert path is not None
    found, diff = store.lookup(fp)
    assert not diff
    assert found.profile.bucketize_id_s == 15e-9
    assert found.profile.dp_table_overhead_s >= 30e-6 - 1e-15
    # the refitted all-to-all's share above the bare collective (what lossy comms do not shrink)
    assert found.profile.a2a_host_byte_s == pytest.approx(max(0.0, 1 / found.profile.intra_host_bw - 0.1e-9))
    assert found.profile.a2a_host_byte_s > 0


def _host_terms_on_two_ranks(rank, world_size):
    import torch.distributed as dist

    from torchrec_sparselift.measure.steps import host_terms

    return host_terms(dist.group.WORLD).to_dict()


def test_host_terms_across_two_ranks_measure_the_all_to_all_byte_and_agree():
    from launcher import run_ranks

    a, b = run_ranks(_host_terms_on_two_ranks, 2, timeout_s=120)
    assert a == b  # one record on every rank (the ranks' mean; the all-to-all's slowest rank)
    # per byte a rank sends or receives over loopback gloo (0.01-10 ns idle; a slope, so load
    # moves it: benchmarks/load_sensitive.py's range)
    assert math.isfinite(a["a2a_byte_s"]) and a["a2a_byte_s"] >= 0
    # the rewrites' constants, measured on every rank at once and averaged
    assert a["chunk_overhead_s"] >= 0 and a["dedup_id_s"] > 0
    base, terms, floors = host_fit_setup(base_profile("cpu"), a)
    assert (base.chunk_overhead_s, base.dedup_id_s) == (a["chunk_overhead_s"], a["dedup_id_s"])
    assert "1/a2a_bw" in {t.name for t in terms}  # fitted, above the bare collective's cost
    assert floors["1/a2a_bw"] == a["a2a_byte_s"]


def test_bench_dense_terms_recovers_a_known_byte_and_flop_cost(monkeypatch):
    """The least squares separates bytes from FLOPs across the shapes: a synthetic timing of
    known per-byte and per-FLOP cost (plus a constant) comes back."""
    from torchrec_sparselift.measure import microbench
    from torchrec_sparselift.semantics.dense import ACTIVATION_BYTES, dlrm_interaction

    per_byte, per_flop = 1.2e-9, 3e-11

    def fake(b, f, d, device, trials):
        flops, elems = dlrm_interaction(f, d)
        return 2e-4 + per_byte * b * ACTIVATION_BYTES * (elems + f * d) + per_flop * b * flops

    monkeypatch.setattr(microbench, "_dlrm_dense_s", fake)
    got_byte, got_flop = microbench.bench_dense_terms()
    assert got_byte == pytest.approx(per_byte, rel=1e-6)
    assert got_flop == pytest.approx(per_flop, rel=1e-6)


def test_bench_dense_terms_runs_the_real_kernels_and_gives_finite_non_negative_costs():
    byte_s, flop_s = bench_dense_terms(trials=3)
    # per activation byte: a memory pass or a few (0.01-50 ns idle); slopes, so load moves them
    # (benchmarks/load_sensitive.py prints them against that range)
    assert math.isfinite(byte_s) and byte_s >= 0
    assert math.isfinite(flop_s) and flop_s >= 0


def test_host_fit_setup_takes_the_dense_rates_as_measured_at_a_third_of_their_cost():
    host = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9,
                          dense_act_byte_s=1.2e-9, interaction_flop_s=3e-11)
    fixed, terms, floors = host_fit_setup(base_profile("cpu"), host)
    # the model prices the forward at the rate and the backward at twice it: forward + backward
    # measured alone is 3x the forward's cost
    assert 1.0 / fixed.dense_mem_bw == pytest.approx(0.4e-9)
    assert 1.0 / fixed.interaction_flops == pytest.approx(1e-11)
    names = {t.name for t in terms}
    assert "1/dense_mem_bw" not in names and "1/interaction_flops" not in names  # not fitted
    assert "1/dense_mem_bw" not in floors and "1/interaction_flops" not in floors
    assert host_fixed_terms(host) == ("bucketize_id_s", "1/dense_mem_bw", "1/interaction_flops")
    assert host_fixed_terms(host.to_dict()) == host_fixed_terms(host)
    # not measured (an older record, no torchrec): fitted from the steps as before
    no_dense = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9)
    base = base_profile("cpu")
    same, terms, floors = host_fit_setup(base, no_dense)
    assert same.dense_mem_bw == base.dense_mem_bw and same.interaction_flops == base.interaction_flops
    assert {"1/dense_mem_bw", "1/interaction_flops"} <= {t.name for t in terms}
    assert host_fixed_terms(no_dense) == ("bucketize_id_s",) and host_fixed_terms(None) == ()


def test_a_fit_with_measured_dense_rates_does_not_report_them_missing():
    values = {t.name: 1.0 for t in CPU_STEP_TERMS
              if t.name not in ("bucketize_id_s", "1/dense_mem_bw", "1/interaction_flops")}
    host = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9,
                          dense_act_byte_s=1.2e-9, interaction_flop_s=3e-11).to_dict()
    assert StepFitInfo(fit={"values": values}, host_terms=host).missing_terms() == []
    # a record without the dense rates measured: the fit should have fitted them
    no_dense = {**host, "dense_act_byte_s": 0.0, "interaction_flop_s": 0.0}
    assert StepFitInfo(fit={"values": values}, host_terms=no_dense).missing_terms() == [
        "1/interaction_flops", "1/dense_mem_bw"]


def test_bench_dense_flops_recovers_a_known_flop_cost(monkeypatch):
    """The slope over the MLP shapes is the per-FLOP cost (the backward counted twice the forward):
    a synthetic timing of known per-FLOP cost plus a constant per call comes back."""
    from torchrec_sparselift.measure import microbench

    per_flop = 8e-12

    def fake(b, widths, device, trials):
        weights = sum(a * c + c for a, c in zip(widths[:-1], widths[1:]))
        return 3e-4 + per_flop * 3 * 2 * weights * b

    monkeypatch.setattr(microbench, "_mlp_s", fake)
    assert microbench.bench_dense_flops() == pytest.approx(per_flop, rel=1e-6)


def test_bench_dense_flops_runs_the_real_kernels_and_gives_a_finite_non_negative_cost():
    from torchrec_sparselift.measure.microbench import bench_dense_flops

    flop_s = bench_dense_flops(trials=3)
    # an fp32 GEMM on one to a few CPU cores: 1-2000 GFLOP/s idle; a slope, so load moves it
    # (benchmarks/load_sensitive.py prints it against that range)
    assert math.isfinite(flop_s) and flop_s >= 0


def test_host_fit_setup_floors_the_dense_flop_rate_at_its_measured_cost():
    host = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=15e-9,
                          dense_flop_s=7e-12)
    _fixed, terms, floors = host_fit_setup(base_profile("cpu"), host)
    assert floors["1/dense_flops"] == pytest.approx(7e-12)
    assert "1/dense_flops" in {t.name for t in terms}  # fitted above the floor
    # a stored record from before the measurement (no dense_flop_s) leaves the rate unfloored
    old = {k: v for k, v in host.to_dict().items() if k != "dense_flop_s"}
    assert "1/dense_flops" not in host_fit_setup(base_profile("cpu"), old)[2]


def test_host_floors_average_the_readings_and_each_reading_keeps_its_fastest_sweep():
    """Two readings of the host terms (before and after the probes) are averaged; within one
    reading each case is its fastest over interleaved sweeps (a transient only slows a sweep)."""
    from torchrec_sparselift.measure.microbench import fastest_over_passes

    slow = HostTermRecord(optimizer_tensor_s=40e-6, optimizer_byte_s=0.4e-9, bucketize_id_s=15e-9,
                          dense_act_byte_s=1.2e-9, interaction_flop_s=0.0)
    fast = HostTermRecord(optimizer_tensor_s=20e-6, optimizer_byte_s=0.6e-9, bucketize_id_s=10e-9,
                          dense_act_byte_s=0.6e-9, interaction_flop_s=4e-11)
    got = HostTermRecord.mean_of([slow, fast])
    want = HostTermRecord(optimizer_tensor_s=30e-6, optimizer_byte_s=0.5e-9, bucketize_id_s=12.5e-9,
                          dense_act_byte_s=0.9e-9, interaction_flop_s=2e-11)
    for name, value in want.to_dict().items():
        assert getattr(got, name) == pytest.approx(value, rel=1e-12, abs=1e-30), name
    assert HostTermRecord.mean_of([slow]) == slow
    with pytest.raises(ValueError, match="at least one"):
        HostTermRecord.mean_of([])
    # interleaved sweeps: case i's fastest reading over the passes, every case run once per pass
    calls = []
    readings = {0: iter([3.0, 1.0, 2.0]), 1: iter([5.0, 6.0, 4.0])}

    def case(i):
        def run():
            calls.append(i)
            return next(readings[i])
        return run

    assert fastest_over_passes([case(0), case(1)], 3) == [1.0, 4.0]
    assert calls == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="passes"):
        fastest_over_passes([case(0)], 0)


def test_the_all_to_all_share_above_the_bare_collective_is_what_lossy_comms_do_not_shrink():
    """with_a2a_host_split: the fitted all-to-all cost per byte above the bare collective measured
    alone becomes ``a2a_host_byte_s``; nothing without a measured collective, never below 0."""
    import attrs

    fitted = attrs.evolve(base_profile("cpu"), intra_host_bw=2.5e9, inter_host_bw=2.5e9)  # 0.4 ns per byte
    host = HostTermRecord(optimizer_tensor_s=1e-5, optimizer_byte_s=1e-10, bucketize_id_s=1e-8, a2a_byte_s=0.25e-9)
    assert with_a2a_host_split(fitted, host).a2a_host_byte_s == pytest.approx(0.15e-9)
    assert with_a2a_host_split(fitted, host.to_dict()).a2a_host_byte_s == pytest.approx(0.15e-9)
    assert with_a2a_host_split(fitted, None) is fitted
    assert with_a2a_host_split(fitted, attrs.evolve(host, a2a_byte_s=0.0)) is fitted  # one rank: not measured
    assert with_a2a_host_split(fitted, attrs.evolve(host, a2a_byte_s=1e-9)).a2a_host_byte_s == 0.0


def test_a_profile_calibrated_before_the_lossy_terms_is_flagged_and_priced_with_them_meanwhile():
    """A step-fitted profile whose host terms lack ``codec_byte_s`` (calibrated before the codec was
    measured): ``calibrate check`` / ``hardware="auto"`` say so, and meanwhile it takes the base
    profile's codec and the all-to-all's host share its own fit and host terms give."""
    import attrs

    from torchrec_sparselift.calibration.step_fit import StepFitInfo
    from torchrec_sparselift.calibration.store import stored_profile_problems, with_base_terms

    base = base_profile("cpu")
    assert base.codec_byte_s > 0  # the shipped CPU profile carries the codec measured on its machine
    values = {t.name: 1e-6 for t in CPU_STEP_TERMS}
    old_host = dict(optimizer_tensor_s=1e-5, optimizer_byte_s=1e-10, bucketize_id_s=1e-8, a2a_byte_s=0.25e-9)
    old = StepFitInfo(fit={"values": values}, model_version=2, host_terms=old_host)
    assert any("codec_byte_s" in m for m in stored_profile_problems(old))
    prof = attrs.evolve(base, intra_host_bw=2.5e9, inter_host_bw=2.5e9, codec_byte_s=0.0)
    priced = with_base_terms(prof, old, base)
    assert priced.codec_byte_s == base.codec_byte_s
    assert priced.a2a_host_byte_s == pytest.approx(0.15e-9)
    # a profile calibrated with them: nothing flagged, its own values kept
    new = StepFitInfo(fit={"values": values}, model_version=2, host_terms={**old_host, "codec_byte_s": 0.2e-9})
    assert not any("codec_byte_s" in m for m in stored_profile_problems(new))
    assert with_base_terms(prof, new, base) == prof
