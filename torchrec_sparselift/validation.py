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
* :class:`~torchrec_sparselift.search.errors.SparseLiftPlannerError` (a TorchRec
  ``PlannerError``, kind ``insufficient_storage``) when the tables' weights alone exceed the
  memory of the whole cluster, so no plan can exist. (A single table too big for any one rank is
  reported by the planner's search, which knows each option's footprint.)

Some of these are also refused elsewhere (``SparseLiftPlanner.__init__`` rejects a batch size of 0,
:func:`~torchrec_sparselift.semantics.tables.extract_tables` rejects constraints for unknown tables
and constraints that leave no sharding type or kernel, ``TableSpec`` rejects non-positive shapes);
repeating the cheap checks here keeps this function a complete statement of what valid input is.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "validate_inputs",
    "FUSED_DIM_MULTIPLE",
    "FUSED_KERNELS",
    "KNOWN_SHARDING_TYPES",
    "KNOWN_COMPUTE_KERNELS",
]

#: FBGEMM's training TBE (``SplitTableBatchedEmbeddingBagsCodegen``) asserts that every embedding
#: dim is a multiple of 4, on CUDA *and* on CPU (measured with fbgemm-gpu-cpu 1.8.0). The dense
#: kernel (data-parallel tables) takes any dim.
FUSED_DIM_MULTIPLE = 4
#: Kernels backed by the TBE that needs ``embedding_dim % FUSED_DIM_MULTIPLE == 0``.
FUSED_KERNELS: Tuple[str, ...] = ("fused", "fused_uvm", "fused_uvm_caching")

_COLUMN_TYPES = ("column_wise", "table_column_wise")


def _enum_values(path: str, name: str) -> Tuple[str, ...]:
    import importlib

    return tuple(m.value for m in getattr(importlib.import_module(path), name))


KNOWN_SHARDING_TYPES: Tuple[str, ...] = _enum_values("torchrec.distributed.types", "ShardingType")
KNOWN_COMPUTE_KERNELS: Tuple[str, ...] = _enum_values(
    "torchrec.distributed.embedding_types", "EmbeddingComputeKernel"
)


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
    specs: Sequence[Any], constraints: Mapping[str, Any], problems: List[str]
) -> None:
    by_name: Dict[str, List[Any]] = {}
    for s in specs:
        by_name.setdefault(s.name, []).append(s)
    unknown = sorted(set(constraints) - set(by_name))
    if unknown:
        known = sorted(by_name)
        problems.append(
            f"constraints name tables the model does not have: {unknown}; known tables: "
            f"{known[:20]}{' ...' if len(known) > 20 else ''} (constraints are keyed by table name)"
        )
    for name, c in sorted(constraints.items()):
        where = f"ParameterConstraints for table {name!r}"
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
                    if s.sharding_types and all(t in _COLUMN_TYPES for t in s.sharding_types) \
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


def _check_stats(specs: Sequence[Any], stats: Any, problems: List[str]) -> None:
    known = {f for s in specs for f in s.feature_names}
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
    from torchrec_sparselift.search.errors import SparseLiftPlannerError

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


def validate_inputs(
    module_tables: Iterable[Any],
    topology: Any,
    batch_size: int,
    constraints: Optional[Mapping[str, Any]] = None,
    stats: Any = None,
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

    Raises ``ValueError`` listing every input problem (one line each, naming the table, feature
    or field and what to change); if there is none but the tables' weights exceed the whole
    cluster's memory, ``SparseLiftPlannerError`` with kind ``insufficient_storage``.
    Pure: reads its arguments, changes nothing.
    """
    specs = [_spec(t) for t in module_tables]
    problems: List[str] = []
    if not _is_int(batch_size) or batch_size <= 0:
        problems.append(f"batch_size must be a positive per-rank batch size (int), got {batch_size!r}")
    _check_topology(topology, problems)
    _check_tables(specs, topology.compute_device, problems)
    if constraints:
        _check_constraints(specs, constraints, problems)
    if stats is not None:
        _check_stats(specs, stats, problems)
    if problems:
        if len(problems) == 1:
            raise ValueError(f"invalid planning input: {problems[0]}")
        raise ValueError(
            f"{len(problems)} problems with the planning input:\n  - " + "\n  - ".join(problems)
        )
    _check_total_memory(specs, topology)
