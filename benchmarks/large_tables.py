"""Large tables against the calibration's own large-table probe: is a term missing that grows with
table size?

    torchrun --standalone --nproc_per_node 2 -m benchmarks.large_tables steps --profile P.json [--rounds 4] [--out R.json]
    python -m benchmarks.large_tables kernels [--passes 20] [--id-sets 64]

``steps``: the table-wise plans of ``probe_many`` (16 tables within the cache), ``probe_large`` (the
step calibration's large-table probe, tables of 2k-200k rows), the benchmark workload ``few_large``
(100k-300k rows, :data:`benchmarks.real_runs.WORKLOADS`) and :data:`XL` (0.5M-3M rows, 0.12-0.73 GiB
per table: 15 times ``probe_large``'s largest), each a fresh model trained as the calibration's probes
are (``measure.probe.measure_plan``, pinned ranks, pre-built batches), in interleaved rounds (order
reversed every other round), then 5 profiled steps each (``measure.attribution``). The plans are
priced under ``--profile`` (a step-fitted profile; no workload here is fitted). On a shared machine
the step's absolute ratio predicted / measured moves with the machine's load from one minute to the
next, alike for every plan; what tells a size-dependent term is each workload's ratio *relative to
probe_large's in the same round* (:func:`relative_ratios`): 1.0 where the model scales from the
probe's tables to the larger ones as the machine does. Per rank it also prints the sparse work the
profiler attributes (lookup, KJT, TBE backward with its fused update) against the model's for the
tables the rank owns.

``kernels``: one process, one fbgemm TBE with the fused row-wise AdaGrad (as TorchRec's fused tables
run it), forward + backward of 2,048 ids (bags of 2, the workloads' power-law ids) on tables of 2k
to 3M rows, ``--id-sets`` id sets cycled call by call, interleaved passes: seconds per id and per
distinct row, and each size's time relative to the 200k-row table in the same pass. The rows one
pass touches stay within a large last-level cache (480 MiB on the 2-core box), so the sweep shows
what grows with distinct rows, not the misses of a step whose other work runs between lookups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch

from benchmarks.harness import exit_now, worker
from benchmarks.real_runs import _workloads
from torchrec_sparselift.calibration.attribution import predicted_by_kind
from torchrec_sparselift.calibration.pricer import PlanPricer
from torchrec_sparselift.cost import terms
from torchrec_sparselift.cost.hardware import get_profile
from torchrec_sparselift.cost.model import dp_optimizer_s, shard_cost
from torchrec_sparselift.measure import probe
from torchrec_sparselift.measure.microbench import _TbeTable, time_per_call
from torchrec_sparselift.measure.steps import PROBE_BATCHES, forced_plan, probe_topology

__all__ = ["XL", "relative_ratios", "power_law_ids", "main"]

#: 15 times the calibration's largest probe table (200k rows): 0.5M-3M rows of dim 64 (0.12-0.73 GiB each).
XL = probe.ProbeWorkload("xl_large", probe._tables("x", [(3_000_000, 64, 1, 2.0), (2_000_000, 64, 1, 1.0),
                                                         (1_000_000, 64, 1, 4.0), (500_000, 64, 1, 1.0)]),
                         model="dlrm", dense=(64,), batch_size=512)
#: The reference workload of :func:`relative_ratios` (a probe plan of the step calibration).
REFERENCE = "probe_large"
SPARSE_KINDS = ("lookup", "kjt", "backward_update")
SPARSE_COLUMNS = ("fwd_s", "bwd_s", "cold_rows_s")
KERNEL_ROWS = (2_000, 40_000, 200_000, 1_000_000, 3_000_000)
KERNEL_IDS = 2048


def relative_ratios(predicted: Mapping[str, float], measured: Mapping[str, Sequence[float]],
                    reference: str = REFERENCE) -> Dict[str, List[float]]:
    """Per workload, per round: ``(predicted / measured) / (predicted_ref / measured_ref)`` of the
    same round (rounds paired by position). 1.0: the workload is priced as well as ``reference``."""
    if reference not in measured:
        raise ValueError(f"reference workload {reference!r} not measured; measured: {sorted(measured)}")
    ref = measured[reference]
    out = {}
    for name, ms in measured.items():
        if name == reference:
            continue
        if len(ms) != len(ref):
            raise ValueError(f"{name!r} has {len(ms)} rounds, {reference!r} {len(ref)}: rounds must pair")
        out[name] = [(predicted[name] / m) / (predicted[reference] / r) for m, r in zip(ms, ref)]
    return out


def power_law_ids(rows: int, n: int, seed: int, alpha: float = 1.05) -> torch.Tensor:
    """``n`` ids over ``rows`` as ``measure.probe.prebuilt_batches`` draws them (power law, hashed)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    e = 1.0 - alpha
    top = torch.tensor(rows + 1.0, dtype=torch.float64)
    k = torch.floor(((torch.pow(top, e) - 1.0) * u + 1.0) ** (1.0 / e)).long() - 1
    return (k.clamp(0, rows - 1) * 2147483647 + 12345) % rows


def _cases() -> List[Tuple[str, Any, float]]:
    fl, alpha = _workloads()["few_large"]
    named = {w.name: w for w in probe.PROBE_WORKLOADS}
    return [("probe_many", named["probe_many"], 1.05), (REFERENCE, named[REFERENCE], 1.05),
            ("few_large", fl, alpha), (XL.name, XL, 1.05)]


def _sparse_per_rank(pricer: PlanPricer, profile: Any, world: int) -> List[float]:
    """The model's sparse seconds (lookup, backward + fused update, cold lookups) per rank."""
    cols = [terms.layout().index[c] for c in SPARSE_COLUMNS]
    ctx = pricer.given.context(profile)
    out = [0.0] * world
    for h, (cand, ranks) in zip(pricer.given.handles, pricer.given.placed):
        owner = shard_cost(h.spec, cand, ctx).owner
        out[ranks[0]] += float(sum(owner[c] for c in cols))
    return out


def run_steps(args: argparse.Namespace) -> int:
    profile = get_profile(args.profile)
    with worker(pin=False) as me:
        world = me.world_size
        topo = probe_topology(world, "cpu")
        setup = []
        for name, w, alpha in _cases():
            stats = probe.probe_stats(w, alpha, n=PROBE_BATCHES)
            plan, cons = forced_plan(probe.probe_model(w), w.tables, "table_wise", topo, w.batch_size, me.pg,
                                     profile, stats=stats)
            pricer = PlanPricer(probe.probe_model(w), plan, topo, w.batch_size, cons, stats=stats)
            step = pricer.step_time(profile)
            kinds = predicted_by_kind(step, dp_optimizer_s=dp_optimizer_s(pricer.specs, pricer.cands,
                                                                          pricer.given.context(profile)))
            batches = probe.prebuilt_batches(w, PROBE_BATCHES, seed=0, rank=me.rank, alpha=alpha)
            setup.append((name, w, plan, batches))
            me.say(f"[large_tables] {name}: predicted {step.total_s * 1e3:.1f} ms")
            args_res = dict(predicted_ms=step.total_s * 1e3, predicted_kinds_ms={k: v * 1e3 for k, v in kinds.items()},
                            predicted_sparse_ms=[s * 1e3 for s in _sparse_per_rank(pricer, profile, world)],
                            measured_ms=[], sparse_ms=[])
            setup[-1] = setup[-1] + (args_res,)
        for r in range(args.rounds):
            for name, w, plan, batches, res in (setup if r % 2 == 0 else setup[::-1]):
                torch.manual_seed(0)
                m = probe.measure_plan(name, lambda: probe.probe_model(w), plan, batches, pg=me.pg, attribute=5)
                res["measured_ms"].append(m.median_s * 1e3)
                res["sparse_ms"].append([sum(rk.kinds_ms.get(k, 0.0) for k in SPARSE_KINDS)
                                         for rk in m.attribution.ranks])
                me.say(f"[large_tables] round {r} {name}: {m.median_s * 1e3:.1f} ms")
        results = {name: res for name, _w, _p, _b, res in setup}
        rel = relative_ratios({n: v["predicted_ms"] for n, v in results.items()},
                              {n: v["measured_ms"] for n, v in results.items()})
        if me.rank == 0:
            print(f"\nworkload      predicted  measured ms (rounds)                 pred/meas  vs {REFERENCE} (median, range)")
            for n, v in results.items():
                ratio = statistics.median(v["predicted_ms"] / x for x in v["measured_ms"])
                rr = rel.get(n)
                tail = f"{statistics.median(rr):.3f} ({min(rr):.3f}-{max(rr):.3f})" if rr else "1 (reference)"
                print(f"{n:<13} {v['predicted_ms']:8.1f}  {' '.join(f'{x:5.1f}' for x in v['measured_ms']):<36} "
                      f"{ratio:8.2f}  {tail}")
            print("\nsparse work per rank (lookup + KJT + TBE backward with its update), ms: predicted / measured median")
            for n, v in results.items():
                per = [statistics.median(s[i] for s in v["sparse_ms"]) for i in range(world)]
                print(f"{n:<13} " + "  ".join(f"rank {i} {p:.2f} / {m:.2f}"
                                              for i, (p, m) in enumerate(zip(v["predicted_sparse_ms"], per))))
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump(dict(results=results, relative=rel, profile=args.profile), f, indent=1)
    return 0


def run_kernels(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    tabs = {}
    off = torch.arange(0, KERNEL_IDS + 1, 2, dtype=torch.int64)
    grad = torch.ones(off.numel() - 1, 64)
    for rows in KERNEL_ROWS:
        # id sets cycled call by call: args.id_sets = 1 repeats one batch (its rows stay cached)
        sets = [power_law_ids(rows, KERNEL_IDS, seed=rows * 1000 + i) for i in range(args.id_sets)]
        tabs[rows] = (_TbeTable(rows, 64, cpu), sets, statistics.fmean(int(torch.unique(x).numel()) for x in sets))
    secs: Dict[int, List[float]] = {r: [] for r in KERNEL_ROWS}
    for p in range(args.passes):
        for rows in (KERNEL_ROWS if p % 2 == 0 else KERNEL_ROWS[::-1]):
            t, sets, _d = tabs[rows]
            nxt = iter(sets * 1000)
            secs[rows].append(time_per_call(lambda: t.forward_backward(next(nxt), off, grad), cpu, warmup=2, trials=5,
                                            target_trial_s=0.01, max_inner=20, stat="min"))
    base = 200_000
    print(f"fbgemm TBE + fused row-wise AdaGrad, forward + backward of {KERNEL_IDS} ids, dim 64, "
          f"{args.id_sets} id sets cycled, {args.passes} passes")
    for rows in KERNEL_ROWS:
        med, d = statistics.median(secs[rows]), tabs[rows][2]
        rel = [a / b for a, b in zip(secs[rows], secs[base])]
        print(f"rows {rows:>9} ({rows * 256 / 2 ** 20:6.1f} MiB) distinct {d:6.0f}: {med * 1e6:7.1f} us, "
              f"{med / KERNEL_IDS * 1e9:6.1f} ns/id, {med / d * 1e9:7.1f} ns/distinct row; vs 200k rows "
              f"{statistics.median(rel):.3f} ({min(rel):.3f}-{max(rel):.3f}), distinct {d / tabs[base][2]:.3f}")
    return 0


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("steps", help="interleaved table-wise steps (torchrun, 2 ranks)")
    s.add_argument("--profile", required=True, help="a step-fitted hardware profile JSON to price with")
    s.add_argument("--rounds", type=int, default=4)
    s.add_argument("--out", help="write the measurements and predictions here (JSON)")
    k = sub.add_parser("kernels", help="one TBE, tables of 2k-3M rows (one process)")
    k.add_argument("--passes", type=int, default=20)
    k.add_argument("--id-sets", type=int, default=64, help="distinct id sets cycled call by call (1: one batch "
                   "repeated, whose rows stay in the cache)")
    a = p.parse_args(list(argv) or None)
    if a.mode == "steps" and a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.mode == "kernels" and (a.passes < 1 or a.id_sets < 1):
        p.error(f"--passes and --id-sets must be >= 1, got {a.passes} and {a.id_sets}")
    warnings.filterwarnings("ignore")
    return run_steps(a) if a.mode == "steps" else run_kernels(a)


if __name__ == "__main__":
    exit_now(lambda: main(sys.argv[1:]))
