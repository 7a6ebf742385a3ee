"""optim: the momentum-scaled row-wise AdaGrad replica merge for 2D sparse parallelism."""

from torchrec_sparselift.optim.momentum_scaled import (
    MergeStats,
    PRECONDITIONERS,
    MomentumScaledRowWiseAdagrad,
    finish_merge,
    interval_denominator,
    local_payload,
)

__all__ = [
    "MomentumScaledRowWiseAdagrad",
    "MergeStats",
    "local_payload",
    "finish_merge",
    "interval_denominator",
    "PRECONDITIONERS",
]
