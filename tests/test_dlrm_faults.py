"""Faults during training (the DLRM example, 2 gloo ranks as separate processes, one per emulated
host): a rank killed mid-run (its connections close) and a rank that stops answering (its
connections stay open, as when its host or link is gone). The surviving rank stops by itself
within the collective timeout the example sets (``--collective-timeout``), with one error naming
the lost rank and its last finished step; a run resumed from the last checkpoint has the
uninterrupted run's losses (tests/test_dlrm_checkpoint.py). A full disk during a checkpoint stops
the run naming the directory and keeps the last complete checkpoint (a small tmpfs; needs root)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from typing import Optional

import pytest

from launcher import ROOT, run_script, start_script

TRAIN = os.path.join(ROOT, "examples", "dlrm", "train.py")
TINY = ["--tables", "kaggle", "--scale", "0.0001", "--embedding-dim", "16", "--batch-size", "64", "--steps", "12",
        "--warmup-steps", "1", "--no-progress", "--pipeline", "sparse_dist", "--device", "cpu"]


def test_a_killed_rank_stops_the_other_at_once_naming_it(tmp_path):
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


def test_a_rank_that_stops_answering_ends_the_job_within_the_collective_timeout(tmp_path):
    timeout = 8
    ranks = start_script(TRAIN, [*TINY, "--plan-cache", str(tmp_path / "plans"), "--fail-at-step", "4",
                                 "--fail-how", "hang", "--fail-rank", "1", "--collective-timeout", str(timeout)],
                         2, timeout_s=300)
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


def _mount_small_disk(path: str, kib: int) -> Optional[str]:
    """A tmpfs of ``kib`` KiB at ``path`` (None: mounted; else why not)."""
    if os.geteuid() != 0:
        return "needs root (mount -t tmpfs)"
    os.makedirs(path, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", path], capture_output=True, text=True)
    return None if out.returncode == 0 else f"mount -t tmpfs failed: {out.stderr.strip()}"


def test_a_full_disk_during_a_checkpoint_fails_clearly_and_keeps_the_last_checkpoint(tmp_path):
    # ~1 MB a checkpoint: the first fits in 1.6 MB, the second (written before the first is
    # removed) does not; the run stops naming the directory, latest.json still names the first,
    # and a run resumed from it (on a disk with room) has the uninterrupted run's losses
    disk = str(tmp_path / "disk")
    why = _mount_small_disk(disk, 1600)
    if why:
        pytest.skip(why)
    try:
        common = [*TINY, "--plan-cache", str(tmp_path / "plans")]
        whole = run_script(TRAIN, [*common, "--out", str(tmp_path / "whole.json")], 2, timeout_s=300)
        assert whole.ok, whole.tail()
        full = run_script(TRAIN, [*common, "--checkpoint-dir", os.path.join(disk, "ck"), "--checkpoint-every", "2"],
                          2, timeout_s=300)
        assert not full.ok
        err = full.stderrs[0]
        assert "cannot save checkpoint" in err and "No space left on device" in err, full.tail()
        assert f"check free space and permissions of {disk}/ck" in err and "Traceback" not in err, full.tail()
        latest = json.loads(open(os.path.join(disk, "ck", "latest.json")).read())
        assert latest["step"] == 2
        saved = str(tmp_path / "ck")
        shutil.copytree(os.path.join(disk, "ck"), saved)
    finally:
        subprocess.run(["umount", disk], capture_output=True)
    resumed = run_script(TRAIN, [*common, "--checkpoint-dir", saved, "--checkpoint-every", "100",
                                 "--out", str(tmp_path / "resumed.json")], 2, timeout_s=300)
    assert resumed.ok and "resumed from the checkpoint after step 2" in resumed.stdout, resumed.tail()
    want = json.loads((tmp_path / "whole.json").read_text())["losses"]
    got = json.loads((tmp_path / "resumed.json").read_text())
    assert got["first_step"] == 3 and got["losses"] == want[2:]


def test_a_checkpoint_directory_on_a_full_disk_is_refused_naming_it(tmp_path):
    disk = str(tmp_path / "disk")
    why = _mount_small_disk(disk, 4)
    if why:
        pytest.skip(why)
    try:
        try:  # fill it
            with open(os.path.join(disk, "filler"), "wb") as f:
                f.write(b"x" * 8192)
        except OSError:
            pass
        res = run_script(TRAIN, [*TINY, "--plan-cache", str(tmp_path / "plans"), "--checkpoint-dir",
                                 os.path.join(disk, "ck")], 2, timeout_s=300)
    finally:
        subprocess.run(["umount", disk], capture_output=True)
    assert not res.ok
    assert f"cannot use checkpoint directory {disk}/ck (No space left on device)" in res.stderrs[0], res.tail()
    assert "Traceback" not in res.stderr
