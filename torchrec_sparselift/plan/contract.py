"""What callers of ``EmbeddingShardingPlanner`` rely on beyond the plan itself.

- Nothing to shard gives an empty plan: ``plan(module, sharders=[])``, or a module whose tables
  no given sharder shards, returns ``ShardingPlan({})`` (:func:`has_shardable_tables`).
- A no-plan error names the storage reservation it was planned under, with the amount it keeps
  per device (:func:`reservation_note`, :func:`with_reservation`), e.g.
  ``FixedAbsoluteStorageReservation: 0.5 GB per device``: the reservation is often why a model
  that "fits" does not.

The error *type* (``INSUFFICIENT_STORAGE`` vs ``STRICT_CONSTRAINTS``) is decided where the
no-plan error is built (:func:`torchrec_sparselift.search.problem.no_plan_kind`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.semantics.tables import extract_tables
from torchrec_sparselift.plan.request import describe_reservation

__all__ = ["has_shardable_tables", "last_reserved", "reservation_note", "with_reservation"]

_STORAGE_ERRORS = (PlannerErrorType.INSUFFICIENT_STORAGE, PlannerErrorType.STRICT_CONSTRAINTS)
_GB = 1024**3  # TorchRec's bytes_to_gb / gb_to_bytes unit


def has_shardable_tables(module: Any, sharders: Sequence[Any], compute_device: str,
                         batch_size: int) -> bool:
    """Whether any given sharder shards a table of ``module`` (constraints aside: with nothing
    to shard, constraints naming tables do not make the input invalid, as in TorchRec)."""
    if not sharders:
        return False
    return bool(extract_tables(module, sharders, compute_device, batch_size))


def _gb(n: float) -> str:
    return f"{round(n / _GB, 3)} GB"


def reservation_note(reservation: Any, topology: Any, reserved: Any = None) -> str:
    """One line naming ``reservation``: its type, what it keeps per device (from its
    configuration) and, when ``reserved`` (the topology ``reserve()`` returned) is known, what
    it left per device for embedding tables."""
    desc = describe_reservation(reservation)
    name = (desc.get("__type__") or "none").rsplit(".", 1)[-1]
    parts = []
    absolute = desc.get("_hbm_reserved_bytes")
    pct = desc.get("_percentage")
    if isinstance(absolute, (int, float)) and absolute:
        parts.append(f"{_gb(absolute)} per device")
    if isinstance(pct, (int, float)) and pct:
        parts.append(f"{pct * 100:g}% of each device's HBM")
    if "Heuristical" in name:
        parts.append("plus dense parameters x "
                     f"{desc.get('_parameter_multiplier', 6.0):g} and input (KJT) buffers")
    text = f"storage reservation {name}" + (f": {', '.join(parts)}" if parts else "")
    if reserved is not None and getattr(reserved, "devices", None) and topology.devices:
        before, after = topology.devices[0].storage, reserved.devices[0].storage
        text += (f"; per device {_gb(after.hbm)} HBM and {_gb(after.ddr)} DDR of {_gb(before.hbm)} / "
                 f"{_gb(before.ddr)} are left for embedding tables")
    return text


def with_reservation(error: Exception, note: str) -> Exception:
    """``error`` with ``note`` appended when it is a no-plan storage error (once); other errors
    are returned as they are."""
    if not isinstance(error, PlannerError) or getattr(error, "reservation_noted", False):
        return error
    if getattr(error, "error_type", None) not in _STORAGE_ERRORS:
        return error
    message = f"{error}\nPlanned under the {note}; a smaller reservation leaves more memory for tables."
    new: PlannerError
    if isinstance(error, SparseLiftPlannerError):
        new = SparseLiftPlannerError(message, kind=error.kind)
    else:
        new = PlannerError(message=message, error_type=error.error_type)
    new.reservation_noted = True  # type: ignore[attr-defined]
    return new


def last_reserved(reservation: Any) -> Optional[Any]:
    """The topology ``reservation.reserve()`` last returned (TorchRec's public
    ``last_reserved_topology``), or ``None``."""
    return getattr(reservation, "last_reserved_topology", None)
