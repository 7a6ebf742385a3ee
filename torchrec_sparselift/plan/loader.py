"""TorchRec's ``PlanLoader`` contract: a stored plan, checked against the planner's context.

``EmbeddingShardingPlanner(plan_loader=...)`` asks the loader for a plan context hash and a map of
sharding options; when the hash differs from the planner's own
(:func:`context_digest`, what ``hash_planner_context_inputs_str()`` returns) planning stops with
``PlannerErrorType.PLANNER_INPUT_CONTEXT_MISMATCH``; when the loader returns options they are
used instead of searching. :func:`check_context` and :func:`loaded_options` do that for
``SparseLiftPlanner``, and validate the loaded options against the model (every table placed
once, with a sharding type and kernel its sharder and constraints allow, shards that tile the
table, ranks inside the world): a loaded plan that does not fit the model raises
``PlannerErrorType.PLAN_LOADING_FAILED`` naming the table, instead of reaching
``DistributedModelParallel``. :func:`stored_plan_problem` applies the same checks to a cached
``ExecutionPlan`` before the plan cache reuses it.

The context digest covers the planning inputs a stored plan depends on: the
:class:`~torchrec_sparselift.plan.request.PlanRequest` (tables, topology, batch size,
constraints, statistics, hardware, every planner option) without the library versions, plus the
storage reservation's configuration and the topology it reserved. Equal inputs give equal
digests in any process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from torchrec.distributed.planner.types import (
    PlannerError,
    PlannerErrorType,
    Shard,
    ShardingOption,
)

from torchrec_sparselift.files import canonical_digest
from torchrec_sparselift.plan.execution_plan import topology_description
from torchrec_sparselift.semantics.tables import TableHandle
from torchrec_sparselift.plan.request import describe_reservation
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["context_digest", "context_hash_int", "check_context", "loaded_options", "stored_plan_problem",
           "tiling_problem"]


def context_digest(request: Any, reserved_topology: Any = None) -> str:
    """sha256 hex of the planning context of ``request`` (a ``PlanRequest``) and the topology
    its storage reservation produced (``None`` before any reservation ran)."""
    fp = request.fingerprint()

    return canonical_digest({
        "tables": fp.tables_digest,
        "topology": fp.topology_digest,
        "batch_size": fp.batch_size,
        "constraints": fp.constraints_digest,
        "stats": fp.stats_digest,
        "hardware": fp.hardware_digest,
        "options": fp.options_digest,
        "reservation": describe_reservation(request.storage_reservation),
        "reserved_topology": None if reserved_topology is None else topology_description(reserved_topology),
    })


def context_hash_int(digest: str) -> int:
    """The digest as a non-negative 63-bit int (what ``hash_planner_context_inputs()`` returns)."""
    return int(digest[:16], 16) & (2**63 - 1)


def check_context(plan_loader: Any, current: str) -> None:
    """Raise ``PLANNER_INPUT_CONTEXT_MISMATCH`` when the loader's plan was made for another
    context (a loader that reports no hash is not checked, as in TorchRec)."""
    stored = plan_loader.plan_context_hash()
    if stored is not None and stored != current:
        plan_id = _plan_id(plan_loader)
        raise PlannerError(
            error_type=PlannerErrorType.PLANNER_INPUT_CONTEXT_MISMATCH,
            message=(
                "Unable to load the stored plan because of a planner input mismatch: plan "
                f"{plan_id!r} was made for planner context {stored}, this planner's context is "
                f"{current}. The tables, topology, batch size, constraints, storage reservation "
                "or planner options changed since it was stored; re-plan (drop plan_loader) and "
                "store the new plan."
            ),
        )


def _plan_id(plan_loader: Any) -> Optional[str]:
    get = getattr(plan_loader, "get_plan_id", None)
    return get() if callable(get) else None


def _failed(message: str) -> PlannerError:
    return PlannerError(error_type=PlannerErrorType.PLAN_LOADING_FAILED, message=message)


def tiling_problem(shards: Sequence[Tuple[Sequence[int], Sequence[int], Any]], rows: int, cols: int,
                   world_size: int, whole_each: bool = False) -> Optional[str]:
    """Why ``shards`` (``(size, offset, rank)`` each) do not place a ``rows x cols`` table on
    ranks ``0..world_size-1``, or ``None``. Without ``whole_each`` the shards must tile the table
    exactly (inside it, no overlap, no gap; empty shards, which row-wise plans give ranks beyond
    the rows, are allowed); with it (data parallel) each shard must be the whole table."""
    if not shards:
        return "no shards"
    boxes: List[Tuple[int, int, int, int]] = []
    for size, offset, rank in shards:
        if len(size) != 2 or len(offset) != 2:
            return f"shard size {list(size)} / offset {list(offset)} is not 2-D"
        (r, c), (r0, c0) = size, offset
        if r < 0 or c < 0 or r0 < 0 or c0 < 0 or r0 + r > rows or c0 + c > cols:
            return f"shard {list(size)} at {list(offset)} lies outside the {rows} x {cols} table"
        if rank is None or not 0 <= int(rank) < world_size:
            return f"shard at {list(offset)} has rank {rank}, outside 0..{world_size - 1}"
        if whole_each and [r, c] != [rows, cols]:
            return "data-parallel shards must each hold the whole table"
        if r and c:
            boxes.append((r0, r0 + r, c0, c0 + c))
    if whole_each:
        return None
    area = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in boxes)
    if area != rows * cols:
        return f"shards cover {area} of the table's {rows * cols} elements"
    # Equal area and no overlap is an exact tiling; find overlaps on the grid the shard edges cut.
    row_cuts = sorted({b[0] for b in boxes} | {b[1] for b in boxes})
    col_cuts = sorted({b[2] for b in boxes} | {b[3] for b in boxes})
    ri = {v: i for i, v in enumerate(row_cuts)}
    ci = {v: i for i, v in enumerate(col_cuts)}
    taken = set()
    for r0, r1, c0, c1 in boxes:
        for i in range(ri[r0], ri[r1]):
            for j in range(ci[c0], ci[c1]):
                if (i, j) in taken:
                    return f"shards overlap at row {row_cuts[i]}, column {col_cuts[j]}"
                taken.add((i, j))
    return None


def _check_shards(handle: TableHandle, so: ShardingOption, world_size: int) -> List[Shard]:
    spec = handle.spec
    where = f"loaded plan, table {spec.fqn!r} ({so.sharding_type}/{so.compute_kernel})"
    problem = tiling_problem([(s.size, s.offset, s.rank) for s in so.shards or ()], spec.num_embeddings,
                             spec.embedding_dim, world_size, whole_each=so.sharding_type == DATA_PARALLEL)
    if problem is not None:
        raise _failed(f"{where}: {problem}")
    return [Shard(size=list(s.size), offset=list(s.offset), storage=s.storage, perf=s.perf,
                  rank=int(s.rank)) for s in so.shards]


def stored_plan_problem(request: Any, plan: Any) -> Optional[str]:
    """Why the stored ``plan`` (an ``ExecutionPlan``) must not be reused for ``request`` (a
    ``PlanRequest``) beyond what :meth:`PlanRequest.refuses` checks, or ``None``: for every table
    of the request, a sharding type and compute kernel its sharders and constraints allow
    (``TableSpec.sharding_types`` / ``kernels_for``), shards that tile its rows and columns
    exactly, and ranks (in ``ranks`` and in the shard placements) inside the world, or inside the
    sharding group of a 2D plan. A plan edited, corrupted or made under other constraints is
    refused naming the table."""
    world = plan.optimizations.sharding_group_size or request.world_size
    specs = {(t.module_path, t.name): t for t in request.tables}
    for path, module_plan in plan.sharding_plan.plan.items():
        if not isinstance(module_plan, dict):
            continue
        for name, ps in module_plan.items():
            spec = specs.get((path, name))
            if spec is None:
                continue  # refuses() names tables the request does not have
            fqn = f"{path}.{name}" if path else name
            st, kernel = ps.sharding_type, ps.compute_kernel
            if st not in spec.sharding_types:
                return (f"table {fqn!r} is sharded {st}, which its sharders and constraints do not allow "
                        f"(allowed: {list(spec.sharding_types)})")
            if kernel not in spec.kernels_for(st):
                return (f"table {fqn!r} uses compute kernel {kernel!r} with {st}, which its sharders and "
                        f"constraints do not allow (allowed: {list(spec.kernels_for(st))})")
            ranks = list(ps.ranks or ())
            if not ranks or any(not 0 <= r < world for r in ranks):
                return f"table {fqn!r} is placed on ranks {ranks}, outside 0..{world - 1}"
            shards = getattr(ps.sharding_spec, "shards", None)
            if shards is None:
                if st != DATA_PARALLEL:
                    return f"table {fqn!r} ({st}) has no shards"
                continue
            placed = []
            for s in shards:
                placement = s.placement
                placed.append((s.shard_sizes, s.shard_offsets, None if placement is None else placement.rank()))
            problem = tiling_problem(placed, spec.num_embeddings, spec.embedding_dim, world,
                                     whole_each=st == DATA_PARALLEL)
            if problem is not None:
                return f"table {fqn!r} ({st}): {problem}"
            if sorted(set(ranks)) != sorted({p[2] for p in placed}):
                return (f"table {fqn!r} lists ranks {ranks} but its shards are placed on "
                        f"{sorted({p[2] for p in placed})}")
    return None


def loaded_options(
    loaded: Optional[Mapping[int, ShardingOption]],
    handles: Sequence[TableHandle],
    world_size: int,
) -> Optional[List[ShardingOption]]:
    """The loader's options rebuilt on this model's tables (tensor, module, constraints from the
    model; sharding type, kernel and shards from the loaded plan), in table order; ``None`` when
    the loader has no plan (``None`` or empty: the planner then searches as usual).

    Raises ``PLAN_LOADING_FAILED`` when the loaded plan names a table the model lacks, places a
    table twice or not at all, uses a sharding type or kernel the table does not allow, or has
    shards that do not tile the table or lie on ranks outside the world.
    """
    if not loaded:
        return None
    by_fqn: Dict[str, TableHandle] = {h.spec.fqn: h for h in handles}
    chosen: Dict[str, ShardingOption] = {}
    for so in loaded.values():
        path = so.module[0] if so.module is not None else ""
        fqn = f"{path}.{so.name}" if path else so.name
        if fqn not in by_fqn:
            raise _failed(
                f"loaded plan places table {fqn!r}, which the model does not have (model tables: "
                f"{sorted(by_fqn)[:20]}); the stored plan belongs to another model"
            )
        if fqn in chosen:
            raise _failed(f"loaded plan places table {fqn!r} twice")
        chosen[fqn] = so
    missing = sorted(set(by_fqn) - set(chosen))
    if missing:
        raise _failed(f"loaded plan does not place tables {missing[:20]} of the model; re-plan")
    out: List[ShardingOption] = []
    for h in handles:
        so = chosen[h.spec.fqn]
        allowed = h.spec.kernels_for(so.sharding_type)
        if so.compute_kernel not in allowed:
            raise _failed(
                f"loaded plan shards table {h.spec.fqn!r} as {so.sharding_type}/{so.compute_kernel}, "
                f"which its sharder and constraints do not allow here (allowed: "
                f"{ {st: list(ks) for st, ks in h.spec.compute_kernels} })"
            )
        shards = _check_shards(h, so, world_size)
        c = h.constraints
        out.append(ShardingOption(
            name=h.spec.name,
            tensor=h.tensor,
            module=h.module,
            input_lengths=list(so.input_lengths),
            batch_size=h.spec.batch_size,
            compute_kernel=so.compute_kernel,
            sharding_type=so.sharding_type,
            partition_by=so.partition_by,
            shards=shards,
            cache_params=getattr(c, "cache_params", None),
            enforce_hbm=getattr(c, "enforce_hbm", None),
            stochastic_rounding=getattr(c, "stochastic_rounding", None),
            bounds_check_mode=getattr(c, "bounds_check_mode", None),
            is_pooled=h.spec.is_pooled,
            feature_names=list(h.spec.feature_names),
            output_dtype=getattr(c, "output_dtype", None),
            key_value_params=getattr(c, "key_value_params", None),
        ))
    return out

