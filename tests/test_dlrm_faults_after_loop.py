"""A rank lost after the train loop (killed at the last step: the survivor fails in the result's
reductions or the last barrier, outside the loop) ends the job as a rank lost in the loop does:
one error naming the lost rank and its last finished step, bounded by ``--collective-timeout``,
no traceback (the DLRM example, 2 gloo ranks; tests/test_dlrm_faults.py has the faults inside the
loop)."""

from __future__ import annotations

import re

import pytest

from launcher import run_script, start_script
from test_dlrm_faults import TINY, TRAIN

LAST = TINY[TINY.index("--steps") + 1]


def test_a_rank_killed_at_the_last_step_is_named_by_the_survivor(tmp_path):
    res = run_script(TRAIN, [*TINY, "--plan-cache", str(tmp_path / "plans"), "--fail-at-step", LAST,
                             "--fail-how", "kill", "--fail-rank", "1", "--collective-timeout", "60"],
                     2, timeout_s=300)
    assert res.returncodes[1] == -9, res.tail()
    assert res.returncodes[0] == 1, res.tail()
    err = res.stderrs[0]
    assert f"lost rank 1 (last finished step {LAST})" in err, err
    assert "its connections closed (a process killed)" in err and "Traceback" not in err, err
    waited = float(re.search(r"failed, ([0-9.]+) s after this rank's last finished step", err).group(1))
    assert waited < 30, err


@pytest.mark.slow  # ~45 s: the collective timeout, the roll call and two example starts
def test_a_rank_silent_after_the_last_step_ends_the_job_within_the_collective_timeout(tmp_path):
    timeout = 8
    ranks = start_script(TRAIN, [*TINY, "--plan-cache", str(tmp_path / "plans"), "--fail-at-step", LAST,
                                 "--fail-how", "hang", "--fail-rank", "1", "--collective-timeout", str(timeout)],
                         2, timeout_s=300)
    try:
        code = ranks.wait_rank(0, timeout_s=240)
    finally:
        ranks.kill_rank(1)  # stopped (SIGSTOP): it never exits by itself
    res = ranks.wait()
    assert code == 1, res.tail()
    err = res.stderrs[0]
    assert f"no answer within the collective timeout of {timeout} s" in err, err
    assert f"lost rank 1 (last finished step {LAST})" in err and "Traceback" not in err, err
    waited = float(re.search(r"failed, ([0-9.]+) s after this rank's last finished step", err).group(1))
    assert timeout <= waited < timeout + 5 + 10, err
