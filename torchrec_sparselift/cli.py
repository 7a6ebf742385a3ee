"""``sparselift``: plan, compare, explain and calibrate from the command line.

::

    sparselift plan --tables tables.json --topology h100 --world-size 16 --out plan.json
    sparselift compare --workload dcnv2 --topology h100 --world-size 8
    sparselift explain plan.json --png plan.png
    sparselift calibrate kernels --quick --out my-machine.json

Inputs are a table file (JSON, or YAML when PyYAML is installed), a reference workload
(``--workload dcnv2|kaggle|production-N``) or an importable model factory
(``--model package.module:factory``), and a topology (a hardware preset or calibrated profile
plus world size). ``plan`` stores those inputs in the plan's ``planner_info["inputs"]`` so
``explain`` can re-price the plan's tables without re-planning.

Exit codes: 0 success, 1 no plan satisfies the constraints, 2 bad input (arguments, files,
topology). Errors print one ``sparselift <command>: error: ...`` message and no traceback
(``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import attrs

from torchrec_sparselift import defaults
from torchrec_sparselift.atomic import write_text
from torchrec_sparselift.errors import CliError
from torchrec_sparselift.pictures import plan_png, plans_png, require_matplotlib
from torchrec_sparselift.plan.stored_inputs import (
    DEFAULT_BATCH_SIZE,
    PlanInputs,
    TopologySpec,
    load_table_file,
    parse_table_entries,
    reference_workload,
)
from torchrec_sparselift.vocabulary import LAYOUT_2D_CHOICES, STRATEGY_2D_CHOICES
from torchrec_sparselift.semantics.table_file import TableEntry
from torchrec_sparselift.validation import option_problems, raise_problems, setting_problems
from torchrec_sparselift.calibration.attribution import (
    compare,
    format_comparison,
    load_attribution,
    predicted_for_plan,
)
from torchrec_sparselift.explain import (
    format_2d,
    format_never_slower,
    format_rewrites,
    format_plan_table,
    format_rank_breakdown,
    format_table,
    format_tables,
    format_timeline,
    reprice_plan,
)
from torchrec_sparselift.measure.commands import main as calibrate_main
from torchrec_sparselift.plan import ExecutionPlan, PlanFormatError
from torchrec_sparselift.plan.compare import compare_planners
from torchrec_sparselift.plan.rewrites import REWRITES, rewrite_problem
from torchrec_sparselift.planner import SparseLiftPlanner

__all__ = [
    "main",
    "CliError",
    "TableEntry",
    "TopologySpec",
    "PlanInputs",
    "load_table_file",
    "parse_table_entries",
]

# ----------------------------------------------------------------------------------------------
# progress and output helpers
# ----------------------------------------------------------------------------------------------


class Progress:
    """Tell the user (stderr) about a step only if it takes longer than ``after_s`` seconds,
    then every ``every_s`` seconds until it ends, and how long it took."""

    def __init__(self, what: str, quiet: bool = False, after_s: float = 2.0, every_s: float = 15.0) -> None:
        self.what = what
        self.quiet = quiet
        self.after_s = after_s
        self.every_s = every_s
        self._stop = threading.Event()
        self._shown = False
        self._t0 = 0.0
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        if self._stop.wait(self.after_s):
            return
        self._shown = True
        print(f"sparselift: {self.what} ...", file=sys.stderr, flush=True)
        while not self._stop.wait(self.every_s):
            print(f"sparselift: still {self.what} ({time.monotonic() - self._t0:.0f} s)", file=sys.stderr, flush=True)

    def __enter__(self) -> "Progress":
        self._t0 = time.monotonic()
        if not self.quiet:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._shown and exc[0] is None:
            print(f"sparselift: {self.what}: done in {time.monotonic() - self._t0:.1f} s",
                  file=sys.stderr, flush=True)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0


def _write_text(path: str, text: str) -> None:
    try:
        write_text(path, text, prefix=".sparselift-", suffix=".tmp")
    except OSError as e:
        raise CliError(f"cannot write {path}: {e}") from None


# ----------------------------------------------------------------------------------------------
# argument parsing
# ----------------------------------------------------------------------------------------------


def _add_input_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("input (exactly one)" if required else "input (default: the inputs stored in the plan)")
    g.add_argument("--tables", metavar="FILE", help="table file (.json, or .yaml with PyYAML): a list of "
                   "{name, rows, dim, features?, pooling_factor?, sharding_types?, compute_kernels?, "
                   "min_partition?}")
    g.add_argument("--workload", metavar="NAME", help="reference workload: dcnv2, kaggle or production-N")
    g.add_argument("--model", metavar="MODULE:FACTORY", help="importable function returning an nn.Module")
    g.add_argument("--constraints", metavar="FILE", help="per-table constraints (same keys as a table file, "
                   "without rows/dim) for --model or --workload")
    t = p.add_argument_group("topology")
    t.add_argument("--topology", metavar="NAME", default=None if not required else "h100",
                   help="hardware preset (h100, h200, a100, cpu-gloo) or a calibrated profile .json "
                   "(default h100)" if required else "hardware preset or profile .json")
    t.add_argument("--world-size", type=int, default=None, metavar="N", help="number of ranks (default: one host)")
    t.add_argument("--local-world-size", type=int, default=None, metavar="N", help="ranks per host (default: the preset's)")
    t.add_argument("--hbm-gib", type=float, default=None, metavar="GIB", help="device memory per rank in GiB "
                   "(CPU: the rank's memory)")
    t.add_argument("--ddr-gib", type=float, default=None, metavar="GIB", help="host memory per rank in GiB")
    b = p.add_argument_group("batch")
    b.add_argument("--batch-size", type=int, default=None, metavar="B", help="per-rank batch size "
                   f"(default: the workload's global batch / world size, else {DEFAULT_BATCH_SIZE})")
    b.add_argument("--global-batch-size", type=int, default=None, metavar="B", help="global batch size (divided over ranks)")


def _add_planner_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planner")
    g.add_argument("--time-budget", type=float, default=defaults.TIME_BUDGET_S, metavar="S",
                   help=f"search time budget (default {defaults.TIME_BUDGET_S:g} s)")
    g.add_argument("--allow-lossy-comm", action="store_true", help="allow fp16/bf16 embedding communication")
    g.add_argument("--allow-staleness", action="store_true", help="allow the semi-sync pipeline (one-step-stale "
                   "embeddings)")
    g.add_argument("--rewrites", default=None, metavar="NAMES",
                   help=f"the sparse-path rewrites the planner may choose, comma-separated from {','.join(REWRITES)}, "
                        "or none (default: all)")
    g.add_argument("--per-sample", action="store_true",
                   help="declare the model's dense part per-sample (every sample's output depends on that sample "
                        "alone, the loss is the batch mean), so the planner may split the batch of a model whose "
                        "modules it does not know")
    _add_2d_args(g)


def _add_2d_args(g: Any) -> None:
    g.add_argument("--sharding-group-size", type=_group_size_arg, default=None, metavar="auto|N",
                   help="2D sparse parallelism (DMPCollection): shard tables over groups of N ranks and "
                   "replicate the groups, or 'auto' to let the planner pick N (the whole world = 1D)")
    g.add_argument("--max-sync-interval", type=int, default=None, metavar="N",
                   help="2D: largest replica-sync interval the planner may choose (default: the largest "
                   "interval measured at quality parity with 1D; more is an explicit allowance)")
    g.add_argument("--layout-2d", choices=LAYOUT_2D_CHOICES, default=defaults.LAYOUT_2D,
                   help="2D rank layout: strided groups (TorchRec's default), contiguous groups "
                   "(use_inter_host_allreduce), or auto: price both on several hosts")
    g.add_argument("--2d-strategy", dest="strategy_2d", choices=STRATEGY_2D_CHOICES, default=defaults.STRATEGY_2D,
                   help="2D: how replicas stay in step: periodic sync (default), reduce-scatter + all-gather "
                   "of the weights every step (fully_sharded; CUDA only), or auto: price both")


def _group_size_arg(value: str) -> Union[str, int]:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of ranks, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of ranks >= 1, got {n}")
    return n


def _add_common(p: argparse.ArgumentParser, top: bool = False) -> None:
    # subcommands must not reset a flag given before the command name
    default = False if top else argparse.SUPPRESS
    p.add_argument("--quiet", action="store_true", default=default, help="no progress messages on stderr")
    p.add_argument("--debug", action="store_true", default=default, help="show tracebacks and library warnings")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparselift",
        description="Plan TorchRec embedding sharding with SparseLift's cost model, compare with "
        "TorchRec's planner, and explain plans.",
        epilog="Run `sparselift COMMAND --help` for each command's options.",
    )
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plan", help="plan and write an ExecutionPlan JSON",
                       description="Plan the input on the topology, write the ExecutionPlan JSON and print "
                       "a summary table.")
    _add_input_args(p)
    _add_planner_args(p)
    p.add_argument("--out", "-o", default="sparselift-plan.json", metavar="FILE", help="where to write the plan "
                   "(default sparselift-plan.json)")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="reuse a stored plan with the same inputs from this "
                   "directory (and store new ones there)")
    _add_common(p)

    c = sub.add_parser("compare", help="SparseLift vs TorchRec's EmbeddingShardingPlanner, side by side",
                       description="Plan the same input with SparseLift and TorchRec's EmbeddingShardingPlanner; "
                       "score both plans under SparseLift's cost model and TorchRec's estimator; show lower "
                       "bound, per-rank peak memory and planning time.")
    _add_input_args(c)
    _add_planner_args(c)
    c.add_argument("--torchrec-timeout", type=float, default=None, metavar="S",
                   help="TorchRec planner's timeout_seconds (default: none)")
    c.add_argument("--json", default=None, metavar="FILE", help="also write the numbers as JSON")
    c.add_argument("--save-plans", default=None, metavar="DIR", help="also write both plans as ExecutionPlan "
                   "JSON (DIR/sparselift.json, DIR/torchrec.json) for `sparselift explain`")
    c.add_argument("--png", default=None, metavar="FILE", help="also draw both plans' per-rank step (stacked by "
                   "term, SparseLift left, TorchRec right) and per-rank memory against capacity (needs matplotlib)")
    _add_common(c)

    e = sub.add_parser("explain", help="explain a plan: per-rank breakdown, critical path, per-table reasons",
                       description="Explain an ExecutionPlan: per-rank compute/communication/memory, the "
                       "critical path of a step, the gap to the lower bound, and for each large table the "
                       "alternative shardings it beat (re-priced with the same cost model, not re-planned).")
    e.add_argument("plan", help="ExecutionPlan JSON written by `sparselift plan`")
    e.add_argument("--top", type=int, default=8, metavar="N", help="explain this many of the largest tables (default 8)")
    e.add_argument("--png", default=None, metavar="FILE", help="also draw per-rank bars stacked by term and the "
                   "step timeline (needs matplotlib)")
    e.add_argument("--attribution", default=None, metavar="FILE.json",
                   help="a measured attribution (examples/dlrm/train.py --attribute N, or "
                   "calibration.attribution.save_attribution): show each sparse-path node kind's measured ms "
                   "next to the model's prediction (also in the PNG)")
    _add_input_args(e, required=False)
    _add_2d_args(e.add_argument_group("2D (with an input: the planning inputs to compare against)"))
    _add_common(e)

    sub.add_parser("calibrate", help="calibrate this machine: steps (under torchrun), check, kernels",
                   add_help=False)
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    """Every numeric flag that is zero, negative or out of range, listed at once (exit 2)."""
    raise_problems(setting_problems([
        ("--world-size", getattr(args, "world_size", None), "int>=1", "--world-size 8"),
        ("--local-world-size", getattr(args, "local_world_size", None), "int>=1", "--local-world-size 8"),
        ("--hbm-gib", getattr(args, "hbm_gib", None), ">0", "--hbm-gib 80"),
        ("--ddr-gib", getattr(args, "ddr_gib", None), ">0", "--ddr-gib 512"),
        ("--batch-size", getattr(args, "batch_size", None), "int>=1", "--batch-size 512"),
        ("--global-batch-size", getattr(args, "global_batch_size", None), "int>=1", "--global-batch-size 65536"),
        ("--time-budget", getattr(args, "time_budget", None), ">0", "--time-budget 10"),
        ("--torchrec-timeout", getattr(args, "torchrec_timeout", None), ">0", "--torchrec-timeout 60"),
        ("--top", getattr(args, "top", None), "int>=0", "--top 8"),
    ]), "the command line", CliError)


#: The planner option each command-line flag sets (for messages that name what the user typed).
FLAG_OF_OPTION = {"sharding_group_size": "--sharding-group-size", "max_sync_interval": "--max-sync-interval",
                  "layout_2d": "--layout-2d", "strategy_2d": "--2d-strategy", "time_budget_s": "--time-budget",
                  "allow_lossy_comm": "--allow-lossy-comm", "allow_staleness": "--allow-staleness",
                  "rewrites": "--rewrites", "per_sample": "--per-sample"}


def _check_options_apply(args: argparse.Namespace) -> None:
    """The planner's rule for options that do not apply (:data:`~torchrec_sparselift.validation.OPTION_NEEDS`),
    on the flags given, naming the flags (exit 2)."""
    given = {name: getattr(args, name) for name in FLAG_OF_OPTION if hasattr(args, name)}
    if "rewrites" in given:
        given["rewrites"] = _rewrites_arg(args)
    errors, warned = option_problems(given, spell=lambda name: FLAG_OF_OPTION.get(name, name))
    for w in warned:
        print(f"sparselift: warning: {w}", file=sys.stderr)
    raise_problems(errors, "the command line", CliError)


def _rewrites_arg(args: argparse.Namespace) -> Optional[Tuple[str, ...]]:
    """``--rewrites`` as the planner's ``rewrites=`` (None: the flag not given, every rewrite)."""
    text = getattr(args, "rewrites", None)
    if text is None:
        return None
    names = [] if text.strip().lower() == "none" else [n.strip() for n in text.split(",") if n.strip()]
    problem = rewrite_problem(names)
    if problem or not (names or text.strip().lower() == "none"):
        raise CliError(f"--rewrites {text!r}: " + (problem or "") +
                       f" (give names from {','.join(REWRITES)}, comma-separated, or none)")
    return tuple(names)


def _inputs_from_args(args: argparse.Namespace, topology_default: Optional[str] = "h100") -> PlanInputs:
    _check_flags(args)
    _check_options_apply(args)
    given = [n for n in ("tables", "workload", "model") if getattr(args, n, None)]
    if len(given) != 1:
        raise CliError("give exactly one input: --tables FILE, --workload NAME or --model MODULE:FACTORY"
                       + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
    if args.constraints and args.tables:
        raise CliError("--constraints is for --model/--workload; put constraints in the table file instead")
    tables = load_table_file(args.tables) if args.tables else None
    constraints = load_table_file(args.constraints, constraint_only=True) if args.constraints else ()
    hardware = args.topology or topology_default
    spec = TopologySpec(hardware=hardware, world_size=1, local_world_size=args.local_world_size,
                        hbm_gib=args.hbm_gib, ddr_gib=args.ddr_gib)
    world = args.world_size if args.world_size is not None else spec.profile().local_world_size
    spec = attrs.evolve(spec, world_size=world)
    spec.resolved()  # validate before importing torchrec
    if args.workload:
        reference_workload(args.workload)
    return PlanInputs(
        topology=spec, tables=tables, workload=args.workload, model=args.model, constraints=constraints,
        batch_size=args.batch_size, global_batch_size=args.global_batch_size,
        allow_lossy_comm=getattr(args, "allow_lossy_comm", False),
        allow_staleness=getattr(args, "allow_staleness", False),
        time_budget_s=float(getattr(args, "time_budget", defaults.TIME_BUDGET_S)),
        source=os.path.abspath(args.tables) if args.tables else "",
        sharding_group_size=getattr(args, "sharding_group_size", None),
        max_sync_interval=getattr(args, "max_sync_interval", None),
        layout_2d=getattr(args, "layout_2d", defaults.LAYOUT_2D),
        strategy_2d=getattr(args, "strategy_2d", defaults.STRATEGY_2D),
        rewrites=_rewrites_arg(args),
        per_sample=bool(getattr(args, "per_sample", False)),
    )


def _import_torchrec(quiet: bool) -> None:
    with Progress("importing torchrec", quiet):
        import torchrec  # noqa: F401
        import torchrec.distributed.planner  # noqa: F401


def _planner(inputs: PlanInputs, constraints: Dict[str, Any], cache_dir: Optional[str] = None) -> Any:
    return SparseLiftPlanner(
        topology=inputs.topology.topology(), batch_size=inputs.per_rank_batch(),
        constraints=constraints or None, hardware=inputs.topology.profile(), debug=False,
        time_budget_s=inputs.time_budget_s, allow_lossy_comm=inputs.allow_lossy_comm,
        allow_staleness=inputs.allow_staleness, cache_dir=cache_dir,
        sharding_group_size=inputs.sharding_group_size, max_sync_interval=inputs.max_sync_interval,
        layout_2d=inputs.layout_2d, strategy_2d=inputs.strategy_2d,
        rewrites=inputs.rewrites, per_sample=inputs.per_sample,
    )


def _peak(values: Sequence[float]) -> float:
    return max(values) if values else 0.0


# ----------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    inputs = _inputs_from_args(args)
    _import_torchrec(args.quiet)
    module, constraints = inputs.build()
    planner = _planner(inputs, constraints, args.cache_dir)
    what = f"planning {inputs.describe()} on {inputs.topology.describe()}"
    with Progress(what, args.quiet):
        ep = planner.plan_execution(module)
    ep = attrs.evolve(ep, planner_info={**ep.planner_info, "inputs": inputs.to_dict()})
    _write_text(args.out, ep.to_json(indent=1))
    p = ep.prediction
    hit = planner.last_cache_hit
    print(f"SparseLift plan for {inputs.describe()} on {inputs.topology.describe()}, "
          f"batch {inputs.per_rank_batch()}/rank" + (" (reused from cache)" if hit else ""))
    print(f"  {ep.summary()}")
    print(f"  predicted step {p.step_time_s * 1e3:.3f} ms, lower bound {p.lower_bound_s * 1e3:.3f} ms, "
          f"planning {ep.planner_info.get('planning_time_s', 0.0):.2f} s")
    peak_dev = _peak([r.hbm_bytes for r in p.per_rank])
    peak_host = _peak([r.ddr_bytes for r in p.per_rank])
    print(f"  peak per-rank memory: device {peak_dev / 2**30:.2f} GiB, host {peak_host / 2**30:.2f} GiB")
    rule = format_never_slower(ep.planner_info)
    if rule:
        print(f"  {rule}")
    for line in format_rewrites(ep.planner_info):
        print(f"  {line}")
    if ep.optimizations.is_2d:
        print("\n".join("  " + line for line in format_2d(ep.optimizations)))
    print()
    print(format_plan_table(ep))
    print()
    print(f"wrote {args.out}; see why with: sparselift explain {args.out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    inputs = _inputs_from_args(args)
    _check_png(args.png)
    _import_torchrec(args.quiet)
    module, constraints = inputs.build()
    bs = inputs.per_rank_batch()
    planner = _planner(inputs, constraints)
    stages = {"sparselift": f"planning with SparseLift ({inputs.describe()})",
              "torchrec": "planning with TorchRec's EmbeddingShardingPlanner"}
    cmp = compare_planners(planner, module, inputs.topology.topology(), bs, constraints,
                           inputs.topology.profile(), args.torchrec_timeout,
                           stage=lambda name: Progress(stages[name], args.quiet))
    ours, sl, tr = cmp.result, cmp.sparselift, cmp.torchrec
    cols = {"sparselift": sl, "torchrec": tr}

    def ms(d: Dict[str, Any], k: str) -> str:
        return f"{d[k] * 1e3:.3f}" if k in d and d[k] == d[k] else "n/a"

    def gib(d: Dict[str, Any], k: str) -> str:
        return f"{d[k] / 2**30:.2f}" if k in d else "n/a"

    def ratio(k: str) -> str:
        if k in sl and k in tr and sl[k]:
            return f"{tr[k] / sl[k]:.2f}x"
        return ""

    lb = sl["lower_bound_sparse_dist_s"]

    def gap(d: Dict[str, Any]) -> str:
        return f"{d['step_sparse_dist_s'] / lb - 1:.1%}" if lb and "step_sparse_dist_s" in d else "n/a"

    rows = [
        ["SparseLift model, sparse_dist/fp32 (ms)", ms(sl, "step_sparse_dist_s"), ms(tr, "step_sparse_dist_s"),
         ratio("step_sparse_dist_s")],
        ["  lower bound, same model (ms)", f"{lb * 1e3:.3f}", f"{lb * 1e3:.3f}", ""],
        ["  gap to lower bound", gap(sl), gap(tr), ""],
        ["SparseLift model, with optimizations (ms)", ms(sl, "step_s"), ms(tr, "step_s"), ratio("step_s")],
        ["  optimizations", sl["optimizations"], tr.get("optimizations", "n/a"), ""],
        ["  lower bound for these (ms)", f"{sl['lower_bound_s'] * 1e3:.3f}", "", ""],
        ["TorchRec estimator: slowest rank (ms)",
         f"{sl['torchrec_estimate_ms']:.3f}" if "torchrec_estimate_ms" in sl else "n/a",
         f"{tr['torchrec_estimate_ms']:.3f}" if "torchrec_estimate_ms" in tr else "n/a", ratio("torchrec_estimate_ms")],
        ["peak memory/rank, SparseLift model (GiB)", gib(sl, "peak_device_bytes"), gib(tr, "peak_device_bytes"), ""],
        ["peak memory/rank, TorchRec estimator (GiB)", gib(sl, "torchrec_peak_bytes"), gib(tr, "torchrec_peak_bytes"), ""],
        ["planning time (s)", f"{sl['planning_time_s']:.2f}", f"{tr['planning_time_s']:.2f}", ratio("planning_time_s")],
    ]
    print(f"{inputs.describe()} on {inputs.topology.describe()}, batch {bs}/rank")
    print(format_table(["", "SparseLift", "TorchRec", "TorchRec/SparseLift"], rows, "<>>>"))
    if "error" in tr:
        print(f"TorchRec planner failed: {tr['error']}")
    for name, d in (("SparseLift", sl), ("TorchRec", tr)):
        if "torchrec_estimate_error" in d:
            print(f"TorchRec estimator could not price the {name} plan: {d['torchrec_estimate_error']}")
    print("TorchRec's planner chooses no pipeline or comm precision: its plan is priced with "
          "TrainPipelineSparseDist and fp32 comms, TorchRec's default runtime. Ratios above 1.00x favour SparseLift.")
    if ours.sharding_group_size:
        print("SparseLift's plan is 2D: 'with optimizations' is its step with the replica sync; the other "
              "SparseLift rows price its group-local sharding as if it were 1D on the first ranks")
        print("\n".join(format_2d(ours.optimizations())))
    if args.json:
        _write_text(args.json, json.dumps({"inputs": inputs.to_dict(), **cols}, indent=1, default=str))
    if args.save_plans:
        fp = planner.fingerprint(module)
        info = {"inputs": inputs.to_dict()}
        written = [_save_execution_plan(os.path.join(args.save_plans, "sparselift.json"), ours, fp,
                                        {"planner": "SparseLiftPlanner", "solver": ours.search.solver,
                                         "planning_time_s": round(sl["planning_time_s"], 4), **info})]
        if cmp.torchrec_result is not None:
            written.append(_save_execution_plan(os.path.join(args.save_plans, "torchrec.json"),
                                                cmp.torchrec_result, fp,
                                                {"planner": "EmbeddingShardingPlanner", "solver": "torchrec",
                                                 "planning_time_s": round(tr["planning_time_s"], 4), **info}))
        print(f"wrote {' and '.join(written)}; explain with: sparselift explain {written[-1]}")
    if args.png:
        _compare_png(args.png, cmp, planner.memory_caps(module), f"{inputs.describe()} on {inputs.topology.describe()}, "
                     f"batch {bs}/rank")
    return 0


def _compare_png(path: str, cmp: Any, capacity: Any, what: str) -> None:
    """``compare --png``: both plans' per-rank bars and memory against ``capacity``."""
    sl = cmp.result
    plans = [(f"SparseLift ({sl.search.pipeline})", sl.prediction())]
    if cmp.torchrec_result is not None:
        plans.append(("TorchRec (sparse_dist)", cmp.torchrec_result.prediction()))
    title = what + ("" if cmp.torchrec_result is not None else ": TorchRec's planner found no plan")
    if sl.sharding_group_size:
        title += (f" (SparseLift's 2D plan: one sharding group of {sl.sharding_group_size} ranks; its step "
                  f"includes the replica sync, {sl.sync_s * 1e3:.3f} ms/step)")
    _draw_png(path, lambda: plans_png(plans, path, capacity=capacity, title=title))


def _check_png(path: Optional[str]) -> None:
    """Before planning: ``--png``'s folder exists and matplotlib imports (else a CliError)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"--png {path}: the folder {folder} does not exist")
    try:
        require_matplotlib()
    except ImportError as e:
        raise CliError(str(e)) from None


def _draw_png(path: str, draw: Any) -> None:
    """Run ``draw`` (it writes ``path``), turning a missing matplotlib or an unwritable path into
    a CliError, and say where the picture is."""
    try:
        draw()
    except ImportError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot write {path}: {e}") from None
    print(f"\nwrote {path}")


def _save_execution_plan(path: str, result: Any, fingerprint: Any, info: Dict[str, Any]) -> str:
    """Write a PlanResult (planned or evaluated) as an ExecutionPlan JSON that explain can read."""
    ep = ExecutionPlan(sharding_plan=result.sharding_plan, optimizations=result.optimizations(),
                       prediction=result.prediction(), fingerprint=fingerprint, planner_info=info)
    _write_text(path, ep.to_json(indent=1))
    return path


def _explain_inputs(args: argparse.Namespace, ep: Any) -> Optional[PlanInputs]:
    if args.tables or args.workload or args.model:
        return _inputs_from_args(args)
    stored = ep.planner_info.get("inputs")
    if stored is None:
        return None
    inputs = PlanInputs.from_dict(stored, file=args.plan)
    if args.topology or args.world_size or args.batch_size:
        raise CliError("topology/batch flags for explain need an input too (--tables, --workload or --model)")
    return inputs


def cmd_explain(args: argparse.Namespace) -> int:
    _check_flags(args)
    _check_png(args.png)
    if not os.path.isfile(args.plan):
        raise CliError(f"plan file {args.plan!r} does not exist")
    attribution = None
    if args.attribution:
        try:
            attribution = load_attribution(args.attribution)
        except ValueError as e:  # FileFormatError: names the file and the field
            raise CliError(f"--attribution: not a SparseLift attribution file: {e}") from None
    _import_torchrec(args.quiet)

    try:
        ep = ExecutionPlan.load(args.plan)
    except PlanFormatError as e:  # names the file and the field
        raise CliError(f"not a SparseLift execution plan: {e}") from None
    p = ep.prediction
    o = ep.optimizations
    print(f"{args.plan}: {ep.summary()}")
    if o.is_2d:
        print("\n".join(format_2d(o)))
    lb_txt = f"{p.lower_bound_s * 1e3:.3f} ms" if p.lower_bound_s > 0 else "n/a"
    print(f"step {p.step_time_s * 1e3:.3f} ms, lower bound {lb_txt}, gap {p.gap:.1%}"
          + ("  (the plan is within this of the best possible under the model)" if p.lower_bound_s > 0 else ""))
    rule = format_never_slower(ep.planner_info)
    if rule:
        print(rule)
    for line in format_rewrites(ep.planner_info):
        print(line)
    print()
    print("Per-rank breakdown (modelled; busy = compute + exposed comm):")
    print(format_rank_breakdown(p))
    busiest = max(p.per_rank, key=lambda r: r.step_s, default=None)
    if busiest is not None:
        print(f"busiest rank {busiest.rank}: {busiest.step_s * 1e3:.3f} ms busy "
              f"({busiest.exposed_comm_s / max(busiest.step_s, 1e-30):.0%} exposed communication)")

    inputs = _explain_inputs(args, ep)
    segments = None
    if inputs is None:
        print("\nThis plan carries no planning inputs (it was not written by `sparselift plan`): pass "
              "--tables/--workload/--model and topology flags to see the critical path and per-table reasons.")
    else:
        module, constraints = inputs.build()
        with Progress("re-pricing the plan", args.quiet):
            try:
                repriced = reprice_plan(ep, _planner(inputs, constraints), module, constraints,
                                        inputs.topology.topology(), inputs.per_rank_batch(),
                                        inputs.topology.profile(), args.top)
            except ValueError as e:
                raise CliError(f"the plan does not match its inputs: {e}") from None
        if repriced.inputs_differ:
            print(f"\nnote: the inputs differ from the ones this plan was made for ({repriced.inputs_differ}); "
                  "the explanation below prices the plan on the current inputs")
        evaluated, expl, segments = repriced.evaluated, list(repriced.tables), list(repriced.segments)
        step = evaluated.search.step
        supports = repriced.supports_overlap
        repriced_s = evaluated.rewritten_step_s  # the step with the plan's rewrites (none: the search's)
        if abs(repriced_s - p.step_time_s) > 1e-6 * max(p.step_time_s, 1e-12):
            print(f"\nnote: re-priced step {repriced_s * 1e3:.3f} ms differs from the stored "
                  f"{p.step_time_s * 1e3:.3f} ms (cost model or inputs changed since planning)")
        print(f"\nCritical path of one step (pipeline {step.pipeline}"
              + ("" if supports else "; this hardware does not overlap, so every pipeline runs as base")
              + "):")
        print(format_timeline(segments, step.total_s))
        if p.lower_bound_s > 0:
            print(f"gap to the lower bound: {(step.total_s - p.lower_bound_s) * 1e3:.3f} ms ({p.gap:.1%}); "
                  "the bound assumes perfectly divisible work, so part of the gap may be unreachable")
        if expl:
            print(f"\nWhy the {len(expl)} tables with the most modelled work got their sharding (each "
                  "alternative priced on its best ranks with the rest of the plan fixed):")
            print(format_tables(expl))
    comparison = None
    if attribution is not None:
        predicted = predicted_for_plan(evaluated) if inputs is not None else None
        comparison = compare(attribution, predicted)
        label = f" ({attribution.label})" if attribution.label else ""
        print(f"\nMeasured vs predicted per sparse-path node kind, ms per step ({args.attribution}{label}, "
              f"{attribution.world_size} ranks, pipeline {attribution.pipeline or '?'}):")
        print(format_comparison(comparison, attribution))
        if predicted is None:
            print("(no prediction per kind: give the plan's inputs to re-price it, see the note above)")
    if args.png:
        if segments is None:
            raise CliError("--png needs the step timeline: give the plan's inputs (see the note above)")
        _draw_png(args.png, lambda: plan_png(p, segments, args.png, title=f"{os.path.basename(args.plan)}: "
                                             f"{ep.summary()}", comparison=comparison,
                                             capacity=repriced.capacity))
    return 0


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _library_noise(debug: bool) -> Iterator[None]:
    """While a command runs: print the plan cache's log lines on stderr, and (unless ``debug``)
    silence library warnings and TorchRec's log chatter. Everything is restored afterwards, so
    calling :func:`main` in-process leaves logging and warning filters as they were."""
    cache_log = logging.getLogger("torchrec_sparselift.plan.cache")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("sparselift: %(message)s"))
    quiet = ("torchrec", "fbgemm_gpu", "torch.distributed", "torchrec_sparselift.planner", "")
    saved = {name: logging.getLogger(name or None).level for name in quiet}
    saved_cache = (cache_log.level, cache_log.propagate)
    cache_log.addHandler(handler)
    cache_log.setLevel(logging.INFO)
    cache_log.propagate = False
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.simplefilter("ignore")
                # TorchRec's planner also warns on the root logger (e.g. "Sharding spec not found"
                # for every data-parallel table); the cache log has its own handler
                for name in quiet:
                    logging.getLogger(name or None).setLevel(logging.ERROR)
            yield
    finally:
        cache_log.removeHandler(handler)
        cache_log.setLevel(saved_cache[0])
        cache_log.propagate = saved_cache[1]
        for name, level in saved.items():
            logging.getLogger(name or None).setLevel(level)


def _planning_errors() -> Tuple[type, ...]:
    try:
        from torchrec.distributed.planner.types import PlannerError

        return (PlannerError,)
    except ImportError:
        return ()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``sparselift`` command line; returns the exit code (0 ok, 1 no plan, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        return calibrate_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    debug = bool(args.debug)
    cmd = {"plan": cmd_plan, "compare": cmd_compare, "explain": cmd_explain}[args.command]
    prefix = f"sparselift {args.command}: error:"
    try:
        with _library_noise(debug):
            return cmd(args)
    except CliError as e:
        if debug:
            raise
        print(f"{prefix} {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"sparselift {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into messages
        if debug:
            raise
        planning = _planning_errors()
        if planning and isinstance(e, planning):
            msg = getattr(e, "message", None) or str(e)
            print(f"{prefix} no plan fits: {msg}", file=sys.stderr)
            return 1
        if isinstance(e, (ValueError, OSError, ImportError, TypeError)):
            print(f"{prefix} {e}", file=sys.stderr)
            return 2
        print(f"{prefix} {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
