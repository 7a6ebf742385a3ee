"""Predicted DLRM-DCNv2 throughput from 8 to 4096 GPUs: full sharding (1D) vs the planner's 2D
choice, under SparseLift's cost model (weak scaling: fixed per-rank batch).

The 2D plan is made with the default sync-interval bound (the largest interval measured at
quality parity) and the layout the planner picks (strided or contiguous groups, priced on the
hosts they really span); ``--unbounded N`` adds a second 2D plan allowed intervals up to N, to
show what the bound costs.

    python -m benchmarks.scaling_2d --out docs/scaling_2d.json --png docs/scaling_2d.png
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from typing import List, Optional

from torchrec.distributed.planner import Topology

from benchmarks.harness import write_report
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.semantics.reference_workloads import dcnv2

__all__ = ["main"]


def run(world_sizes: List[int], batch: int, hardware: str, budget: float,
        unbounded: Optional[int] = None) -> List[dict]:
    wl = dcnv2()
    rows = []
    for W in world_sizes:
        topo = Topology(world_size=W, local_world_size=min(8, W), compute_device="cuda",
                        hbm_cap=80 * 1024**3, ddr_cap=512 * 1024**3)
        t0 = time.monotonic()
        one = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=wl.constraints(),
                                hardware=hardware, debug=False, time_budget_s=budget).plan_with_result(wl.module())
        two = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=wl.constraints(),
                                hardware=hardware, debug=False, time_budget_s=budget,
                                sharding_group_size="auto").plan_with_result(wl.module())
        free = None
        if unbounded:
            free = SparseLiftPlanner(topology=topo, batch_size=batch, constraints=wl.constraints(),
                                     hardware=hardware, debug=False, time_budget_s=budget,
                                     sharding_group_size="auto",
                                     max_sync_interval=unbounded).plan_with_result(wl.module())
        # 1D: the better of the plain 1D plan and the 1D candidate the auto run priced (both are
        # the planner's 1D plans; which search found the better one is a budget effect)
        step_1d = min([one.step_time_s] + [t for g, t in two.alternatives_2d if g == W]
                      + ([t for g, t in free.alternatives_2d if g == W] if free is not None else []))
        row = {
            "world_size": W,
            "step_1d_ms": step_1d * 1e3,
            "step_1d_plain_ms": one.step_time_s * 1e3,
            "throughput_1d": W * batch / step_1d,
            "group_size_2d": two.sharding_group_size or W,
            "sync_interval_2d": two.sync_interval,
            "max_sync_interval": two.max_sync_interval,
            "layout_2d": two.layout_2d.kind if two.layout_2d else None,
            "layouts_priced": [[g, k, s * 1e3] for g, k, s in two.alternatives_layout],
            "sync_ms_per_step": two.sync_s * 1e3,
            "step_2d_ms": two.step_time_s * 1e3,
            "throughput_2d": W * batch / two.step_time_s,
            "planning_s": time.monotonic() - t0,
        }
        row["speedup_2d"] = row["throughput_2d"] / row["throughput_1d"]
        if free is not None:
            row.update(group_size_unbounded=free.sharding_group_size or W,
                       sync_interval_unbounded=free.sync_interval,
                       layout_unbounded=free.layout_2d.kind if free.layout_2d else None,
                       step_unbounded_ms=free.step_time_s * 1e3,
                       throughput_unbounded=W * batch / free.step_time_s,
                       max_sync_unbounded=unbounded,
                       speedup_unbounded=step_1d / free.step_time_s)
        rows.append(row)
        print(f"W={W:5d}  1D {row['step_1d_ms']:8.3f} ms {row['throughput_1d'] / 1e6:8.2f} M samples/s | "
              f"2D G={row['group_size_2d']:5d} N={row['sync_interval_2d']:3d} {row['layout_2d'] or '-':10s} "
              f"{row['step_2d_ms']:8.3f} ms "
              f"{row['throughput_2d'] / 1e6:8.2f} M samples/s | x{row['speedup_2d']:.2f} "
              f"(planned in {row['planning_s']:.1f} s)", flush=True)
    return rows


def plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = [r["world_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ws, [r["throughput_1d"] / 1e6 for r in rows], "o-", label="1D: full sharding")
    ax.plot(ws, [r["throughput_2d"] / 1e6 for r in rows], "s-",
            label=f"2D: planner's group size and layout, sync interval <= {rows[0].get('max_sync_interval')}")
    if "step_unbounded_ms" in rows[0]:
        ax.plot(ws, [r["throughput_unbounded"] / 1e6 for r in rows], "^--", alpha=0.6,
                label=f"2D, sync interval up to {rows[0]['max_sync_unbounded']} (beyond the quality evidence)")
    ideal = [rows[0]["throughput_1d"] / 1e6 * w / ws[0] for w in ws]
    ax.plot(ws, ideal, ":", color="gray", label="linear scaling")
    for r in rows:
        if r["group_size_2d"] != r["world_size"]:
            ax.annotate(f"G={r['group_size_2d']}", (r["world_size"], r["throughput_2d"] / 1e6),
                        textcoords="offset points", xytext=(-10, 8), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (H100-class, 8 per host)")
    ax.set_ylabel("predicted throughput (M samples/s)")
    ax.set_title("DLRM-DCNv2, per-GPU batch fixed: predicted by SparseLift's cost model")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="8,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--batch", type=int, default=1024, help="per-GPU batch (weak scaling)")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--budget", type=float, default=8.0, help="planning budget per plan, seconds")
    ap.add_argument("--unbounded", type=int, default=None, metavar="N",
                    help="also plan 2D with max_sync_interval=N (what the quality bound costs)")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--png", default=None, help="plot (needs matplotlib)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    rows = run([int(w) for w in args.world_sizes.split(",")], args.batch, args.hardware, args.budget,
               args.unbounded)
    if args.out:
        write_report(args.out, {"workload": "dlrm-dcnv2", "per_gpu_batch": args.batch, "hardware": args.hardware,
                                "rows": rows}, indent=2)
    if args.png:
        try:
            plot(rows, args.png)
        except ImportError:
            print("matplotlib is not installed: pip install matplotlib to draw the plot", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
