"""One plan of a regime benchmark run under several forced rewrites, side by side: interleaved
rounds of fresh models, where the regime benchmark's two rounds cannot tell rewrites apart.

    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 1 --rate 300mbit --shared -- \\
        -m benchmarks.rewrite_pairs --from runs/r123.json --regime R3 --workload many_small \\
        --row sparselift_split2 --variants 1,8 [--rounds 5] [--out R.json]

``--from``: a ``benchmarks.regimes`` result (``--out``); ``--row``: one of its rows of
``--workload`` in ``--regime`` (``sparselift``, ``torchrec``, ``sparselift_split4``, ...), whose
stored replay (its sharding plan, pipeline, precisions and ids dtype) every variant trains.
``--variants``: comma-separated ``K`` (batch split into K chunks, ``overlap`` where K > 1, the
run's own pipeline at 1; no dedup) or ``Kd`` (the same with every model-parallel feature
deduplicated). Launch it on the link of the regime the run came from (the testbed command above
for R2 and R3: ``--rate 1gbit`` / ``300mbit``; ``torchrun --standalone --nproc_per_node 2`` for R1).

Each round trains every variant once (the order rotated each round; ``benchmarks.regimes.timed_run``,
as the regime benchmark times its runs: ranks pinned, ``--warmup`` untimed then ``--steps`` timed
steps, the slowest rank's steady step). Prints each variant's ms per round, its median, its
median ratio to the first variant paired by round, and whether its last loss agrees with the first
variant's within :data:`LOSS_RTOL` (the rewrites are exact: a difference is a bug).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import warnings
from typing import Any, Dict, List, Mapping, Tuple

from benchmarks.harness import exit_now, interleaved_rounds, paired_ratio, worker, write_report
from benchmarks.real_runs import BATCH_SEED, _workloads
from benchmarks.regimes import lift_run, timed_run
from torchrec_sparselift.cost.batch_split import BATCH_SPLIT_PIPELINE, MAX_CHUNKS
from torchrec_sparselift.measure.probe import prebuilt_batches
from torchrec_sparselift.plan.serialization import sharding_plan_from_dict
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["LOSS_RTOL", "parse_variants", "replay_of", "variant_spec", "main"]

#: the last losses of two variants agree within this (the batch split sums the chunks' losses and
#: gradients in another order than the unsplit step: equal up to floating-point summation order)
LOSS_RTOL = 1e-5


def parse_variants(text: str) -> List[Tuple[int, bool]]:
    """``"1,4,4d"`` -> ``[(1, False), (4, False), (4, True)]``: chunks and dedup per variant.
    ``ValueError`` naming a bad or repeated variant."""
    out: List[Tuple[int, bool]] = []
    for raw in text.split(","):
        v = raw.strip()
        dedup = v.endswith("d")
        digits = v[:-1] if dedup else v
        if not digits.isdigit() or not 1 <= int(digits) <= MAX_CHUNKS:
            raise ValueError(f"--variants: {raw!r} is not K or Kd with K a chunk count in 1..{MAX_CHUNKS} "
                             "(e.g. 1,4,4d)")
        item = (int(digits), dedup)
        if item in out:
            raise ValueError(f"--variants: {raw!r} is given twice")
        out.append(item)
    if not out:
        raise ValueError("--variants: give at least one variant (e.g. 1,4)")
    return out


def replay_of(result: Mapping[str, Any], regime: str, workload: str, run: str) -> Dict[str, Any]:
    """The stored replay entry of ``run`` of ``workload`` in ``regime`` of a regime benchmark
    result. ``ValueError`` naming what is missing and what there is."""
    regimes = result.get("regimes") or {}
    if regime not in regimes:
        raise ValueError(f"--regime {regime}: the result holds {sorted(regimes) or 'no regime'}")
    rows = {w.get("workload"): w.get("rows") or {} for w in regimes[regime].get("workloads", [])}
    if workload not in rows:
        raise ValueError(f"--workload {workload}: {regime} of the result holds {sorted(rows)}")
    row = rows[workload].get(run)
    if row is None:
        raise ValueError(f"--row {run}: {regime} {workload} has the runs {sorted(rows[workload])}")
    replay = row.get("replay")
    if not replay:
        raise ValueError(f"--row {run}: {regime} {workload} stored no replay of it (a 2D or table-row-wise plan, "
                         "or a failed run): pick another run")
    return dict(replay)


def variant_spec(replay: Mapping[str, Any], plan: Any, chunks: int, dedup: bool,
                 features: List[str]) -> Dict[str, Any]:
    """The ``lift_run`` spec of one variant: the replay's plan, precisions and ids dtype; the batch
    split into ``chunks`` (the ``overlap`` pipeline where it splits, the replay's pipeline at 1);
    ``features`` deduplicated where ``dedup``."""
    return dict(plan=plan, pipeline=BATCH_SPLIT_PIPELINE if chunks > 1 else replay["pipeline"],
                fwd=replay.get("fwd"), bwd=replay.get("bwd"), batch_split=chunks if chunks > 1 else None,
                id_dtype=replay.get("id_dtype"), dedup_features=list(features) if dedup else None)


def _label(chunks: int, dedup: bool) -> str:
    return f"{chunks}{'d' if dedup else ''}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", required=True, help="a benchmarks.regimes result JSON")
    p.add_argument("--regime", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--row", default="sparselift", help="the run (row) whose plan the variants train (default sparselift)")
    p.add_argument("--variants", default="1,2,4,8", help="comma-separated K or Kd (default 1,2,4,8)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", help="JSON file for the results (rank 0)")
    args = p.parse_args()
    try:
        variants = parse_variants(args.variants)
        with open(args.source, encoding="utf-8") as f:
            replay = replay_of(json.load(f), args.regime, args.workload, args.row)
        if args.workload not in _workloads():
            raise ValueError(f"--workload {args.workload}: not a benchmark workload ({sorted(_workloads())})")
    except (OSError, ValueError) as e:
        p.error(str(e))
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    warnings.filterwarnings("ignore")
    w, alpha = _workloads()[args.workload]
    plan = sharding_plan_from_dict(replay["plan"])
    sharding = {t: ps.sharding_type for module in plan.plan.values() for t, ps in module.items()}
    features = [f for t in w.tables if sharding.get(t.name) != DATA_PARALLEL for f in t.features]
    with worker() as c:
        batches = prebuilt_batches(w, 6, seed=BATCH_SEED, rank=c.rank, alpha=alpha)
        ms: Dict[str, List[float]] = {_label(*v): [] for v in variants}
        loss: Dict[str, float] = {}

        def measure(v: Tuple[int, bool], _round: int) -> None:
            spec = variant_spec(replay, plan, v[0], v[1], features)
            step_s, losses, _build_s = timed_run(lambda: lift_run(w, spec, c.device), batches, args.steps,
                                                 args.warmup, c.pg)
            ms[_label(*v)].append(1e3 * step_s)
            loss[_label(*v)] = losses[-1]

        interleaved_rounds(variants, measure, args.rounds)
        first = _label(*variants[0])
        out: Dict[str, Any] = {}
        for label, runs in ms.items():
            out[label] = dict(ms=runs, median_ms=statistics.median(runs),
                              over_first=paired_ratio(runs, ms[first]), last_loss=loss[label],
                              loss_equal=math.isclose(loss[label], loss[first], rel_tol=LOSS_RTOL))
            c.say(f"[rewrite_pairs] {args.regime} {args.workload} {args.row} {label}: median "
                  f"{out[label]['median_ms']:.2f} ms, /{first} {out[label]['over_first']:.3f}, rounds "
                  f"{[round(x, 1) for x in runs]}, last loss {loss[label]:.6f}"
                  f"{'' if out[label]['loss_equal'] else f' (differs from the first variant beyond {LOSS_RTOL:g})'}")
        if args.out and c.rank == 0:
            write_report(args.out, {"variants": out, "replay_of": args.row, "settings": vars(args)})
    return 0


if __name__ == "__main__":
    exit_now(main)
