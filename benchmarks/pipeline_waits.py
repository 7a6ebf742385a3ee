"""Where a train pipeline's step goes, by TorchRec's own profiler regions: TorchRec's plan of a
benchmark workload under each pipeline, profiled, the regions' ms per step (mean over ranks).

    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 2 --rate 1gbit -- \\
        -m benchmarks.pipeline_waits --workloads kaggle,hot_skewed --pipelines sparse_dist,fused

Per workload (:data:`benchmarks.real_runs.WORKLOADS`) and interleaved round (the order rotated each
round), each pipeline in turn: a fresh model of TorchRec's ``EmbeddingShardingPlanner`` plan
(:func:`benchmarks.regimes.lift_run`, as the regime benchmark trains it), ranks
pinned to their cores, pre-built batches, ``--warmup`` steps, then ``--steps`` steps under
``torch.profiler`` (CPU). Prints the step (wall, under the profiler) and the ``record_function``
regions TorchRec's pipelines and sharded modules open (``## forward ##``, ``## start_embedding_lookup
##``, ``## PooledEmbeddingsAwaitable wait() ##``: the wait on the output all-to-all, ...), each the
mean over ranks of its CPU ms per step; ``--out``: the same as JSON. docs/overlap.md section 9.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks.harness import (Cycle, exit_now, interleaved_rounds, names_arg, start_worker, stop_worker, timed_steps,
                                write_report)
from benchmarks.real_runs import BATCH_SEED, WORKLOADS, _workloads, torchrec_plan_of
from benchmarks.regimes import job_topology, lift_run
from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.measure.probe import pin_rank_to_core, prebuilt_batches, restore_affinity
from torchrec_sparselift.vocabulary import PIPELINES as PIPELINE_KINDS

__all__ = ["main", "regions"]

#: the regions printed first (the rest follow by name)
KEY_REGIONS = ("forward", "backward", "optimizer", "zero_grad", "start_embedding_lookup", "start_sparse_data_dist",
               "wait_sparse_data_dist", "PooledEmbeddingsAwaitable wait()")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="kaggle", help=f"comma-separated from {','.join(WORKLOADS)}")
    p.add_argument("--pipelines", default="sparse_dist,fused", help=f"comma-separated from {','.join(PIPELINE_KINDS)}")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each a fresh model of every pipeline (default 2)")
    p.add_argument("--steps", type=int, default=6, help="profiled steps (default 6)")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling (default 3)")
    p.add_argument("--out", help="JSON file for the results (rank 0)")
    args = p.parse_args(argv)
    args.workloads = names_arg(p, "--workloads", args.workloads, WORKLOADS)
    args.pipelines = names_arg(p, "--pipelines", args.pipelines, PIPELINE_KINDS)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def regions(events: Any, steps: int) -> Dict[str, float]:
    """CPU ms per step of each ``## name ##`` region in ``events`` (a profiler's events), the batch
    index TorchRec puts in some names (``## forward 12 ##``) left out."""
    out: Dict[str, float] = collections.defaultdict(float)
    for e in events:
        m = re.fullmatch(r"## (.*?) ##", e.name)
        if m:
            key = " ".join(x for x in m.group(1).split() if not x.isdigit())
            out[key] += e.cpu_time_total / 1e3 / steps
    return dict(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun or the testbed: python -m torchrec_sparselift.measure.testbed --hosts 2 "
              "--ranks-per-host 2 --rate 1gbit -- -m benchmarks.pipeline_waits", file=sys.stderr)
        return 2
    me = start_worker(threads=None, quiet_logs=False)
    pg, W, rank = me.pg, me.world_size, me.rank
    topo = job_topology(W, ranks_per_host(world_size=W))
    results: List[Dict[str, Any]] = []
    old = pin_rank_to_core(pg)
    try:
        for wname in args.workloads:
            w, alpha = _workloads()[wname]
            plan, _cons = torchrec_plan_of(w, topo, pg)
            batches = prebuilt_batches(w, 6, seed=BATCH_SEED, rank=rank, alpha=alpha)

            def measure(pipe: str, rnd: int) -> None:
                lifted = lift_run(w, dict(plan=plan, pipeline=pipe), torch.device("cpu"))
                it = Cycle(batches)
                for _ in range(args.warmup):
                    lifted.pipeline.progress(it)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    timer = timed_steps(lambda: lifted.pipeline.progress(it), args.steps, pg, torch.device("cpu"))
                wall_ms = timer.record(log=False).mean_s * 1e3  # this rank's; the row takes the mean over ranks
                mine = dict(wall_ms=wall_ms, regions=regions(prof.events(), args.steps))
                every: List[Any] = [None] * W
                dist.all_gather_object(every, mine, group=pg)
                keys = sorted({k for r in every for k in r["regions"]})
                mean = {k: sum(r["regions"].get(k, 0.0) for r in every) / W for k in keys}
                row = dict(workload=wname, pipeline=pipe, round=rnd, wall_ms=sum(r["wall_ms"] for r in every) / W,
                           regions=mean)
                results.append(row)
                first = [k for k in KEY_REGIONS if k in mean] + [k for k in keys if k not in KEY_REGIONS]
                me.say(f"[pipeline_waits] {wname} {pipe} round {rnd + 1}: step {row['wall_ms']:.1f} ms; "
                       + ", ".join(f"{k} {mean[k]:.1f}" for k in first))

            interleaved_rounds(args.pipelines, measure, args.rounds)
    finally:
        restore_affinity(old)
    if rank == 0 and args.out:
        write_report(args.out, dict(settings=dict(vars(args)), world_size=W, results=results))
        print(f"[pipeline_waits] wrote {args.out}", flush=True)
    stop_worker()
    return 0


if __name__ == "__main__":
    exit_now(main)
