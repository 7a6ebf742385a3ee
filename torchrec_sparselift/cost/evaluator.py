"""Incremental step-time evaluator.

Holds a plan as per-rank load vectors (one row per rank, one column per resource, see
:data:`torchrec_sparselift.cost.terms.LOAD_COLUMNS`). Moving one shard changes the rows of the
ranks it leaves and joins (and, where a host's ranks share their inter-host link, their host
mates' rows in the shared columns, which hold the host's mean); the evaluator updates those rows
and the per-column maxima, and can price a move *without* applying it in O(K) using the top-3
ranks per column (a shared column ties across a host, so with 3 or more ranks per host the
untouched maximum there often falls back to a masked max over the ranks). The property test
``tests/test_incremental_evaluator.py`` checks that incremental results equal
:meth:`PlanEvaluator.full_recompute` on random plans.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.model import (
    CostContext,
    ShardCost,
    StepTime,
    host_mean_rows,
    phase_times,
    piece_loads,
    shared_link_columns,
    step_time,
    step_total_batch,
)
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["PlanEvaluator", "Assignment"]

Assignment = Tuple[int, Tuple[int, ...]]  # (candidate id, rank of each shard)

_TOP = 3


class PlanEvaluator:
    """Per-rank loads of a (partial) plan, updated move by move.

    Args:
        ctx: cost context (hardware, world size, batch size, dense part).
        costs: ``costs[c]`` is the :class:`ShardCost` of one shard of candidate ``c``.
        sharding_types: ``sharding_types[c]`` is candidate ``c``'s sharding type (for the
            number of collective groups).
        device_cap / host_cap: per-rank memory limits in bytes (arrays of length world size).
        pipeline, fwd_precision, bwd_precision: the optimizations the objective is priced under.
        kernels: ``kernels[c]`` is candidate ``c``'s compute kernel. Tables of one sharding type
            and kernel on a rank share one TBE call, whose fixed cost (``lookup_overhead_s``,
            forward and backward) the evaluator charges once per rank and group.
    """

    def __init__(
        self,
        ctx: CostContext,
        costs: Sequence[ShardCost],
        sharding_types: Sequence[str],
        device_cap: np.ndarray,
        host_cap: np.ndarray,
        pipeline: str = defaults.PIPELINE,
        fwd_precision: str = defaults.COMM_PRECISION,
        bwd_precision: str = defaults.COMM_PRECISION,
        kernels: Optional[Sequence[str]] = None,
    ) -> None:
        self.ctx = ctx
        self.W = ctx.world_size
        self.costs = list(costs)
        self.types = list(sharding_types)
        lay = layout()  # the load columns (cost.terms.LOAD_COLUMNS)
        K = self.K = lay.width
        self.dev_col, self.host_col = lay.capacity_column("device"), lay.capacity_column("host")
        self.owner = np.stack([c.owner for c in self.costs]) if self.costs else np.zeros((0, K))
        self.peers = np.stack([c.peers for c in self.costs]) if self.costs else np.zeros((0, K))
        self.allreduce = np.array([c.allreduce_bytes for c in self.costs])
        self.device_cap = np.asarray(device_cap, dtype=float)
        self.host_cap = np.asarray(host_cap, dtype=float)
        self.pipeline = pipeline
        self.fwd_precision = fwd_precision
        self.bwd_precision = bwd_precision
        # TBE groups: TorchRec runs one fused kernel per (sharding type, kernel) on a rank, so
        # the fixed lookup cost is paid once per group present on a rank, not per table
        kern = list(kernels) if kernels is not None else [""] * len(self.types)
        keys = sorted(set(zip(self.types, kern)))
        self._gidx = {k: i for i, k in enumerate(keys)}
        self.group_of = np.array([self._gidx[k] for k in zip(self.types, kern)], dtype=np.int64)
        self.gcount = np.zeros((self.W, max(1, len(keys))), dtype=np.int64)
        self.overhead = lay.group_costs(ctx.profile)  # a TBE group's fixed cost, per column
        # a host's shared link (cost.model.shared_link_columns): a rank's row holds its host's mean
        # in those columns, so one shard adds owner/L to every rank of its host there
        self.L = ctx.ranks_per_host
        self.shared = np.asarray(shared_link_columns(ctx), dtype=np.int64)
        #: what one shard adds to its own rank's row (cost.model.piece_loads); ``owner_host``: what
        #: it adds to every rank of its host (the shared columns), ``owner_local``: the rest
        self.owner_eff = piece_loads(self.owner, ctx)
        self.owner_local = self.owner.copy()
        self.owner_host = np.zeros_like(self.owner)
        if len(self.shared):
            self.owner_local[:, self.shared] = 0.0
            self.owner_host[:, self.shared] = self.owner_eff[:, self.shared]
        self.loads = np.zeros((self.W, K))
        self.uniform = np.zeros(K)
        self.allreduce_bytes = 0.0
        self.groups: Counter = Counter()
        self.assignment: Dict[int, Assignment] = {}
        self._tables_at: Dict[int, set] = {}  # rank -> tables with a shard there (tables_on)
        self._all_ranks = np.arange(self.W, dtype=np.int64)
        self._top = np.zeros((min(_TOP, self.W), K), dtype=np.int64)
        self._colmax = np.zeros(K)
        #: what prices rows of column maxima instead of the pipeline's step (``step_total_batch``):
        #: ``row_price(rows, allreduce_bytes, comm_groups) -> step per row``; None: the step. The
        #: search sets it while its moves price the batch split (``search.split_pricing``).
        self.row_price: Optional[Callable[[np.ndarray, float, int], np.ndarray]] = None

    # -- bookkeeping --------------------------------------------------------------------
    def _refresh_top(self) -> None:
        if self.W <= _TOP:
            self._top = np.argsort(-self.loads, axis=0, kind="stable")
        else:
            part = np.argpartition(-self.loads, _TOP - 1, axis=0)[:_TOP]
            vals = np.take_along_axis(self.loads, part, axis=0)
            order = np.argsort(-vals, axis=0, kind="stable")
            self._top = np.take_along_axis(part, order, axis=0)
        self._colmax = self.loads.max(axis=0) if self.W else np.zeros(self.K)

    # -- shards into rows ------------------------------------------------------------------
    def host_ranks(self, ranks: Sequence[int]) -> np.ndarray:
        """``ranks`` and, where a host link is shared, every other rank of their hosts (sorted):
        the rows a shard on ``ranks`` changes."""
        idx = np.unique(np.asarray(ranks, dtype=np.int64))
        if not len(self.shared) or not len(idx):
            return idx
        hosts = np.unique(idx // self.L)
        return (hosts[:, None] * self.L + np.arange(self.L)[None, :]).ravel()

    def add_shards(self, rows: np.ndarray, rows_ranks: np.ndarray, cand: int, ranks: Sequence[int],
                   sign: float = 1.0) -> None:
        """Add ``sign`` x the owner loads of ``cand``'s shards on ``ranks`` to ``rows``, the rows of
        the sorted ranks ``rows_ranks`` (in place; :meth:`host_ranks` of ``ranks`` must be among
        them): each shard's own columns on its rank, and where a host link is shared its bytes
        there / L on every rank of its host."""
        idx = np.asarray(ranks, dtype=np.int64)
        if not len(idx):
            return
        np.add.at(rows, np.searchsorted(rows_ranks, idx), self.owner_local[cand] * sign)
        if len(self.shared):
            per_host = np.bincount(idx // self.L, minlength=self.W // self.L)
            k = per_host[np.asarray(rows_ranks, dtype=np.int64) // self.L].astype(float)
            rows[:, self.shared] += (sign * k)[:, None] * self.owner_host[cand][None, self.shared]

    def block_vec(self, cand: int, block: int) -> np.ndarray:
        """The load a rank's row gains when ``cand`` puts one shard on each of ``block``
        consecutive ranks starting at a host boundary (``host`` and ``all`` placements): its own
        shard, and with a shared host link the ``min(block, L) - 1`` other shards on its host."""
        return self.owner_local[cand] + min(max(block, 1), self.L) * self.owner_host[cand]

    def _apply(self, table: int, cand: int, ranks: Sequence[int], sign: float) -> None:
        idx = np.asarray(ranks, dtype=np.int64)
        self.add_shards(self.loads, self._all_ranks, cand, idx, sign)
        g = self.group_of[cand]
        if sign > 0:
            first = idx[self.gcount[idx, g] == 0]
            self.gcount[idx, g] += 1
            self.loads[first] += self.overhead
        else:
            self.gcount[idx, g] -= 1
            last = idx[self.gcount[idx, g] == 0]
            self.loads[last] -= self.overhead
        n = len(ranks)
        self.uniform += self.peers[cand] * (n * sign)
        self.allreduce_bytes += self.allreduce[cand] * n * sign / max(self.W, 1)
        st = self.types[cand]
        if st != DATA_PARALLEL:
            self.groups[st] += 1 if sign > 0 else -1
            if self.groups[st] <= 0:
                del self.groups[st]

    def assign(self, table: int, cand: int, ranks: Sequence[int]) -> None:
        """Place ``table`` with candidate ``cand``, shard ``i`` on ``ranks[i]`` (replacing any
        previous placement of the table)."""
        self.assign_many({table: (cand, ranks)})

    def assign_many(self, assignment: Mapping[int, Assignment]) -> None:
        """:meth:`assign` for many tables, with one refresh of the column maxima at the end
        (what the search at scale loads a whole plan with)."""
        for table, (cand, ranks) in assignment.items():
            if table in self.assignment:
                self.unassign(table, refresh=False)
            ranks = tuple(int(r) for r in ranks)
            self._apply(table, cand, ranks, 1.0)
            self.assignment[table] = (cand, ranks)
            self._index(table, ranks, True)
        self._refresh_top()

    def unassign(self, table: int, refresh: bool = True) -> None:
        cand, ranks = self.assignment.pop(table)
        self._index(table, ranks, False)
        self._apply(table, cand, ranks, -1.0)
        if refresh:
            self._refresh_top()

    # -- pricing ------------------------------------------------------------------------
    @property
    def comm_groups(self) -> int:
        return len(self.groups)

    def colmax(self) -> np.ndarray:
        """Per-column maximum over ranks of each rank's load (owner + peers share)."""
        return self._colmax + self.uniform

    def objective_rows(self, colmax_rows: np.ndarray, allreduce_bytes: float, groups: int) -> np.ndarray:
        """The objective of each row of column maxima (rows x columns, peers' share included):
        :attr:`row_price` where set, else the pipeline's step (``cost.model.step_total_batch``)."""
        if self.row_price is not None:
            return self.row_price(colmax_rows, allreduce_bytes, groups)
        return step_total_batch(colmax_rows, allreduce_bytes, groups, self.ctx, self.pipeline,
                                self.fwd_precision, self.bwd_precision)

    def objective_of(self, colmax: np.ndarray, allreduce_bytes: float, groups: int) -> float:
        return float(self.objective_rows(colmax[None, :], allreduce_bytes, groups)[0])

    def objective(self) -> float:
        return self.objective_of(self.colmax(), self.allreduce_bytes, self.comm_groups)

    def step_time(self, pipeline: Optional[str] = None, fwd: Optional[str] = None,
                  bwd: Optional[str] = None) -> StepTime:
        return step_time(
            self.colmax(), self.allreduce_bytes, self.comm_groups, self.ctx,
            pipeline or self.pipeline, fwd or self.fwd_precision, bwd or self.bwd_precision,
        )

    def move_objective(self, table: int, cand: int, ranks: Sequence[int]) -> float:
        """Objective if ``table`` were placed as (cand, ranks), without changing anything.

        Returns ``inf`` when the move breaks a memory limit.
        """
        old = self.assignment.get(table)
        if old is not None:
            oc, oranks = old
        else:
            oc, oranks = -1, ()
        touched = self.host_ranks(np.fromiter((*oranks, *ranks), dtype=np.int64))
        new_rows = self.loads[touched].copy()
        if oranks:
            self.add_shards(new_rows, touched, oc, oranks, -1.0)
        self.add_shards(new_rows, touched, cand, ranks, 1.0)
        # TBE group fixed costs on the touched ranks
        counts = self.gcount[touched].copy()
        before = counts > 0
        if oranks:
            np.subtract.at(counts, (np.searchsorted(touched, np.asarray(oranks, dtype=np.int64)), self.group_of[oc]), 1)
        np.add.at(counts, (np.searchsorted(touched, np.asarray(ranks, dtype=np.int64)), self.group_of[cand]), 1)
        change = (counts > 0).sum(axis=1) - before.sum(axis=1)
        if np.any(change):
            new_rows += change[:, None] * self.overhead[None, :]
        if np.any(new_rows[:, self.dev_col] > self.device_cap[touched] + 1e-6) or np.any(
            new_rows[:, self.host_col] > self.host_cap[touched] + 1e-6
        ):
            return float("inf")
        # max over untouched ranks from the top-3 cache; fall back to a masked max
        if len(touched) >= self.W:
            rest = np.full(self.K, -np.inf)
        else:
            valid = ~np.isin(self._top, touched)
            first = np.argmax(valid, axis=0)
            cols = np.arange(self.K)
            rest = self.loads[self._top[first, cols], cols]
            missing = ~valid.any(axis=0)
            if missing.any():
                mask = np.ones(self.W, dtype=bool)
                mask[touched] = False
                rest[missing] = self.loads[mask][:, missing].max(axis=0)
        colmax = np.maximum(rest, new_rows.max(axis=0))
        uniform = self.uniform + self.peers[cand] * len(ranks)
        allreduce = self.allreduce_bytes + self.allreduce[cand] * len(ranks) / self.W
        ngroups = len(self.groups)
        new_t, old_t = self.types[cand], (self.types[oc] if old is not None else None)
        if old is not None:
            uniform = uniform - self.peers[oc] * len(oranks)
            allreduce -= self.allreduce[oc] * len(oranks) / self.W
            if old_t != DATA_PARALLEL and old_t != new_t and self.groups.get(old_t, 0) == 1:
                ngroups -= 1
        if new_t != DATA_PARALLEL and new_t != old_t and self.groups.get(new_t, 0) == 0:
            ngroups += 1
        return self.objective_of(colmax + uniform, allreduce, ngroups)

    # -- checks and reports --------------------------------------------------------------
    def full_recompute(self) -> Tuple[np.ndarray, np.ndarray, float, int]:
        """(loads, uniform, allreduce bytes, groups) rebuilt from scratch from the assignment."""
        loads = np.zeros((self.W, self.K))
        uniform = np.zeros(self.K)
        allreduce = 0.0
        groups = set()
        present = np.zeros(self.gcount.shape, dtype=bool)
        for table, (cand, ranks) in self.assignment.items():
            for r in ranks:
                loads[r] += self.owner[cand]
                present[r, self.group_of[cand]] = True
            uniform += self.peers[cand] * len(ranks)
            allreduce += self.allreduce[cand] * len(ranks) / self.W
            if self.types[cand] != DATA_PARALLEL:
                groups.add(self.types[cand])
        loads = host_mean_rows(loads, self.ctx)  # each rank's own bytes -> its host's mean
        loads += present.sum(axis=1)[:, None] * self.overhead[None, :]
        return loads, uniform, allreduce, len(groups)

    def full_objective(self) -> float:
        loads, uniform, allreduce, groups = self.full_recompute()
        return self.objective_of(loads.max(axis=0) + uniform, allreduce, groups)

    def rank_loads(self) -> np.ndarray:
        """Each rank's load vector including its share of peers' traffic (and, where a host link
        is shared, its host's mean in the shared columns)."""
        return self.loads + self.uniform[None, :]

    def memory_ok(self) -> bool:
        return bool(
            np.all(self.loads[:, self.dev_col] <= self.device_cap + 1e-6)
            and np.all(self.loads[:, self.host_col] <= self.host_cap + 1e-6)
        )

    def phases(self) -> Dict[str, float]:
        return phase_times(self.colmax(), self.allreduce_bytes, self.comm_groups, self.ctx,
                           self.fwd_precision, self.bwd_precision, self.pipeline)

    def _index(self, table: int, ranks: Sequence[int], add: bool) -> None:
        for r in ranks:
            at = self._tables_at.setdefault(r, set())
            if add:
                at.add(table)
            else:
                at.discard(table)

    def tables_on(self, rank: int) -> List[int]:
        """Tables with a shard on ``rank``, in table order (kept per rank: the local search asks
        for the hot ranks' tables every round)."""
        return sorted(self._tables_at.get(int(rank), ()))
