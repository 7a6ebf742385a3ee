"""Cost of 2D sparse parallelism: replica synchronisation, amortised over the sync interval.

With ``W`` ranks and sharding groups of ``G`` ranks there are ``R = W / G`` replicas. Rank ``g``
of every group holds the same shards; every ``N`` steps the ``R`` copies average their weights
and optimizer state with two ``allreduce_coalesced`` calls (weights, then optimizer state) over
the ranks holding shard ``g``, every replica group at once:

    t_sync = 2 latency + 2 (R - 1) / R * max_g bytes_g / bw_replica
    per step: t_sync / N

``bw_replica`` (:meth:`HardwareProfile.replica_bw`) is the replica sync's measured rate within a
host when the replica group (the ranks holding shard ``g`` in every replica) sits on one host,
else across hosts: the job's link measurement times that very collective, every group at once
(``replica_intra_bw`` / ``replica_inter_bw``); without one, the all-to-all rate of the same link.
On 2 emulated hosts x 2 ranks (2 cores, gloo) the all-to-all rates priced the sync 1.3x (across
hosts) to 5x (within a host) too cheap: gloo's coalesced all-reduce copies the tensors into one
buffer and back, and both hosts' groups share the cores. Which link is read from the
:class:`~torchrec_sparselift.semantics.layout.Layout2D` (TorchRec's strided default keeps replica
groups inside a host when ``R <= ranks per host``; contiguous groups put them across hosts).
The all-to-all inside a sharding group is priced by the ordinary cost model on a group-local
topology with ``Layout2D.group_ranks_per_host`` ranks per host.

That is ``DMPCollection``'s ``ShardingStrategy.DEFAULT`` (:data:`~torchrec_sparselift.vocabulary.STRATEGY_2D_REGISTRY`
"default"). Its ``FULLY_SHARDED`` strategy ("fully_sharded") keeps no interval: every step, after
the lookup, each rank reduce-scatters (averages) its shards' weights ``w_g`` over its replica
group and keeps ``1/R`` of them; before the embedding backward it all-gathers them back:

    t_rs = t_ag = latency + (R - 1) / R * max_g w_g * rs_factor / bw_replica
    per step: t_ag + t_rs                       (no overlap on this hardware)
              t_ag + max(0, t_rs - t_dense)     (the reduce-scatter runs on a side stream
                                                 beside the dense forward and backward)

``w_g`` is weights only (its optimizer state stays per replica), ``rs_factor`` the profile's
``reduce_scatter_factor``. Memory per rank (:func:`two_d_memory`): both strategies need the full
weights and optimizer state while the embedding backward runs (TorchRec's all-gather restores
them there), so the storage each rank must fit is the same; ``fully_sharded`` holds only
``w_g / R`` (plus padding to a multiple of ``R`` elements) of the weights through the dense part of
the step, where activations peak, freeing ``w_g (R - 1) / R``.

The sync interval changes model quality, so it is bounded: the planner never chooses an interval
above ``max_sync_interval`` (default :data:`DEFAULT_MAX_SYNC_INTERVAL`, the largest interval at
which quality parity with 1D was measured, :data:`PARITY_EVIDENCE`); a larger bound is the
user's explicit allowance, like lossy comms and staleness.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.semantics.layout import Layout2D
from torchrec_sparselift.vocabulary import PIPELINES_2D, strategy_2d

__all__ = [
    "TwoDMemory",
    "two_d_memory",
    "fully_sharded_s",
    "replica_sync_s",
    "replica_sync_bytes",
    "amortised_sync",
    "group_sizes",
    "choose_sync_interval",
    "check_sync_interval",
    "sync_evidence",
    "SYNC_INTERVALS",
    "SYNC_PIPELINES_2D",
    "DEFAULT_MAX_SYNC_INTERVAL",
    "PARITY_EVIDENCE",
]

SYNC_INTERVALS = (1, 2, 4, 8, 16, 32, 64, 100)

#: Train pipelines through which TorchRec runs ``DMPCollection``'s replica sync
#: (``dmp_collection_sync_interval_batches``); a 2D plan uses one of them.
SYNC_PIPELINES_2D = PIPELINES_2D

#: Largest sync interval at which the momentum-scaled merge was measured at parity with 1D
#: (docs/benchmarks.md, "2D quality parity"): the planner's default bound.
DEFAULT_MAX_SYNC_INTERVAL = defaults.MAX_SYNC_INTERVAL

#: What was measured, per interval (benchmarks/parity_2d.py; docs/benchmarks.md has the commands).
PARITY_EVIDENCE = {
    1: ("exact with the momentum-scaled merge: it reproduces 1D row-wise AdaGrad (property test, and "
        "through the runtime on 4 gloo ranks); TorchRec's averaging, lift's default, does not"),
    2: ("measured at parity with 1D under TorchRec's averaging: on 2 emulated hosts x 2 ranks "
        "(benchmarks/regimes.py R4, 320 steps) +0.00045 to +0.00049 held-out loss on `kaggle` "
        "(standard error 0.00004-0.00006; +0.00077 once, with a plan sharding one table more), "
        "where two exact 1D plans differ by up to 0.00023, the other workloads -0.00257..+0.00028 "
        "(docs/benchmarks.md section 20); at 4 the synthetic task and R4's other five workloads "
        "were at parity already (sections 11, 20)"),
}
#: Intervals measured and found short of parity: 64 and 100 lost up to +0.0029 (2 replicas) and
#: +0.0113 (4 replicas) held-out loss on the worst seed of the synthetic task (section 11); 16 and
#: 8, at parity there, lost +0.0016 and +0.0011 on R4's `shared` workload, 16 +0.0008 and +0.0014
#: (two data seeds) on `kaggle`; 4, at parity on the synthetic task and five of R4's workloads
#: (worst +0.00047 on `shared`), lost +0.0007 (standard error 0.00007) on `kaggle` (section 20).
MEASURED_SHORT_OF_PARITY = (4, 8, 16, 64, 100)


def replica_sync_s(max_rank_bytes: float, layout: Layout2D, profile: HardwareProfile) -> float:
    """Seconds of one replica synchronisation (not amortised) under ``layout``."""
    R = layout.num_replicas
    if R <= 1 or max_rank_bytes <= 0:
        return 0.0
    return (2 * profile.collective_latency_s
            + 2 * (R - 1) / R * max_rank_bytes / profile.replica_bw(not layout.replica_sync_intra_host))


def replica_sync_bytes(shards: Iterable[Tuple[int, int, int, Sequence[int]]], group_size: int,
                       optimizer_state: bool = True) -> float:
    """The bytes one replica sync all-reduces: the most state any of the ``group_size`` ranks of
    a sharding group holds. Per shard ``(rows, columns, element bytes, ranks)``: its weights,
    ``rows * columns * element bytes``, and (``optimizer_state``) its row-wise optimizer state,
    one fp32 per row, on each of its ranks. ``optimizer_state=False``: the weights alone, what
    ``fully_sharded`` reduce-scatters and all-gathers every step."""
    per_rank = np.zeros(group_size)
    for rows, cols, elem_bytes, ranks in shards:
        b = rows * cols * elem_bytes + (rows * 4 if optimizer_state else 0)
        for r in ranks:
            per_rank[r] += b
    return float(per_rank.max())


def fully_sharded_s(max_rank_weight_bytes: float, layout: Layout2D, profile: HardwareProfile,
                    dense_s: float = 0.0) -> float:
    """Seconds per step of ``fully_sharded``'s reduce-scatter and all-gather of the weights over
    the replica group (module docstring); the reduce-scatter hides behind ``dense_s`` seconds of
    dense work where the profile overlaps communication with compute."""
    R = layout.num_replicas
    if R <= 1 or max_rank_weight_bytes <= 0:
        return 0.0
    one = (profile.collective_latency_s + (R - 1) / R * max_rank_weight_bytes
           * profile.rs_factor(not layout.replica_sync_intra_host) / profile.link_bw(not layout.replica_sync_intra_host))
    rs = max(0.0, one - dense_s) if profile.supports_overlap else one
    return one + rs


@attrs.frozen
class TwoDMemory:
    """Bytes per rank of a 2D plan's fullest rank: ``weight_bytes`` and ``optimizer_bytes`` it
    holds while the embedding backward runs (what must fit: the same under every strategy), and
    ``dense_phase_bytes``, what it holds of them while the dense part of the step runs."""

    strategy: str
    weight_bytes: float
    optimizer_bytes: float
    dense_phase_bytes: float

    @property
    def peak_bytes(self) -> float:
        return self.weight_bytes + self.optimizer_bytes

    @property
    def freed_bytes(self) -> float:
        """Bytes the strategy frees through the dense part (0 for ``default``)."""
        return self.peak_bytes - self.dense_phase_bytes


def two_d_memory(strategy: str, weight_bytes: float, optimizer_bytes: float, num_replicas: int,
                 elem_bytes: int = 4) -> TwoDMemory:
    """:class:`TwoDMemory` of one rank holding ``weight_bytes`` of shard weights and
    ``optimizer_bytes`` of optimizer state under ``strategy`` with ``num_replicas`` replicas:
    ``fully_sharded`` keeps ``ceil(elements / R)`` of the weights through the dense part."""
    if strategy_2d(strategy).periodic_sync or num_replicas <= 1:
        dense = weight_bytes + optimizer_bytes
    else:
        elems = weight_bytes / elem_bytes
        dense = math.ceil(elems / num_replicas) * elem_bytes + optimizer_bytes
    return TwoDMemory(strategy=strategy, weight_bytes=weight_bytes, optimizer_bytes=optimizer_bytes,
                      dense_phase_bytes=float(dense))


def amortised_sync(step_s: float, sync_s: float, sync_interval: Optional[int] = None,
                   max_sync_interval: Optional[int] = None) -> Tuple[int, float]:
    """(sync interval, replica sync seconds per step): one sync of ``sync_s`` every pinned
    ``sync_interval`` steps, else every :func:`choose_sync_interval` steps for ``step_s``."""
    interval = sync_interval or choose_sync_interval(step_s, sync_s, max_sync_interval=max_sync_interval)
    return interval, sync_s / interval


def group_sizes(world_size: int, local_world_size: int) -> List[int]:
    """Sharding-group sizes worth trying: divisors of the world size from 2 up, the full
    world (1D) included."""
    sizes = [g for g in range(2, world_size) if world_size % g == 0
             and (g & (g - 1) == 0 or g % local_world_size == 0)]
    return sizes + [world_size]


def choose_sync_interval(step_s: float, sync_s: float, max_overhead: float = defaults.SYNC_OVERHEAD,
                         intervals: Sequence[int] = SYNC_INTERVALS,
                         max_sync_interval: Optional[int] = None) -> int:
    """Smallest interval whose amortised sync costs at most ``max_overhead`` of the step, never
    above ``max_sync_interval`` (None: :data:`DEFAULT_MAX_SYNC_INTERVAL`); if none is cheap
    enough, the bound itself (the sync then costs more than ``max_overhead``, and is priced so)."""
    bound = DEFAULT_MAX_SYNC_INTERVAL if max_sync_interval is None else max_sync_interval
    allowed = [n for n in intervals if n <= bound]
    if bound not in allowed:
        allowed.append(bound)
    for n in allowed:
        if sync_s / n <= max_overhead * step_s:
            return n
    return allowed[-1]


def check_sync_interval(sync_interval: Optional[int], max_sync_interval: Optional[int]) -> int:
    """The bound in force; refuses a pinned ``sync_interval`` above it with the fix."""
    bound = DEFAULT_MAX_SYNC_INTERVAL if max_sync_interval is None else max_sync_interval
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
        raise ValueError(f"max_sync_interval must be a positive number of steps, got {max_sync_interval!r}")
    if sync_interval is not None and sync_interval > bound:
        raise ValueError(
            f"sync_interval {sync_interval} exceeds max_sync_interval {bound}: quality parity with 1D "
            f"is measured up to {DEFAULT_MAX_SYNC_INTERVAL} steps (docs/benchmarks.md); pass "
            f"max_sync_interval={sync_interval} to allow it, or a sync_interval <= {bound}"
        )
    return bound


def sync_evidence(sync_interval: int) -> str:
    """One line on the quality evidence for ``sync_interval`` (for summaries and explain)."""
    if sync_interval in PARITY_EVIDENCE:
        return PARITY_EVIDENCE[sync_interval]
    measured = [n for n in PARITY_EVIDENCE if n >= sync_interval]
    if measured:
        return (f"between measured intervals: parity measured at {min(measured)} "
                f"and below (benchmarks/parity_2d.py)")
    worse = [n for n in MEASURED_SHORT_OF_PARITY if n <= sync_interval]
    return (f"NOT covered by the parity measurements (parity measured up to {max(PARITY_EVIDENCE)} steps"
            + (f"; {max(worse)} measured short of parity" if worse else "")
            + "): allowed by an explicit max_sync_interval")
