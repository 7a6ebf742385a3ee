"""scripts/gpu_check.py overlap and batch-split on CPU: each worker end to end on 2 gloo CPU ranks
(the verdict passes: every pipeline's losses, and batch-split's final weights, agree with the
reference run), and each verdict fails, naming the run, on a perturbed loss or weight."""

from __future__ import annotations

import copy

import pytest
import torch

from launcher import run_ranks
from test_gpu_check_wire_ids import _gpu_check

SHORT = ["--device", "cpu", "--steps", "4", "--warmup", "1", "--batch", "32", "--rows", "256", "--dim", "16"]
OVERLAP = ["overlap", *SHORT]
#: the default --weights-rtol: each tensor's largest difference over its largest element (float
#: summation order alone moves a near-zero element by ~1e-1 of its own size, the tensor by ~1e-4)
SPLIT = ["batch-split", *SHORT, "--chunks", "2"]


def _overlap_job(rank: int, world_size: int) -> dict:
    gc = _gpu_check()
    return gc.run_rank(rank, world_size, gc.parse(OVERLAP), torch.device("cpu"))


def _split_job(rank: int, world_size: int) -> dict:
    gc = _gpu_check()
    return gc.run_rank(rank, world_size, gc.parse(SPLIT), torch.device("cpu"))


def _failed(lines: list) -> list:
    return [line for line in lines if line.startswith("FAILED")]


def _assert_trained(results: list, ref: str) -> None:
    for r in results:
        losses = r["runs"][ref]["losses"]
        assert len(losses) == 4 and losses[-1] != losses[0]  # it trained


@pytest.mark.multiprocess
def test_overlap_worker_passes_and_fails_on_a_perturbed_loss() -> None:
    gc = _gpu_check()
    args = gc.parse(OVERLAP)
    results = run_ranks(_overlap_job, 2, timeout_s=300)
    _assert_trained(results, "base")
    lines = gc.verdict(args, results)
    assert len(lines) == 2 and all(line.startswith("ok") for line in lines), "\n".join(lines)
    assert all("overlap vs base" in line and gc.OVERLAP_CLASS in line for line in lines)
    bad = copy.deepcopy(results)
    bad[1]["runs"]["overlap"]["losses"][-1] *= 1.01
    (line,) = _failed(gc.verdict(args, bad))
    assert "rank 1 overlap vs base" in line and "losses worst relative difference 1.00e-02" in line
    bad = copy.deepcopy(results)
    bad[0]["runs"]["overlap"]["class"] = "TrainPipelineBase"
    (line,) = _failed(gc.verdict(args, bad))
    assert "rank 0 overlap vs base (TrainPipelineBase)" in line


@pytest.mark.multiprocess
def test_batch_split_worker_passes_and_fails_on_a_perturbed_loss_or_weight() -> None:
    gc = _gpu_check()
    args = gc.parse(SPLIT)
    results = run_ranks(_split_job, 2, timeout_s=300)
    _assert_trained(results, "k=1")
    lines = gc.verdict(args, results)
    assert len(lines) == 2 and all(line.startswith("ok") for line in lines), "\n".join(lines)
    assert all("k=2 vs k=1" in line and gc.SPLIT_CLASS in line and ", weights " in line for line in lines)
    bad = copy.deepcopy(results)
    bad[0]["runs"]["k=2"]["losses"][0] *= 1.01
    (line,) = _failed(gc.verdict(args, bad))
    assert "rank 0 k=2 vs k=1" in line and "losses worst relative difference 1.00e-02" in line
    bad = copy.deepcopy(results)
    name = next(n for n, v in bad[1]["weights"]["k=2"].items() if v.numel())
    bad[1]["weights"]["k=2"][name] = bad[1]["weights"]["k=2"][name] * 2.0
    (line,) = _failed(gc.verdict(args, bad))
    assert "rank 1 k=2 vs k=1" in line and "weights 1.00e+00" in line
