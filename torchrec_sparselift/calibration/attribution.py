"""Where a real training step's time goes, by sparse-path node kind, next to the model's prediction
(the values and the model side; profiling steps is :mod:`torchrec_sparselift.measure.attribution`).

::

    att = attribute_steps(pipeline, batches, steps=5, pg=pg, label=plan.summary())   # measure
    predicted = predicted_for_plan(evaluate_sharding_plan(...))
    print(format_comparison(compare(att, predicted), att))
    save_attribution("attribution.json", att)      # sparselift explain PLAN --attribution attribution.json

A :class:`StepAttribution` holds every rank's mean milliseconds per step per kind
(:class:`RankAttribution`); the kinds partition the profiled step (they sum to it). Kinds
(:data:`KINDS`): ``input_dist`` (ids/lengths all-to-alls and their waits), ``kjt`` (KJT
permutes, bucketize, recat), ``lookup`` (TBE forward; the data-parallel tables' dense lookup),
``output_dist`` (pooled all-to-all / reduce-scatter), ``grad_dist`` (their backward),
``backward_update`` (TBE backward with the fused optimizer; data-parallel tables' gradient),
``grad_allreduce`` (DDP all-reduce of dense and data-parallel gradients, exposed part),
``dense_optimizer`` (``optimizer.step``/``zero_grad``: the dense part and data-parallel tables),
``dense_fwd``, ``dense_bwd``, ``pipeline`` (batch copy, waits, other pipeline bookkeeping),
``data`` (the pipeline's ``next(dataloader)``: the example builds its synthetic batch there),
``rest``.

:func:`predicted_by_kind` splits the model's step into the same kinds; :data:`FIT_GROUPS` joins
kinds the step fit (:mod:`torchrec_sparselift.calibration.step_fit`) fits together.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.atomic import write_json
from torchrec_sparselift.files import Fields, load_json, read_attrs, record_reader
from torchrec_sparselift.cost.model import BWD, FWD, dp_optimizer_s, node_time
from torchrec_sparselift.cost.pipelines import PHASES
from torchrec_sparselift.semantics.graph import shard_nodes

__all__ = [
    "KINDS",
    "PREDICTED_KINDS",
    "FIT_GROUPS",
    "RankAttribution",
    "StepAttribution",
    "KindComparison",
    "group_kinds",
    "measured_groups",
    "predicted_by_kind",
    "predicted_for_plan",
    "model_splits",
    "dp_optimizer_seconds",
    "compare",
    "format_attribution",
    "format_comparison",
    "save_attribution",
    "load_attribution",
]

SCHEMA = "sparselift.attribution/1"

KINDS = (
    "input_dist",
    "kjt",
    "lookup",
    "output_dist",
    "grad_dist",
    "backward_update",
    "grad_allreduce",
    "dense_optimizer",
    "dense_fwd",
    "dense_bwd",
    "pipeline",
    "data",
    "rest",
)

#: For each measured kind, the model phases (cost.pipelines.PHASES names) that predict it. Kinds
#: absent here have no term in the model (predicted 0); a phase not named here counts as ``rest``.
PREDICTED_KINDS: Mapping[str, Tuple[str, ...]] = {
    "input_dist": ("input_dist",),
    "lookup": ("lookup", "uvm_fetch"),
    "output_dist": ("output_dist",),
    "grad_dist": ("grad_dist",),
    "backward_update": ("backward_update",),
    "grad_allreduce": ("allreduce",),
    "dense_fwd": ("dense_fwd",),
    "dense_bwd": ("dense_bwd",),
    "pipeline": ("step_overhead",),
}

#: Kinds fitted together in profile-guided calibration (:mod:`torchrec_sparselift.calibration.step_fit`):
#: each group's measured time is fitted to the model's, so a term is judged on the work it prices
#: (the dense part cannot hide in per-table costs). A group joins kinds whose split the model and
#: the profiler draw differently: collectives share one process group, so an all-to-all's wait
#: holds the peer's lag and the gradient all-reduce queued before it (``comm``); the host KJT work
#: sits inside the lookup / backward in the model (``sparse``); a data-parallel replica's per-step
#: work (DDP's gradient hooks during the dense backward, ``optimizer.step``, ``zero_grad``) is
#: priced as dense-update and per-table nodes by the model (``dense``, with the dense part and the
#: pipeline's per-step work). Every kind is in exactly one group (tested).
FIT_GROUPS: Mapping[str, Tuple[str, ...]] = {
    "dense": ("dense_fwd", "dense_bwd", "dense_optimizer", "pipeline", "data", "rest"),
    "comm": ("input_dist", "output_dist", "grad_dist", "grad_allreduce", "overlap"),
    "sparse": ("lookup", "kjt", "backward_update"),
}


def group_kinds(by_kind: Mapping[str, float]) -> Dict[str, float]:
    """Sum ``by_kind`` (measured or :func:`predicted_by_kind`'s) into :data:`FIT_GROUPS`."""
    return {g: float(sum(by_kind.get(k, 0.0) for k in kinds)) for g, kinds in FIT_GROUPS.items()}


def measured_groups(att: StepAttribution, step_s: float) -> Dict[str, float]:
    """Seconds per :data:`FIT_GROUPS` group of one measured step of ``step_s`` (the unprofiled
    steady-state step): the kinds of the rank with the most work outside collectives (the one
    the others wait for, whose waits are shortest), scaled so they sum to ``step_s`` (the
    profiler's per-operator cost spread in proportion)."""
    if not step_s > 0:
        raise ValueError(f"step_s must be a positive time, got {step_s!r}")
    comm = FIT_GROUPS["comm"]
    busiest = max(att.ranks, key=lambda r: (sum(v for k, v in r.kinds_ms.items() if k not in comm), -r.rank))
    total_ms = sum(busiest.kinds_ms.values())
    if not total_ms > 0:
        raise ValueError(f"rank {busiest.rank}'s attribution holds no time")
    scale = step_s / (total_ms * 1e-3)
    return {g: v * 1e-3 * scale for g, v in group_kinds(busiest.kinds_ms).items()}


def _kinds_map(value: Any) -> Dict[str, float]:
    d = {str(k): float(v) for k, v in dict(value).items()}
    unknown = sorted(set(d) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown attribution kinds {unknown}; known: {', '.join(KINDS)}")
    return {k: d.get(k, 0.0) for k in KINDS}


@attrs.frozen(kw_only=True)
class RankAttribution:
    """One rank's profiled steps: mean ms per step per kind; the kinds sum to ``step_ms``."""

    rank: int
    steps: int
    step_ms: float
    kinds_ms: Mapping[str, float] = attrs.field(converter=_kinds_map)
    unprofiled_step_ms: Optional[float] = None

    def __attrs_post_init__(self) -> None:
        total = sum(self.kinds_ms.values())
        if not math.isclose(total, self.step_ms, rel_tol=1e-6, abs_tol=1e-6):
            raise ValueError(f"rank {self.rank}: kinds sum to {total:.6f} ms, not the step's {self.step_ms:.6f} ms")

    def to_dict(self) -> Dict[str, Any]:
        return {"rank": self.rank, "steps": self.steps, "step_ms": self.step_ms,
                "kinds_ms": dict(self.kinds_ms), "unprofiled_step_ms": self.unprofiled_step_ms}

    @classmethod
    def from_dict(cls, d: Any) -> "RankAttribution":
        """The rank :meth:`to_dict` wrote (a dict, or a file's reader)."""
        return read_attrs(cls, d, kinds={"rank": int, "steps": int, "step_ms": float, "kinds_ms": dict,
                                         "unprofiled_step_ms": float})


@attrs.frozen(kw_only=True)
class StepAttribution:
    """Attribution of every rank (rank order) of one run; ``slowest`` is the rank with the longest step.

    ``label`` names the plan (e.g. ``ExecutionPlan.summary()``); ``pipeline`` the train pipeline;
    ``device`` cpu or cuda.
    """

    ranks: Tuple[RankAttribution, ...] = attrs.field(converter=tuple)
    label: str = ""
    pipeline: str = ""
    device: str = "cpu"

    def __attrs_post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("a StepAttribution needs at least one rank")

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def slowest(self) -> RankAttribution:
        """The rank whose profiled step is longest (a synchronous step waits for it)."""
        return max(self.ranks, key=lambda r: (r.step_ms, -r.rank))

    @property
    def step_ms(self) -> float:
        return self.slowest.step_ms

    @property
    def unprofiled_step_ms(self) -> Optional[float]:
        vals = [r.unprofiled_step_ms for r in self.ranks if r.unprofiled_step_ms is not None]
        return max(vals) if vals else None

    def kinds_ms(self, rank: Optional[int] = None) -> Mapping[str, float]:
        """ms per step per kind of ``rank`` (default: the slowest rank)."""
        if rank is None:
            return self.slowest.kinds_ms
        for r in self.ranks:
            if r.rank == rank:
                return r.kinds_ms
        raise KeyError(f"no rank {rank} in this attribution (ranks {[r.rank for r in self.ranks]})")

    def to_dict(self) -> Dict[str, Any]:
        return {"schema": SCHEMA, "label": self.label, "pipeline": self.pipeline, "device": self.device,
                "ranks": [r.to_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, d: Any) -> "StepAttribution":
        """The attribution :meth:`to_dict` wrote (a dict, or a file's reader)."""
        f = record_reader(cls, d)
        schema = f.data.get("schema")
        if schema != SCHEMA:
            raise f.fail("schema", f"is {schema!r}, not {SCHEMA!r}: not an attribution file",
                         "write one with examples/dlrm/train.py --attribute N --attribution-out FILE")
        return read_attrs(cls, f, ignore_unknown=True, kinds={"label": str, "pipeline": str, "device": str},
                          ranks=lambda r: [RankAttribution.from_dict(x) for x in r.objs("ranks", nonempty=True)])


def save_attribution(path: str, att: StepAttribution) -> None:
    """Write ``att`` as JSON, atomically."""
    write_json(path, att.to_dict(), prefix=".attribution-", sort_keys=True)


def load_attribution(path: str) -> StepAttribution:
    """Read a file written by :func:`save_attribution`;
    :class:`~torchrec_sparselift.errors.FileFormatError` (a ``ValueError``) naming the file and the
    field (``ranks[1].kinds_ms``) for anything else."""
    return StepAttribution.from_dict(Fields(load_json(path, "attribution file", top=dict), file=path,
                                            what="attribution file"))


def dp_optimizer_seconds(evaluated: Any) -> float:
    """The model's dense-optimizer time of the plan's data-parallel tables (seconds per step).

    The graph puts it inside ``backward_update`` (a pass over the whole replica, the same on every
    rank); :func:`predicted_by_kind` moves it to ``dense_optimizer``, where it is measured.
    ``evaluated`` is a :class:`~torchrec_sparselift.planner.PlanResult`
    (:func:`torchrec_sparselift.cost.model.dp_optimizer_s` of its tables).
    """
    prob, s = evaluated.problem, evaluated.search
    return dp_optimizer_s(prob.specs, [prob.cands[cid] for cid, _r in s.assignment], prob.ctx)


_KJT_NODE_KINDS = ("kjt_work", "bucketize")  # host work per feature / per id: the KJT kind


def model_splits(evaluated: Any) -> Dict[str, float]:
    """The parts of the model's compute phases that the attribution measures as other kinds, on
    the rank that sets each phase (seconds): ``kjt_fwd_s`` / ``kjt_bwd_s`` (host KJT work nodes
    inside ``lookup`` / ``backward_update``), ``dp_optimizer_s`` (:func:`dp_optimizer_seconds`).
    Keyword arguments for :func:`predicted_by_kind`; ``evaluated`` is a PlanResult.
    """
    import numpy as np

    prob, s = evaluated.problem, evaluated.search
    ctx = prob.ctx
    W = ctx.world_size
    kjt = np.zeros((W, 2))  # forward, backward
    for t, (cid, ranks) in enumerate(s.assignment):
        cand = prob.cands[cid]
        for owner in ranks:
            for node in shard_nodes(prob.specs[t], cand, W, ctx.local_world_size):
                if node.kind not in _KJT_NODE_KINDS:
                    continue
                v = node_time(node, ctx.profile)
                col = 1 if node.backward else 0
                if node.scope == "owner":
                    kjt[owner, col] += v
                elif node.scope == "others":
                    kjt[:, col] += v
                    kjt[owner, col] -= v
                else:
                    kjt[:, col] += v
    loads = getattr(s, "rank_loads", None)
    if loads is not None and len(loads) == W:
        r_fwd, r_bwd = int(np.argmax(loads[:, FWD])), int(np.argmax(loads[:, BWD]))
    else:
        r_fwd = r_bwd = int(np.argmax(kjt.sum(axis=1)))
    return {"kjt_fwd_s": float(kjt[r_fwd, 0]), "kjt_bwd_s": float(kjt[r_bwd, 1]),
            "dp_optimizer_s": dp_optimizer_seconds(evaluated)}


def predicted_for_plan(evaluated: Any) -> Dict[str, float]:
    """:func:`predicted_by_kind` for a PlanResult (e.g. from ``evaluate_sharding_plan``)."""
    return predicted_by_kind(evaluated.search.step, **model_splits(evaluated))


def predicted_by_kind(step: Any, *, dp_optimizer_s: float = 0.0, kjt_fwd_s: float = 0.0,
                      kjt_bwd_s: float = 0.0) -> Dict[str, float]:
    """The model's seconds per step for each of :data:`KINDS` (plus ``overlap``, <= 0).

    ``step`` is a :class:`~torchrec_sparselift.cost.model.StepTime` (its ``phases``, ``total_s``).
    Each kind gets the phases of :data:`PREDICTED_KINDS`; the all-reduce only its part longer than
    the dense backward where the pipeline overlaps (the model hides the rest under it), all of it
    where nothing overlaps (``step.overlapped_s == 0``, e.g. CPU gloo); ``dense_optimizer`` the data-parallel
    tables' optimizer pass (``dp_optimizer_s``, taken out of ``backward_update``); ``kjt`` the host
    KJT work the model puts inside ``lookup`` (``kjt_fwd_s``) and ``backward_update``
    (``kjt_bwd_s``) (see :func:`model_splits`). ``overlap`` is
    ``total_s`` minus the sum, what the pipeline hides; the values sum to ``total_s``.
    """
    ph = dict(step.phases)
    out = {k: 0.0 for k in KINDS}
    named = {p for phases in PREDICTED_KINDS.values() for p in phases} | {p.name for p in PHASES if p.part_of}
    for kind, phases in PREDICTED_KINDS.items():
        out[kind] = sum(float(ph.get(p, 0.0)) for p in phases)
    out["rest"] += sum(float(v) for p, v in ph.items() if p not in named)
    allreduce = float(ph.get("allreduce", 0.0))
    if float(getattr(step, "overlapped_s", 1.0)) > 0:
        allreduce = max(0.0, allreduce - float(ph.get("dense_bwd", 0.0)))
    out["grad_allreduce"] = allreduce  # where nothing overlaps (CPU gloo) all of it is exposed
    kf = min(max(0.0, kjt_fwd_s), out["lookup"])
    out["lookup"] -= kf
    kb = min(max(0.0, kjt_bwd_s), out["backward_update"])
    out["backward_update"] -= kb
    out["kjt"] = kf + kb
    dp = min(max(0.0, dp_optimizer_s), out["backward_update"])
    out["backward_update"] -= dp
    out["dense_optimizer"] = dp
    out["overlap"] = float(step.total_s) - sum(out.values())
    if out["overlap"] > 1e-12:
        # the modeled total holds a term that is in no phase (should not happen): keep it visible
        out["rest"] += out["overlap"]
        out["overlap"] = 0.0
    return out


@attrs.frozen
class KindComparison:
    """One kind: measured ms per step (slowest rank), predicted ms, and the difference."""

    kind: str
    measured_ms: float
    predicted_ms: Optional[float]

    @property
    def delta_ms(self) -> Optional[float]:
        return None if self.predicted_ms is None else self.measured_ms - self.predicted_ms


def compare(att: StepAttribution, predicted_s: Optional[Mapping[str, float]],
            rank: Optional[int] = None) -> Tuple[KindComparison, ...]:
    """One row per kind (plus ``overlap`` when predicted, and ``step``): measured vs predicted.

    ``predicted_s`` is :func:`predicted_by_kind`'s output (seconds) or None (measured only).
    """
    measured = att.kinds_ms(rank)
    rows = []
    for k in KINDS:
        pred = None if predicted_s is None else float(predicted_s.get(k, 0.0)) * 1e3
        rows.append(KindComparison(k, float(measured[k]), pred))
    if predicted_s is not None and abs(predicted_s.get("overlap", 0.0)) > 1e-9:
        rows.append(KindComparison("overlap", 0.0, float(predicted_s["overlap"]) * 1e3))
    step_ms = sum(measured.values())
    total_pred = None if predicted_s is None else sum(float(v) for v in predicted_s.values()) * 1e3
    rows.append(KindComparison("step", step_ms, total_pred))
    return tuple(rows)


def format_comparison(rows: Sequence[KindComparison], att: Optional[StepAttribution] = None,
                      rank: Optional[int] = None) -> str:
    """A fixed-width table of :func:`compare`'s rows (ms per step, share of the measured step)."""
    step = next((r.measured_ms for r in rows if r.kind == "step"), 0.0) or 1e-30
    has_pred = any(r.predicted_ms is not None for r in rows)
    head = ["kind", "measured ms", "share"] + (["predicted ms", "measured-predicted"] if has_pred else [])
    lines = []
    for r in rows:
        cells = [r.kind, f"{r.measured_ms:.3f}", f"{r.measured_ms / step:.0%}" if r.kind != "overlap" else ""]
        if has_pred:
            if r.predicted_ms is None:
                cells += ["-", "-"]
            else:
                modelled = r.kind in PREDICTED_KINDS or r.kind in ("overlap", "step") or r.predicted_ms != 0
                note = "" if modelled or r.measured_ms == 0 else " (not modelled)"
                cells += [f"{r.predicted_ms:.3f}", f"{r.delta_ms:+.3f}{note}"]
        lines.append(cells)
    widths = [max(len(c[i]) for c in lines + [head]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(  # noqa: E731
        (c.ljust(widths[i]) if i == 0 or i == len(head) - 1 else c.rjust(widths[i])) for i, c in enumerate(cells)).rstrip()
    out = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(c) for c in lines]
    if att is not None:
        who = att.slowest if rank is None else next(r for r in att.ranks if r.rank == rank)
        extra = "" if who.unprofiled_step_ms is None else f"; the same steps unprofiled: {who.unprofiled_step_ms:.3f} ms"
        out.append(f"rank {who.rank} of {att.world_size} ({'slowest' if rank is None else 'chosen'}), mean of "
                   f"{who.steps} profiled steps{extra}")
    return "\n".join(out)


def format_attribution(att: StepAttribution) -> str:
    """Every rank's ms per step per kind side by side."""
    head = ["kind"] + [f"rank {r.rank}" for r in att.ranks]
    rows = [[k] + [f"{r.kinds_ms[k]:.3f}" for r in att.ranks] for k in KINDS]
    rows.append(["step"] + [f"{r.step_ms:.3f}" for r in att.ranks])
    if att.unprofiled_step_ms is not None:
        rows.append(["unprofiled step"] + [("-" if r.unprofiled_step_ms is None else f"{r.unprofiled_step_ms:.3f}")
                                           for r in att.ranks])
    widths = [max(len(c[i]) for c in rows + [head]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])  # noqa: E731
                                  for i, c in enumerate(cells)).rstrip()
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])
