"""Every error SparseLift raises on purpose, in one place. Each message says what to change.

- :class:`SparseLiftPlannerError`: no plan satisfies the constraints (a TorchRec ``PlannerError``).
- :class:`FileFormatError`: a file the package reads is missing, unreadable or malformed (it
  names the file and the field, :mod:`torchrec_sparselift.files`).
- :class:`PlanFormatError`: a serialized execution plan cannot be read.
- :class:`CalibrationError`: measurements cannot determine a hardware-profile parameter.
- :class:`CliError`: a problem with the command line's input (exit code 2).

Malformed planning input (shapes, sizes, budgets, constraints) is a plain ``ValueError`` listing
every problem at once (:mod:`torchrec_sparselift.validation`).

This module sits below every layer, so any of them may import it. It needs TorchRec only for
``PlannerError``; without TorchRec (the cost layer works on torch alone) that base is a plain
``Exception``.
"""

from __future__ import annotations

from typing import Any, Dict

try:
    from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

    _KINDS: Dict[str, Any] = {
        "insufficient_storage": PlannerErrorType.INSUFFICIENT_STORAGE,
        "strict_constraints": PlannerErrorType.STRICT_CONSTRAINTS,
        "partition": PlannerErrorType.PARTITION,
        "other": PlannerErrorType.OTHER,
    }
except ImportError:  # pragma: no cover - torch without torchrec
    _KINDS = {}

    class PlannerError(Exception):  # type: ignore[no-redef]
        def __init__(self, message: str, error_type: Any = None) -> None:
            self.error_type = error_type
            super().__init__(message)


__all__ = ["SparseLiftPlannerError", "FileFormatError", "PlanFormatError", "CalibrationError", "CliError"]


class SparseLiftPlannerError(PlannerError):
    """Raised when no plan satisfies the constraints. A ``PlannerError`` subclass, so code that
    catches TorchRec's planner errors keeps working. ``kind`` is one of
    ``insufficient_storage``, ``strict_constraints``, ``partition``, ``other``."""

    def __init__(self, message: str, kind: str = "other") -> None:
        self.kind = kind
        super().__init__(message=message, error_type=_KINDS.get(kind, _KINDS.get("other")))


class FileFormatError(ValueError):
    """A file cannot be used: missing, unreadable, not UTF-8, not valid JSON/YAML, a duplicate
    key, or a field of the wrong type or range. One line naming the file, the field path
    (``tables[3].rows``) and the fix. ``path`` is the file (``None`` for in-memory data)."""

    def __init__(self, message: str, path: "str | None" = None) -> None:
        self.path = path
        super().__init__(message)


class PlanFormatError(FileFormatError):
    """A serialized execution plan cannot be read (malformed, truncated, or another schema)."""


class CalibrationError(ValueError):
    """The records cannot determine a parameter; the message says what to measure instead."""


class CliError(Exception):
    """A problem with the user's input; the message says what to change. Exit code 2."""

    exit_code = 2
