"""The link measurement: the fit recovers latency and bandwidth, comparisons flag only differences
beyond noise, records round-trip through JSON, every rank gets the same rates, a shaped
emulated link measures at its rate, and the ranks of an emulated host are found to share its link
(those last two need root and tc; they skip with the reason).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import attrs
import numpy as np
import pytest

from launcher import run_ranks
from torchrec_sparselift.calibration.link import differing_terms
from torchrec_sparselift.measure import link
from torchrec_sparselift.measure import testbed as tb
from torchrec_sparselift.measure.link import LinkRates, LinkRatesError, links_differ

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _rates(**overrides) -> LinkRates:
    base = dict(
        intra_bw=700e6, intra_latency_s=300e-6, inter_bw=12.5e6, inter_latency_s=250e-6, spread=0.05,
        allreduce_bw=12e6, allreduce_latency_s=150e-6, latency_spread_s=20e-6, hosts=2, ranks_per_host=2,
    )  # fmt: skip
    base.update(overrides)
    return LinkRates(**base)


# ---------------------------------------------------------------- pure parts


def test_fit_recovers_latency_and_bandwidth_from_synthetic_timings():
    sizes = np.array([4096, 2 << 20, 8 << 20], dtype=float)
    lat, bw = link.fit_latency_bandwidth(sizes, 250e-6 + sizes / 12.5e6)
    assert lat == pytest.approx(250e-6, rel=1e-6)
    assert bw == pytest.approx(12.5e6, rel=1e-9)
    # five noisy repetitions: the medians still give both terms, the spread reflects the noise
    rng = np.random.default_rng(0)
    times = (300e-6 + sizes / 1e9) * rng.uniform(0.97, 1.03, size=(5, 3))
    lat, bw, spread, latency_spread = link.fit_family(sizes, times)
    assert lat == pytest.approx(300e-6, rel=0.1)
    assert bw == pytest.approx(1e9, rel=0.05)
    assert 0 < spread < 0.1 and 0 < latency_spread < 30e-6
    noisy = (300e-6 + sizes / 1e9) * rng.uniform(0.6, 1.4, size=(5, 3))
    assert link.fit_family(sizes, noisy)[2] > spread
    # a scheduling hiccup of 10 ms in one repetition of the small size moves neither term far
    sizes3 = np.array([4096, 4096, 4096, 2 << 20, 8 << 20], dtype=float)
    clean = np.tile(300e-6 + sizes3 / 1e9, (5, 1))
    clean[0, 0] = clean[3, 1] = 10e-3
    lat, bw, _, _ = link.fit_family(sizes3, clean)
    assert lat == pytest.approx(300e-6, rel=0.01) and bw == pytest.approx(1e9, rel=0.01)


def test_fit_refuses_one_size_and_times_that_do_not_grow():
    with pytest.raises(LinkRatesError, match="two or more"):
        link.fit_latency_bandwidth([4096, 4096], [1e-3, 1.1e-3])
    with pytest.raises(LinkRatesError, match="do not grow with message size"):
        link.fit_latency_bandwidth([4096, 1 << 20], [2e-3, 1e-3])
    with pytest.raises(LinkRatesError, match="positive"):
        link.fit_latency_bandwidth([4096, 1 << 20], [0.0, 1e-3])


def test_equal_or_within_spread_rates_do_not_differ():
    a = _rates()
    assert links_differ(a, a) == []
    # 20% slower links, 2x latency within its floor, under a 30% measured spread: noise
    b = _rates(inter_bw=10.4e6, intra_bw=580e6, allreduce_bw=10e6, inter_latency_s=450e-6, spread=0.3)
    assert links_differ(a, b) == []
    # a latency 5x larger but only 60 us apart is below the absolute floor
    assert links_differ(_rates(intra_latency_s=15e-6), _rates(intra_latency_s=75e-6)) == []
    # 1.85 ms apart is noise when the latencies were measured to wander by 2 ms, not otherwise
    assert links_differ(_rates(), _rates(allreduce_latency_s=2e-3, latency_spread_s=2e-3)) == []
    assert "allreduce_latency_s" in links_differ(_rates(), _rates(allreduce_latency_s=2e-3))[0]


def test_a_difference_beyond_spread_names_the_term_and_both_values():
    stored = _rates(inter_bw=118e6)  # an unshaped box's profile
    measured = _rates(inter_bw=36e6, inter_latency_s=2e-3)
    diffs = links_differ(stored, measured)
    assert len(diffs) == 2, diffs
    bw_line = next(d for d in diffs if "inter_bw" in d)
    assert "inter-host all-to-all bandwidth" in bw_line
    assert "118 MB/s" in bw_line and "36 MB/s" in bw_line and "0.31x" in bw_line
    lat_line = next(d for d in diffs if "inter_latency_s" in d)
    assert "250 us" in lat_line and "2000 us" in lat_line
    # the spread widens the allowance: 40% apart is noise under a 50% spread, not under 5%
    assert links_differ(_rates(intra_bw=1e9), _rates(intra_bw=0.71e9, spread=0.5)) == []
    assert [d.split(" (")[0] for d in links_differ(_rates(intra_bw=1e9), _rates(intra_bw=0.71e9))] == [
        "intra-host all-to-all bandwidth"
    ]


def test_another_topology_or_an_unmeasured_term_is_a_difference():
    one_host = _rates(hosts=1, ranks_per_host=2, inter_bw=None, inter_latency_s=None)
    diffs = links_differ(one_host, _rates())
    assert diffs[0] == "topology: stored was measured on 1 host x 2 ranks, this job runs 2 hosts x 2 ranks"
    assert any("inter_bw" in d and "stored not measured" in d and "12.5 MB/s" in d for d in diffs)


def test_json_round_trip_and_clear_errors():
    for rates in (_rates(), _rates(hosts=1, ranks_per_host=4, inter_bw=None, inter_latency_s=None)):
        assert LinkRates.from_json(rates.to_json()) == rates
        assert LinkRates.from_dict(json.loads(json.dumps(rates.to_dict()))) == rates
    data = _rates().to_dict()
    with pytest.raises(LinkRatesError, match=r"unknown fields \['bogus'\].*missing fields \['spread'\]"):
        LinkRates.from_dict({**{k: v for k, v in data.items() if k != "spread"}, "bogus": 1})
    with pytest.raises(LinkRatesError, match="malformed"):
        LinkRates.from_json("{not json")
    with pytest.raises(LinkRatesError, match="JSON object"):
        LinkRates.from_dict([1, 2])
    with pytest.raises(LinkRatesError) as e:
        LinkRates.from_dict({**data, "inter_bw": -1.0, "spread": "low", "hosts": 0})
    for culprit in ("inter_bw=-1.0", "spread='low'", "hosts=0"):
        assert culprit in str(e.value)
    with pytest.raises(LinkRatesError, match="intra_bw and intra_latency_s must be None with ranks_per_host=1"):
        attrs.evolve(_rates(), ranks_per_host=1)
    with pytest.raises(LinkRatesError, match="inter_bw and inter_latency_s are needed with hosts=2"):
        _rates(inter_bw=None, inter_latency_s=None)


def test_the_machine_share_is_optional_both_or_neither_and_read_from_older_records():
    shared = _rates(machine_ranks=4, machine_cores=2)
    assert shared.ranks_per_core == 2.0 and shared.machine == "4 ranks on 2 cores"
    assert "4 ranks on 2 cores" in shared.describe()
    assert _rates(machine_ranks=1, machine_cores=2).ranks_per_core == 1.0  # a rank computes on one core
    assert LinkRates.from_json(shared.to_json()) == shared
    # a record written before the share was measured: read, the share unknown
    older = {k: v for k, v in _rates().to_dict().items() if not k.startswith("machine_")}
    assert LinkRates.from_dict(older).ranks_per_core is None
    assert _rates().machine == "ranks per core not measured"
    with pytest.raises(LinkRatesError, match="machine_ranks=4, machine_cores=None: give both or neither"):
        _rates(machine_ranks=4)
    with pytest.raises(LinkRatesError, match="machine_cores=0: give an integer >= 1"):
        _rates(machine_ranks=4, machine_cores=0)


def _sharing(ratio: float, ranks_per_host: int = 2, **overrides) -> LinkRates:
    """Two hosts whose one-way rates are ``ratio`` apart (one rank alone over each of all)."""
    return _rates(ranks_per_host=ranks_per_host, inter_oneway_bw=60e6, inter_solo_bw=60e6 * ratio, **overrides)


def test_a_host_link_is_shared_when_one_rank_alone_sends_well_past_its_share():
    # 2 ranks per host: the line is 1.5x (halfway between a link per rank, 1x, and one link, 2x)
    assert _sharing(2.0).host_link_shared is True
    assert _sharing(1.5).host_link_shared is True
    assert _sharing(1.49).host_link_shared is False
    assert _sharing(1.0).host_link_shared is False
    # 4 ranks per host: halfway between 1x and 4x is 2.5x
    assert _sharing(2.5, ranks_per_host=4).host_link_shared is True
    assert _sharing(2.4, ranks_per_host=4).host_link_shared is False
    # the symmetric all-to-all rate does not enter the rule (an exchange can stop short of the link)
    assert _sharing(2.0, inter_bw=200e6).host_link_shared is True
    # not measured: a record without the one-way rates
    assert _rates().host_link_shared is None and _rates().host_link == "sharing not measured"


def test_sharing_is_measured_only_on_several_hosts_of_several_ranks_both_rates_or_neither():
    with pytest.raises(LinkRatesError, match="inter_oneway_bw=60000000.0, inter_solo_bw=None: give both or neither"):
        _rates(inter_oneway_bw=6e7)
    one_host = dict(hosts=1, inter_bw=None, inter_latency_s=None)
    with pytest.raises(LinkRatesError, match="must be None with hosts=1, ranks_per_host=2"):
        _rates(inter_oneway_bw=6e7, inter_solo_bw=1.2e8, **one_host)
    with pytest.raises(LinkRatesError, match="must be None with hosts=2, ranks_per_host=1"):
        _rates(inter_oneway_bw=6e7, inter_solo_bw=1.2e8, ranks_per_host=1, intra_bw=None, intra_latency_s=None)
    with pytest.raises(LinkRatesError, match="inter_solo_bw=0.0: give a finite number > 0"):
        _rates(inter_oneway_bw=6e7, inter_solo_bw=0.0)


def test_the_sharing_rates_round_trip_and_older_records_read_as_not_measured():
    shared = _sharing(1.99)
    assert LinkRates.from_json(shared.to_json()) == shared and LinkRates.from_json(shared.to_json()).host_link_shared
    text = shared.describe()
    assert "one-way" in text and "60 MB/s" in text and "119.4 MB/s" in text, text
    assert "host link shared by the host's 2 ranks (one rank sending alone 1.99x" in text, text
    assert "one per rank (one rank sending alone 1.05x" in _sharing(1.05).describe()
    assert "one-way" not in _rates().describe()  # unknown: not mentioned
    # a record written before sharing was measured: read, sharing unknown
    older = {k: v for k, v in shared.to_dict().items() if k not in ("inter_oneway_bw", "inter_solo_bw")}
    assert LinkRates.from_dict(older).host_link_shared is None
    assert LinkRates.from_dict(older) == _rates()


def test_stored_and_measured_sharing_that_disagree_differ_and_unknown_sharing_does_not():
    per_rank, shared = _sharing(1.05), _sharing(1.98)
    diffs = differing_terms(shared, per_rank)
    assert [t for t, _ in diffs] == ["host_link_shared"], diffs
    assert diffs[0][1] == ("host link (host_link_shared): stored shared by the host's 2 ranks (one rank sending "
                           "alone 1.98x the rate of each with all), measured one per rank (one rank sending alone "
                           "1.05x the rate of each with all)")
    (back,) = links_differ(per_rank, shared)
    assert back.startswith("host link (host_link_shared): stored one per rank") and "measured shared by" in back
    # the same verdict at other one-way rates is no difference (the rates only decide sharing)
    assert links_differ(shared, _sharing(3.0)) == []
    # unknown on either side: not compared
    assert links_differ(_rates(), shared) == [] and links_differ(shared, _rates()) == []


def test_ranks_group_into_hosts_by_key():
    assert link.host_groups(["a/node0", "a/node0", "a/node1", "a/node1"]) == [[0, 1], [2, 3]]
    assert link.host_groups(["x/node", "y/node", "x/node", "y/node"]) == [[0, 2], [1, 3]]
    with pytest.raises(LinkRatesError, match="same --nproc_per_node"):
        link.host_groups(["a", "a", "b"])


# ---------------------------------------------------------------- real process groups


def _measure(rank: int, world_size: int) -> tuple:
    rates = link.measure_link_rates(repetitions=3, target_call_s=0.02).to_dict()

    def fails(*args):
        raise LinkRatesError("times do not grow")

    link.fit_family = fails  # this process only: rank 0's fit fails, every rank must hear of it
    try:
        link.measure_link_rates(repetitions=1, target_call_s=0.005)
        error = None
    except LinkRatesError as e:
        error = str(e)
    return rates, error


def test_two_gloo_ranks_on_loopback_agree_on_their_rates_and_on_a_failed_fit():
    results = run_ranks(_measure, 2, timeout_s=120)
    assert results[0][0] == results[1][0]
    assert results[0][1] == results[1][1] == "times do not grow (family intra)"
    rates = LinkRates.from_dict(results[0][0])
    assert (rates.hosts, rates.ranks_per_host) == (1, 2)
    assert rates.inter_bw is None and rates.intra_bw > 10e6 and rates.allreduce_bw > 10e6
    # one host: no link between hosts to share
    assert rates.inter_oneway_bw is None and rates.inter_solo_bw is None and rates.host_link_shared is None
    # the replica sync's collective within the host; no hosts to sync across
    assert rates.replica_intra_bw > 10e6 and rates.replica_inter_bw is None
    # the machine share: both ranks on this machine, its cores
    assert (rates.machine_ranks, rates.machine_cores) == (2, os.cpu_count())
    assert rates.ranks_per_core == max(1.0, 2 / os.cpu_count())


REASON = tb.unavailable_reason()


def _measure_on_testbed(tmp_path, rate_bps):
    out = tmp_path / f"rates_{rate_bps}.json"
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    # calls of 100 ms: the largest call at 100 Mbit/s is 1.25 MB, 20x the token bucket's 64 KB burst
    argv = ["-m", "torchrec_sparselift.measure.link", "--repetitions", "3", "--target-call-ms", "100",
            "--json", str(out)]
    with tb.emulated_hosts(tb.HostLayout(hosts=2, ranks_per_host=1, rate_bps=rate_bps)) as bed:
        results = bed.torchrun(argv, env=env, timeout_s=120)
    for r in results:
        assert r.ok, f"host {r.host}: exit {r.returncode}\n{r.output}"
    return LinkRates.from_json(out.read_text())


@pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")
def test_a_100_mbit_link_between_two_emulated_hosts_measures_at_its_rate(tmp_path):
    # both testbeds at once (their namespaces and ports are their own): half the wall time
    with ThreadPoolExecutor(2) as pool:
        shaped, unshaped = pool.map(lambda rate: _measure_on_testbed(tmp_path, rate), (100e6, None))
    assert (shaped.hosts, shaped.ranks_per_host) == (2, 1) and shaped.intra_bw is None
    # both measure at the shaped rate (calls of 0.1 s, largest first: a token bucket's burst
    # is a small part of each timed size); a rank's all-to-all sends and
    # receives over one connection and reaches about half the rate per direction on per-host links
    # (0.47-0.5 measured, docs/testbed.md)
    assert 0.8 * 12.5e6 <= shaped.allreduce_bw <= 1.25 * 12.5e6, shaped.describe()
    # the replica sync's coalesced all-reduce across the link: its rate too; no host of 2 ranks
    assert 0.7 * 12.5e6 <= shaped.replica_inter_bw <= 1.25 * 12.5e6 and shaped.replica_intra_bw is None
    assert 0.4 * 12.5e6 <= shaped.inter_bw <= 1.25 * 12.5e6, shaped.describe()
    assert unshaped.inter_bw > 2 * shaped.inter_bw, (shaped.describe(), unshaped.describe())
    assert any("inter_bw" in d for d in links_differ(unshaped, shaped))


def test_a_noisy_measurement_does_not_hide_a_link_several_times_slower():
    fast = LinkRates(intra_bw=None, intra_latency_s=None, inter_bw=7e8, inter_latency_s=1e-4, spread=30.0,
                     allreduce_bw=3e8, allreduce_latency_s=1e-4, latency_spread_s=1e-4, hosts=2, ranks_per_host=1)
    slow = attrs.evolve(fast, inter_bw=1.2e7, spread=0.05)
    assert any("inter_bw" in d for d in links_differ(fast, slow))
    assert not any("inter_bw" in d for d in links_differ(fast, attrs.evolve(fast, inter_bw=4e8)))  # 1.75x: noise


def _measured(spread, bw=5.8e7):
    return LinkRates(intra_bw=None, intra_latency_s=None, inter_bw=bw, inter_latency_s=5e-4, spread=spread,
                     allreduce_bw=6e7, allreduce_latency_s=1e-3, latency_spread_s=1e-4, hosts=2, ranks_per_host=1)


def _fake_measure(outcomes, log, record="target_call_s"):
    """A stand-in for ``link._measure_once`` returning (or raising) ``outcomes`` in turn; each call
    appends its ``target_call_s`` (or, ``record="sharing"``, whether it was asked to measure
    sharing) to ``log``."""
    def once(repetitions, target_call_s, min_bytes, max_bytes, sharing=True):
        log.append(sharing if record == "sharing" else target_call_s)
        out = outcomes[len(log) - 1]
        if isinstance(out, Exception):
            raise out
        return out
    return once


def test_a_measurement_whose_repetitions_disagree_is_taken_again_and_the_steadiest_kept(monkeypatch):
    calls = []

    def fake(outcomes):
        return _fake_measure(outcomes, calls)

    # disturbed (18% spread, the rate read low), then quiet: the quiet one, and no third call
    monkeypatch.setattr(link, "_measure_once", fake([_measured(0.18, bw=4.37e7), _measured(0.02), _measured(0.5)]))
    got = link.measure_link_rates(target_call_s=0.25)
    assert got.spread == 0.02 and got.inter_bw == 5.8e7 and calls == [0.25, 0.25]
    # a quiet first measurement is taken once
    calls.clear()
    monkeypatch.setattr(link, "_measure_once", fake([_measured(0.01)]))
    assert link.measure_link_rates().spread == 0.01 and len(calls) == 1
    # never under max_spread (a loopback's CPU-bound rates): the smallest spread of all attempts
    calls.clear()
    monkeypatch.setattr(link, "_measure_once", fake([_measured(0.4), _measured(0.15), _measured(0.3)]))
    assert link.measure_link_rates().spread == 0.15 and len(calls) == 3
    # one host: kept at once, however wide its spread (a loopback's comparison counts only
    # bandwidths several times apart)
    calls.clear()
    one_host = attrs.evolve(_measured(0.4), hosts=1, ranks_per_host=2, inter_bw=None, inter_latency_s=None,
                            intra_bw=6e8, intra_latency_s=4e-4)
    monkeypatch.setattr(link, "_measure_once", fake([one_host, _measured(0.01)]))
    assert link.measure_link_rates() == one_host and len(calls) == 1
    # a failed fit is measured again with calls twice as long; the last failure raises
    calls.clear()
    monkeypatch.setattr(link, "_measure_once", fake([link._FitFailed("flat"), _measured(0.03)]))
    assert link.measure_link_rates(target_call_s=0.25).spread == 0.03 and calls == [0.25, 0.5]
    calls.clear()
    monkeypatch.setattr(link, "_measure_once", fake([link._FitFailed("flat")] * 3))
    with pytest.raises(LinkRatesError, match="flat"):
        link.measure_link_rates()
    # a fit that fails after a noisy measurement returns that measurement
    calls.clear()
    monkeypatch.setattr(link, "_measure_once", fake([_measured(0.3), link._FitFailed("flat"), link._FitFailed("flat")]))
    assert link.measure_link_rates().spread == 0.3


def _two_by_two(ratio: float, spread: float) -> LinkRates:
    solo = dict(inter_oneway_bw=6e7, inter_solo_bw=6e7 * ratio) if ratio else {}
    return _rates(spread=spread, **solo)


def test_the_sharing_rates_are_measured_once_and_kept_with_the_steadiest_attempt(monkeypatch):
    asked = []
    # the first attempt measures sharing (noisy exchanges), the later ones do not
    monkeypatch.setattr(link, "_measure_once",
                        _fake_measure([_two_by_two(2.0, 0.3), _two_by_two(0, 0.05)], asked, "sharing"))
    got = link.measure_link_rates()
    assert asked == [True, False]
    assert got.spread == 0.05 and (got.inter_oneway_bw, got.inter_solo_bw) == (6e7, 1.2e8)
    assert got.host_link_shared is True
    # a first attempt whose fit fails measured nothing: the next one measures sharing
    asked.clear()
    monkeypatch.setattr(link, "_measure_once",
                        _fake_measure([link._FitFailed("flat"), _two_by_two(1.0, 0.02)], asked, "sharing"))
    assert link.measure_link_rates().host_link_shared is False and asked == [True, True]


SHARING_JOB = r"""
import sys
import torch.distributed as dist
from torchrec_sparselift.measure.link import measure_link_rates

dist.init_process_group("gloo")
rates = measure_link_rates(repetitions=3, target_call_s=0.1, attempts=1)
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(rates.to_json())
dist.destroy_process_group()
"""


@pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")
def test_the_ranks_of_an_emulated_host_are_found_to_share_its_link(tmp_path):
    # 2 hosts x 2 ranks at 300 Mbit/s: each host's ranks cross one shaped veth
    script, out = tmp_path / "job.py", tmp_path / "rates.json"
    script.write_text(SHARING_JOB)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    with tb.emulated_hosts(tb.HostLayout(hosts=2, ranks_per_host=2, rate_bps=300e6)) as bed:
        results = bed.torchrun([str(script), str(out)], env=env, timeout_s=120)
    for r in results:
        assert r.ok, f"host {r.host}: exit {r.returncode}\n{r.output}"
    rates = LinkRates.from_json(out.read_text())
    assert (rates.hosts, rates.ranks_per_host) == (2, 2)
    # one rank alone sends at about the link's rate (37.5 MB/s; TCP goodput ~95%), each of two about half
    assert 0.8 * 37.5e6 <= rates.inter_solo_bw <= 1.1 * 37.5e6, rates.describe()
    assert rates.host_link_shared is True, rates.describe()


def test_the_replica_sync_rates_round_trip_and_older_records_read_as_not_measured():
    r = _rates(replica_intra_bw=3.8e8, replica_inter_bw=5.8e7)
    assert LinkRates.from_json(r.to_json()) == r
    assert "replica sync, hosts" in r.describe()
    old = {k: v for k, v in _rates().to_dict().items() if not k.startswith("replica_")}
    assert LinkRates.from_dict(old).replica_intra_bw is None
    with pytest.raises(LinkRatesError, match="replica_inter_bw=0"):
        _rates(replica_inter_bw=0)
