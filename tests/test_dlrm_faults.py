"""Faults during training (the DLRM example, 2 gloo ranks as separate processes, one per emulated
host): a rank killed mid-run (its connections close) and a rank that stops answering (its
connections stay open, as when its host or link is gone). The surviving rank stops by itself
within the collective timeout the example sets (``--collective-timeout``), with one error naming
the lost rank and its last finished step; a run resumed from the last checkpoint has the
uninterrupted run's losses (tests/test_dlrm_checkpoint.py)."""

from __future__ import annotations

import os
import re

from launcher import ROOT, start_script

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
