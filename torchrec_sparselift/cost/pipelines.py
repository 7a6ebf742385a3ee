"""What overlaps with what in one training step, per train-pipeline kind: the one description.

A step is made of **phases** (:data:`PHASES`, seconds from :func:`~.model.phase_times`). Each
pipeline kind (:data:`PIPELINE_KINDS`; names and properties in
:data:`torchrec_sparselift.vocabulary.PIPELINE_REGISTRY`) arranges them as a
series-parallel composition:

* :class:`Seq` runs its parts one after the other;
* :class:`Par` runs its :class:`Lane` s side by side from the same start; it ends when the longest
  lane ends. ``lanes[0]`` is the step's own flow and wins ties; the other lanes hold work that
  runs alongside it (the next batch's ``input_dist``, the gradient all-reduce, ...).

A phase with ``hidden_under`` (the gradient ``allreduce`` under ``dense_bwd``) always runs
alongside that phase; only the part longer than it is a term of the composition (its *exposed*
part, see :func:`terms`).

Everything else is derived from these values, so the overlap rules live only here:

* the step total (:func:`evaluate`; used by ``cost.model.step_time`` / ``step_total_batch``);
* the LP / MILP composition rows (:func:`paths`: the composition as a maximum of sums, one row
  ``total >= sum(path)`` each, in ``search.equation.composition_rows``);
* the explain timeline (:func:`schedule`; ``explain.step_timeline``);
* the split into compute and communication (``Phase.kind``; ``StepTime.compute_s`` and the
  per-rank report).

Adding a phase: a :class:`Phase` in :data:`PHASES` (in step order) and the load columns that feed
it (``cost.terms.LOAD_COLUMNS``; a constant goes in ``cost.model.phase_constants``): the evaluator's
seconds and every solver's linear form (``search.equation.phase_forms``) follow; put its name in
the right stage tuple below (:data:`EMB_FWD`, ...) and every pipeline kind built from that stage
gets it. Adding a pipeline kind: its :class:`~torchrec_sparselift.vocabulary.Pipeline` in
``vocabulary.PIPELINE_REGISTRY`` (the runtime builds its TorchRec class from there) and its step
composition in ``_STEPS`` below. See docs/cost_model.md.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List, Mapping, Tuple, Union

import attrs
import numpy as np

from torchrec_sparselift.vocabulary import (
    BASE,
    FUSED,
    OVERLAP,
    OVERLAP_STALE,
    PIPELINES,
    PREFETCH,
    SEMI_SYNC,
    SPARSE_DIST,
    STALE_PIPELINES,
    SYNC_PIPELINES,
    Pipeline,
    pipeline,
)

__all__ = [
    "Phase",
    "PHASES",
    "PHASE_NAMES",
    "COMPUTE_PHASES",
    "LINK_PHASES",
    "Seq",
    "Par",
    "Lane",
    "PipelineKind",
    "PIPELINE_KINDS",
    "PIPELINES",
    "SYNC_PIPELINES",
    "STALE_PIPELINES",
    "pipeline_kind",
    "trainable_pipelines",
    "effective_pipeline",
    "step_factor",
    "terms",
    "exposed",
    "evaluate",
    "paths",
    "path_matrix",
    "step_totals",
    "PHASE_PARTS",
    "Placed",
    "schedule",
]

PHASE_KINDS = ("compute", "link", "collective")


@attrs.frozen
class Phase:
    """One phase of a step.

    ``kind``: ``compute`` (counted in ``StepTime.compute_s`` and a rank's compute), ``link``
    (an all-to-all style phase over the host links, a rank's communication) or ``collective``
    (the gradient all-reduce: one number for the whole world). ``hidden_under``: a phase this
    one always runs alongside (only the excess is exposed). ``part_of``: the phase this one is a
    part of (the dense work split by whether it depends on the embeddings); a kind's composition
    uses either the whole phase or its parts, and a part is not counted again in
    :data:`COMPUTE_PHASES`.
    """

    name: str
    kind: str = attrs.field(validator=attrs.validators.in_(PHASE_KINDS))
    doc: str = ""
    hidden_under: str = ""
    part_of: str = ""


#: Every phase, in the order a step without overlap runs them (the ``base`` pipeline).
PHASES: Tuple[Phase, ...] = (
    Phase("input_dist", "link", "ids (KJT) all-to-all to the ranks holding the shards"),
    Phase("uvm_fetch", "compute", "UVM-cache misses fetched from host memory"),
    Phase("lookup", "compute", "embedding lookups (TBE forward)"),
    Phase("output_dist", "link", "pooled embeddings back to the ranks owning the samples"),
    Phase("dense_fwd", "compute", "dense model forward"),
    Phase("dense_bwd", "compute", "dense model backward"),
    Phase("grad_dist", "link", "embedding gradients to the shards (mirror of output_dist)"),
    Phase("backward_update", "compute", "TBE backward with the fused optimizer update"),
    Phase("allreduce", "collective", "dense and data-parallel gradient all-reduce",
          hidden_under="dense_bwd"),
    Phase("dense_fwd_indep", "compute", "dense forward independent of the embeddings (DLRM's bottom MLP)",
          part_of="dense_fwd"),
    Phase("dense_fwd_rest", "compute", "dense forward that consumes the embeddings", part_of="dense_fwd"),
    Phase("dense_bwd_rest", "compute", "dense backward down to the embeddings' gradient", part_of="dense_bwd"),
    Phase("dense_bwd_indep", "compute", "dense backward independent of the embeddings (the bottom MLP's)",
          part_of="dense_bwd"),
    Phase("step_overhead", "compute", "fixed per-step work outside the sparse-path nodes (pipeline "
          "bookkeeping, loss, optimizer calls; HardwareProfile.step_overhead_s, fitted from real steps)"),
)
PHASE_NAMES: Tuple[str, ...] = tuple(p.name for p in PHASES)
COMPUTE_PHASES: Tuple[str, ...] = tuple(p.name for p in PHASES if p.kind == "compute" and not p.part_of)
#: The parts of a split phase: ``{whole: (part, ...)}`` (a composition uses the whole or its parts).
PHASE_PARTS: Dict[str, Tuple[str, ...]] = {
    w.name: tuple(p.name for p in PHASES if p.part_of == w.name) for w in PHASES
    if any(p.part_of == w.name for p in PHASES)
}
LINK_PHASES: Tuple[str, ...] = tuple(p.name for p in PHASES if p.kind == "link")

# stages: the phases of each part of a step, in order (pipelines below are built from these)
INPUT: Tuple[str, ...] = ("input_dist",)
EMB_FWD: Tuple[str, ...] = ("uvm_fetch", "lookup", "output_dist")
DENSE: Tuple[str, ...] = ("dense_fwd", "dense_bwd")
EMB_BWD: Tuple[str, ...] = ("grad_dist", "backward_update")
SYNC: Tuple[str, ...] = ("allreduce",)
STEP: Tuple[str, ...] = ("step_overhead",)  # on the step's own flow in every pipeline


@attrs.frozen
class Seq:
    """Parts run one after the other (phase names or :class:`Par` blocks)."""

    parts: Tuple[Union[str, "Par"], ...] = attrs.field(converter=tuple)


@attrs.frozen
class Lane:
    """One lane of a :class:`Par`: its name in the timeline, its work, and how the timeline
    names it when it hides another lane (``label``). ``next_batch``: work done for the next
    batch (pipelined ahead)."""

    name: str
    body: Seq
    label: str
    next_batch: bool = False


@attrs.frozen
class Par:
    """Lanes that run side by side from the same start; ``lanes[0]`` is the step's own flow."""

    lanes: Tuple[Lane, ...] = attrs.field(converter=tuple)

    @lanes.validator
    def _two_or_more(self, _: Any, value: Tuple[Lane, ...]) -> None:
        if len(value) < 2:
            raise ValueError("Par needs at least two lanes")


@attrs.frozen
class PipelineKind:
    """A train-pipeline kind as the cost model sees it: its step composition. What the kind is
    (its TorchRec class, whether it trains on stale embeddings, which tables it can train, whether
    it fuses the input distribution's splits exchanges) is its
    :class:`~torchrec_sparselift.vocabulary.Pipeline` entry (:attr:`properties`); the attributes
    below read it."""

    name: str
    step: Seq
    doc: str

    @property
    def properties(self) -> Pipeline:
        """The kind's entry in :data:`~torchrec_sparselift.vocabulary.PIPELINE_REGISTRY`."""
        return pipeline(self.name)

    @property
    def stale(self) -> bool:
        """Trains on one-step-stale embeddings (only offered with ``allow_staleness``)."""
        return self.properties.stale

    @property
    def dense_kernel(self) -> bool:
        """Can train tables on the ``dense`` compute kernel (every data-parallel table uses it)."""
        return self.properties.dense_kernel

    @property
    def fused_input_splits(self) -> bool:
        """Fuses the input distribution's splits exchanges of all sharding groups into one call
        per step (``cost.model.collective_calls``)."""
        return self.properties.fused_input_splits


def _next_batch(phases: Tuple[str, ...], label: str, lane: str = "next batch") -> Lane:
    return Lane(lane, Seq(phases), label, next_batch=True)


_PREFETCH_AHEAD = INPUT + ("uvm_fetch",)

#: Each pipeline kind's step composition and what it overlaps (one entry per registry pipeline).
_STEPS: Dict[str, Tuple[Seq, str]] = {
    BASE: (Seq(INPUT + EMB_FWD + DENSE + EMB_BWD + SYNC + STEP),
             "everything in sequence (TrainPipelineBase)"),
    SPARSE_DIST: (Seq([Par([
        Lane("main", Seq(EMB_FWD + DENSE + EMB_BWD + SYNC + STEP), "the step's lookup/dense/backward"),
        _next_batch(INPUT, "the next batch's input_dist"),
    ])]), "the next batch's input_dist runs during this batch's work (TrainPipelineSparseDist)"),
    FUSED: (Seq([Par([
        Lane("main", Seq(EMB_FWD + DENSE + (Par([
            Lane("main", Seq(EMB_BWD), "embedding backward"),
            Lane("comm", Seq(SYNC), "allreduce"),
        ]),) + STEP), "the step"),
        _next_batch(INPUT, "the next batch's input_dist"),
    ])]), "as sparse_dist, and the embedding backward/optimizer overlaps the dense all-reduce "
          "(TrainPipelineFusedSparseDist)"),
    PREFETCH: (Seq([Par([
        Lane("main", Seq(tuple(p for p in EMB_FWD if p not in _PREFETCH_AHEAD) + DENSE + EMB_BWD + SYNC + STEP),
             "the step's lookup/dense/backward"),
        _next_batch(_PREFETCH_AHEAD, "the next batch's " + "+".join(_PREFETCH_AHEAD)),
    ])]), "as sparse_dist, and UVM-cache misses are fetched with the input_dist "
          "(PrefetchTrainPipelineSparseDist)"),
    SEMI_SYNC: (Seq([Par([
        Lane("main", Seq((Par([
            Lane("main", Seq(DENSE), "dense fwd/bwd"),
            _next_batch(EMB_FWD, "next batch's embedding forward"),
        ]),) + EMB_BWD + SYNC + STEP), "the step"),
        _next_batch(INPUT, "input_dist", lane="next batch input"),
    ])]), "as sparse_dist, and the next batch's lookup + output_dist overlap this batch's dense "
          "forward/backward (one step of embedding staleness; TrainPipelineSemiSync). It looks up "
          "batch i+1 before step i's update, so a dense-kernel table (updated in place after that "
          "lookup) cannot train under it"),
    OVERLAP: (Seq([Par([
        Lane("main", Seq(("uvm_fetch", "lookup",
                          Par([Lane("main", Seq(("output_dist",)), "output all-to-all"),
                               Lane("dense", Seq(("dense_fwd_indep",)), "bottom MLP forward")]),
                          "dense_fwd_rest", "dense_bwd_rest",
                          Par([Lane("main", Seq(("grad_dist",)), "gradient all-to-all"),
                               Lane("dense", Seq(("dense_bwd_indep",)), "bottom MLP backward")]),
                          Par([Lane("main", Seq(("backward_update",)), "embedding backward"),
                               Lane("comm", Seq(SYNC), "dense all-reduce")]))
                         + STEP), "the step"),
        _next_batch(INPUT, "the next batch's input_dist"),
    ])]), "as sparse_dist, and the output and gradient all-to-alls overlap the dense work independent "
          "of the embeddings, the dense all-reduce the embedding backward (exact; "
          "runtime.overlap.TrainPipelineOverlap)"),
    OVERLAP_STALE: (Seq([Par([
        Lane("main", Seq((Par([Lane("main", Seq(("dense_fwd",)), "dense forward"),
                               Lane("previous batch", Seq(("grad_dist",)), "the previous batch's gradient all-to-all")]),
                          "backward_update", "uvm_fetch", "lookup",
                          Par([Lane("main", Seq(("dense_bwd",)), "dense backward"),
                               _next_batch(("output_dist",), "the next batch's output all-to-all")]))
                         + SYNC + STEP), "the step"),
        _next_batch(INPUT, "input_dist", lane="next batch input"),
    ])]), "as sparse_dist, and the next batch's lookup is issued before this batch's dense backward, "
          "its output all-to-all running beside that backward, and this batch's gradient all-to-all "
          "beside the next batch's dense forward (one step of embedding staleness; "
          "runtime.stale.TrainPipelineOverlapStale). The embedding backward/update of a batch runs in "
          "the next step, after its dense forward"),
}
if set(_STEPS) != set(PIPELINES):
    raise RuntimeError(
        f"cost.pipelines describes the steps of {sorted(_STEPS)} but vocabulary.PIPELINE_REGISTRY "
        f"holds {sorted(PIPELINES)}: give every registry pipeline a step composition in _STEPS"
    )

#: Every pipeline kind, in the registry's order (the planner's order of preference on equal step
#: times).
PIPELINE_KINDS: Tuple[PipelineKind, ...] = tuple(PipelineKind(name, *_STEPS[name]) for name in PIPELINES)
_BY_NAME: Dict[str, PipelineKind] = {k.name: k for k in PIPELINE_KINDS}


def _input_dist_in_step(kind: PipelineKind) -> PipelineKind:
    """``kind`` with the next batch's input_dist moved from its own lane into the step's flow,
    ahead of the rest: how a kind that overlaps between hosts runs where the cost model otherwise
    prices no overlap (CPU gloo across hosts). Its next batch's ids all-to-all is issued right
    after this batch's output all-to-all and crosses the same link beside it, so its bytes delay
    the output all-to-all the step waits for instead of hiding under the step (measured on the
    shared 1 Gbit/s and 300 Mbit/s links: priced in its own lane, ``overlap`` was predicted
    12-23% faster than ``sparse_dist`` on the same table-wise plans and measured 0.5-7% faster;
    docs/cost_model.md section 3). A kind without such a lane is returned as it is."""
    parts = kind.step.parts
    if len(parts) == 1 and isinstance(parts[0], Par):
        main, *others = parts[0].lanes
        if others and all(lane.next_batch and tuple(lane.body.parts) == INPUT for lane in others):
            return PipelineKind(kind.name, Seq(INPUT + tuple(main.body.parts)), kind.doc)
    return kind


#: How a TorchRec kind that overlaps between hosts runs across hosts on hardware without overlap,
#: where that is not its own composition (its overlap there comes from where it issues the
#: collectives, not from side streams). ``fused`` (``TrainPipelineFusedSparseDist``) runs this
#: batch's lookup and issues its output all-to-all at the start of ``progress``, before the next
#: batch's input_dist and the model's forward; on CPU that all-to-all is gloo-async, so its wire
#: time runs beside the next batch's input_dist (its host work; the ids' bytes share the link) and
#: the bottom MLP's forward, which ``sparse_dist`` runs before issuing it. Measured on the testbed
#: (docs/overlap.md section 9): per step the forward's wait on the output all-to-all fell from 19-20
#: to 11 ms; over the day's regime runs ``fused`` ran below ``sparse_dist``'s step on 68 of 72
#: network-regime workloads (0.91-1.02x; geomean 0.96-0.98), on one host 0.90-1.08x (geomean 0.98,
#: within the A/A control beside it).
_ACROSS_HOSTS_STEPS: Dict[str, Tuple[Seq, str]] = {
    FUSED: (Seq(("uvm_fetch", "lookup", Par([
        Lane("main", Seq(("output_dist",)), "output all-to-all"),
        Lane("before forward", Seq(("input_dist", "dense_fwd_indep")),
             "the next batch's input_dist and the bottom MLP forward"),
    ]), "dense_fwd_rest", "dense_bwd") + EMB_BWD + SYNC + STEP),
              "this batch's output all-to-all issued before the next batch's input_dist and the "
              "forward (TrainPipelineFusedSparseDist across hosts on CPU)"),
}

def _allreduce_after_update(node: Union[str, Seq, Par]) -> Union[str, Seq, Par]:
    """``node`` with every :class:`Par` that runs the gradient all-reduce (:data:`SYNC`) in a lane
    beside the step's flow turned into that flow followed by the all-reduce: how a kind runs
    across hosts on hardware without overlap. A rank is pinned to one core, so gloo's all-reduce
    (its reduction and socket work on that core) does not run beside the TBE backward. Measured on
    the shared 1 Gbit/s link (docs/cost_model.md section 3; 2026-12-07, R2 of benchmarks.regimes):
    priced beside it, the 44 ``overlap`` runs (most with data-parallel tables, whose all-reduce is
    the largest collective left) read 0.77-1.03 of their measured steps (MAPE 9.4%); priced after
    it, 0.84-1.28 (MAPE 5.2%)."""
    if isinstance(node, str):
        return node
    if isinstance(node, Seq):
        parts: List[Union[str, Par]] = []
        for part in node.parts:
            done = _allreduce_after_update(part)
            parts.extend(done.parts if isinstance(done, Seq) else (done,))
        return Seq(parts)
    main, *others = node.lanes
    if others and all(tuple(lane.body.parts) == SYNC and not lane.next_batch for lane in others):
        return Seq(tuple(_allreduce_after_update(main.body).parts) + SYNC)
    return Par([attrs.evolve(lane, body=_allreduce_after_update(lane.body)) for lane in node.lanes])


#: The kinds that overlap between hosts (``Pipeline.overlaps_between_hosts``) as they run across
#: hosts on hardware without overlap: :data:`_ACROSS_HOSTS_STEPS`, else :func:`_input_dist_in_step`,
#: each with the all-reduce after the embedding backward (:func:`_allreduce_after_update`).
_ACROSS_HOSTS: Dict[str, PipelineKind] = {
    k.name: attrs.evolve(kind, step=_allreduce_after_update(kind.step))
    for k in PIPELINE_KINDS if k.properties.overlaps_between_hosts
    for kind in (PipelineKind(k.name, *_ACROSS_HOSTS_STEPS[k.name]) if k.name in _ACROSS_HOSTS_STEPS
                 else _input_dist_in_step(k),)}
if not set(_ACROSS_HOSTS_STEPS) <= set(_ACROSS_HOSTS):
    raise RuntimeError("cost.pipelines: a composition across hosts for a kind whose registry entry does not say "
                       "overlaps_between_hosts")


def pipeline_kind(name: str) -> PipelineKind:
    """The :class:`PipelineKind` called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown pipeline {name!r}; choose one of {PIPELINES}") from None


def trainable_pipelines(names: Tuple[str, ...], dense_kernel: bool, streams: bool = False,
                        feature_processors: bool = False) -> Tuple[str, ...]:
    """The pipelines among ``names`` that can train a plan exactly: ``dense_kernel``, the plan has a
    table on the ``dense`` compute kernel (e.g. a data-parallel one), which the stale kinds cannot
    train; ``streams``, the device runs side streams (CUDA), where a kind that looks up the next
    batch before the dense optimizer's step (``Pipeline.lookup_before_dense_step``: TorchRec's
    ``fused``) would read a dense-kernel table's or a feature processor's weights (the model has
    one: ``feature_processors``) before their update (the rule: ``vocabulary.Pipeline.conflict``).
    A single allowed pipeline is kept as asked (the runtime then refuses the pair, naming the
    tables or the module)."""
    names = tuple(names)
    if len(names) <= 1:
        return names

    return tuple(n for n in names
                 if pipeline_kind(n).properties.conflict(dense_kernel, streams, feature_processors) is None) or names


def effective_pipeline(name: str, supports_overlap: bool = True, spans_hosts: bool = False) -> PipelineKind:
    """The kind a step really runs: on hardware without compute/communication overlap
    (``HardwareProfile.supports_overlap`` False, e.g. CPU gloo) every pipeline runs as ``base``,
    except a kind whose registry entry says ``overlaps_between_hosts`` when the ranks span hosts
    (``spans_hosts``): its collectives run on gloo's threads while the rank computes, and a
    transfer over a link between hosts waits on the wire, not on the rank's cores
    (docs/overlap.md: measured on two emulated hosts; on one box the loopback transfer is CPU
    work and the kind gains nothing). Its next batch's input_dist then runs in the step's flow
    (:func:`_input_dist_in_step`: it shares the link with the output all-to-all)."""
    kind = pipeline_kind(name)
    if supports_overlap:
        return kind
    if spans_hosts and kind.properties.overlaps_between_hosts:
        return _ACROSS_HOSTS[name]
    return _BY_NAME[BASE]


def step_factor(profile: Any, name: str, spans_hosts: bool = False) -> float:
    """The measured factor a step under pipeline ``name`` takes on the composition's total: the
    profile's ``pipeline_factor(name)`` (its step calibration timed the same plans under each
    pipeline, ``HardwareProfile.pipeline_factors``) where the model prices the pipeline as
    ``base`` (:func:`effective_pipeline`: hardware without overlap), 1.0 where the composition
    itself says what the pipeline overlaps (that is what it prices) and for a profile without
    measured factors. Every step total (the evaluator's :func:`step_totals` callers and the
    solvers' rows, ``search.equation.composition_rows``) takes it from here."""
    overlap = bool(getattr(profile, "supports_overlap", True))
    if effective_pipeline(name, overlap, spans_hosts).name != BASE:
        return 1.0
    factor = getattr(profile, "pipeline_factor", None)
    return float(factor(name)) if factor is not None else 1.0


def terms(phases: Mapping[str, Any], supports_overlap: bool = True) -> Dict[str, Any]:
    """The composition's terms from the phase durations (floats or numpy arrays): each phase's
    duration, except that a ``hidden_under`` phase counts only its exposed part
    ``max(0, phase - hidden_under)``; on hardware without overlap (``supports_overlap`` False:
    CPU gloo on few cores, where the measured data-parallel plans pay their gradient all-reduce in
    full) nothing hides and every phase counts in full. Missing phases count 0."""
    out: Dict[str, Any] = {}
    for p in PHASES:
        v = phases.get(p.name, 0.0)
        if p.hidden_under and supports_overlap:
            v = np.maximum(0.0, v - phases.get(p.hidden_under, 0.0))
        out[p.name] = v
    return out


def evaluate(node: Union[str, Seq, Par], values: Mapping[str, Any]) -> Any:
    """The duration of ``node`` given each term's value (floats or numpy arrays, elementwise):
    a :class:`Seq` sums, a :class:`Par` takes the maximum of its lanes."""
    if isinstance(node, str):
        return values[node]
    if isinstance(node, Seq):
        total: Any = 0.0
        for part in node.parts:
            total = total + evaluate(part, values)
        return total
    out = evaluate(node.lanes[0].body, values)
    for lane in node.lanes[1:]:
        out = np.maximum(out, evaluate(lane.body, values))
    return out


def paths(node: Union[str, Seq, Par]) -> Tuple[Tuple[str, ...], ...]:
    """The composition as a maximum of sums: every way through it, as the terms it adds up.
    ``evaluate(node, v) == max(sum(v[t] for t in path) for path in paths(node))`` for terms
    ``>= 0``. Side lanes of a :class:`Par` come before its main lane."""
    if isinstance(node, str):
        return ((node,),)
    if isinstance(node, Par):
        out: List[Tuple[str, ...]] = []
        for lane in node.lanes[1:] + node.lanes[:1]:
            out.extend(paths(lane.body))
        return tuple(out)
    acc: List[Tuple[str, ...]] = [()]
    for part in node.parts:
        acc = [a + b for a in acc for b in paths(part)]
    return tuple(acc)


@lru_cache(maxsize=None)
def path_matrix(name: str, supports_overlap: bool = True, spans_hosts: bool = False) -> np.ndarray:
    """0/1 matrix (paths x :data:`PHASE_NAMES`) of the effective kind's :func:`paths`."""
    kind = effective_pipeline(name, supports_overlap, spans_hosts)
    index = {p: i for i, p in enumerate(PHASE_NAMES)}
    ps = paths(kind.step)
    m = np.zeros((len(ps), len(PHASE_NAMES)))
    for r, path in enumerate(ps):
        for t in path:
            m[r, index[t]] += 1.0
    m.setflags(write=False)
    return m


_HIDDEN = tuple((PHASE_NAMES.index(p.name), PHASE_NAMES.index(p.hidden_under)) for p in PHASES if p.hidden_under)


def exposed(table: np.ndarray, supports_overlap: bool = True) -> np.ndarray:
    """:func:`terms` for a phase table (rows x :data:`PHASE_NAMES` columns)."""
    if not _HIDDEN or not supports_overlap:
        return table
    out = table.copy()
    for i, j in _HIDDEN:
        out[:, i] = np.maximum(0.0, table[:, i] - table[:, j])
    return out


def step_totals(table: np.ndarray, name: str, supports_overlap: bool = True, spans_hosts: bool = False) -> np.ndarray:
    """Step time per row of a phase table (rows x :data:`PHASE_NAMES` seconds) under pipeline
    ``name``: the largest path sum, ``evaluate(kind.step, terms(row))`` for every row, in one
    matrix product (the search's hot path). ``spans_hosts``: see :func:`effective_pipeline`."""
    return (exposed(table, supports_overlap) @ path_matrix(name, supports_overlap, spans_hosts).T).max(axis=1)


@attrs.frozen
class Placed:
    """One phase placed on a lane by :func:`schedule` (seconds from the start of the step)."""

    phase: str
    lane: str
    start_s: float
    duration_s: float
    critical: bool = True
    hidden_by: str = ""
    next_batch: bool = False

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


def schedule(kind: PipelineKind, phases: Mapping[str, float], supports_overlap: bool = True) -> Tuple[Placed, ...]:
    """Lay one steady-state step of ``kind`` out on lanes.

    Each :class:`Par` starts its lanes together; the lane that ends last (``lanes[0]`` on ties)
    stays critical, the others' critical work becomes hidden by its ``label``. A
    ``hidden_under`` phase's hidden part runs on lane ``comm`` alongside the phase it hides
    under; its exposed part sits where the composition puts it. Zero-length phases are left
    out. The critical segments end at ``evaluate(kind.step, terms(phases))``.
    """
    ph = {p: float(phases.get(p, 0.0)) for p in PHASE_NAMES}
    vals = terms(ph, supports_overlap)
    riders = {p.hidden_under: (p.name, p.hidden_under) for p in PHASES if p.hidden_under and supports_overlap}
    for whole, (rider, _) in list(riders.items()):  # a kind that splits the phase: under its first part
        if PHASE_PARTS.get(whole):
            riders[PHASE_PARTS[whole][0]] = (rider, whole)

    def place(node: Union[str, Seq, Par], lane: str, start: float, next_batch: bool) -> Tuple[List[Placed], float]:
        if isinstance(node, str):
            out: List[Placed] = []
            dur = float(vals[node])
            if dur > 0:
                out.append(Placed(node, lane, start, dur, next_batch=next_batch))
            ride = riders.get(node)  # a phase that runs hidden under this one
            if ride is not None:
                rider, under = ride
                part = min(ph[rider], ph[under])
                if part > 0:
                    out.append(Placed(rider, "comm", start, part, critical=False, hidden_by=node,
                                      next_batch=next_batch))
            return out, start + dur
        if isinstance(node, Seq):
            out, t = [], start
            for part in node.parts:
                segs, t = place(part, lane, t, next_batch)
                out.extend(segs)
            return out, t
        placed = []
        for ln in node.lanes:
            segs, end = place(ln.body, ln.name, start, next_batch or ln.next_batch)
            placed.append((ln, segs, end))
        win = max(range(len(placed)), key=lambda i: (placed[i][2], -i))
        out = []
        for i in list(range(1, len(placed))) + [0]:  # side lanes first (timeline lane order)
            ln, segs, _ = placed[i]
            if i != win:
                segs = [attrs.evolve(s, critical=False, hidden_by=placed[win][0].label) if s.critical else s
                        for s in segs]
            out.extend(segs)
        return out, placed[win][2]

    segs, _ = place(kind.step, "main", 0.0, False)
    return tuple(segs)
