"""Per-rank report of a priced plan: each rank's compute and communication seconds (exposed and
overlapped under the plan's step time) and memory. Pure functions of the cost model's numbers."""

from __future__ import annotations

import math
from typing import Dict, List, Protocol, Sequence

import numpy as np

from torchrec_sparselift.cost.model import DEV_MEM, HOST_MEM, CostContext, StepTime, rank_times

__all__ = ["PricedPlacement", "mape", "rank_breakdown", "ranks_repr", "spearman"]


class PricedPlacement(Protocol):
    """What the report reads of a placement (e.g. a ``search.solve.SearchResult``)."""

    rank_loads: np.ndarray
    step: StepTime
    fwd_precision: str
    bwd_precision: str


def rank_breakdown(ctx: CostContext, search: PricedPlacement) -> List[Dict[str, float]]:
    """Each rank's compute and communication seconds, and memory, under the plan's pipeline."""
    L = search.rank_loads
    computes, comms = rank_times(L, ctx, search.fwd_precision, search.bwd_precision)
    out = []
    step = search.step.total_s
    for r in range(L.shape[0]):
        compute, comm = float(computes[r]), float(comms[r])
        exposed = float(min(comm, max(0.0, step - compute)))
        out.append({
            "compute_s": compute,
            "comm_s": comm,
            "exposed_comm_s": exposed,
            "overlapped_comm_s": float(comm - exposed),
            "device_bytes": float(L[r, DEV_MEM]),
            "host_bytes": float(L[r, HOST_MEM]),
        })
    return out


def ranks_repr(ranks: Sequence[int]) -> str:
    """Ranks for a one-line summary: ``0..7`` for a run of more than four, else ``0,2,5``."""
    r = list(ranks)
    if len(r) > 4 and r == list(range(r[0], r[0] + len(r))):
        return f"{r[0]}..{r[-1]}"
    return ",".join(map(str, r))


# -- prediction accuracy (fidelity and real-run benchmarks, calibration reports) ------------

def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error of ``predicted`` against ``measured`` (a fraction: 0.1 = 10%)."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError(f"need equally many predictions and measurements, got {len(predicted)} and {len(measured)}")
    if any(m <= 0 for m in measured):
        raise ValueError("measured times must be > 0")
    return sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured)


def _ranks(xs: Sequence[float]) -> List[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2.0 + 1.0  # ties share the mean rank
        i = j + 1
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation of ``a`` and ``b`` (Pearson correlation of their ranks, ties
    averaged); nan when either is constant."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two equally long sequences of >= 2 values, got {len(a)} and {len(b)}")
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return float("nan")
    return cov / math.sqrt(va * vb)
