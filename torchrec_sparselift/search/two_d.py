"""The 2D search: which sharding-group size and rank layout to plan, and what one group sees.

2D sparse parallelism shards the tables over a sharding group of ``G`` ranks and replicates the
group ``W / G`` times (the full world, ``G = W``, is 1D). For each group size worth trying
(:func:`~torchrec_sparselift.cost.two_d.group_sizes`, or the one the user pinned) and each rank
layout worth pricing (:func:`~torchrec_sparselift.semantics.layout.layouts_to_price`), the planner
solves the tables on the group-local topology (:func:`group_topology`); :func:`search_groups`
splits the time budget over those tries, keeps the fastest (ties: the larger group), records
every try's step time, and polishes the winner with the budget left. A group plan's replica
sync (:func:`replica_sync`) is priced by :mod:`torchrec_sparselift.cost.two_d` from the state
bytes each rank holds, under each 2D strategy the device runs (:func:`strategies_to_price`,
:func:`choose_replica_sync`: ``default``'s periodic sync at its interval against
``fully_sharded``'s per-step reduce-scatter and all-gather; the faster wins, ``default`` on ties).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import attrs
from torchrec.distributed.planner.types import PlannerError, Topology

from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.cost.model import phase_constants
from torchrec_sparselift.cost.two_d import (
    SYNC_PIPELINES_2D,
    TwoDMemory,
    amortised_sync,
    fully_sharded_s,
    group_sizes,
    replica_sync_bytes,
    replica_sync_s,
    two_d_memory,
)
from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.semantics.layout import Layout2D, layouts_to_price
from torchrec_sparselift.vocabulary import STRATEGIES_2D, STRATEGY_2D_CHOICES, strategy_2d

__all__ = [
    "GroupChoice",
    "group_topology",
    "group_setting",
    "group_tries",
    "sync_pipelines",
    "placed_shards",
    "replica_sync",
    "ReplicaSyncChoice",
    "strategies_to_price",
    "choose_replica_sync",
    "search_groups",
]

#: one try of the 2D search: (group size, layout; ``None`` for the whole world, 1D)
GroupTry = Tuple[int, Optional[Layout2D]]


def group_topology(topology: Topology, group_size: int, ranks_per_host: Optional[int] = None) -> Topology:
    """The TorchRec ``Topology`` one sharding group sees: ``group_size`` ranks with the same
    devices, ``ranks_per_host`` of them per host (default: a contiguous group,
    ``min(ranks per host, group_size)``)."""
    dev = topology.devices[0].storage
    local = min(topology.local_world_size, group_size) if ranks_per_host is None else ranks_per_host
    kw = dict(world_size=group_size, local_world_size=local,
              compute_device=topology.compute_device, ddr_cap=dev.ddr)
    if topology.compute_device != "cpu":
        kw["hbm_cap"] = dev.hbm
    return Topology(**kw)


def group_setting(topology: Topology, group_size: int, layout: Optional[Layout2D],
                  layout_2d: str = "auto") -> Tuple[Optional[Layout2D], int, Topology]:
    """(layout, ranks per host, topology) of planning over ``group_size`` ranks of ``topology``.

    The whole world is 1D: no layout, the topology itself. A smaller group without a ``layout``
    gets ``layout_2d``'s (TorchRec's strided default for "auto"); its topology has
    ``layout.group_ranks_per_host`` ranks per host, which is what the sharding group's
    all-to-all really crosses."""
    W = topology.world_size
    if group_size < W and layout is None:
        layout = Layout2D(W, topology.local_world_size, group_size,
                          "strided" if layout_2d == "auto" else layout_2d)
    local = layout.group_ranks_per_host if layout is not None else min(topology.local_world_size, group_size)
    gtopo = topology if group_size == W else group_topology(topology, group_size, local)
    return layout, local, gtopo


def group_tries(world_size: int, ranks_per_host: int, sharding_group_size: Union[int, str],
                layout_2d: str = "auto") -> Tuple[Tuple[GroupTry, ...], Tuple[str, ...]]:
    """(tries, refusals): every (group size, layout) to plan for ``sharding_group_size`` (a
    group size, or "auto": every size worth trying, the whole world included) and ``layout_2d``;
    a size no layout allows is a refusal naming it."""
    W, H = world_size, ranks_per_host
    sizes = [sharding_group_size] if isinstance(sharding_group_size, int) else group_sizes(W, H)
    tries: List[GroupTry] = []
    failures: List[str] = []
    for g in sizes:
        if g >= W:
            tries.append((g, None))
            continue
        try:
            tries += [(g, lay) for lay in layouts_to_price(W, H, g, layout_2d)]
        except ValueError as e:
            failures.append(f"group size {g}: {e}")
    return tuple(tries), tuple(failures)


def sync_pipelines(pipelines: Sequence[str]) -> Tuple[str, ...]:
    """The pipelines a 2D plan may use: those that run ``DMPCollection``'s replica sync. Raises
    ``ValueError`` with the fix when none of ``pipelines`` does."""
    out = tuple(p for p in pipelines if p in SYNC_PIPELINES_2D)
    if not out:
        raise ValueError(
            f"2D plans need a pipeline that runs the replica sync ({', '.join(SYNC_PIPELINES_2D)}); "
            f"the allowed pipelines are {list(pipelines)}: allow sparse_dist"
        )
    return out


def placed_shards(problem: PlanningProblem, assignment: Sequence[Tuple[int, Sequence[int]]]
                  ) -> Iterator[Tuple[int, int, int, Sequence[int]]]:
    """(rows, columns, element bytes, ranks) of each table's shards as ``assignment`` (candidate
    id and ranks per table) places them."""
    for cid, ranks in assignment:
        c = problem.cands[cid]
        yield c.shard_rows, c.shard_cols, problem.specs[c.table].elem_bytes, ranks


def replica_sync(problem: PlanningProblem, assignment: Sequence[Tuple[int, Sequence[int]]],
                 group_size: int, layout: Layout2D, profile: HardwareProfile, step_s: float,
                 sync_interval: Optional[int] = None,
                 max_sync_interval: Optional[int] = None) -> Tuple[float, int]:
    """(replica sync seconds per step, sync interval) of a group plan under the ``default``
    strategy: one sync of the most state any rank of the group holds, amortised over the pinned
    ``sync_interval`` or the one chosen for ``step_s`` under ``max_sync_interval``."""
    c = choose_replica_sync(problem, assignment, group_size, layout, profile, step_s,
                            sync_interval=sync_interval, max_sync_interval=max_sync_interval)
    return c.sync_s, c.sync_interval


def strategies_to_price(strategy: str, compute_device: str,
                        sync_interval: Optional[int] = None) -> Tuple[Tuple[str, ...], Tuple[Tuple[str, str], ...]]:
    """(strategies to price, refusals as (strategy, reason)) for ``strategy`` ("auto": every
    strategy in :data:`~torchrec_sparselift.vocabulary.STRATEGY_2D_REGISTRY`) on
    ``compute_device``. A strategy TorchRec does not run on CPU is refused there; a pinned
    ``sync_interval`` refuses the strategies without one. Raises ``ValueError`` naming the fix
    when nothing is left."""
    if strategy not in STRATEGY_2D_CHOICES:
        raise ValueError(f"strategy_2d must be one of {', '.join(map(repr, STRATEGY_2D_CHOICES))}, got {strategy!r}")
    names = STRATEGIES_2D if strategy == "auto" else (strategy,)
    offered: List[str] = []
    refused: List[Tuple[str, str]] = []
    for name in names:
        s = strategy_2d(name)
        if compute_device == "cpu" and not s.runs_on_cpu:
            refused.append((name, f"not on CPU: {s.not_on_cpu}"))
        elif sync_interval is not None and not s.periodic_sync:
            refused.append((name, f"it has no sync interval (sync_interval={sync_interval} is pinned)"))
        else:
            offered.append(name)
    if not offered:
        reasons = "; ".join(f"{n}: {r}" for n, r in refused)
        raise ValueError(f"2D strategy {strategy!r} cannot be planned here ({reasons}); use "
                         f"strategy_2d='default' or 'auto'" + (", or drop sync_interval" if sync_interval else ""))
    return tuple(offered), tuple(refused)


@attrs.frozen
class ReplicaSyncChoice:
    """How a group plan keeps its replicas in step: the ``strategy``, its ``sync_interval``
    (1 for a strategy without one), replica-sync seconds per step (``sync_s``), the fullest
    rank's memory under it (``memory``), every priced strategy's seconds per step
    (``alternatives``) and the refused ones with the reason (``refused``)."""

    strategy: str
    sync_interval: int
    sync_s: float
    memory: TwoDMemory
    alternatives: Tuple[Tuple[str, float], ...] = ()
    refused: Tuple[Tuple[str, str], ...] = ()


def choose_replica_sync(problem: PlanningProblem, assignment: Sequence[Tuple[int, Sequence[int]]],
                        group_size: int, layout: Layout2D, profile: HardwareProfile, step_s: float,
                        strategies: Sequence[str] = ("default",),
                        refused: Sequence[Tuple[str, str]] = (),
                        sync_interval: Optional[int] = None,
                        max_sync_interval: Optional[int] = None) -> ReplicaSyncChoice:
    """Price each of ``strategies`` for a group plan (:mod:`torchrec_sparselift.cost.two_d`) and
    keep the fastest; ties go to the earlier one (``default`` first). ``default`` syncs weights
    and optimizer state every pinned ``sync_interval`` steps or the one chosen for ``step_s``;
    ``fully_sharded`` reduce-scatters and all-gathers the weights every step, the
    reduce-scatter beside the dense forward and backward where the profile overlaps."""
    shards = list(placed_shards(problem, assignment))
    state = replica_sync_bytes(shards, group_size)
    weights = replica_sync_bytes(shards, group_size, optimizer_state=False)
    consts = phase_constants(problem.ctx)
    dense_s = consts["dense_fwd"] + consts["dense_bwd"]
    priced: List[Tuple[str, float, int]] = []
    for name in strategies:
        if strategy_2d(name).periodic_sync:
            one = replica_sync_s(state, layout, profile)
            interval, per_step = amortised_sync(step_s, one, sync_interval, max_sync_interval)
        else:
            interval, per_step = 1, fully_sharded_s(weights, layout, profile, dense_s)
        priced.append((name, per_step, interval))
    name, per_step, interval = min(priced, key=lambda p: p[1])
    return ReplicaSyncChoice(
        strategy=name, sync_interval=interval, sync_s=per_step,
        memory=two_d_memory(name, weights, state - weights, layout.num_replicas),
        alternatives=tuple((n, s) for n, s, _ in priced), refused=tuple(refused),
    )


@attrs.frozen
class GroupChoice:
    """The 2D search's outcome: the ``best`` group plan, the best step time per group size
    (``alternatives_2d``: (group size, step s)) and every try's (``alternatives_layout``:
    (group size, layout kind or "1d", step s))."""

    best: Any
    alternatives_2d: Tuple[Tuple[int, float], ...]
    alternatives_layout: Tuple[Tuple[int, str, float], ...]


def search_groups(
    world_size: int,
    ranks_per_host: int,
    sharding_group_size: Union[int, str],
    layout_2d: str,
    budget_s: float,
    t0: float,
    solve_group: Callable[[int, Optional[Layout2D], float], Any],
    clock: Callable[[], float] = time.monotonic,
) -> GroupChoice:
    """Plan every try of :func:`group_tries` with ``solve_group(group size, layout, budget s)``
    (a plan with ``step_time_s``, ``sharding_group_size`` (None for 1D) and ``layout_2d``; a
    ``PlannerError`` when the tables do not fit) and keep the fastest.

    1D (the whole world) gets a third of ``budget_s``, as it would planned alone; the 2D tries
    share another third; the winner is planned again with what is left of the budget started at
    ``t0`` (``clock`` time) and kept if no slower. Raises :class:`SparseLiftPlannerError` listing
    every group size's reason when none fits."""
    W = world_size
    tries, refused = group_tries(W, ranks_per_host, sharding_group_size, layout_2d)
    failures = list(refused)
    n2d = sum(1 for g, _ in tries if g < W)
    budget_2d = budget_s / (3 * n2d) if n2d else budget_s
    budget_1d = budget_s / 3 if n2d else budget_s
    results: List[Any] = []
    for g, lay in tries:
        try:
            results.append(solve_group(g, lay, budget_1d if g >= W else budget_2d))
        except PlannerError as e:  # tables do not fit in g ranks
            failures.append(f"group size {g}: {str(e).splitlines()[0]}")
    if not results:
        raise SparseLiftPlannerError(
            "no sharding-group size fits the tables:\n  " + "\n  ".join(failures),
            kind="insufficient_storage",
        )
    best = min(results, key=lambda r: (r.step_time_s, -(r.sharding_group_size or W)))
    per_group: Dict[int, float] = {}
    for r in results:
        g = r.sharding_group_size or W
        per_group[g] = min(per_group.get(g, float("inf")), r.step_time_s)
    alts_layout = tuple((r.sharding_group_size or W, r.layout_2d.kind if r.layout_2d else "1d", r.step_time_s)
                        for r in results)
    left = max(0.5, budget_s - (clock() - t0))
    res = solve_group(best.sharding_group_size or W, best.layout_2d, left)
    if res.step_time_s > best.step_time_s:
        res = best
    return GroupChoice(best=res, alternatives_2d=tuple(per_group.items()), alternatives_layout=alts_layout)
