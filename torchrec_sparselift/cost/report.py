"""Per-rank report of a priced plan: each rank's compute and communication seconds (exposed and
overlapped under the plan's step time) and memory. Pure functions of the cost model's numbers."""

from __future__ import annotations

from typing import Dict, List, Protocol, Sequence

import numpy as np

from torchrec_sparselift.cost.model import DEV_MEM, HOST_MEM, CostContext, StepTime, rank_times

__all__ = ["PricedPlacement", "rank_breakdown", "ranks_repr"]


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
