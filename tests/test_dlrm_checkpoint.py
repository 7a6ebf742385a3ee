"""Checkpoint and resume of the DLRM example (examples/dlrm/train.py, torchrec_sparselift.dlrm.checkpoint): a run
that crashes mid-training and is rerun continues from its last checkpoint and loses nothing."""

from __future__ import annotations

import json
import os

import pytest
from launcher import run_script, start_script

from torchrec_sparselift.dlrm.checkpoint import CHECKPOINT_SCHEMA, CheckpointError, latest_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dlrm")
TRAIN = os.path.join(EXAMPLE, "train.py")

TINY = ["--tables", "kaggle", "--scale", "0.0001", "--embedding-dim", "16", "--batch-size", "64"]
# Every kind of state a checkpoint must carry: row-, column- and table-row-wise shards (fused
# optimizer state sharded with them) and a data-parallel table (DDP weight, dense optimizer).
MIXED_SHARDING = {
    "t_cat_0": {"sharding_types": ["row_wise"]},
    "t_cat_1": {"sharding_types": ["data_parallel"], "compute_kernels": ["dense"]},
    "t_cat_2": {"sharding_types": ["column_wise"], "min_partition": 8},
    "t_cat_3": {"sharding_types": ["table_row_wise"]},
}


def _run(args):
    """train.py on 2 gloo ranks, started as 2 processes with torchrun's environment variables
    (no launcher process: it would cost a third torch import per run)."""
    return start_script(TRAIN, args, 2, timeout_s=600)


def test_run_killed_mid_training_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path):
    """2 gloo ranks, 12 steps, pipeline ``sparse_dist`` (it prefetches the next batch, so the
    resumed run must start its data iterator at the resumed step, not replay from 0).

    The crashed run checkpoints after step 4 and dies after step 7; the rerun loads step 4's
    model and optimizer state (sharded tables, fused row-wise AdaGrad state, dense AdaGrad
    state) and trains steps 5-12. Its per-step losses must EQUAL the uninterrupted run's, bit for
    bit: all runs get the same plan (planning this instance is deterministic and not time-limited;
    the runs also share a plan cache, which is safe to fill concurrently), DCP restores every tensor exactly, the
    synthetic batch of a step depends only on (seed, rank, step), and the CPU kernels are
    deterministic, so there is no rounding to tolerate. A missed piece of state (optimizer
    momentum, data position) changes the losses and fails this test."""
    constraints = tmp_path / "constraints.json"
    constraints.write_text(json.dumps(MIXED_SHARDING))
    common = [*TINY, "--steps", "12", "--warmup-steps", "1", "--no-progress", "--pipeline", "sparse_dist",
              "--plan-cache", str(tmp_path / "plans"), "--constraints", str(constraints)]  # fmt: skip
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4"]

    # The uninterrupted and the crashing run are independent: run them side by side (time).
    whole_run = _run([*common, "--out", str(tmp_path / "whole.json")])
    crashed = _run([*common, *ck, "--fail-at-step", "7", "--out", str(tmp_path / "crashed.json")]).wait()
    assert crashed.returncodes == (1, 1), crashed.tail()
    assert "SimulatedFailure: --fail-at-step 7" in crashed.stderr
    assert not (tmp_path / "crashed.json").exists()
    marker = json.loads((tmp_path / "ck" / "latest.json").read_text())
    assert marker["step"] == 4
    whole = whole_run.wait()
    assert whole.ok, whole.tail()

    resumed = _run([*common, *ck, "--out", str(tmp_path / "resumed.json")]).wait()
    assert resumed.ok, resumed.tail()
    assert "resumed from the checkpoint after step 4" in resumed.stdout

    full = json.loads((tmp_path / "whole.json").read_text())
    res = json.loads((tmp_path / "resumed.json").read_text())
    assert res["resumed_from_step"] == 4 and res["first_step"] == 5
    assert len(full["losses"]) == 12 and len(res["losses"]) == 8
    assert res["losses"] == full["losses"][4:]
    assert res["checkpoints_saved"] == [8, 12]
    kinds = {r["table"]: r["sharding_type"] for r in res["plan"]}
    assert {kinds[t] for t in MIXED_SHARDING} == {"row_wise", "data_parallel", "column_wise", "table_row_wise"}


def test_checkpoint_of_a_different_run_is_refused_with_what_differs(tmp_path):
    assert latest_checkpoint(str(tmp_path / "missing"), {"seed": 0}) is None
    (tmp_path / "step_00000004").mkdir()
    marker = {"schema": CHECKPOINT_SCHEMA, "step": 4, "path": "step_00000004", "config": {"seed": 0, "lr": 0.05}}
    (tmp_path / "latest.json").write_text(json.dumps(marker))
    info = latest_checkpoint(str(tmp_path), {"seed": 0, "lr": 0.05})
    assert info.step == 4 and info.path == "step_00000004"
    with pytest.raises(CheckpointError, match=r"different run \(seed: 0 -> 1\)"):
        latest_checkpoint(str(tmp_path), {"seed": 1, "lr": 0.05})
    (tmp_path / "latest.json").write_text('{"schema": "dlrm_example.checkpoint/1", "step": ')
    with pytest.raises(CheckpointError, match="is unreadable"):
        latest_checkpoint(str(tmp_path), {"seed": 0, "lr": 0.05})
    marker["path"] = "step_00000008"
    (tmp_path / "latest.json").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="which is missing"):
        latest_checkpoint(str(tmp_path), {"seed": 0, "lr": 0.05})


@pytest.mark.slow
def test_torchrun_restart_resumes_after_a_simulated_crash_with_the_same_losses(tmp_path):
    """``torchrun --max-restarts 1``: the first attempt crashes after step 7, the restarted
    workers (same flags; ``--fail-at-step`` acts only on the first attempt) meet in a fresh store
    key space, resume from step 4's checkpoint and finish with the uninterrupted run's losses."""
    common = [*TINY, "--steps", "12", "--warmup-steps", "1", "--no-progress", "--pipeline", "sparse_dist",
              "--plan-cache", str(tmp_path / "plans")]  # fmt: skip
    whole_run = _run([*common, "--out", str(tmp_path / "whole.json")])
    restarted = run_script(TRAIN, [*common, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4",
                                   "--fail-at-step", "7", "--out", str(tmp_path / "restarted.json")],
                           2, torchrun=True, torchrun_args=["--max-restarts", "1"], timeout_s=600)  # fmt: skip
    whole = whole_run.wait()
    assert whole.ok, whole.tail()
    assert restarted.ok, restarted.tail()
    assert "SimulatedFailure" in restarted.stderr and "resumed from the checkpoint after step 4" in restarted.stdout
    full = json.loads((tmp_path / "whole.json").read_text())
    res = json.loads((tmp_path / "restarted.json").read_text())
    assert res["first_step"] == 5 and res["losses"] == full["losses"][4:]
