"""Check planning inputs before planning: fail early, name the table or field, say what to change.

:func:`validate_inputs` looks at the tables a planner recovered (:class:`TableSpec` values or the
:class:`TableHandle` s that carry them), the topology, the per-rank batch size, the user's
``ParameterConstraints`` and the workload statistics, and raises one error that lists *every*
problem it found, each line naming the offending table, feature or field and the fix:

* ``ValueError`` for malformed or contradictory input: non-positive rows, dims or batch size; a
  topology whose world size is not a positive multiple of its local world size; a feature looked
  up by two tables of one module; an embedding dim the fused kernels cannot take; constraints that
  name unknown tables, unknown sharding types or kernels, a ``min_partition`` wider than a table
  that may only be split by columns, negative pooling factors or non-positive batch sizes;
  statistics for features no table looks up.
* :class:`~torchrec_sparselift.errors.SparseLiftPlannerError` (a TorchRec
  ``PlannerError``, kind ``insufficient_storage``) when the tables' weights alone exceed the
  memory of the whole cluster, so no plan can exist. (A single table too big for any one rank is
  reported by the planner's search, which knows each option's footprint.)

Every check lives here, and runs before any value is built. The planner passes a
:class:`Problems` list to :func:`~torchrec_sparselift.semantics.tables.extract_tables`, which
applies :func:`table_value_problems` (the checks ``TableSpec`` itself runs) and records what
leaves a table no sharding type or kernel instead of raising; :func:`validate_inputs` adds the
rest and raises them all in one error. Without a list, ``extract_tables`` and ``TableSpec`` raise
the first problem with the same words.

The planner's own arguments and the CLI's flags go through :func:`setting_problems` (sizes and
budgets: zero, negative, non-numeric, non-finite) and :func:`planner_option_problems` (pipelines,
solver, 2D group size against the topology), also listed at once; their types and shapes (a
list where a dict belongs, a string where a list belongs, a dict for a profile or statistics, an
empty pipeline list, NaN memory capacities) through :func:`argument_problems`, before any value
is built. :func:`callback_problem` names a user callback that returns no list of sharding options
or drops, adds or repeats a table. A batch size or pooling factors whose input/output buffers
alone exceed a rank's memory are refused by :func:`validate_inputs` naming the buffers.

This module is the base of the package with :mod:`torchrec_sparselift.errors`: it imports no
other layer, so every layer may use it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import attrs

from torchrec_sparselift import defaults
from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.vocabulary import COLUMN_SPLIT_TYPES, COMPUTE_KERNELS, SHARDING_TYPES, SOLVERS
from torchrec_sparselift.vocabulary import FUSED_KERNELS, OVERLAP, STALE_PIPELINES

__all__ = [
    "OptionNeed",
    "OPTION_NEEDS",
    "option_problems",
    "validate_inputs",
    "validate_settings",
    "setting_problems",
    "planner_option_problems",
    "argument_problems",
    "callback_problem",
    "topology_problems",
    "table_value_problems",
    "raise_problems",
    "Problems",
    "FUSED_DIM_MULTIPLE",
    "KNOWN_SHARDING_TYPES",
    "KNOWN_COMPUTE_KERNELS",
    "int_at_least",
]

#: FBGEMM's training TBE (``SplitTableBatchedEmbeddingBagsCodegen``) asserts that every embedding
#: dim is a multiple of 4, on CUDA *and* on CPU (measured with fbgemm-gpu-cpu 1.8.0). The dense
#: kernel (data-parallel tables) takes any dim.
FUSED_DIM_MULTIPLE = 4

#: TorchRec's sharding types and compute kernels (:mod:`torchrec_sparselift.vocabulary`).
KNOWN_SHARDING_TYPES: Tuple[str, ...] = SHARDING_TYPES
KNOWN_COMPUTE_KERNELS: Tuple[str, ...] = COMPUTE_KERNELS


def _spec(table: Any) -> Any:
    """A TableSpec from a TableSpec or a TableHandle."""
    return getattr(table, "spec", table)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_topology(topology: Any, problems: List[str]) -> None:
    ws, lws = topology.world_size, topology.local_world_size
    if not _is_int(ws) or ws <= 0:
        problems.append(f"topology.world_size must be a positive number of ranks, got {ws!r}")
        return
    if not _is_int(lws) or lws <= 0:
        problems.append(
            f"topology.local_world_size must be a positive number of ranks per host, got {lws!r}; "
            f"set it to the ranks per host (e.g. {min(8, ws)})"
        )
    elif ws % min(lws, ws):
        problems.append(
            f"topology.world_size {ws} is not a multiple of local_world_size {lws}; set "
            "local_world_size to the ranks per host (every host must have the same number)"
        )
    problems.extend(topology_problems(topology))
    if len(topology.devices) != ws:
        problems.append(
            f"topology has {len(topology.devices)} devices for world_size {ws}; build it with "
            "Topology(world_size=...) or TopologyFactory so there is one device per rank"
        )


def _check_tables(specs: Sequence[Any], compute_device: str, problems: List[str]) -> None:
    by_module: Dict[str, Dict[str, List[str]]] = {}
    for s in specs:
        where = f"table {s.fqn!r}"
        if s.num_embeddings <= 0:
            problems.append(f"{where}: num_embeddings must be positive, got {s.num_embeddings}")
        if s.embedding_dim <= 0:
            problems.append(f"{where}: embedding_dim must be positive, got {s.embedding_dim}")
        elif s.embedding_dim % FUSED_DIM_MULTIPLE:
            allowed = {k for _, ks in s.compute_kernels for k in ks}
            if allowed - {"dense"}:
                fused = [k for k in FUSED_KERNELS if k in allowed] or sorted(allowed - {"dense"})
                pad = s.embedding_dim + (-s.embedding_dim) % FUSED_DIM_MULTIPLE
                problems.append(
                    f"{where}: embedding_dim {s.embedding_dim} is not a multiple of "
                    f"{FUSED_DIM_MULTIPLE}, which FBGEMM's table-batched kernels ({', '.join(fused)}) "
                    f"need on {compute_device}; "
                    f"pad it to {pad}, or constrain the table to ParameterConstraints("
                    "sharding_types=['data_parallel'], compute_kernels=['dense'])"
                )
        features = by_module.setdefault(s.module_path, {})
        seen_here = set()
        for f in s.feature_names:
            if f in seen_here:
                problems.append(f"{where}: feature {f!r} is listed twice; list each feature once")
                continue
            seen_here.add(f)
            features.setdefault(f, []).append(s.name)
    for module_path, features in sorted(by_module.items()):
        for f, tables in sorted(features.items()):
            if len(tables) > 1:
                problems.append(
                    f"feature {f!r} is looked up by tables {sorted(tables)} of module "
                    f"{module_path or '<root>'!r}; a feature may feed one table per module: give "
                    "each table its own feature name (duplicate the ids under a new key in the KJT)"
                )


def _check_constraints(
    specs: Sequence[Any], constraints: Mapping[str, Any], problems: List[str],
    other_tables: Iterable[str] = (),
) -> None:
    by_name: Dict[str, List[Any]] = {}
    for s in specs:
        by_name.setdefault(s.name, []).append(s)
    unknown = sorted(set(constraints) - set(by_name) - set(other_tables))
    if unknown:
        known = sorted(set(by_name) | set(other_tables))
        problems.append(
            f"constraints name tables the model does not have: {unknown}; known tables: "
            f"{known[:20]}{' ...' if len(known) > 20 else ''} (constraints are keyed by table name)"
        )
    for name, c in sorted(constraints.items()):
        where = f"ParameterConstraints for table {name!r}"
        if _list_field_problems(where, c, problems):
            continue
        for st in c.sharding_types or ():
            if st not in KNOWN_SHARDING_TYPES:
                problems.append(
                    f"{where}: unknown sharding type {st!r}; choose from {list(KNOWN_SHARDING_TYPES)}"
                )
        for k in c.compute_kernels or ():
            if k not in KNOWN_COMPUTE_KERNELS:
                problems.append(
                    f"{where}: unknown compute kernel {k!r}; choose from {list(KNOWN_COMPUTE_KERNELS)}"
                )
        mp = c.min_partition
        if mp is not None:
            if not _is_int(mp) or mp <= 0:
                problems.append(f"{where}: min_partition must be a positive int, got {mp!r}")
            else:
                for s in by_name.get(name, ()):
                    if s.sharding_types and all(t in COLUMN_SPLIT_TYPES for t in s.sharding_types) \
                            and mp > s.embedding_dim:
                        problems.append(
                            f"{where}: min_partition {mp} is wider than the table "
                            f"(embedding_dim {s.embedding_dim}) and column-wise is its only allowed "
                            f"sharding; lower min_partition to at most {s.embedding_dim // 2} so "
                            "it can split, or allow 'table_wise'"
                        )
        for pf in c.pooling_factors or ():
            if isinstance(pf, bool) or not isinstance(pf, (int, float)) or not math.isfinite(pf) or pf < 0:
                problems.append(
                    f"{where}: pooling_factors must be finite numbers >= 0 (ids per sample), got {pf!r}"
                )
        for b in c.batch_sizes or ():
            if not _is_int(b) or b <= 0:
                problems.append(f"{where}: batch_sizes must be positive ints, got {b!r}")
        pfs = c.pooling_factors or ()
        for s in by_name.get(name, ()):
            n = len(s.feature_names)
            if len(pfs) > 1 and len(pfs) != n:
                problems.append(
                    f"{where}: {len(pfs)} pooling_factors {list(pfs)} for {n} feature(s) "
                    f"{list(s.feature_names)}; give one per feature, in the table's feature order "
                    f"(e.g. pooling_factors={[float(pfs[0])] * n})"
                )


#: ParameterConstraints fields that are lists (a string there would be read letter by letter)
_CONSTRAINT_LISTS = ("sharding_types", "compute_kernels", "pooling_factors", "batch_sizes",
                     "num_poolings")


def _list_field_problems(where: str, c: Any, problems: List[str]) -> bool:
    """Problems with a constraint's list fields given as a string or a scalar; True if any."""
    found = False
    if getattr(c, "pooling_factors", ()) is None:  # TorchRec's storage reservation reads it
        found = True
        problems.append(f"{where}: pooling_factors must be a list (ids per sample, one per "
                        "feature), got None; e.g. pooling_factors=[1.0] (TorchRec's default)")
    for field in _CONSTRAINT_LISTS:
        v = getattr(c, field, None)
        if v is None or isinstance(v, (list, tuple)):
            continue
        found = True
        example = {"sharding_types": "['table_wise']", "compute_kernels": "['fused']"}.get(field, "[1.0]")
        hint = f"[{v!r}]" if isinstance(v, (str, int, float)) and not isinstance(v, bool) else example
        problems.append(
            f"{where}: {field} must be a list, got {type(v).__name__} {v!r}; e.g. {field}={hint}"
        )
    return found


def _check_stats(specs: Sequence[Any], stats: Any, problems: List[str],
                 other_features: Iterable[str] = ()) -> None:
    known = {f for s in specs for f in s.feature_names} | set(other_features)
    unknown = sorted(f for f in stats if f not in known)
    if unknown:
        shown = sorted(known)[:20]
        problems.append(
            f"workload statistics describe features no table looks up: {unknown[:20]}"
            f"{' ...' if len(unknown) > 20 else ''}; known features: {shown}"
            f"{' ...' if len(known) > 20 else ''}. Drop them, e.g. WorkloadStats(tuple(stats[f] "
            "for f in stats if f in model_features)), or fix the feature names"
        )


def _fmt_bytes(n: float) -> str:
    """Bytes in GiB, or in MiB/KiB/B when GiB would print as 0.00."""
    for unit, size, least in (("GiB", 2**30, 0.01), ("MiB", 2**20, 1.0), ("KiB", 2**10, 1.0)):
        if n >= least * size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _cluster_bytes(topology: Any) -> float:
    if topology.compute_device == "cpu":
        return float(sum(d.storage.ddr for d in topology.devices))
    # GPU: weights can live in HBM, or in host memory through the UVM kernels.
    return float(sum(d.storage.hbm + d.storage.ddr for d in topology.devices))


def _check_total_memory(specs: Sequence[Any], topology: Any) -> None:
    # key-value (virtual) tables pin only their caches, never all rows of their id space
    need = float(sum(s.pinned_weight_bytes for s in specs))
    have = _cluster_bytes(topology)
    if need > have:
        biggest = sorted(specs, key=lambda s: (-s.pinned_weight_bytes, s.fqn))[:5]
        names = ", ".join(f"{s.fqn} ({_fmt_bytes(s.pinned_weight_bytes)})" for s in biggest)
        kind = "DDR" if topology.compute_device == "cpu" else "HBM + DDR"
        raise SparseLiftPlannerError(
            f"the tables' weights alone need {_fmt_bytes(need)} but the whole cluster has "
            f"{_fmt_bytes(have)} ({kind} over {topology.world_size} ranks); largest tables: "
            f"{names}. To fix: add ranks or memory, shrink the largest tables (fewer rows, "
            "smaller dims) or store them in a narrower data type (FP16)",
            kind="insufficient_storage",
        )


#: bytes of one id in a KJT (int64) and of one output element (fp32)
_ID_BYTES, _OUT_BYTES = 8, 4


def _step_buffer_bytes(s: Any) -> float:
    """The bytes one rank's batch of ``s`` needs in any plan: its ids and its lookup output."""
    ids = float(s.batch_size) * float(s.pooling_factor)
    out_rows = float(s.batch_size) * max(1, len(s.feature_names)) if s.is_pooled else ids
    return ids * _ID_BYTES + out_rows * s.embedding_dim * _OUT_BYTES


def _check_step_buffers(specs: Sequence[Any], topology: Any, batch_size: Any) -> None:
    """Refuse a batch size or pooling factors whose input/output buffers alone (one copy of one
    step's ids and lookup outputs on one rank, whatever the plan) exceed a rank's memory."""
    if not specs or not getattr(topology, "devices", None):
        return
    cpu = topology.compute_device == "cpu"
    per_rank = max(float(d.storage.ddr if cpu else d.storage.hbm) for d in topology.devices)
    need = {s.fqn: _step_buffer_bytes(s) for s in specs}
    total = sum(need.values())
    if total <= per_rank:
        return
    biggest = sorted(specs, key=lambda s: (-need[s.fqn], s.fqn))[:5]
    names = ", ".join(f"{s.fqn} ({s.pooling_factor:g} ids/sample x {s.batch_size} samples: "
                      f"{_fmt_bytes(need[s.fqn])})" for s in biggest)
    raise SparseLiftPlannerError(
        f"the input/output buffers of one step (ids and lookup outputs of batch_size {batch_size} "
        f"per rank) need {_fmt_bytes(total)} on a rank but a rank has {_fmt_bytes(per_rank)} of "
        f"{'DDR' if cpu else 'HBM'}, whatever the sharding; largest: {names}. To fix: lower "
        "batch_size (it is per rank) or the pooling factors (ParameterConstraints.pooling_factors "
        "or the workload statistics are ids per sample)",
        kind="insufficient_storage",
    )


def validate_inputs(
    module_tables: Iterable[Any],
    topology: Any,
    batch_size: int,
    constraints: Optional[Mapping[str, Any]] = None,
    stats: Any = None,
    problems: Optional[List[str]] = None,
) -> None:
    """Raise if the planning inputs are malformed or contradictory; return ``None`` if valid.

    Args:
        module_tables: the tables to plan, as ``TableSpec`` s or ``TableHandle`` s (what
            :func:`~torchrec_sparselift.semantics.tables.extract_tables` returns).
        topology: the TorchRec ``Topology`` planned for (capacities before any reservation).
        batch_size: per-rank batch size.
        constraints: TorchRec ``ParameterConstraints`` by table name, or ``None``.
        stats: :class:`~torchrec_sparselift.semantics.workload.WorkloadStats` (any mapping keyed
            by feature name), or ``None``.
        problems: problems found earlier, listed first: what
            :func:`~torchrec_sparselift.semantics.tables.extract_tables` collected (given a
            :class:`Problems`) about tables whose values it could not build.

    Raises ``ValueError`` listing every input problem (one line each, naming the table, feature
    or field and what to change); if there is none but the tables' weights exceed the whole
    cluster's memory, ``SparseLiftPlannerError`` with kind ``insufficient_storage``.
    Pure: reads its arguments, changes nothing.
    """
    specs = [_spec(t) for t in module_tables]
    earlier = problems
    problems = list(earlier or [])
    if not _is_int(batch_size) or batch_size <= 0:
        problems.append(f"batch_size must be a positive per-rank batch size (int), got {batch_size!r}")
    _check_topology(topology, problems)
    _check_tables(specs, topology.compute_device, problems)
    if constraints:
        _check_constraints(specs, constraints, problems, getattr(earlier, "tables", set()))
    if stats is not None:
        _check_stats(specs, stats, problems, getattr(earlier, "features", set()))
    raise_problems(problems)
    _check_step_buffers(specs, topology, batch_size)
    _check_total_memory(specs, topology)


# ----------------------------------------------------------------------------------------------
# problems, listed at once
# ----------------------------------------------------------------------------------------------


class Problems(List[str]):
    """Problems collected before they are raised together (:func:`raise_problems`).

    ``tables`` and ``features`` name what the model has, also the tables whose values could not
    be built, so later checks do not call them unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: Set[str] = set()
        self.features: Set[str] = set()


def raise_problems(problems: Sequence[str], what: str = "the planning input",
                   error: Callable[[str], Exception] = ValueError) -> None:
    """Raise one ``error`` (``ValueError``) listing every problem (nothing if there is none).
    The same problem of several tables is listed once, naming the tables."""
    if not problems:
        return
    problems = group_table_problems(problems)
    if len(problems) == 1:
        raise error(f"invalid {what.replace('the ', '', 1)}: {problems[0]}")
    raise error(f"{len(problems)} problems with {what}:\n  - " + "\n  - ".join(problems))


_TABLE_PROBLEM = re.compile(r"table ('(?:[^'\\]|\\.)*'): (.*)", re.DOTALL)


def group_table_problems(problems: Sequence[str], shown: int = 3) -> List[str]:
    """``problems`` with the same ``table 'x': ...`` problem of several tables merged into one
    (``tables 'a', 'b', 'c' and 23 more: ...``), in the order each first appears."""
    groups: Dict[str, List[str]] = {}
    for p in problems:
        m = _TABLE_PROBLEM.fullmatch(p)
        if m:
            groups.setdefault(m.group(2), []).append(m.group(1))
    out: List[str] = []
    done: Set[str] = set()
    for p in problems:
        m = _TABLE_PROBLEM.fullmatch(p)
        if not m or len(groups[m.group(2)]) == 1:
            out.append(p)
            continue
        rest = m.group(2)
        if rest in done:
            continue
        done.add(rest)
        names = groups[rest]
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        out.append(f"tables {', '.join(names[:shown])}{more} ({len(names)} tables): {rest}")
    return out


def table_value_problems(where: str, num_embeddings: Any, embedding_dim: Any,
                         pooling_factor: Any = 0.0, batch_size: Any = 1) -> List[str]:
    """What keeps a table's values from being a ``TableSpec`` (the checks ``TableSpec`` runs)."""
    out = []
    if not _is_int(num_embeddings) or num_embeddings <= 0:
        out.append(f"{where}: num_embeddings must be positive, got {num_embeddings!r}")
    if not _is_int(embedding_dim) or embedding_dim <= 0:
        out.append(f"{where}: embedding_dim must be positive, got {embedding_dim!r}")
    if not _is_number(pooling_factor) or not pooling_factor >= 0:
        out.append(f"{where}: pooling factor must be >= 0 (ids per sample), got {pooling_factor!r}")
    if not _is_int(batch_size) or batch_size <= 0:
        out.append(f"{where}: batch size must be positive, got {batch_size!r}")
    return out


# ----------------------------------------------------------------------------------------------
# settings: sizes, budgets, choices (the planner's arguments and the CLI's flags)
# ----------------------------------------------------------------------------------------------

#: rule -> (test, what the value must be)
_RULES = {
    "int>=1": (lambda v: _is_int(v) and v >= 1, "a whole number >= 1"),
    "int>=0": (lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    ">0": (lambda v: _is_number(v) and math.isfinite(v) and v > 0, "a number > 0"),
    ">=0": (lambda v: _is_number(v) and math.isfinite(v) and v >= 0, "a number >= 0"),
    "fraction": (lambda v: _is_number(v) and 0 <= v < 1, "a fraction in [0, 1)"),
}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def setting_problems(settings: Iterable[Tuple[str, Any, str, str]]) -> List[str]:
    """One line per setting that breaks its rule; ``None`` values (not given) are skipped.

    ``settings``: ``(name, value, rule, fix)`` with rule one of ``int>=1``, ``int>=0``, ``>0``,
    ``>=0``, ``fraction`` and ``fix`` an example of a valid setting (e.g. ``--world-size 8``).
    """
    out = []
    for name, value, rule, fix in settings:
        if value is None:
            continue
        ok, must = _RULES[rule]
        if not ok(value):
            out.append(f"{name} must be {must}, got {value!r}; e.g. {fix}")
    return out


def validate_settings(settings: Iterable[Tuple[str, Any, str, str]], what: str = "the settings") -> None:
    """:func:`setting_problems`, raised as one ``ValueError`` listing them all."""
    raise_problems(setting_problems(settings), what)


def planner_option_problems(
    *,
    topology: Any,
    batch_size: Any,
    timeout_seconds: Any,
    time_budget_s: Any,
    pipelines: Optional[Sequence[str]],
    known_pipelines: Sequence[str],
    stale_pipelines: Sequence[str],
    allow_staleness: bool,
    solver: Any,
    sharding_group_size: Any,
    sync_interval: Any,
    drift_tolerance: Any,
    reservation_percentage: Any,
    never_slower: Any = defaults.NEVER_SLOWER,
) -> List[str]:
    """Every problem with ``SparseLiftPlanner``'s own arguments (not the model's tables)."""
    problems = setting_problems([
        ("batch_size", batch_size, "int>=1", f"batch_size={defaults.BATCH_SIZE} (per rank)"),
        ("timeout_seconds", timeout_seconds, ">0", "timeout_seconds=30"),
        ("time_budget_s", time_budget_s, ">0", f"time_budget_s={defaults.TIME_BUDGET_S}"),
        ("sync_interval", sync_interval, "int>=1", "sync_interval=4 (steps)"),
        ("drift_tolerance", drift_tolerance, ">=0", f"drift_tolerance={defaults.DRIFT_TOLERANCE}"),
        ("heuristical_storage_reservation_percentage", reservation_percentage, "fraction",
         f"heuristical_storage_reservation_percentage={defaults.STORAGE_RESERVATION_PERCENTAGE}"),
    ])
    ws, lws = getattr(topology, "world_size", None), getattr(topology, "local_world_size", None)
    if _is_int(ws) and ws >= 1 and _is_int(lws) and lws >= 1 and ws % min(lws, ws):
        problems.append(
            f"topology world_size {ws} is not a multiple of local_world_size {lws}; set "
            "local_world_size to the ranks per host"
        )
    for p in pipelines if isinstance(pipelines, (list, tuple)) else ():
        if p not in known_pipelines:
            problems.append(f"unknown pipeline {p!r}; choose from {tuple(known_pipelines)}")
        elif p in stale_pipelines and not allow_staleness:
            problems.append(f"pipeline {p!r} trains on one-step-stale embeddings; pass "
                            "allow_staleness=True to allow it")
    if solver not in SOLVERS:
        problems.append(f"solver must be 'auto', 'heuristic' or 'milp', got {solver!r}")
    if not any(never_slower is c for c in defaults.NEVER_SLOWER_CHOICES if isinstance(c, bool)) and never_slower != "auto":
        problems.append(f"never_slower must be True, False or 'auto', got {never_slower!r}; e.g. "
                        f"never_slower={defaults.NEVER_SLOWER!r} (the default: the rule where the profile's error is measured)")
    g = sharding_group_size
    if g not in (None, "auto") and _is_int(ws) and ws >= 1:
        if not _is_int(g) or g < 1 or ws % g:
            problems.append(
                f"sharding_group_size must be None (1D), 'auto' or a divisor of the world size "
                f"{ws}, got {g!r}"
            )
        elif g < ws and _is_int(lws) and lws >= 1:
            L = min(lws, ws)
            if g % L and L % g:
                problems.append(
                    f"sharding_group_size {g} must be a multiple or a divisor of the ranks per "
                    f"host ({L}), so every group has whole hosts or fits in one"
                )
    return problems


def int_at_least(least: int, note: str = "", optional: bool = False) -> Any:
    """attrs validator: an int (not a bool) >= ``least``; ``None`` too when ``optional``; the error
    names the class and field (used by the plan values and the guard settings)."""

    def check(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name} must be {'None (1D) or ' if optional else ''}"
                f"an int >= {least}{note}, got {value!r}"
            )

    return check


# ----------------------------------------------------------------------------------------------
# argument types and shapes (before any value is built)
# ----------------------------------------------------------------------------------------------

#: Topology bandwidths and multipliers that must be finite and > 0 when set
_TOPOLOGY_RATES = ("hbm_mem_bw", "ddr_mem_bw", "intra_host_bw", "inter_host_bw", "bwd_compute_multiplier")


def _finite_number(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v)


def topology_problems(topology: Any) -> List[str]:
    """The topology's memory capacities (per device) and bandwidths: finite, not negative.

    A NaN or infinite ``hbm_cap``/``ddr_cap`` would otherwise fail deep inside TorchRec's storage
    reservation without naming the field."""
    out: List[str] = []
    bad: Dict[str, List[Any]] = {}
    for d in getattr(topology, "devices", None) or ():
        storage = getattr(d, "storage", None)
        for field, cap in (("hbm", "hbm_cap"), ("ddr", "ddr_cap")):
            v = getattr(storage, field, 0)
            if not _finite_number(v) or v < 0:
                bad.setdefault(cap, []).append(v)
    for cap, values in bad.items():
        out.append(
            f"topology {cap} must be a finite number of bytes >= 0 per device, got "
            f"{values[0]!r} on {len(values)} device(s); e.g. Topology(..., {cap}=80 * 1024**3)"
        )
    for field in _TOPOLOGY_RATES:
        v = getattr(topology, field, None)
        if v is not None and (not _finite_number(v) or v <= 0):
            out.append(f"topology {field} must be a finite number > 0, got {v!r}; leave it unset "
                       "for TorchRec's default")
    return out


def _type_name(v: Any) -> str:
    return type(v).__name__


def argument_problems(
    *,
    topology: Any,
    constraints: Any,
    hardware: Any,
    workload: Any,
    topology_type: type,
    constraint_type: type,
    profile_type: type,
    workload_type: type,
    pipelines: Any = None,
    callbacks: Any = None,
    stats: Any = None,
    storage_reservation: Any = None,
    cache_dir: Any = None,
    flags: Mapping[str, Any] = {},
    choices: Mapping[str, Tuple[Any, Sequence[Any]]] = {},
    required: Mapping[str, Tuple[Any, str]] = {},
) -> List[str]:
    """Every type or shape problem with ``SparseLiftPlanner``'s (or ``evaluate_sharding_plan``'s)
    arguments, one line each naming the argument and what it must be; ``None`` for an optional
    argument means not given. ``flags``: name -> value of the ``bool`` arguments;
    ``choices``: name -> (value, allowed values); ``required``: name -> (value, example) of the
    numbers that have a default but may not be ``None``; the ``*_type`` arguments are the documented
    classes (passed in: this module imports no other layer)."""
    out: List[str] = []
    if not isinstance(topology, topology_type):
        out.append(
            f"topology must be a torchrec Topology, got {_type_name(topology)}; e.g. "
            "Topology(world_size=2, local_world_size=2, compute_device='cuda')"
        )
    else:
        out.extend(topology_problems(topology))
    if constraints is not None:
        if not isinstance(constraints, Mapping):
            out.append(
                f"constraints must be a dict of table name -> ParameterConstraints, got "
                f"{_type_name(constraints)}; e.g. constraints={{'t0': "
                "ParameterConstraints(sharding_types=['table_wise'])}"
            )
        else:
            for name, c in constraints.items():
                if not isinstance(name, str):
                    out.append(f"constraints keys must be table names (str), got {name!r}")
                if not isinstance(c, constraint_type):
                    out.append(
                        f"constraints[{name!r}] must be a ParameterConstraints, got "
                        f"{_type_name(c)}; e.g. ParameterConstraints(sharding_types=['table_wise'])"
                    )
                else:
                    _list_field_problems(f"ParameterConstraints for table {name!r}", c, out)
    if hardware is not None and not isinstance(hardware, (str, profile_type)):
        fix = ("HardwareProfile.from_dict(...)" if isinstance(hardware, Mapping)
               else "a HardwareProfile")
        out.append(
            f"hardware must be a HardwareProfile, a preset name ('h100', 'h200', 'a100', "
            f"'cpu-gloo'), a profile JSON path or 'auto', got {_type_name(hardware)}; pass {fix}"
        )
    if workload is not None and not isinstance(workload, workload_type):
        fix = ("workload=declare({...}) for pooling factors by feature"
               if isinstance(workload, Mapping) else "workload=observe(batches) or declare(...)")
        out.append(
            f"workload must be WorkloadStats (torchrec_sparselift.semantics.workload), got "
            f"{_type_name(workload)}; pass {fix}"
        )
    if pipelines is not None:
        if isinstance(pipelines, str) or not isinstance(pipelines, (list, tuple)):
            out.append(f"pipelines must be a list of pipeline names, got {_type_name(pipelines)} "
                       f"{pipelines!r}; e.g. pipelines=['fused']")
        elif not pipelines:
            out.append("pipelines is empty: give at least one pipeline (e.g. pipelines=['fused']) "
                       "or leave it unset for the default")
    if callbacks is not None:
        if not isinstance(callbacks, (list, tuple)):
            out.append(f"callbacks must be a list of functions, got {_type_name(callbacks)}; e.g. "
                       "callbacks=[my_callback]")
        else:
            for i, cb in enumerate(callbacks):
                if not callable(cb):
                    out.append(f"callbacks[{i}] must be a function of the list of ShardingOptions, "
                               f"got {_type_name(cb)}")
    for i, s in enumerate(stats if isinstance(stats, list) else [] if stats is None else [stats]):
        if not callable(getattr(s, "log", None)):
            out.append(f"stats{f'[{i}]' if isinstance(stats, list) else ''} must be a TorchRec "
                       f"Stats (with log()), got {_type_name(s)}; e.g. stats=EmbeddingStats()")
    if storage_reservation is not None and not callable(getattr(storage_reservation, "reserve", None)):
        out.append(f"storage_reservation must be a TorchRec StorageReservation, got "
                   f"{_type_name(storage_reservation)}; e.g. HeuristicalStorageReservation(percentage=0.15)")
    if cache_dir is not None and not isinstance(cache_dir, (str, bytes)) and not hasattr(cache_dir, "__fspath__"):
        out.append(f"cache_dir must be a directory path, got {_type_name(cache_dir)}")
    for name, v in flags.items():
        if not isinstance(v, bool):
            out.append(f"{name} must be True or False, got {v!r}")
    for name, (v, example) in required.items():
        if v is None:
            out.append(f"{name} must be a number, got None; e.g. {example} (the default)")
    for name, (v, allowed) in choices.items():
        if not isinstance(v, str) or v not in allowed:
            out.append(f"{name} must be one of {', '.join(map(repr, allowed))}, got {v!r}")
    return out


def callback_problem(callback: Any, before: Sequence[Any], after: Any) -> Optional[str]:
    """What a ``callbacks`` entry did wrong with the sharding options (``None``: nothing).

    A callback must return the options it was given (changed or replaced), one per table."""
    name = getattr(callback, "__qualname__", None) or repr(callback)
    must = ("a callback must return the list of ShardingOptions it was given (changed in place "
            "or replaced), one per table")
    if not isinstance(after, (list, tuple)):
        return f"callback {name} returned {_type_name(after)} instead of a list of ShardingOptions; {must}"
    keys = []
    for o in after:
        if not (hasattr(o, "path") and hasattr(o, "name") and hasattr(o, "shards")):
            return f"callback {name} returned a {_type_name(o)} among the ShardingOptions; {must}"
        keys.append((o.path, o.name))
    want = [(o.path, o.name) for o in before]
    dropped = sorted(set(want) - set(keys))
    added = sorted(set(keys) - set(want))
    twice = sorted({k for k in keys if keys.count(k) > 1})
    what = []
    if dropped:
        what.append(f"dropped tables {[n for _, n in dropped]}")
    if added:
        what.append(f"added tables the model does not have {[n for _, n in added]}")
    if twice:
        what.append(f"listed tables twice {[n for _, n in twice]}")
    if what:
        return f"callback {name} {' and '.join(what)}; {must}"
    return None


# -- options that do not apply ---------------------------------------------------------------

_TWO_D = "sharding_group_size='auto' or a group size (a 2D plan)"
_TWO_D_FLAGS = "--sharding-group-size auto|N (a 2D plan)"
_ONE_D = "a 1D plan (sharding_group_size=None)"
_ONE_D_FLAGS = "a 1D plan (no --sharding-group-size)"


@attrs.frozen
class OptionNeed:
    """One row of :data:`OPTION_NEEDS`: ``option`` has no effect on the plan asked for unless
    ``needs`` holds; ``given_without(args)`` says, from every planner argument by name, that it was
    given where it does not apply. ``warn``: the documented default absorbs it (one warning)
    instead of an error."""

    option: str
    needs: str
    given_without: Any = attrs.field(eq=False)
    warn: bool = False
    #: ``needs`` in a command line's words, where they differ (the flag of the option it needs)
    needs_flags: Optional[str] = None


def _one_d(a: Mapping[str, Any]) -> bool:
    return a.get("sharding_group_size") is None


def _listed(a: Mapping[str, Any], name: str) -> Optional[Tuple[Any, ...]]:
    """Argument ``name`` as a tuple where it is a list or tuple (None otherwise: not given, or a
    value its own check refuses)."""
    v = a.get(name)
    return tuple(v) if isinstance(v, (list, tuple)) else None


def _stale_listed(a: Mapping[str, Any]) -> bool:
    return any(p in STALE_PIPELINES for p in a.get("pipelines") or ())


#: Which option needs which: the one rule the planner's arguments, the command line and the DLRM
#: example check (docs/troubleshooting.md has the same table).
OPTION_NEEDS: Tuple[OptionNeed, ...] = (
    OptionNeed("sync_interval", _TWO_D, lambda a: a.get("sync_interval") is not None and _one_d(a), needs_flags=_TWO_D_FLAGS),
    OptionNeed("max_sync_interval", _TWO_D, lambda a: a.get("max_sync_interval") is not None and _one_d(a), needs_flags=_TWO_D_FLAGS),
    OptionNeed("layout_2d", _TWO_D, lambda a: a.get("layout_2d", "auto") != "auto" and _one_d(a),
               needs_flags=_TWO_D_FLAGS),
    OptionNeed("strategy_2d", _TWO_D, lambda a: a.get("strategy_2d", "auto") != "auto" and _one_d(a),
               needs_flags=_TWO_D_FLAGS),
    OptionNeed("allow_fp8", "allow_lossy_comm=True (fp8 is a lossy precision)",
               lambda a: bool(a.get("allow_fp8")) and not a.get("allow_lossy_comm")),
    OptionNeed("estimator", "cost_model='torchrec' (TorchRec's estimators rate the plan only there)",
               lambda a: a.get("estimator") is not None and a.get("cost_model", "sparselift") != "torchrec"),
    OptionNeed("never_slower", "cost_model='sparselift' (the rule compares SparseLift's cost model's prices)",
               lambda a: a.get("never_slower") is True and a.get("cost_model", "sparselift") != "sparselift"),
    OptionNeed("model_errors", "the never-slower rule: never_slower='auto' or True with cost_model='sparselift'",
               lambda a: a.get("model_errors") is not None and (
                   a.get("never_slower", defaults.NEVER_SLOWER) is False
                   or a.get("cost_model", "sparselift") != "sparselift")),
    OptionNeed("drift_tolerance", "cache_dir=... (it decides when a cached plan is planned again)",
               lambda a: a.get("drift_tolerance", defaults.DRIFT_TOLERANCE) != defaults.DRIFT_TOLERANCE
               and not a.get("cache_dir")),
    OptionNeed("heuristical_storage_reservation_percentage",
               "storage_reservation=None (a storage reservation you pass keeps its own percentage)",
               lambda a: a.get("storage_reservation") is not None and a.get(
                   "heuristical_storage_reservation_percentage",
                   defaults.STORAGE_RESERVATION_PERCENTAGE) != defaults.STORAGE_RESERVATION_PERCENTAGE),
    OptionNeed("timeout_seconds", "no time_budget_s (time_budget_s is the search budget when both are given)",
               lambda a: bool(a.get("timeout_seconds")) and bool(a.get("time_budget_s"))
               and float(a["timeout_seconds"]) != float(a["time_budget_s"])),
    OptionNeed("rewrites", "a 1D plan (sharding_group_size=None) with cost_model='sparselift' (the rewrite stage "
               "prices 1D plans with SparseLift's model)",
               lambda a: bool(_listed(a, "rewrites")) and (
                   not _one_d(a) or a.get("cost_model", "sparselift") != "sparselift"),
               needs_flags="no --sharding-group-size, --cost-model sparselift"),
    OptionNeed("per_sample", "the batch split among the rewrites (rewrites=None or a list with 'batch_split') "
               "in a 1D plan", lambda a: a.get("per_sample") is True and (
                   not _one_d(a) or (_listed(a, "rewrites") is not None and "batch_split" not in _listed(a, "rewrites"))),
               needs_flags="the batch split among the rewrites in a 1D plan"),
    OptionNeed("allow_staleness", "pipelines=None or a list with a stale pipeline ("
               + ", ".join(STALE_PIPELINES) + ")",
               lambda a: bool(a.get("allow_staleness")) and a.get("pipelines") is not None and not _stale_listed(a)),
    # the sparse-path rewrites forced on a run (runtime.lift's keywords; the DLRM example's flags)
    OptionNeed("batch_split", f"pipeline={OVERLAP!r} (it splits that pipeline's all-to-alls) and {_ONE_D}",
               lambda a: (a.get("batch_split") or 1) > 1 and (a.get("pipeline") != OVERLAP or not _one_d(a)),
               needs_flags=f"--pipeline {OVERLAP} (it splits that pipeline's all-to-alls) and {_ONE_D_FLAGS}"),
    OptionNeed("id_dtype", _ONE_D, lambda a: a.get("id_dtype") not in (None, "int64") and not _one_d(a),
               needs_flags=_ONE_D_FLAGS),
    OptionNeed("dedup_features", _ONE_D, lambda a: bool(a.get("dedup_features")) and not _one_d(a),
               needs_flags=_ONE_D_FLAGS),
)


def option_problems(args: Mapping[str, Any], spell: Optional[Callable[[str], str]] = None
                    ) -> Tuple[List[str], List[str]]:
    """(errors, warnings) for the options in ``args`` (planner keyword arguments by name) that have
    no effect on the plan asked for (:data:`OPTION_NEEDS`); ``spell``: how a command line writes an
    option (its ``--flag``), so each message names what the user typed, and what it needs in flags."""
    errors: List[str] = []
    warned: List[str] = []
    for row in OPTION_NEEDS:
        if row.given_without(args):
            option = spell(row.option) if spell else row.option
            needs = row.needs_flags if spell and row.needs_flags else row.needs
            msg = f"{option} has no effect here: it needs {needs}; drop it or give what it needs"
            (warned if row.warn else errors).append(msg)
    return errors, warned
