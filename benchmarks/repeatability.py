"""How well does one plan's measured step time repeat? (the measurement harness)

    torchrun --standalone --nproc_per_node 2 -m benchmarks.repeatability --workload dcnv2 --plan table_wise \
        --runs 8 [--variant NAME ...] [--out runs/repeatability.json]

Plans the workload once (a forced plan kind of :mod:`benchmarks.real_runs`, or ``sparselift``) and
measures it ``--runs`` times with :func:`torchrec_sparselift.measure.probe.measure_plan` (a fresh
sharded model per run, as the benchmark, the step calibration and the measured guard do), once per
variant, in interleaved rounds (run i of every variant, the order rotated each round, then run i+1). Per variant it prints each run's time,
the spread (max/min - 1) and the coefficient of variation over runs, and the per-step durations of
the first run (to see how many steps the warm-up needs).

Variants (``--variant``, repeatable; default: all): ``base`` (the harness's defaults), ``legacy``
(the harness before the repeatability fix: 3 warm-up steps, 8 timed, no pinning, GC on), the
knobs one at a time, and ``shared_cpu`` (the ranks' scheduler group at the default weight, i.e.
competing equally with any other session's jobs; see ``--autogroup``) (:data:`VARIANTS`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks import real_runs
from benchmarks.harness import exit_now, interleaved_rounds, worker, write_report
from torchrec_sparselift.calibration.store import auto_profile
from torchrec_sparselift.measure.probe import DEFAULT_TIMING, measure_plan, prebuilt_batches, probe_model
from torchrec_sparselift.measure.steps import probe_topology as _topology

#: name -> keyword arguments of measure_plan
VARIANTS: Dict[str, Dict[str, Any]] = {
    "legacy": dict(warmup=3, steps=8, pin=False, gc_off=False),
    "base": dict(),
    "no_pin": dict(pin=False),
    "gc_off": dict(gc_off=True),
    "warmup3": dict(warmup=3),
    "steps8": dict(steps=8),
    "shared_cpu": dict(autogroup=0),
}


def _autogroup(nice: int) -> None:
    """This rank's scheduler-group weight (Linux autogroups: torchrun starts each rank in its own
    session, whose group competes with every other session's group at equal weight whatever the
    processes' nice values). Only this rank's own session is touched."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="dcnv2")
    p.add_argument("--plan", default="table_wise")
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--variant", action="append", help=f"one of {list(VARIANTS)} (repeatable; default all)")
    p.add_argument("--autogroup", type=int, help="this run's ranks' autogroup nice (e.g. -10: other sessions' "
                   "jobs get a small share; only the ranks' own sessions are changed)")
    p.add_argument("--out")
    args = p.parse_args(argv)

    with worker() as me:
        rank, say = me.rank, me.say
        w, alpha = real_runs._workloads()[args.workload]
        profile = auto_profile("cpu", 2, warn=lambda m: None)[0]
        plans = {name: plan for name, plan, _c in real_runs._plans(w, _topology(2, "cpu"), profile, dist.group.WORLD,
                                                                     lambda m: None)}
        plan = plans[args.plan]
        batches = prebuilt_batches(w, 8, seed=1, rank=rank, alpha=alpha)
        names = args.variant or list(VARIANTS)
        say(f"[repeat] {args.workload}/{args.plan} ({real_runs._types(plan)}), {args.runs} runs x {names}; "
            f"defaults {DEFAULT_TIMING}; load {os.getloadavg()[0]:.2f}")
        measure_plan("warm-up", lambda: probe_model(w), plan, batches, 2, 2, pg=dist.group.WORLD)
        res: Dict[str, Any] = {n: dict(runs_ms=[], first_steps_ms=None, stats={}) for n in names}
        t0 = time.time()

        def measure(n: str, _round: int) -> None:
            torch.manual_seed(0)
            kw = dict(VARIANTS[n])
            ag = kw.pop("autogroup", args.autogroup)
            if ag is not None:
                _autogroup(ag)
            m = measure_plan(n, lambda: probe_model(w), plan, batches, pg=dist.group.WORLD, **kw)
            if args.autogroup is not None:
                _autogroup(args.autogroup)
            res[n]["runs_ms"].append(m.median_s * 1e3)
            steady = sorted(m.durations_s[-m.steps:])
            cpu = sorted(m.cpu_durations_s[-m.steps:])
            for k, v in (("min", steady[0]), ("p25", steady[len(steady) // 4]), ("mean", m.mean_s),
                         ("cpu_median", cpu[len(cpu) // 2]), ("cpu_p25", cpu[len(cpu) // 4])):
                res[n]["stats"].setdefault(k, []).append(v * 1e3)
            if res[n]["first_steps_ms"] is None:
                res[n]["first_steps_ms"] = [d * 1e3 for d in m.durations_s]

        interleaved_rounds(names, measure, args.runs, after_round=lambda done: say(
            f"[repeat] run {done}/{args.runs}: " + ", ".join(f"{n} {res[n]['runs_ms'][-1]:.1f}" for n in names)
            + f" ms (load {os.getloadavg()[0]:.2f})"))
        for n in names:
            r = res[n]["runs_ms"]
            res[n].update(spread=max(r) / min(r) - 1, cv=statistics.stdev(r) / statistics.fmean(r) if len(r) > 1 else 0.0,
                          median_ms=statistics.median(r))
            say(f"{n:<10} median {res[n]['median_ms']:7.2f} ms  spread {res[n]['spread'] * 100:5.1f}%  "
                f"cv {res[n]['cv'] * 100:4.1f}%  runs " + " ".join(f"{x:.1f}" for x in r))
            for k, v in res[n]["stats"].items():
                say(f"{'':<10} {k:<11} median {statistics.median(v):7.2f} ms  spread {(max(v) / min(v) - 1) * 100:5.1f}%  "
                    f"cv {statistics.stdev(v) / statistics.fmean(v) * 100 if len(v) > 1 else 0:4.1f}%")
            say(f"{'':<10} first run, every step incl. warm-up: "
                + " ".join(f"{x:.0f}" for x in res[n]["first_steps_ms"]))
        if rank == 0 and args.out:
            write_report(args.out, dict(workload=args.workload, plan=args.plan, runs=args.runs,
                                        wall_s=time.time() - t0,
                                        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                                        load_end=os.getloadavg()[0], variants={n: VARIANTS[n] for n in names},
                                        results=res))
        dist.barrier()
    return 0


if __name__ == "__main__":
    exit_now(main)
