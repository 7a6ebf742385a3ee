"""Before/after check for structural changes: plans, predicted step times and bounds, to 1e-9.

Records what the planner decides on the planner benchmark's scenarios (simulated GPU clusters
with several hardware presets and options) and on random small planning inputs (CPU and GPU
topologies, constraints, batch sizes, solvers, lossy comm, staleness, 2D groups), then compares
a later checkout against the record::

    python -m benchmarks.plan_snapshot record runs/snapshot.json [--random 2000]
    python -m benchmarks.plan_snapshot compare runs/snapshot.json [--limit 300] [--only scenarios]

Per input it keeps every table's sharding type, compute kernel and ranks, the chosen pipeline and
comm precision, the predicted step time, the lower bound, and the plan re-priced by
``evaluate_sharding_plan`` under the ``base`` pipeline. ``compare`` prints every difference
(relative tolerance ``--rtol``, default 1e-9) and exits 1 if there is one. An input whose search
a wall-clock limit cut short (``search_status`` says so) is reported but not counted: its plan
depends on the machine's speed, not on the code. So are the step times of the 2D options the
planner priced but did not choose (each is searched on a slice of the budget). Run it on a quiet
machine: under load more searches hit their limit.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.planners import resolve_hardware  # the planner benchmark's presets

GiB = 1 << 30

SCENARIOS: Tuple[Tuple[str, int, str, Dict[str, Any]], ...] = (
    # workload, world size, hardware preset, extra planner arguments
    ("kaggle", 8, "h100", {}),
    ("dcnv2", 8, "h100", {}),
    ("dcnv2", 16, "h100", {}),
    ("dcnv2", 64, "h100", {}),
    ("dcnv2", 128, "h100", {}),
    ("production-200", 64, "h100", {}),
    ("production-856", 128, "h100", {}),
    ("dcnv2", 16, "a100", {}),
    ("dcnv2", 64, "h200", {}),
    ("kaggle", 8, "torchrec-constants", {}),
    ("dcnv2", 64, "torchrec-constants", {}),
    ("kaggle", 8, "h100", {"allow_lossy_comm": True}),
    ("dcnv2", 16, "h100", {"allow_lossy_comm": True, "allow_staleness": True}),
    ("kaggle", 8, "h100", {"solver": "milp"}),
    ("dcnv2", 64, "h100", {"sharding_group_size": "auto"}),
    ("dcnv2", 64, "h100", {"sharding_group_size": 8}),
    ("production-200", 64, "h100", {"sharding_group_size": "auto", "allow_lossy_comm": True}),
    ("kaggle", 16, "a100", {"pipelines": ["base"]}),
    ("dcnv2", 8, "h100", {"allow_staleness": True}),
)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("torchrec", "torchrec_sparselift", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger(name).propagate = False


def _hardware(name: str) -> Any:
    return resolve_hardware(name)


def _summary(res: Any, module: Any, topo: Any, batch: int, cons: Any, hardware: Any) -> Dict[str, Any]:
    from torchrec_sparselift.planner import evaluate_sharding_plan

    s = res.search
    tables = []
    for o in sorted(res.sharding_options, key=lambda o: o.name):
        ranks = [sh.rank for sh in o.shards]
        tables.append([o.name, o.sharding_type, o.compute_kernel, ranks])
    rec: Dict[str, Any] = {
        "tables": tables,
        "pipeline": s.pipeline,
        "comm": [s.fwd_precision, s.bwd_precision],
        "step_s": s.step.total_s,
        "lower_bound_s": s.lower_bound_s,
        "status": str(s.status),
        "solver": s.solver,
    }
    try:
        ev = evaluate_sharding_plan(module, res.sharding_plan, topo, batch, cons, hardware=hardware,
                                    pipeline="base")
        rec["base_step_s"] = ev.search.step.total_s
    except Exception as e:  # recorded, compared like any value
        rec["base_step_s"] = f"error: {type(e).__name__}: {e}"
    rec["two_d"] = [res.sharding_group_size, res.sync_interval, res.sync_s,
                    [list(a) for a in res.alternatives_layout]]
    rec["total_step_s"] = res.step_time_s
    return rec


def _plan(module: Any, topo: Any, batch: int, cons: Any, hardware: Any, extra: Dict[str, Any],
          budget: float) -> Dict[str, Any]:
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.planner import SparseLiftPlanner

    kw = dict(extra)
    planner = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=cons, hardware=hardware,
                                debug=False, time_budget_s=budget, **kw)
    try:
        res = planner.plan_with_result(module, get_default_sharders())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return _summary(res, module, topo, batch, cons, hardware)


def scenario_records(budget: float) -> Dict[str, Any]:
    from torchrec.distributed.planner.types import Topology

    from torchrec_sparselift.semantics.reference_workloads import by_name

    out = {}
    for wl_name, ws, hw, extra in SCENARIOS:
        wl = by_name(wl_name)
        topo = Topology(world_size=ws, local_world_size=min(8, ws), compute_device="cuda", hbm_cap=80 * GiB)
        key = f"{wl_name}@{ws}/{hw}/{json.dumps(extra, sort_keys=True)}"
        t0 = time.perf_counter()
        out[key] = _plan(wl.module(), topo, wl.per_rank_batch(ws), wl.constraints(), _hardware(hw), extra, budget)
        print(f"  {key}: {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def _random_case(rng: random.Random) -> Tuple[Any, ...]:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner.types import ParameterConstraints, Topology

    device = rng.choice(["cpu", "cuda"])
    ws = rng.choice([1, 2, 2, 4, 4, 8, 16])
    lws = ws if device == "cpu" else min(ws, rng.choice([2, 4, 8]))
    if ws % lws:
        lws = ws
    ntab = rng.randint(2, 14)
    tables = []
    for i in range(ntab):
        rows = int(10 ** rng.uniform(1, 6.5))
        dim = rng.choice([4, 8, 16, 32, 64, 128])
        tables.append((f"t{i}", rows, dim, round(rng.uniform(1, 40), 2)))
    module = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
                for n, r, d, _ in tables],
        device=torch.device("meta"))
    types = ["data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"]
    kernels = ["dense", "fused"] if device == "cpu" else ["fused", "fused_uvm_caching", "dense"]
    cons = {}
    for n, _, _, pf in tables:
        c: Dict[str, Any] = {"pooling_factors": [pf]}
        if rng.random() < 0.3:
            c["sharding_types"] = rng.sample(types, rng.randint(1, 3))
        if rng.random() < 0.2:
            c["compute_kernels"] = rng.sample(kernels, rng.randint(1, 2))
        cons[n] = ParameterConstraints(**c)
    hbm = int(rng.choice([0.25, 1, 16, 80]) * GiB)
    topo = Topology(world_size=ws, local_world_size=lws, compute_device=device, hbm_cap=hbm,
                    ddr_cap=int(rng.choice([4, 64, 256]) * GiB))
    batch = rng.choice([32, 256, 1024, 4096])
    hw = "cpu-gloo" if device == "cpu" else rng.choice(["h100", "a100", "h200"])
    extra: Dict[str, Any] = {"solver": rng.choice(["auto", "auto", "heuristic", "milp"])}
    if rng.random() < 0.25:
        extra["allow_lossy_comm"] = True
    if rng.random() < 0.2:
        extra["allow_staleness"] = True
    if rng.random() < 0.15 and ws >= 4:
        extra["sharding_group_size"] = rng.choice(["auto", ws // 2])
    desc = {"device": device, "ws": ws, "lws": lws, "tables": tables, "hbm": hbm, "batch": batch, "hw": hw,
            "extra": extra, "cons": {k: {kk: vv for kk, vv in v.__dict__.items() if vv is not None}
                                     for k, v in cons.items()}}
    return module, topo, batch, cons, hw, extra, desc


def random_records(n: int, seed: int, budget: float) -> Dict[str, Any]:
    from torchrec_sparselift.cost.hardware import get_profile

    rng = random.Random(seed)
    out = {}
    t0 = time.perf_counter()
    for i in range(n):
        module, topo, batch, cons, hw, extra, desc = _random_case(rng)
        rec = _plan(module, topo, batch, cons, get_profile(hw), extra, budget)
        rec["input"] = json.loads(json.dumps(desc, default=str))
        out[f"random-{i}"] = rec
        if (i + 1) % 100 == 0:
            print(f"  {i + 1}/{n} random inputs, {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _time_limited(rec: Dict[str, Any]) -> bool:
    return rec.get("status") == "time_limit" or "time_limit" in str(rec.get("solver", ""))


def _diff(a: Any, b: Any, rtol: float, path: str, out: List[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k == "input":
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'before' if k in a else 'after'}")
            else:
                _diff(a[k], b[k], rtol, f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} -> {len(b)}")
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                _diff(x, y, rtol, f"{path}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float):
        if not (a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rtol * max(abs(a), abs(b)))):
            out.append(f"{path}: {a!r} -> {b!r}")
    elif a != b:
        out.append(f"{path}: {a!r} -> {b!r}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_snapshot", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("record", "compare"))
    p.add_argument("path", help="the snapshot JSON (written by record, read by compare)")
    p.add_argument("--random", type=int, default=2000, help="random inputs (record; default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=10.0, help="planner time budget per input, s (default 10)")
    p.add_argument("--rtol", type=float, default=1e-9)
    p.add_argument("--only", choices=("scenarios", "random"), default=None, help="compare one part only")
    p.add_argument("--limit", type=int, default=None, help="compare: only the first N random inputs")
    args = p.parse_args(argv)
    _quiet()
    if args.mode == "record":
        t0 = time.perf_counter()
        data = {"random": args.random, "seed": args.seed, "budget": args.budget,
                "scenarios": scenario_records(args.budget),
                "random_inputs": random_records(args.random, args.seed, args.budget)}
        with open(args.path, "w") as f:
            json.dump(data, f, indent=0, default=str)
        print(f"recorded {len(data['scenarios'])} scenarios and {args.random} random inputs in "
              f"{time.perf_counter() - t0:.0f} s -> {args.path}")
        return 0
    with open(args.path) as f:
        before = json.load(f)
    parts = {}
    if args.only in (None, "scenarios"):
        parts["scenarios"] = scenario_records(before["budget"])
    if args.only in (None, "random"):
        n = before["random"] if args.limit is None else min(args.limit, before["random"])
        parts["random_inputs"] = random_records(n, before["seed"], before["budget"])
    diffs: List[str] = []
    skipped = 0
    checked = 0
    for part, after in parts.items():
        for key, rec in after.items():
            old = before[part].get(key)
            if old is None:
                diffs.append(f"{key}: not in the snapshot")
                continue
            d: List[str] = []
            _diff(old, rec, args.rtol, key, d)
            side = [x for x in d if ".two_d[3]" in x]  # 2D options not chosen: budget-limited sub-searches
            d = [x for x in d if ".two_d[3]" not in x]
            for x in side:
                print(f"  (2D option not chosen, searched on a slice of the budget, not counted) {x}")
            if d and (_time_limited(old) or _time_limited(rec)):
                skipped += 1
                print(f"  (time-limited search, not counted) {d[0]}")
                continue
            checked += 1
            diffs += d
    for line in diffs[:200]:
        print("DIFF", line)
    print(f"{checked} inputs compared, {skipped} time-limited skipped: "
          f"{'identical' if not diffs else f'{len(diffs)} differences'} (rtol {args.rtol:g})")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
