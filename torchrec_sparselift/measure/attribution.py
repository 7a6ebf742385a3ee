"""Where a real training step's time goes, by sparse-path node kind, next to the model's prediction.

::

    att = attribute_steps(pipeline, batches, steps=5, pg=pg, label=plan.summary())
    predicted = predicted_by_kind(evaluated.search.step, dp_optimizer_s=dp_optimizer_seconds(evaluated))
    print(format_comparison(compare(att, predicted)))
    save_attribution("attribution.json", att)      # sparselift explain PLAN --attribution attribution.json

A few steps run under ``torch.profiler`` (CPU activity only, no shapes or stacks). Every profiled
step is wrapped in a ``record_function`` range (:data:`STEP_LABEL`); the events of the thread that
ran it form a tree of nested ranges. Each range's *exclusive* time (its interval minus its
children's) is given to exactly one kind, so the kinds partition the step: they sum to the
measured (profiled) step time by construction, with no double counting.

A range's kind comes from its own name and the kind of the nearest enclosing range that has one
(:func:`classify`): TorchRec's stage labels (``[splits_dist]_...``, ``[lookup]_...``,
``[output_dist]_...``, the awaitables' ``## ... wait() ##``), its autograd nodes
(``All2All_Pooled_ReqBackward``, ``ReduceScatterBase_WaitBackward``, ``SplitLookupFunction_*``),
fbgemm's KJT kernels (``permute_2D_sparse_data``, ``block_bucketize_sparse_features``),
c10d's ``allreduce_`` (DDP) and the train pipeline's labels (``## optimizer ##``,
``## load batch N from dataloader (host) ##``, ``## copy_batch_to_gpu ##`` ...). Operators with no
sparse-path label are dense forward or backward work, by which of the pipeline's
``## forward ##``/``## backward ##`` ranges holds them. The exclusive time of bare containers (the
step, ``## forward ##``, ``## backward ##``, DDP's forward: Python and framework time outside any
operator) is split once more: the part during which a gloo/NCCL ``all_reduce`` runs on a
communication thread is DDP's exposed gradient all-reduce wait (``grad_allreduce``), the remainder
is ``rest``.

Kinds (:data:`KINDS`): ``input_dist`` (ids/lengths all-to-alls and their waits), ``kjt`` (KJT
permutes, bucketize, recat), ``lookup`` (TBE forward; the data-parallel tables' dense lookup),
``output_dist`` (pooled all-to-all / reduce-scatter), ``grad_dist`` (their backward),
``backward_update`` (TBE backward with the fused optimizer; data-parallel tables' gradient),
``grad_allreduce`` (DDP all-reduce of dense and data-parallel gradients, exposed part),
``dense_optimizer`` (``optimizer.step``/``zero_grad``: the dense part and data-parallel tables),
``dense_fwd``, ``dense_bwd``, ``pipeline`` (batch copy, waits, other pipeline bookkeeping),
``data`` (the pipeline's ``next(dataloader)``: the example builds its synthetic batch there),
``rest``.

The profiler costs time per operator (on a 26-table DLRM step on CPU within the noise of a
loaded machine: docs/benchmarks.md section 10), so :func:`attribute_steps` also times the same
number of steps without it (``unprofiled_step_ms``);
the per-kind numbers are from the profiled steps. On CUDA only host (CPU) time is attributed: kernels
queued asynchronously are charged where the host waits for them.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.atomic import write_json
__all__ = [
    "KINDS",
    "PREDICTED_KINDS",
    "STEP_LABEL",
    "ProfEvent",
    "RankAttribution",
    "StepAttribution",
    "KindComparison",
    "classify",
    "attribute_events",
    "attribute_steps",
    "profile_events",
    "predicted_by_kind",
    "predicted_for_plan",
    "FIT_GROUPS",
    "group_kinds",
    "measured_groups",
    "model_splits",
    "dp_optimizer_seconds",
    "compare",
    "format_attribution",
    "format_comparison",
    "save_attribution",
    "load_attribution",
]

SCHEMA = "sparselift.attribution/1"
STEP_LABEL = "## sparselift step ##"

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

#: Kinds fitted together in profile-guided calibration (:mod:`torchrec_sparselift.step_calibration`):
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


# ------------------------------------------------------------------------------------------------
# classification of profiler ranges
# ------------------------------------------------------------------------------------------------

_CONTEXT_FWD, _CONTEXT_BWD = "ctx:fwd", "ctx:bwd"
GAP = "gap"  # exclusive time of a bare container: split by the comm threads' all-reduces

_STAGE = re.compile(r"^\[(\w+)\]_\[")  # TorchRec's ShardedModule labels: [stage]_[module path]_[type]
_STAGE_KIND = {
    "splits_dist": "input_dist",
    "input_dist": "input_dist",
    "lookup": "lookup",
    "compute": "lookup",
    "output_dist": "output_dist",
    "compute_and_output_dist": "output_dist",
}
_INPUT_AWAITABLES = ("KJTList", "KJTAllToAll", "KJTOneToAll", "SplitsAllToAll", "sparse_data_dist",
                     "all2all_data", "dist_init", "input_dist")
_OUTPUT_AWAITABLES = ("EmbeddingBagCollectionAwaitable", "EmbeddingCollectionAwaitable",
                      "PooledEmbeddingsAwaitable", "SequenceEmbeddingsAwaitable", "VariableBatchPooled",
                      "EmbeddingsAllToOne", "ReduceScatter", "All2All_Pooled", "All2All_Seq")
_GRAD_DIST_NODES = ("All2All_Pooled", "All2All_Seq", "ReduceScatter", "AllGather", "Variable_Batch_All2All",
                    "All2Allv", "AllGatherBase", "ReduceScatterV")
_KJT_OPS = ("fbgemm::permute_", "fbgemm::block_bucketize", "fbgemm::bucketize", "fbgemm::expand_into_jagged",
            "fbgemm::keyed_jagged_index_select", "fbgemm::jagged_", "fbgemm::segment_sum_csr",
            "recat_permute_gen", "dist_init:recat", "fbgemm::invert_permute")
_TBE_BACKWARD = ("SplitLookupFunction", "split_embedding_backward", "dense_embedding_codegen_grad",
                 "SplitNoBagLookupFunction", "DenseTableBatchedEmbedding")
_DATA = ("## load batch", "## next_batch", "## load_batch")
_PIPELINE = ("## copy_batch_to_gpu", "## inplace_copy_batch_to_gpu", "## wait_for_batch", "## dmp_collection_sync",
             "## sharded_module_prefetch", "## runtime_forward", "## backward_hook", "## ebc ")
_OPTIMIZER = ("## optimizer", "## zero_grad", "Optimizer.step#", "Optimizer.zero_grad#")
_CONTAINERS = ("DistributedDataParallel.forward",)


def classify(name: str, inherited: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """``(kind of this range's exclusive time, kind its children inherit)`` for a profiler range.

    ``inherited`` is what the enclosing range passed down (a kind, a forward/backward context, or
    None at the top). A kind is one of :data:`KINDS`; :data:`GAP` marks a bare container whose
    exclusive time is split by the comm threads' all-reduces.
    """
    sparse = inherited in ("input_dist", "lookup", "output_dist", "grad_dist", "backward_update", "kjt")
    if name == STEP_LABEL:
        return GAP, None
    # KJT work is its own kind wherever it happens (input_dist's bucketize and permutes included)
    if any(k in name for k in _KJT_OPS):
        return "kjt", "kjt"
    if name.startswith("c10d::allreduce") or "reducer::" in name:
        return "grad_allreduce", "grad_allreduce"
    m = _STAGE.match(name)
    if m:
        stage = m.group(1)
        if stage == "output_dist_wait":  # used for the input awaitables' waits too: keep their kind
            kind = inherited if sparse else "output_dist"
            return kind, kind
        kind = _STAGE_KIND.get(stage, inherited if sparse else "output_dist")
        return kind, kind
    if sparse:
        return inherited, inherited
    if name.startswith("## "):
        if any(name.startswith(p) for p in _DATA):
            return "data", "data"
        if any(name.startswith(p) for p in _OPTIMIZER):
            return "dense_optimizer", "dense_optimizer"
        if name.startswith("## forward"):
            return GAP, _CONTEXT_FWD
        if name.startswith("## backward") or name.startswith("## emb_backward"):
            return GAP, _CONTEXT_BWD
        if any(p in name for p in _OUTPUT_AWAITABLES):
            return "output_dist", "output_dist"
        if any(p in name for p in _INPUT_AWAITABLES):
            return "input_dist", "input_dist"
        if "start_embedding_lookup" in name:
            return "lookup", "lookup"
        if any(name.startswith(p) for p in _PIPELINE):
            return "pipeline", "pipeline"
    if any(p in name for p in _OPTIMIZER):
        return "dense_optimizer", "dense_optimizer"
    if inherited in ("dense_optimizer", "data", "pipeline", "grad_allreduce"):
        return inherited, inherited
    # autograd nodes of the sparse path (backward) and TBE backward kernels
    if "Backward" in name and any(p in name for p in _GRAD_DIST_NODES):
        return "grad_dist", "grad_dist"
    if any(p in name for p in _TBE_BACKWARD):
        return "backward_update", "backward_update"
    if name in _CONTAINERS:
        return GAP, inherited
    if inherited == _CONTEXT_BWD or name.startswith("autograd::engine::evaluate_function"):
        return "dense_bwd", _CONTEXT_BWD
    if inherited == _CONTEXT_FWD:
        return "dense_fwd", _CONTEXT_FWD
    if inherited is None:
        # an operator directly under the step, outside the pipeline's forward/backward ranges
        return "pipeline", "pipeline"
    return inherited if inherited in KINDS else "rest", inherited


# ------------------------------------------------------------------------------------------------
# values
# ------------------------------------------------------------------------------------------------


@attrs.frozen
class ProfEvent:
    """One profiler range: name, thread, [start, end) in microseconds, parent's index (-1: none).

    ``parent`` indexes the list the event is in; the profiler's own event objects are converted
    by :func:`profile_events`.
    """

    name: str
    thread: int
    start_us: float
    end_us: float
    parent: int = -1


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
    def from_dict(cls, d: Mapping[str, Any]) -> "RankAttribution":
        return cls(rank=int(d["rank"]), steps=int(d["steps"]), step_ms=float(d["step_ms"]),
                   kinds_ms=d["kinds_ms"], unprofiled_step_ms=d.get("unprofiled_step_ms"))


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
    def from_dict(cls, d: Mapping[str, Any]) -> "StepAttribution":
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} record (schema {d.get('schema')!r})")
        return cls(ranks=[RankAttribution.from_dict(r) for r in d["ranks"]], label=str(d.get("label", "")),
                   pipeline=str(d.get("pipeline", "")), device=str(d.get("device", "cpu")))


def save_attribution(path: str, att: StepAttribution) -> None:
    """Write ``att`` as JSON, atomically."""
    write_json(path, att.to_dict(), prefix=".attribution-", sort_keys=True)


def load_attribution(path: str) -> StepAttribution:
    """Read a file written by :func:`save_attribution` (``ValueError`` for anything else)."""
    with open(path, encoding="utf-8") as f:
        try:
            payload = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{path} is not a {SCHEMA} file")
    return StepAttribution.from_dict(payload)


# ------------------------------------------------------------------------------------------------
# attribution of a profiled event list (pure)
# ------------------------------------------------------------------------------------------------


def _merge(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(s: float, e: float, merged: Sequence[Tuple[float, float]]) -> float:
    tot = 0.0
    for a, b in merged:
        if b <= s:
            continue
        if a >= e:
            break
        tot += min(b, e) - max(a, s)
    return tot


def _is_allreduce(name: str) -> bool:
    n = name.lower()
    return ("all_reduce" in n or "allreduce" in n) and (n.startswith("gloo:") or "nccl" in n)


def attribute_events(events: Sequence[ProfEvent], rank: int = 0, *,
                     unprofiled_step_ms: Optional[float] = None) -> RankAttribution:
    """Partition every :data:`STEP_LABEL` range of ``events`` into kinds (mean ms per step).

    The step ranges' thread is the one attributed; all-reduces on other threads only decide which
    part of the bare containers' exclusive time is a gradient all-reduce wait.
    """
    steps = [i for i, e in enumerate(events) if e.name == STEP_LABEL]
    if not steps:
        raise ValueError(f"no {STEP_LABEL!r} range among {len(events)} profiler events: profile steps "
                         "with attribute_steps (or wrap each step in record_function(STEP_LABEL))")
    main = events[steps[0]].thread
    children: Dict[int, List[int]] = {}
    for i, e in enumerate(events):
        if e.thread == main and e.parent >= 0:
            children.setdefault(e.parent, []).append(i)
    comm = _merge((e.start_us, e.end_us) for e in events if e.thread != main and _is_allreduce(e.name))
    totals = {k: 0.0 for k in KINDS}

    def walk(i: int, inherited: Optional[str], lo: float, hi: float) -> None:
        e = events[i]
        s, t = max(e.start_us, lo), min(e.end_us, hi)
        if t <= s:
            return
        kind, passed = classify(e.name, inherited)
        kids = sorted(children.get(i, ()), key=lambda c: events[c].start_us)
        covered = []
        for c in kids:
            cs, ct = max(events[c].start_us, s), min(events[c].end_us, t)
            if ct > cs:
                covered.append((cs, ct))
        merged = _merge(covered)
        own = (t - s) - sum(b - a for a, b in merged)
        if kind == GAP:
            gaps, cur = [], s
            for a, b in merged:
                if a > cur:
                    gaps.append((cur, a))
                cur = max(cur, b)
            if cur < t:
                gaps.append((cur, t))
            wait = sum(_overlap(a, b, comm) for a, b in gaps)
            totals["grad_allreduce"] += wait
            totals["rest"] += own - wait
        else:
            totals[kind if kind in totals else "rest"] += own
        # children inside the clipped range; a child overlapping an earlier sibling is clipped to it
        cur = s
        for c in kids:
            cs = max(events[c].start_us, cur)
            ct = min(events[c].end_us, t)
            if ct > cs:
                walk(c, passed, cs, ct)
                cur = ct

    step_total = 0.0
    for i in steps:
        walk(i, None, events[i].start_us, events[i].end_us)
        step_total += events[i].end_us - events[i].start_us
    n = len(steps)
    kinds_ms = {k: v / n / 1e3 for k, v in totals.items()}
    step_ms = sum(kinds_ms.values())  # == step_total / n / 1e3 up to rounding
    assert math.isclose(step_ms, step_total / n / 1e3, rel_tol=1e-6, abs_tol=1e-6)
    return RankAttribution(rank=rank, steps=n, step_ms=step_ms, kinds_ms=kinds_ms,
                           unprofiled_step_ms=unprofiled_step_ms)


def profile_events(prof: Any) -> List[ProfEvent]:
    """Convert a finished ``torch.profiler.profile``'s events into :class:`ProfEvent` values."""
    evs = list(prof.events())
    index = {id(e): i for i, e in enumerate(evs)}
    out = []
    for e in evs:
        parent = e.cpu_parent
        out.append(ProfEvent(name=e.name, thread=int(e.thread), start_us=float(e.time_range.start),
                             end_us=float(e.time_range.end),
                             parent=index.get(id(parent), -1) if parent is not None else -1))
    return out


# ------------------------------------------------------------------------------------------------
# running steps (side effects)
# ------------------------------------------------------------------------------------------------


def _step_fn(step: Any, batches: Optional[Iterator[Any]]) -> Callable[[], Any]:
    if callable(getattr(step, "progress", None)):
        if batches is None:
            raise ValueError("a train pipeline needs its batches: attribute_steps(pipeline, batches, ...)")
        return lambda: step.progress(batches)
    if callable(step):
        return step
    raise TypeError(f"attribute_steps needs a train pipeline (with .progress) or a callable step, got {type(step).__name__}")


#: What libkineto writes to stderr on every profiler start and stop (two lines per profiled run;
#: 56 per calibration): dropped, everything else on stderr in that window is passed on.
_KINETO_NOTICE = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\]")


@contextlib.contextmanager
def _without_profiler_notices() -> Iterator[None]:
    """Run the block with the process's stderr (fd 2) captured; on exit write back every line but
    libkineto's start/stop notices (:data:`_KINETO_NOTICE`)."""
    import os
    import sys
    import tempfile

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (embedded interpreters): leave stderr alone
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not _KINETO_NOTICE.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def attribute_steps(
    step: Any,
    batches: Optional[Iterator[Any]] = None,
    *,
    steps: int = 5,
    warmup_steps: int = 2,
    pg: Any = None,
    label: str = "",
    pipeline: str = "",
    device: Any = None,
    measure_unprofiled: bool = True,
) -> StepAttribution:
    """Run ``warmup_steps`` steps, then ``steps`` timed steps without the profiler (when
    ``measure_unprofiled``), then ``steps`` profiled steps, and attribute the profiled ones.

    ``step`` is a TorchRec train pipeline (``step.progress(batches)`` is one step) or a callable
    that runs one step. With ``pg`` every rank of ``pg`` must call this; each gets every rank's
    attribution (gathered with ``all_gather_object``). The iterator must hold
    ``warmup_steps + 2 * steps`` more batches (plus what the pipeline prefetches).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if steps < 1 or warmup_steps < 0:
        raise ValueError(f"steps must be >= 1 and warmup_steps >= 0, got {steps} and {warmup_steps}")
    run = _step_fn(step, batches)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup_steps):
        run()
    unprofiled = None
    if measure_unprofiled:
        durations = []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            durations.append(time.perf_counter() - t0)
        unprofiled = sorted(durations)[len(durations) // 2] * 1e3
    with _without_profiler_notices():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False) as prof:
            for _ in range(steps):
                with record_function(STEP_LABEL):
                    run()
                    sync()
    rank = 0
    if pg is not None:
        import torch.distributed as dist

        rank = dist.get_rank(pg)
    mine = attribute_events(profile_events(prof), rank=rank, unprofiled_step_ms=unprofiled)
    ranks = [mine]
    if pg is not None:
        import torch.distributed as dist

        gathered: List[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(gathered, mine.to_dict(), group=pg)
        ranks = [RankAttribution.from_dict(d) for d in gathered]
    return StepAttribution(ranks=ranks, label=label, pipeline=pipeline, device=dev.type)


# ------------------------------------------------------------------------------------------------
# measured vs predicted
# ------------------------------------------------------------------------------------------------


def dp_optimizer_seconds(evaluated: Any) -> float:
    """The model's dense-optimizer time of the plan's data-parallel tables (seconds per step).

    The graph puts it inside ``backward_update`` (a pass over the whole replica, the same on every
    rank); :func:`predicted_by_kind` moves it to ``dense_optimizer``, where it is measured.
    ``evaluated`` is a :class:`~torchrec_sparselift.planner.PlanResult`
    (:func:`torchrec_sparselift.cost.model.dp_optimizer_s` of its tables).
    """
    from torchrec_sparselift.cost.model import dp_optimizer_s

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

    from torchrec_sparselift.cost.model import BWD, FWD, node_time
    from torchrec_sparselift.semantics.graph import shard_nodes

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
    named = {p for phases in PREDICTED_KINDS.values() for p in phases}
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
