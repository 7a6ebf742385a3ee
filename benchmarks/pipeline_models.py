"""Pipelines against the spread of models: TorchRec's plan of a benchmark workload trained under
several pipelines, each on several models, interleaved; then where each pipeline's step goes.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.pipeline_models \\
        --workloads hot_skewed,kaggle,few_large --pipelines sparse_dist,fused --models 4 --attribute
    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 1 --rate 1gbit --shared \\
        -- -m benchmarks.pipeline_models --pipelines sparse_dist,fused,overlap --attribute   # R2's link

Per workload (:data:`benchmarks.real_runs.WORKLOADS`): TorchRec's ``EmbeddingShardingPlanner`` plan, sharded for
training as the step calibration's probes are (``measure.probe.shard_for_training``), ranks pinned
to their cores, pre-built batches. ``--models`` models per pipeline, built in turn, all kept, then
``--blocks`` interleaved blocks of ``--block-steps`` timed steps of each (order rotated), the
per-step slowest rank. Prints each model's median step (the spread between models of one
pipeline is the A/A), each pipeline's median over its models' steps and its ratio to the first
pipeline's. ``--attribute``: then each pipeline's first model profiled
(``measure.attribution.attribute_steps``): ms per step by sparse-path node kind, rank 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.planner import Topology

from benchmarks.harness import Cycle, exit_now, interleaved_rounds, names_arg, start_worker, stop_worker, timed_steps
from benchmarks.real_runs import BATCH_SEED, WORKLOADS, _workloads, torchrec_plan_of
from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.measure import probe
from torchrec_sparselift.measure.attribution import attribute_steps
from torchrec_sparselift.runtime.pipelines import make_train_pipeline
from torchrec_sparselift.vocabulary import PIPELINES as PIPELINE_KINDS

__all__ = ["main"]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="hot_skewed,kaggle,few_large", help=f"comma-separated from {','.join(WORKLOADS)}")
    p.add_argument("--pipelines", default="sparse_dist,fused", help="comma-separated pipeline kinds; ratios to the first")
    p.add_argument("--models", type=int, default=4, help="models per pipeline (default 4)")
    p.add_argument("--blocks", type=int, default=8, help="interleaved blocks per model (default 8)")
    p.add_argument("--block-steps", type=int, default=5, help="timed steps per block (default 5)")
    p.add_argument("--attribute", action="store_true", help="profile each pipeline's first model after timing")
    args = p.parse_args(argv)
    args.workloads = names_arg(p, "--workloads", args.workloads, WORKLOADS)
    args.pipelines = names_arg(p, "--pipelines", args.pipelines, PIPELINE_KINDS)
    for name in ("models", "blocks", "block_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --standalone --nproc_per_node 2 -m benchmarks.pipeline_models",
              file=sys.stderr)
        return 2
    me = start_worker()
    rank, world, device, say = me.rank, me.world_size, me.device, me.say
    try:
        topo = Topology(world_size=world, local_world_size=ranks_per_host(world_size=world), compute_device="cpu")
        for wname in args.workloads:
            w, alpha = _workloads()[wname]
            plan, _cons = torchrec_plan_of(w, topo, dist.group.WORLD)
            batches = probe.prebuilt_batches(w, 6, seed=BATCH_SEED, rank=rank, alpha=alpha)
            runs = [(k, m) for m in range(args.models) for k in args.pipelines]
            old = probe.pin_rank_to_core(dist.group.WORLD)
            built: Dict[tuple, tuple] = {}
            try:
                for k, m in runs:
                    torch.manual_seed(m)
                    dmp, opt = probe.shard_for_training(probe.probe_model(w), plan, device)
                    built[(k, m)] = (make_train_pipeline(k, dmp, opt, device), Cycle(batches))
                    for _ in range(3):
                        built[(k, m)][0].progress(built[(k, m)][1])
                times: Dict[tuple, List[float]] = {r: [] for r in runs}

                def measure(r: tuple, _block: int) -> None:
                    pipe, it = built[r]
                    # one untimed step first: the switch from the previous model
                    timer = timed_steps(lambda: pipe.progress(it), args.block_steps, me.pg, device, untimed=1)
                    times[r].extend(timer.slowest_rank_durations_s(me.pg))

                interleaved_rounds(runs, measure, args.blocks)
                per = {k: [x for m in range(args.models) for x in times[(k, m)]] for k in args.pipelines}
                ref = float(np.median(per[args.pipelines[0]]))
                say(f"{wname}: " + "; ".join(
                    f"{k} {np.median(per[k]) * 1e3:.2f} ms ({np.median(per[k]) / ref:.3f}), models "
                    + "/".join(f"{np.median(times[(k, m)]) * 1e3:.1f}" for m in range(args.models))
                    for k in args.pipelines))
                if args.attribute:
                    for k in args.pipelines:
                        pipe, it = built[(k, 0)]
                        att = attribute_steps(pipe, it, steps=5, warmup_steps=1, pg=dist.group.WORLD, label=k,
                                              pipeline=k)
                        r0 = att.ranks[0]
                        say(f"  {k} attributed step {r0.step_ms:.1f} ms (rank 0): " + ", ".join(
                            f"{kind} {ms:.1f}" for kind, ms in sorted(r0.kinds_ms.items(), key=lambda x: -x[1])
                            if ms >= 0.05))
            finally:
                built.clear()
                gc.collect()
                probe.restore_affinity(old)
    finally:
        stop_worker()
    return 0


if __name__ == "__main__":
    exit_now(main)
