"""Every rank plans the same request, and every rank gets rank 0's plan: the process-group side
of ``SparseLiftPlanner.collective_plan``.

- :func:`check_group_size`: the topology has one rank per member of the process group (checked on
  every rank before any collective, so every rank raises alike).
- :func:`agreed`: every rank builds its request; one all-gather compares their digests. An error
  on one rank is raised on every rank (instead of leaving the others waiting in a collective), and
  ranks that built different requests raise an error naming them.
- :func:`from_rank_0`: a value computed on rank 0 and broadcast; an error there is raised on every
  rank.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist
from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
from torchrec.distributed.planner.types import Topology

from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.plan.request import PlanRequest

__all__ = ["check_group_size", "agreed", "from_rank_0", "reraise_shared"]


def check_group_size(topology: Topology, pg: Any) -> None:
    """The topology must have one rank per member of the process group the plan is shared over."""
    size = dist.get_world_size(pg)
    if topology.world_size != size:
        raise ValueError(
            f"the topology has world_size {topology.world_size} but the process group has {size} ranks: a plan "
            f"for {topology.world_size} ranks cannot be applied by {size}. Build the topology with "
            f"Topology(world_size={size}, ...) (dist.get_world_size(pg)), or plan over the process group of "
            "the ranks the topology describes")


def _shared(e: Exception) -> Tuple[Any, ...]:
    return ("error", type(e).__name__, getattr(e, "kind", None), str(e))


def agreed(build: Callable[[], PlanRequest], pg: Any) -> PlanRequest:
    """``build()`` on every rank, checked to give the same request on all (:meth:`PlanRequest.digest`)."""
    local_error: Optional[Exception] = None
    request: Optional[PlanRequest] = None
    try:
        request = build()
        mine: Any = ("ok", request.digest())
    except Exception as e:  # noqa: BLE001 - every rank learns of it through the all_gather
        local_error, mine = e, _shared(e)
    entries: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(entries, mine, group=pg)
    failed = [r for r, e in enumerate(entries) if e[0] == "error"]
    if failed:
        reraise_shared(entries[failed[0]], local_error, f"rank(s) {failed} have invalid planning input")
    groups: Dict[str, List[int]] = {}
    for r, e in enumerate(entries):
        groups.setdefault(e[1], []).append(r)
    if len(groups) > 1:
        majority = max(groups.values(), key=len)
        differ = sorted(r for rs in groups.values() if rs is not majority for r in rs)
        raise SparseLiftPlannerError(
            f"ranks planned different inputs: ranks {differ} differ from ranks {majority} (tables, topology, "
            "batch size, constraints, workload statistics or planner options). Build the model and the "
            "planner identically on every rank.", kind="other")
    assert request is not None
    return request


def from_rank_0(compute: Callable[[], Any], pg: Any, who: str = "rank 0 could not plan") -> Any:
    """``compute()`` on rank 0, its (picklable) value broadcast to every rank of ``pg``."""
    local_error: List[Optional[Exception]] = [None]

    def on_rank_0() -> Tuple[Any, ...]:
        try:
            return ("ok", compute())
        except Exception as e:  # noqa: BLE001 - shared with every rank, re-raised below
            local_error[0] = e
            return _shared(e)

    out = invoke_on_rank_and_broadcast_result(pg, 0, on_rank_0)
    if out[0] == "error":
        reraise_shared(out, local_error[0], who)
    return out[1]


def reraise_shared(out: Any, local_error: Optional[Exception], who: str) -> None:
    """Raise, on every rank, the error one rank reported: the original object where it
    happened, the same kind and message elsewhere."""
    if local_error is not None:
        raise local_error
    _, name, kind, msg = out
    if name == "ValueError":
        raise ValueError(f"{who}: {msg}")
    raise SparseLiftPlannerError(f"{who}: {msg}" if kind else f"{who}: {name}: {msg}", kind=kind or "other")
