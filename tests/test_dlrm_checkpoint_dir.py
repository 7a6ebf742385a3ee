"""One run per checkpoint directory, and damaged checkpoints as one-line errors (the DLRM
example: torchrec_sparselift.dlrm.checkpoint and examples/dlrm/train.py).

A second run on a directory another run is using stops at once naming that run's pid and
deletes nothing; a checkpoint whose shard is damaged (DCP raises ``CheckpointException``, a
``BaseException``) ends the example with one error line and a non-zero exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from launcher import run_script
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from torchrec_sparselift.dlrm.checkpoint import CheckpointDirLock, CheckpointError, describe_checkpoint_exception

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dlrm")
TRAIN = os.path.join(EXAMPLE, "train.py")

TINY = ["--tables", "kaggle", "--scale", "0.0001", "--embedding-dim", "16", "--batch-size", "64",
        "--warmup-steps", "1", "--no-progress", "--no-plan-cache", "--device", "cpu"]

# A run that saves checkpoints of a small model on its own 1-rank gloo group: once the file
# START exists (none given: at once) it claims the directory, waiting up to WAIT s
# (checkpoint.LOCK_WAIT_S, none given: the example's) for a held lock, saves step 1, waits for
# the file GO, then saves steps 2..STEPS. Refused, it prints the refusal and then how long it
# waited.
SAVER = r"""
import os, sys, time
import torch, torch.distributed as dist
from torchrec_sparselift.dlrm import checkpoint
from torchrec_sparselift.dlrm.checkpoint import CheckpointError, claim_checkpoint_dir, save_checkpoint
directory, steps, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
start = sys.argv[4] if len(sys.argv) > 4 else None
if len(sys.argv) > 5:
    checkpoint.LOCK_WAIT_S = float(sys.argv[5])
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
while start is not None and not os.path.exists(start):
    time.sleep(0.05)
t0 = time.monotonic()
try:
    lock = claim_checkpoint_dir(directory)
except CheckpointError as e:
    print("REFUSED", e, flush=True)
    print(f"WAITED {time.monotonic() - t0:.3f}", flush=True)
    sys.exit(2)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, steps + 1):
    save_checkpoint(directory, step, model, opt, {"seed": 0})
    if step == 1:
        print("SAVED1", flush=True)
        while not os.path.exists(go):
            time.sleep(0.05)
print("DONE", flush=True)
"""


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _saver(directory, steps, go, *start):
    return subprocess.Popen([sys.executable, "-c", SAVER, str(directory), str(steps), str(go), *map(str, start)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _tree(directory):
    return sorted(os.path.relpath(os.path.join(d, f), directory)
                  for d, _, files in os.walk(directory) for f in files)


def test_two_concurrent_saves_to_one_dir_the_second_fails_at_once_and_nothing_is_deleted(tmp_path):
    ck, go, start = tmp_path / "ck", tmp_path / "go", tmp_path / "start"
    first = _saver(ck, 4, go)
    # the second starts (imports torch) meanwhile and claims the directory only once told, after
    # the first holds it and has saved; it waits 1 s (not the example's 10) for the held lock
    second = _saver(ck, 4, tmp_path / "never", start, 1.0)
    try:
        assert first.stdout.readline().strip() == "SAVED1", first.stderr.read()[-2000:]
        before = _tree(ck)
        marker = (ck / "latest.json").read_text()
        start.touch()
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-2000:]
        refused, waited = out.strip().splitlines()
        assert refused == (f"REFUSED checkpoint directory {ck} is in use by another run (pid {first.pid}); "
                           "wait for it to finish or give this run another --checkpoint-dir")
        assert 1.0 <= float(waited.split()[1]) < 60, out  # the claim waited LOCK_WAIT_S for the lock
        assert _tree(ck) == before and (ck / "latest.json").read_text() == marker  # nothing touched
        go.touch()
        out, err = first.communicate(timeout=120)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert first.returncode == 0 and out.strip() == "DONE", err[-2000:]
    assert json.loads((ck / "latest.json").read_text())["step"] == 4
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "step_00000004"]


def test_the_lock_ends_with_its_holder_and_names_it_while_held(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\n"
         "from torchrec_sparselift.dlrm.checkpoint import CheckpointDirLock\n"
         f"lock = CheckpointDirLock({str(tmp_path)!r})\nprint('locked', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=rf"in use by another run \(pid {holder.pid}\)"):
            CheckpointDirLock(str(tmp_path))
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    with CheckpointDirLock(str(tmp_path)) as lock:  # its holder ended: free again
        assert open(lock.path).read().strip() == str(os.getpid())
    CheckpointDirLock(str(tmp_path)).release()  # and released by the with-block


def test_checkpoint_exception_is_described_on_one_line():
    def failure(exc):
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001
            return _wrap_exception(e)

    e = CheckpointException("load failed", {1: failure(EOFError()), 0: failure(RuntimeError("bad\nshard"))})
    assert describe_checkpoint_exception(e) == "rank 0: RuntimeError: bad shard (ranks [0, 1] failed)"
    assert "\n" in str(e)  # torch's own text is one traceback per rank


def _train(args, timeout=300):
    """The example as one rank, through the tests' launcher."""
    res = run_script(TRAIN, args, world_size=1, env=_env(), timeout_s=timeout)
    return SimpleNamespace(returncode=res.returncodes[0], stdout=res.stdout, stderr=res.stderr)


@pytest.mark.slow
def test_example_run_on_a_directory_in_use_stops_at_once_with_one_line(tmp_path):
    ck = tmp_path / "ck"
    (ck / "step_00000004").mkdir(parents=True)
    (ck / "latest.json").write_text('{"keep": true}')
    with CheckpointDirLock(str(ck)):  # another run, here this test's process
        proc = _train([*TINY, "--steps", "4", "--checkpoint-dir", str(ck)])
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert errors == [f"error: checkpoint directory {ck} is in use by another run (pid {os.getpid()}); wait for "
                      "it to finish or give this run another --checkpoint-dir"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "latest.json", "step_00000004"]
    assert (ck / "latest.json").read_text() == '{"keep": true}'


@pytest.mark.slow
def test_example_with_a_damaged_checkpoint_shard_exits_non_zero_with_one_line(tmp_path):
    ck = tmp_path / "ck"
    proc = _train([*TINY, "--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    shards = [p for p in (ck / "step_00000002").iterdir() if p.suffix == ".distcp"]
    assert shards
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) // 2])  # a truncated copy

    proc = _train([*TINY, "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"])
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "CheckpointException" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: the checkpoint {ck / 'step_00000002'} cannot be loaded: rank 0: ")
    assert f"remove {ck}" in errors[0]


def test_a_lock_released_within_the_wait_is_taken_and_one_held_past_it_is_refused(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from torchrec_sparselift.dlrm.checkpoint import CheckpointDirLock\n"
         f"lock = CheckpointDirLock({str(tmp_path)!r})\nprint('locked', flush=True)\nsys.stdin.read()\n"
         "time.sleep(0.5)"],  # the crashed run still being torn down
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match="in use by another run"):
            CheckpointDirLock(str(tmp_path), wait_s=0.5)
        holder.stdin.close()  # the holder ends about 0.5 s from now
        with CheckpointDirLock(str(tmp_path), wait_s=20) as lock:
            assert open(lock.path).read().strip() == str(os.getpid())
    finally:
        holder.wait(timeout=60)
