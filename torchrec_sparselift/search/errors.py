"""Planner errors: TorchRec's ``PlannerError`` with a message that says what to change."""

from __future__ import annotations

from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

__all__ = ["SparseLiftPlannerError"]

_KINDS = {
    "insufficient_storage": PlannerErrorType.INSUFFICIENT_STORAGE,
    "strict_constraints": PlannerErrorType.STRICT_CONSTRAINTS,
    "partition": PlannerErrorType.PARTITION,
    "other": PlannerErrorType.OTHER,
}


class SparseLiftPlannerError(PlannerError):
    """Raised when no plan satisfies the constraints. A ``PlannerError`` subclass, so code that
    catches TorchRec's planner errors keeps working. ``kind`` is one of
    ``insufficient_storage``, ``strict_constraints``, ``partition``, ``other``."""

    def __init__(self, message: str, kind: str = "other") -> None:
        self.kind = kind
        super().__init__(message=message, error_type=_KINDS.get(kind, PlannerErrorType.OTHER))
