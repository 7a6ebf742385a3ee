"""The rewrite stage of the decision: after the search has chosen the sharding, the pipeline and the
comm precisions of a 1D plan, choose the sparse-path rewrites by price.

* ``batch_split`` (:mod:`~torchrec_sparselift.cost.batch_split`): the ``overlap`` pipeline's output
  and gradient all-to-alls in k chunks, k in 1..16 by :func:`~torchrec_sparselift.cost.batch_split.choose_chunks`.
  Chosen only where the pipeline is ``overlap``, the profile has a calibrated ``chunk_overhead_s``
  (``sparselift calibrate kernels``), every table's sharding type splits, and the module's dense
  part is per-sample (:func:`~torchrec_sparselift.semantics.per_sample.per_sample_violation`) or
  the user declared it (``per_sample=True``).
* ``id_dtype`` (:mod:`~torchrec_sparselift.cost.wire_ids`): int32 ids and lengths in the input
  all-to-all wherever every model-parallel table's rows fit int32 and the runtime rewrites its
  sharding type's input dist; narrow ids never send more bytes, so they are chosen whenever allowed.
* ``dedup``: per feature, where the profile has a calibrated ``dedup_id_s`` and the workload
  statistics give the feature's distinct-id ratio, when the bytes it removes outweigh its kernels
  (:func:`~torchrec_sparselift.cost.wire_ids.choose_for_request`).

The price of the rewritten plan (:func:`choose_rewrites`): the input all-to-all's phase less the
seconds of the bytes the wire rewrites remove (plus the dedup kernels' seconds), the pipeline's
composition on those phases (its measured step factor included, as the search prices it), and,
with a split, less what the split schedule wins on those phases::

    step = composition(phases') - (split_step_s(terms', 1) - split_step_s(terms', k))

which is ``split_step_s(terms', k)`` wherever the model prices ``overlap`` by its own composition
(hardware with overlap), never above the unrewritten step and never below ``max(compute,
communication)`` of the split terms. Every rewrite not chosen has its reason in
:attr:`RewriteChoice.notes`. The never-slower rule (``plan.planning.apply_never_slower``) judges
the rewritten plan, the saving a term of its own (:data:`~torchrec_sparselift.plan.baseline.REWRITE_TERM`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.batch_split import (
    BATCH_SPLIT_PIPELINE, MAX_CHUNKS, SplitSchedule, SplitTerms, choose_chunks, split_schedule, split_step_s,
)
from torchrec_sparselift.cost.model import CostContext, collective_calls
from torchrec_sparselift.cost.pipelines import PHASE_NAMES, step_factor, step_totals
from torchrec_sparselift.cost.wire_ids import choose_for_request, feature_tuple, wire_features
from torchrec_sparselift.search.solve import new_evaluator
from torchrec_sparselift.semantics.per_sample import per_sample_violation
from torchrec_sparselift.semantics.tables import is_feature_processed
from torchrec_sparselift.vocabulary import (
    COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE, TABLE_WISE, pipeline as pipeline_kind,
)

__all__ = ["REWRITES", "BATCH_SPLIT", "ID_DTYPE", "DEDUP", "SPLIT_SHARDING_TYPES", "WIRE_SHARDING_TYPES",
           "rewrite_names", "rewrite_problem", "RewriteChoice", "choose_rewrites", "no_rewrites"]

#: the rewrite that splits the batch (``Optimizations.batch_split``)
BATCH_SPLIT = "batch_split"
#: the rewrite that narrows the ids on the wire (``Optimizations.id_dtype``)
ID_DTYPE = "id_dtype"
#: the rewrite that deduplicates a feature's ids on the wire (``Optimizations.dedup_features``)
DEDUP = "dedup"
#: every rewrite the planner may choose (the planner's ``rewrites=`` names a subset)
REWRITES: Tuple[str, ...] = (BATCH_SPLIT, ID_DTYPE, DEDUP)
#: sharding types whose output collective the batch split splits (``runtime.batch_split.SPLIT_SHARDING_TYPES``)
SPLIT_SHARDING_TYPES: Tuple[str, ...] = (TABLE_WISE, COLUMN_WISE, ROW_WISE, TABLE_ROW_WISE, DATA_PARALLEL)
#: model-parallel sharding types whose input dist ``runtime.wire_ids`` rewrites (data-parallel sends nothing)
WIRE_SHARDING_TYPES: Tuple[str, ...] = (TABLE_WISE, COLUMN_WISE, ROW_WISE, TABLE_ROW_WISE)

_CALIBRATE = ("calibrate the profile to measure it (`sparselift calibrate steps` for hardware='auto'; "
              "`sparselift calibrate kernels` for a kernel profile)")


def rewrite_problem(value: Any) -> Optional[str]:
    """Why ``value`` is not a valid ``rewrites=`` (None: the default, every rewrite; else names of
    :data:`REWRITES`, each once), or None where it is."""
    if value is None:
        return None
    if isinstance(value, str):
        return f"rewrites must be a list of rewrite names, got the string {value!r}: write [{value!r}]"
    try:
        names = list(value)
    except TypeError:
        return f"rewrites must be a list of rewrite names ({', '.join(REWRITES)}), got {type(value).__name__}"
    unknown = [n for n in names if n not in REWRITES]
    if unknown:
        return f"rewrites names unknown rewrite(s) {unknown}: the rewrites are {', '.join(REWRITES)}"
    if len(set(names)) != len(names):
        return f"rewrites names a rewrite twice: {names}; give each once"
    return None


def rewrite_names(value: Any) -> Tuple[str, ...]:
    """``rewrites=`` as the tuple of names the planner may choose, in :data:`REWRITES` order (None:
    all of them; ``()``: none); ``ValueError`` naming the valid ones for anything else."""
    problem = rewrite_problem(value)
    if problem:
        raise ValueError(problem)
    if value is None:
        return REWRITES
    return tuple(n for n in REWRITES if n in set(value))


@attrs.frozen(kw_only=True)
class RewriteChoice:
    """What the rewrite stage chose for one plan and what it predicts.

    ``batch_split``, ``id_dtype``, ``dedup_features``: the settings (``Optimizations``' fields);
    ``step_without_s``: the plan's step as the search priced it; ``step_s``: with the rewrites;
    ``input_dist_saved_s``: what the wire rewrites take off the input all-to-all phase (its bytes'
    seconds less the dedup kernels'); ``split_saved_s``: what the split wins on top;
    ``wire_bytes_before`` / ``wire_bytes_after``: the input all-to-all's bytes per rank and step;
    ``notes``: why each rewrite not chosen was not (one line each); ``terms``: the split terms
    priced (for :meth:`schedule`; None where no split was priced)."""

    batch_split: int = 1
    id_dtype: str = "int64"
    dedup_features: Tuple[str, ...] = attrs.field(default=(), converter=feature_tuple)
    step_without_s: float = 0.0
    step_s: float = 0.0
    input_dist_saved_s: float = 0.0
    split_saved_s: float = 0.0
    wire_bytes_before: float = 0.0
    wire_bytes_after: float = 0.0
    notes: Tuple[str, ...] = attrs.field(default=(), converter=tuple)
    terms: Optional[SplitTerms] = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.batch_split <= MAX_CHUNKS:
            raise ValueError(f"RewriteChoice.batch_split must be in 1..{MAX_CHUNKS}, got {self.batch_split}")
        if self.step_s > self.step_without_s * (1 + 1e-9) + 1e-15:
            raise ValueError(f"RewriteChoice.step_s={self.step_s} exceeds step_without_s={self.step_without_s}: "
                             "a rewrite is chosen only where it does not slow the step")

    @property
    def chosen(self) -> bool:
        """Whether any rewrite is chosen."""
        return self.batch_split > 1 or self.id_dtype != "int64" or bool(self.dedup_features)

    @property
    def saving_s(self) -> float:
        """Predicted seconds per step the rewrites save (>= 0)."""
        return max(0.0, self.step_without_s - self.step_s)

    @property
    def wire_bytes_saved(self) -> float:
        """Bytes per rank and step the wire rewrites take off the input all-to-all."""
        return max(0.0, self.wire_bytes_before - self.wire_bytes_after)

    def schedule(self) -> Optional[SplitSchedule]:
        """The split step's schedule per chunk (what the link hides and what the step waits for);
        None without a split."""
        if self.terms is None or self.batch_split <= 1:
            return None
        return split_schedule(self.terms, self.batch_split)

    def with_notes(self, *notes: str) -> "RewriteChoice":
        return attrs.evolve(self, notes=self.notes + tuple(notes))

    def dropped(self, note: str) -> "RewriteChoice":
        """No rewrite, the step as the search priced it, with every note kept and ``note`` added."""
        return RewriteChoice(step_without_s=self.step_without_s, step_s=self.step_without_s,
                             notes=self.notes + (note,))

    def describe(self) -> List[str]:
        """Lines for a plan's explanation: what is chosen with its saving, then each note."""
        ms = 1e3
        chosen = []
        if self.batch_split > 1:
            chosen.append(f"batch split {self.batch_split} (saves {self.split_saved_s * ms:.3f} ms)")
        if self.id_dtype != "int64":
            chosen.append(f"{self.id_dtype} ids")
        if self.dedup_features:
            chosen.append(f"dedup of {len(self.dedup_features)} feature(s) ({', '.join(self.dedup_features[:4])}"
                          f"{', ...' if len(self.dedup_features) > 4 else ''})")
        lines = []
        if chosen:
            lines.append(f"rewrites: {', '.join(chosen)}; predicted step {self.step_s * ms:.3f} ms "
                         f"(without {self.step_without_s * ms:.3f} ms)")
        else:
            lines.append("rewrites: none chosen")
        if self.wire_bytes_before > 0 and self.wire_bytes_saved > 0:
            lines.append(f"  ids on the wire: {self.wire_bytes_before / 1024:.1f} -> {self.wire_bytes_after / 1024:.1f} "
                         f"KiB per rank and step ({self.wire_bytes_saved / 1024:.1f} KiB saved; input all-to-all "
                         f"{self.input_dist_saved_s * ms:.3f} ms shorter)")
        sched = self.schedule()
        if sched is not None:
            lines += ["  " + line for line in sched.describe()]
        lines += [f"  not chosen: {n}" for n in self.notes]
        return lines

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON (an execution plan's ``planner_info["rewrites"]``)."""
        return dict(batch_split=self.batch_split, id_dtype=self.id_dtype, dedup_features=list(self.dedup_features),
                    step_without_s=self.step_without_s, step_s=self.step_s, saving_s=self.saving_s,
                    input_dist_saved_s=self.input_dist_saved_s, split_saved_s=self.split_saved_s,
                    wire_bytes_before=self.wire_bytes_before, wire_bytes_after=self.wire_bytes_after,
                    notes=list(self.notes), terms=None if self.terms is None else attrs.asdict(self.terms))

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> Optional["RewriteChoice"]:
        """The choice an execution plan stored (:meth:`to_dict`); None where it has none."""
        if not data:
            return None
        terms = data.get("terms")
        return cls(batch_split=int(data.get("batch_split", 1)), id_dtype=str(data.get("id_dtype", "int64")),
                   dedup_features=tuple(data.get("dedup_features", ())),
                   step_without_s=float(data.get("step_without_s", 0.0)), step_s=float(data.get("step_s", 0.0)),
                   input_dist_saved_s=float(data.get("input_dist_saved_s", 0.0)),
                   split_saved_s=float(data.get("split_saved_s", 0.0)),
                   wire_bytes_before=float(data.get("wire_bytes_before", 0.0)),
                   wire_bytes_after=float(data.get("wire_bytes_after", 0.0)),
                   notes=tuple(str(n) for n in data.get("notes", ())),
                   terms=None if not terms else SplitTerms(**terms))


def no_rewrites(step_s: float, *notes: str) -> RewriteChoice:
    """No rewrite chosen (the step unchanged), with the reasons ``notes``."""
    return RewriteChoice(step_without_s=step_s, step_s=step_s, notes=notes)


def _composed(phases: Dict[str, float], ctx: CostContext, pipeline: str) -> float:
    """The pipeline's step on ``phases`` as the search prices it (``cost.model.step_time``)."""
    row = np.array([[float(phases.get(n, 0.0)) for n in PHASE_NAMES]])
    spans = ctx.num_hosts > 1
    return float(step_totals(row, pipeline, getattr(ctx.profile, "supports_overlap", True), spans)[0]) * step_factor(
        ctx.profile, pipeline, spans)


def _sharding(res: Any) -> Dict[str, Tuple[str, int]]:
    """Table name -> (sharding type, shards) of a result's plan."""
    out = {}
    for h, (cid, _ranks) in zip(res.handles, res.search.assignment):
        c = res.problem.cands[cid]
        out[h.spec.name] = (c.sharding_type, int(c.num_shards))
    return out


def _calibrated(profile: Any, field: str) -> Optional[float]:
    value = getattr(profile, field, None)
    return None if value is None else float(value)


def choose_rewrites(request: Any, res: Any, allowed: Optional[Iterable[str]] = None) -> RewriteChoice:
    """The rewrites for ``res`` (a 1D ``PlanResult`` of ``request``, a ``PlanRequest``) among
    ``allowed`` (default: ``request.rewrites``), priced on its loads (module docstring)."""
    s = res.search
    step0 = float(s.step.total_s)
    allowed = tuple(request.rewrites if allowed is None else allowed)
    if not allowed:
        return no_rewrites(step0)
    if res.sharding_group_size is not None:
        return no_rewrites(step0, "a 2D plan: the rewrites apply to 1D plans only")
    if not str(request.cost_model).startswith("sparselift"):
        return no_rewrites(step0, "cost_model='torchrec': the rewrites are priced by SparseLift's cost model only")
    ctx = res.problem.ctx
    profile = ctx.profile
    ev = new_evaluator(res.problem, s.pipeline, s.fwd_precision, s.bwd_precision)
    ev.assign_many({t: (cid, ranks) for t, (cid, ranks) in enumerate(s.assignment)})
    phases = dict(ev.phases())
    groups = ev.comm_groups
    sharding = _sharding(res)
    notes: List[str] = []

    # -- ids on the wire ---------------------------------------------------------------------
    id_dtype, dedup, saved_s, before, after = "int64", (), 0.0, 0.0, 0.0
    want_narrow, want_dedup = ID_DTYPE in allowed, DEDUP in allowed
    unsupported = sorted({st for st, _ in sharding.values() if st != DATA_PARALLEL and st not in WIRE_SHARDING_TYPES})
    sequence = sorted(h.spec.name for h in res.handles
                      if not h.spec.is_pooled or is_feature_processed(h.sharder_key))
    if (want_narrow or want_dedup) and unsupported:
        notes.append(f"ids on the wire: the runtime does not rewrite the input dist of {', '.join(unsupported)} tables")
        want_narrow = want_dedup = False
    elif (want_narrow or want_dedup) and sequence:
        notes.append(f"ids on the wire: the runtime rewrites EmbeddingBagCollections' input dists only, and "
                     f"{', '.join(sequence[:4])} belong to an EmbeddingCollection or a feature-processed module")
        want_narrow = want_dedup = False
    dedup_id_s = _calibrated(profile, "dedup_id_s")
    if want_dedup and dedup_id_s is None:
        notes.append(f"dedup: the profile {profile.name} has no dedup_id_s (the dedup kernels' seconds per id); "
                     + _CALIBRATE)
        want_dedup = False
    model_parallel = any(st != DATA_PARALLEL for st, _ in sharding.values())
    if (want_narrow or want_dedup) and not model_parallel:
        notes.append("ids on the wire: every table is data-parallel, the plan has no input all-to-all")
        want_narrow = want_dedup = False
    if want_narrow or want_dedup:
        world, local = int(request.topology.world_size), int(request.topology.local_world_size)
        features = wire_features(request.tables, request.stats, sharding, batch_size=request.batch_size,
                                 world_size=world, local_world_size=min(local, world))
        if want_dedup and not any(f.unique_ratio is not None for f in features):
            notes.append("dedup: no observed distinct-id ratio for the model-parallel features (pass the workload's "
                         "statistics: workload=semantics.workload.observe(...))")
            want_dedup = False
        wire = choose_for_request(request, sharding, dedup_id_s=dedup_id_s or 0.0, allow_narrow=want_narrow,
                                  allow_dedup=want_dedup)
        if wire.refused:
            notes.append(f"id_dtype: {wire.refused}")
        if want_dedup and not wire.dedup_features:
            notes.append("dedup: no feature's distinct ids are few enough to pay for the dedup kernels")
        id_dtype, dedup = wire.id_dtype, wire.dedup_features
        before, after = wire.bytes_before, wire.bytes_after
        hw = request.hardware
        bandwidth = hw.inter_host_bw if world > local else hw.intra_host_bw
        kernels = sum(f.ids for f in features if f.feature in dedup) * (dedup_id_s or 0.0)
        fused = pipeline_kind(s.pipeline).fused_input_splits
        lat = profile.collective_latency_s * collective_calls("input_dist", groups, fused) if world > 1 else 0.0
        room = max(0.0, phases["input_dist"] - lat)
        saved_s = min(room, max(0.0, (before - after) / bandwidth - kernels))
        phases["input_dist"] -= saved_s
    step_w = min(step0, _composed(phases, ctx, s.pipeline))

    # -- batch split -------------------------------------------------------------------------
    k, split_saved, terms = 1, 0.0, None
    if BATCH_SPLIT in allowed:
        overhead = _calibrated(profile, "chunk_overhead_s")
        splits = sorted({st for st, _ in sharding.values() if st not in SPLIT_SHARDING_TYPES})
        why = None
        if s.pipeline != BATCH_SPLIT_PIPELINE:
            why = (f"batch split: the pipeline is {s.pipeline!r}; the split chunks the {BATCH_SPLIT_PIPELINE!r} "
                   "pipeline's all-to-alls")
        elif overhead is None:
            why = (f"batch split: the profile {profile.name} has no chunk_overhead_s (the dense calls' cost per "
                   "extra chunk); " + _CALIBRATE)
        elif splits:
            why = f"batch split: the runtime does not split the output of {', '.join(splits)} tables"
        elif any(not h.spec.is_pooled for h in res.handles):
            why = "batch split: the runtime splits pooled outputs only, and the model has sequence tables (EmbeddingCollection)"
        elif any(is_feature_processed(h.sharder_key) for h in res.handles):
            why = "batch split: the runtime does not split a feature-processed module's output"
        elif request.module is not None:  # a declaration cannot clear a BatchNorm or a dropout
            why = per_sample_violation(request.module, request.per_sample)
        elif not request.per_sample:
            why = "batch split: the request carries no module to inspect; declare it per-sample (per_sample=True)"
        if why is None:
            lat = profile.collective_latency_s if ctx.world_size > 1 else 0.0
            per_chunk = min(lat * collective_calls("output_dist", groups), phases["output_dist"], phases["grad_dist"])
            terms = SplitTerms.from_phases(phases, chunk_latency_s=per_chunk, chunk_overhead_s=overhead or 0.0,
                                           chunk_feature_s=_calibrated(profile, "chunk_feature_s") or 0.0,
                                           features=sum(len(h.spec.feature_names) for h in res.handles),
                                           supports_overlap=getattr(profile, "supports_overlap", True))
            k = choose_chunks(terms, request.batch_size)
            split_saved = max(0.0, split_step_s(terms, 1) - split_step_s(terms, k))
            if k == 1:
                notes.append(f"batch split: no k in 2..{min(MAX_CHUNKS, request.batch_size)} is priced faster "
                             "(the per-chunk latency and overhead outweigh the transfer it hides)")
        else:
            notes.append(why)
    step = step_w - split_saved
    if terms is not None and k > 1:  # the compute runs on one flow, the chunks on one link
        step = min(step_w, max(step, terms.compute_s, terms.comm_s))
        split_saved = step_w - step
    return RewriteChoice(batch_split=k, id_dtype=id_dtype, dedup_features=dedup, step_without_s=step0,
                         step_s=max(0.0, min(step, step0)), input_dist_saved_s=saved_s, split_saved_s=split_saved,
                         wire_bytes_before=before, wire_bytes_after=after, notes=tuple(notes), terms=terms)


def with_rewrites_of(optimizations: Any, request: Any, evaluated: Any) -> Any:
    """``evaluated`` (a 1D ``PlanResult``: a plan's sharding priced again) with the rewrites
    ``optimizations`` carries priced again on it: the stage choosing among those it set (the batch
    split where it splits, narrow ids where its ids are narrow, dedup where it deduplicates) on
    ``request``; ``evaluated`` unchanged for optimizations without rewrites or a 2D plan."""
    o = optimizations
    allowed = tuple(name for name, on in ((BATCH_SPLIT, o.batch_split > 1), (ID_DTYPE, o.id_dtype != "int64"),
                                          (DEDUP, bool(o.dedup_features))) if on)
    if o.is_2d or not allowed:
        return evaluated
    return attrs.evolve(evaluated, rewrites=choose_rewrites(request, evaluated, allowed))
