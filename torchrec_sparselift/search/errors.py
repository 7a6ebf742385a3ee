"""Re-export of :class:`torchrec_sparselift.errors.SparseLiftPlannerError` (its old home), so
``from torchrec_sparselift.errors import SparseLiftPlannerError`` keeps working."""

from torchrec_sparselift.errors import SparseLiftPlannerError

__all__ = ["SparseLiftPlannerError"]
