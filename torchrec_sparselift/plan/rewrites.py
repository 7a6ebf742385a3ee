"""The sparse-path rewrites of a 1D plan: which ones the search prices (:func:`search_rewrites`),
and, for the plan it chose, which are chosen and what they save (:func:`choose_rewrites`).

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
  (:func:`~torchrec_sparselift.cost.wire_ids.dedup_saving_s`).

The search prices them in its step equation (docs/cost_model.md, "The sparse-path rewrites in the
step equation"): the wire rewrites in every option's input-dist columns
(:func:`~torchrec_sparselift.cost.wire_ids.table_wire`, ``cost.model.rewrite_wire``), the split in
the ``overlap`` pipeline's price (``search.solve.split_price``). The price of the rewritten plan
(:func:`choose_rewrites`) takes the same functions on the plan's options: its loads with the wire
rewrites, the pipeline's composition on them (its measured step factor included), and with a
split::

    step = min(S, max(S - (split_step_s(terms, 1) - split_step_s(terms, k)), F))

(``S`` the unsplit step, ``F`` the split's floor, ``search.equation.SPLIT_FLOOR_PATHS``), so for
the search's own plan it is the search's ``priced_step_s``; ``step_without_s`` is the same plan on
TorchRec's int64 input dist, unsplit. Every rewrite not chosen has its reason in
:attr:`RewriteChoice.notes`. The never-slower rule (``plan.planning.apply_never_slower``) judges
the rewritten plan, the saving a term of its own (:data:`~torchrec_sparselift.plan.baseline.REWRITE_TERM`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.cost.batch_split import (
    BATCH_SPLIT_PIPELINE, MAX_CHUNKS, SplitSchedule, SplitTerms, chunk_dense_s, pooled_features, split_schedule,
    split_step_s,
)
from torchrec_sparselift.cost.evaluator import PlanEvaluator
from torchrec_sparselift.cost.model import rewrite_wire
from torchrec_sparselift.cost.terms import layout
from torchrec_sparselift.cost.two_level import plan_note
from torchrec_sparselift.cost.wire_ids import WireRule, feature_tuple, narrow_refusal, table_wire, wire_features
from torchrec_sparselift.search.solve import split_price, split_terms, split_floor_terms
from torchrec_sparselift.semantics.per_sample import per_sample_violation
from torchrec_sparselift.semantics.tables import is_feature_processed
from torchrec_sparselift.vocabulary import (
    COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE, TABLE_WISE,
)

__all__ = ["REWRITES", "BATCH_SPLIT", "ID_DTYPE", "DEDUP", "SPLIT_SHARDING_TYPES", "WIRE_SHARDING_TYPES",
           "rewrite_names", "rewrite_problem", "RewriteChoice", "choose_rewrites", "no_rewrites", "search_rewrites",
           "price_rewrites"]

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
    #: the rewrites the search priced in its step equation (``search_rewrites``: ``id_dtype`` and
    #: ``dedup`` in the options' input-dist columns, ``batch_split`` in the ``overlap`` price);
    #: empty for a plan priced after the search (an evaluated or stored plan)
    in_search: Tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: the plan's phase seconds with the wire rewrites (``cost.pipelines.PHASE_NAMES``; before the
    #: split), what ``explain``'s timeline draws; empty where none is chosen
    phases: Mapping[str, float] = attrs.field(factory=dict, eq=False, repr=False)

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
                             notes=self.notes + (note,), in_search=self.in_search)

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
        if self.in_search:
            where = [w for w, on in (("every option's input-dist columns", set(self.in_search) & {ID_DTYPE, DEDUP}),
                                     ("the overlap pipeline at its best batch split", BATCH_SPLIT in self.in_search))
                     if on]
            lines.append(f"  priced in the search's step equation: {', '.join(self.in_search)} ({'; '.join(where)}), "
                         "so the sharding is chosen with them")
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
                    notes=list(self.notes), terms=None if self.terms is None else attrs.asdict(self.terms),
                    in_search=list(self.in_search), phases=dict(self.phases))

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
                   terms=None if not terms else SplitTerms(**terms),
                   in_search=tuple(str(n) for n in data.get("in_search", ())),
                   phases={str(k): float(v) for k, v in (data.get("phases") or {}).items()})


def no_rewrites(step_s: float, *notes: str) -> RewriteChoice:
    """No rewrite chosen (the step unchanged), with the reasons ``notes``."""
    return RewriteChoice(step_without_s=step_s, step_s=step_s, notes=notes)


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


def _split_refusal(request: Any, handles: Sequence[Any], pipeline: str, profile: Any,
                   sharding_types: Iterable[str]) -> Optional[str]:
    """Why the batch split does not apply (None where it does): the pipeline, the profile's
    ``chunk_overhead_s``, the sharding types, the modules and the per-sample rule."""
    splits = sorted({st for st in sharding_types if st not in SPLIT_SHARDING_TYPES})
    if pipeline != BATCH_SPLIT_PIPELINE:
        return (f"batch split: the pipeline is {pipeline!r}; the split chunks the {BATCH_SPLIT_PIPELINE!r} "
                "pipeline's all-to-alls")
    if _calibrated(profile, "chunk_overhead_s") is None:
        return (f"batch split: the profile {profile.name} has no chunk_overhead_s (the dense calls' cost per "
                "extra chunk); " + _CALIBRATE)
    if splits:
        return f"batch split: the runtime does not split the output of {', '.join(splits)} tables"
    if any(not h.spec.is_pooled for h in handles):
        return "batch split: the runtime splits pooled outputs only, and the model has sequence tables (EmbeddingCollection)"
    if any(is_feature_processed(h.sharder_key) for h in handles):
        return "batch split: the runtime does not split a feature-processed module's output"
    if request.module is not None:  # a declaration cannot clear a BatchNorm or a dropout
        return per_sample_violation(request.module, request.per_sample)
    if not request.per_sample:
        return "batch split: the request carries no module to inspect; declare it per-sample (per_sample=True)"
    return None


def _input_bandwidth(request: Any) -> float:
    world, local = int(request.topology.world_size), int(request.topology.local_world_size)
    hw = request.hardware
    return float(hw.inter_host_bw if world > local else hw.intra_host_bw)


def _wire_rule(request: Any, id_dtype: str, dedup_id_s: Optional[float], batch_size: int) -> WireRule:
    world, local = int(request.topology.world_size), int(request.topology.local_world_size)
    return WireRule(id_dtype=id_dtype, dedup_id_s=dedup_id_s, bandwidth=_input_bandwidth(request),
                    batch_size=batch_size, world_size=world, local_world_size=min(local, world),
                    stats=request.stats)


def search_rewrites(request: Any, handles: Sequence[Any], pipelines: Sequence[str],
                    two_d: bool = False) -> Tuple[Optional[WireRule], Optional[float]]:
    """The rewrites the search prices for ``request``'s tables (``handles``) over the whole world:
    ``(wire, split_overhead_s)`` for ``search.problem.build_problem``.

    ``wire``: narrow ids where ``id_dtype`` is allowed and every table that has a model-parallel
    sharding type fits int32 (so every plan of the space may narrow its ids), per-feature dedup
    where ``dedup`` is allowed and the profile has ``dedup_id_s``; None where neither applies, for
    a 2D plan, ``cost_model='torchrec'``, or sequence and feature-processed tables (the runtime
    rewrites EmbeddingBagCollections' input dists only). ``split_overhead_s``: one more chunk's
    dense cost on the profile (``cost.batch_split.chunk_dense_s``: ``chunk_overhead_s`` plus
    ``chunk_feature_s`` per pooled feature of the tables) where the batch split applies to every
    plan the search may choose under ``overlap`` (:func:`_split_refusal`), else None.
    :func:`choose_rewrites` judges one plan by the same rules, so it prices what the search priced."""
    if two_d or not str(request.cost_model).startswith("sparselift"):
        return None, None
    allowed = tuple(request.rewrites)
    profile = request.hardware
    wire = None
    if (ID_DTYPE in allowed or DEDUP in allowed) and not any(
            not h.spec.is_pooled or is_feature_processed(h.sharder_key) for h in handles):
        narrow = ID_DTYPE in allowed and narrow_refusal(
            (h.spec.name, int(h.spec.num_embeddings)) for h in handles
            if any(st != DATA_PARALLEL for st in h.spec.sharding_types)) is None
        dedup_id_s = _calibrated(profile, "dedup_id_s") if DEDUP in allowed else None
        rule = _wire_rule(request, "int32" if narrow else "int64", dedup_id_s, int(request.batch_size))
        wire = rule if rule.active else None
    split = None
    if BATCH_SPLIT in allowed and BATCH_SPLIT_PIPELINE in pipelines and _split_refusal(
            request, handles, BATCH_SPLIT_PIPELINE, profile, SPLIT_SHARDING_TYPES) is None:
        split = chunk_dense_s(profile, pooled_features(handles))  # every plan of the search: the same features
    return wire, split


def _evaluator(prob: Any, costs: Sequence[Any], s: Any) -> PlanEvaluator:
    """An evaluator of ``prob``'s options priced ``costs`` under ``s``'s settings, with ``s``'s plan."""
    ev = PlanEvaluator(prob.ctx, list(costs), [c.sharding_type for c in prob.cands], prob.device_cap,
                       prob.host_cap, s.pipeline, s.fwd_precision, s.bwd_precision,
                       kernels=[c.compute_kernel for c in prob.cands])
    ev.assign_many({t: (cid, ranks) for t, (cid, ranks) in enumerate(s.assignment)})
    return ev


def _wired_costs(res: Any, plain_costs: Sequence[Any], rule: WireRule,
                 dedup: Optional[Iterable[str]] = None) -> Tuple[List[Any], List[Any]]:
    """The plan's options' costs with the wire rewrites of ``rule`` in their input-dist columns
    (``table_wire``: ``dedup`` forced, or the features whose price pays) and each table's wire terms."""
    prob, ctx = res.problem, res.problem.ctx
    costs, wires = list(plain_costs), []
    for h, (cid, _ranks) in zip(res.handles, res.search.assignment):
        c = prob.cands[cid]
        tw = table_wire(rule, h.spec, c.sharding_type, c.num_shards, dedup=dedup)
        costs[cid] = rewrite_wire(plain_costs[cid], tw.factor, tw.kernel_s, c.num_shards, ctx)
        wires.append(tw)
    return costs, wires


def choose_rewrites(request: Any, res: Any, allowed: Optional[Iterable[str]] = None) -> RewriteChoice:
    """The rewrites for ``res`` (a 1D ``PlanResult`` of ``request``, a ``PlanRequest``) among
    ``allowed`` (default: ``request.rewrites``), priced on its loads (module docstring): the same
    terms the search prices (``cost.wire_ids.table_wire`` in the input-dist columns,
    ``search.solve.split_price``), so for a plan the search chose its ``step_s`` is the search's
    ``priced_step_s``."""
    s = res.search
    prob = res.problem
    allowed = tuple(request.rewrites if allowed is None else allowed)
    if not allowed:
        return no_rewrites(float(s.step.total_s))
    if res.sharding_group_size is not None:
        return no_rewrites(float(s.step.total_s), "a 2D plan: the rewrites apply to 1D plans only")
    if not str(request.cost_model).startswith("sparselift"):
        return no_rewrites(float(s.step.total_s),
                           "cost_model='torchrec': the rewrites are priced by SparseLift's cost model only")
    ctx = prob.ctx
    profile = ctx.profile
    plain_costs = prob.plain_costs if prob.plain_costs is not None else prob.costs
    ev0 = _evaluator(prob, plain_costs, s)
    step0 = float(ev0.step_time().total_s)
    sharding = _sharding(res)
    notes: List[str] = []
    per_host = min(ctx.local_world_size, ctx.world_size)
    hosts_note = plan_note(ctx.world_size // per_host, per_host,
                           float(ev0.colmax()[layout().index["out_inter_bytes"]]), profile)
    notes += [hosts_note] if hosts_note else []

    # -- ids on the wire ---------------------------------------------------------------------
    id_dtype, dedup, before, after = "int64", (), 0.0, 0.0
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
    ev, costs = ev0, plain_costs
    if want_narrow or want_dedup:
        world, local = int(request.topology.world_size), int(request.topology.local_world_size)
        features = wire_features(request.tables, request.stats, sharding, batch_size=request.batch_size,
                                 world_size=world, local_world_size=min(local, world))
        if want_dedup and not any(f.unique_ratio is not None for f in features):
            notes.append("dedup: no observed distinct-id ratio for the model-parallel features (pass the workload's "
                         "statistics: workload=semantics.workload.observe(...))")
            want_dedup = False
        refused = narrow_refusal((h.spec.name, int(h.spec.num_embeddings)) for h in res.handles
                                 if sharding[h.spec.name][0] != DATA_PARALLEL) if want_narrow else None
        if refused:
            notes.append(f"id_dtype: {refused}")
        narrow = want_narrow and not refused
        for dedup_on in ((True, False) if want_dedup else (False,)):
            rule = _wire_rule(request, "int32" if narrow else "int64", dedup_id_s if dedup_on else None,
                              int(ctx.batch_size))
            if not rule.active:
                break
            rewritten, wires = _wired_costs(res, plain_costs, rule)
            ev1 = _evaluator(prob, rewritten, s)
            if dedup_on and ev1.step_time().total_s > step0 * (1 + 1e-12):
                notes.append("dedup: its kernels outweigh the bytes it removes on this plan's slowest rank")
                continue
            ev, costs = ev1, rewritten
            id_dtype = rule.id_dtype
            dedup = feature_tuple(f for tw in wires for f in tw.dedup_features)
            before = sum(tw.bytes_before for tw in wires)
            after = sum(tw.bytes_after for tw in wires)
            break
        if want_dedup and not dedup and not any("dedup:" in n for n in notes):
            notes.append("dedup: no feature's distinct ids are few enough to pay for the dedup kernels")
    step_w = min(step0, float(ev.step_time().total_s))
    saved_s = max(0.0, ev0.phases()["input_dist"] - ev.phases()["input_dist"])

    # -- batch split -------------------------------------------------------------------------
    k, split_saved, terms, step = 1, 0.0, None, step_w
    if BATCH_SPLIT in allowed:
        why = _split_refusal(request, res.handles, s.pipeline, profile, (st for st, _ in sharding.values()))
        if why is None:
            terms = split_terms(ev, _calibrated(profile, "chunk_overhead_s") or 0.0,
                                _calibrated(profile, "chunk_feature_s") or 0.0, pooled_features(res.handles))
            k, step = split_price(step_w, terms, ctx.batch_size)
            split_saved = max(0.0, step_w - step)
            if k == 1:
                notes.append(f"batch split: no k in 2..{min(MAX_CHUNKS, ctx.batch_size)} is priced faster "
                             "(the per-chunk latency and overhead outweigh the transfer it hides)")
        else:
            notes.append(why)
    in_search = []
    if prob.wire is not None:
        in_search += [n for n, on in ((ID_DTYPE, prob.wire.id_dtype != "int64"),
                                      (DEDUP, prob.wire.dedup_id_s is not None)) if on and n in allowed]
    if prob.split_overhead_s is not None and BATCH_SPLIT in allowed:
        in_search.append(BATCH_SPLIT)
    chosen = id_dtype != "int64" or bool(dedup)
    return RewriteChoice(batch_split=k, id_dtype=id_dtype, dedup_features=dedup, step_without_s=step0,
                         step_s=max(0.0, min(step, step0)), input_dist_saved_s=saved_s, split_saved_s=split_saved,
                         wire_bytes_before=before, wire_bytes_after=after, notes=tuple(notes), terms=terms,
                         in_search=tuple(in_search), phases=dict(ev.phases()) if chosen else {})


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


def price_rewrites(request: Any, res: Any, *, batch_split: int = 1, id_dtype: str = "int64",
                   dedup_features: Iterable[str] = ()) -> float:
    """The step (seconds) of ``res``'s plan (a 1D ``PlanResult`` of ``request``) with exactly these
    rewrites, whether or not they pay: what a run that forces them is predicted at (the regimes
    benchmark's forced runs). The same terms as :func:`choose_rewrites` and the search: the
    options' input-dist columns under the wire rewrites (``cost.wire_ids.table_wire`` with the
    features forced), the pipeline's composition, and with ``batch_split`` k > 1 the ``overlap``
    pipeline's split step at k, never below the split's floor (``search.solve.split_floor_terms``)
    (``ValueError`` for another pipeline, an uncalibrated ``chunk_overhead_s``, or a dedup feature
    that is not a model-parallel feature of the plan or has no observed distinct-id ratio)."""
    s = res.search
    if res.sharding_group_size is not None:
        raise ValueError("price_rewrites: the rewrites apply to 1D plans only")
    prob = res.problem
    ctx = prob.ctx
    profile = ctx.profile
    plain_costs = prob.plain_costs if prob.plain_costs is not None else prob.costs
    dedup = feature_tuple(dedup_features)
    costs = plain_costs
    if id_dtype != "int64" or dedup:
        sharding = _sharding(res)
        world, local = int(request.topology.world_size), int(request.topology.local_world_size)
        names = {f.feature for f in wire_features(request.tables, request.stats, sharding,
                                                  batch_size=request.batch_size, world_size=world,
                                                  local_world_size=min(local, world))}
        unknown = sorted(set(dedup) - names)
        if unknown:
            raise ValueError(f"price_rewrites: dedup features {unknown[:4]} are not model-parallel features of the plan")
        dedup_id_s = _calibrated(profile, "dedup_id_s")
        if dedup and dedup_id_s is None:
            raise ValueError(f"price_rewrites: the profile {profile.name} has no dedup_id_s; " + _CALIBRATE)
        rule = _wire_rule(request, id_dtype, dedup_id_s if dedup else None, int(ctx.batch_size))
        costs, _wires = _wired_costs(res, plain_costs, rule, dedup)
    ev = _evaluator(prob, costs, s)
    step = float(ev.step_time().total_s)
    if batch_split > 1:
        if s.pipeline != BATCH_SPLIT_PIPELINE:
            raise ValueError(f"price_rewrites: a batch split chunks the {BATCH_SPLIT_PIPELINE!r} pipeline, the plan "
                             f"runs {s.pipeline!r}")
        overhead = _calibrated(profile, "chunk_overhead_s")
        if overhead is None:
            raise ValueError(f"price_rewrites: the profile {profile.name} has no chunk_overhead_s; " + _CALIBRATE)
        terms = split_terms(ev, overhead, _calibrated(profile, "chunk_feature_s") or 0.0,
                            pooled_features(res.handles))
        step += split_step_s(terms, batch_split) - split_step_s(terms, 1)
        step = max(step, split_floor_terms(terms))  # one compute flow, one link
    return max(0.0, step)
