"""Explain a plan: where the step time goes, what bounds it, and why each big table got its sharding.

Everything here reads values (an :class:`~torchrec_sparselift.plan.ExecutionPlan`, a
:class:`~torchrec_sparselift.cost.model.StepTime`, a :class:`~torchrec_sparselift.planner.PlanResult`
from :func:`~torchrec_sparselift.planner.evaluate_sharding_plan`) and returns values or text;
pictures of them are :mod:`torchrec_sparselift.pictures`.

* :func:`step_timeline` lays one steady-state step out as segments on lanes, from the same
  pipeline description :func:`~torchrec_sparselift.cost.model.step_time` evaluates
  (:mod:`torchrec_sparselift.cost.pipelines`); the critical segments end exactly at the modelled
  step time, so the picture and the number agree.
* :func:`explain_tables` re-prices each large table's other candidate shardings with the same
  incremental evaluator the search used (the rest of the plan fixed, best placement for each
  candidate, per-rank memory limits enforced): the alternatives the chosen sharding beat, and by
  how much.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.pipelines import PHASE_NAMES, PHASES, Placed, effective_pipeline, schedule
from torchrec_sparselift.cost.two_d import sync_evidence
from torchrec_sparselift.search.place import best_placement
from torchrec_sparselift.search.solve import new_evaluator
from torchrec_sparselift.plan.baseline import decision_from_dict
from torchrec_sparselift.plan.rewrites import RewriteChoice, with_rewrites_of
from torchrec_sparselift.planner import evaluate_sharding_plan
from torchrec_sparselift.search.two_d import group_topology

__all__ = [
    "Segment",
    "Alternative",
    "TableExplanation",
    "step_timeline",
    "critical_path",
    "comm_exposure",
    "explain_tables",
    "RepricedPlan",
    "reprice_plan",
    "format_plan_table",
    "format_rank_breakdown",
    "format_timeline",
    "format_tables",
    "format_2d",
    "format_never_slower",
    "format_rewrites",
    "with_stored_rewrites",
]

PHASE_ORDER = PHASE_NAMES
_PHASE_KIND = {p.name: p.kind for p in PHASES}

#: One phase of a step on a lane (seconds from the start of the step). ``critical`` segments form
#: the chain that sets the step time; the others run hidden behind them (``hidden_by`` names what
#: they overlap). ``next_batch`` marks work done for the next batch (pipelined ahead).
Segment = Placed


def step_timeline(phases: Mapping[str, float], pipeline: str, supports_overlap: bool = True,
                  spans_hosts: bool = False) -> Tuple[Segment, ...]:
    """Segments of one steady-state step under ``pipeline``'s overlap rules.

    Laid out from the pipeline's description (:func:`torchrec_sparselift.cost.pipelines.schedule`),
    the one :func:`torchrec_sparselift.cost.model.step_time` evaluates: the end of the last
    critical segment equals its ``total_s`` for the same phases (tested). The gradient all-reduce
    overlaps the dense backward; only the part longer than the dense backward is exposed
    (``allreduce`` critical tail). Hardware without overlap runs every pipeline as ``base``, except
    ``overlap`` and ``overlap_stale`` when the ranks span hosts (``spans_hosts``;
    ``cost.pipelines.effective_pipeline``).
    """
    return schedule(effective_pipeline(pipeline, supports_overlap, spans_hosts), phases, supports_overlap)


def comm_exposure(segments: Sequence[Segment]) -> Dict[str, Tuple[float, float]]:
    """Per communication phase of the step (``link`` and ``collective`` phases, the next batch's
    included), ``(hidden_s, exposed_s)``: hidden is the part of its segments during which the
    rank computes (some compute phase's segment runs at the same time, on any lane), exposed the
    rest. ``base`` exposes everything; ``overlap`` hides ``min(output_dist, dense_fwd_indep)``
    of the output all-to-all, likewise the gradient all-to-all, and the all-reduce behind the
    embedding backward; ``overlap_stale`` hides ``min(output_dist, dense_bwd)`` and
    ``min(grad_dist, dense_fwd)``."""
    compute = sorted((s.start_s, s.end_s) for s in segments if _PHASE_KIND[s.phase] == "compute" and s.duration_s > 0)
    merged: List[List[float]] = []
    for a, b in compute:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out: Dict[str, Tuple[float, float]] = {}
    for s in segments:
        if _PHASE_KIND[s.phase] == "compute":
            continue
        hidden = sum(max(0.0, min(b, s.end_s) - max(a, s.start_s)) for a, b in merged)
        h, e = out.get(s.phase, (0.0, 0.0))
        out[s.phase] = (h + hidden, e + s.duration_s - hidden)
    return out


def critical_path(segments: Sequence[Segment]) -> Tuple[Segment, ...]:
    """The critical segments in time order; their last end is the step time."""
    return tuple(sorted((s for s in segments if s.critical), key=lambda s: (s.start_s, s.lane)))


def timeline_end(segments: Sequence[Segment]) -> float:
    return max((s.end_s for s in segments), default=0.0)


# ------------------------------------------------------------------------------------------
# per-table alternatives
# ------------------------------------------------------------------------------------------


@attrs.frozen
class Alternative:
    """Another candidate sharding for one table, priced with everything else fixed.

    ``step_s`` is the modelled step time with the table sharded this way on its best ranks;
    ``None`` when it does not fit in per-rank memory next to the other tables.
    """

    label: str
    step_s: Optional[float]
    ranks: Tuple[int, ...] = ()


@attrs.frozen
class TableExplanation:
    """Why one table got its sharding: the chosen option and the alternatives it beat."""

    fqn: str
    rows: int
    dim: int
    weight_bytes: int
    chosen: str
    ranks: Tuple[int, ...]
    step_s: float
    work_s: float
    alternatives: Tuple[Alternative, ...]

    def best_alternative(self) -> Optional[Alternative]:
        fits = [a for a in self.alternatives if a.step_s is not None]
        return min(fits, key=lambda a: a.step_s) if fits else None


def _label(cand: Any) -> str:
    return f"{cand.sharding_type}/{cand.compute_kernel} x{cand.num_shards}"


def explain_tables(
    evaluated: Any,
    device_cap: np.ndarray,
    host_cap: np.ndarray,
    top: int = 8,
) -> List[TableExplanation]:
    """For the ``top`` tables with the most work, price every other candidate sharding.

    ``evaluated`` is a :class:`~torchrec_sparselift.planner.PlanResult` from
    :func:`~torchrec_sparselift.planner.evaluate_sharding_plan` (its ``problem`` holds each
    table's enumerated candidates plus the plan's own option; ``search.assignment`` the plan).
    ``device_cap``/``host_cap`` are the per-rank memory limits the planner used. The plan is
    loaded into a fresh :class:`~torchrec_sparselift.cost.evaluator.PlanEvaluator`; for one
    table at a time the table is lifted out and each candidate is placed on its best ranks
    (:func:`~torchrec_sparselift.search.place.best_placement`) and priced. Nothing is re-planned.
    """
    prob = attrs.evolve(evaluated.problem, device_cap=np.asarray(device_cap, dtype=float),
                        host_cap=np.asarray(host_cap, dtype=float))
    s = evaluated.search
    ev = new_evaluator(prob, s.pipeline, s.fwd_precision, s.bwd_precision)
    for t, (cid, ranks) in enumerate(s.assignment):
        ev.assign(t, cid, ranks)
    current = ev.objective()
    work = [prob.shard_time(cid) * len(ranks) for cid, ranks in s.assignment]
    order = sorted(range(prob.num_tables), key=lambda t: (-work[t], t))[: max(0, top)]
    out = []
    for t in order:
        cid, ranks = s.assignment[t]
        chosen = prob.cands[cid]
        ev.unassign(t)
        alts: Dict[str, Alternative] = {}
        for alt in prob.candidates[t]:
            c = prob.cands[alt]
            if c.key == chosen.key:
                continue
            got = best_placement(ev, prob, t, alt)
            a = Alternative(_label(c), None if got is None else float(got[1]),
                            () if got is None else tuple(int(r) for r in got[0]))
            prev = alts.get(a.label)
            if prev is None or (a.step_s is not None and (prev.step_s is None or a.step_s < prev.step_s)):
                alts[a.label] = a
        ev.assign(t, cid, ranks)
        spec = prob.specs[t]
        out.append(TableExplanation(
            fqn=spec.fqn, rows=spec.num_embeddings, dim=spec.embedding_dim,
            weight_bytes=spec.weight_bytes, chosen=_label(chosen), ranks=tuple(int(r) for r in ranks),
            step_s=float(current), work_s=float(work[t]),
            alternatives=tuple(sorted(alts.values(), key=lambda a: (a.step_s is None, a.step_s or 0.0, a.label))),
        ))
    return out


# ------------------------------------------------------------------------------------------
# text
# ------------------------------------------------------------------------------------------


@attrs.frozen
class RepricedPlan:
    """A stored execution plan priced again on its planning inputs (``sparselift explain``)."""

    evaluated: Any  # PlanResult of evaluate_sharding_plan
    tables: Tuple[TableExplanation, ...]  # the largest tables' reasons (explain_tables)
    segments: Tuple[Segment, ...]  # the step timeline
    supports_overlap: bool
    inputs_differ: str  # why the inputs differ from the plan's fingerprint; "" when they match
    #: per rank, the (device, host) bytes the plan may fill (the planner's memory_caps; a 2D
    #: plan's one sharding group): the capacity its memory is drawn against
    capacity: Tuple[Tuple[float, ...], Tuple[float, ...]] = ((), ())


def with_stored_rewrites(ep: Any, planner: Any, module: Any, evaluated: Any) -> Any:
    """``evaluated`` (``ep``'s sharding priced again) with the rewrites ``ep`` carries priced again
    on it (:func:`~torchrec_sparselift.plan.rewrites.with_rewrites_of`), on ``planner``'s request
    for ``module`` under ``evaluated``'s profile."""
    if ep.optimizations.is_2d:
        return evaluated
    request = attrs.evolve(planner.request(module), hardware=evaluated.profile)
    return with_rewrites_of(ep.optimizations, request, evaluated)


def reprice_plan(ep: Any, planner: Any, module: Any, constraints: Optional[Mapping[str, Any]], topology: Any,
                 per_rank_batch: int, profile: Any, top: int) -> RepricedPlan:
    """Price the execution plan ``ep`` again on ``module``/``topology`` with ``planner``'s memory
    reservation and ``profile``: the step (with the plan's rewrites, :func:`with_stored_rewrites`),
    its timeline and the ``top`` tables' reasons. A 2D
    plan's ranks are group-local, so it is priced on one sharding group. ``ValueError`` when the
    plan does not fit the inputs."""
    o = ep.optimizations
    if o.is_2d:
        local = o.layout_2d.group_ranks_per_host if o.layout_2d is not None else None
        topology = group_topology(topology, o.sharding_group_size, local)
    why = planner.fingerprint(module).mismatch(ep.fingerprint)
    evaluated = evaluate_sharding_plan(
        module, ep.sharding_plan, topology, per_rank_batch, constraints or None, hardware=profile,
        pipeline=o.pipeline, fwd_precision=o.fwd_comm_precision, bwd_precision=o.bwd_comm_precision)
    evaluated = with_stored_rewrites(ep, planner, module, evaluated)
    dev_cap, host_cap = planner.memory_caps(module)
    if o.is_2d:
        dev_cap, host_cap = dev_cap[: o.sharding_group_size], host_cap[: o.sharding_group_size]
    expl = explain_tables(evaluated, dev_cap, host_cap, top=top)
    step = evaluated.search.step
    supports = getattr(evaluated.profile, "supports_overlap", True)
    # the phases with the plan's wire rewrites where it has them (plan.rewrites.RewriteChoice.phases)
    rw = getattr(evaluated, "rewrites", None)
    phases = rw.phases if rw is not None and rw.phases else step.phases
    segments = step_timeline(phases, step.pipeline, supports, topology.world_size > topology.local_world_size)
    capacity = (tuple(float(c) for c in dev_cap), tuple(float(c) for c in host_cap))
    return RepricedPlan(evaluated, tuple(expl), tuple(segments), bool(supports), why or "", capacity)


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def _ranks(r: Sequence[int]) -> str:
    r = list(r)
    if len(r) > 3 and r == list(range(r[0], r[0] + len(r))):
        return f"{r[0]}..{r[-1]}"
    if len(r) > 8:
        return ",".join(map(str, r[:8])) + f",... ({len(r)})"
    return ",".join(map(str, r))


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A plain fixed-width table; ``align`` holds '<' or '>' per column (default: first left)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    al = align or ("<" + ">" * (len(header) - 1))
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(f"{c:{al[i]}{widths[i]}}" for i, c in enumerate(r)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_plan_table(ep: Any) -> str:
    """One row per table of an ExecutionPlan: sharding, kernel, shards, ranks, shard shape."""
    rows = []
    for module_path, mod in sorted(ep.sharding_plan.plan.items()):
        for name, ps in sorted(mod.items()):
            fqn = f"{module_path}.{name}" if module_path else name
            shards = getattr(getattr(ps, "sharding_spec", None), "shards", None) or []
            shape = "x".join(map(str, shards[0].shard_sizes)) if shards else "-"
            rows.append([fqn, ps.sharding_type, ps.compute_kernel, len(ps.ranks or []),
                         _ranks(ps.ranks or []), shape])
    return format_table(["table", "sharding", "kernel", "shards", "ranks", "shard shape"], rows, "<<<><<")


def format_rank_breakdown(prediction: Any, max_rows: int = 64) -> str:
    """Per rank: compute, exposed and overlapped communication (ms), device and host memory (GiB).
    With more ranks than ``max_rows``, the busiest ranks are shown and the rest summarised."""
    per = list(prediction.per_rank)
    order = per
    note = ""
    if len(per) > max_rows:
        order = sorted(per, key=lambda r: -(r.compute_s + r.exposed_comm_s))[:max_rows]
        order.sort(key=lambda r: r.rank)
        note = f"\n({len(per) - max_rows} less busy ranks not shown)"
    rows = [[r.rank, _ms(r.compute_s), _ms(r.exposed_comm_s), _ms(r.overlapped_comm_s),
             _ms(r.compute_s + r.exposed_comm_s), _gib(r.hbm_bytes), _gib(r.ddr_bytes)] for r in order]
    return format_table(["rank", "compute ms", "exposed comm ms", "overlapped ms", "busy ms",
                         "device GiB", "host GiB"], rows) + note


def format_timeline(segments: Sequence[Segment], total_s: float) -> str:
    """The step's phases in time order: start, duration, and whether they are on the critical path."""
    rows = []
    for s in sorted(segments, key=lambda s: (s.start_s, not s.critical, s.lane)):
        what = "critical" if s.critical else f"hidden behind {s.hidden_by}" if s.hidden_by else "hidden"
        lane = s.lane + (" (next batch)" if s.next_batch and s.lane != "next batch" else "")
        rows.append([s.phase, lane, _ms(s.start_s), _ms(s.duration_s), _ms(s.end_s), what])
    crit = critical_path(segments)
    chain = " -> ".join(f"{s.phase} {_ms(s.duration_s)}" for s in crit)
    comm = comm_exposure(segments)
    exposure = ", ".join(f"{k} {_ms(h)}/{_ms(e)}" for k, (h, e) in comm.items())
    end = timeline_end(crit)
    length = _ms(total_s)
    if end > 0 and abs(total_s / end - 1) > 1e-9:  # the pipeline's measured step factor (cost.pipelines.step_factor)
        length = f"{_ms(end)} ms x {total_s / end:.3f}, the pipeline's measured step factor, = {_ms(total_s)}"
    return (format_table(["phase", "lane", "start ms", "ms", "end ms", ""], rows, "<<>>><")
            + f"\ncritical path ({length} ms): {chain}"
            + (f"\ncommunication hidden behind compute / exposed (ms): {exposure}" if comm else ""))


def format_tables(expl: Sequence[TableExplanation]) -> str:
    """Per large table: chosen sharding and each alternative's step time relative to it."""
    lines = []
    for e in expl:
        lines.append(f"{e.fqn} ({e.rows:,} x {e.dim}, {_gib(e.weight_bytes)} GiB): {e.chosen} on ranks "
                     f"{_ranks(e.ranks)}  [step {_ms(e.step_s)} ms]")
        if not e.alternatives:
            lines.append("    no other sharding was allowed for this table")
        for a in e.alternatives:
            if a.step_s is None:
                lines.append(f"    {a.label:<34} does not fit in per-rank memory next to the other tables")
                continue
            d = a.step_s - e.step_s
            rel = d / e.step_s if e.step_s else 0.0
            if d > 1e-12:
                verdict = f"+{_ms(d)} ms ({rel:+.1%}) slower"
            elif d < -1e-12:
                verdict = f"{_ms(d)} ms ({rel:+.1%}) FASTER: the plan is not locally optimal here"
            else:
                verdict = "same step time (tie; the chosen one balances ranks better or came first)"
            lines.append(f"    {a.label:<34} {_ms(a.step_s)} ms  {verdict}")
    return "\n".join(lines)


def format_2d(optimizations: Any) -> List[str]:
    """Lines on a 2D plan: the sharding and replica groups, where their collectives run, the sync
    interval, its bound and the quality evidence for it."""
    o = optimizations
    lines = ["2D sparse parallelism:"]
    if o.layout_2d is not None:
        lines += ["  " + line for line in o.layout_2d.describe()]
    else:
        lines.append(f"  sharding groups of {o.sharding_group_size} ranks (no layout stored: "
                     "an older plan; lift() builds TorchRec's default strided groups)")
    strategy = getattr(o, "strategy", None) or "default"
    if strategy == "fully_sharded":
        lines.append("  strategy fully_sharded: weights reduce-scattered over each replica group after the "
                     "lookup and all-gathered before the embedding backward, every step; optimizer state "
                     "per replica")
        return lines
    bound = o.max_sync_interval if o.max_sync_interval is not None else defaults.MAX_SYNC_INTERVAL
    lines.append(f"  strategy default: replica sync every {o.sync_interval} steps (bound {bound}): "
                 f"{sync_evidence(o.sync_interval)}")
    return lines


def format_never_slower(planner_info: Mapping[str, Any]) -> Optional[str]:
    """The never-slower rule's decision an execution plan stored (``planner_info["never_slower"]``:
    which plan was kept, the predicted gain over TorchRec's plan, the margin it had to exceed and
    the differing terms behind it); None when the plan was made without the rule."""
    decision = decision_from_dict(planner_info.get("never_slower"))
    return None if decision is None else decision.describe()


def format_rewrites(planner_info: Mapping[str, Any]) -> List[str]:
    """The rewrite stage's choice an execution plan stored (``planner_info["rewrites"]``): the
    rewrites chosen with the predicted step with and without them, the wire-id bytes saved, per
    chunk of a batch split what the link hides and what the step waits for
    (``cost.batch_split.split_schedule``), and why each rewrite not chosen was not; no lines when
    the plan was made without the stage."""
    choice = RewriteChoice.from_dict(planner_info.get("rewrites"))
    return [] if choice is None else choice.describe()
