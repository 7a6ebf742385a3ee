"""TorchRec's own estimators as the objective: ``SparseLiftPlanner(cost_model="torchrec")``.

TorchRec rates a plan with ``NoopPerfModel``: the slowest rank's sum of ``shard.perf.total``
(milliseconds), where every shard's ``Perf`` and ``Storage`` come from the enumerator's
estimators (by default ``EmbeddingPerfEstimator`` and ``EmbeddingStorageEstimator``; a user may
pass their own, as ``EmbeddingEnumerator(estimator=...)`` takes them). This module turns that
objective into a :class:`~torchrec_sparselift.search.problem.PlanningProblem`, so the same search
(LP bound, greedy, local search, MILP) optimizes it:

1. :func:`estimate_options` runs TorchRec's ``EmbeddingEnumerator`` over the module (its sharding
   types, kernels, shard shapes and constraints) and fills every shard's ``Perf``/``Storage``.
   The estimators price each shard independently, so with ``share_estimates`` (on for TorchRec's
   default estimators) each option is estimated once per *distinct* shard size and the result is
   copied to its identical shards: a row-wise option over 128 ranks costs 2 estimates, not 128.
2. :func:`makespan_problem` makes one candidate per option: its shard's ``Perf.total`` (seconds)
   is the only time column (``FWD``), its ``Storage.hbm``/``Storage.ddr`` the memory columns, and
   the cost context has no fixed, latency or dense terms, so the step time of a plan under the
   ``base`` pipeline *is* the slowest rank's summed ``Perf.total``: ``NoopPerfModel``'s rating.
   Memory limits are the reserved topology's per-rank HBM and DDR, as TorchRec's partitioner
   checks them.

Placement rules follow TorchRec's: row-wise and data-parallel shard ``i`` on rank ``i``,
table-row-wise on one host's ranks, table-wise and column-wise shards anywhere (distinct ranks).
Table-column-wise options are kept only when they have one shard per rank of a host (then they
are a host placement); TorchRec's partitioner keeps a table-column-wise table on one host, which
a free placement cannot promise.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.vocabulary import (
    BASE,
    COLUMN_WISE,
    FP32,
    ON_EVERY_RANK_TYPES,
    TABLE_COLUMN_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    UVM_KERNELS,
)
from torchrec_sparselift.cost.model import CostContext, DEV_MEM, DenseWork, FWD, HOST_MEM, K, ShardCost
from torchrec_sparselift.search.errors import SparseLiftPlannerError
from torchrec_sparselift.search.lp import solve_lp
from torchrec_sparselift.search.makespan_bound import makespan_bound
from torchrec_sparselift.search.makespan_milp import makespan_milp_size, solve_makespan_milp
from torchrec_sparselift.search.place import WorkBudget, best_placement, local_search
from torchrec_sparselift.search.problem import PlanningProblem, _no_fit_error, column_splits, device_caps
from torchrec_sparselift.search.solve import SearchResult, WORK_UNITS_PER_SECOND, new_evaluator, solve
from torchrec_sparselift.semantics.graph import Candidate
from torchrec_sparselift.semantics.tables import TableSpec, extract_tables

__all__ = [
    "TorchRecProblem",
    "default_estimators",
    "estimator_identity",
    "estimate_options",
    "makespan_context",
    "makespan_problem",
    "placed_options",
    "noop_rating_ms",
]

_MS = 1e3


def default_estimators(topology: Any, constraints: Optional[Dict[str, Any]] = None) -> List[Any]:
    """TorchRec's default pair: ``EmbeddingPerfEstimator`` + ``EmbeddingStorageEstimator``."""
    from torchrec.distributed.planner.shard_estimators import (
        EmbeddingPerfEstimator,
        EmbeddingStorageEstimator,
    )

    return [EmbeddingPerfEstimator(topology=topology, constraints=constraints),
            EmbeddingStorageEstimator(topology=topology, constraints=constraints)]


def _as_list(estimator: Any) -> List[Any]:
    if estimator is None:
        return []
    return list(estimator) if isinstance(estimator, (list, tuple)) else [estimator]


def estimator_identity(estimator: Any = None) -> str:
    """A stable name of the estimators in use, for cache keys (``PlanRequest``): the classes'
    qualified names, plus a user estimator's ``identity()``/``version`` if it has one. Default:
    TorchRec's pair, with the torchrec version."""
    ests = _as_list(estimator)
    if not ests:
        import torchrec

        return f"torchrec-default/{torchrec.__version__}"
    parts = []
    for e in ests:
        name = f"{type(e).__module__}.{type(e).__qualname__}"
        ident = getattr(e, "identity", None)
        tag = ident() if callable(ident) else getattr(e, "version", None)
        parts.append(name + (f"[{tag}]" if tag is not None else ""))
    return "+".join(parts)


def _is_default(estimators: Sequence[Any]) -> bool:
    from torchrec.distributed.planner.shard_estimators import (
        EmbeddingPerfEstimator,
        EmbeddingStorageEstimator,
    )

    return all(type(e) in (EmbeddingPerfEstimator, EmbeddingStorageEstimator) for e in estimators)


class _Captured(Exception):
    pass


class _CaptureOptions:
    """A ``ShardEstimator`` that takes the enumerator's options and stops it there: the
    enumerator's own deep copy of the whole search space (the slowest part of its
    ``enumerate`` at scale) is skipped; estimation happens afterwards, shared across shards."""

    def __init__(self) -> None:
        self.options: List[Any] = []

    def estimate(self, sharding_options: Any, sharder_data_map: Any = None) -> None:
        self.options = list(sharding_options)
        raise _Captured()


def placeable(option: Any, world_size: int, local_world_size: int) -> bool:
    """Whether the makespan problem can place ``option`` (see :func:`makespan_problem`)."""
    st, n = option.sharding_type, len(option.shards)
    L = min(local_world_size, world_size)
    if st in (TABLE_WISE, COLUMN_WISE):
        return True
    if st == TABLE_COLUMN_WISE:
        return n in (1, L)
    if st in ON_EVERY_RANK_TYPES:
        return n == world_size
    if st == TABLE_ROW_WISE:
        return n == L
    return False


def _representatives(options: Sequence[Any]) -> List[Tuple[Any, Any, List[List[int]]]]:
    """(option, a copy with one shard per distinct shard size, shard indices per size)."""
    out = []
    for o in options:
        by_size: Dict[Tuple[int, ...], List[int]] = {}
        for i, s in enumerate(o.shards):
            by_size.setdefault(tuple(s.size), []).append(i)
        rep = copy.copy(o)  # shares tensor/module; own shard list
        rep.shards = [copy.copy(o.shards[idx[0]]) for idx in by_size.values()]
        out.append((o, rep, list(by_size.values())))
    return out


def _copy_back(reps: Sequence[Tuple[Any, Any, List[List[int]]]]) -> None:
    for o, rep, idxs in reps:
        for rs, idx in zip(rep.shards, idxs):
            for i in idx:
                o.shards[i].perf = rs.perf
                o.shards[i].storage = rs.storage


def _uvm_needed(reps: Sequence[Tuple[Any, Any, List[List[int]]]], rank_hbm: float, total_hbm: float) -> set:
    """Tables whose UVM options are worth estimating: memory is tight for them (their smallest
    non-UVM shard takes over 1/16 of a rank's HBM), and, when the smallest non-UVM storage of all
    tables is over half the cluster's HBM, the biggest tables until the rest is under half.
    Elsewhere a UVM option only trades speed for memory that is not short."""
    smallest_shard: Dict[Tuple[str, str], float] = {}
    smallest_total: Dict[Tuple[str, str], float] = {}
    for o, rep, idxs in reps:
        if o.compute_kernel in UVM_KERNELS:
            continue
        key = (o.path, o.name)
        hbm = [float(s.storage.hbm) for s in rep.shards]
        tot = sum(h * len(ix) for h, ix in zip(hbm, idxs))
        smallest_shard[key] = min(smallest_shard.get(key, np.inf), max(hbm))
        smallest_total[key] = min(smallest_total.get(key, np.inf), tot)
    need = {k for k, v in smallest_shard.items() if v > rank_hbm / 16}
    # tight overall: the biggest tables too, until the others' smallest storage is at most half
    rest = sum(v for k, v in smallest_total.items() if k not in need)
    for k in sorted(smallest_total, key=lambda k: (-smallest_total[k], k)):
        if rest <= 0.5 * total_hbm:
            break
        if k not in need:
            need.add(k)
            rest -= smallest_total[k]
    keys = {(o.path, o.name) for o, _, _ in reps}
    return need | (keys - set(smallest_shard))  # tables with only UVM options keep them


def estimate_options(
    module: Any,
    sharders: Sequence[Any],
    topology: Any,
    batch_size: int,
    constraints: Optional[Dict[str, Any]] = None,
    estimator: Any = None,
    share_estimates: Optional[bool] = None,
    prune_uvm: Optional[bool] = None,
) -> Tuple[List[Any], Dict[str, float]]:
    """TorchRec's ``EmbeddingEnumerator`` options for ``module`` that the makespan problem can
    place (:func:`placeable`), every shard estimated.

    ``estimator``: a ``ShardEstimator`` or a list of them (as ``EmbeddingEnumerator`` takes it;
    like there, it replaces *both* defaults, so include a storage estimator); None: TorchRec's
    defaults. ``share_estimates``: estimate one shard per distinct shard size and copy it to its
    identical shards (default: on for TorchRec's default estimators, off for others, whose
    per-shard independence is not known). ``prune_uvm`` (default: with TorchRec's default
    estimators): storage first, then perf only for the UVM options of tables where memory is
    tight (:func:`_uvm_needed`); other UVM options are left out. Returns (options, timings).
    """
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

    ests = _as_list(estimator) or default_estimators(topology, constraints)
    default = _is_default(ests)
    share = default if share_estimates is None else bool(share_estimates)
    prune = (default and share) if prune_uvm is None else bool(prune_uvm and default and share)
    t0 = time.perf_counter()
    cap = _CaptureOptions()
    enum = EmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints,
                               estimator=[cap])
    try:
        enum.enumerate(module, list(sharders))
    except _Captured:
        pass
    data_map = build_sharder_data_map({sharder_name(s.module_type): s for s in sharders})
    W, L = topology.world_size, topology.local_world_size
    options = [o for o in cap.options if placeable(o, W, L)]
    t1 = time.perf_counter()
    timings: Dict[str, float] = {"enumerate_s": t1 - t0, "options_enumerated": float(len(cap.options))}
    if share:
        reps = _representatives(options)
        if prune:
            storage = [e for e in ests if isinstance(e, EmbeddingStorageEstimator)]
            perf = [e for e in ests if not isinstance(e, EmbeddingStorageEstimator)]
            # storage of the non-UVM options first: it decides which UVM options are needed,
            # and only those are estimated at all
            for e in storage:
                e.estimate([r for o, r, _ in reps if o.compute_kernel not in UVM_KERNELS],
                           sharder_data_map=data_map)
            hbm = [d.storage.hbm for d in topology.devices]
            need = _uvm_needed(reps, float(min(hbm)), float(sum(hbm)))  # reads non-UVM storage only
            uvm = [x for x in reps if x[0].compute_kernel in UVM_KERNELS and (x[0].path, x[0].name) in need]
            for e in storage:
                e.estimate([r for _, r, _ in uvm], sharder_data_map=data_map)
            reps = [x for x in reps if x[0].compute_kernel not in UVM_KERNELS
                    or (x[0].path, x[0].name) in need]
            timings["uvm_options_left_out"] = float(len(options) - len(reps))
            for e in perf:
                e.estimate([r for _, r, _ in reps], sharder_data_map=data_map)
        else:
            for e in ests:
                e.estimate([r for _, r, _ in reps], sharder_data_map=data_map)
        _copy_back(reps)
        options = [o for o, _, _ in reps]
        timings["shard_estimates"] = float(sum(len(r.shards) for _, r, _ in reps))
    else:
        for e in ests:
            e.estimate(options, sharder_data_map=data_map)
        timings["shard_estimates"] = float(sum(len(o.shards) for o in options))
    t2 = time.perf_counter()
    timings["estimate_s"] = t2 - t1
    timings["shared"] = float(share)
    for o in options:
        for s in o.shards:
            if s.perf is None or s.storage is None:
                raise ValueError(
                    f"table {o.name!r} ({o.sharding_type}/{o.compute_kernel}): the estimators left a "
                    "shard without perf or storage; pass both a perf and a storage estimator "
                    "(estimator=[MyPerfEstimator(...), EmbeddingStorageEstimator(...)])"
                )
    return options, timings


def makespan_context(profile: Any, world_size: int, local_world_size: int, batch_size: int) -> Any:
    """A cost context whose ``base``-pipeline step time is the maximum over ranks of the ``FWD``
    column: every fixed, latency, overlap and dense term of the profile is zero."""
    zero = {}
    for f in attrs.fields(type(profile)):
        if (f.name.endswith("overhead_s") or f.name.endswith("latency_s") or f.name.endswith("_id_s")) \
                and isinstance(getattr(profile, f.name), (int, float)):
            zero[f.name] = 0.0
    prof = attrs.evolve(profile, name="torchrec-estimator", supports_overlap=False, **zero)
    return CostContext(profile=prof, world_size=world_size, local_world_size=local_world_size,
                       batch_size=batch_size, dense=DenseWork())


@attrs.frozen
class TorchRecProblem:
    """A :class:`PlanningProblem` over TorchRec's estimated options.

    ``option_of[c]``: the ``ShardingOption`` of candidate ``c``; ``bound_problem``: the same
    problem with each candidate's *smallest* shard perf when an option's shards differ (its
    bounds are valid for the real rating; None when every option's shards are alike);
    ``skipped``: options left out and why; ``timings``: enumeration/estimation seconds.
    """

    problem: Any = attrs.field(eq=False)
    option_of: Tuple[Any, ...] = attrs.field(eq=False, repr=False)
    bound_problem: Any = attrs.field(eq=False, default=None)
    skipped: Tuple[str, ...] = ()
    timings: Dict[str, float] = attrs.field(factory=dict, eq=False)
    identity: str = ""


def makespan_problem(
    options: Sequence[Any],
    specs: Sequence[Any],
    profile: Any,
    world_size: int,
    local_world_size: int,
    batch_size: int,
    device_cap: np.ndarray,
    host_cap: np.ndarray,
    identity: str = "",
    timings: Optional[Dict[str, float]] = None,
) -> TorchRecProblem:
    """Candidates from estimated ``options`` (see module docs), tables in ``specs`` order.

    Options whose largest shard cannot fit one rank are dropped (TorchRec's partitioner would
    reject them); a table left without options raises the planner's insufficient-storage error
    naming it."""
    W, L = world_size, min(local_world_size, world_size)
    ctx = makespan_context(profile, W, L, batch_size)
    index = {(s.module_path, s.name): t for t, s in enumerate(specs)}
    max_dev = float(np.max(device_cap)) if len(device_cap) else 0.0
    max_host = float(np.max(host_cap)) if len(host_cap) else 0.0
    cands: List[Any] = []
    costs: List[Any] = []
    low: List[Any] = []
    opt_of: List[Any] = []
    per_table: List[List[int]] = [[] for _ in specs]
    skipped: List[str] = []
    smallest: Dict[int, Tuple[float, str]] = {}
    uneven = False
    for o in options:
        t = index.get((o.path, o.name))
        if t is None:
            skipped.append(f"{o.path}.{o.name}: not a table of the module's specs")
            continue
        st, n = o.sharding_type, len(o.shards)
        if st in (TABLE_WISE, COLUMN_WISE) or (st == TABLE_COLUMN_WISE and n == 1):
            placement = "free"
        elif st in ON_EVERY_RANK_TYPES:
            placement = "all"
            if n != W:
                skipped.append(f"{o.name} {st}/{o.compute_kernel}: {n} shards on {W} ranks")
                continue
        elif st == TABLE_ROW_WISE or (st == TABLE_COLUMN_WISE and n == L):
            placement = "host"
            if n != L:
                skipped.append(f"{o.name} {st}/{o.compute_kernel}: {n} shards, {L} ranks per host")
                continue
        else:
            skipped.append(f"{o.name} {st}/{o.compute_kernel} ({n} shards): placement not modelled")
            continue
        perf = np.array([s.perf.total for s in o.shards], dtype=float) / _MS
        hbm = max(float(s.storage.hbm) for s in o.shards)
        ddr = max(float(s.storage.ddr) for s in o.shards)
        key = f"{st}/{o.compute_kernel}"
        over = max(hbm - max_dev, ddr - max_host)
        if t not in smallest or over < smallest[t][0]:
            smallest[t] = (over, key, hbm, ddr)
        if hbm > max_dev + 1e-6 or ddr > max_host + 1e-6:
            continue
        owner = np.zeros(K)
        owner[FWD] = float(perf.max())
        owner[DEV_MEM], owner[HOST_MEM] = hbm, ddr
        lo = owner.copy()
        lo[FWD] = float(perf.min())
        uneven = uneven or bool(perf.max() > perf.min() * (1 + 1e-12))
        size0 = o.shards[0].size
        per_table[t].append(len(cands))
        cands.append(Candidate(table=t, sharding_type=st, compute_kernel=o.compute_kernel, num_shards=n,
                               shard_rows=int(size0[0]), shard_cols=int(size0[1]), placement=placement))
        costs.append(ShardCost(owner=owner, peers=np.zeros(K)))
        low.append(ShardCost(owner=lo, peers=np.zeros(K)))
        opt_of.append(o)
    misfits = []
    for t, ids in enumerate(per_table):
        if ids:
            continue
        sp = specs[t]
        if t not in smallest:
            misfits.append(f"{sp.fqn}: TorchRec's enumerator offers no option this planner can place")
        else:
            _, key, hbm, ddr = smallest[t]
            misfits.append(f"{sp.fqn} ({sp.num_embeddings} x {sp.embedding_dim}): its best-fitting shard "
                           f"({key}) needs {hbm / 2**30:.2f} GiB HBM and {ddr / 2**30:.2f} GiB DDR under "
                           f"TorchRec's storage estimate; a rank has {max_dev / 2**30:.2f} GiB HBM and "
                           f"{max_host / 2**30:.2f} GiB DDR after the storage reservation")
    if misfits:
        raise _no_fit_error(misfits)
    prob = PlanningProblem(
        specs=tuple(specs), ctx=ctx, cands=tuple(cands), costs=tuple(costs),
        candidates=tuple(tuple(ids) for ids in per_table),
        device_cap=np.asarray(device_cap, dtype=float), host_cap=np.asarray(host_cap, dtype=float),
        pipelines=(BASE,), precisions=((FP32, FP32),),
    )
    bound = attrs.evolve(prob, costs=tuple(low)) if uneven else None
    return TorchRecProblem(problem=prob, option_of=tuple(opt_of), bound_problem=bound,
                           skipped=tuple(skipped), timings=dict(timings or {}), identity=identity)


def placed_options(trp: TorchRecProblem, assignment: Sequence[Tuple[int, Sequence[int]]]) -> List[Any]:
    """The chosen ``ShardingOption`` per table, copied, with ``shard.rank`` set (shard ``i`` of a
    candidate on ``ranks[i]``)."""
    out = []
    for cid, ranks in assignment:
        o = trp.option_of[cid]
        so = copy.copy(o)
        so.shards = [copy.copy(s) for s in o.shards]
        for s, r in zip(so.shards, ranks):
            s.rank = int(r)
        out.append(so)
    return out


def noop_rating_ms(options: Sequence[Any], world_size: int) -> float:
    """``NoopPerfModel``'s rating of placed options: max over ranks of summed ``Perf.total``."""
    per = np.zeros(world_size)
    for o in options:
        for s in o.shards:
            per[s.rank] += s.perf.total
    return float(per.max()) if world_size else 0.0


def build_torchrec_problem(
    module: Any,
    sharders: Sequence[Any],
    specs: Sequence[Any],
    topology: Any,
    reserved: Any,
    batch_size: int,
    profile: Any,
    constraints: Optional[Dict[str, Any]] = None,
    estimator: Any = None,
    share_estimates: Optional[bool] = None,
    column_splits: bool = True,
) -> TorchRecProblem:
    """:func:`estimate_options` on ``topology`` then :func:`makespan_problem` under the
    per-rank memory of ``reserved`` (the topology after the storage reservation).
    ``column_splits``: also offer SparseLift's column-wise splits (2, 4, 8, ... equal shards,
    :func:`column_split_options`) that TorchRec's enumerator does not, priced by the same
    estimators."""
    options, timings = estimate_options(module, sharders, topology, batch_size, constraints,
                                        estimator, share_estimates)
    if column_splits:
        t0 = time.perf_counter()
        extra = column_split_options(module, sharders, topology, batch_size, constraints, options,
                                     estimator, specs=specs)
        options = options + extra
        timings["column_split_options"] = float(len(extra))
        timings["column_split_s"] = time.perf_counter() - t0
    dev, host = device_caps(reserved)
    if topology.compute_device == "cpu":  # TorchRec's CPU storage is DDR only
        dev = np.full(len(dev), np.inf)
    return makespan_problem(options, specs, profile, topology.world_size, topology.local_world_size,
                            batch_size, dev, host, identity=estimator_identity(estimator),
                            timings=timings)



def perf_core(prob: Any, memory: bool = False) -> Tuple[Any, List[int]]:
    """The candidates no other candidate of the same table beats on shard time with the same
    placement and shard count. ``memory=False``: memory limits lifted; every plan of ``prob``
    maps to a plan of the core with no larger makespan (swap each option for its dominating
    one), so the core's optimum (or MILP dual bound) is a lower bound for ``prob``.
    ``memory=True``: a candidate dominates only if it also needs no more device and host memory
    per shard, and the limits stay: the core has the same optimum as ``prob`` and its plans are
    plans of ``prob``. Returns (core, core id -> id)."""
    def key(c):
        o = prob.costs[c].owner
        return (o[FWD], o[DEV_MEM], o[HOST_MEM]) if memory else (o[FWD],)

    keep: List[int] = []
    per_table: List[Tuple[int, ...]] = []
    for ids in prob.candidates:
        mine = []
        for c in ids:
            a = prob.cands[c]
            kc = key(c)
            dominated = False
            for d in ids:
                if d == c or prob.cands[d].placement != a.placement or prob.cands[d].num_shards != a.num_shards:
                    continue
                kd = key(d)
                if all(x <= y for x, y in zip(kd, kc)) and (kd != kc or d < c):
                    dominated = True
                    break
            if not dominated:
                mine.append(len(keep))
                keep.append(c)
        per_table.append(tuple(mine))
    caps = {}
    if not memory:
        inf = np.full(prob.ctx.world_size, np.inf)
        caps = {"device_cap": inf, "host_cap": inf.copy()}
    core = attrs.evolve(prob, cands=tuple(prob.cands[c] for c in keep),
                        costs=tuple(prob.costs[c] for c in keep), candidates=tuple(per_table), **caps)
    return core, keep


TORCHREC_EXACT_MAX_BINARIES = 6000


def _restrict(prob: Any, ids: Sequence[int]) -> Optional[Any]:
    """``prob`` with only candidates ``ids`` (renumbered); None if a table would have none."""
    pos = {c: j for j, c in enumerate(ids)}
    per = tuple(tuple(pos[c] for c in cs if c in pos) for cs in prob.candidates)
    if any(not cs for cs in per):
        return None
    return attrs.evolve(prob, cands=tuple(prob.cands[c] for c in ids),
                        costs=tuple(prob.costs[c] for c in ids), candidates=per)


def solve_torchrec(trp: TorchRecProblem, time_budget_s: float, solver: str = "auto") -> Any:
    """The makespan problem of ``trp`` (TorchRec's rating), in four steps:

    1. the makespan bound (:mod:`.makespan_bound`: averages, largest piece plus the uniform
       load, bin packing; over the smallest shard estimates when an option's shards differ);
       its relaxed choice is also a seed;
    2. :func:`~torchrec_sparselift.search.solve.solve` (LP, greedy, local search) and
       :func:`_rigid_first` (LP / least-work / bound / TorchRec-style uniform seeds, rigid
       options first, local search);
    3. where it is small enough (:data:`TORCHREC_EXACT_MAX_BINARIES`), the exact makespan MILP
       (:mod:`.makespan_milp`) over choice and placement on the memory-aware :func:`perf_core`,
       capped at the best plan so far: its plan is taken when better, its dual bound (proven
       gap) is a bound when every option's shards are alike;
    4. the bound is the largest valid one found, never above the plan."""
    t0 = time.monotonic()
    prob = trp.problem
    bprob = trp.bound_problem if trp.bound_problem is not None else prob
    # (at scale the bound MILP needs ~1.5 s of CPU: at least 2.5 s when the budget allows)
    lb = makespan_bound(bprob, time_limit_s=max(0.5, 0.3 * time_budget_s, min(0.5 * time_budget_s, 2.5)))
    bounds, methods = [lb.bound_s], [lb.method]
    heur_solver = "heuristic" if solver == "auto" else solver
    def exact_stages(memory: bool) -> List[Tuple[str, Any, List[int], bool]]:
        # TorchRec's own options first (smaller: it often closes them), then every option, each
        # capped at the best plan so far; only the full one's dual bound is a bound
        core, keep = perf_core(prob, memory=memory)
        out = [("every", core, keep, True)]
        if trp.option_of:
            own = [j for j, c in enumerate(keep)
                   if not getattr(trp.option_of[c], "sparselift_column_split", False)]
            sub = _restrict(core, own)
            if 0 < len(own) < len(keep) and sub is not None:
                out.insert(0, ("TorchRec's", sub, [keep[j] for j in own], False))
        return [st for st in out if makespan_milp_size(st[1]) <= TORCHREC_EXACT_MAX_BINARIES
                and solver in ("auto", "milp")]

    stages = exact_stages(memory=False)
    # with an exact stage to run, the heuristics only need to give it a good cap
    heur = (0.1 if stages else 0.2) * time_budget_s
    try:
        res = solve(prob, time_budget_s=heur, pipeline=BASE, solver=heur_solver)
        failed = None
    except SparseLiftPlannerError as e:  # the generic greedy could not fit: try rigid-first
        res, failed = None, e
    extra = [("bound", list(lb.choice))] if lb.choice else []
    alt = _rigid_first(prob, heur, extra_seeds=extra)
    if res is None:
        if alt is None:
            raise failed
        res = _result_from(prob, alt[0], f"lp+rigid-first greedy({alt[1]})+local_search", t0)
    elif alt is not None and alt[0].objective() < res.step.total_s * (1 - 1e-9):
        ev, seed = alt
        res = attrs.evolve(res, assignment=tuple(ev.assignment[t] for t in range(prob.num_tables)),
                           step=ev.step_time(), rank_loads=ev.rank_loads(),
                           solver=f"lp+rigid-first greedy({seed})+local_search")
    if trp.bound_problem is None and np.isfinite(res.lower_bound_s):
        bounds.append(res.lower_bound_s)
    name = res.solver
    # memory rows only where the best plan so far uses over half of some rank's memory: elsewhere
    # the memory-free core (a relaxation, so its dual bound stays a bound) is faster, and its
    # plan is checked against the limits before it is taken
    loads = res.rank_loads
    tight = bool(stages) and bool(np.any(loads[:, DEV_MEM] > 0.5 * prob.device_cap)
                                  or np.any(loads[:, HOST_MEM] > 0.5 * prob.host_cap))
    if tight:
        stages = exact_stages(memory=True)
    for i, (label, sub, ids, full) in enumerate(stages):
        if res.step.total_s <= max(bounds) * (1 + 1e-4):
            break
        left = max(0.5, time_budget_s - (time.monotonic() - t0))
        share = 0.6 if i + 1 < len(stages) else 1.0
        m = solve_makespan_milp(sub, time_limit_s=share * left, upper=res.step.total_s, memory=tight,
                                lower=max(bounds) if trp.bound_problem is None else 0.0, rel_gap=1e-3)
        if full and trp.bound_problem is None:
            bounds.append(m.bound_s * (1 - 1e-7))
            methods.append(f"makespan-milp over choice and placement({m.status})")
        if m.assignment:
            ev = new_evaluator(prob, BASE)
            for t, (c, rk) in enumerate(m.assignment):
                ev.assign(t, ids[c], rk)
            if ev.memory_ok() and ev.objective() < res.step.total_s * (1 - 1e-9):
                res = attrs.evolve(res, assignment=tuple(ev.assignment[t] for t in range(prob.num_tables)),
                                   step=ev.step_time(), rank_loads=ev.rank_loads(), status="converged")
                name = f"makespan-milp({m.status}) over {len(ids)} undominated options ({label})"
    bound = float(np.nanmax(bounds))
    return attrs.evolve(res, lower_bound_s=float(min(bound, res.step.total_s)),
                        solver=name + "; bound: " + ", ".join(methods),
                        planning_time_s=time.monotonic() - t0)


def specs_from_options(options: Sequence[Any]) -> Tuple[List[Any], List[Tuple[str, str]]]:
    """One :class:`TableSpec` per table of ``options`` (sorted by (path, name)), from what the
    options carry: shape, features, pooling, batch, the sharding types and kernels offered."""
    tables: Dict[Tuple[str, str], List[Any]] = {}
    for o in options:
        tables.setdefault((o.path, o.name), []).append(o)
    keys = sorted(tables)
    specs = []
    for key in keys:
        opts = tables[key]
        o = opts[0]
        types = tuple(sorted({x.sharding_type for x in opts}))
        kernels = tuple((st, tuple(sorted({x.compute_kernel for x in opts if x.sharding_type == st})))
                        for st in types)
        specs.append(TableSpec(
            module_path=o.path, name=o.name, num_embeddings=int(o.tensor.shape[0]),
            embedding_dim=int(o.tensor.shape[1]), feature_names=tuple(o.feature_names or [o.name]),
            pooling_factor=float(sum(o.input_lengths)), is_pooled=bool(o.is_pooled),
            elem_bytes=int(o.tensor.element_size()), sharding_types=types, compute_kernels=kernels,
            batch_size=int(o.batch_size),
        ))
    return specs, keys


def _rigid_first(prob: Any, budget_s: float,
                 extra_seeds: Sequence[Tuple[str, List[int]]] = ()) -> Optional[Tuple[Any, str]]:
    """Makespan seeds (the LP's choice, the least-work choice, and TorchRec's uniform proposals:
    one sharding type for every table), each placed rigid options first (row-wise/data-parallel
    on every rank, then table-row-wise on a host), then the free pieces biggest first on the
    least loaded rank that fits (LPT); a table whose option does not fit takes its best-fitting
    alternative. The shared local search then polishes the two best. Rigid options placed last would find every rank already full and
    fall back to slow UVM kernels. Returns (evaluator, seed name) of the better seed."""
    t0 = time.monotonic()
    lp = solve_lp(prob, BASE, time_limit_s=max(5.0, budget_s))
    seeds = []
    if lp.choice:
        seeds.append(("lp", list(lp.choice)))
    least = [min(ids, key=lambda i: (prob.shard_time(i) * prob.cands[i].num_shards, i))
             for ids in prob.candidates]
    seeds.append(("least_work", least))
    seeds.extend((name, list(ch)) for name, ch in extra_seeds if len(ch) == prob.num_tables)
    # TorchRec's uniform proposals: one sharding type for every table that offers it (its
    # fastest kernel), the least-work option elsewhere
    for st in sorted({c.sharding_type for c in prob.cands}):
        ch = []
        for t, ids in enumerate(prob.candidates):
            mine = [i for i in ids if prob.cands[i].sharding_type == st]
            ch.append(min(mine, key=lambda i: (prob.shard_time(i), i)) if mine else least[t])
        seeds.append((f"all {st}", ch))
    rank = {"all": 0, "host": 1, "free": 2}
    placed = []
    for name, choice in seeds:
        ev = new_evaluator(prob, BASE)
        order = sorted(range(prob.num_tables), key=lambda t: (
            rank[prob.cands[choice[t]].placement], -prob.shard_time(choice[t]),
            -ev.owner[choice[t]][DEV_MEM], t))
        ok = True
        for t in order:
            got = best_placement(ev, prob, t, choice[t])
            if got is not None:
                ev.assign(t, choice[t], got[0])
                continue
            fit = None
            for alt in prob.candidates[t]:
                g = best_placement(ev, prob, t, alt)
                if g is not None and (fit is None or g[1] < fit[2]):
                    fit = (alt, g[0], g[1])
            if fit is None:
                ok = False
                break
            ev.assign(t, fit[0], fit[1])
        if ok:
            placed.append((ev.objective(), len(placed), name, ev))
    if not placed:
        return None
    placed.sort(key=lambda x: (x[0], x[1]))
    best = None
    top = placed[:2]
    # the bound's choice is the best-informed seed: polished even when its greedy start is not
    top += [x for x in placed[2:] if x[2] == "bound"][:1]
    for _, _, name, ev in top:  # local search on the two best seeds (and the bound's)
        # deterministic work units; the wall clock (10x the budget) only as a safety net
        work = WorkBudget(int(WORK_UNITS_PER_SECOND * budget_s / len(top)), t0 + 10.0 * budget_s)
        local_search(ev, prob, deadline=work.deadline, budget=work)
        if best is None or ev.objective() < best[0].objective():
            best = (ev, name)
    return best


def _result_from(prob: Any, ev: Any, solver: str, t0: float) -> Any:
    """A :class:`SearchResult` for a plan held by an evaluator (bound filled in later)."""
    return SearchResult(
        assignment=tuple(ev.assignment[t] for t in range(prob.num_tables)), step=ev.step_time(),
        lower_bound_s=float("nan"), pipeline=BASE, fwd_precision=FP32, bwd_precision=FP32,
        solver=solver, status="converged" if ev.memory_ok() else "memory_violation",
        planning_time_s=time.monotonic() - t0, moves=0, rank_loads=ev.rank_loads())


def rate_placed(options: Sequence[Any], topology: Any, sharders: Sequence[Any],
                constraints: Optional[Dict[str, Any]] = None, estimator: Any = None) -> Dict[str, float]:
    """Re-estimate placed ``options`` (copies; the inputs are not modified) with TorchRec's
    default estimators (or ``estimator``), one estimate per distinct shard size, and rate them as
    ``NoopPerfModel`` does. Returns ``perf_ms`` and the peak per-rank ``hbm``/``ddr`` bytes: the
    same numbers as :func:`torchrec_sparselift.cost.torchrec_score.torchrec_score`, faster on
    row-wise/data-parallel shards over many ranks."""
    from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

    opts = []
    for o in options:
        so = copy.copy(o)
        so.shards = [copy.copy(s) for s in o.shards]
        opts.append(so)
    ests = _as_list(estimator) or default_estimators(topology, constraints)
    reps = _representatives(opts)
    data_map = build_sharder_data_map({sharder_name(s.module_type): s for s in sharders})
    for e in ests:
        e.estimate([r for _, r, _ in reps], sharder_data_map=data_map)
    _copy_back(reps)
    W = topology.world_size
    hbm, ddr = np.zeros(W), np.zeros(W)
    for o in opts:
        for s in o.shards:
            hbm[s.rank] += s.storage.hbm
            ddr[s.rank] += s.storage.ddr
    return {"perf_ms": noop_rating_ms(opts, W), "peak_hbm_bytes": float(hbm.max()),
            "peak_ddr_bytes": float(ddr.max())}


def column_split_options(module: Any, sharders: Sequence[Any], topology: Any, batch_size: int,
                         constraints: Optional[Dict[str, Any]], existing: Sequence[Any],
                         estimator: Any = None, specs: Optional[Sequence[Any]] = None) -> List[Any]:
    """SparseLift's column-wise options (equal splits into 2, 4, 8, ... shards, width a
    multiple of 4 and at least ``min_partition``; see ``search.problem.column_splits``) whose
    shard count TorchRec's enumerator did not offer for the table, as TorchRec
    ``ShardingOption`` s estimated by ``estimator`` (default: TorchRec's). TorchRec's runtime
    shards a table column-wise into any equal widths; its enumerator only tries one width.
    Each is a copy of TorchRec's own column-wise option of the table and kernel with the shards
    re-cut (``specs``: the tables' :class:`TableSpec` s, for ``min_partition``)."""
    from torchrec.distributed.planner.types import Shard

    spec_of = {(sp.module_path, sp.name): sp for sp in (specs or ())}
    if specs is None:
        spec_of = {(h.spec.module_path, h.spec.name): h.spec for h in extract_tables(
            module, list(sharders), topology.compute_device, batch_size, constraints)}
    have = {(o.path, o.name, o.compute_kernel, len(o.shards)) for o in existing
            if o.sharding_type == COLUMN_WISE}
    first = {}
    for o in existing:
        if o.sharding_type == COLUMN_WISE:
            first.setdefault((o.path, o.name, o.compute_kernel), o)
    out = []
    for (path, name, kernel), o in first.items():
        sp = spec_of.get((path, name))
        if sp is None:
            continue
        rows, dim = int(o.tensor.shape[0]), int(o.tensor.shape[1])
        for k in column_splits(sp, topology.world_size, topology.compute_device):
            if (path, name, kernel, k) in have:
                continue
            w = dim // k
            so = copy.copy(o)
            so.shards = [Shard(size=[rows, w], offset=[0, i * w]) for i in range(k)]
            so.sparselift_column_split = True  # not one of TorchRec's enumerated options
            out.append(so)
    if not out:
        return out
    from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

    ests = _as_list(estimator) or default_estimators(topology, constraints)
    data_map = build_sharder_data_map({sharder_name(s.module_type): s for s in sharders})
    if _is_default(ests):
        reps = _representatives(out)
        for e in ests:
            e.estimate([r for _, r, _ in reps], sharder_data_map=data_map)
        _copy_back(reps)
    else:
        for e in ests:
            e.estimate(out, sharder_data_map=data_map)
    return out
