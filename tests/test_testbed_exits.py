"""The testbed's command line on every exit path: it reports the job's own exit code (torchrun
exits 1 whatever its worker's code was) and leaves nothing behind (namespaces, veth links, tc
qdiscs, /etc/netns entries, processes) after a normal exit, a failed job, a bad option (exit 2
before anything is created), Ctrl-C (exit 130) and SIGTERM (exit 143) of the driver.

Needs root and iproute2; skipped with the testbed's reason otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from torchrec_sparselift.measure import testbed as tb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REASON = tb.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"testbed unavailable: {REASON}")

JOB = """\
import os, sys, time
host = int(os.environ["SPARSELIFT_TESTBED_HOST"])
with open(os.path.join(sys.argv[1], f"pid{host}"), "w") as f:
    f.write(str(os.getpid()))
mode = sys.argv[2]
if mode == "fail" and host == 1:
    sys.exit(3)
if mode == "wait":
    print("job started", flush=True)
    time.sleep(120)
if mode == "fail":
    time.sleep(2)
print(f"job done on host {host}", flush=True)
"""


def _state(pid=None):
    """What the machine has that the testbed run of driver ``pid`` could leave behind (other
    runs on the machine may come and go meanwhile: only this driver's namespaces count)."""
    mine = tb.PREFIX if pid is None else f"{tb.PREFIX}{pid}x"
    def out(*argv):
        return subprocess.run(argv, capture_output=True, text=True).stdout

    namespaces = {line.split()[0] for line in out("ip", "netns", "list").splitlines() if line.strip()}
    links = {line.split(":")[1].strip().split("@")[0] for line in out("ip", "-o", "link", "show").splitlines()}
    etc = set(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else set()
    return {
        "namespaces": {n for n in namespaces if n.startswith(mine)},
        "links": links,
        "qdiscs": out("tc", "qdisc", "show"),
        "etc_netns": {n for n in etc if n.startswith(mine)},
    }


def _alive(pid_file):
    if not os.path.exists(pid_file):
        return False
    pid = int(open(pid_file).read())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _driver(tmp_path, mode, *flags, sigint=signal.SIG_DFL):
    """The testbed's command line on JOB in ``mode``, started with SIGINT's disposition
    ``sigint`` (a shell's ``command &`` without job control starts it ignored)."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "torchrec_sparselift.measure.testbed", "--hosts", "2", *flags, "--timeout", "150",
         "--", str(job), str(tmp_path), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


def _left_behind(before, tmp_path, proc):
    after = _state(proc.pid)
    before = {**before, "namespaces": set(), "etc_netns": set()}
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    for host in (0, 1):
        assert not _alive(str(tmp_path / f"pid{host}")), f"the job's process on host {host} outlived the driver"


def test_a_job_that_succeeds_exits_0_and_leaves_nothing(tmp_path):
    before = _state()
    proc = _driver(tmp_path, "ok", "--rate", "1gbit")
    out, err = proc.communicate(timeout=170)
    assert proc.returncode == 0, err
    assert "job done on host 0" in out and "job done on host 1" in out
    assert "testbed: host 0: exit 0" in err and "testbed: job exit 0" in err
    _left_behind(before, tmp_path, proc)


def test_a_failed_job_exits_with_its_own_code_printed_and_leaves_nothing(tmp_path):
    before = _state()
    proc = _driver(tmp_path, "fail", "--rate", "1gbit", "--grace", "3")
    out, err = proc.communicate(timeout=170)
    assert proc.returncode == 3, err  # torchrun on host 1 exits 1: the code is the job's own
    assert "testbed: host 1: exit 1 (job exit 3)" in err, err
    assert "testbed: job exit 3 (host 1 failed first)" in err, err
    _left_behind(before, tmp_path, proc)


@pytest.mark.parametrize("flags, says", [
    (["--rate", "1gb"], "rate"),
    (["--hosts", "0"], "hosts=0"),
    (["--packet", "100"], "packet_bytes=100"),
    (["--colour", "red"], "unrecognized arguments"),
])
def test_a_bad_option_exits_2_before_creating_anything(tmp_path, flags, says):
    before = _state()
    proc = _driver(tmp_path, "ok", *flags)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert says in err and "Traceback" not in err, err
    assert not (tmp_path / "pid0").exists()  # the job never started
    _left_behind(before, tmp_path, proc)


@pytest.mark.parametrize("sig, code, inherited", [
    (signal.SIGINT, 130, signal.SIG_DFL),
    # started with SIGINT ignored (a background job of a script, as a suite run with `&` starts
    # pytest): Ctrl-C still tears down, not the job's own end or timeout
    (signal.SIGINT, 130, signal.SIG_IGN),
    (signal.SIGTERM, 128 + signal.SIGTERM, signal.SIG_DFL),
], ids=["SIGINT", "SIGINT-inherited-ignored", "SIGTERM"])
def test_a_signal_to_the_driver_tears_everything_down(tmp_path, sig, code, inherited):
    before = _state()
    proc = _driver(tmp_path, "wait", sigint=inherited)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"pid{h}").exists() for h in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    assert _state(proc.pid)["namespaces"]  # the hosts exist while the job runs
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "the emulated hosts were removed" in err and "Traceback" not in err, err
    _left_behind(before, tmp_path, proc)
