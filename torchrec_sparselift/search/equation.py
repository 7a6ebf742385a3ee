"""The step equation as data: one builder every solver takes its rows from.

Like ``scipy.optimize.milp``'s inputs, an :class:`Equation` is a problem as data: named variables
(blocks such as ``x[c]``, ``z[fwd_s]``, each with bounds and integrality) and rows
``lb <= sum(coef * var) <= ub``. The LP (:mod:`.lp`), the placement MILP (:mod:`.milp`), the
integral-choice bound (:mod:`.choice_bound`) and the makespan bound and MILP
(:mod:`.makespan_bound`, :mod:`.makespan_milp`) declare their variables on it and add their own
relaxation's rows; the step time itself is written once, here:

* ``z[col]``: the maximum over ranks of load column ``col`` (:func:`load_maxima`), in
  milliseconds, link columns divided by their bandwidth (:func:`column_scale`); the columns and
  their meaning come from :data:`torchrec_sparselift.cost.terms.LOAD_COLUMNS`. Where a host's
  ranks share their inter-host link (``cost.model.shared_link_columns``) a rank's load in those
  columns is its host's mean (:func:`rank_load_rows`, :func:`piece_loads`);
* ``y[phases]``: one per link group, at least each of its columns' ``z`` (:func:`link_rows`);
* ``allreduce``: the exposed gradient all-reduce (:func:`allreduce_rows`);
* ``total``: at least every path of the pipeline's composition
  (:mod:`torchrec_sparselift.cost.pipelines`), each phase's linear form from :func:`phase_forms`:
  its compute columns' ``z``, its link group's ``y`` times the phase's comm precision, its
  collective latencies (``cost.model.collective_call_form``) and its constant
  (``cost.model.phase_constants``), the same parts :func:`torchrec_sparselift.cost.model.phase_table`
  adds up for the evaluator.

The sparse-path rewrites are terms of the same rows:

* **ids on the wire** (narrow ids, per-feature dedup): each option's input-dist load columns hold
  its bytes after the rewrites and its dedup kernels' seconds (``cost.wire_ids.table_wire``,
  ``cost.model.rewrite_wire``, built into ``PlanningProblem.costs`` by ``build_problem(wire=...)``),
  so every row that reads an option's loads reads them with no edit here;
* **batch split** (``FixedTerms.split``): where the search prices the ``overlap`` pipeline at its
  best chunk count (``search.solve.split_price``), that pipeline's composition rows give way to
  the rows every k satisfies, ``total >= min(1, factor) * sum(path)`` for each path of
  :data:`SPLIT_FLOOR_PATHS` (the input dist; the compute flow; the output and gradient
  collectives on one link between the lookup and the update; :func:`split_floor_s`).

A load column added to the registry is then in every solver's rows with no further edit.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_matrix

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.batch_split import BATCH_SPLIT_PIPELINE
from torchrec_sparselift.cost.model import (PRECISION_BYTES, collective_call_form, lossy_column_rates,
                                            phase_constants, piece_loads, shared_link_columns)
from torchrec_sparselift.cost.pipelines import (PHASE_NAMES, PHASE_PARTS, PHASES, PIPELINES, effective_pipeline, paths,
                                                step_factor)
from torchrec_sparselift.cost.terms import PHASE_PRECISION, layout

__all__ = [
    "Equation", "RangeRows", "StepVars", "FixedTerms", "fixed_terms", "column_scale", "load_maxima",
    "step_vars", "link_rows", "allreduce_rows", "precision_scales", "lossy_per_z", "lossy_coefficients", "phase_forms",
    "composition_rows", "step_rows",
    "choice_rows", "total_memory_rows", "piece_loads", "rank_load_rows", "MS", "GIB",
    "SPLIT_FLOOR_PATHS", "split_floor_s", "split_floor_rows",
]

#: The paths the batch-split step never goes below at any k (``cost.batch_split``: the lookups and
#: the dense work run on one flow; every chunk's output and then its gradient cross one link after
#: the lookup, and the update or the exposed all-reduce follows the last gradient), each a tuple
#: of phase names (``cost.pipelines.PHASE_NAMES``; ``allreduce`` as ``cost.pipelines.terms``
#: exposes it). The search's split price is clamped to their largest sum
#: (``search.solve.split_price``) and the bound's rows for a split ``overlap`` take them
#: (:func:`split_floor_rows`), so both read one list.
_COMPUTE_FLOW = ("uvm_fetch", "lookup", "dense_fwd_indep", "dense_fwd_rest", "dense_bwd_rest", "dense_bwd_indep")
SPLIT_FLOOR_PATHS: Tuple[Tuple[str, ...], ...] = (
    ("input_dist",),
    _COMPUTE_FLOW + ("backward_update", "step_overhead"),
    _COMPUTE_FLOW + ("allreduce", "step_overhead"),
    ("uvm_fetch", "lookup", "output_dist", "grad_dist", "backward_update", "step_overhead"),
    ("uvm_fetch", "lookup", "output_dist", "grad_dist", "allreduce", "step_overhead"),
)


def split_floor_s(exposed: Mapping[str, float]) -> float:
    """The largest path sum of :data:`SPLIT_FLOOR_PATHS` over a rank's exposed phase times
    (``cost.pipelines.terms``; a missing phase counts 0)."""
    return max(sum(float(exposed.get(n, 0.0)) for n in path) for path in SPLIT_FLOOR_PATHS)


def split_floor_rows(forms, itot, factor=1.0):
    """Rows ``(entries, rhs)`` making ``itot`` >= ``min(1, factor)`` times every path of
    :data:`SPLIT_FLOOR_PATHS` (``forms`` from :func:`phase_forms`): a lower bound on the split
    step at every k (``search.solve.split_price``), hence on ``overlap`` with the split allowed."""
    f = min(1.0, float(factor))
    out = []
    for path in SPLIT_FLOOR_PATHS:
        entries, const = [], 0.0
        for t in path:
            e, c = forms[t]
            entries.extend((v, f * a) for v, a in e)
            const += c
        out.append((entries + [(itot, -1.0)], -f * const))
    return out

#: The solvers' time unit (ms) and memory unit (GiB): HiGHS drops matrix coefficients below
#: ~1e-9, so seconds and raw bytes / bandwidth would vanish.
MS = 1e3
GIB = 2.0**30

_COLLECTIVE = frozenset(p.name for p in PHASES if p.kind == "collective")


class RangeRows:
    """Sparse constraint rows ``lb <= sum_j v x_j <= ub``: ``add`` one row (zero coefficients
    dropped), then ``matrix(nv)`` with ``lo``/``hi`` for ``LinearConstraint``."""

    def __init__(self) -> None:
        self.rows: List[int] = []
        self.cols: List[int] = []
        self.vals: List[float] = []
        self.lo: List[float] = []
        self.hi: List[float] = []

    def add(self, entries, lb, ub) -> None:
        r = len(self.lo)
        for j, v in entries:
            if v != 0.0:
                self.rows.append(r)
                self.cols.append(int(j))
                self.vals.append(float(v))
        self.lo.append(lb)
        self.hi.append(ub)

    def add_arrays(self, cols, vals, lb, ub) -> None:
        """``add`` for one long row given as arrays (no Python loop per entry)."""
        cols, vals = np.asarray(cols, dtype=int), np.asarray(vals, dtype=float)
        keep = vals != 0.0
        r = len(self.lo)
        self.rows.extend([r] * int(keep.sum()))
        self.cols.extend(cols[keep].tolist())
        self.vals.extend(vals[keep].tolist())
        self.lo.append(lb)
        self.hi.append(ub)

    def matrix(self, nv: int):
        return coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), nv)).tocsr()


class Equation:
    """A linear (mixed-integer) program as data: named variable blocks and rows.

    ``var(name)`` declares one variable, ``block(name, keys)`` one per key (``name[key]``);
    both return indices in declaration order. ``add(entries, lb, ub)`` adds a row of
    ``(index, coefficient)`` entries. :meth:`solve_milp` / :meth:`solve_lp` minimize one variable.
    """

    def __init__(self) -> None:
        self.rows = RangeRows()
        self.lb: List[float] = []
        self.ub: List[float] = []
        self.integer: List[bool] = []
        self._blocks: List[Tuple[str, int, Optional[Sequence[Hashable]], int]] = []
        self._by_name: Dict[str, Tuple[int, Optional[Dict[Hashable, int]]]] = {}

    @property
    def nv(self) -> int:
        return len(self.lb)

    def _declare(self, name: str, n: int, lb: float, ub: float, integer: bool) -> int:
        if name in self._by_name:
            raise ValueError(f"variable {name!r} declared twice")
        start = self.nv
        self.lb.extend([float(lb)] * n)
        self.ub.extend([float(ub)] * n)
        self.integer.extend([bool(integer)] * n)
        return start

    def var(self, name: str, lb: float = 0.0, ub: float = np.inf, integer: bool = False) -> int:
        i = self._declare(name, 1, lb, ub, integer)
        self._blocks.append((name, i, None, 1))
        self._by_name[name] = (i, None)
        return i

    def block(self, name: str, keys: Sequence[Hashable], lb: float = 0.0, ub: float = np.inf,
              integer: bool = False, labels: Optional[Sequence[str]] = None) -> Dict[Hashable, int]:
        keys = list(keys)
        start = self._declare(name, len(keys), lb, ub, integer)
        idx = {k: start + i for i, k in enumerate(keys)}
        self._blocks.append((name, start, list(labels) if labels is not None else keys, len(keys)))
        self._by_name[name] = (start, idx)
        return idx

    def vector(self, name: str, n: int, lb: float = 0.0, ub: float = np.inf, integer: bool = False) -> int:
        """``n`` variables ``name[0..n-1]``; returns the first index (they are consecutive)."""
        start = self._declare(name, n, lb, ub, integer)
        self._blocks.append((name, start, None, n))
        self._by_name[name] = (start, None)
        return start

    def index(self, name: str, key: Hashable = None) -> int:
        start, keys = self._by_name[name]
        if key is None:
            return start
        return keys[key] if keys is not None else start + int(key)

    def name_of(self, i: int) -> str:
        for name, start, keys, n in self._blocks:
            if start <= i < start + n:
                if keys is None:
                    return name if n == 1 else f"{name}[{i - start}]"
                return f"{name}[{keys[i - start]}]"
        raise IndexError(f"no variable {i} (the equation has {self.nv})")

    def set_bounds(self, i: int, lb: Optional[float] = None, ub: Optional[float] = None) -> None:
        if lb is not None:
            self.lb[i] = float(lb)
        if ub is not None:
            self.ub[i] = float(ub)

    def add(self, entries, lb: float = -np.inf, ub: float = np.inf) -> None:
        self.rows.add(entries, lb, ub)

    def add_arrays(self, cols, vals, lb: float = -np.inf, ub: float = np.inf) -> None:
        self.rows.add_arrays(cols, vals, lb, ub)

    def objective(self, var: int) -> np.ndarray:
        c = np.zeros(self.nv)
        c[var] = 1.0
        return c

    def solve_milp(self, minimize: int, options: Mapping[str, Any]):
        """``scipy.optimize.milp`` minimizing variable ``minimize``."""
        return milp(self.objective(minimize),
                    constraints=LinearConstraint(self.rows.matrix(self.nv), self.rows.lo, self.rows.hi),
                    integrality=np.asarray(self.integer, dtype=float),
                    bounds=Bounds(np.asarray(self.lb), np.asarray(self.ub)), options=dict(options))

    def solve_lp(self, minimize: int, options: Mapping[str, Any]):
        """``scipy.optimize.linprog`` (HiGHS) minimizing ``minimize``, integrality dropped: rows
        with ``lb == ub`` become ``A_eq``, rows with only an upper bound ``A_ub``."""
        rr = self.rows
        eq_rows = [r for r in range(len(rr.lo)) if rr.lo[r] == rr.hi[r]]
        ub_rows = [r for r in range(len(rr.lo)) if rr.lo[r] != rr.hi[r]]
        if any(np.isfinite(rr.lo[r]) for r in ub_rows):
            raise ValueError("solve_lp takes rows with an upper bound only (or equalities)")
        A = rr.matrix(self.nv)
        bounds = [(lo, None if not np.isfinite(hi) else hi) for lo, hi in zip(self.lb, self.ub)]
        return linprog(self.objective(minimize), A_ub=A[ub_rows], b_ub=np.array([rr.hi[r] for r in ub_rows], dtype=float),
                       A_eq=A[eq_rows], b_eq=np.array([rr.hi[r] for r in eq_rows], dtype=float),
                       bounds=bounds, method="highs", options=dict(options))


def column_scale(profile, ncols: Optional[int] = None) -> np.ndarray:
    """Per load column, the factor from the cost vectors to the solvers' units: milliseconds for
    time, link columns pre-divided by their bandwidth (:data:`MS`)."""
    scale = layout().scale(profile, MS)
    if ncols is not None and ncols != len(scale):
        raise ValueError(f"column_scale: {ncols} columns asked, the load vectors have {len(scale)}")
    return scale


@attrs.frozen
class FixedTerms:
    """The step time's constants in the solvers' units (milliseconds), one definition for the LP,
    the MILP and the integral-choice bound (the evaluator's are
    :func:`torchrec_sparselift.cost.model.phase_table`'s): ``dense_fwd`` / ``dense_bwd`` (twice
    the forward), ``step_overhead``, ``lookup`` (one TBE group's fixed cost), ``group_cost`` (per
    load column, what a rank pays once per TBE group it holds), ``latency`` (one collective call;
    0 on one rank), ``allreduce_per_byte`` (ring all-reduce over the ranks DDP spans,
    ``CostContext.allreduce_s_per_byte``),
    ``dense_param_bytes``, ``hidden`` (what the dense backward hides of the all-reduce: 0 without
    overlap, pipelines.terms) and ``overlap``. Build it with :func:`fixed_terms`."""

    world_size: int
    dense_fwd: float
    dense_bwd: float
    step_overhead: float
    lookup: float
    latency: float
    allreduce_per_byte: float
    dense_param_bytes: float
    hidden: float
    overlap: bool
    group_cost: np.ndarray = attrs.field(eq=False, factory=lambda: np.zeros(0))
    parts: Mapping[str, float] = attrs.field(factory=dict)  # split phases' parts (ms), cost.pipelines.PHASE_PARTS
    spans_hosts: bool = False  # ranks on several hosts (cost.pipelines.effective_pipeline)
    step_factors: Mapping[str, float] = attrs.field(factory=dict)  # pipeline -> cost.pipelines.step_factor
    #: lossy comm precision -> link column -> ms per ms of that column's ``z`` a phase at that
    #: precision adds (``cost.model.lossy_byte_s * bandwidth``: z is the column's bytes over its
    #: bandwidth); :func:`lossy_per_z`
    lossy_per_z: Mapping[str, Mapping[int, float]] = attrs.field(factory=dict)
    #: the search prices ``overlap`` with its batch split (``PlanningProblem.split_overhead_s``):
    #: :func:`step_rows` gives that pipeline the split's rows (:func:`split_floor_rows`)
    split: bool = False

    @property
    def dense_allreduce(self) -> bool:
        """Dense parameters exist, so the all-reduce (and its latency) runs in every plan."""
        return self.dense_param_bytes > 0

    def constants(self) -> Dict[str, float]:
        """Each phase's constant (ms): ``cost.model.phase_constants`` in the solvers' unit."""
        return {"dense_fwd": self.dense_fwd, "dense_bwd": self.dense_bwd, "step_overhead": self.step_overhead,
                **self.parts}

    def allreduce_const(self, with_latency: bool) -> float:
        """The all-reduce row's constant: the dense parameters' ring time less ``hidden``, plus one
        latency when ``with_latency``."""
        return ((self.latency if with_latency else 0.0)
                + self.allreduce_per_byte * self.dense_param_bytes) - self.hidden


def fixed_terms(ctx, split: bool = False) -> FixedTerms:
    """:class:`FixedTerms` of a :class:`~torchrec_sparselift.cost.model.CostContext`; ``split``:
    the problem allows the batch split (``PlanningProblem.split_overhead_s`` is set)."""
    p = ctx.profile
    W = ctx.world_size
    const = phase_constants(ctx)
    dense_bwd = MS * const["dense_bwd"]
    overlap = bool(getattr(p, "supports_overlap", True))
    return FixedTerms(
        world_size=W, dense_fwd=MS * const["dense_fwd"], dense_bwd=dense_bwd,
        step_overhead=MS * const["step_overhead"], lookup=MS * p.lookup_overhead_s,
        latency=MS * p.collective_latency_s if W > 1 else 0.0,
        allreduce_per_byte=MS * ctx.allreduce_s_per_byte(),
        dense_param_bytes=float(ctx.dense.param_bytes),
        hidden=dense_bwd if overlap else 0.0, overlap=overlap,
        group_cost=MS * layout().group_costs(p),
        parts={q: MS * const[q] for qs in PHASE_PARTS.values() for q in qs}, spans_hosts=ctx.num_hosts > 1,
        step_factors={pl: step_factor(p, pl, ctx.num_hosts > 1) for pl in PIPELINES},
        lossy_per_z=lossy_per_z(p), split=bool(split),
    )


def lossy_per_z(profile) -> Dict[str, Dict[int, float]]:
    """:attr:`FixedTerms.lossy_per_z` of a profile: for each lossy comm precision, each link
    column's coefficient on its ``z`` (``cost.model.lossy_column_rates`` times the column's
    bandwidth: z is its bytes over that bandwidth)."""
    cols = layout().columns
    return {prec: {j: r * float(getattr(profile, cols[j].bandwidth))
                   for j, r in lossy_column_rates(profile, prec).items()}
            for prec, nbytes in PRECISION_BYTES.items() if nbytes < 4}


@attrs.frozen
class StepVars:
    """The step equation's variables in an :class:`Equation`: ``z`` (load column -> its maximum
    over ranks), ``link`` (link group -> its slowest column), ``allreduce``, ``total``, and the
    optional latency variables: ``latency`` (one collective latency per sharding group used) and
    ``any_group`` (binary, 1 when any sharding group is used)."""

    z: Mapping[int, int]
    link: Mapping[Tuple[str, ...], int]
    allreduce: int
    total: int
    latency: Optional[int] = None
    any_group: Optional[int] = None


def load_maxima(eq: Equation) -> Dict[int, int]:
    """Declare ``z[col]`` for every column the step time reads (cost.terms.layout().time)."""
    lay = layout()
    return eq.block("z", lay.time, labels=[lay.columns[j].name for j in lay.time])


def step_vars(eq: Equation, z: Mapping[int, int]) -> StepVars:
    """Declare one ``y`` per link group, then ``allreduce`` and ``total``."""
    lay = layout()
    link = {phases: eq.var("y[" + "+".join(phases) + "]") for phases, _ in lay.link_groups}
    ia = eq.var("allreduce")
    itot = eq.var("total")
    return StepVars(z=dict(z), link=link, allreduce=ia, total=itot)


def link_rows(eq: Equation, sv: StepVars) -> None:
    """``y[group] >= z[col]`` for every link column of every group."""
    for phases, cols in layout().link_groups:
        for j in cols:
            eq.add([(sv.z[j], 1.0), (sv.link[phases], -1.0)], -np.inf, 0.0)


def allreduce_rows(fixed: FixedTerms, allreduce: np.ndarray, ia: int, idp=None):
    """Rows ``(entries, ub)``, each ``sum(entries) <= ub``, that make variable ``ia`` >= the
    exposed all-reduce (ms): ``sum_c allreduce_per_byte * allreduce[c] x_c + allreduce_const``,
    ``allreduce[c]`` the bytes option ``c`` (variable ``c``) adds per rank. Its latency is in the
    constant when there are dense parameters; otherwise, with ``idp`` (a binary every option in
    the all-reduce forces to 1) it is charged through ``idp``, and without (the LP) always, which
    the LP takes off its bound. No rows on one rank."""
    if fixed.world_size <= 1:
        return []
    k = fixed.allreduce_per_byte
    nz = np.nonzero(allreduce)[0]
    rows = []
    lat_ent = []
    if idp is not None and not fixed.dense_allreduce:
        lat_ent = [(idp, fixed.latency)]
        rows.extend(([(int(i), 1.0), (idp, -1.0)], 0.0) for i in nz)
    const = fixed.allreduce_const(with_latency=idp is None or fixed.dense_allreduce)
    rows.append(([(int(i), k * allreduce[i]) for i in nz] + lat_ent + [(ia, -1.0)], -const))
    return rows


def precision_scales(fwd: str = defaults.COMM_PRECISION, bwd: str = defaults.COMM_PRECISION) -> Dict[str, float]:
    """The comm precisions as byte fractions of fp32, by the names in cost.terms.PHASE_PRECISION."""
    return {"fwd": PRECISION_BYTES[fwd] / 4, "bwd": PRECISION_BYTES[bwd] / 4}


def lossy_coefficients(per_z: Mapping[str, Mapping[int, float]], fwd: str = defaults.COMM_PRECISION,
                       bwd: str = defaults.COMM_PRECISION) -> Dict[str, Mapping[int, float]]:
    """Per comm-precision name of cost.terms.PHASE_PRECISION, the link columns' coefficients on
    their ``z`` at that phase's precision (``per_z`` from :func:`lossy_per_z`,
    ``FixedTerms.lossy_per_z``; empty at fp32): the term
    :func:`torchrec_sparselift.cost.model.phase_table` adds to a lossy link phase."""
    return {k: dict(per_z.get(prec, {})) for k, prec in (("fwd", fwd), ("bwd", bwd))}


def phase_forms(sv: StepVars, constants: Mapping[str, float], scales: Mapping[str, float],
                latency: float = 0.0, fused_splits: bool = True,
                lossy: Optional[Mapping[str, Mapping[int, float]]] = None) -> Dict[str, Tuple[list, float]]:
    """Each phase of :data:`~torchrec_sparselift.cost.pipelines.PHASES` as a linear form
    ``{phase: (entries, constant)}`` (ms): its compute columns' ``z``, its link group's ``y``
    scaled by the phase's comm precision (cost.terms.PHASE_PRECISION; ``scales`` from
    :func:`precision_scales`), ``allreduce`` for the
    collective phase, its collective latencies when ``sv.latency`` is set (``per_group *
    latency_var + once * latency * any_group``, cost.model.collective_call_form;
    ``fused_splits``: the pipeline's ``PipelineKind.fused_input_splits``), what a lossy precision
    adds on the phase's link columns' ``z`` (``lossy`` from :func:`lossy_coefficients`:
    ``cost.model.lossy_byte_s``) and ``constants[phase]``."""
    lay = layout()
    group_cols = dict(lay.link_groups)
    forms: Dict[str, Tuple[list, float]] = {}
    for name in PHASE_NAMES:
        entries = [(sv.z[j], 1.0) for j in lay.phase_columns.get(name, ())]
        group = lay.link_group(name)
        if group is not None:
            prec = PHASE_PRECISION.get(name)
            entries.append((sv.link[group], 1.0 if prec is None else scales[prec]))
            if prec is not None and lossy:
                entries.extend((sv.z[j], c) for j, c in lossy.get(prec, {}).items() if j in group_cols[group])
            if sv.latency is not None:
                per_group, once = collective_call_form(name, fused_splits)
                entries.append((sv.latency, float(per_group)))
                if once and sv.any_group is not None and latency:
                    entries.append((sv.any_group, latency * once))
        if name in _COLLECTIVE:
            entries.append((sv.allreduce, 1.0))
        forms[name] = (entries, constants.get(name, 0.0))
    return forms


def composition_rows(pl, forms, itot, supports_overlap=True, spans_hosts=False, factor=1.0):
    """Rows ``(entries, rhs)`` that make variable ``itot`` >= the step time of pipeline ``pl``:
    one row ``factor * sum(path) - total <= -factor * constants`` per path of its composition
    (:func:`torchrec_sparselift.cost.pipelines.paths`), ``forms`` from :func:`phase_forms`,
    ``factor`` the pipeline's measured step factor (:func:`~torchrec_sparselift.cost.pipelines.step_factor`)."""
    kind = effective_pipeline(pl, supports_overlap, spans_hosts)
    out = []
    for path in paths(kind.step):
        entries, const = [], 0.0
        for t in path:
            e, c = forms[t]
            entries.extend(e)
            const += c
        if factor != 1.0:
            entries = [(v, factor * a) for v, a in entries]
        out.append((entries + [(itot, -1.0)], -factor * const))
    return out


def step_rows(eq: Equation, sv: StepVars, pipeline: str, fixed: FixedTerms, fwd: str = defaults.COMM_PRECISION,
              bwd: str = defaults.COMM_PRECISION, fused_splits: bool = True) -> None:
    """Add the composition rows: ``total`` >= every path of ``pipeline``'s step; for ``overlap``
    with the batch split allowed (``fixed.split``) the rows every chunk count satisfies
    (:func:`split_floor_rows`)."""
    forms = phase_forms(sv, fixed.constants(), precision_scales(fwd, bwd), latency=fixed.latency,
                        fused_splits=fused_splits, lossy=lossy_coefficients(fixed.lossy_per_z, fwd, bwd))
    factor = fixed.step_factors.get(pipeline, 1.0)
    if fixed.split and pipeline == BATCH_SPLIT_PIPELINE:
        rows = split_floor_rows(forms, sv.total, factor)
    else:
        rows = composition_rows(pipeline, forms, sv.total, fixed.overlap, fixed.spans_hosts, factor)
    for entries, rhs in rows:
        eq.add(entries, -np.inf, rhs)


def choice_rows(eq: Equation, candidates: Sequence[Sequence[int]]) -> None:
    """One option per table: ``sum_{c in table} x[c] = 1`` (``x[c]`` is variable ``c``)."""
    for ids in candidates:
        eq.add([(c, 1.0) for c in ids], 1.0, 1.0)


def total_memory_rows(eq: Equation, prob, nshards: np.ndarray) -> None:
    """Per memory column, the chosen options' memory over all shards fits the ranks' total (GiB);
    skipped when a rank's capacity is unlimited or no option uses the column."""
    lay = layout()
    caps = {"device": prob.device_cap, "host": prob.host_cap}
    for col in lay.memory:
        cap = caps[lay.columns[col].capacity]
        coef = nshards * np.array([c.owner[col] for c in prob.costs]) / GIB
        nz = np.nonzero(coef)[0]
        if len(nz) and len(cap) and np.all(np.isfinite(cap)):
            eq.add(list(zip(nz.tolist(), coef[nz].tolist())), -np.inf, float(np.sum(cap)) / GIB)


def rank_load_rows(ctx, col: int) -> List[Tuple[List[int], float]]:
    """The groups of ranks whose summed load terms bound ``z[col]`` in an exact placement model,
    with the weight of each term: every rank alone (weight 1), or in a shared host link's columns
    each host's ranks together (weight ``1 / L``: the host's mean)."""
    W = ctx.world_size
    if col in shared_link_columns(ctx):
        L = ctx.ranks_per_host
        return [(list(range(h * L, (h + 1) * L)), 1.0 / L) for h in range(W // L)]
    return [([r], 1.0) for r in range(W)]
