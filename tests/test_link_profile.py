"""Link-aware profiles: a stored profile keeps the link it was calibrated on, a job whose link
differs beyond the measured spread gets one warning naming each differing term and the profile's
link terms corrected by the measured change; the store reads profiles with and without a link
record; on two emulated hosts a profile calibrated on an unshaped link is corrected to a
100 Mbit/s one (that last one needs root and tc; it skips with the reason).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import attrs
import pytest

from torchrec_sparselift.calibration.link import (
    LinkRates,
    correct_link_terms,
    corrected_bandwidth,
    links_differ,
    with_link_facts,
)
from torchrec_sparselift.calibration.store import (
    PROFILE_STORE_ENV,
    MachineFingerprint,
    ProfileStore,
    auto_profile,
    auto_profile_link,
    current_fingerprint,
)
from torchrec_sparselift.cost.hardware import (
    COMPUTE_RATE_FIELDS,
    COMPUTE_TIME_FIELDS,
    HardwareProfile,
    with_slower_compute,
)
from torchrec_sparselift.cost.step_terms import link_terms
from torchrec_sparselift.errors import FileFormatError
from launcher import run_ranks
from search_helpers import meta_ebc
from torchrec_sparselift.measure import testbed as tb

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PROFILE = HardwareProfile(name="step-fit-test", compute_device="cpu", local_world_size=1, intra_host_bw=400e6,
                          inter_host_bw=400e6, allreduce_bw=300e6, collective_latency_s=1e-3)


def _rates(**overrides) -> LinkRates:
    base = dict(
        intra_bw=None, intra_latency_s=None, inter_bw=430e6, inter_latency_s=130e-6, spread=0.1,
        allreduce_bw=220e6, allreduce_latency_s=250e-6, latency_spread_s=20e-6, hosts=2, ranks_per_host=1,
    )  # fmt: skip
    base.update(overrides)
    return LinkRates(**base)


# ---------------------------------------------------------------- the correction


def test_a_bandwidth_keeps_the_profiles_extra_seconds_per_byte_over_the_link():
    # profile 400 MB/s over a 430 MB/s link: 1/400e6 - 1/430e6 s/byte on top of the link
    new = corrected_bandwidth(400e6, 430e6, 12.5e6)
    assert new == pytest.approx(1 / (1 / 400e6 + 1 / 12.5e6 - 1 / 430e6), rel=1e-12)
    assert 12.0e6 < new < 12.5e6
    # the link got faster by more than the profile's per-byte time: the measured rate outright
    assert corrected_bandwidth(1e9, 1e8, 1e10) == 1e10
    with pytest.raises(ValueError, match="measured_bw=0"):
        corrected_bandwidth(1e9, 1e9, 0.0)


def test_a_slower_link_corrects_the_flagged_terms_and_names_them_with_both_values():
    stored, measured = _rates(), _rates(inter_bw=12.4e6, allreduce_bw=12.1e6, inter_latency_s=230e-6)
    c = correct_link_terms(PROFILE, stored, measured)
    assert c.differs and len(c.differences) == len(links_differ(stored, measured)) == 2
    p = c.profile
    # the model's all-to-all bytes are sent + received: two per measured (sent) byte
    per_measured = {r.measured: r.profile_bytes_per_measured for r in link_terms("bandwidth")}
    assert per_measured["inter_bw"] == 2.0 and per_measured["allreduce_bw"] == 1.0
    assert p.inter_host_bw == pytest.approx(corrected_bandwidth(400e6, 2 * 430e6, 2 * 12.4e6))
    assert p.allreduce_bw == pytest.approx(corrected_bandwidth(300e6, 220e6, 12.1e6))
    # within the spread: untouched (the latencies are 100 us apart, within 100% of the smaller)
    assert p.intra_host_bw == PROFILE.intra_host_bw and p.collective_latency_s == PROFILE.collective_latency_s
    assert p.name == "step-fit-test+link"
    assert {f for f, _, _ in c.changed} == {"inter_host_bw", "allreduce_bw"}
    msg = c.describe("/store/cpu-x.json")
    for needle in ("inter_bw", "allreduce_bw", "430 MB/s", "12.4 MB/s", "/store/cpu-x.json", "inter_host_bw"):
        assert needle in msg, msg


def test_latency_shifts_only_when_flagged_and_not_below_zero():
    slow = correct_link_terms(PROFILE, _rates(), _rates(inter_latency_s=2.13e-3))
    assert slow.profile.collective_latency_s == pytest.approx(1e-3 + 2e-3)
    assert slow.changed == (("collective_latency_s", 1e-3, pytest.approx(3e-3)),)
    fast = correct_link_terms(PROFILE, _rates(inter_latency_s=5e-3), _rates(inter_latency_s=130e-6))
    assert fast.profile.collective_latency_s == 0.0
    allreduce_only = correct_link_terms(PROFILE, _rates(allreduce_latency_s=480e-6), _rates(allreduce_latency_s=7e-6))
    assert allreduce_only.differs and allreduce_only.profile is PROFILE  # flagged, but no a2a latency moved


def test_a_slower_inter_host_link_counts_once_per_reduce_scatter_byte():
    # the step fit's reduce-scatter factor (gloo reduces on the CPU) keeps its seconds per byte at
    # the old rate; the slower link's added seconds count once per byte on the wire
    prof = attrs.evolve(PROFILE, reduce_scatter_factor=4.0)
    c = correct_link_terms(prof, _rates(), _rates(inter_bw=12.4e6))
    new_bw = c.profile.inter_host_bw
    f = c.profile.inter_reduce_scatter_factor
    assert f == pytest.approx(1 + 3.0 * new_bw / 400e6) and c.profile.rs_factor(inter_host=True) == f
    # a reduce-scatter byte across hosts: the old factor's seconds plus the link's added seconds
    assert f / new_bw == pytest.approx(4.0 / 400e6 + (1 / new_bw - 1 / 400e6))
    assert ("inter_reduce_scatter_factor", 4.0, pytest.approx(f)) in c.changed
    assert "inter_reduce_scatter_factor 4 -> " in c.describe()
    # the intra-host bytes (table-row-wise's stage) keep the calibrated factor: their link did not slow
    assert c.profile.reduce_scatter_factor == 4.0 and c.profile.rs_factor(inter_host=False) == 4.0
    # a faster link, or one host: the factor stays
    faster = correct_link_terms(prof, _rates(inter_bw=12.4e6), _rates()).profile
    assert faster.inter_reduce_scatter_factor is None and faster.rs_factor(True) == 4.0
    one = dict(hosts=1, ranks_per_host=2, inter_bw=None, inter_latency_s=None, intra_latency_s=3e-4)
    assert correct_link_terms(prof, _rates(intra_bw=800e6, **one), _rates(intra_bw=12e6, **one)
                              ).profile.reduce_scatter_factor == 4.0


def test_an_agreeing_link_returns_the_profile_itself():
    c = correct_link_terms(PROFILE, _rates(), _rates(inter_bw=450e6, allreduce_bw=230e6))
    assert not c.differs and c.profile is PROFILE and c.changed == ()


def test_a_term_the_calibration_did_not_see_is_compared_with_its_other_all_to_all():
    # calibrated on one host x 2 ranks (loopback), run on 2 hosts x 1 rank at 100 Mbit/s
    one_host = _rates(intra_bw=800e6, intra_latency_s=300e-6, inter_bw=None, inter_latency_s=None,
                      hosts=1, ranks_per_host=2)
    c = correct_link_terms(PROFILE, one_host, _rates(inter_bw=12.5e6, allreduce_bw=12e6))
    assert any(d.startswith("topology") for d in c.differences)
    assert c.profile.inter_host_bw == pytest.approx(corrected_bandwidth(400e6, 2 * 800e6, 2 * 12.5e6))


def test_ranks_outnumbering_the_cores_slow_every_compute_term_by_the_share():
    # calibrated with 2 ranks on 2 cores, run with 4 ranks on the same 2 cores (2 emulated hosts)
    stored, measured = _rates(machine_ranks=2, machine_cores=2), _rates(machine_ranks=4, machine_cores=2)
    prof = attrs.evolve(PROFILE, lookup_overhead_s=10e-6, bwd_row_s=0.5e-6, dense_update_bw=2e9)
    c = correct_link_terms(prof, stored, measured)
    assert c.differences == ("ranks per core: stored was measured with 2 ranks on 2 cores (1 per core), "
                             "this job runs 4 ranks on 2 cores (2 per core)",)
    assert c.profile == attrs.evolve(with_slower_compute(prof, 2.0), name="step-fit-test+link")
    p = c.profile
    assert p.lookup_overhead_s == pytest.approx(20e-6) and p.bwd_row_s == pytest.approx(1e-6)
    assert p.hbm_bw == pytest.approx(prof.hbm_bw / 2) and p.dense_update_bw == pytest.approx(1e9)
    # the link terms: as the step fit set them (the job's link was measured under its own load)
    for f in ("intra_host_bw", "inter_host_bw", "allreduce_bw", "collective_latency_s"):
        assert getattr(p, f) == getattr(prof, f), f
    assert "compute terms (" in c.describe() and "2x slower" in c.describe()
    # fewer ranks per core than calibrated: faster by the same rule
    back = correct_link_terms(prof, measured, stored)
    assert back.profile.lookup_overhead_s == pytest.approx(5e-6)
    # the same share on another machine, fewer ranks than cores, or a side not measured: no difference
    for a, b in (((2, 2), (4, 4)), ((1, 2), (2, 2)), ((None, None), (4, 2))):
        c = correct_link_terms(prof, _rates(machine_ranks=a[0], machine_cores=a[1]),
                               _rates(machine_ranks=b[0], machine_cores=b[1]))
        assert not c.differs and c.profile is prof, (a, b)


def test_with_slower_compute_scales_rates_and_seconds_and_keeps_fallbacks():
    prof = attrs.evolve(PROFILE, step_overhead_s=2e-3, cold_row_s=70e-9, chunk_overhead_s=3e-4, chunk_feature_s=3e-5,
                        dedup_id_s=8e-9)
    slow = with_slower_compute(prof, 1.5)
    for f in COMPUTE_RATE_FIELDS:
        v = getattr(prof, f)
        assert getattr(slow, f) == (None if v is None else pytest.approx(v / 1.5)), f
        assert slow.rate(f) == pytest.approx(prof.rate(f) / 1.5), f  # a None rate falls back to a slower one
    for f in COMPUTE_TIME_FIELDS:
        assert getattr(slow, f) == pytest.approx(getattr(prof, f) * 1.5), f
    assert slow.inter_host_bw == prof.inter_host_bw and slow.uvm_bw == prof.uvm_bw
    assert with_slower_compute(prof, 1) is prof
    for bad in (0, -1.0, float("nan"), True, "2"):
        with pytest.raises(ValueError, match="with_slower_compute: factor="):
            with_slower_compute(prof, bad)


# ---------------------------------------------------------------- a host's ranks sharing one link


def _two_by_two(ratio=None, **overrides) -> LinkRates:
    """2 hosts x 2 ranks; ``ratio``: one rank alone over each of all, one-way (None: not measured)."""
    solo = dict(inter_oneway_bw=60e6, inter_solo_bw=60e6 * ratio) if ratio is not None else {}
    return _rates(ranks_per_host=2, intra_bw=800e6, intra_latency_s=300e-6, **solo, **overrides)


def test_a_measured_shared_host_link_is_set_on_the_profile_when_nothing_else_differs():
    # the stored link is an older record (sharing not measured); everything else agrees
    c = correct_link_terms(PROFILE, _two_by_two(), _two_by_two(2.0))
    assert c.differs and c.profile.host_link_shared is True and c.profile.name == "step-fit-test+link"
    assert c.changed == (("host_link_shared", 0.0, 1.0),)
    assert c.differences == ("host link (host_link_shared): the profile prices a link per rank, this job measured "
                             "shared by the host's 2 ranks (one rank sending alone 2.00x the rate of each with all)",)
    assert attrs.evolve(c.profile, host_link_shared=False, name=PROFILE.name) == PROFILE  # nothing else moved
    assert "host_link_shared False -> True" in c.describe()
    # a profile that already says so: returned as is
    shared = attrs.evolve(PROFILE, host_link_shared=True)
    same = correct_link_terms(shared, _two_by_two(), _two_by_two(2.0))
    assert not same.differs and same.profile is shared
    # sharing not measured now: the profile's flag is left as it is
    assert correct_link_terms(shared, _two_by_two(), _two_by_two()).profile is shared


def test_stored_and_measured_sharing_that_differ_correct_the_flag_alone():
    shared = attrs.evolve(PROFILE, host_link_shared=True)
    c = correct_link_terms(shared, _two_by_two(1.98), _two_by_two(1.02))
    assert [d.split(":")[0] for d in c.differences] == ["host link (host_link_shared)"]
    assert c.profile.host_link_shared is False and c.changed == (("host_link_shared", 1.0, 0.0),)
    assert "host_link_shared True -> False" in c.describe()
    # stored and measured differ, but the profile already has the measured value: no field moves
    already = correct_link_terms(PROFILE, _two_by_two(1.98), _two_by_two(1.02))
    assert already.differs and already.profile is PROFILE and already.changed == ()


def test_a_one_host_profile_used_on_hosts_sharing_a_link_gets_the_flag_with_the_other_corrections():
    one_host = _rates(intra_bw=800e6, intra_latency_s=300e-6, inter_bw=None, inter_latency_s=None,
                      hosts=1, ranks_per_host=2)
    c = correct_link_terms(PROFILE, one_host, _two_by_two(2.0, inter_bw=12.5e6))
    assert c.differences[0].startswith("topology")
    assert not any("host_link_shared" in d for d in c.differences)  # the topology already flags it
    assert c.profile.host_link_shared is True
    assert c.profile.inter_host_bw == pytest.approx(corrected_bandwidth(400e6, 2 * 800e6, 2 * 12.5e6))
    assert ("host_link_shared", 0.0, 1.0) in c.changed


def test_with_link_facts_takes_the_measured_sharing_and_leaves_the_profile_otherwise():
    assert with_link_facts(PROFILE, _two_by_two(2.0)).host_link_shared is True
    assert with_link_facts(PROFILE, _two_by_two(2.0)) == attrs.evolve(PROFILE, host_link_shared=True)
    shared = attrs.evolve(PROFILE, host_link_shared=True)
    assert with_link_facts(shared, _two_by_two(1.0)).host_link_shared is False
    for unknown in (None, _two_by_two(), _rates(hosts=1, inter_bw=None, inter_latency_s=None, ranks_per_host=2,
                                                intra_bw=8e8, intra_latency_s=3e-4)):
        assert with_link_facts(PROFILE, unknown) is PROFILE and with_link_facts(shared, unknown) is shared
    assert with_link_facts(PROFILE, _two_by_two(1.0)) is PROFILE


def test_the_calibration_takes_the_link_latency_and_a_correction_moves_it_with_the_link():
    from torchrec_sparselift.calibration.link import with_link_latency

    # the calibration's link: the inter-host all-to-all latency on several hosts, else the intra-host one
    assert with_link_latency(PROFILE, _two_by_two()).link_latency_s == 130e-6
    one_host = _rates(hosts=1, inter_bw=None, inter_latency_s=None, ranks_per_host=2, intra_bw=8e8,
                      intra_latency_s=3e-4)
    calibrated = with_link_latency(PROFILE, one_host)
    assert calibrated.link_latency_s == 3e-4
    assert with_link_latency(PROFILE, None) is PROFILE
    # moved to a link whose latency differs beyond the noise: the job's, as collective_latency_s shifts
    slow = _two_by_two(inter_latency_s=5e-3)
    moved = correct_link_terms(calibrated, one_host, slow).profile
    assert moved.link_latency_s == 5e-3
    assert moved.collective_latency_s == pytest.approx(calibrated.collective_latency_s + 5e-3 - 3e-4)
    # within the noise, or a profile calibrated without it: left as it is (a plan cache keyed on
    # the profile stays valid from one job to the next)
    on_two = with_link_latency(PROFILE, _two_by_two())
    near = correct_link_terms(on_two, _two_by_two(), _two_by_two(inter_latency_s=1.6e-4, inter_bw=40e6)).profile
    assert near.link_latency_s == 130e-6 and near.inter_host_bw < on_two.inter_host_bw
    assert correct_link_terms(PROFILE, one_host, slow).profile.link_latency_s is None
    # the facts a job's link measures leave it alone
    assert with_link_facts(calibrated, slow).link_latency_s == 3e-4


def test_the_replica_sync_rates_are_taken_as_measured_and_price_the_2d_sync():
    from torchrec_sparselift.cost.two_d import replica_sync_s
    from torchrec_sparselift.semantics.layout import Layout2D

    link = _two_by_two(2.0, replica_intra_bw=380e6, replica_inter_bw=58e6)
    p = with_link_facts(PROFILE, link)
    assert (p.replica_intra_bw, p.replica_inter_bw, p.host_link_shared) == (380e6, 58e6, True)
    assert with_link_facts(p, link) is p
    # a stored profile moved to the job's link takes the job's, whether or not anything else differs
    from torchrec_sparselift.calibration.term_error import profile_on_link

    assert profile_on_link(PROFILE, link, link, "stored.json").profile.replica_intra_bw == 380e6
    # the sync's bytes at the measured rate of the link its replica groups cross, two calls' latency
    inside, across = Layout2D(4, 2, 2, "strided"), Layout2D(4, 2, 2, "contiguous")
    assert inside.replica_sync_intra_host and not across.replica_sync_intra_host
    lat = 2 * p.collective_latency_s
    assert replica_sync_s(38e6, inside, p) == pytest.approx(lat + 38e6 / 380e6)
    assert replica_sync_s(38e6, across, p) == pytest.approx(lat + 38e6 / 58e6)
    # not measured (presets, older profiles): the all-to-all rate of the same link
    assert replica_sync_s(38e6, inside, PROFILE) == pytest.approx(lat + 38e6 / PROFILE.intra_host_bw)


def _calibrate_with_fakes(rank: int, world_size: int, links) -> list:
    """calibrate_steps on one gloo rank with its measurements and fit replaced, once per link (a
    LinkRates dict): the fitted profiles it returns, as dicts."""
    from torchrec_sparselift.calibration.records import HostTermRecord
    from torchrec_sparselift.measure import steps

    import torch.distributed as dist

    host = HostTermRecord(optimizer_tensor_s=1e-6, optimizer_byte_s=1e-10, bucketize_id_s=1e-8)
    steps.host_terms = lambda pg=None: host
    steps.measure_probes = lambda *a, **k: []
    steps.fit_measurements = lambda ms, base, *a, **k: (attrs.evolve(base, name="fitted"), None, [], [])
    return [steps.calibrate_steps(dist.group.WORLD, "cuda", base=PROFILE, progress=False,
                                  link=LinkRates.from_dict(d))[0].to_dict() for d in links]


def test_the_step_calibration_stores_the_sharing_its_link_measured():
    links = [_two_by_two(2.0).to_dict(), _two_by_two(1.0).to_dict()]
    shared, per_rank = run_ranks(_calibrate_with_fakes, 1, links)[0]
    assert shared["name"] == "fitted" and shared["host_link_shared"] is True
    assert per_rank["host_link_shared"] is False


# ---------------------------------------------------------------- the store


def test_the_store_keeps_the_link_and_reads_a_profile_without_one(tmp_path):
    store = ProfileStore(str(tmp_path))
    fp = current_fingerprint("cpu", 2)
    path = store.save(PROFILE, fp, {"fit": {}}, link=_rates(hosts=1, ranks_per_host=2, intra_bw=800e6,
                                                             intra_latency_s=3e-4, inter_bw=None,
                                                             inter_latency_s=None))
    found, diff = store.lookup(fp)
    assert diff == [] and found.path == path and found.profile == PROFILE
    assert found.link.intra_bw == 800e6 and found.link.hosts == 1
    assert auto_profile_link("cpu", 2, store, warn=lambda m: None)[2] == found.link
    # recorded before the machine share was measured: one host's ranks on the fingerprint's cores
    assert (found.link.machine_ranks, found.link.machine_cores) == (2, fp.cores)
    two_hosts = _rates()
    store.save(PROFILE, fp, {"fit": {}}, link=two_hosts)
    assert store.lookup(fp)[0].link == two_hosts  # emulated hosts may share a machine: left unknown
    measured = _rates(machine_ranks=3, machine_cores=1)
    store.save(PROFILE, fp, {"fit": {}}, link=measured)
    assert store.lookup(fp)[0].link == measured  # a measured share is kept as measured
    store.save(PROFILE, fp, {"fit": {}})  # no link record: loads, its link unknown
    assert store.lookup(fp)[0].link is None
    assert auto_profile_link("cpu", 2, store, warn=lambda m: None)[2] is None


def test_hosts_join_the_fingerprint_and_leave_one_host_digests_as_they_were(tmp_path):
    fp = current_fingerprint("cpu", 1)
    old = {k: v for k, v in fp.to_dict().items() if k != "hosts"}  # a record from before the field
    assert MachineFingerprint.from_dict(old) == fp
    import hashlib

    assert fp.digest() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    two = current_fingerprint("cpu", 1, hosts=2)
    assert two.digest() != fp.digest() and fp.differences(two) == ["hosts: 1 vs 2"]
    store = ProfileStore(str(tmp_path))
    store.save(PROFILE, fp)
    found, diff = store.lookup(two)  # only a one-host profile: the closest, named as another machine's
    assert found is not None and diff == ["hosts: 2 vs 1"]
    warned = []
    auto_profile("cpu", 1, store, warn=warned.append, hosts=2)
    assert warned and "hosts: 2 vs 1" in warned[0]


def test_the_planner_with_hardware_auto_corrects_the_stored_link_and_warns_once(tmp_path, monkeypatch):
    from torchrec.distributed.planner import Topology

    from torchrec_sparselift.planner import SparseLiftPlanner

    store = ProfileStore(str(tmp_path))
    store.save(PROFILE, current_fingerprint("cpu", 1, hosts=2), {"fit": {}}, link=_rates())
    monkeypatch.setenv(PROFILE_STORE_ENV, str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topo = Topology(world_size=2, local_world_size=1, compute_device="cpu")
    planner = SparseLiftPlanner(topology=topo, batch_size=64, hardware="auto")
    assert planner.hardware == PROFILE  # no process group, no link: the stored profile as is
    on = planner.on_link(_rates(inter_bw=12.5e6))
    assert on.corrected and "inter_bw" in on.note and "430 MB/s" in on.note
    assert on.profile.inter_host_bw == pytest.approx(corrected_bandwidth(400e6, 2 * 430e6, 2 * 12.5e6))
    assert on.profile.allreduce_bw == PROFILE.allreduce_bw
    assert planner.hardware == PROFILE  # a value: the planner itself is not changed
    request = planner.request(meta_ebc(2, 100, 8), on_link=on)
    assert request.hardware.inter_host_bw == on.profile.inter_host_bw and request.model_errors is on.errors
    explicit = SparseLiftPlanner(topology=topo, batch_size=64, hardware=PROFILE)
    assert explicit.on_link(_rates(inter_bw=12.5e6)) is None  # the user's profile: left alone
    assert explicit.hardware is PROFILE


# ---------------------------------------------------------------- two emulated hosts

REASON = tb.unavailable_reason()

JOB = r"""
import json, sys, warnings
import torch.distributed as dist
from torchrec.distributed.planner import Topology
from torchrec_sparselift.measure.link import measure_link_rates
from torchrec_sparselift.planner import SparseLiftPlanner

dist.init_process_group("gloo")
# one attempt: the unshaped and the 100 Mbit/s rates are ~50x apart, far beyond any spread
link = measure_link_rates(repetitions=3, target_call_s=0.04, attempts=1)
if sys.argv[1] == "measure":
    if dist.get_rank() == 0:
        open(sys.argv[2], "w").write(link.to_json())
else:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topo = Topology(world_size=2, local_world_size=1, compute_device="cpu")
    planner = SparseLiftPlanner(topology=topo, batch_size=64, hardware="auto")
    on = planner.on_link(link)
    if dist.get_rank() == 0:
        out = {"link": link.to_dict(), "profile": on.profile.to_dict(),
               "warnings": [on.note] if on.note else []}
        open(sys.argv[2], "w").write(json.dumps(out))
dist.destroy_process_group()
"""


def _job(tmp_path, rate_bps, mode, store_dir):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / f"{mode}.json"
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, PROFILE_STORE_ENV: str(store_dir)}
    with tb.emulated_hosts(tb.HostLayout(hosts=2, ranks_per_host=1, rate_bps=rate_bps)) as bed:
        results = bed.torchrun([str(script), mode, str(out)], env=env, timeout_s=150)
    for r in results:
        assert r.ok, f"host {r.host}: exit {r.returncode}\n{r.output}"
    return json.loads(out.read_text())


@pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")
def test_a_profile_from_an_unshaped_link_is_corrected_under_100_mbit(tmp_path):
    store_dir = tmp_path / "store"
    unshaped = LinkRates.from_dict(_job(tmp_path, None, "measure", store_dir))
    # the profile a calibration on the unshaped hosts stores (its a2a and all-reduce fitted from steps)
    fitted = attrs.evolve(PROFILE, inter_host_bw=0.8 * unshaped.inter_bw, intra_host_bw=0.8 * unshaped.inter_bw,
                          allreduce_bw=0.8 * unshaped.allreduce_bw)
    ProfileStore(str(store_dir)).save(fitted, current_fingerprint("cpu", 1, hosts=2), {"fit": {}}, link=unshaped)
    out = _job(tmp_path, 100e6, "plan", store_dir)
    measured = LinkRates.from_dict(out["link"])
    assert len(out["warnings"]) == 1 and "inter_bw" in out["warnings"][0], out["warnings"]
    corrected = HardwareProfile.from_dict(out["profile"])
    # two profile bytes (sent + received) per measured byte sent, less the profile's own seconds per byte
    assert 1.5 * measured.inter_bw <= corrected.inter_host_bw <= 2.0 * measured.inter_bw, (
        corrected.inter_host_bw, measured.describe(), unshaped.describe())
    assert corrected.name.endswith("+link")


def _one_host(intra_bw: float, hosts: int = 1) -> LinkRates:
    return LinkRates(intra_bw=intra_bw, intra_latency_s=3e-4, inter_bw=None if hosts == 1 else 6e7,
                     inter_latency_s=None if hosts == 1 else 1e-3, spread=0.1, allreduce_bw=intra_bw,
                     allreduce_latency_s=3e-4, latency_spread_s=1e-4, hosts=hosts, ranks_per_host=2)


def test_on_one_host_only_a_loopback_several_times_apart_differs_not_the_machines_load():
    from torchrec_sparselift.calibration.link import ONE_HOST_BANDWIDTH_RATIO

    stored = _one_host(8e8)
    busy = attrs.evolve(_one_host(8e8 / 2.0), intra_latency_s=3e-3, allreduce_latency_s=3e-3)  # load
    shaped = _one_host(8e8 / (ONE_HOST_BANDWIDTH_RATIO * 4))  # a shaped loopback: another network
    assert links_differ(stored, busy) == []
    assert any("intra_bw" in d for d in links_differ(stored, shaped))
    assert any(d.startswith("topology") for d in links_differ(stored, _one_host(8e8, hosts=2)))
    two = _one_host(8e8, hosts=2)  # across hosts every term counts, latencies too
    assert any("inter_latency_s" in d for d in links_differ(two, attrs.evolve(two, inter_latency_s=1e-2)))


def test_a_replica_rate_within_its_noise_keeps_the_profile_and_a_1d_request_ignores_it():
    from torchrec_sparselift.calibration.link import replica_rate_differs

    link = _two_by_two(2.0, replica_intra_bw=380e6, spread=0.1)
    p = with_link_facts(PROFILE, link)
    # the next job on the same link reads 20% more: within the 25% floor, the profile stays
    assert with_link_facts(p, attrs.evolve(link, replica_intra_bw=456e6)) is p
    assert with_link_facts(p, attrs.evolve(link, replica_intra_bw=200e6)).replica_intra_bw == 200e6
    one_host = _rates(hosts=1, inter_bw=None, inter_latency_s=None, ranks_per_host=2, intra_bw=8e8,
                      intra_latency_s=3e-4)
    assert not replica_rate_differs(380e6, 2 * 380e6, one_host) and replica_rate_differs(380e6, 4 * 380e6, one_host)
    assert replica_rate_differs(None, 1.0, one_host)


def test_the_replica_rates_are_in_a_2d_request_fingerprint_only():
    from torchrec.distributed.planner import Topology

    from torchrec_sparselift.plan.request import PlanRequest

    topo = Topology(world_size=4, local_world_size=2, compute_device="cpu")
    other = attrs.evolve(PROFILE, replica_intra_bw=1e8)

    def key(profile, group):
        return PlanRequest(tables=(), topology=topo, batch_size=8, constraints={}, hardware=profile,
                           sharding_group_size=group).cache_key()

    assert key(PROFILE, None) == key(other, None)
    assert key(PROFILE, 2) != key(other, 2)


def test_a_damaged_link_record_makes_the_profile_unusable_everywhere_it_is_read(tmp_path):
    # the loader reads the link record with the rest: the plain `calibrate check`, hardware="auto"
    # and the link check all refuse the profile with one message naming the file, the field, the fix
    store = ProfileStore(str(tmp_path))
    path = store.save(PROFILE, current_fingerprint("cpu", 1, hosts=2), {"fit": {}}, link=_rates())
    doc = json.loads(open(path).read())
    doc["info"]["link"]["inter_bw"] = "fast"
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(FileFormatError) as e:
        store.load(path)
    assert path in str(e.value) and "info.link" in str(e.value) and "intra_bw" not in str(e.value)
    assert "inter_bw='fast'" in str(e.value) and "calibrate" in str(e.value)
    with pytest.raises(FileFormatError, match="info.link"):
        auto_profile_link("cpu", 1, store, warn=lambda m: None, hosts=2)
    env = {**os.environ, "TORCHREC_SPARSELIFT_PROFILE_DIR": str(tmp_path), "LOCAL_WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-m", "torchrec_sparselift", "calibrate", "check", "--store", str(tmp_path)],
                         capture_output=True, text=True, env=env)
    # this machine's fingerprint may differ from the stored one's hosts: the damaged file is named either way
    assert out.returncode == 1 and "info.link" in out.stdout + out.stderr, out.stdout + out.stderr
