"""Faults during training (the DLRM example, 2 gloo ranks as separate processes, one per emulated
host): a rank killed mid-run (its connections close) and a rank that stops answering (its
connections stay open, as when its host or link is gone). The surviving rank stops by itself
within the collective timeout the example sets (``--collective-timeout``), with one error naming
the lost rank and its last finished step; a run resumed from the last checkpoint has the
uninterrupted run's losses (tests/test_dlrm_checkpoint.py). A full disk during a checkpoint stops
the run naming the directory and keeps the last complete checkpoint (a small tmpfs; needs root)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from typing import Any, Iterator, List

import pytest

from launcher import ROOT, run_script, start_script
from torchrec_sparselift.measure import testbed as tb

TRAIN = os.path.join(ROOT, "examples", "dlrm", "train.py")
TINY = ["--tables", "kaggle", "--scale", "0.0001", "--embedding-dim", "16", "--batch-size", "64", "--steps", "12",
        "--warmup-steps", "1", "--no-progress", "--pipeline", "sparse_dist", "--device", "cpu"]


HANG_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    """The job of the hang test below, rank 1 stopping at step 4 (SIGSTOP). Started by the first
    test that asks for it (the kill test, before its own job), so the survivor's idle wait for the
    collective timeout and the roll call runs while that test and the full-disk tests work; the
    hang test, after them, collects it."""
    plans = tmp_path_factory.mktemp("hung") / "plans"
    ranks = start_script(TRAIN, [*TINY, "--plan-cache", str(plans), "--fail-at-step", "4", "--fail-how", "hang",
                                 "--fail-rank", "1", "--collective-timeout", str(HANG_TIMEOUT_S)],
                         2, timeout_s=300)
    yield ranks
    for rank in (0, 1):
        ranks.kill_rank(rank)


def test_a_killed_rank_stops_the_other_at_once_naming_it(tmp_path, hung_job):
    ranks = start_script(TRAIN, [*TINY, "--plan-cache", str(tmp_path / "plans"), "--fail-at-step", "4",
                                 "--fail-how", "kill", "--fail-rank", "1", "--collective-timeout", "60"],
                         2, timeout_s=300)
    res = ranks.wait()
    assert res.returncodes[1] == -9, res.tail()
    assert res.returncodes[0] == 1, res.tail()
    err = res.stderrs[0]
    assert "its connections closed (a process killed)" in err and "lost rank 1 (last finished step 4)" in err, err
    assert "Traceback" not in err
    # it did not wait for the timeout: the failure is seen as soon as the connections close
    waited = float(re.search(r"failed, ([0-9.]+) s after this rank's last finished step", err).group(1))
    assert waited < 30, err


@contextlib.contextmanager
def small_disk(path: str, kib: int) -> Iterator[str]:
    """A tmpfs of ``kib`` KiB mounted at ``path`` for the block (the test skips where it cannot
    mount one: not root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount -t tmpfs)")
    os.makedirs(path, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", path], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {out.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], capture_output=True)


def test_a_full_disk_during_a_checkpoint_fails_clearly_and_keeps_the_last_checkpoint(tmp_path):
    # ~1 MB a checkpoint: the first fits in 1.6 MB, the second (written before the first is
    # removed) does not; the run stops naming the directory, latest.json still names the first,
    # and a run resumed from it (on a disk with room) has the uninterrupted run's losses
    common = [*TINY, "--plan-cache", str(tmp_path / "plans")]
    with small_disk(str(tmp_path / "disk"), 1600) as disk:
        # the uninterrupted run is independent of the full one: side by side (the runs may share
        # a plan cache, tests/test_dlrm_checkpoint.py); collected after the disk is unmounted
        whole_run = start_script(TRAIN, [*common, "--out", str(tmp_path / "whole.json")], 2, timeout_s=300)
        full = run_script(TRAIN, [*common, "--checkpoint-dir", os.path.join(disk, "ck"), "--checkpoint-every", "2"],
                          2, timeout_s=300)
        assert not full.ok
        err = full.stderrs[0]
        # the OS's words depend on which write the full disk cuts short (ENOSPC, or torch's writer
        # finding a short write: "unexpected pos"); the run's own message is the same either way
        assert "cannot save checkpoint" in err and ("No space left on device" in err or "unexpected pos" in err), \
            full.tail()
        assert f"check free space and permissions of {disk}/ck" in err and "Traceback" not in err, full.tail()
        latest = json.loads(open(os.path.join(disk, "ck", "latest.json")).read())
        assert latest["step"] == 2
        saved = str(tmp_path / "ck")
        shutil.copytree(os.path.join(disk, "ck"), saved)
    whole = whole_run.wait()
    assert whole.ok, whole.tail()
    resumed = run_script(TRAIN, [*common, "--checkpoint-dir", saved, "--checkpoint-every", "100",
                                 "--out", str(tmp_path / "resumed.json")], 2, timeout_s=300)
    assert resumed.ok and "resumed from the checkpoint after step 2" in resumed.stdout, resumed.tail()
    want = json.loads((tmp_path / "whole.json").read_text())["losses"]
    got = json.loads((tmp_path / "resumed.json").read_text())
    assert got["first_step"] == 3 and got["losses"] == want[2:]


def test_a_checkpoint_directory_on_a_full_disk_is_refused_naming_it(tmp_path):
    with small_disk(str(tmp_path / "disk"), 4) as disk:
        try:  # fill it
            with open(os.path.join(disk, "filler"), "wb") as f:
                f.write(b"x" * 8192)
        except OSError:
            pass
        res = run_script(TRAIN, [*TINY, "--plan-cache", str(tmp_path / "plans"), "--checkpoint-dir",
                                 os.path.join(disk, "ck")], 2, timeout_s=300)
    assert not res.ok
    assert f"cannot use checkpoint directory {disk}/ck (No space left on device)" in res.stderrs[0], res.tail()
    assert "Traceback" not in res.stderr


def test_a_rank_that_stops_answering_ends_the_job_within_the_collective_timeout(hung_job):
    timeout, ranks = HANG_TIMEOUT_S, hung_job
    try:
        code = ranks.wait_rank(0, timeout_s=240)
    finally:
        ranks.kill_rank(1)  # stopped (SIGSTOP): as a host whose link is gone, it never exits by itself
    res = ranks.wait()
    assert code == 1, res.tail()
    err = res.stderrs[0]
    assert f"no answer within the collective timeout of {timeout} s" in err, err
    assert "lost rank 1 (last finished step 4)" in err and "Traceback" not in err, err
    # bounded: the timeout, the few seconds the survivors wait for each other, and one step
    waited = float(re.search(r"failed, ([0-9.]+) s after this rank's last finished step", err).group(1))
    assert timeout <= waited < timeout + 5 + 10, err


# -- on the testbed: 2 emulated hosts x 1 rank, a real link between them ----------------------

TESTBED_REASON = tb.unavailable_reason()
needs_testbed = pytest.mark.skipif(TESTBED_REASON is not None, reason=f"testbed unavailable: {TESTBED_REASON}")
LONG = [a if a != "12" else "1500" for a in TINY] + ["--hardware", "cpu-gloo"]  # a fixed profile: the same plan


def _training(checkpoints: str, timeout_s: float = 120) -> None:
    """Wait until the run has checkpointed once (it is training)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(checkpoints, "latest.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint in {checkpoints} after {timeout_s} s")
        time.sleep(0.05)


def _switch_port(bed: Any, host: int, state: str) -> None:
    """The switch's port to ``host`` down or up: the host loses its carrier as when a cable is
    pulled (its address and routes stay, as a NIC's do; an admin ``down`` on the host's own
    interface would flush its routes, which ``up`` does not bring back)."""
    subprocess.run(["ip", "-n", bed.switch_namespace, "link", "set", f"p{host}", state], check=True)


def _train_on_testbed(tmp_path, name: str, extra: List[str], during: Any = None,
                      timeout_s: float = 300) -> List[Any]:
    """The example under torchrun on 2 emulated hosts (1 Gbit/s), checkpointing every 300 steps
    into ``tmp_path/name``; ``during(bed, checkpoints)`` runs beside it."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    checkpoints = str(tmp_path / name)
    args = [TRAIN, *LONG, "--plan-cache", str(tmp_path / "plans"), "--out", str(tmp_path / f"{name}.json"),
            "--checkpoint-dir", checkpoints, "--checkpoint-every", "300", *extra]
    with tb.emulated_hosts(tb.HostLayout(hosts=2, ranks_per_host=1, rate_bps=1e9)) as bed:
        worker = threading.Thread(target=during, args=(bed, checkpoints), daemon=True) if during else None
        if worker:
            worker.start()
        results = bed.torchrun(args, env=env, timeout_s=timeout_s, grace_s=30)
        if worker:
            worker.join(timeout=60)
    return results


@needs_testbed
@pytest.mark.slow
def test_a_link_down_for_a_few_seconds_loses_nothing(tmp_path):
    # host 1's link goes down for 3 s mid-run and comes back: TCP resends, the run finishes with
    # the losses of the same run without the outage
    def flap(bed, checkpoints):
        _training(checkpoints)
        _switch_port(bed, 1, "down")
        time.sleep(3)
        _switch_port(bed, 1, "up")

    clean = _train_on_testbed(tmp_path, "clean", [])
    assert all(r.ok for r in clean), "\n".join(r.output[-2000:] for r in clean)
    flapped = _train_on_testbed(tmp_path, "flapped", [], during=flap)
    assert all(r.ok for r in flapped), "\n".join(r.output[-2000:] for r in flapped)
    want = json.loads((tmp_path / "clean.json").read_text())["losses"]
    assert json.loads((tmp_path / "flapped.json").read_text())["losses"] == want


@needs_testbed
@pytest.mark.slow
def test_a_link_gone_for_good_ends_the_job_within_the_timeout_naming_the_lost_rank(tmp_path):
    timeout = 10
    cut = {}

    def cut_link(bed, checkpoints):
        _training(checkpoints)
        _switch_port(bed, 1, "down")  # and never up again
        cut["at"] = time.monotonic()

    results = _train_on_testbed(tmp_path, "cut", ["--collective-timeout", str(timeout), "--steps", "100000"],
                                during=cut_link)
    ended = time.monotonic()
    assert "at" in cut and not any(r.ok for r in results)
    host0 = results[0].output
    assert "lost rank 1" in host0 and f"no answer within the collective timeout of {timeout} s" in host0, host0[-3000:]
    host1 = results[1].output
    assert "cannot be reached either" in host1 or "lost rank 0" in host1, host1[-3000:]
    # bounded by the timeout, the roll call and the testbed's grace for the other host, not 30 minutes
    assert ended - cut["at"] < timeout + 5 + 30 + 30
