"""Pure numpy reference of row-wise AdaGrad under 2D replication (single process, R replicas).

Written row by row straight from the equations in docs/optimizer.md, independent of the
torch/distributed implementation in :mod:`torchrec_sparselift.optim.momentum_scaled`, which the
tests check against it. Everything is float64.

Shapes: weights ``[rows, dim]``, accumulators ``[rows]``, per-replica stacks ``[R, rows, ...]``.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

__all__ = [
    "rowwise_adagrad_step",
    "plain_average_merge",
    "momentum_scaled_merge",
    "interval_denominator",
]


def rowwise_adagrad_step(
    w: np.ndarray, a: np.ndarray, g: np.ndarray, lr: float, eps: float
) -> Tuple[np.ndarray, np.ndarray]:
    """One exact row-wise AdaGrad step (fbgemm EXACT_ROWWISE_ADAGRAD, no weight decay).

    ``a_i += mean_d(g_i^2)``; ``w_i -= lr * g_i / (sqrt(a_i) + eps)``. Rows with a zero gradient
    are unchanged. Returns new arrays.
    """
    w = np.array(w, dtype=np.float64, copy=True)
    a = np.array(a, dtype=np.float64, copy=True)
    g = np.asarray(g, dtype=np.float64)
    for i in range(w.shape[0]):
        if not np.any(g[i] != 0.0):
            continue
        a[i] = a[i] + np.mean(g[i] ** 2)
        w[i] = w[i] - lr * g[i] / (np.sqrt(a[i]) + eps)
    return w, a


def plain_average_merge(
    replica_w: np.ndarray, replica_a: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """TorchRec's ``DMPCollection.sync``: average weights and accumulators over the replicas."""
    return (
        np.mean(np.asarray(replica_w, dtype=np.float64), axis=0),
        np.mean(np.asarray(replica_a, dtype=np.float64), axis=0),
    )


def interval_denominator(a0: float, a1: float, steps: int, eps: float, preconditioner: str) -> float:
    """One row's AdaGrad denominator over an interval (docs/optimizer.md): ``sqrt(a1) + eps``
    ("end"), or the harmonic mean of ``sqrt(a_t) + eps`` along equal accumulator increments
    from ``a0`` to ``a1`` over ``steps`` steps ("interval")."""
    if preconditioner == "end" or steps == 1:
        return float(np.sqrt(a1) + eps)
    inc = (a1 - a0) / steps
    return steps / sum(1.0 / (np.sqrt(max(a0 + t * inc, 0.0)) + eps) for t in range(1, steps + 1))


def momentum_scaled_merge(
    anchor_w: np.ndarray,
    anchor_a: np.ndarray,
    replica_w: np.ndarray,
    replica_a: np.ndarray,
    momentum_buf: np.ndarray,
    lr: float,
    eps: float,
    sync_interval: int,
    momentum: float,
    preconditioner: str = "interval",
    grad_scale: float = 1.0,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The momentum-scaled row-wise AdaGrad merge (docs/optimizer.md), row by row.

    ``anchor_*`` is the merged state of the previous sync (identical on all replicas),
    ``replica_*`` each replica's local state now. Returns ``(w, a, momentum_buf)`` merged.
    For each row touched by at least one replica (k > 0)::

        G_r  = -(w_r - w0) * h(a0, a_r) / lr * c           pseudo-gradient of replica r
        S    = sum_r G_r
        Q    = sum_r mean(G_r^2)
        U    = c^2 sum_r (a_r - a0)
        dA   = max(U + (mean(S^2) - Q) / N,  mean(S^2) / N)
        a    = a0 + dA
        D    = -lr * S / h(a0, a)
        m    = momentum * m + D
        w    = w0 + m

    with ``h`` = :func:`interval_denominator` (``preconditioner``) and ``c`` = ``grad_scale`` (1 for
    gradients summed over a replica's ranks; ``1 / R`` under TorchRec's gradient division,
    :func:`~torchrec_sparselift.optim.momentum_scaled.local_payload`). Untouched rows (k = 0) keep
    anchor weights, accumulator and momentum buffer.
    """
    anchor_w = np.asarray(anchor_w, dtype=np.float64)
    anchor_a = np.asarray(anchor_a, dtype=np.float64)
    replica_w = np.asarray(replica_w, dtype=np.float64)
    replica_a = np.asarray(replica_a, dtype=np.float64)
    w = anchor_w.copy()
    a = anchor_a.copy()
    m = np.array(momentum_buf, dtype=np.float64, copy=True)
    num_replicas = replica_w.shape[0]
    for i in range(w.shape[0]):
        k = 0
        S = np.zeros(w.shape[1])
        Q = 0.0
        U = 0.0
        for r in range(num_replicas):
            dw = replica_w[r, i] - anchor_w[i]
            da = replica_a[r, i] - anchor_a[i]
            if da > 0.0 or np.any(dw != 0.0):
                k += 1
            h = interval_denominator(anchor_a[i], replica_a[r, i], sync_interval, eps, preconditioner)
            G = -dw * h / lr * grad_scale
            S += G
            Q += np.mean(G**2)
            U += da * grad_scale**2
        if k == 0:
            continue
        dA = max(U + (np.mean(S**2) - Q) / sync_interval, np.mean(S**2) / sync_interval)
        a[i] = anchor_a[i] + dA
        D = -lr * S / interval_denominator(anchor_a[i], a[i], sync_interval, eps, preconditioner)
        m[i] = momentum * m[i] + D
        w[i] = anchor_w[i] + m[i]
    return w, a, m
