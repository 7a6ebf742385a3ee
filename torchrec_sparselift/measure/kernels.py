"""Measure this machine's kernels and fit a hardware profile (``sparselift calibrate kernels``).

:func:`calibrate` runs the microbenchmarks (:mod:`.microbench`: embedding lookups, collectives
across the ranks of a process group, dense matmuls, host-to-device copies, and the sparse-path
rewrites' constants: a dense step in k chunks and the id-deduplication kernels) and hands the records to
the pure fit (:func:`torchrec_sparselift.calibration.kernel_fit.fit_kernel_profile`);
:func:`run_kernels` is the command: alone (no collectives: they keep the base profile's values) or
under ``torchrun`` (rank 0 writes; collectives are measured across all ranks), or a refit of saved
records (``--from-records``). Nothing here imports torchrec.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, List, Optional, Tuple

import attrs
import torch

from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.atomic import write_json
from torchrec_sparselift.calibration.kernel_fit import CalibrationReport, fit_kernel_profile, load_records
from torchrec_sparselift.calibration.records import MicrobenchRecords
from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile
from torchrec_sparselift.errors import CalibrationError
from torchrec_sparselift.pictures import fit_png, kernel_fit_points, require_matplotlib
from torchrec_sparselift.measure.microbench import (
    RewriteSweep,
    SweepConfig,
    bench_collectives,
    bench_dense,
    bench_host_to_device,
    bench_lookups,
    bench_rewrite_constants,
    resolve_kernel,
)

__all__ = ["calibrate", "add_kernels_arguments", "run_kernels"]


def _rank0_print(message: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(f"[calibrate] {message}", flush=True)


def calibrate(
    base: HardwareProfile,
    quick: bool = False,
    pg: Any = None,
    *,
    device: Optional[str] = None,
    kernel: str = "auto",
    config: Optional[SweepConfig] = None,
    rewrites: Optional[RewriteSweep] = None,
    dense_dtype: Optional[str] = None,
    name: Optional[str] = None,
    budget_s: Optional[float] = None,
    progress: Optional[Callable[[str], None]] = _rank0_print,
) -> Tuple[HardwareProfile, CalibrationReport]:
    """Run the microbenchmarks here and fit a profile on top of ``base``.

    ``pg``: the process group for collectives; ``None`` means the default group when one is
    initialized, else none. With one rank, collectives are skipped (and the report says so).
    Every rank of ``pg`` must call this with the same arguments. Compute benchmarks run on all
    ranks at once (they contend as in training); each rank fits its own compute records and the
    shared collective records, so save rank 0's result (``main`` does). ``device`` defaults to
    CUDA when available. ``budget_s`` (single process only) stops starting new lookup tables
    once 70% of it is spent, leaving the rest for the dense and copy benchmarks. ``rewrites``:
    the sweep of the rewrites' constants (default :meth:`RewriteSweep.quick` with ``quick``, else
    :class:`RewriteSweep`'s, a few seconds).
    """
    import torch.distributed as dist

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    if dev.type not in ("cpu", "cuda"):
        raise CalibrationError(f"calibration runs on 'cpu' or 'cuda', not {dev.type!r}")
    if pg is None and dist.is_available() and dist.is_initialized():
        pg = dist.group.WORLD
    world = dist.get_world_size(pg) if pg is not None else 1
    cfg = config or (SweepConfig.quick(dev.type) if quick else SweepConfig.full(dev.type))
    if dense_dtype is not None and dense_dtype not in cfg.dense_dtypes:
        cfg = attrs.evolve(cfg, dense_dtypes=cfg.dense_dtypes + (dense_dtype,))
    notes: List[str] = []
    barrier = (lambda: dist.barrier(group=pg)) if world > 1 else None
    say = progress or (lambda _m: None)

    kern = resolve_kernel(kernel)
    say(f"device {dev}, lookup kernel {kern}, {world} rank(s), {'quick' if quick else 'full'} sweep")
    deadline = None
    if budget_s is not None:
        if world > 1:
            raise CalibrationError("budget_s works in a single process only (ranks must sweep the same tables)")
        deadline = time.monotonic() + 0.7 * budget_s
    lookups = bench_lookups(cfg, dev, kernel=kern, barrier=barrier, progress=say, deadline=deadline)
    say(f"lookups: {len(lookups)} records")
    dense = bench_dense(cfg, dev, progress=say)
    copies = bench_host_to_device(cfg, dev, progress=say)
    chunks, dedup = bench_rewrite_constants(dev, rewrites or (RewriteSweep.quick() if quick else RewriteSweep()))
    say(f"rewrite constants: {len(chunks)} chunked dense steps, {len(dedup)} dedup kernel timings")
    if world > 1:
        collectives = bench_collectives(cfg, pg, dev, progress=say)
    else:
        collectives = []
        say("single process: collectives skipped (run under torchrun with >= 2 ranks to measure them)")
    records = MicrobenchRecords(lookups=lookups, collectives=collectives, dense=dense, copies=copies,
                                chunks=chunks, dedup=dedup)

    local = ranks_per_host(world_size=world) if world > 1 else None
    spans = world > 1 and local is not None and world > local
    hbm_cap = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    if dev.type == "cuda":
        notes.append(f"measured on {torch.cuda.get_device_name(dev)}")
    if kern == "torch_embedding_bag":
        notes.append(
            "lookups used torch.nn.functional.embedding_bag + row-wise AdaGrad (fbgemm_gpu not "
            "importable); fbgemm TBE is typically faster, so bw is a lower and bwd_factor an upper estimate"
        )
    return fit_kernel_profile(
        base, records, name=name, dense_dtype=dense_dtype, compute_device=dev.type,
        local_world_size=local, spans_hosts=spans, hbm_cap_bytes=hbm_cap, notes=notes,
    )


def add_kernels_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sparselift calibrate kernels``."""
    p.add_argument("--out", required=True, help="where to write the fitted profile JSON")
    p.add_argument("--quick", action="store_true", help="a small sweep (seconds) instead of the full one")
    p.add_argument("--base", default=None, help="preset or profile JSON whose unmeasured fields are kept "
                   "(default: cpu-gloo on CPU, h100 on CUDA)")
    p.add_argument("--name", default=None, help="name of the fitted profile (default: BASE-calibrated)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--kernel", choices=("auto", "fbgemm", "torch"), default="auto",
                   help="lookup kernel: fbgemm TBE or torch embedding_bag (auto: fbgemm when importable)")
    p.add_argument("--dense-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="matmul dtype whose throughput becomes dense_flops (default fp32)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads while measuring (torchrun sets 1 per rank; on a shared "
                   "machine 1 avoids OpenMP spin-wait stalls in the CPU TBE backward)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="single process: stop adding lookup tables after 70%% of this many seconds")
    p.add_argument("--records", default=None,
                   help="where to write raw records + fit report (default: OUT with .records.json)")
    p.add_argument("--from-records", default=None,
                   help="refit from a records/report JSON written earlier instead of measuring")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="also draw the fit: predicted against measured time per record, by family (needs matplotlib)")


def run_kernels(args: argparse.Namespace) -> int:
    """``sparselift calibrate kernels``: measure (or refit saved records), write the profile and
    its records; 0 on success, 2 on bad input."""
    import torch.distributed as dist

    if args.threads is not None:
        if args.threads < 1:
            print("sparselift calibrate kernels: error: --threads must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    records_path = args.records or (os.path.splitext(args.out)[0] + ".records.json")
    own_pg = False
    try:
        if args.png:  # before measuring: the picture's folder and matplotlib
            if not os.path.isdir(os.path.dirname(os.path.abspath(args.png))):
                raise CalibrationError(f"--png {args.png}: the folder {os.path.dirname(os.path.abspath(args.png))} "
                                       "does not exist")
            require_matplotlib()
        if args.from_records:
            records, previous = load_records(args.from_records)
            base = get_profile(args.base or previous.get("base") or "cpu-gloo")
            dev = args.device or (records.lookups[0].device if records.lookups else base.compute_device)
            prev_profile = previous.get("profile", {})
            profile, report = fit_kernel_profile(
                base, records, name=args.name, dense_dtype=args.dense_dtype, compute_device=dev,
                local_world_size=prev_profile.get("local_world_size"),
                hbm_cap_bytes=prev_profile.get("hbm_cap_bytes"),
                notes=[n for n in previous.get("notes", []) if n.startswith(("measured on", "lookups used"))],
            )
            rank = 0
        else:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
                use_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
                if use_cuda:
                    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                dist.init_process_group(backend="nccl" if use_cuda else "gloo")
                own_pg = True
            rank = dist.get_rank() if dist.is_initialized() else 0
            on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
            base = get_profile(args.base or ("h100" if on_cuda else "cpu-gloo"))
            profile, report = calibrate(
                base, quick=args.quick, device=args.device, kernel=args.kernel,
                dense_dtype=args.dense_dtype, name=args.name, budget_s=args.budget_s,
            )
        if rank == 0:
            profile.save(args.out)
            write_json(records_path, report.to_dict(), prefix=".calib-")
            print(report.summary(), flush=True)
            print(f"[calibrate] wrote {args.out} and {records_path}", flush=True)
            if args.png:
                fit_png(kernel_fit_points(report), args.png, title=f"kernel fit {report.profile.name!r}",
                        what="kernel measurements", quantity="time")
                print(f"[calibrate] wrote {args.png}", flush=True)
        return 0
    except (CalibrationError, ValueError, RuntimeError, OSError, ImportError) as exc:
        print(f"sparselift calibrate kernels: error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if own_pg:
            # the runtime package's __init__ imports torchrec; this command runs without it
            from torchrec_sparselift.runtime.process_group import close_process_group

            close_process_group()
