"""The overlap train pipeline: the sparse path's collectives in flight while independent dense work runs.

::

    pipeline = TrainPipelineOverlap(dmp, optimizer, device)
    for _ in range(steps):
        loss, logits, labels = pipeline.progress(batches)

Same interface and same results as TorchRec's ``TrainPipelineSparseDist`` (which it extends: the next
batch's input_dist still runs behind this step), with the user's model code unchanged. What it
changes is *when* the embedding modules' work is issued.

TorchRec runs a sharded embedding module where the model's ``forward`` calls it. In DLRM that is
after the bottom MLP (``embedded_dense = dense_arch(...)`` comes first), so a step is::

    dense_arch fwd | lookup | output all-to-all (issued, then waited by inter_arch) | over_arch fwd
    over_arch bwd | grad all-to-all (issued, waited at once) | TBE bwd+update | dense_arch bwd | DDP all-reduce

and nothing independent of the embeddings is left to run while either all-to-all is in flight: the
CPU autograd engine runs ready nodes latest-created first, so the output_dist's backward half (the
wait) outranks the bottom MLP's backward, which was created before it.

This pipeline runs, before the model's forward, every pipelined embedding module's lookup and
issues its output all-to-all (``compute_and_output_dist``: TorchRec's own split of the module's
forward), keeping the returned lazy awaitable; when the model then calls the module, it gets that
awaitable. The order becomes::

    lookup | output all-to-all issued | dense_arch fwd (in flight) | wait in inter_arch | over_arch fwd
    over_arch bwd | grad all-to-all issued | dense_arch bwd (in flight) | wait
    | DDP all-reduce issued | TBE bwd+update (all-reduce in flight) | DDP waits its all-reduce

The reordering needs nothing from the autograd engine beyond its documented order: the
output_dist's request node is now created *before* the bottom MLP, so in backward the bottom MLP
(and the DDP bucket its gradients complete) runs before the wait for the gradient all-to-all, and
the embedding backward runs while the dense all-reduce is in flight. On gloo a DDP
communication hook holds the all-reduce until the gradient all-to-all has arrived, so the two do
not share the link (:func:`_order_allreduce_after_grad_dist`).

Exact: every operation reads the same inputs as under ``TrainPipelineSparseDist`` (the lookup
reads the weights of the previous step's fused update, which has finished: backward is complete
before ``progress`` returns); only the order of independent operations changes, so losses and
weights equal TrainPipelineBase's up to floating-point summation order (bit-equal in the tests).

Devices: on CUDA the lookup runs on the current stream after waiting for the data-dist stream
(as TorchRec's ``PipelinedForward`` does); NCCL runs the all-to-all on its own stream and the
current stream waits for it only where the awaitable is waited, so the bottom MLP's kernels
queued before that wait run beside the collective. On CPU/gloo the collective runs on gloo's
worker thread beside the Python thread's dense work.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import torch
from torch.profiler import record_function
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.types import Awaitable

__all__ = ["OverlapPipelinedForward", "TrainPipelineOverlap", "EARLY_OUTPUT_DIST_LABEL"]

#: profiler range around the early lookups and output all-to-all issues of one step
EARLY_OUTPUT_DIST_LABEL = "## overlap: lookup + output_dist issued early ##"


class OverlapPipelinedForward(PipelinedForward):
    """TorchRec's ``PipelinedForward`` (the sharded module's forward inside a sparse-dist pipeline)
    that can be started before the model calls it.

    :meth:`start` waits for the module's input_dist, runs its lookup and issues its output
    collective, keeping the lazy awaitable for ``context``; the model's later call returns that
    awaitable. Called without :meth:`start`, it behaves as ``PipelinedForward``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._started: Dict[int, Any] = {}  # id(context) -> the module's output awaitable

    def start(self, context: TrainPipelineContext) -> None:
        """Lookup + output collective of this module for the batch of ``context``, issued now."""
        if id(context) in self._started:
            raise RuntimeError(
                f"overlap pipeline: the output_dist of {self._name} for batch {context.index} was already "
                "started; start it once per batch"
            )
        saved = self._context
        self._context = context
        try:
            self._started[id(context)] = super().__call__()
        finally:
            self._context = saved

    def __call__(self, *input: Any, **kwargs: Any) -> Awaitable:
        started = self._started.pop(id(self._context), None)
        if started is not None:
            return started
        return super().__call__(*input, **kwargs)

    def discard(self, context: TrainPipelineContext) -> None:
        """Drop a started awaitable the model never consumed (e.g. a forward that raised)."""
        self._started.pop(id(context), None)


class TrainPipelineOverlap(TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` that issues every embedding module's lookup and output
    all-to-all before the model's forward, so the dense work that does not depend on the
    embeddings (DLRM's bottom MLP, and in backward its gradient and the dense all-reduce) runs while
    the collectives are in flight. Exact: same losses and weights as ``TrainPipelineBase``.

    Constructor arguments: those of ``TrainPipelineSparseDist`` (model: a DMP; optimizer; device).
    """

    _pipelined_forward_type = OverlapPipelinedForward

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(model, optimizer, device, *args, **kwargs)
        self._step_requests: List[Any] = []
        if device.type == "cpu":
            _order_allreduce_after_grad_dist(model, self)

    def _overlap_forwards(self) -> List[OverlapPipelinedForward]:
        forwards = [m.forward for m in self._pipelined_modules]
        wrong = [type(f).__name__ for f in forwards if not isinstance(f, OverlapPipelinedForward)]
        if wrong:
            raise RuntimeError(
                f"overlap pipeline: pipelined modules carry {sorted(set(wrong))} forwards, not "
                "OverlapPipelinedForward: the model was pipelined by another train pipeline; detach() it "
                "there first or build the TrainPipelineOverlap on the unpipelined DMP"
            )
        return forwards  # type: ignore[return-value]

    def start_output_dist(self, context: TrainPipelineContext) -> None:
        """Run the lookups of ``context``'s batch and issue their output collectives (its
        input_dist must have been waited on: ``wait_sparse_data_dist``)."""
        with record_function(EARLY_OUTPUT_DIST_LABEL):
            requests: List[Any] = []
            for forward in self._overlap_forwards():
                forward.start(context)
                requests.extend(_comm_requests(forward._started[id(context)]))
            self._step_requests = requests

    def _begin_step(self, dataloader_iter: Iterator[Any]) -> None:
        """The start of every step: the model attached, the pipeline filled (``StopIteration`` when
        the data ends), the step's module context set, gradients zeroed, the batch waited for."""
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        self._set_module_context(self.contexts[0])
        if self._model.training:
            with record_function("## zero_grad ##"):
                self._optimizer.zero_grad()
        self._wait_for_batch()

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        self._begin_step(dataloader_iter)
        # batch i: lookups and output collectives first, so they are in flight during what follows
        self.start_output_dist(self.contexts[0])
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # batch i+1's splits
        if not self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)  # batch i+2
        try:
            with record_function(f"## forward {self.contexts[0].index} ##"):
                losses, output = self._model_fwd(self.batches[0])
        except BaseException:
            for forward in self._overlap_forwards():
                forward.discard(self.contexts[0])
            raise
        if self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])  # batch i+1's ids all-to-all, in flight in backward
        if self._model.training:
            self._backward(losses)
            self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, self.contexts[0])
            self._optimizer_step()
        self.dequeue_batch()
        return output


def _comm_requests(awaitable: Any, depth: int = 6) -> List[Any]:
    """The ``comm_ops.Request`` objects inside a sharded module's output awaitable (one per
    output collective): TorchRec sets each one's ``req`` to the gradient collective's work when
    backward issues it, and clears it once waited."""
    from torchrec.distributed.comm_ops import Request

    found: List[Any] = []
    seen: set = set()

    def walk(obj: Any, d: int) -> None:
        if id(obj) in seen or d < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, Request):
            found.append(obj)
            return
        if isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, d - 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x, d - 1)
        elif type(obj).__module__.startswith("torchrec.") and hasattr(obj, "__dict__"):
            for x in vars(obj).values():
                walk(x, d - 1)

    walk(awaitable, depth)
    return found


def _order_allreduce_after_grad_dist(model: torch.nn.Module, pipeline: "TrainPipelineOverlap") -> None:
    """On gloo, send the dense all-reduce after the step's gradient all-to-alls, not beside them.

    gloo runs collectives issued from different threads' requests concurrently (two worker threads
    per process group), so a DDP bucket that becomes ready while the gradient all-to-all is in
    flight would share the link with it and delay the embedding backward that waits for it
    (measured: +13 ms of a 52 ms all-to-all at 1 Gbit/s). This DDP communication hook waits for
    the in-flight gradient all-to-alls of the step, then runs DDP's reference all-reduce
    (``allreduce_hook``: the same arithmetic as DDP's built-in path). It blocks the autograd
    thread only where the next node would wait for the same all-to-all anyway (the bucket
    completes with the bottom MLP's backward; the embedding backward comes next). NCCL needs no
    hook: one communicator runs its collectives in issue order."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(model, "_dmp_wrapped_module", model)
    if not isinstance(ddp, DistributedDataParallel) or getattr(ddp, "_sparselift_comm_hook", False):
        return
    if ddp._comm_hooks:
        return  # the user's own hook stays; the all-reduce then shares the link
    import weakref

    ref = weakref.ref(pipeline)

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations other than GradBucket
        pipe = ref()
        for request in (pipe._step_requests if pipe is not None else ()):
            work = request.req
            if work is not None:
                with record_function("## overlap: all-reduce waits for grad_dist ##"):
                    work.wait()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    ddp._sparselift_comm_hook = True


# ------------------------------------------------------------------------------------------------
# measurement: a per-rank timeline of collectives and dense work (side effects: patches, hooks)
# ------------------------------------------------------------------------------------------------

#: collective kinds the timeline tells apart
COMM_KINDS = ("input_dist", "output_dist", "grad_dist", "allreduce", "other")


def _a2a_kind() -> str:
    """Which sparse-path collective the caller of ``all_to_all_single`` is: TorchRec issues the
    pooled embeddings' all-to-all in ``All2All_*_Req.forward`` (output_dist) and its gradient in
    ``All2All_*_Wait.backward`` (grad_dist), the KJT ids/lengths all-to-alls in ``dist_data``."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        name, fn = f.f_code.co_filename, f.f_code.co_name
        if name.endswith("comm_ops.py") and fn in ("forward", "backward"):
            return "output_dist" if fn == "forward" else "grad_dist"
        if name.endswith("dist_data.py"):
            return "input_dist"
        f = f.f_back
    return "other"


class CommTimeline:
    """Timestamps (``time.perf_counter`` seconds) of one rank's steps: every collective's issue,
    completion (its future's callback, on the communication thread) and the main thread's waits
    on it; the bottom MLP's forward and backward; the end of the autograd graph; the end of
    backward (after DDP has waited for its all-reduce); the optimizer step.

    ``install(dmp, pipeline)`` patches ``torch.distributed.all_to_all_single`` and
    ``all_reduce`` (returning a ``Work`` subclass that records its waits), registers DDP's
    reference all-reduce hook (``allreduce_hook``: divide, then sum; the same arithmetic as DDP's
    built-in path) so the dense all-reduce passes the patch, hooks the model's ``dense_arch`` (if
    it has one) and wraps the pipeline's ``_backward`` and optimizer step. ``uninstall()`` restores
    the patched functions; hooks stay (they only record). Events: ``(t, what, kind, id)`` with
    ``what`` in ``issue``, ``done``, ``wait_start``, ``wait_end``, ``dense_fwd_start``,
    ``dense_fwd_end``, ``dense_bwd_start``, ``dense_bwd_end``, ``backward_start``, ``graph_done``,
    ``backward_end``, ``opt_start``, ``opt_end``, ``step_start``, ``step_end``.
    """

    def __init__(self) -> None:
        self.events: List[tuple] = []
        self._restore: List[Any] = []
        self._next_id = 0
        self._patched = False

    def mark(self, what: str, kind: str = "", cid: int = -1) -> None:
        import time

        self.events.append((time.perf_counter(), what, kind, cid))

    def clear(self) -> None:
        self.events = []

    def _work(self, work: Any, kind: str) -> Any:
        import torch.distributed as dist

        cid = self._next_id
        self._next_id += 1
        self.mark("issue", kind, cid)
        timeline = self

        if work is None:  # a synchronous collective: it is done, and all of it was waited for
            timeline.mark("done", kind, cid)
            return None

        work.get_future().add_done_callback(lambda _f: timeline.mark("done", kind, cid))

        class _TracedWork(dist.Work):
            def wait(self, *args: Any, **kwargs: Any) -> Any:
                timeline.mark("wait_start", kind, cid)
                try:
                    return work.wait(*args, **kwargs)
                finally:
                    timeline.mark("wait_end", kind, cid)

            def get_future(self) -> Any:
                return work.get_future()

            def is_completed(self) -> bool:
                return work.is_completed()

            def is_success(self) -> bool:
                return work.is_success()

            def exception(self) -> Any:
                return work.exception()

            def source_rank(self) -> int:
                return work.source_rank()

            def result(self) -> Any:
                return work.result()

            def synchronize(self) -> None:
                return work.synchronize()

        return _TracedWork()

    def install(self, dmp: torch.nn.Module, pipeline: Any = None) -> "CommTimeline":
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        a2a, allreduce = dist.all_to_all_single, dist.all_reduce

        def traced_a2a(*args: Any, **kwargs: Any) -> Any:
            kind = _a2a_kind()
            if kwargs.get("async_op", False):
                return self._work(a2a(*args, **kwargs), kind)
            cid = self._next_id
            self._next_id += 1
            self.mark("issue", kind, cid)
            self.mark("wait_start", kind, cid)
            out = a2a(*args, **kwargs)
            self.mark("wait_end", kind, cid)
            self.mark("done", kind, cid)
            return out

        def traced_allreduce(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("async_op", False):
                return self._work(allreduce(*args, **kwargs), "allreduce")
            return allreduce(*args, **kwargs)

        if not self._patched:  # once per timeline, however many models it traces
            dist.all_to_all_single, dist.all_reduce = traced_a2a, traced_allreduce
            self._patched = True

            def restore() -> None:
                dist.all_to_all_single, dist.all_reduce = a2a, allreduce
                self._patched = False

            self._restore.append(restore)

        wrapped = getattr(dmp, "_dmp_wrapped_module", dmp)
        if isinstance(wrapped, DistributedDataParallel) and not getattr(wrapped, "_sparselift_comm_hook", False) \
                and not wrapped._comm_hooks:
            wrapped.register_comm_hook(None, allreduce_hook)  # so the all-reduce passes dist.all_reduce
            wrapped._sparselift_comm_hook = True
        inner = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
        dense_arch = next((m for n, m in inner.named_modules() if n.endswith("dense_arch")), None)
        if dense_arch is not None and not getattr(dense_arch, "_sparselift_traced", False):
            dense_arch._sparselift_traced = True
            params = [p for p in dense_arch.parameters() if p.requires_grad]
            pending = {"n": 0}

            def fwd_pre(_m: Any, _i: Any) -> None:
                self.mark("dense_fwd_start")

            def fwd_post(_m: Any, _i: Any, out: Any) -> None:
                self.mark("dense_fwd_end")
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    pending["n"] = len(params)
                    out.register_hook(lambda g: (self.mark("dense_bwd_start"), None)[1])

            def accumulated(_p: Any) -> None:
                pending["n"] -= 1
                if pending["n"] == 0:
                    self.mark("dense_bwd_end")

            dense_arch.register_forward_pre_hook(fwd_pre)
            dense_arch.register_forward_hook(fwd_post)
            for p in params:
                p.register_post_accumulate_grad_hook(accumulated)

        if pipeline is not None:
            backward, opt_step = pipeline._backward, pipeline._optimizer.step

            def traced_backward(losses: torch.Tensor) -> None:
                from torch.autograd import Variable

                # queued at the start of backward, so it runs before DDP's finalize callback
                # (queued when the last bucket is ready): its time is the end of the graph
                if losses.requires_grad:
                    losses.register_hook(lambda g: (Variable._execution_engine.queue_callback(
                        lambda: self.mark("graph_done")), None)[1])
                self.mark("backward_start")
                backward(losses)
                self.mark("backward_end")

            def traced_step(*args: Any, **kwargs: Any) -> Any:
                self.mark("opt_start")
                try:
                    return opt_step(*args, **kwargs)
                finally:
                    self.mark("opt_end")

            pipeline._backward, pipeline._optimizer.step = traced_backward, traced_step
            self._restore.append(lambda: (delattr(pipeline, "_backward"), delattr(pipeline._optimizer, "step")))
        return self

    def uninstall(self) -> None:
        while self._restore:
            self._restore.pop()()


def step_windows(events: List[tuple]) -> List[List[tuple]]:
    """The events between each ``step_start`` and the next ``step_end`` mark."""
    out: List[List[tuple]] = []
    cur = None
    for ev in events:
        if ev[1] == "step_start":
            cur = [ev]
        elif ev[1] == "step_end" and cur is not None:
            cur.append(ev)
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.append(ev)
    return out


def step_attribution(window: List[tuple], done_at: Dict[int, float]) -> Dict[str, float]:
    """Seconds of one step (events of :func:`step_windows`; ``done_at``: each collective id's
    completion time, from the whole timeline): ``step``; per collective kind ``<kind>_inflight``
    (issue to completion of those issued in this step), ``<kind>_exposed`` (the main thread's
    waits on that kind in this step; for ``allreduce``, from the end of the autograd graph to the
    end of backward, where DDP waits) and ``<kind>_hidden`` (in flight but not waited for);
    ``dense_fwd``, ``dense_bwd`` (the bottom MLP), ``emb_bwd`` (from the gradient all-to-all's
    wait to the next traced event: TBE backward with the fused update), ``optimizer``, and, on a
    step that waits for its output all-to-all in the forward (``sparse_dist``), ``lookup``,
    ``dense_fwd_rest`` and ``dense_bwd_rest`` (the dense work that consumes the embeddings)."""
    out: Dict[str, float] = {"step": window[-1][0] - window[0][0]}
    for k in COMM_KINDS:
        out[f"{k}_inflight"] = out[f"{k}_exposed"] = 0.0
    waits: Dict[int, float] = {}
    first: Dict[str, float] = {}
    for t, what, kind, cid in window:
        if what == "issue":
            out[f"{kind}_inflight"] += max(0.0, done_at.get(cid, t) - t)
        elif what == "wait_start":
            waits[cid] = t
        elif what == "wait_end" and cid in waits:
            out[f"{kind}_exposed"] += t - waits.pop(cid)
        elif what in ("dense_fwd_start", "dense_bwd_start", "graph_done", "opt_start"):
            first.setdefault(what, t)
        elif what in ("dense_fwd_end", "dense_bwd_end", "backward_end", "opt_end"):
            first.setdefault(what, t)
    if "graph_done" in first and "backward_end" in first:
        out["allreduce_exposed"] += first["backward_end"] - first["graph_done"]
    for k in COMM_KINDS:
        out[f"{k}_hidden"] = max(0.0, out[f"{k}_inflight"] - out[f"{k}_exposed"])
    out["dense_fwd"] = first.get("dense_fwd_end", 0.0) - first.get("dense_fwd_start", 0.0)
    out["dense_bwd"] = first.get("dense_bwd_end", 0.0) - first.get("dense_bwd_start", 0.0)
    out["optimizer"] = first.get("opt_end", 0.0) - first.get("opt_start", 0.0)
    # the dense work that consumes the embeddings (meaningful on a step where the output
    # all-to-all is waited in the forward and the gradient one issued in the backward, e.g.
    # sparse_dist's): forward from the output wait to backward's start; backward from there to
    # the first gradient all-to-all's issue; the lookup: from the bottom MLP's end to the first
    # output all-to-all's issue (the ids' wait and the TBE forward)
    out_wait = [t for t, what, kind, _c in window if what == "wait_end" and kind == "output_dist"]
    grad_issue = [t for t, what, kind, _c in window if what == "issue" and kind == "grad_dist"]
    out_issue = [t for t, what, kind, _c in window if what == "issue" and kind == "output_dist"]
    bstart = [t for t, what, _k, _c in window if what == "backward_start"]
    out["dense_fwd_rest"] = (bstart[0] - out_wait[-1]) if bstart and out_wait and out_wait[-1] < bstart[0] else 0.0
    out["dense_bwd_rest"] = (grad_issue[0] - bstart[0]) if bstart and grad_issue and grad_issue[0] > bstart[0] else 0.0
    fwd_end = first.get("dense_fwd_end")
    out["lookup"] = (out_issue[0] - fwd_end) if fwd_end is not None and out_issue and out_issue[0] > fwd_end else 0.0
    grad_wait_end = [t for t, what, kind, _c in window if what == "wait_end" and kind == "grad_dist"]
    out["emb_bwd"] = 0.0
    if grad_wait_end:
        t0 = grad_wait_end[-1]
        later = [t for t, what, _k, _c in window if t > t0 and what in ("dense_bwd_start", "graph_done", "wait_start")]
        out["emb_bwd"] = (min(later) - t0) if later else 0.0
    return out


def timeline_attribution(events: List[tuple]) -> List[Dict[str, float]]:
    """:func:`step_attribution` of every complete step in a :class:`CommTimeline`'s events."""
    done_at = {cid: t for t, what, _k, cid in events if what == "done"}
    return [step_attribution(w, done_at) for w in step_windows(events)]
