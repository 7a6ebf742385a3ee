"""Layout2D: which ranks form each sharding group and each replica group in 2D sparse parallelism.

One value, used by the cost model (what the all-to-all inside a sharding group and the replica
sync really cross), the planner (which prices both layouts on multi-host topologies), the
execution plan (serialized) and the runtime (``DMPCollection`` is built from it). Like
torchtitan's ``ParallelDims`` it is validated on construction, with errors that say what to change.

``W = world_size`` ranks, ``H = ranks_per_host`` per host (host of rank ``k``: ``k // H``), sharding
groups of ``G = group_size`` ranks, ``R = W / G`` replicas. TorchRec's ``DMPCollection`` forms
(``DMPCollection._create_process_groups``):

* **strided** (``use_inter_host_allreduce=False``, TorchRec's default): sharding group ``j`` is
  ranks ``j, j+R, j+2R, ...``; the replica group of group-local rank ``s`` is the contiguous ranks
  ``s*R .. s*R+R-1`` (intra-host when ``R <= H``); on more than one host every sharding group
  spans them all, so its all-to-all crosses hosts.
* **contiguous** (``use_inter_host_allreduce=True``): sharding group ``j`` is ranks
  ``j*G .. j*G+G-1`` (inside one host when ``G <= H``); the replica group of group-local rank
  ``s`` is ranks ``s, s+G, s+2G, ...`` (across hosts once ``W > H``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Tuple

import attrs

from torchrec_sparselift.files import read_attrs
from torchrec_sparselift.vocabulary import LAYOUTS_2D

__all__ = ["Layout2D", "LAYOUTS", "layouts_to_price"]

#: The 2D rank layouts (:data:`torchrec_sparselift.vocabulary.LAYOUTS_2D`).
LAYOUTS = LAYOUTS_2D


def _positive(_: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Layout2D.{attribute.name} must be an int >= 1, got {value!r}")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@attrs.frozen
class Layout2D:
    """A 2D rank layout: ``world_size`` ranks, ``ranks_per_host`` per host, sharding groups of
    ``group_size`` ranks laid out ``"contiguous"`` or ``"strided"`` (see the module docstring)."""

    world_size: int = attrs.field(validator=_positive)
    ranks_per_host: int = attrs.field(validator=_positive)
    group_size: int = attrs.field(validator=_positive)
    kind: str = attrs.field(default="strided")

    def __attrs_post_init__(self) -> None:
        W, H, G = self.world_size, self.ranks_per_host, self.group_size
        if self.kind not in LAYOUTS:
            raise ValueError(f"Layout2D.kind must be one of {LAYOUTS}, got {self.kind!r}")
        if W % G:
            raise ValueError(
                f"group_size {G} must divide world_size {W}; pick one of {_divisors(W)}"
            )
        if W % min(H, W):
            raise ValueError(
                f"world_size {W} must be a multiple of ranks_per_host {H}; set ranks_per_host to "
                f"the ranks on one host (one of {_divisors(W)})"
            )
        if len(set(self._per_host_counts(self.sharding_groups))) > 1:
            other = "strided" if self.kind == "contiguous" else "contiguous"
            raise ValueError(
                f"{self.kind} sharding groups of {G} ranks put a different number of ranks on the "
                f"hosts they span ({H} ranks per host, {self.num_replicas} replicas); pick a group "
                f"size that divides or is a multiple of {H if self.kind == 'contiguous' else W // min(H, W)}"
                f", or the {other} layout"
            )

    # -- groups -----------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        """R = world_size / group_size."""
        return self.world_size // self.group_size

    @property
    def contiguous(self) -> bool:
        return self.kind == "contiguous"

    @property
    def use_inter_host_allreduce(self) -> bool:
        """The ``DMPCollection`` argument that forms this layout."""
        return self.contiguous

    @property
    def sharding_groups(self) -> Tuple[Tuple[int, ...], ...]:
        """Global ranks of each sharding group, in group-local rank order."""
        G, R = self.group_size, self.num_replicas
        if self.contiguous:
            return tuple(tuple(range(j * G, (j + 1) * G)) for j in range(R))
        return tuple(tuple(j + i * R for i in range(G)) for j in range(R))

    @property
    def replica_groups(self) -> Tuple[Tuple[int, ...], ...]:
        """Global ranks holding group-local rank ``s`` in every replica, for ``s = 0..G-1``."""
        groups = self.sharding_groups
        return tuple(tuple(g[s] for g in groups) for s in range(self.group_size))

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def _per_host_counts(self, groups: Tuple[Tuple[int, ...], ...]) -> List[int]:
        return [c for g in groups for c in Counter(self.host_of(r) for r in g).values()]

    # -- what the cost model needs ---------------------------------------------------------------
    @property
    def group_ranks_per_host(self) -> int:
        """Ranks of one sharding group on each host it touches: the ``local_world_size`` of the
        group-local topology the all-to-all is priced on."""
        return self._per_host_counts(self.sharding_groups)[0]

    @property
    def group_hosts(self) -> int:
        """Hosts one sharding group spans (1: its all-to-all stays inside a host)."""
        return self.group_size // self.group_ranks_per_host

    @property
    def replica_hosts(self) -> int:
        """Hosts one replica group spans (1: the replica sync stays inside a host)."""
        return len({self.host_of(r) for r in self.replica_groups[0]})

    @property
    def replica_sync_intra_host(self) -> bool:
        return self.replica_hosts == 1

    # -- presentation and serialization ----------------------------------------------------------
    def describe(self, max_groups: int = 3) -> List[str]:
        """Lines for ``explain``: the groups (first few) and what crosses hosts."""

        def show(groups: Tuple[Tuple[int, ...], ...]) -> str:
            def one(g: Tuple[int, ...]) -> str:
                if len(g) > 8:
                    return "[" + ", ".join(map(str, g[:3])) + f", ..., {g[-1]}]"
                return "[" + ", ".join(map(str, g)) + "]"

            more = f" ... ({len(groups)} in all)" if len(groups) > max_groups else ""
            return " ".join(one(g) for g in groups[:max_groups]) + more

        a2a = ("inside one host" if self.group_hosts == 1
               else f"across {self.group_hosts} hosts ({self.group_ranks_per_host} ranks per host)")
        sync = ("inside one host" if self.replica_sync_intra_host
                else f"across {self.replica_hosts} hosts")
        return [
            f"layout {self.kind} (DMPCollection use_inter_host_allreduce="
            f"{self.use_inter_host_allreduce}): {self.num_replicas} replicas x groups of "
            f"{self.group_size} ranks, {self.ranks_per_host} ranks per host",
            f"sharding groups {show(self.sharding_groups)}: all-to-all {a2a}",
            f"replica groups {show(self.replica_groups)}: replica sync {sync}",
        ]

    def to_dict(self) -> Dict[str, Any]:
        return {"world_size": self.world_size, "ranks_per_host": self.ranks_per_host,
                "group_size": self.group_size, "kind": self.kind}

    @classmethod
    def from_dict(cls, data: Any) -> "Layout2D":
        """The layout :meth:`to_dict` wrote (a dict, or a file's reader)."""
        return read_attrs(cls, data, kinds={"world_size": int, "ranks_per_host": int, "group_size": int, "kind": str})


def layouts_to_price(world_size: int, ranks_per_host: int, group_size: int,
                     which: str = "auto") -> List[Layout2D]:
    """The layouts the planner prices for one group size: ``which`` = "auto" (both, where they
    differ and are valid: on one host they are the same groups up to renumbering, so only the
    strided default), "contiguous" or "strided"."""
    if which not in ("auto",) + LAYOUTS:
        raise ValueError(f"layout must be 'auto', 'contiguous' or 'strided', got {which!r}")
    kinds = LAYOUTS if which == "auto" else (which,)
    if which == "auto" and world_size <= ranks_per_host:
        kinds = ("strided",)
    out: List[Layout2D] = []
    errors: List[str] = []
    for kind in kinds:
        try:
            out.append(Layout2D(world_size, ranks_per_host, group_size, kind))
        except ValueError as e:
            errors.append(str(e))
    if not out:
        raise ValueError("; ".join(errors))
    return out
