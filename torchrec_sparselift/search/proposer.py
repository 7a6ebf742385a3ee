"""``SparseLiftProposer``: a TorchRec ``Proposer`` that proposes SparseLift's option choice.

It works with any enumerator: it prices the search space it is given with SparseLift's cost
model (each ``ShardingOption`` becomes a candidate), solves the LP relaxation for the option
choice and proposes it, then reacts to TorchRec's feedback:

* not partitionable (memory): propose the next choice in a sequence that shrinks memory
  (the LP with tighter memory, then the least-memory option per table);
* partitionable: remember the rating; after the memory-safe variants are exhausted, stop.

TorchRec's partitioner places the shards of each proposal; ``SparseLiftPlanner`` places them
itself (with the evaluator) and is usually better, but this proposer makes SparseLift's option
choice available inside ``EmbeddingShardingPlanner``.

With ``cost_model="torchrec"`` it optimizes what TorchRec's loop rates instead: the options'
own ``Perf``/``Storage`` (filled by the enumerator's estimators) as a per-rank makespan
(:mod:`.torchrec_objective`), solved with the full search (LP, greedy, local search, MILP where
small); it proposes that plan's option choice, then the LP's and the least-work choice, and
re-solves under the exact storage limits the loop reports when a proposal does not fit.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np
from torchrec.distributed.planner.types import Enumerator, Proposer, ShardingOption, Topology

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.hardware import get_profile, profile_for_topology, PRESETS
from torchrec_sparselift.cost.model import DEV_MEM, CostContext, shard_cost
from torchrec_sparselift.search.lp import solve_lp
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.semantics.graph import candidate_for
from torchrec_sparselift.semantics.tables import TableSpec
from torchrec_sparselift.vocabulary import BASE, COLUMN_SPLIT_TYPES, COST_MODELS, ON_EVERY_RANK_TYPES, TABLE_ROW_WISE
from torchrec_sparselift.search.torchrec_objective import (
    makespan_problem,
    solve_torchrec,
    specs_from_options,
)

__all__ = ["SparseLiftProposer", "problem_from_options"]


def _infer_world(options: Sequence[ShardingOption]) -> Tuple[int, int]:
    world = max((len(o.shards) for o in options if o.sharding_type in ON_EVERY_RANK_TYPES), default=0)
    local = max((len(o.shards) for o in options if o.sharding_type == TABLE_ROW_WISE), default=0)
    world = world or max((len(o.shards) for o in options), default=1)
    return world, local or world


def problem_from_options(
    options: Sequence[ShardingOption], topology: Optional[Topology] = None, hardware: Any = None,
) -> Tuple[PlanningProblem, List[List[int]]]:
    """A :class:`PlanningProblem` whose candidates are exactly ``options``.

    Returns the problem and, per table, the indices into ``options`` of its candidates.
    """
    if topology is not None:
        W, L = topology.world_size, min(topology.local_world_size, topology.world_size)
        profile = profile_for_topology(topology, get_profile(hardware) if isinstance(hardware, str) else hardware)
        dev_cap = np.array([d.storage.hbm if topology.compute_device != "cpu" else d.storage.ddr
                            for d in topology.devices], dtype=float)
    else:
        W, L = _infer_world(options)
        profile = get_profile(hardware) if isinstance(hardware, str) else (hardware or PRESETS["h100"])
        dev_cap = np.full(W, float(profile.hbm_cap_bytes))
    tables: Dict[Tuple[str, str], List[int]] = {}
    for i, o in enumerate(options):
        tables.setdefault((o.path, o.name), []).append(i)
    keys = sorted(tables)
    specs: List[TableSpec] = []
    for t, key in enumerate(keys):
        o = options[tables[key][0]]
        types = tuple(sorted({options[i].sharding_type for i in tables[key]}))
        kernels = tuple(
            (st, tuple(sorted({options[i].compute_kernel for i in tables[key] if options[i].sharding_type == st})))
            for st in types
        )
        specs.append(TableSpec(
            module_path=o.path, name=o.name, num_embeddings=int(o.tensor.shape[0]),
            embedding_dim=int(o.tensor.shape[1]),
            feature_names=tuple(o.feature_names or [o.name]),
            pooling_factor=float(sum(o.input_lengths)), is_pooled=bool(o.is_pooled),
            elem_bytes=int(o.tensor.element_size()), sharding_types=types, compute_kernels=kernels,
            batch_size=int(o.batch_size),
        ))
    ctx = CostContext(profile=profile, world_size=W, local_world_size=L,
                      batch_size=max(s.batch_size for s in specs) if specs else 1)
    cands, costs, per_table, index = [], [], [], []
    for t, key in enumerate(keys):
        ids = []
        for i in tables[key]:
            o = options[i]
            splits = len(o.shards) if o.sharding_type in COLUMN_SPLIT_TYPES else 1
            try:
                cand = candidate_for(t, specs[t], o.sharding_type, o.compute_kernel, W, L, splits)
            except ValueError:
                continue
            ids.append(len(cands))
            cands.append(cand)
            costs.append(shard_cost(specs[t], cand, ctx))
            index.append(i)
        per_table.append(tuple(ids))
    prob = PlanningProblem(specs=tuple(specs), ctx=ctx, cands=tuple(cands), costs=tuple(costs),
                           candidates=tuple(per_table), device_cap=dev_cap, host_cap=np.full(W, np.inf))
    option_index = [[index[c] for c in ids] for ids in per_table]
    return prob, option_index


class SparseLiftProposer(Proposer):
    """Proposes SparseLift's option choice for TorchRec's planning loop (see module docs)."""

    def __init__(self, topology: Optional[Topology] = None, hardware: Any = None,
                 pipeline: str = defaults.PIPELINE, max_proposals: int = 6,
                 cost_model: str = "sparselift", time_budget_s: float = 4.0,
                 storage_reservation_percentage: float = defaults.STORAGE_RESERVATION_PERCENTAGE) -> None:
        if cost_model not in COST_MODELS:
            raise ValueError(f"cost_model must be 'sparselift' or 'torchrec', got {cost_model!r}")
        self._cost_model = cost_model
        self._budget = float(time_budget_s)
        self._reserve = float(storage_reservation_percentage)
        self._caps: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self._topology = topology
        self._hardware = hardware
        self._pipeline = pipeline
        self._max = max_proposals
        self._queue: List[List[ShardingOption]] = []
        self._search_space: List[ShardingOption] = []
        self._prob: Optional[PlanningProblem] = None
        self._index: List[List[int]] = []
        self._cand_to_option: Dict[int, int] = {}
        self._proposed = 0
        self._mem_scale = 1.0
        self.best_perf_rating: Optional[float] = None
        self.best_plan: Optional[List[ShardingOption]] = None

    def load(self, search_space: List[ShardingOption], enumerator: Optional[Enumerator] = None) -> None:
        self._search_space = list(search_space)
        self._proposed = 0
        self._mem_scale = 1.0
        self.best_perf_rating, self.best_plan = None, None
        if self._cost_model == "torchrec":
            self._queue = self._torchrec_proposals(None)
            return
        self._prob, self._index = problem_from_options(self._search_space, self._topology, self._hardware)
        self._cand_to_option = {}
        for ids, opt_ids in zip(self._prob.candidates, self._index):
            for c, o in zip(ids, opt_ids):
                self._cand_to_option[c] = o
        self._queue = [self._lp_proposal(1.0)]

    def _to_options(self, choice: Sequence[int]) -> List[ShardingOption]:
        return [self._search_space[self._cand_to_option[c]] for c in choice]

    def _lp_proposal(self, mem_scale: float) -> List[ShardingOption]:
        prob = attrs.evolve(self._prob, device_cap=self._prob.device_cap * mem_scale)
        lp = solve_lp(prob, self._pipeline)
        if not lp.choice:
            return self._least_memory()
        return self._to_options(lp.choice)

    def _least_memory(self) -> List[ShardingOption]:
        prob = self._prob
        choice = [min(ids, key=lambda c: (prob.costs[c].owner[DEV_MEM] * prob.cands[c].num_shards, c))
                  for ids in prob.candidates]
        return self._to_options(choice)

    def propose(self) -> Optional[List[ShardingOption]]:
        if self._proposed >= self._max or not self._queue:
            return None
        self._proposed += 1
        return self._queue.pop(0)

    def _torchrec_proposals(self, storage: Optional[Topology]) -> List[List[ShardingOption]]:
        """Option choices under TorchRec's own estimates (see the module docs)."""
        opts = self._search_space
        if self._topology is not None:
            W, L = self._topology.world_size, min(self._topology.local_world_size, self._topology.world_size)
        else:
            W, L = _infer_world(opts)
        topo = storage or self._topology
        if topo is not None:
            hbm = np.array([d.storage.hbm for d in topo.devices], dtype=float)
            ddr = np.array([d.storage.ddr for d in topo.devices], dtype=float)
            if storage is None:  # before the loop says: TorchRec's default reservation
                hbm, ddr = hbm * (1 - self._reserve), ddr * (1 - self._reserve)
        else:
            hbm, ddr = np.full(W, np.inf), np.full(W, np.inf)
        specs, _ = specs_from_options(opts)
        profile = get_profile(self._hardware) if isinstance(self._hardware, str) else (self._hardware or PRESETS["h100"])
        batch = max(s.batch_size for s in specs) if specs else 1
        trp = makespan_problem(opts, specs, profile, W, L, batch, hbm, ddr)
        res = solve_torchrec(trp, self._budget)
        self._trp = trp
        prob = trp.problem
        choices = [[c for c, _ in res.assignment]]
        lp_choice = None

        lp = solve_lp(prob, BASE)
        if lp.choice:
            lp_choice = list(lp.choice)
            choices.append(lp_choice)
        choices.append([min(ids, key=lambda i: (prob.shard_time(i) * prob.cands[i].num_shards, i))
                        for ids in prob.candidates])
        out, seen = [], set()
        for ch in choices:
            key = tuple(ch)
            if key in seen:
                continue
            seen.add(key)
            out.append([trp.option_of[c] for c in ch])
        return out

    def feedback(self, partitionable: bool, plan: Optional[List[ShardingOption]] = None,
                 perf_rating: Optional[float] = None, storage_constraint: Optional[Topology] = None) -> None:
        if self._cost_model == "torchrec":
            if partitionable and perf_rating is not None:
                if self.best_perf_rating is None or perf_rating < self.best_perf_rating:
                    self.best_perf_rating, self.best_plan = perf_rating, plan
            elif storage_constraint is not None and self._caps is None:
                # re-plan once under the exact per-rank storage the loop partitions against
                self._caps = (np.zeros(0), np.zeros(0))
                self._queue = self._torchrec_proposals(storage_constraint) + self._queue
            return
        if partitionable and perf_rating is not None:
            if self.best_perf_rating is None or perf_rating < self.best_perf_rating:
                self.best_perf_rating, self.best_plan = perf_rating, plan
            return  # the LP choice fits: nothing better to propose under our model
        # did not fit: shrink memory and try again, ending with the least-memory choice
        self._mem_scale *= 0.8
        if self._mem_scale > 0.3:
            self._queue.append(self._lp_proposal(self._mem_scale))
        else:
            self._queue.append(self._least_memory())
            self._mem_scale = 0.0
