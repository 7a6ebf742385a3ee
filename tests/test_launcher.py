"""The test launcher (tests/launcher.py): results in rank order, a rank's error reaches the test,
hangs end at the timeout, TorchRec's native abort is run again once, scripts run as ranks."""

import os
import sys
import time

import pytest

from launcher import LaunchError, LaunchTimeout, NativeAbort, run_ranks, run_script, start_script


def _who(rank, world_size, tag):
    return (rank, world_size, tag, os.environ["RANK"], os.environ["WORLD_SIZE"])


def _gloo_rank(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return (dist.get_rank(), dist.get_world_size(), float(t))


def _rank_1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 refuses this input")
    time.sleep(600)  # rank 0 would wait for rank 1 forever: the launcher stops it


def _sleeps(rank, world_size):
    time.sleep(600)


def _aborts_the_first_time(rank, world_size, marker):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()  # as TorchRec's native "terminate called without an active exception" does
    return rank


def _exits_quietly(rank, world_size):
    if rank == 0:
        os._exit(3)
    time.sleep(600)


def test_results_come_back_in_rank_order_with_each_rank_environment():
    got = run_ranks(_who, 3, "x", backend=None, timeout_s=60)
    assert got == [(r, 3, "x", str(r), "3") for r in range(3)]


@pytest.mark.multiprocess
def test_gloo_ranks_share_a_process_group():
    assert run_ranks(_gloo_rank, 2, timeout_s=120) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_a_rank_that_raises_fails_the_launch_with_its_traceback_and_stops_the_others():
    with pytest.raises(LaunchError, match="rank 1 raised") as info:
        run_ranks(_rank_1_raises, 2, backend=None, timeout_s=300)
    assert "ValueError: rank 1 refuses this input" in str(info.value)
    assert "_rank_1_raises" in str(info.value)  # the traceback, not just the message
    assert not isinstance(info.value, LaunchTimeout)  # rank 0 was stopped, not waited for


def test_ranks_past_the_timeout_are_killed_with_a_message_naming_them():
    with pytest.raises(LaunchTimeout, match=r"ranks \[0, 1\] of 2 did not finish _sleeps within 2 s"):
        run_ranks(_sleeps, 2, backend=None, timeout_s=2)


def test_a_rank_killed_without_a_python_error_is_named_with_its_exit():
    with pytest.raises(LaunchError, match="rank 0 of 2 exited with code 3 without a Python error") as info:
        run_ranks(_exits_quietly, 2, backend=None, timeout_s=60, retry_native_abort=True)
    assert not isinstance(info.value, NativeAbort)  # only SIGABRT is run again


def test_native_abort_is_run_again_once_only_when_asked(tmp_path):
    marker = str(tmp_path / "aborted")
    with pytest.raises(NativeAbort, match="rank 1 of 2 was killed by SIGABRT without a Python error"):
        run_ranks(_aborts_the_first_time, 2, marker, backend=None, timeout_s=60)
    os.remove(marker)
    assert run_ranks(_aborts_the_first_time, 2, marker, backend=None, timeout_s=60,
                     retry_native_abort=True) == [0, 1]
    assert os.path.exists(marker)  # it did abort once


_SCRIPT = """
import os, sys, time
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "port", os.environ["MASTER_PORT"], *sys.argv[1:])
if sys.argv[1:] == ["fail"] and os.environ["RANK"] == "1":
    sys.exit("rank 1 failed")
if sys.argv[1:] == ["hang"]:
    time.sleep(600)
"""


def test_a_script_runs_as_ranks_with_torchrun_environment(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(_SCRIPT)
    res = run_script(str(script), ["hello"], 2, timeout_s=60)
    assert res.ok and res.returncodes == (0, 0)
    port = res.stdouts[0].split()[5]
    assert res.stdouts == (f"rank 0 of 2 port {port} hello\n", f"rank 1 of 2 port {port} hello\n")
    assert res.stdout == res.stdouts[0]

    failed = start_script(str(script), ["fail"], 2, timeout_s=60).wait()
    assert failed.returncodes == (0, 1) and not failed.ok
    assert "rank 1 failed" in failed.stderr and "--- rank 1: exit 1" in failed.tail()


def test_a_script_past_its_timeout_is_killed_and_its_output_shown(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(_SCRIPT)
    with pytest.raises(LaunchTimeout, match="did not finish within 3 s") as info:
        run_script(str(script), ["hang"], 2, timeout_s=3, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert "rank 0 of 2" in str(info.value) and sys.executable in str(info.value)
