"""Cost of 2D sparse parallelism: replica synchronisation, amortised over the sync interval.

With ``W`` ranks and sharding groups of ``G`` ranks there are ``R = W / G`` replicas. Rank ``g``
of every group holds the same shards; every ``N`` steps the ``R`` copies average their weights
and optimizer state with an all-reduce over the ranks holding shard ``g``:

    t_sync = latency + 2 (R - 1) / R * max_g bytes_g / bw_replica
    per step: t_sync / N

``bw_replica`` is the intra-host bandwidth when all ``R`` copies sit on one host (``G * R <=
local_world_size``), else the inter-host bandwidth (groups are laid out contiguously, so
replicas of a rank live on different hosts once a group spans a host).
"""

from __future__ import annotations

from typing import List, Sequence

from torchrec_sparselift.cost.hardware import HardwareProfile

__all__ = ["replica_sync_s", "group_sizes", "choose_sync_interval", "SYNC_INTERVALS"]

SYNC_INTERVALS = (1, 2, 4, 8, 16, 32, 64, 100)


def replica_sync_s(max_rank_bytes: float, world_size: int, group_size: int,
                   profile: HardwareProfile) -> float:
    """Seconds of one replica synchronisation (not amortised)."""
    if group_size >= world_size or max_rank_bytes <= 0:
        return 0.0
    R = world_size // group_size
    same_host = world_size <= profile.local_world_size
    bw = profile.intra_host_bw if same_host else profile.inter_host_bw
    return profile.collective_latency_s + 2 * (R - 1) / R * max_rank_bytes / bw


def group_sizes(world_size: int, local_world_size: int) -> List[int]:
    """Sharding-group sizes worth trying: divisors of the world size from 2 up, the full
    world (1D) included."""
    sizes = [g for g in range(2, world_size) if world_size % g == 0
             and (g & (g - 1) == 0 or g % local_world_size == 0)]
    return sizes + [world_size]


def choose_sync_interval(step_s: float, sync_s: float, max_overhead: float = 0.05,
                         intervals: Sequence[int] = SYNC_INTERVALS) -> int:
    """Smallest interval whose amortised sync costs at most ``max_overhead`` of the step."""
    for n in intervals:
        if sync_s / n <= max_overhead * step_s:
            return n
    return intervals[-1]
