"""The example's ``--check`` refuses what planning would refuse, with planning's own words."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "dlrm", "train.py")


def _check(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, WORLD_SIZE="2")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, TRAIN, *args, "--check"], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env=env)


def test_check_refuses_an_embedding_dim_the_fused_kernels_cannot_take():
    proc = _check("--embedding-dim", "6", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "planning would refuse this input" in proc.stderr
    assert "embedding_dim 6 is not a multiple of 4" in proc.stderr and "pad it to 8" in proc.stderr
    assert "Traceback" not in proc.stderr


# the tests below call the example's main in this process (``dlrm_main``); the one above runs
# the command


def test_check_refuses_input_buffers_no_rank_can_hold(dlrm_main):
    code, err = dlrm_main(["--batch-size", str(10**12), "--device", "cpu", "--check"], WORLD_SIZE=2)
    assert code == 2, err[-2000:]
    assert "input/output buffers of one step" in err and "lower batch_size" in err


def test_check_accepts_what_planning_accepts(dlrm_main):
    code, err = dlrm_main(["--embedding-dim", "8", "--device", "cpu", "--check"], WORLD_SIZE=2)
    assert code == 0, err[-2000:]


def _check4(dlrm_main, *args):
    return dlrm_main([*args, "--check", "--device", "cpu", "--scale", "0.001"], WORLD_SIZE=4, LOCAL_WORLD_SIZE=2)


def test_check_validates_the_2d_flags_with_the_fix(dlrm_main):
    refused = {
        ("--sharding-group-size", "x"): "auto or a number of ranks",
        ("--sync-interval", "4"): "needs --sharding-group-size",
        ("--sharding-group-size", "2", "--planner", "torchrec"): "TorchRec's planner has no 2D",
        ("--sharding-group-size", "3"): "divisor of the world size 4",
        ("--sharding-group-size", "2", "--2d-strategy", "fully_sharded"): "torch.cuda.Stream",
        ("--sharding-group-size", "2", "--sync-interval", "64"): "max_sync_interval",
        ("--replica-merge", "momentum_scaled"): "needs --sharding-group-size",
    }
    for args, words in refused.items():
        code, err = _check4(dlrm_main, *args)
        assert code == 2 and words in err, (args, err[-1500:])
        assert "Traceback" not in err
    code, err = _check4(dlrm_main, "--sharding-group-size", "2", "--2d-strategy", "default", "--sync-interval", "2")
    assert code == 0, err[-2000:]
    code, err = _check4(dlrm_main, "--sharding-group-size", "2", "--replica-merge", "momentum_scaled")
    assert code == 0, err[-2000:]
