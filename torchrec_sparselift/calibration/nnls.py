"""The one non-negative least-squares solver every calibration fit uses.

The kernel microbenchmark fit (:mod:`.kernel_fit`), the step fit (:mod:`.step_fit`) and the host
microbenchmarks' slopes (:mod:`torchrec_sparselift.measure.microbench`) all solve

    minimize  sum_i w_i (a_i . x - b_i)^2   subject to  x >= 0

over quantities that span many orders of magnitude (bytes next to calls), so each column is scaled
to its largest magnitude before the solver sees it and the solution is scaled back.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

__all__ = ["nonnegative_least_squares"]


def nonnegative_least_squares(
    a: Sequence[Sequence[float]],
    b: Sequence[float],
    *,
    weights: Optional[Sequence[float]] = None,
    maxiter: Optional[int] = None,
) -> np.ndarray:
    """``x >= 0`` minimizing ``sum_i weights_i (a_i . x - b_i)^2`` (weights default to 1).

    Columns are scaled to their largest absolute value first (a column of zeros keeps scale 1
    and gets 0). ``maxiter``: the active-set solver's iteration limit (scipy's default when None).
    Raises ``ValueError`` for mismatched shapes or non-finite input.
    """
    from scipy.optimize import nnls

    A = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if A.ndim != 2 or y.ndim != 1 or A.shape[0] != y.shape[0] or A.shape[0] == 0:
        raise ValueError(f"nonnegative_least_squares needs an (n, k) matrix and n values, got {A.shape} and {y.shape}")
    if not (np.all(np.isfinite(A)) and np.all(np.isfinite(y))):
        raise ValueError("nonnegative_least_squares: the matrix and the values must be finite")
    if weights is not None:
        w = np.sqrt(np.asarray(weights, dtype=np.float64))
        if w.shape != y.shape or not np.all(np.isfinite(w)):
            raise ValueError(f"nonnegative_least_squares: need {y.shape[0]} finite non-negative weights")
        A, y = A * w[:, None], y * w
    scale = np.abs(A).max(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    x, _residual = nnls(A / scale, y, maxiter=maxiter)
    return x / scale
