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
``DistributedModelParallel``.

The context digest covers the planning inputs a stored plan depends on: the
:class:`~torchrec_sparselift.plan.request.PlanRequest` (tables, topology, batch size,
constraints, statistics, hardware, every planner option) without the library versions, plus the
storage reservation's configuration and the topology it reserved. Equal inputs give equal
digests in any process.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from torchrec.distributed.planner.types import (
    PlannerError,
    PlannerErrorType,
    Shard,
    ShardingOption,
)

from torchrec_sparselift.plan.execution_plan import canonical_digest, topology_description
from torchrec_sparselift.semantics.tables import TableHandle

__all__ = ["context_digest", "context_hash_int", "check_context", "loaded_options"]


def context_digest(request: Any, reserved_topology: Any = None) -> str:
    """sha256 hex of the planning context of ``request`` (a ``PlanRequest``) and the topology
    its storage reservation produced (``None`` before any reservation ran)."""
    fp = request.fingerprint()
    from torchrec_sparselift.plan.request import describe_reservation

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


def _check_shards(handle: TableHandle, so: ShardingOption, world_size: int) -> List[Shard]:
    spec = handle.spec
    rows, cols = spec.num_embeddings, spec.embedding_dim
    where = f"loaded plan, table {spec.fqn!r} ({so.sharding_type}/{so.compute_kernel})"
    if not so.shards:
        raise _failed(f"{where}: no shards")
    area = 0
    for s in so.shards:
        if len(s.size) != 2 or len(s.offset) != 2:
            raise _failed(f"{where}: shard size {s.size} / offset {s.offset} is not 2-D")
        (r, c), (r0, c0) = s.size, s.offset
        if r <= 0 or c <= 0 or r0 < 0 or c0 < 0 or r0 + r > rows or c0 + c > cols:
            raise _failed(f"{where}: shard {s.size} at {s.offset} lies outside the {rows} x {cols} table")
        if s.rank is None or not 0 <= int(s.rank) < world_size:
            raise _failed(f"{where}: shard at {s.offset} has rank {s.rank}, outside 0..{world_size - 1}")
        area += r * c
    if so.sharding_type == "data_parallel":
        if any(list(s.size) != [rows, cols] for s in so.shards):
            raise _failed(f"{where}: data-parallel shards must each hold the whole table")
    elif area != rows * cols:
        raise _failed(f"{where}: shards cover {area} of the table's {rows * cols} elements")
    return [Shard(size=list(s.size), offset=list(s.offset), storage=s.storage, perf=s.perf,
                  rank=int(s.rank)) for s in so.shards]


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

