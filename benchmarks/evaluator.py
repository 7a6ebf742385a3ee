"""How long pricing one shard move takes with the incremental evaluator, against a full
recomputation, on a large plan (default: 2000 production-like tables on 1024 ranks).

    python -m benchmarks.evaluator [--tables 2000] [--world-size 1024]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from typing import List, Optional

import numpy as np

from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import CostContext
from torchrec_sparselift.search.place import greedy_place
from torchrec_sparselift.search.problem import build_problem
from torchrec_sparselift.search.solve import new_evaluator
from torchrec_sparselift.semantics.reference_workloads import production
from torchrec_sparselift.semantics.tables import TableSpec

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=2000)
    ap.add_argument("--world-size", type=int, default=1024)
    ap.add_argument("--moves", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    W = args.world_size
    wl = production(args.tables, seed=args.seed)
    types = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")
    specs = [
        TableSpec(module_path="", name=n, num_embeddings=r, embedding_dim=d, feature_names=(f"f_{n}",),
                  pooling_factor=pf, is_pooled=True, elem_bytes=4, sharding_types=types,
                  compute_kernels=tuple((t, ("dense",) if t == "data_parallel" else ("fused",)) for t in types),
                  batch_size=wl.per_rank_batch(W))
        for n, r, d, pf in wl.tables
    ]
    ctx = CostContext(profile=PRESETS["h100"], world_size=W, local_world_size=8, batch_size=wl.per_rank_batch(W))
    cap = np.full(W, 1e15)
    t0 = time.perf_counter()
    prob = build_problem(specs, ctx, cap, cap.copy())
    ev = new_evaluator(prob, "sparse_dist")
    greedy_place(ev, prob, [ids[0] for ids in prob.candidates])
    print(f"built and seeded {args.tables} tables x {W} ranks in {time.perf_counter() - t0:.1f} s")

    rng = np.random.default_rng(args.seed)
    single = [t for t in range(prob.num_tables) if prob.cands[ev.assignment[t][0]].placement == "free"
              and prob.cands[ev.assignment[t][0]].num_shards == 1]
    moves = [(int(rng.choice(single)), int(rng.integers(0, W))) for _ in range(args.moves)]
    t0 = time.perf_counter()
    for t, r in moves:
        ev.move_objective(t, ev.assignment[t][0], (r,))
    price_us = (time.perf_counter() - t0) / len(moves) * 1e6
    t0 = time.perf_counter()
    n_apply = min(len(moves), 500)
    for t, r in moves[:n_apply]:
        ev.assign(t, ev.assignment[t][0], (r,))
    apply_us = (time.perf_counter() - t0) / n_apply * 1e6
    t0 = time.perf_counter()
    n_full = 5
    for _ in range(n_full):
        ev.full_objective()
    full_us = (time.perf_counter() - t0) / n_full * 1e6
    print(f"price one move (incremental, not applied): {price_us:9.1f} us")
    print(f"apply one move (update rows + top-3 per column): {apply_us:9.1f} us")
    print(f"full recomputation of the plan:            {full_us:9.1f} us")
    print(f"ratio full / incremental pricing: {full_us / price_us:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
