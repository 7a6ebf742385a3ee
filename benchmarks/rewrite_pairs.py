"""One plan of a regime benchmark run under several forced rewrites, side by side: interleaved
rounds of fresh models, where the regime benchmark's two rounds cannot tell rewrites apart.

    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 1 --rate 300mbit --shared -- \\
        -m benchmarks.rewrite_pairs --from runs/r123.json --regime R3 --workload many_small \\
        --row sparselift_split2 --variants 1,8 [--rounds 5] [--out R.json]

``--from``: a ``benchmarks.regimes`` result (``--out``); ``--row``: one of its rows of
``--workload`` in ``--regime`` (``sparselift``, ``torchrec``, ``sparselift_split4``, ...), whose
stored replay (its sharding plan, pipeline, precisions and ids dtype) every variant trains; or
several, comma-separated (``--row torchrec,sparselift --variants 1``: two rows' own plans side by
side, each variant of each row, labelled ``ROW:VARIANT``).
``--variants``: comma-separated ``K`` (batch split into K chunks, ``overlap`` where K > 1, the
run's own pipeline at 1; no dedup) or ``Kd`` (the same with every model-parallel feature
deduplicated). Launch it on the link of the regime the run came from (the testbed command above
for R2 and R3: ``--rate 1gbit`` / ``300mbit``; ``torchrun --standalone --nproc_per_node 2`` for R1).

Each round trains every variant once (the order rotated each round; ``benchmarks.regimes.timed_run``,
as the regime benchmark times its runs: ranks pinned, ``--warmup`` untimed then ``--steps`` timed
steps, the slowest rank's steady step). Prints each variant's ms per round, its median, its
median ratio to the first variant paired by round, and whether its last loss agrees within
:data:`LOSS_RTOL` with the first variant's of the same sharding plan (another plan's tables start
from other random streams). That is a screen, not the exactness check: the rewrites agree with
the unrewritten step within rounding, and AdaGrad amplifies rounding over a run, so a last loss
apart after many steps is followed up with ``benchmarks.split_rounding`` (step by step from the
same state, and the run's own drift under noise of rounding size).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import warnings
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple, TypeVar

from benchmarks.harness import exit_now, interleaved_rounds, paired_ratio, worker, write_report
from benchmarks.real_runs import BATCH_SEED, _workloads, model_parallel_features
from benchmarks.regimes import lift_run, timed_run
from torchrec_sparselift.cost.batch_split import BATCH_SPLIT_PIPELINE, MAX_CHUNKS
from torchrec_sparselift.measure.probe import prebuilt_batches
from torchrec_sparselift.plan.serialization import sharding_plan_from_dict

__all__ = ["LOSS_RTOL", "parse_variants", "parse_rows", "replay_of", "same_plan_first", "variant_spec", "main"]

T = TypeVar("T")

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


def parse_rows(text: str) -> List[str]:
    """``"torchrec, sparselift"`` -> ``["torchrec", "sparselift"]``. ``ValueError`` naming an empty
    or repeated row."""
    rows = [r.strip() for r in text.split(",")]
    for r in rows:
        if not r:
            raise ValueError(f"--row {text!r}: an empty row name (e.g. --row torchrec,sparselift)")
        if rows.count(r) > 1:
            raise ValueError(f"--row {text!r}: {r!r} is given twice")
    return rows


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


def same_plan_first(items: Sequence[T], plan_of: Callable[[T], Any], item: T) -> T:
    """The first of ``items`` whose plan (``plan_of``) is ``item``'s: the variant whose last loss
    ``item``'s must equal (rewrites of one sharding are exact; another sharding initializes its
    tables from other random streams, so its loss is not compared)."""
    return next(x for x in items if plan_of(x) == plan_of(item))


def _label(row: str, chunks: int, dedup: bool, rows: int) -> str:
    """A variant's label: ``K`` / ``Kd``, prefixed ``ROW:`` where several rows are replayed."""
    return f"{row + ':' if rows > 1 else ''}{chunks}{'d' if dedup else ''}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", required=True, help="a benchmarks.regimes result JSON")
    p.add_argument("--regime", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--row", default="sparselift",
                   help="the run (row) whose plan the variants train, or several comma-separated (default sparselift)")
    p.add_argument("--variants", default="1,2,4,8", help="comma-separated K or Kd (default 1,2,4,8)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", help="JSON file for the results (rank 0)")
    args = p.parse_args()
    try:
        variants = parse_variants(args.variants)
        rows = parse_rows(args.row)
        with open(args.source, encoding="utf-8") as f:
            result = json.load(f)
        replays = {r: replay_of(result, args.regime, args.workload, r) for r in rows}
        if args.workload not in _workloads():
            raise ValueError(f"--workload {args.workload}: not a benchmark workload ({sorted(_workloads())})")
    except (OSError, ValueError) as e:
        p.error(str(e))
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    warnings.filterwarnings("ignore")
    w, alpha = _workloads()[args.workload]
    plans = {r: sharding_plan_from_dict(replays[r]["plan"]) for r in rows}
    features = {r: model_parallel_features(w, plans[r]) for r in rows}
    items = [(r, k, d) for r in rows for k, d in variants]
    label = {it: _label(*it, len(rows)) for it in items}
    with worker() as c:
        batches = prebuilt_batches(w, 6, seed=BATCH_SEED, rank=c.rank, alpha=alpha)
        ms: Dict[str, List[float]] = {label[it]: [] for it in items}
        loss: Dict[str, float] = {}

        def measure(it: Tuple[str, int, bool], _round: int) -> None:
            row, chunks, dedup = it
            spec = variant_spec(replays[row], plans[row], chunks, dedup, features[row])
            step_s, losses, _build_s = timed_run(lambda: lift_run(w, spec, c.device), batches, args.steps,
                                                 args.warmup, c.pg)
            ms[label[it]].append(1e3 * step_s)
            loss[label[it]] = losses[-1]

        interleaved_rounds(items, measure, args.rounds)
        first = label[items[0]]
        out: Dict[str, Any] = {}
        for it in items:
            name, runs = label[it], ms[label[it]]
            same = label[same_plan_first(items, lambda x: replays[x[0]]["plan"], it)]
            out[name] = dict(ms=runs, median_ms=statistics.median(runs),
                             over_first=paired_ratio(runs, ms[first]), last_loss=loss[name], loss_of=same,
                             loss_equal=math.isclose(loss[name], loss[same], rel_tol=LOSS_RTOL))
            c.say(f"[rewrite_pairs] {args.regime} {args.workload} {args.row} {name}: median "
                  f"{out[name]['median_ms']:.2f} ms, /{first} {out[name]['over_first']:.3f}, rounds "
                  f"{[round(x, 1) for x in runs]}, last loss {loss[name]:.6f}"
                  f"{'' if out[name]['loss_equal'] else f' (differs from {same} beyond {LOSS_RTOL:g}: follow up with benchmarks.split_rounding)'}")
        if args.out and c.rank == 0:
            write_report(args.out, {"variants": out, "replay_of": args.row, "settings": vars(args)})
    return 0


if __name__ == "__main__":
    exit_now(main)
