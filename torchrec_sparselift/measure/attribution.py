"""Profile real training steps and attribute their time to sparse-path node kinds (the
measuring side; the values, the model's prediction per kind and the comparison are
:mod:`torchrec_sparselift.calibration.attribution`).

::

    att = attribute_steps(pipeline, batches, steps=5, pg=pg, label=plan.summary())

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

The kinds are :data:`~torchrec_sparselift.calibration.attribution.KINDS`.

The profiler costs time per operator (on a 26-table DLRM step on CPU within the noise of a
loaded machine: docs/benchmarks.md section 10), so :func:`attribute_steps` also times the same
number of steps without it (``unprofiled_step_ms``);
the per-kind numbers are from the profiled steps. On CUDA only host (CPU) time is attributed: kernels
queued asynchronously are charged where the host waits for them.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.calibration.attribution import KINDS, RankAttribution, StepAttribution

__all__ = [
    "STEP_LABEL",
    "ProfEvent",
    "classify",
    "attribute_events",
    "attribute_steps",
    "profile_events",
]

STEP_LABEL = "## sparselift step ##"

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
