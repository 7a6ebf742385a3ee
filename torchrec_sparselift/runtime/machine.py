"""The machine a job's ranks run on: how many of them share one machine's CPU cores.

On CPU a pipeline that overlaps communication with compute needs a core for gloo's threads
beside each rank's compute; the planner asks :func:`machine_share` before offering such a
pipeline (``SparseLiftPlanner.collective_plan``). Emulated hosts (the testbed's network
namespaces) share one machine and its cores, and are counted as one machine here.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, List, Tuple

__all__ = ["machine_share"]


def machine_share(pg: Any = None) -> Tuple[int, int]:
    """``(ranks, cores)``: the most ranks of ``pg`` (default: the world) on one machine (same
    ``socket.gethostname()``) and the fewest CPU cores (``os.cpu_count()``) any of its ranks
    reports. Every rank of ``pg`` must call it (one all-gather); every rank gets the same answer."""
    import torch.distributed as dist

    mine = (socket.gethostname(), int(os.cpu_count() or 1))
    everyone: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, mine, group=pg)
    per_machine: Dict[str, int] = {}
    for name, _cores in everyone:
        per_machine[name] = per_machine.get(name, 0) + 1
    return max(per_machine.values()), min(c for _n, c in everyone)
