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


def _passing(job, argv: list, ref: str, label: str, cls: str) -> tuple:
    """The check's worker on 2 gloo ranks: it trained, and its verdict passes on both ranks for
    ``label`` built as ``cls``. Returns the module, its arguments and the ranks' results."""
    gc = _gpu_check()
    args = gc.parse(argv)
    results = run_ranks(job, 2, timeout_s=300)
    for r in results:
        losses = r["runs"][ref]["losses"]
        assert len(losses) == 4 and losses[-1] != losses[0]  # it trained
    lines = gc.verdict(args, results)
    assert len(lines) == 2 and all(line.startswith("ok") for line in lines), "\n".join(lines)
    assert all(f"{label} vs {ref}" in line and getattr(gc, cls) in line for line in lines)
    return gc, args, results


def _fails_on_a_perturbed_loss(gc, args, results: list, rank: int, run: str, step: int, ref: str) -> None:
    bad = copy.deepcopy(results)
    bad[rank]["runs"][run]["losses"][step] *= 1.01
    (line,) = _failed(gc.verdict(args, bad))
    assert f"rank {rank} {run} vs {ref}" in line and "losses worst relative difference 1.00e-02" in line


@pytest.mark.multiprocess
def test_overlap_worker_passes_and_fails_on_a_perturbed_loss() -> None:
    gc, args, results = _passing(_overlap_job, OVERLAP, "base", "overlap", "OVERLAP_CLASS")
    _fails_on_a_perturbed_loss(gc, args, results, 1, "overlap", -1, "base")
    bad = copy.deepcopy(results)
    bad[0]["runs"]["overlap"]["class"] = "TrainPipelineBase"
    (line,) = _failed(gc.verdict(args, bad))
    assert "rank 0 overlap vs base (TrainPipelineBase)" in line


@pytest.mark.multiprocess
def test_batch_split_worker_passes_and_fails_on_a_perturbed_loss_or_weight() -> None:
    gc, args, results = _passing(_split_job, SPLIT, "k=1", "k=2", "SPLIT_CLASS")
    lines = gc.verdict(args, results)
    assert all(", weights " in line for line in lines)
    _fails_on_a_perturbed_loss(gc, args, results, 0, "k=2", 0, "k=1")
    bad = copy.deepcopy(results)
    name = next(n for n, v in bad[1]["weights"]["k=2"].items() if v.numel())
    bad[1]["weights"]["k=2"][name] = bad[1]["weights"]["k=2"][name] * 2.0
    (line,) = _failed(gc.verdict(args, bad))
    assert "rank 1 k=2 vs k=1" in line and "weights 1.00e+00" in line
