"""scripts/gpu_check.py wire-ids on CPU: its arguments, run list and verdict, its clean refusal
without CUDA, and its worker end to end on 2 gloo CPU ranks (the same code the GPU check runs on
NCCL, but the CUDA kernels and streams)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from launcher import run_ranks

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "scripts", "gpu_check.py")
#: a small run: skewed ids over 64 hot rows, so a 32-sample batch repeats ids and dedup pays
SMALL = ["wire-ids", "--device", "cpu", "--steps", "4", "--warmup", "1", "--batch", "32", "--rows", "256",
         "--dim", "16", "--id-rows", "64"]


def _gpu_check():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_check", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_wire_ids_arguments_and_runs() -> None:
    gc = _gpu_check()
    args = gc.parse(["wire-ids"])
    assert args.check == "wire-ids" and args.steps == 50 and args.device == "cuda" and args.id_rows == 4096
    runs = gc.runs_of(args)
    assert [label for label, _, _ in runs] == ["int64", "int32", "dedup", "dedup_unique"]
    assert all(kind == "sparse_dist" and chunks == 1 for _, kind, chunks in runs)
    assert gc.WIRE_RUNS["int64"] == ("int64", False, False) and gc.WIRE_RUNS["dedup_unique"] == ("int32", True, True)
    small = gc.parse(SMALL)
    assert small.device == "cpu" and gc.runs_of(small) == runs
    assert [label for label, _, _ in gc.runs_of(gc.parse(SMALL + ["--runs", "dedup"]))] == ["int64", "dedup"]
    for bad, says in ((["--id-rows", "0"], "--id-rows must be at least 1"),
                      (["--steps", "5", "--warmup", "5"], "must exceed --warmup"),
                      (["--runs", "int64"], "--runs must name some of")):
        done = subprocess.run([sys.executable, PATH, "wire-ids", *bad], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr, done.stderr


def test_wire_ids_refuses_cleanly_without_cuda() -> None:
    gc = _gpu_check()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, PATH, "wire-ids"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == gc.NO_CUDA, done.stderr
    assert "no CUDA device visible, nothing checked" in done.stderr and "Traceback" not in done.stderr


def _result(gc, losses=None, weights=None, nbytes=None, cls="TrainPipelineSparseDist"):  # type: ignore[no-untyped-def]
    """One rank's synthetic results: every run as the reference unless overridden."""
    w = {"a": torch.tensor([1.0, 2.0])}
    nbytes = nbytes or {"int64": 800, "int32": 400, "dedup": 300, "dedup_unique": 300}
    dtypes = {"int64": ["torch.int64"], "int32": ["torch.int32"], "dedup": ["torch.int32", "torch.uint8"],
              "dedup_unique": ["torch.int32", "torch.uint8"]}
    runs, weights_of = {}, {}
    for label in gc.WIRE_RUNS:
        runs[label] = {"losses": (losses or {}).get(label, [1.0, 0.5]), "class": cls if label != "int64" else
                       "TrainPipelineSparseDist", "input_bytes": {"bytes": nbytes[label], "dtypes": dtypes[label]}}
        weights_of[label] = (weights or {}).get(label, w)
    return [{"rank": 0, "runs": runs, "weights": weights_of}]


def test_wire_ids_verdict_fails_on_losses_weights_class_and_bytes() -> None:
    gc = _gpu_check()
    args = gc.parse(["wire-ids"])

    def failed(results):  # type: ignore[no-untyped-def]
        lines = gc.verdict(args, results)
        assert len(lines) == 4  # three checked runs and the bytes, for the one rank
        return [line for line in lines if line.startswith("FAILED")]

    assert failed(_result(gc)) == []
    assert len(failed(_result(gc, losses={"dedup": [1.0, 0.51]}))) == 1
    assert len(failed(_result(gc, weights={"dedup_unique": {"a": torch.tensor([1.0, 2.5])}}))) == 1
    assert len(failed(_result(gc, cls="TrainPipelineBase"))) == 3
    # int32 must halve the reference's bytes, and dedup send fewer than int32
    for nbytes in ({"int64": 800, "int32": 500, "dedup": 300, "dedup_unique": 300},
                   {"int64": 800, "int32": 400, "dedup": 400, "dedup_unique": 300},
                   {"int64": 800, "int32": 400, "dedup": 300, "dedup_unique": 450}):
        (line,) = failed(_result(gc, nbytes=nbytes))
        assert "input all-to-all bytes" in line
    # one rank: nothing leaves it, the bytes are not checked (and not passed)
    lines = gc.verdict(args, _result(gc, nbytes={"int64": 0, "int32": 0, "dedup": 0, "dedup_unique": 0}))
    assert lines[-1].startswith("not checked")


def _cpu_job(rank: int, world_size: int) -> dict:
    gc = _gpu_check()
    return gc.run_rank(rank, world_size, gc.parse(SMALL), torch.device("cpu"))


@pytest.mark.multiprocess
def test_wire_ids_worker_passes_on_two_gloo_ranks() -> None:
    gc = _gpu_check()
    results = run_ranks(_cpu_job, 2, timeout_s=300)
    lines = gc.verdict(gc.parse(SMALL), results)
    assert len(lines) == 2 * 4 and all(line.startswith("ok") for line in lines), "\n".join(lines)
    for r in results:
        ref = r["runs"]["int64"]
        assert len(ref["losses"]) == 4 and ref["losses"][-1] != ref["losses"][0]  # it trained
        assert ref["input_bytes"]["bytes"] > 0
