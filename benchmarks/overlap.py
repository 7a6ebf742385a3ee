"""The overlap pipeline against TorchRec's, on emulated hosts: ms/step, hidden vs exposed
communication, the dependency bound and the share of it reached.

    # all regimes (needs root for the testbed): 2 one-rank hosts sharing 1 Gbit/s, then 300 Mbit/s,
    # then one host without shaping (compute-bound)
    python -m benchmarks.overlap --regimes 1gbit,300mbit,none --rounds 5 --out overlap.json

    # one job by hand (what each regime runs, under torchrun or the testbed)
    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 1 --rate 1gbit --shared -- \\
        -m benchmarks.overlap --worker --out r.json

The worker builds the DLRM model (:mod:`torchrec_sparselift.dlrm`) (DCNv2 tables, ``--scale``, ``--embedding-dim``,
``--arch``) and TorchRec's plan with every table table-wise (``EmbeddingShardingPlanner`` with a
``sharding_types=["table_wise"]`` constraint per table), shards it once per pipeline kind (same
seed, same weights) and times the kinds in interleaved rounds (the order rotates every round):
each round runs ``--warmup`` untimed and ``--steps`` timed steps per kind. Every step is traced
(:class:`~torchrec_sparselift.runtime.overlap.CommTimeline`, installed for all kinds alike): each
collective's issue, completion and the waits on it; the bottom MLP's forward/backward; the end of
the autograd graph and of backward.

Reported per kind: ms/step (slowest rank's mean per round; median over rounds, and each round's
ratio to sparse_dist), and per collective kind the ms in flight, exposed (waited for) and hidden.
The *dependency bound* is what exact scheduling can hide on top of sparse_dist (which already
hides the next batch's input_dist), from sparse_dist's own timeline (median step, mean of ranks)::

    bound = min(output_dist, dense_fwd) + min(grad_dist, dense_bwd) + min(allreduce, emb_bwd)

(the output all-to-all behind the bottom MLP's forward; the gradient all-to-all behind its
backward; the dense all-reduce behind the embedding backward with its fused update). Achieved =
sparse_dist's step minus overlap's, paired per round; the ratio achieved/bound is the target
(>= 0.8).

The package's kinds (``overlap``, and the stale ``overlap_stale``) are also set against the best
of TorchRec's kinds timed (``base``, ``sparse_dist``, ``fused``, ``prefetch``, ``semi_sync``): per
round, the fastest TorchRec step over the kind's step (``speedup_over_best_torchrec``), and
``overlap`` over ``overlap_stale``. *Predicted*: each of ``sparse_dist``, ``overlap`` and
``overlap_stale`` as its step composition in ``cost.pipelines`` (what the planner prices) gives it
from sparse_dist's measured phases (:func:`measured_phases`: collectives in flight, lookup, dense
work split at the embeddings, embedding backward, the rest as step overhead), set against its
measured step. This checks the compositions, not the calibrated cost terms.

    python -m benchmarks.overlap --regimes 1gbit,300mbit --rounds 6 --steps 3 --warmup 1 --out stale.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

from benchmarks.harness import exit_now, interleaved_rounds, median_step, start_worker, stop_worker, timed_steps
from benchmarks.harness import write_report
from benchmarks.harness.report import REPO
from torchrec_sparselift.cost.pipelines import evaluate, pipeline_kind, terms
from torchrec_sparselift.dlrm.data import synthetic_batches
from torchrec_sparselift.dlrm.model import arch_spec, build_model, shard_model
from torchrec_sparselift.dlrm.tables import preset_tables, scale_tables
from torchrec_sparselift.measure import testbed
from torchrec_sparselift.runtime.overlap import (CommTimeline, TrainPipelineOverlap, step_windows,
                                                 timeline_attribution)
from torchrec_sparselift.runtime.pipelines import make_train_pipeline

KINDS = ("base", "sparse_dist", "fused", "prefetch", "semi_sync", "overlap", "overlap_stale",
         "overlap_stale/late_allreduce")
#: benchmark-only variants: a kind with constructor options
VARIANTS = {"overlap_stale/late_allreduce": ("overlap_stale", {"early_allreduce": False})}
#: TorchRec's own pipelines (the best of those present is what the package's kinds are set against)
TORCHREC_KINDS = ("base", "sparse_dist", "fused", "prefetch", "semi_sync")
#: the package's kinds whose step the cost model composes on CPU between hosts (predicted below)
PREDICTED_KINDS = ("sparse_dist", "overlap", "overlap_stale")
REFERENCE = "sparse_dist"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help="run as one rank of a torchrun job")
    p.add_argument("--regimes", default="1gbit,300mbit,none",
                   help="comma list: a shared-link rate for 2 one-rank hosts (1gbit, 300mbit, ...) or none "
                        "(one host, no shaping: compute-bound)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="timed steps per kind per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per kind per round")
    p.add_argument("--scale", type=float, default=0.001)
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--arch", default="small", choices=["small", "mlperf"])
    p.add_argument("--batches", type=int, default=8, help="distinct batches, cycled")
    p.add_argument("--no-pin", action="store_true", help="do not pin each rank to its own core (the example's "
                   "default pins, and so does this benchmark)")
    p.add_argument("--out", help="JSON results (all regimes; with --worker, this job's)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per regime")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown or REFERENCE not in args.kinds:
        p.error(f"--kinds: unknown {unknown}, choose from {','.join(KINDS)} (include {REFERENCE})")
    args.regimes = [r for r in args.regimes.split(",") if r]
    return args


# ------------------------------------------------------------------------------------------------
# worker (one rank)
# ------------------------------------------------------------------------------------------------


def _pipeline(kind: str, dmp: Any, opt: Any, device: Any) -> Any:
    if kind == "base":
        return TrainPipelineBase(dmp, opt, device)
    if kind == "sparse_dist":
        return TrainPipelineSparseDist(dmp, opt, device, execute_all_batches=True)
    if kind == "semi_sync":  # stale from the first step (TorchRec's default waits 900 steps)
        return make_train_pipeline("semi_sync", dmp, opt, device, options={"start_batch": 0})
    if kind == "overlap":
        return TrainPipelineOverlap(dmp, opt, device)
    if kind in VARIANTS:  # the DDP all-reduce as one bucket at the end of the backward
        name, options = VARIANTS[kind]
        return make_train_pipeline(name, dmp, opt, device, options=options)
    return make_train_pipeline(kind, dmp, opt, device)  # fused, prefetch (CPU adaptations), overlap_stale


def table_wise_dcn(embedding_dim: int, scale: float, arch_name: str, batch_size: int, world: int,
                   local_world_size: int, pg: Any) -> Tuple[List[Any], Any, Any]:
    """``(tables, arch, plan)``: the DLRM library's DCNv2 tables at ``scale`` and TorchRec's plan of
    its DCN model with every table table-wise (``EmbeddingShardingPlanner`` with a
    ``sharding_types=["table_wise"]`` constraint per table), every rank of ``pg`` alike."""
    tables = scale_tables(preset_tables("dcnv2", embedding_dim), scale)
    arch = arch_spec(arch_name, embedding_dim)
    constraints = {t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topology = Topology(world_size=world, local_world_size=local_world_size, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    return tables, arch, planner.collective_plan(build_model(tables, "dcn", arch), get_default_sharders(), pg)


def worker(args: argparse.Namespace) -> int:
    me = start_worker(pin=not args.no_pin)
    rank, world, pg = me.rank, me.world_size, me.pg
    device = torch.device("cpu")
    tables, arch, plan = table_wise_dcn(args.embedding_dim, args.scale, args.arch, args.batch_size, world,
                                        int(os.environ.get("LOCAL_WORLD_SIZE", world)), pg)
    placement = {name: (ps.sharding_type, ps.ranks) for mp in plan.plan.values() for name, ps in mp.items()}
    batches = list(itertools.islice(synthetic_batches(tables, args.batch_size, 0, rank, args.batches), args.batches))

    timeline = CommTimeline()
    runs: Dict[str, Any] = {}
    for kind in args.kinds:
        torch.manual_seed(0)
        dmp, opt = shard_model(build_model(tables, "dcn", arch), plan, device, 0.05, "adagrad", 0.005)
        pipe = _pipeline(kind, dmp, opt, device)
        timeline.install(dmp, pipe)
        runs[kind] = (pipe, itertools.cycle(batches))

    per_round: Dict[str, List[float]] = {k: [] for k in args.kinds}
    steps: Dict[str, List[Dict[str, float]]] = {k: [] for k in args.kinds}
    timelines: Dict[str, List[Any]] = {}

    def measure(kind: str, _round: int) -> None:
        pipe, it = runs[kind]
        for _ in range(args.warmup):
            pipe.progress(it)
        timeline.clear()

        def step() -> None:
            timeline.mark("step_start")
            pipe.progress(it)
            timeline.mark("step_end")

        timer = timed_steps(step, args.steps, pg, device)
        per_round[kind].append(timer.record(pg, log=False).mean_s)  # the slowest rank's mean step
        events = list(timeline.events)
        steps[kind].extend(timeline_attribution(events))
        windows = step_windows(events)
        if windows:  # one steady step per kind for the timeline (the last round's middle step)
            w = windows[len(windows) // 2]
            timelines[kind] = [(round(1e3 * (t - w[0][0]), 2), what, k) for t, what, k, _c in w]

    interleaved_rounds(args.kinds, measure, args.rounds)
    timeline.uninstall()
    mine = {k: median_step(v) for k, v in steps.items()}
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=pg)
    gathered_timelines: List[Any] = [None] * world
    dist.all_gather_object(gathered_timelines, timelines, group=pg)
    if rank == 0:
        result = {
            "world_size": world,
            "link": os.environ.get("SPARSELIFT_OVERLAP_REGIME", "?"),
            "config": {k: getattr(args, k) for k in ("scale", "embedding_dim", "batch_size", "arch", "rounds",
                                                      "steps", "warmup", "batches", "no_pin")},
            "placement": placement,
            "step_s_per_round": per_round,
            "attribution_per_rank": gathered,
            "timeline_per_rank": gathered_timelines,
        }
        result.update(summarize(result))
        print(format_result(result), flush=True)
        if args.out:
            write_report(args.out, result)
    stop_worker()
    return 0


# ------------------------------------------------------------------------------------------------
# summary (pure)
# ------------------------------------------------------------------------------------------------


def _mean_ranks(per_rank: List[Dict[str, Dict[str, float]]], kind: str, key: str) -> float:
    return statistics.mean(r[kind][key] for r in per_rank)


def dependency_bound(att: Dict[str, float]) -> Dict[str, float]:
    """What exact scheduling can hide beyond sparse_dist, from a step where nothing of it is
    hidden: each window's min(communication, independent compute), in seconds."""
    fwd = min(att["output_dist_inflight"], att["dense_fwd"])
    bwd = min(att["grad_dist_inflight"], att["dense_bwd"])
    ar = min(att["allreduce_inflight"], att["emb_bwd"])
    return {"fwd": fwd, "bwd": bwd, "allreduce": ar, "total": fwd + bwd + ar}


def summarize(result: Dict[str, Any]) -> Dict[str, Any]:
    per_round = result["step_s_per_round"]
    per_rank = result["attribution_per_rank"]
    kinds = list(per_round)
    ref = per_round[REFERENCE]
    out: Dict[str, Any] = {"kinds": {}}
    for kind in kinds:
        att = {key: _mean_ranks(per_rank, kind, key) for key in per_rank[0][kind]}
        out["kinds"][kind] = {
            "step_ms_median": 1e3 * statistics.median(per_round[kind]),
            "ratio_to_sparse_dist_per_round": [a / b for a, b in zip(per_round[kind], ref)],
            "attribution_ms": {k: 1e3 * v for k, v in att.items()},
        }
    ref_att = {key: _mean_ranks(per_rank, REFERENCE, key) for key in per_rank[0][REFERENCE]}
    bound = dependency_bound(ref_att)
    out["bound_ms"] = {k: 1e3 * v for k, v in bound.items()}
    if "overlap" in per_round:
        ov = out["kinds"]["overlap"]["attribution_ms"]
        rf = out["kinds"][REFERENCE]["attribution_ms"]
        windows = ("output_dist", "grad_dist", "allreduce")
        out["exposed_ms"] = {k: {"reference": rf[f"{k}_exposed"], "overlap": ov[f"{k}_exposed"]} for k in windows}
        hidden = sum(rf[f"{k}_exposed"] - ov[f"{k}_exposed"] for k in windows)
        out["hidden_gain_ms"] = hidden
        out["hidden_gain_over_bound"] = hidden / out["bound_ms"]["total"] if bound["total"] > 0 else None
        saved = [b - a for a, b in zip(per_round["overlap"], ref)]
        achieved = statistics.median(saved)
        out["achieved_ms"] = 1e3 * achieved
        out["achieved_ms_per_round"] = [1e3 * s for s in saved]
        out["achieved_over_bound"] = achieved / bound["total"] if bound["total"] > 0 else None
    torchrec = [k for k in kinds if k in TORCHREC_KINDS]
    if torchrec:
        best = [min(per_round[k][r] for k in torchrec) for r in range(len(ref))]
        out["best_torchrec_ms_per_round"] = [1e3 * b for b in best]
        out["speedup_over_best_torchrec"] = {}
        for kind in kinds:
            if kind in TORCHREC_KINDS:
                continue
            sp = [b / a for a, b in zip(per_round[kind], best)]
            out["speedup_over_best_torchrec"][kind] = {"per_round": sp, "median": statistics.median(sp)}
        if "overlap_stale" in per_round and "overlap" in per_round:
            sp = [b / a for a, b in zip(per_round["overlap_stale"], per_round["overlap"])]
            out["stale_speedup_over_overlap"] = {"per_round": sp, "median": statistics.median(sp)}
    if "overlap_stale" in per_round and "overlap_stale/late_allreduce" in per_round:
        r = [a / b for a, b in zip(per_round["overlap_stale"], per_round["overlap_stale/late_allreduce"])]
        out["early_over_late_allreduce"] = {"per_round": r, "median": statistics.median(r)}
    out["predicted_ms"] = {k: 1e3 * v for k, v in predicted_steps(ref_att, [k for k in kinds
                                                                           if k in PREDICTED_KINDS]).items()}
    out["predicted_over_measured"] = {k: v / out["kinds"][k]["step_ms_median"]
                                      for k, v in out["predicted_ms"].items()}
    return out


def measured_phases(att: Dict[str, float]) -> Dict[str, float]:
    """The cost model's phases (seconds) measured on a step where nothing of the sparse path is
    hidden but the next batch's input_dist (sparse_dist's): each collective's time in flight, the
    lookup, the dense work split by dependence on the embeddings, the embedding backward, and
    the rest of the step as ``step_overhead`` (step minus everything on its critical path)."""
    ph = {
        "input_dist": att["input_dist_inflight"],
        "uvm_fetch": 0.0,
        "lookup": att["lookup"],
        "output_dist": att["output_dist_inflight"],
        "dense_fwd_indep": att["dense_fwd"],
        "dense_fwd_rest": att["dense_fwd_rest"],
        "dense_bwd_rest": att["dense_bwd_rest"],
        "dense_bwd_indep": att["dense_bwd"],
        "grad_dist": att["grad_dist_inflight"],
        "backward_update": att["emb_bwd"],
        "allreduce": att["allreduce_inflight"],
    }
    ph["dense_fwd"] = ph["dense_fwd_indep"] + ph["dense_fwd_rest"]
    ph["dense_bwd"] = ph["dense_bwd_rest"] + ph["dense_bwd_indep"]
    critical = (att["input_dist_exposed"] + ph["lookup"] + att["output_dist_exposed"] + ph["dense_fwd"]
                + ph["dense_bwd"] + att["grad_dist_exposed"] + ph["backward_update"] + att["allreduce_exposed"])
    ph["step_overhead"] = max(0.0, att["step"] - critical)
    return ph


def predicted_steps(att: Dict[str, float], kinds: Sequence[str]) -> Dict[str, float]:
    """Each kind's step (seconds) as its composition in ``cost.pipelines`` (the one the planner
    prices) gives it from ``att``'s measured phases (:func:`measured_phases`), on CPU (nothing hides
    under the dense backward)."""
    t = terms(measured_phases(att), supports_overlap=False)
    return {k: float(evaluate(pipeline_kind(k).step, t)) for k in kinds}


def format_result(result: Dict[str, Any]) -> str:
    lines = [f"[overlap] link {result['link']}, {result['world_size']} ranks, {result['config']}"]
    lines.append(f"{'kind':28s} {'ms/step':>8s} {'x sparse_dist (rounds)':>28s}   "
                 "in flight / exposed ms: input_dist output_dist grad_dist allreduce")
    for kind, s in result["kinds"].items():
        a = s["attribution_ms"]
        ratios = " ".join(f"{x:.3f}" for x in s["ratio_to_sparse_dist_per_round"])
        comm = "  ".join(f"{a[k + '_inflight']:6.1f}/{a[k + '_exposed']:6.1f}"
                         for k in ("input_dist", "output_dist", "grad_dist", "allreduce"))
        lines.append(f"{kind:28s} {s['step_ms_median']:8.1f} {ratios:>28s}   {comm}"
                     f"   dense fwd {a['dense_fwd']:.1f} bwd {a['dense_bwd']:.1f} emb_bwd {a['emb_bwd']:.1f}")
    b = result["bound_ms"]
    lines.append(f"dependency bound (from {REFERENCE}): {b['total']:.1f} ms = fwd {b['fwd']:.1f} + bwd {b['bwd']:.1f} "
                 f"+ allreduce {b['allreduce']:.1f}")
    if "hidden_gain_ms" in result:
        e = result["exposed_ms"]
        lines.append("exposed ms, sparse_dist -> overlap: " + ", ".join(
            f"{k} {v['reference']:.1f} -> {v['overlap']:.1f}" for k, v in e.items())
            + f"; less exposed: {result['hidden_gain_ms']:.1f} ms = {result['hidden_gain_over_bound']:.2f} of the bound")
    if "achieved_ms" in result:
        r = result["achieved_over_bound"]
        lines.append(f"achieved (sparse_dist - overlap, median of rounds {', '.join(f'{x:.1f}' for x in result['achieved_ms_per_round'])}): "
                     f"{result['achieved_ms']:.1f} ms = {r:.2f} of the bound" if r is not None else "bound 0")
    for kind, sp in result.get("speedup_over_best_torchrec", {}).items():
        lines.append(f"{kind}: best TorchRec step / its step per round "
                     f"{' '.join(f'{x:.3f}' for x in sp['per_round'])}: median {sp['median']:.3f}x")
    if "stale_speedup_over_overlap" in result:
        sp = result["stale_speedup_over_overlap"]
        lines.append(f"overlap / overlap_stale per round {' '.join(f'{x:.3f}' for x in sp['per_round'])}: "
                     f"median {sp['median']:.3f}x")
    if "early_over_late_allreduce" in result:
        r = result["early_over_late_allreduce"]
        lines.append(f"overlap_stale / overlap_stale/late_allreduce per round {' '.join(f'{x:.3f}' for x in r['per_round'])}: "
                     f"median {r['median']:.3f}")
    if result.get("predicted_ms"):
        lines.append("composition of cost.pipelines with sparse_dist's measured phases, predicted / measured: " + ", ".join(
            f"{k} {v:.1f}/{result['kinds'][k]['step_ms_median']:.1f} ms = {result['predicted_over_measured'][k]:.3f}"
            for k, v in result["predicted_ms"].items()))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# driver: one testbed job per regime
# ------------------------------------------------------------------------------------------------


def _rate_bps(text: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for u, f in units.items():
        if text.endswith(u):
            return float(text[: -len(u)]) * f
    return float(text)


def driver(args: argparse.Namespace, argv: Sequence[str]) -> int:
    results = {}
    clean: List[str] = []  # the worker's flags: argv without --regimes/--out and their values
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--regimes", "--out"):
            skip = True
            continue
        if a.startswith("--regimes=") or a.startswith("--out="):
            continue
        clean.append(a)
    for regime in args.regimes:
        if regime == "none":
            topology = testbed.HostLayout(hosts=1, ranks_per_host=2)
        else:
            topology = testbed.HostLayout(hosts=2, ranks_per_host=1, rate_bps=_rate_bps(regime), shared=True)
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            with testbed.emulated_hosts(topology) as bed:
                host_results = bed.torchrun(["-m", "benchmarks.overlap", "--worker", "--out", out, *clean],
                                            env={"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO,
                                                 "SPARSELIFT_OVERLAP_REGIME": regime},
                                            timeout_s=args.timeout, capture=True)
            for h in host_results:
                if not h.ok:
                    print(h.output[-4000:], file=sys.stderr)
                    raise SystemExit(f"regime {regime}: host job failed (exit {h.returncode})")
            text = host_results[0].output
            print(text[text.index("[overlap]"):] if "[overlap]" in text else text[-3000:], flush=True)
            with open(out) as f:
                results[regime] = json.load(f)
    if args.out:
        write_report(args.out, {"regimes": results})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.worker:
        return worker(args)
    return driver(args, argv)


if __name__ == "__main__":
    exit_now(main)
