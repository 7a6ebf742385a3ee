"""2D replica sync, predicted vs measured, on the emulated-host testbed (docs/benchmarks.md section 20).

    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 2 --rate 1gbit -- \\
        -m benchmarks.replica_sync [--workloads kaggle,hot_skewed,few_large,shared] [--out runs/sync.json]

Needs R1's stored profile (``python -m benchmarks.regimes --regimes R1``), which it moves to the
job's link as ``hardware="auto"`` does (``profile_on_link``: the link terms corrected, the replica
sync's measured rates taken). Per workload: SparseLift's 1D plan and its 2D plan
(``sharding_group_size=2``, the planner's sync interval), each sharded through ``runtime.lift``;
``--steps`` timed steps each (slowest rank per step) after ``--warmup``; then ``--syncs`` calls of
the 2D model's ``sync()`` timed alone. Prints, per workload, the per-step times, the 2D step over
whole sync intervals (``runtime.timing.steady_step_s``) against 1D's, one sync measured against
the cost model's (``cost.two_d.replica_sync_s`` of the plan's state), and whether the planner's
2D-vs-1D order matches the measured one.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence

import torch

from benchmarks import regimes as R
from benchmarks.harness import Cycle, exit_now, start_worker, stop_worker, timed_steps, write_report
from benchmarks.real_runs import BATCH_SEED, _workloads
from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.measure.link import measure_link_rates
from torchrec_sparselift.measure.probe import pin_rank_to_core, prebuilt_batches, probe_stats
from torchrec_sparselift.runtime.timing import steady_step_s


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="kaggle,hot_skewed,few_large,shared")
    p.add_argument("--steps", type=int, default=12, help="timed steps per plan (a 2D plan's: rounded up to "
                                                          "whole sync intervals)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--syncs", type=int, default=5, help="sync() calls timed alone")
    p.add_argument("--store", default=os.path.expanduser("~/.cache/torchrec_sparselift/regimes"))
    p.add_argument("--out", default=None, help="JSON of every measurement (rank 0)")
    a = p.parse_args(argv)
    a.workloads = [w for w in a.workloads.split(",") if w]
    if a.steps < 1 or a.warmup < 0 or a.syncs < 1:
        p.error("--steps and --syncs must be >= 1, --warmup >= 0")
    return a


def _timed_syncs(model: Any, n: int, pg: Any) -> List[float]:
    """``n`` calls of ``model.sync()`` alone, each started together: the slowest rank's seconds."""
    durations: List[float] = []
    for _ in range(n):  # a barrier before every call: each sync starts on every rank together
        durations += timed_steps(model.sync, 1, pg, torch.device("cpu")).slowest_rank_durations_s(pg)
    return durations


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    me = start_worker()
    pg, rank, say, W = me.pg, me.rank, me.say, me.world_size
    topo = R.job_topology(W, ranks_per_host(world_size=W))
    if topo.world_size // topo.local_world_size < 2:
        raise SystemExit("benchmarks.replica_sync: run it on 2 or more emulated hosts (the command in its docstring)")
    link = measure_link_rates()
    say(link.describe())
    prof_args = argparse.Namespace(profile_from="unshaped", store=args.store, calibrate=False, calibration_steps=None)
    profiles, errors, _ = R.job_profiles(prof_args, "R4", link, pg, say)
    pin_rank_to_core(pg)
    results: List[Dict[str, Any]] = []
    for wname in args.workloads:
        w, alpha = _workloads()[wname]
        stats = probe_stats(w, alpha, n=6, seed=BATCH_SEED)
        specs = R.build_specs(w, ["sparselift", "sparselift_2d"], topo, profiles, errors, stats, pg, lambda m: None)
        batches = prebuilt_batches(w, 6, seed=BATCH_SEED, rank=rank, alpha=alpha)
        res: Dict[str, Any] = dict(workload=wname)
        for s in specs:
            ep = s["plan"]
            lifted = R.lift_run(w, s, torch.device("cpu"))
            it = Cycle(batches)
            period = lifted.sync_period  # a 2D step is timed over whole sync intervals
            steps = -(-args.steps // period) * period
            timer = timed_steps(lambda pipeline=lifted.pipeline, batches=it: pipeline.progress(batches), steps, pg,
                                torch.device("cpu"),
                                warmup=args.warmup, period=period)
            per_step = timer.slowest_rank_durations_s(pg)[args.warmup:]
            row = dict(plan=ep.summary(), predicted_ms=ep.prediction.step_time_s * 1e3, period=period,
                       steps_ms=[x * 1e3 for x in per_step], step_ms=steady_step_s(per_step, period) * 1e3,
                       median_ms=statistics.median(per_step) * 1e3)
            if period > 1 or ep.optimizations.is_2d:
                syncs = _timed_syncs(lifted.model, args.syncs, pg)
                row["sync_measured_ms"] = [x * 1e3 for x in syncs]
                row["sync_interval"] = ep.optimizations.sync_interval
                row["layout"] = ep.optimizations.layout_2d.describe()[1:] if ep.optimizations.layout_2d else None
                row["sync_predicted_ms"] = s.get("replica_sync_ms")
            res["2d" if ep.optimizations.is_2d else "1d"] = row
            del lifted, it
        results.append(res)
    for res in results:
        say(_format(res))
    if rank == 0 and args.out:
        write_report(args.out, dict(link=link.to_dict(), workloads=results))
        say(f"[replica_sync] wrote {args.out}")
    stop_worker()
    return 0


def _format(res: Dict[str, Any]) -> str:
    one, two = res["1d"], res["2d"]
    sync = two.get("sync_measured_ms") or []
    lines = [f"{res['workload']}: 1D {one['step_ms']:.1f} ms (predicted {one['predicted_ms']:.1f}); "
             f"2D {two['step_ms']:.1f} ms over whole intervals of {two['period']} (median step "
             f"{two['median_ms']:.1f}; predicted {two['predicted_ms']:.1f})"]
    if sync:
        lines.append(f"  one sync measured {min(sync):.1f}-{max(sync):.1f} ms (median {statistics.median(sync):.1f})"
                     + (f", predicted {two['sync_predicted_ms']:.1f}" if two.get("sync_predicted_ms") else ""))
    faster_measured = two["step_ms"] < one["step_ms"]
    faster_predicted = two["predicted_ms"] < one["predicted_ms"]
    lines.append(f"  2D faster: measured {faster_measured}, predicted {faster_predicted} -> "
                 f"{'right' if faster_measured == faster_predicted else 'WRONG'}")
    return "\n".join(lines)


if __name__ == "__main__":
    exit_now(main)
