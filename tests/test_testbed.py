"""The emulated-host testbed: spec validation, shaping that takes effect, teardown that leaves
nothing behind, and a real torchrun + gloo job across two emulated hosts.

Everything past validation needs root and iproute2; those tests skip with the reason the testbed
gives (checked once, at collection).
"""

from __future__ import annotations

import os
import re
import signal
import shutil
import subprocess
import sys
import time

import pytest

from torchrec_sparselift.measure import testbed as tb
from torchrec_sparselift.measure.testbed.__main__ import main as tb_main

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "testbed_allreduce_job.py")
REASON = tb.unavailable_reason()
needs_testbed = pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")


def _root_links() -> set:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _namespaces() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# ---------------------------------------------------------------- no root needed


def test_topology_lists_every_problem_with_its_fix():
    with pytest.raises(tb.HostLayoutError) as e:
        tb.HostLayout(hosts=0, ranks_per_host=0, rate_bps=-1.0, burst_bytes=100, queue_latency_s=0.0)
    msg = str(e.value)
    for culprit in ("hosts=0", "ranks_per_host=0", "rate_bps=-1.0", "burst_bytes=100", "queue_latency_s=0.0"):
        assert culprit in msg
    with pytest.raises(tb.HostLayoutError, match="shared link needs a rate"):
        tb.HostLayout(hosts=2, shared=True)
    # the bucket holds two of the largest packets: packet_bytes between hosts, 64 KiB on a loopback
    with pytest.raises(tb.HostLayoutError, match=r"burst_bytes=32768: give at least 65536 .*packet_bytes=32768"):
        tb.HostLayout(hosts=2, rate_bps=1e9, packet_bytes=32768, burst_bytes=32768)
    with pytest.raises(tb.HostLayoutError, match=r"burst_bytes=65536: give at least 131072 .*loopback"):
        tb.HostLayout(hosts=1, ranks_per_host=2, rate_bps=1e9, burst_bytes=65536)
    with pytest.raises(tb.HostLayoutError, match=r"packet_bytes=100: give an integer from 1500"):
        tb.HostLayout(hosts=2, rate_bps=1e9, packet_bytes=100)
    assert tb.HostLayout(hosts=2, rate_bps=1e9).largest_packet == 16 * 1024
    with pytest.raises(tb.HostLayoutError, match="hosts=True"):
        tb.HostLayout(hosts=True)
    t = tb.HostLayout(hosts=2, ranks_per_host=4, rate_bps=1e9)
    assert t.world_size == 8
    assert t.describe() == "2 hosts x 4 ranks, 1 Gbit/s per host link per direction"
    assert "one shared 300 Mbit/s link" in tb.HostLayout(hosts=2, rate_bps=3e8, shared=True).describe()


def test_rates_and_sizes_parse_in_tc_units():
    assert tb.parse_rate("1gbit") == 1e9
    assert tb.parse_rate("300mbit") == 3e8
    assert tb.parse_rate("100kbit") == 1e5
    assert tb.parse_rate("1e9") == 1e9
    assert tb.parse_size("512kb") == 512 * 1024
    assert tb.parse_size("64kb") == tb.HostLayout(hosts=2).burst_bytes
    assert tb.parse_size("256kb") == tb.HostLayout(hosts=1, ranks_per_host=2, rate_bps=1e9).burst_bytes
    assert tb.parse_size("65536") == 65536
    with pytest.raises(tb.HostLayoutError, match="1gbit"):
        tb.parse_rate("1 gigabit")
    with pytest.raises(tb.HostLayoutError, match="512kb"):
        tb.parse_size("lots")


def test_unavailable_reason_names_root_and_missing_tools(monkeypatch):
    tb.unavailable_reason.cache_clear()
    try:
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        assert "needs root" in tb.unavailable_reason()
        tb.unavailable_reason.cache_clear()
        monkeypatch.setattr(os, "geteuid", lambda: 0)
        monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
        reason = tb.unavailable_reason()
        assert "tc not found" in reason and "iproute2" in reason
    finally:
        tb.unavailable_reason.cache_clear()


def test_cli_refuses_a_bad_topology_before_touching_the_network(capsys):
    assert tb_main(["--hosts", "0", "--rate", "1gbit", "--check"]) == 2
    assert "hosts=0" in capsys.readouterr().err
    assert tb_main(["--rate", "fast", "--check"]) == 2
    assert "rate 'fast'" in capsys.readouterr().err


def test_the_module_imports_without_torch():
    code = "import sys, torchrec_sparselift.measure.testbed; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(HERE))


# ---------------------------------------------------------------- on emulated hosts


@needs_testbed
def test_a_shaped_link_measures_its_rate_and_an_unshaped_one_is_faster():
    with tb.emulated_hosts(tb.HostLayout(hosts=2, rate_bps=100e6)) as bed:
        shaped = bed.measure_link(0, 1, bulk_bytes=8 << 20, round_trips=50)
        back = bed.measure_link(1, 0, bulk_bytes=8 << 20, round_trips=50)
        time.sleep(0.2)  # an idle link: the bucket refills
        short = bed.measure_link(0, 1, bulk_bytes=512 << 10, round_trips=5)
    with tb.emulated_hosts(tb.HostLayout(hosts=2)) as bed:
        free = bed.measure_link(0, 1, bulk_bytes=32 << 20, round_trips=50)
    # a functional check of the shaping on a noisy machine, not a performance claim
    assert 60e6 <= shaped.bandwidth_bps <= 110e6, shaped
    assert 60e6 <= back.bandwidth_bps <= 110e6, back
    assert free.bandwidth_bps > 2 * shaped.bandwidth_bps, (free, shaped)
    # a short transfer after an idle moment gets no more than the small bucket at the veth's own
    # speed: about its rate, as on a real link (a 512 KiB bucket sent it all at once)
    assert short.bandwidth_bps <= 1.4 * 100e6, short
    assert 0 < shaped.latency_s < 0.05


@needs_testbed
def test_a_shared_link_is_split_between_both_directions():
    rate, size = 100e6, 8 << 20
    with tb.emulated_hosts(tb.HostLayout(hosts=2, rate_bps=rate, shared=True)) as bed:
        both = bed.measure_links([(0, 1), (1, 0)], bulk_bytes=size, round_trips=20)
    alone_s = 8 * size / rate
    # both transfers crossed one 100 Mbit/s queue: the later one finished at about twice the
    # time one alone would take (per-host links would let both run at the full rate)
    assert max(m.bulk_s for m in both) >= 1.5 * alone_s, both
    assert 8 * 2 * size / max(m.bulk_s for m in both) <= 1.15 * rate, both


@needs_testbed
def test_a_shaped_loopback_caps_one_hosts_ranks():
    with tb.emulated_hosts(tb.HostLayout(hosts=1, ranks_per_host=2, rate_bps=100e6)) as bed:
        assert bed.master_addr == "127.0.0.1" and bed.interface(0) == "lo"
        m = bed.measure_link(0, 0, bulk_bytes=8 << 20, round_trips=20)
    assert 60e6 <= m.bandwidth_bps <= 110e6, m


@needs_testbed
def test_teardown_leaves_nothing_behind_when_the_body_raises():
    links_before = _root_links()
    with pytest.raises(RuntimeError, match="body failed"):
        with tb.emulated_hosts(tb.HostLayout(hosts=3, rate_bps=1e9)) as bed:
            names = set(bed.host_namespaces) | {bed.switch_namespace}
            assert names <= _namespaces()
            sleeper = bed.popen(1, ["sleep", "60"])
            raise RuntimeError("body failed")
    assert not names & _namespaces()
    assert not [n for n in names if os.path.exists(os.path.join("/etc/netns", n))]
    assert _root_links() == links_before
    assert sleeper.poll() is not None
    with pytest.raises(tb.TestbedError, match="torn down"):
        bed.run(0, ["true"])


@needs_testbed
def test_leftovers_of_dead_runs_are_removed_and_live_runs_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"sltb{dead.pid}x0dead-h0", "sltb1x0live-h0"  # pid 1 is alive
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = tb.cleanup_stale()
        assert stale in removed and live not in removed
        assert live in _namespaces() and stale not in _namespaces()
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@needs_testbed
def test_sigterm_tears_the_testbed_down():
    code = (
        "import sys, time\n"
        "from torchrec_sparselift.measure import testbed as tb\n"
        "with tb.emulated_hosts(tb.HostLayout(hosts=2, rate_bps=1e9)) as bed:\n"
        "    bed.popen(0, ['sleep', '60'])\n"
        "    print(' '.join(bed.host_namespaces + [bed.switch_namespace]), flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(HERE))
    names = set(proc.stdout.readline().split())
    assert names and names <= _namespaces()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not names & _namespaces()


@needs_testbed
def test_torchrun_all_reduce_across_two_emulated_hosts():
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE)}
    with tb.emulated_hosts(tb.HostLayout(hosts=2, ranks_per_host=2, rate_bps=1e9)) as bed:
        results = bed.torchrun([JOB, "65536"], env=env, timeout_s=180)
    for r in results:
        assert r.ok, f"host {r.host}: exit {r.returncode}\n{r.output}"
    # a host's ranks share its output stream: two ranks' lines can interleave without a newline
    lines = [m for r in results for m in re.findall(r"OK rank \d+ of \d+ on host \d+ via \S+: sum \d+", r.output)]
    assert sorted(lines) == [
        "OK rank 0 of 4 on host 0 via tb0: sum 10",
        "OK rank 1 of 4 on host 0 via tb0: sum 10",
        "OK rank 2 of 4 on host 1 via tb0: sum 10",
        "OK rank 3 of 4 on host 1 via tb0: sum 10",
    ]


@needs_testbed
def test_a_failing_host_ends_the_job_after_the_grace_period(tmp_path):
    script = tmp_path / "fail_on_host_1.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['SPARSELIFT_TESTBED_HOST'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    with tb.emulated_hosts(tb.HostLayout(hosts=2)) as bed:
        results = bed.torchrun([str(script)], timeout_s=120, grace_s=2)
    assert time.monotonic() - t0 < 60
    assert results[1].returncode != 0 and not results[1].killed
    assert results[1].job_returncode == 3  # the worker's own code, from torchrun's failure report
    assert results[0].killed and results[0].returncode is None
