"""The dense part's price against its forward + backward timed alone, on the benchmark workloads.

    python -m benchmarks.dense_part [--profile STORED.json] [--workloads a,b] [--rounds 9] [--out R.json]

Per workload of :data:`benchmarks.real_runs.WORKLOADS` (none of them a calibration probe): the
model's dense forward + backward (``cost.model.phase_constants``: ``dense_fwd + dense_bwd`` of the
workload's DLRM at its batch size) under ``--profile`` (a stored step-fitted profile, default this
machine's, ``hardware="auto"``), and the same dense modules (``dense_arch``, ``inter_arch``,
``over_arch`` of the model ``measure.probe.probe_model`` builds) timed alone on one thread: random
pooled embeddings in, the loss's backward out, no embedding table, no collective. Interleaved rounds
(every workload once per round, the order rotated), the median per workload. The ratio
predicted / timed says how the profile's dense rates carry to models the fit did not see; a whole
step adds to the dense part's time what the other rank on the machine and the sparse path around it
cost (cache, memory bandwidth), so a ratio somewhat below 1 is expected where a step is measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any, Dict, List

import torch

from benchmarks.harness import geomean, interleaved_rounds, write_report
from benchmarks.real_runs import WORKLOADS, _workloads


def dense_timer(name: str, seed: int = 0):
    """``(time_once, batch_size)``: a function timing one dense forward + backward of workload
    ``name``'s DLRM on fresh random inputs (seconds)."""
    from torchrec_sparselift.measure.probe import NUM_DENSE, probe_model

    w, _alpha = _workloads()[name]
    model = probe_model(w).model
    features = [f for t in w.tables for f in t.features]
    dims = {t.dim for t in w.tables}
    if len(dims) != 1:
        raise ValueError(f"dense_part: workload {name} has tables of dims {sorted(dims)}; DLRM needs one")
    dim, b = dims.pop(), w.batch_size
    gen = torch.Generator().manual_seed(seed)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def once() -> float:
        dense = torch.randn(b, NUM_DENSE, generator=gen)
        pooled = torch.randn(b, len(features), dim, generator=gen, requires_grad=True)
        labels = torch.rand(b, generator=gen)
        t0 = time.perf_counter()
        logits = model.over_arch(model.inter_arch(model.dense_arch(dense), pooled))
        loss_fn(logits.squeeze(-1), labels).backward()
        return time.perf_counter() - t0

    return once, b


def priced_dense_s(name: str, profile: Any) -> float:
    """The model's dense forward + backward (seconds) of workload ``name`` under ``profile``."""
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.cost.model import CostContext, phase_constants
    from torchrec_sparselift.measure.probe import pooling_constraints, probe_model
    from torchrec_sparselift.semantics.dense import dense_work
    from torchrec_sparselift.semantics.tables import extract_tables

    w, _alpha = _workloads()[name]
    module = probe_model(w)
    handles = extract_tables(module, get_default_sharders(), "cpu", w.batch_size, pooling_constraints(w.tables), None)
    ctx = CostContext(profile=profile, world_size=2, local_world_size=2, batch_size=w.batch_size,
                      dense=dense_work(module, handles))
    c = phase_constants(ctx)
    return c["dense_fwd"] + c["dense_bwd"]


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", help="a stored step-fitted profile (default: this machine's, hardware='auto')")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of the workloads")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per workload and round (their median)")
    p.add_argument("--out", default="runs/dense_part.json")
    args = p.parse_args(argv)
    from torchrec_sparselift.calibration.store import ProfileStore, auto_profile

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        p.error(f"--workloads: unknown {unknown}; choose from {','.join(WORKLOADS)}")
    if args.profile:
        profile, where = ProfileStore().load(args.profile).profile, args.profile
    else:
        profile, where = auto_profile("cpu", 2)
    timers = {n: dense_timer(n) for n in names}
    for once, _b in timers.values():  # warm the allocator and the kernels
        for _ in range(3):
            once()
    times: Dict[str, List[float]] = {n: [] for n in names}

    def measure(n: str, _round: int) -> None:
        once = timers[n][0]
        times[n].append(statistics.median(once() for _ in range(args.repeats)))

    interleaved_rounds(names, measure, args.rounds)
    rows = {}
    print(f"profile: {where}")
    print(f"{'workload':<12}{'batch':>6}{'timed ms':>10}{'priced ms':>11}{'priced/timed':>14}")
    for n in names:
        timed = statistics.median(times[n])
        priced = priced_dense_s(n, profile)
        rows[n] = dict(batch_size=timers[n][1], timed_ms=timed * 1e3, priced_ms=priced * 1e3, ratio=priced / timed,
                       rounds_ms=[t * 1e3 for t in times[n]])
        print(f"{n:<12}{timers[n][1]:>6}{timed * 1e3:>10.2f}{priced * 1e3:>11.2f}{priced / timed:>14.2f}")
    g = geomean([r["ratio"] for r in rows.values()])
    print(f"geomean priced/timed {g:.2f}")
    write_report(args.out, dict(profile=where, rounds=args.rounds, workloads=rows, geomean_ratio=g))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
