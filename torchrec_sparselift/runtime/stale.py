"""The stale overlap train pipeline (kind ``overlap_stale``): the next batch's lookup and both
embedding all-to-alls in flight behind this batch's dense work, at one step of embedding staleness.

::

    pipeline = TrainPipelineOverlapStale(dmp, optimizer, device)
    for _ in range(steps):
        loss, logits, labels = pipeline.progress(batches)
    pipeline.flush()   # apply the last step's embedding update (progress does it at StopIteration)

The user's model code is unchanged. Exact scheduling (:class:`~.overlap.TrainPipelineOverlap`) can
hide the embedding all-to-alls only behind dense work that does not depend on the embeddings
(DLRM's bottom MLP, ~1 ms). This pipeline gives up exactness by one step, as TorchRec's
``TrainPipelineSemiSync`` does: batch i+1's lookup reads the weights before step i's embedding
update. What it buys, per steady step i (one core per rank, gloo; the same order on CUDA)::

    dense fwd(i)            | grad all-to-all(i-1) in flight (issued at the end of step i-1)
    wait grad(i-1); TBE bwd + fused update(i-1)
    lookup(i+1); output all-to-all(i+1) issued
    dense bwd(i)            | output all-to-all(i+1) in flight (and the ids all-to-all of i+2)
    DDP all-reduce(i)       (exposed: nothing independent of the dense weights is left to run)
    grad all-to-all(i) issued; dense optimizer(i)

Staleness is exactly one step: lookup(i+1) runs after update(i-1) and before update(i), as under
``TrainPipelineSemiSync`` (whose losses this pipeline reproduces; tests/test_overlap_stale.py).
The dense part is exact (its optimizer steps after its own all-reduce every step).

How the backward is split without touching the model: the awaitable of batch i's embeddings
(started a step early) gets a callback that hands the model a detached leaf in place of the
pooled embeddings' values, so ``loss.backward()`` stops there. The gradient all-to-all is then
issued with ``torch.autograd.grad(values, dummies, leaf.grad)``, where the *dummies* are the
tensors TorchRec's comm ops (``All2All_*_Req`` / ``*_Wait``, ``ReduceScatter*``) pass from the
request node to the wait node: that runs only the wait nodes' backward, which issue the
gradient collectives asynchronously. ``torch.autograd.backward(dummies, grads)`` a step later
runs the request nodes' backward (which wait) and the TBE backward with its fused update.

Limits: every pipelined module must return a ``KeyedTensor`` (``EmbeddingBagCollection`` and
friends) and train its tables on fused kernels (a ``dense`` kernel's in-place update would
break the saved lookup; :func:`~.model_parallel.check_pipeline_supports_plan`); no 2D replica
sync (a 2D plan uses ``sparse_dist`` or ``semi_sync``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import attrs
import torch
from torch.profiler import record_function
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.sparse.jagged_tensor import KeyedTensor

from torchrec_sparselift.runtime.overlap import OverlapPipelinedForward, TrainPipelineOverlap, _comm_requests

__all__ = ["StalePipelinedForward", "TrainPipelineOverlapStale", "EarlyAllReduce", "STALE_EMB_BACKWARD_LABEL"]

#: profiler range around the previous step's embedding backward (grad wait + TBE backward/update)
STALE_EMB_BACKWARD_LABEL = "## overlap_stale: previous step's embedding backward ##"


@attrs.define
class _Cut:
    """One batch's embedding outputs as the model saw them: ``dummies`` (the comm ops' request ->
    wait tensors), ``pairs`` of (values in TorchRec's graph, the detached leaf the model used)."""

    dummies: List[torch.Tensor]
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = attrs.Factory(list)


class StalePipelinedForward(OverlapPipelinedForward):
    """:class:`~.overlap.OverlapPipelinedForward` whose started output hands the model a detached
    leaf, so the model's backward ends at the pooled embeddings (the pipeline runs the rest)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cuts: Dict[int, _Cut] = {}

    def start(self, context: TrainPipelineContext) -> None:
        super().start(context)
        awaitable = self._started[id(context)]
        cut = _Cut(dummies=[r.dummy_tensor for r in _comm_requests(awaitable) if r.dummy_tensor is not None])
        self._cuts[id(context)] = cut
        name = self._name

        def detach(out: Any) -> Any:
            if not isinstance(out, KeyedTensor):
                raise TypeError(
                    f"pipeline 'overlap_stale': module {name} returned {type(out).__name__}, not a KeyedTensor; "
                    "the stale schedule supports pooled embedding modules (EmbeddingBagCollection): train this "
                    "model with pipeline 'semi_sync' or an exact kind"
                )
            values = out.values()
            leaf = values.detach().requires_grad_(values.requires_grad)
            cut.pairs.append((values, leaf))
            return KeyedTensor(keys=out.keys(), length_per_key=out.length_per_key(), values=leaf,
                               key_dim=out.key_dim())

        awaitable.callbacks.append(detach)

    def take_cut(self, context: TrainPipelineContext) -> Optional[_Cut]:
        return self._cuts.pop(id(context), None)

    def discard(self, context: TrainPipelineContext) -> None:
        super().discard(context)
        self._cuts.pop(id(context), None)


#: bytes of dense gradients per early all-reduce (:class:`EarlyAllReduce`)
EARLY_ALLREDUCE_CHUNK_BYTES = 256 * 1024


class EarlyAllReduce:
    """A DDP communication hook that all-reduces the dense gradients in chunks as their backward
    completes, instead of as one bucket at the end of the backward (gloo/CPU).

    DDP fills its buckets in the order gradients become ready and all-reduces a bucket when all
    its gradients are; a model whose dense gradients fit one bucket (DLRM's: 1.8 MB against DDP's
    25 MB) sends them only after the last layer's backward, with nothing left to run beside it.
    Here a post-accumulate-grad hook on each parameter DDP reduces collects the gradients as they
    arrive and issues ``dist.all_reduce`` on every ``chunk_bytes`` of them (divided by the world
    size first, then summed: the arithmetic of DDP's built-in path and of ``allreduce_hook``), so
    the over arch's gradients travel while the rest of the dense backward runs. DDP's hook, called
    when the bucket is ready, issues the last chunk, waits for all of them and writes the results
    into the bucket. A parameter without a gradient this step (none in a static graph) makes the
    hook fall back to ``allreduce_hook`` for the whole bucket."""

    def __init__(self, ddp: torch.nn.Module, chunk_bytes: Optional[int] = None) -> None:
        self._pg = ddp.process_group
        self._world = ddp.process_group.size()
        self._chunk_bytes = EARLY_ALLREDUCE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self._ready: List[torch.nn.Parameter] = []
        self._ready_bytes = 0
        self._works: List[Tuple[Any, torch.Tensor, List[torch.nn.Parameter]]] = []
        self._reduced: Dict[int, torch.Tensor] = {}  # id(param) -> its all-reduced gradient, until written
        params = [p for p in ddp._module_parameters if p.requires_grad]
        for p in params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, p: torch.nn.Parameter) -> None:
        self._ready.append(p)
        self._ready_bytes += p.grad.numel() * p.grad.element_size()
        if self._ready_bytes >= self._chunk_bytes:
            self._issue()

    def _issue(self) -> None:
        import torch.distributed as dist

        if not self._ready:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self._ready]).div_(self._world)
        work = dist.all_reduce(flat, group=self._pg, async_op=True)
        self._works.append((work, flat, self._ready))
        self._ready, self._ready_bytes = [], 0

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._issue()
        for work, flat, params in self._works:
            work.wait()
            offset = 0
            for p in params:
                n = p.numel()
                self._reduced[id(p)] = flat[offset:offset + n]
                offset += n
        self._works = []
        params = bucket.parameters()
        if any(id(p) not in self._reduced for p in params):
            for p in params:
                self._reduced.pop(id(p), None)
            return allreduce_hook(state, bucket)
        buffer = bucket.buffer()
        offset = 0
        for p in params:
            n = p.numel()
            buffer[offset:offset + n].copy_(self._reduced.pop(id(p)))
            offset += n
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buffer)
        return fut


def _install_early_allreduce(model: torch.nn.Module) -> bool:
    """Register :class:`EarlyAllReduce` on ``model``'s DDP (a DMP's wrapped module), unless it has
    a communication hook already (the user's, kept). Returns whether it was installed."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(model, "_dmp_wrapped_module", model)
    if not isinstance(ddp, DistributedDataParallel) or getattr(ddp, "_sparselift_comm_hook", False) \
            or ddp._comm_hooks:
        return False
    early = EarlyAllReduce(ddp)
    # DDP accepts only hooks whose annotations are its own (GradBucket, Future) or none
    ddp.register_comm_hook(None, lambda state, bucket: early(state, bucket))
    ddp._sparselift_comm_hook = True  # the overlap pipeline's own hook and the timeline's step aside
    return True


class TrainPipelineOverlapStale(TrainPipelineOverlap):
    """The stale overlap schedule (module docstring). Constructor arguments: those of
    ``TrainPipelineSparseDist`` (model: a DMP; optimizer; device), and ``start_batch``: the steps
    (batch indices below it) run exactly first, each looking up the next batch after its own
    update, as TorchRec's ``TrainPipelineSemiSync(start_batch=...)`` does (default 0: stale from
    the first step); ``early_allreduce`` (CPU, default on): all-reduce the dense gradients in chunks
    during the dense backward (:class:`EarlyAllReduce`; measured 0.94x and 0.97x the step without
    it, median of 8 paired rounds at 1 Gbit/s and 300 Mbit/s: docs/overlap.md).
    Not exact from then on: batch i+1's lookup reads the embedding weights before step i's update
    (one step stale)."""

    _pipelined_forward_type = StalePipelinedForward

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 *args: Any, start_batch: int = 0, early_allreduce: bool = True, **kwargs: Any) -> None:
        if not isinstance(start_batch, int) or isinstance(start_batch, bool) or start_batch < 0:
            raise ValueError(f"overlap_stale: start_batch must be an int >= 0 (the exact steps before the stale "
                             f"schedule starts), got {start_batch!r}")
        if early_allreduce and device.type == "cpu":
            _install_early_allreduce(model)
        super().__init__(model, optimizer, device, *args, **kwargs)
        self._start_batch = start_batch
        # (dummies, grads) of the last trained batch: its gradient collectives are in flight
        self._pending: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Batch i: input_dist done, lookup and output collective issued; batch i+1: input_dist
        issued (splits and tensors), so step i can look it up."""
        if self.batches:
            return
        if not self.enqueue_batch(dataloader_iter):
            return
        self._init_pipelined_modules(self.batches[0], self.contexts[0], self._pipelined_forward_type)
        self.wait_sparse_data_dist(self.contexts[0])
        self.start_output_dist(self.contexts[0])
        if not self.enqueue_batch(dataloader_iter):
            return
        self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        self.wait_sparse_data_dist(self.contexts[1])

    def start_output_dist(self, context: TrainPipelineContext) -> None:
        super().start_output_dist(context)
        # the overlap pipeline's DDP hook holds the all-reduce for "this step's" gradient
        # all-to-alls; here the step's own were waited before the lookup, so nothing to hold
        self._step_requests = []

    def finish_embedding_backward(self) -> None:
        """Wait for the last trained batch's gradient collectives and run its TBE backward with the
        fused update (called before the next lookup; :meth:`flush` at the end of training)."""
        if self._pending is None:
            return
        dummies, grads = self._pending
        self._pending = None
        with record_function(STALE_EMB_BACKWARD_LABEL):
            torch.autograd.backward(dummies, grads)

    def flush(self) -> None:
        """Apply the last step's embedding update (its gradients are in flight until the next
        step's lookup). Call before evaluating or checkpointing mid-run; ``progress`` calls it
        when the data runs out."""
        self.finish_embedding_backward()

    def _issue_grad_dist(self, cuts: List[_Cut]) -> None:
        """Issue the gradient collectives of ``cuts`` (one batch's modules) and keep them pending:
        only the comm ops' wait nodes run (they issue the collectives asynchronously)."""
        outs = [(v, leaf.grad) for c in cuts for v, leaf in c.pairs if leaf.grad is not None]
        dummies = [d for c in cuts for d in c.dummies]
        if not outs or not dummies:
            return
        grads = torch.autograd.grad([v for v, _ in outs], dummies, [g for _, g in outs], allow_unused=True)
        used = [(d, g) for d, g in zip(dummies, grads) if g is not None]
        if used:
            self._pending = ([d for d, _ in used], [g for _, g in used])

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            self.flush()
            raise StopIteration
        training = self._model.training
        if not training:
            self.flush()
        if len(self.batches) < 3:
            self.enqueue_batch(dataloader_iter)  # batch i+2
        if len(self.batches) >= 3:
            self.start_sparse_data_dist(self.batches[2], self.contexts[2])
        context = self.contexts[0]
        self._set_module_context(context)
        if training:
            with record_function("## zero_grad ##"):
                self._optimizer.zero_grad()
        self._wait_for_batch()
        forwards = self._overlap_forwards()
        try:
            with record_function(f"## forward {context.index} ##"):
                losses, output = self._model_fwd(self.batches[0])
        except BaseException:
            for forward in forwards:
                forward.discard(context)
            raise
        cuts = [c for c in (f.take_cut(context) for f in forwards) if c is not None]
        stale = training and (context.index or 0) >= self._start_batch
        if training:
            self.finish_embedding_backward()  # update(i-1): before the lookup of i+1
        if len(self.batches) >= 2 and (stale or not training):
            self.start_output_dist(self.contexts[1])  # lookup(i+1), one step stale; in flight in backward
        if len(self.batches) >= 3:
            self.wait_sparse_data_dist(self.contexts[2])  # ids all-to-all of i+2, in flight in backward
        if training:
            self._backward(losses)  # dense only: ends at the detached embeddings
            with record_function(f"## overlap_stale: grad_dist {context.index} issued ##"):
                self._issue_grad_dist(cuts)
            if not stale:  # an exact warm-up step: update(i) before the lookup of i+1
                self.finish_embedding_backward()
            self._optimizer_step()
            if not stale and len(self.batches) >= 2:
                self.start_output_dist(self.contexts[1])
        self.dequeue_batch()
        return output
