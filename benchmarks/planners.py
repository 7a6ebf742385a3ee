"""Side-by-side planner benchmark: SparseLift vs TorchRec's ``EmbeddingShardingPlanner``.

Run::

    python -m benchmarks.planners --scenarios small --out results.json

Per scenario (workload x world size), one run plans the same meta-device module, topology,
per-rank batch and constraints with both planners and records:

1. the plan score under TorchRec's own estimator (``EmbeddingPerfEstimator`` +
   ``NoopPerfModel``, see :mod:`torchrec_sparselift.cost.torchrec_score`) for both plans, and the ratio TorchRec/ours;
2. the predicted step time under SparseLift's model for both plans (TorchRec's plan priced with
   :func:`~torchrec_sparselift.planner.evaluate_sharding_plan` under the pipeline SparseLift chose,
   and under ``sparse_dist``, TorchRec's default pipeline), and the ratio;
3. SparseLift's gap to its lower bound;
4. each planner's planning wall time and CPU time, and the ratio;
5. the peak per-rank device memory of each plan (SparseLift's model and TorchRec's storage
   estimator).

TorchRec plans in a child process with a wall-clock limit (``--torchrec-timeout``) and an
address-space limit (``--torchrec-mem-gib``): past either it is reported as
``timeout``/``oom`` and SparseLift is still timed. Then the planner targets are checked and
printed as PASS/MISS lines. Results go to ``--out`` as JSON, rewritten after every scenario.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np

from benchmarks.harness import exit_now, write_report
from benchmarks.harness.report import REPO

__all__ = [
    "Scenario",
    "SCENARIO_SETS",
    "parse_scenarios",
    "bench_topology",
    "run_sparselift",
    "run_torchrec",
    "run_torchrec_in_process",
    "cached_run_torchrec",
    "compare",
    "check_targets",
    "Target",
    "format_table",
    "resolve_hardware",
    "main",
]

GiB = 1 << 30


@attrs.frozen
class Scenario:
    """One benchmark input: a workload name (see :func:`~.workloads.by_name`) on ``world_size``
    GPUs (8 per host). ``torchrec=False`` times SparseLift only. Text form: ``dcnv2@64``,
    ``production-5000@1024:sl`` (SparseLift only)."""

    workload: str
    world_size: int = attrs.field(validator=attrs.validators.gt(0))
    torchrec: bool = True

    @property
    def name(self) -> str:
        return f"{self.workload}@{self.world_size}" + ("" if self.torchrec else ":sl")

    @classmethod
    def parse(cls, text: str) -> "Scenario":
        body, _, flag = text.strip().partition(":")
        if flag not in ("", "sl"):
            raise ValueError(f"scenario {text!r}: the only suffix is ':sl' (SparseLift only)")
        wl, sep, ws = body.partition("@")
        if not sep or not ws.isdigit():
            raise ValueError(f"scenario {text!r}: write WORKLOAD@WORLD_SIZE, e.g. dcnv2@64 or production-200@64")
        return cls(workload=wl, world_size=int(ws), torchrec=(flag == ""))


SCENARIO_SETS: Dict[str, Tuple[str, ...]] = {
    "smoke": ("kaggle@8",),
    "small": ("dcnv2@8", "dcnv2@16", "dcnv2@64", "dcnv2@128", "kaggle@8"),
    "large": (
        "production-200@64", "production-856@128", "production-2000@512", "production-2000@1024",
        "production-5000@1024:sl",
    ),
}
SCENARIO_SETS["all"] = SCENARIO_SETS["small"] + SCENARIO_SETS["large"]


def parse_scenarios(spec: str) -> List[Scenario]:
    """Comma-separated scenario texts and/or set names (smoke, small, large, all)."""
    out: List[Scenario] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        for text in SCENARIO_SETS.get(part, (part,)):
            out.append(Scenario.parse(text))
    if not out:
        raise ValueError(f"no scenarios in {spec!r}; use e.g. 'small' or 'dcnv2@8,kaggle@8'")
    return out


def bench_topology(world_size: int, hbm_gib: float = 80.0) -> Any:
    """A simulated CUDA topology: ``world_size`` GPUs, 8 per host, ``hbm_gib`` GiB each."""
    from torchrec.distributed.planner.types import Topology

    return Topology(world_size=world_size, local_world_size=min(8, world_size), compute_device="cuda",
                    hbm_cap=int(hbm_gib * GiB))


TORCHREC_CONSTANTS = "torchrec-constants"


def resolve_hardware(name: str) -> Any:
    """A SparseLift hardware profile by preset name, or ``"torchrec-constants"``: the ``h100``
    preset with TorchRec's planner constants (HBM 897 GiB/s, DDR 51 GiB/s, HBM<->DDR 32 GiB/s,
    intra-host 600 GiB/s, inter-host 12.5 GiB/s, backward 2x forward), so both planners assume
    the same machine and a comparison isolates the search from the hardware numbers."""
    from torchrec.distributed.planner import constants as C

    from torchrec_sparselift.cost.hardware import get_profile

    if name != TORCHREC_CONSTANTS:
        return get_profile(name)
    per_s = 1e3  # TorchRec's constants are bytes per millisecond
    return attrs.evolve(
        get_profile("h100"), name=TORCHREC_CONSTANTS, hbm_bw=C.HBM_MEM_BW * per_s, ddr_bw=C.DDR_MEM_BW * per_s,
        uvm_bw=C.HBM_TO_DDR_MEM_BW * per_s, intra_host_bw=C.INTRA_NODE_BANDWIDTH * per_s,
        inter_host_bw=C.CROSS_NODE_BANDWIDTH * per_s, bwd_factor=float(C.BWD_COMPUTE_MULTIPLIER),
    )


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("torchrec", "torchrec_sparselift", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _inputs(sc: Scenario, hbm_gib: float) -> Tuple[Any, Any, Any, int, Dict[str, Any], List[Any]]:
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.semantics.reference_workloads import by_name

    wl = by_name(sc.workload)
    return (wl, wl.module(), bench_topology(sc.world_size, hbm_gib), wl.per_rank_batch(sc.world_size),
            wl.constraints(), get_default_sharders())


def _type_counts(options: Sequence[Any]) -> Dict[str, int]:
    return dict(sorted(Counter(f"{o.sharding_type}/{o.compute_kernel}" for o in options).items()))


def run_torchrec_in_process(sc: Scenario, hbm_gib: float = 80.0) -> Dict[str, Any]:
    """Plan ``sc`` with ``EmbeddingShardingPlanner`` (defaults) here and now; return its timing,
    its own best rating, its score under :func:`torchrec_score` and the plan as JSON data."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    from torchrec_sparselift.cost.torchrec_score import BestPlanCapture, torchrec_score
    from torchrec_sparselift.plan.serialization import sharding_plan_to_dict

    wl, module, topo, batch, cons, sharders = _inputs(sc, hbm_gib)
    cap = BestPlanCapture()
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=cons, debug=False,
                                       stats=cap)
    w0, c0 = time.perf_counter(), time.process_time()
    plan = planner.plan(module, sharders)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if cap.best_plan is None:
        raise RuntimeError("EmbeddingShardingPlanner returned without logging a best plan")
    score = torchrec_score(cap.best_plan, topo, sharders, cons)
    from torchrec.distributed.planner.perf_models import NoopPerfModel

    return {
        "status": "ok",
        "plan_wall_s": wall,
        "plan_cpu_s": cpu,
        "own_rating_ms": float(NoopPerfModel(topology=topo).rate(cap.best_plan)),
        "torchrec_perf_ms": score.perf_ms,
        "torchrec_peak_hbm_bytes": score.peak_hbm_bytes,
        "num_proposals": cap.num_proposals,
        "types": _type_counts(cap.best_plan),
        "plan": sharding_plan_to_dict(plan),
    }


def _limit_memory(gib: float) -> None:
    import resource

    lim = int(gib * GiB)
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def run_torchrec(sc: Scenario, timeout_s: float, mem_gib: float, hbm_gib: float = 80.0) -> Dict[str, Any]:
    """:func:`run_torchrec_in_process` in a child process limited to ``timeout_s`` seconds of
    wall time (imports included) and ``mem_gib`` GiB of address space. Returns its result, or
    ``{"status": "timeout"|"oom"|"error", ...}`` saying what happened."""
    with tempfile.TemporaryDirectory(prefix="planner_bench_") as d:
        out = os.path.join(d, "torchrec.json")
        cmd = [sys.executable, "-m", "benchmarks.planners", "--torchrec-child", sc.name,
               "--child-out", out, "--hbm-gib", str(hbm_gib)]
        t0 = time.perf_counter()
        with open(os.path.join(d, "stderr.txt"), "w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
                                    preexec_fn=(lambda: _limit_memory(mem_gib)) if mem_gib > 0 else None)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                cpu = _cpu_seconds(proc.pid)
                proc.kill()
                proc.wait()
                return {"status": "timeout", "limit_s": timeout_s, "cpu_s_at_limit": cpu,
                        "note": f"no plan within {timeout_s:.0f} s wall ({cpu:.0f} s CPU), child process "
                                "incl. imports and module construction"}
            err.seek(0)
            stderr = err.read()
        elapsed = time.perf_counter() - t0
        if os.path.exists(out):
            with open(out) as f:
                res = json.load(f)
            res["child_wall_s"] = elapsed
            return res
        tail = stderr.strip().splitlines()[-3:]
        oom = "MemoryError" in stderr or "std::bad_alloc" in stderr
        return {"status": "oom" if oom else "error", "rc": proc.returncode, "limit_gib": mem_gib,
                "note": " | ".join(tail)}


def cached_run_torchrec(sc: Scenario, timeout_s: float, mem_gib: float, hbm_gib: float = 80.0,
                        cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """:func:`run_torchrec`, reusing a stored result for the same scenario, HBM size and torchrec
    version from ``cache_dir`` (TorchRec's plan does not depend on SparseLift, so re-running the
    benchmark after a SparseLift change need not re-plan with TorchRec). A stored plan is always
    reused; a stored timeout/oom only if its limit was at least as generous as this one. The
    result says ``"cached": <when it was measured>`` when reused."""
    if not cache_dir:
        return run_torchrec(sc, timeout_s, mem_gib, hbm_gib)
    import torchrec

    path = os.path.join(cache_dir, f"{sc.workload}@{sc.world_size}_hbm{hbm_gib:g}_torchrec-{torchrec.__version__}.json")
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
        st = res.get("status")
        if st == "ok" or (st == "timeout" and res.get("limit_s", 0) >= timeout_s) or (
                st == "oom" and res.get("limit_gib", 0) >= mem_gib > 0):
            res["cached"] = res.get("measured_at", "unknown")
            return res
    res = run_torchrec(sc, timeout_s, mem_gib, hbm_gib)
    res["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if res.get("status") in ("ok", "timeout", "oom"):
        os.makedirs(cache_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, default=float)
        os.replace(path + ".tmp", path)
    return res


def run_sparselift(sc: Scenario, hardware: str = "h100", budget_s: Optional[float] = None,
                   hbm_gib: float = 80.0) -> Tuple[Dict[str, Any], Any]:
    """Plan ``sc`` with ``SparseLiftPlanner``; return (record, PlanResult)."""
    from torchrec_sparselift.cost.torchrec_score import torchrec_score
    from torchrec_sparselift.cost.model import DEV_MEM
    from torchrec_sparselift.planner import SparseLiftPlanner

    wl, module, topo, batch, cons, sharders = _inputs(sc, hbm_gib)
    planner = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=cons,
                                hardware=resolve_hardware(hardware),
                                debug=False, time_budget_s=budget_s)
    w0, c0 = time.perf_counter(), time.process_time()
    res = planner.plan_with_result(module, sharders)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    s = res.search
    peak = float(np.max(s.rank_loads[:, DEV_MEM]))
    rec: Dict[str, Any] = {
        "status": "ok",
        "plan_wall_s": wall,
        "plan_cpu_s": cpu,
        "search_time_s": s.planning_time_s,
        "solver": s.solver,
        "search_status": s.status,
        "pipeline": s.pipeline,
        "comm": f"{s.fwd_precision}/{s.bwd_precision}",
        "step_ms": s.step.total_s * 1e3,
        "lower_bound_ms": s.lower_bound_s * 1e3,
        "gap": s.gap,
        "peak_dev_bytes": peak,
        "hbm_cap_bytes": float(hbm_gib * GiB),
        "types": _type_counts(res.sharding_options),
    }
    if sc.torchrec:  # scoring re-runs TorchRec's estimator over every shard: skip for SL-only timing
        score = torchrec_score(res.sharding_options, topo, sharders, cons)
        rec["torchrec_perf_ms"] = score.perf_ms
        rec["torchrec_peak_hbm_bytes"] = score.peak_hbm_bytes
    return rec, res


def _price(sc: Scenario, plan: Any, hardware: str, pipeline: str, hbm_gib: float) -> Dict[str, float]:
    from torchrec_sparselift.cost.model import DEV_MEM
    from torchrec_sparselift.planner import evaluate_sharding_plan

    wl, module, topo, batch, cons, sharders = _inputs(sc, hbm_gib)
    r = evaluate_sharding_plan(module, plan, topo, batch, cons, hardware=resolve_hardware(hardware),
                               pipeline=pipeline)
    return {"step_ms": r.search.step.total_s * 1e3,
            "peak_dev_bytes": float(np.max(r.search.rank_loads[:, DEV_MEM]))}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def compare(sc: Scenario, hardware: str = "h100", budget_s: Optional[float] = None,
            torchrec_timeout_s: float = 600.0, torchrec_mem_gib: float = 8.0,
            hbm_gib: float = 80.0, torchrec_cache: Optional[str] = None) -> Dict[str, Any]:
    """Plan ``sc`` with both planners and compare them (one result row; see module docstring)."""
    from torchrec_sparselift.plan.serialization import sharding_plan_from_dict

    from torchrec_sparselift.semantics.reference_workloads import by_name

    row: Dict[str, Any] = {"scenario": sc.name, "workload": sc.workload, "world_size": sc.world_size,
                           "tables": len(by_name(sc.workload).tables),
                           "per_rank_batch": by_name(sc.workload).per_rank_batch(sc.world_size),
                           "hardware": hardware}
    try:
        sl, res = run_sparselift(sc, hardware, budget_s, hbm_gib)
    except Exception as e:  # noqa: BLE001 - a benchmark row records the failure and goes on
        sl, res = {"status": "error", "note": f"{type(e).__name__}: {e}"}, None
    row["sparselift"] = sl
    if res is not None and sc.torchrec:
        # self-check: our plan re-priced through evaluate_sharding_plan must match the search
        row["sparselift"]["repriced_step_ms"] = _price(sc, res.sharding_plan, hardware, res.search.pipeline,
                                                       hbm_gib)["step_ms"]
    if not sc.torchrec:
        row["torchrec"] = {"status": "skipped"}
        return row
    tr = dict(cached_run_torchrec(sc, torchrec_timeout_s, torchrec_mem_gib, hbm_gib, torchrec_cache))
    if tr.get("status") == "ok":
        plan = sharding_plan_from_dict(tr.pop("plan"))
        if res is not None:
            same = _price(sc, plan, hardware, res.search.pipeline, hbm_gib)
            tr["step_ms_same_pipeline"] = same["step_ms"]
            tr["peak_dev_bytes"] = same["peak_dev_bytes"]
        tr["step_ms_sparse_dist"] = _price(sc, plan, hardware, "sparse_dist", hbm_gib)["step_ms"]
    else:
        tr.pop("plan", None)
    row["torchrec"] = tr
    if sl.get("status") == "ok":
        row["ratios"] = {
            "torchrec_estimator": _ratio(tr.get("torchrec_perf_ms"), sl.get("torchrec_perf_ms")),
            "our_model_same_pipeline": _ratio(tr.get("step_ms_same_pipeline"), sl.get("step_ms")),
            "our_model_vs_sparse_dist": _ratio(tr.get("step_ms_sparse_dist"), sl.get("step_ms")),
            "planning_wall": _ratio(tr.get("plan_wall_s"), sl.get("plan_wall_s")),
            "planning_cpu": _ratio(tr.get("plan_cpu_s"), sl.get("plan_cpu_s")),
        }
        if tr.get("status") == "timeout":
            row["ratios"]["planning_wall_at_least"] = tr["limit_s"] / sl["plan_wall_s"]
    return row


@attrs.frozen
class Target:
    """One planner target: PASS, MISS, or N/A (not measured in this run), with the numbers."""

    name: str
    verdict: str = attrs.field(validator=attrs.validators.in_(("PASS", "MISS", "N/A")))
    detail: str

    def line(self) -> str:
        return f"[{self.verdict}] {self.name}: {self.detail}"


def _geomean(xs: Sequence[float]) -> float:
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs)))


def _rows_ok(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [r for r in rows if r.get("sparselift", {}).get("status") == "ok"]


def _find(rows: Sequence[Dict[str, Any]], workload: str, world_size: int) -> Optional[Dict[str, Any]]:
    for r in rows:
        if r["workload"] == workload and r["world_size"] == world_size:
            return r
    return None


def check_targets(rows: Sequence[Dict[str, Any]]) -> List[Target]:
    """The planner targets over the rows measured so far (N/A where a row is missing)."""
    out: List[Target] = []
    ok = _rows_ok(rows)
    both = [r for r in ok if r.get("ratios", {}).get("torchrec_estimator") is not None]
    if both:
        ratios = {r["scenario"]: r["ratios"]["torchrec_estimator"] for r in both}
        worse = {k: v for k, v in ratios.items() if v < 1.0}
        g = _geomean(list(ratios.values()))
        out.append(Target(
            "never worse than TorchRec under TorchRec's estimator",
            "PASS" if not worse else "MISS",
            "TorchRec/ours >= 1 everywhere" if not worse else
            "worse on " + ", ".join(f"{k} ({v:.3f}x)" for k, v in worse.items()),
        ))
        out.append(Target("better on geomean under TorchRec's estimator", "PASS" if g > 1.0 else "MISS",
                          f"geomean TorchRec/ours = {g:.3f}x over {len(ratios)} scenarios"))
    else:
        out.append(Target("TorchRec's-estimator comparison", "N/A", "no scenario with both plans"))
    big = [r for r in ok if r["workload"] in ("dcnv2", "dlrm-dcnv2") and r["world_size"] >= 64
           and r.get("ratios", {}).get("our_model_same_pipeline") is not None]
    if big:
        g = _geomean([r["ratios"]["our_model_same_pipeline"] for r in big])
        out.append(Target(">= 1.26x geomean under our model, DLRM-DCNv2 64+ GPUs",
                          "PASS" if g >= 1.26 else "MISS",
                          f"{g:.3f}x over " + ", ".join(r["scenario"] for r in big)
                          + " (TorchRec's plan priced under SparseLift's chosen pipeline)"))
    else:
        out.append(Target(">= 1.26x geomean under our model, DLRM-DCNv2 64+ GPUs", "N/A",
                          "no DCNv2 64+ row with both plans"))
    gaps = [r["sparselift"]["gap"] for r in ok if r["sparselift"].get("gap") is not None
            and math.isfinite(r["sparselift"]["gap"])]
    if gaps:
        med = float(np.median(gaps))
        out.append(Target("median gap to lower bound < 5%", "PASS" if med < 0.05 else "MISS",
                          f"median {med * 100:.1f}% over {len(gaps)} scenarios (max {max(gaps) * 100:.1f}%)"))
    r = _find(ok, "production-200", 64)
    if r is not None and r.get("torchrec", {}).get("status") in ("ok", "timeout"):
        rat = r["ratios"].get("planning_wall") or r["ratios"].get("planning_wall_at_least")
        bound = "" if r["torchrec"]["status"] == "ok" else ">= "
        out.append(Target("200 tables x 64: planning >= 20x faster than TorchRec",
                          "PASS" if rat >= 20 else "MISS",
                          f"{bound}{rat:.1f}x (TorchRec {r['torchrec'].get('plan_wall_s', r['torchrec'].get('limit_s')):.1f} s, "
                          f"ours {r['sparselift']['plan_wall_s']:.2f} s wall)"))
    else:
        out.append(Target("200 tables x 64: planning >= 20x faster than TorchRec", "N/A", "not run"))
    for wl, ws, limit in (("production-856", 128, 10.0), ("production-5000", 1024, 60.0)):
        r = _find(ok, wl, ws)
        name = f"{wl.split('-')[1]} tables x {ws}: SparseLift plans in < {limit:.0f} s"
        if r is None:
            out.append(Target(name, "N/A", "not run"))
        else:
            t = r["sparselift"]["plan_wall_s"]
            out.append(Target(name, "PASS" if t < limit else "MISS",
                              f"{t:.2f} s wall ({r['sparselift']['plan_cpu_s']:.2f} s CPU)"))
    over = [r["scenario"] for r in ok if r["sparselift"]["peak_dev_bytes"] > r["sparselift"]["hbm_cap_bytes"]]
    out.append(Target("SparseLift plans fit per-rank HBM", "MISS" if over else "PASS",
                      ("over the cap on " + ", ".join(over)) if over else "every plan within the cap"))
    failed = [f"{r['scenario']} ({r['sparselift'].get('note')})" for r in rows
              if r.get("sparselift", {}).get("status") != "ok"]
    if failed:
        out.append(Target("SparseLift planned every scenario", "MISS", "; ".join(failed)))
    return out


def _fmt(x: Any, spec: str = ".3f", none: str = "-", suffix: str = "") -> str:
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec) + suffix


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """A markdown table, one line per scenario."""
    head = ("| scenario | TorchRec est. ms: TR / SL (ratio) | our model ms: TR / SL (ratio) [SL pipeline] "
            "| gap | planning s: TR / SL (ratio) | peak GiB/rank: TR / SL |")
    lines = [head, "|" + "---|" * 6]
    for r in rows:
        sl, tr, ra = r.get("sparselift", {}), r.get("torchrec", {}), r.get("ratios", {})
        if tr.get("status") == "ok":
            tr_est = _fmt(tr.get("torchrec_perf_ms"))
            tr_mod = _fmt(tr.get("step_ms_same_pipeline"))
            tr_t = _fmt(tr.get("plan_wall_s"), ".1f")
            tr_mem = _fmt((tr.get("peak_dev_bytes") or float("nan")) / GiB, ".1f")
        else:
            st = tr.get("status", "-")
            st = f"timeout {tr['limit_s']:.0f} s" if st == "timeout" else st
            tr_est = tr_mod = tr_mem = st if st != "skipped" else "-"
            tr_t = st if st != "skipped" else "-"
        if sl.get("status") != "ok":
            lines.append(f"| {r['scenario']} | SparseLift failed: {sl.get('note')} |||||")
            continue
        pr = ra.get("planning_wall")
        pr_s = f"{pr:.1f}x" if pr else (f">= {ra['planning_wall_at_least']:.0f}x" if ra.get("planning_wall_at_least") else "-")
        lines.append(
            f"| {r['scenario']} "
            f"| {tr_est} / {_fmt(sl.get('torchrec_perf_ms'))} ({_fmt(ra.get('torchrec_estimator'), '.2f', suffix='x')}) "
            f"| {tr_mod} / {_fmt(sl['step_ms'])} ({_fmt(ra.get('our_model_same_pipeline'), '.2f', suffix='x')}) [{sl['pipeline']}] "
            f"| {_fmt(sl['gap'] * 100, '.1f', 'no bound', '%')} "
            f"| {tr_t} / {sl['plan_wall_s']:.2f} ({pr_s}) "
            f"| {tr_mem} / {sl['peak_dev_bytes'] / GiB:.1f} |"
        )
    return "\n".join(lines)


def _write(path: Optional[str], rows: Sequence[Dict[str, Any]], targets: Sequence[Target], meta: Dict[str, Any]) -> None:
    if not path:
        return
    write_report(path, {"meta": meta, "rows": list(rows), "targets": [attrs.asdict(t) for t in targets]})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.planners",
        description="SparseLift vs TorchRec EmbeddingShardingPlanner on the same inputs.",
    )
    p.add_argument("--scenarios", default="small",
                   help="comma-separated WORKLOAD@WORLD_SIZE[:sl] and/or sets: "
                        + ", ".join(f"{k}" for k in SCENARIO_SETS) + " (default: small)")
    p.add_argument("--out", default=None, help="JSON results file (rewritten after every scenario)")
    p.add_argument("--hardware", default="h100",
                   help="SparseLift hardware profile: h100, h200, a100 or torchrec-constants "
                        "(h100 with TorchRec's planner bandwidths; default h100)")
    p.add_argument("--hbm-gib", type=float, default=80.0, help="HBM per GPU in the topology (default 80)")
    p.add_argument("--budget", type=float, default=None, help="SparseLift search time budget in seconds")
    p.add_argument("--torchrec-timeout", type=float, default=600.0,
                   help="wall-clock limit for TorchRec's planner per scenario, seconds (default 600)")
    p.add_argument("--torchrec-mem-gib", type=float, default=8.0,
                   help="address-space limit of TorchRec's child process in GiB; 0: none (default 8)")
    p.add_argument("--torchrec-cache", default="runs/torchrec_cache",
                   help="directory of stored TorchRec results to reuse (key: scenario, HBM, torchrec "
                        "version); '' to always re-plan (default runs/torchrec_cache)")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="print the table and target lines of a stored --out file and exit")
    p.add_argument("--torchrec-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    _quiet()
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        print(format_table(data["rows"]))
        print()
        for t in check_targets(data["rows"]):
            print(t.line())
        return 0
    if args.torchrec_child:
        try:
            res = run_torchrec_in_process(Scenario.parse(args.torchrec_child), args.hbm_gib)
        except MemoryError:
            res = {"status": "oom", "note": "MemoryError in TorchRec's planner"}
        with open(args.child_out, "w") as f:
            json.dump(res, f, default=float)
        return 0
    scenarios = parse_scenarios(args.scenarios)
    meta = {"command": "python -m benchmarks.planners " + " ".join(argv if argv is not None else sys.argv[1:]),
            "hardware": args.hardware, "hbm_gib": args.hbm_gib, "torchrec_timeout_s": args.torchrec_timeout,
            "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows: List[Dict[str, Any]] = []
    for sc in scenarios:
        print(f"== {sc.name} ...", flush=True)
        row = compare(sc, args.hardware, args.budget, args.torchrec_timeout, args.torchrec_mem_gib, args.hbm_gib,
                      args.torchrec_cache or None)
        rows.append(row)
        sl, tr, ra = row["sparselift"], row["torchrec"], row.get("ratios", {})
        print(f"   SparseLift: {json.dumps({k: v for k, v in sl.items() if k != 'types'}, default=float)}", flush=True)
        print(f"   TorchRec:   {json.dumps({k: v for k, v in tr.items() if k != 'types'}, default=float)}", flush=True)
        print(f"   ratios:     {json.dumps(ra)}", flush=True)
        _write(args.out, rows, check_targets(rows), meta)
    print()
    print(format_table(rows))
    print()
    targets = check_targets(rows)
    for t in targets:
        print(t.line())
    _write(args.out, rows, targets, meta)
    return 0


if __name__ == "__main__":
    exit_now(main)
