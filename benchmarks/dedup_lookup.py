"""The lookup of a deduplicating group: on the rebuilt ids (the default) or on the distinct rows
(``apply_wire_ids(..., unique_rows=True)``), against the same plan without dedup.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.dedup_lookup [--workloads dcnv2,kaggle] [--rounds 3] [--out R.json]

Per workload (:data:`benchmarks.real_runs.WORKLOADS`): TorchRec's plan of it (as the regime
benchmark trains TorchRec's default), under ``sparse_dist`` with int32 ids, three runs: no dedup
(``int32``), every model-parallel feature deduplicated with the lookup on the rebuilt ids
(``dedup``, what a plan applies) and the same with the lookup on the distinct rows
(``dedup_unique``). Each run a fresh model on the workload's pre-built batches, the ranks pinned
to their cores, ``--warmup`` untimed then ``--steps`` timed steps (the slowest rank's steady step), in
interleaved rounds (the order rotated each round; ``benchmarks.regimes.timed_run``, as the regime
benchmark times its runs). Prints ms/step per round and each run's median
over ``int32``'s in the same round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from typing import Any, Dict, List

import torch

from benchmarks.harness import exit_now, interleaved_rounds, names_arg, worker, write_report
from benchmarks.real_runs import BATCH_SEED, WORKLOADS, _workloads, model_parallel_features, torchrec_plan_of
from benchmarks.regimes import lift_run, timed_run
from torchrec_sparselift.measure.probe import prebuilt_batches
from torchrec_sparselift.runtime.wire_ids import apply_wire_ids

__all__ = ["RUNS", "main"]

#: run -> (dedup every model-parallel feature, lookup on the distinct rows)
RUNS = {"int32": (False, False), "dedup": (True, False), "dedup_unique": (True, True)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated from {','.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", help="JSON file for the results (rank 0)")
    args = p.parse_args()
    names = names_arg(p, "--workloads", args.workloads, WORKLOADS)
    warnings.filterwarnings("ignore")
    from torchrec.distributed.planner.types import Topology

    with worker() as c:
        results: Dict[str, Any] = {}
        for name in names:
            w, alpha = _workloads()[name]
            plan, _ = torchrec_plan_of(w, Topology(world_size=c.world_size, compute_device="cpu"), c.pg)
            features = model_parallel_features(w, plan)
            batches = prebuilt_batches(w, 6, seed=BATCH_SEED, rank=c.rank, alpha=alpha)
            ms: Dict[str, List[float]] = {run: [] for run in RUNS}

            def measure(run: str, _round: int) -> None:
                dedup, unique = RUNS[run]
                # the distinct-row lookup is applied after lift (no plan sets it); the others as a plan applies them
                spec = {"plan": plan, "pipeline": "sparse_dist"} if unique else {
                    "plan": plan, "pipeline": "sparse_dist", "id_dtype": "int32",
                    "dedup_features": features if dedup else None}
                step_s, _losses, _build_s = timed_run(
                    lambda: lift_run(w, spec, c.device), batches, args.steps, args.warmup, c.pg,
                    after_build=(lambda lifted: apply_wire_ids(lifted.model, "int32", features, unique_rows=True))
                    if unique else None)
                ms[run].append(1e3 * step_s)

            interleaved_rounds(list(RUNS), measure, args.rounds)
            ratios = {run: [round(x / y, 3) for x, y in zip(ms[run], ms["int32"])] for run in RUNS}
            results[name] = {"ms": ms, "over_int32": ratios, "dedup_features": len(features)}
            c.say(f"{name}: " + "; ".join(f"{run} {[round(x, 1) for x in ms[run]]} ms (/int32 "
                                          f"{statistics.median(ratios[run]):.2f})" for run in RUNS))
        if args.out and c.rank == 0:
            write_report(args.out, {"workloads": results, "settings": vars(args)})
    return 0


if __name__ == "__main__":
    exit_now(main)
