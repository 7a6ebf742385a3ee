"""Measurements that depend on how loaded the machine is, printed (never asserted): the test
suite checks only what load cannot change, and this prints the rest next to its usual range.

- planning 120 production-like tables on 512 simulated ranks (time budget 20 s; it used to be
  asserted under 60 s);
- the host microbenchmarks the step fit floors its terms with: Adagrad per tensor and per byte,
  bucketize per id, fbgemm's backward per distinct row, the dense per-byte/per-FLOP costs, a
  GEMM's per-FLOP cost. Each is a slope between two timed cases, so load moves it either way
  (the suite checks that they run and are finite and non-negative, and their arithmetic on
  synthetic timings).

    python -m benchmarks.load_sensitive [--skip-planning] [--skip-microbench] [--trials 3]

A value outside its usual range on an idle machine points at the code (a unit, a slope); on a
loaded one, at the load (``uptime`` says which).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from typing import List, Optional, Tuple

from torchrec.distributed.planner import Topology
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.measure.microbench import bench_host_terms
from torchrec_sparselift.semantics.reference_workloads import production

__all__ = ["main"]

GiB = 1024**3

# (name, low, high): orders of magnitude on a CPU with one to a few cores, idle
HOST_RANGES: Tuple[Tuple[str, float, float], ...] = (
    ("optimizer_tensor_s", 1e-7, 1e-3),  # Adagrad.step per tensor: microseconds
    ("optimizer_byte_s", 5e-12, 1e-8),  # per fp32 byte: a memory pass of 0.05-10 ns
    ("bucketize_id_s", 0.0, 1e-6),  # per id: nanoseconds
    ("tbe_row_s", 1e-8, 1e-4),  # fbgemm's fused backward per distinct row: ~0.6 us
    ("dense_act_byte_s", 1e-11, 5e-8),  # cat/split/interaction per activation byte: 0.01-50 ns
    ("interaction_flop_s", 0.0, 1e-9),
    ("dense_flop_s", 5e-13, 1e-9),  # an fp32 GEMM: 1-2000 GFLOP/s
)


def _row(name: str, value: float, low: float, high: float) -> str:
    verdict = "in range" if low <= value < high else "OUT OF RANGE"
    return f"  {name:<20} {value:12.4g}   usual [{low:.0e}, {high:.0e})   {verdict}"


def planning_512_ranks() -> None:
    wl = production(120, seed=3)
    topo = Topology(world_size=512, local_world_size=8, compute_device="cuda", hbm_cap=80 * GiB,
                    ddr_cap=256 * GiB)
    planner = SparseLiftPlanner(topology=topo, batch_size=wl.per_rank_batch(512), constraints=wl.constraints(),
                                debug=False, time_budget_s=20)
    t0 = time.perf_counter()
    res = planner.plan_with_result(wl.module(), get_default_sharders())
    wall = time.perf_counter() - t0
    s = res.search
    print("planning: production-120 on 512 simulated ranks (time budget 20 s)")
    print(f"  search {s.planning_time_s:.1f} s, whole call {wall:.1f} s (usually well under 60 s); "
          f"solver {s.solver}, status {s.status}, gap {s.gap:.2%}")


def host_microbenchmarks(trials: int) -> None:
    t0 = time.perf_counter()
    rec = bench_host_terms(trials=trials).to_dict()
    print(f"host microbenchmarks (trials={trials}, {time.perf_counter() - t0:.1f} s)")
    for name, low, high in HOST_RANGES:
        if rec.get(name) is not None:
            print(_row(name, float(rec[name]), low, high))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-planning", action="store_true")
    ap.add_argument("--skip-microbench", action="store_true")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if not args.skip_planning:
        planning_512_ranks()
    if not args.skip_microbench:
        host_microbenchmarks(args.trials)
    return 0


if __name__ == "__main__":
    sys.exit(main())
