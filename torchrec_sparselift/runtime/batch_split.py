"""Batch-split pipelining: the embeddings' output all-to-all in k chunks along the batch, the
dense forward and backward of each chunk beside the next chunk's transfer. Exact.

::

    pipeline = TrainPipelineBatchSplit(dmp, optimizer, device, chunks=4)
    for _ in range(steps):
        loss, logits, labels = pipeline.progress(batches)

It extends :class:`~torchrec_sparselift.runtime.overlap.TrainPipelineOverlap` (the next batch's
input_dist runs behind the step; the lookups run and the output collectives are issued before the
model's forward) and changes two things:

- **The output collective is issued per chunk.** Every pipelined sharded embedding module runs its
  lookup *once* over the whole batch; its local pooled embeddings are then split along the batch
  (every destination rank's samples ``[s_j, s_j + b_j)``, :func:`chunk_sizes`) and TorchRec's own
  output dist (the pooled all-to-all for table-wise and column-wise, the reduce-scatter for
  row-wise, the reduce-scatter within a host then the all-to-all across hosts for table-row-wise,
  nothing for data-parallel) is called on each chunk with that chunk's batch size; each
  returns chunk j's ``KeyedTensor``. All k collectives are issued before the model runs. NCCL
  sends one communicator's collectives in issue order; gloo runs a group's on two threads at once
  (chunks 0 and 1 would share the link, the first arriving no earlier than the second), so on CPU
  the output dists move to a one-thread gloo group (:func:`serialize_output_collectives`) and the
  chunks travel one at a time. ``chain_chunks`` issues chunk j+1 only when chunk j's embeddings
  are read instead.
- **The model runs once per chunk**, on chunk j of the batch (:func:`split_batch`: the batch is cut once per step); its sharded
  embedding module returns chunk j's embeddings, so the dense forward of chunk j waits only for
  chunk j's transfer while chunk j+1's is on the wire. The step's loss is the chunk losses
  weighted by chunk size (``sum_j b_j/B * loss_j``, the whole batch's mean) and **one** backward
  runs over it. The CPU autograd engine runs ready nodes latest-created first, and chunk j's
  collective was issued (its request node created) before chunk j-1's dense work that consumes
  embeddings: chunk j's gradient all-to-all is issued when chunk j's dense backward reaches it, and
  the dense backward of chunk j-1 that consumes embeddings (created later than that request
  node) runs before the request node waits for the gradient. Chained (CPU), that wait comes before
  chunk j-1's gradient is issued (its wait node is older than chunk j's request node), so the
  gradients too leave one at a time; issued at once, every request node is older than any dense
  work and all k gradients leave before the first wait. The waits, the split's
  backward (one node that concatenates the chunks' gradients) and the TBE backward with its fused
  optimizer update come last, once, over the whole batch's gradient: the update is the unsplit
  one. DDP runs ``no_sync`` for all but the last chunk's forward, so its one all-reduce follows the
  one backward (on gloo held until the gradient all-to-alls arrived, as under ``overlap``).

Exact: the same lookups, the same embedding update and the same dense gradient (a sum over the
chunks' samples instead of over the batch's: equal up to floating-point summation order) as the
unsplit pipeline. It needs a per-sample dense model: :func:`per_sample_violation` refuses
modules that mix samples (BatchNorm in training, dropout's random masks drawn per chunk) and any
module it cannot prove per-sample, unless the user declares the model per-sample
(``per_sample=True``: every sample's output depends on that sample alone and the loss is the
mean over the batch's samples).

Devices: on CPU (gloo) the collectives run on gloo's worker threads beside the Python thread. On
CUDA (NCCL) each chunk's input is cut and its collective issued on a side stream that waits for
the lookups (an event on the current stream); the chunk's forward makes the current (dense)
stream wait for that side stream's event recorded after the issue, and NCCL's ``wait()`` then
orders the dense stream after the transfer. ``scripts/gpu_check.py batch-split`` checks it on
a lent GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable, ShardedEmbeddingBagCollection
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_sparselift.cost.batch_split import BATCH_SPLIT_PIPELINE, MAX_CHUNKS
from torchrec_sparselift.runtime.overlap import OverlapPipelinedForward, TrainPipelineOverlap, _comm_requests
from torchrec_sparselift.semantics.per_sample import per_sample_violation
from torchrec_sparselift.vocabulary import COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_ROW_WISE, TABLE_WISE

__all__ = [
    "serialize_output_collectives",
    "serial_groups",
    "BATCH_SPLIT_OPTIONS",
    "MAX_CHUNKS",
    "BATCH_SPLIT_PIPELINE",
    "SPLIT_SHARDING_TYPES",
    "NotPerSample",
    "BatchSplitPipelinedForward",
    "TrainPipelineBatchSplit",
    "chunk_sizes",
    "per_sample_violation",
    "check_per_sample",
    "split_batch",
    "slice_batch",
    "merge_outputs",
]

#: sharding types whose output collective is split (their local pooled embeddings hold every
#: destination rank's samples in rank order: ``[world * B, D]``), and data-parallel (``[B, D]``,
#: no collective: split alone)
SPLIT_SHARDING_TYPES = (TABLE_WISE, COLUMN_WISE, ROW_WISE, TABLE_ROW_WISE, DATA_PARALLEL)
_RANK_MAJOR = (TABLE_WISE, COLUMN_WISE, ROW_WISE, TABLE_ROW_WISE)

#: the pipeline options only a batch split reads (``make_train_pipeline`` drops them at k = 1)
BATCH_SPLIT_OPTIONS = ("per_sample", "chain_chunks", "serial_link")
#: profiler range around the lookups and the k chunked output collectives of one step
BATCH_SPLIT_LABEL = "## batch split: lookup + chunked output_dist issued ##"


class NotPerSample(ValueError):
    """The model's dense part cannot be shown to treat samples independently: the batch-split
    pipeline would not compute what the unsplit one computes."""


# ------------------------------------------------------------------------------------------------
# pure helpers: chunk sizes, the per-sample rule, batch slicing, output merging
# ------------------------------------------------------------------------------------------------


def chunk_sizes(batch_size: int, chunks: int) -> Tuple[int, ...]:
    """Sizes of the ``chunks`` consecutive sample ranges a batch of ``batch_size`` splits into:
    as equal as possible, the larger ones first (``chunk_sizes(10, 4) == (3, 3, 2, 2)``)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"batch split: chunks must be an int in 1..{MAX_CHUNKS}, got {chunks!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < chunks:
        raise ValueError(
            f"batch split: a batch of {batch_size!r} samples per rank cannot split into {chunks} chunks: "
            f"use at most {batch_size} chunks (or a larger batch)")
    q, r = divmod(batch_size, chunks)
    return tuple(q + (1 if j < r else 0) for j in range(chunks))


def check_per_sample(model: nn.Module, declared: bool = False) -> None:
    """:class:`NotPerSample` with :func:`per_sample_violation`'s reason, if any."""
    why = per_sample_violation(model, declared)
    if why is not None:
        raise NotPerSample(why)


def _split_kjt(kjt: KeyedJaggedTensor, sizes: Sequence[int]) -> List[KeyedJaggedTensor]:
    """``kjt`` cut into consecutive sample ranges of ``sizes`` samples (one batch size for every
    key; a size may be 0): chunk j holds samples ``[s_j, s_j + b_j)`` of every key, keys in order.
    A few tensor ops whatever the key count: each (key, chunk) pair's values are one contiguous run
    of ``kjt``'s values (its start and length from the lengths' running sum at the chunk
    boundaries), so one gather reorders them chunk-major and each chunk's values are one slice."""
    keys = kjt.keys()
    stride = kjt.stride()
    values = kjt.values()
    weights = kjt.weights_or_none()
    lengths = kjt.lengths()
    k, nkeys = len(sizes), len(keys)
    device = lengths.device
    per_key = lengths.view(nkeys, stride).long()
    running = torch.zeros(nkeys, stride + 1, dtype=torch.long, device=device)
    torch.cumsum(per_key, dim=1, out=running[:, 1:])
    bounds = torch.tensor([0] + list(itertools.accumulate(sizes)), device=device)
    at = running[:, bounds]  # [keys, k + 1]: each key's value count before each chunk boundary
    key_base = torch.zeros(nkeys, dtype=torch.long, device=device)
    torch.cumsum(running[:-1, -1], dim=0, out=key_base[1:])
    seg_len = (at[:, 1:] - at[:, :-1]).t().reshape(-1)  # chunk-major: chunk 0's keys, chunk 1's, ...
    seg_start = (key_base[:, None] + at[:, :-1]).t().reshape(-1)
    counts = seg_len.view(k, nkeys).sum(dim=1).tolist()
    if sum(counts) != values.numel():
        raise ValueError(f"batch split: a KeyedJaggedTensor's lengths sum to {sum(counts)} but it holds "
                         f"{values.numel()} values; it cannot be split along the batch")
    out_start = torch.cumsum(seg_len, dim=0) - seg_len
    order = torch.repeat_interleave(seg_start - out_start, seg_len, output_size=values.numel()) + torch.arange(
        values.numel(), device=device)
    vparts = values[order].split(counts)
    wparts = weights[order].split(counts) if weights is not None else [None] * k
    lparts = lengths.view(nkeys, stride).split(list(sizes), dim=1)
    return [KeyedJaggedTensor(keys=keys, values=v, weights=w, lengths=ln.reshape(-1).contiguous(), stride=b)
            for v, w, ln, b in zip(vparts, wparts, lparts, sizes)]


def split_batch(batch: Any, sizes: Sequence[int], batch_size: int) -> List[Any]:
    """``batch`` (of ``batch_size`` samples) cut into consecutive chunks of ``sizes`` samples
    (they sum to ``batch_size``): every tensor whose first dimension is the batch, every
    ``KeyedJaggedTensor`` of that batch size (:func:`_split_kjt`: a few tensor ops, not a loop over
    its keys), through dataclasses (TorchRec's ``Batch``), lists, tuples and dicts; other values as
    they are, in every chunk. ``ValueError`` naming what cannot be split (a tensor or jagged tensor
    of another batch size)."""
    sizes = [int(b) for b in sizes]
    if sum(sizes) != batch_size or any(b < 0 for b in sizes):
        raise ValueError(f"batch split: chunk sizes {sizes} do not cover a batch of {batch_size} samples")
    k = len(sizes)
    if isinstance(batch, KeyedJaggedTensor):
        if batch.variable_stride_per_key() or batch.stride() != batch_size:
            raise ValueError(f"batch split: a KeyedJaggedTensor of batch size {batch.stride()} in a batch of "
                             f"{batch_size} samples cannot be split along the batch")
        return _split_kjt(batch, sizes)
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * k
        if batch.shape[0] != batch_size:
            raise ValueError(f"batch split: a tensor of shape {tuple(batch.shape)} in a batch of {batch_size} "
                             "samples has no batch dimension first; split batches whose tensors lead with it")
        return list(batch.split(sizes))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = [f.name for f in dataclasses.fields(batch) if f.init]
        parts = {name: split_batch(getattr(batch, name), sizes, batch_size) for name in fields}
        return [dataclasses.replace(batch, **{name: parts[name][j] for name in fields}) for j in range(k)]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        cols = [split_batch(v, sizes, batch_size) for v in batch]
        return [type(batch)(*(c[j] for c in cols)) for j in range(k)]
    if isinstance(batch, (list, tuple)):
        cols = [split_batch(v, sizes, batch_size) for v in batch]
        return [type(batch)(c[j] for c in cols) for j in range(k)]
    if isinstance(batch, dict):
        cols = {key: split_batch(v, sizes, batch_size) for key, v in batch.items()}
        return [{key: c[j] for key, c in cols.items()} for j in range(k)]
    return [batch] * k


def slice_batch(batch: Any, start: int, stop: int, batch_size: int) -> Any:
    """Samples ``[start, stop)`` of ``batch`` (of ``batch_size`` samples), as :func:`split_batch`
    cuts them (the same rules and errors)."""
    if not 0 <= start <= stop <= batch_size:
        raise ValueError(f"batch split: samples [{start}, {stop}) are not within a batch of {batch_size}")
    return split_batch(batch, [start, stop - start, batch_size - stop], batch_size)[1]


def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """The whole batch's model output from the chunks' (``sizes``: their sample counts): scalar
    tensors weighted by chunk size and summed (a chunk's mean loss -> the batch's mean), tensors
    whose first dimension is the chunk's size concatenated along it, through tuples, lists and
    dicts; equal non-tensor values kept. ``ValueError`` naming what cannot be merged."""
    first = outputs[0]
    total = float(sum(sizes))
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return sum(o * (b / total) for o, b in zip(outputs, sizes))
        if all(o.dim() >= 1 and o.shape[0] == b for o, b in zip(outputs, sizes)):
            return torch.cat(list(outputs))
        raise ValueError(f"batch split: the model returns a tensor of shape {tuple(first.shape)} for a chunk of "
                         f"{sizes[0]} samples: neither a scalar nor per-sample, so the chunks cannot be merged")
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(merge_outputs(parts, sizes) for parts in zip(*outputs)))
    if isinstance(first, (list, tuple)):
        return type(first)(merge_outputs(parts, sizes) for parts in zip(*outputs))
    if isinstance(first, dict):
        return {k: merge_outputs([o[k] for o in outputs], sizes) for k in first}
    if all(o == first for o in outputs[1:]):
        return first
    raise ValueError(f"batch split: the model returns {type(first).__name__} values that differ between "
                     "chunks; return tensors, or keep batch_split=1")


# ------------------------------------------------------------------------------------------------
# the chunked output dist of one sharded module
# ------------------------------------------------------------------------------------------------


def _check_module(module: nn.Module, name: str) -> None:
    if type(module) is not ShardedEmbeddingBagCollection:
        raise ValueError(f"batch split splits pooled embedding modules (ShardedEmbeddingBagCollection), but "
                         f"{name} is a {type(module).__name__}: keep batch_split=1 for this model")
    wrong = sorted({t for t in module._sharding_types if t not in SPLIT_SHARDING_TYPES})
    if wrong:
        raise ValueError(f"batch split splits the outputs of {', '.join(SPLIT_SHARDING_TYPES)} tables, but {name} "
                         f"holds {', '.join(wrong)} tables: shard them with one of those or keep batch_split=1")
    if module._has_mean_pooling_callback:
        raise ValueError(f"batch split does not split {name}'s mean-pooled row-wise outputs (TorchRec divides "
                         "them after the collective): use sum pooling there or keep batch_split=1")


class _SideStream:
    """CUDA: the stream a step's chunks are cut and their collectives issued on (it waits for the
    lookups on the dense stream; NCCL's own stream waits for it), and the event per chunk the dense
    (current) stream waits on before it reads chunk j; the tensors one stream allocates and the
    other reads are marked for the caching allocator (``record_stream``). No-op on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.events: List[Any] = []
        self.dense: Any = None  # the stream the step's dense work runs on

    def begin(self, fresh: bool = True) -> Any:
        """The side stream as the current one, after the dense stream's work so far (the lookups,
        or, for a chained chunk, the wait for the previous one); ``fresh``: a new step's first."""
        if fresh:
            self.events = []
        if not self.cuda:
            return contextlib.nullcontext()
        self.dense = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(self.dense)
        return torch.cuda.stream(self.stream)

    def issued(self) -> None:
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.stream)
            self.events.append(event)

    def before_chunk(self, j: int) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.stream.device).wait_event(self.events[j])

    def used_by_side(self, tensor: Optional[torch.Tensor]) -> None:
        """A dense-stream tensor the side stream reads: its memory is not reused before that read."""
        if self.cuda and isinstance(tensor, torch.Tensor):
            tensor.record_stream(self.stream)

    def read_by_dense(self, tensor: Optional[torch.Tensor]) -> None:
        """A side-stream tensor the dense stream reads: its memory is not reused before that read."""
        if self.cuda and isinstance(tensor, torch.Tensor):
            tensor.record_stream(self.dense)


class BatchSplitPipelinedForward(OverlapPipelinedForward):
    """The pipelined forward of one sharded ``EmbeddingBagCollection`` under batch split.

    :meth:`start_chunks` waits for the module's input_dist, runs its lookups over the whole batch
    and issues its output collective per chunk of ``sizes`` samples (chunk-major: every sharding
    group's chunk 0 first); each later call of the forward (the model runs once per chunk) returns
    the next chunk's ``KeyedTensor`` awaitable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._chunks: Dict[int, "_ChunkIssuer"] = {}
        self._side: Optional[_SideStream] = None
        self.held: List[torch.Tensor] = []  # the step's chunk inputs, alive until its backward ends

    def start_chunks(self, context: TrainPipelineContext, sizes: Sequence[int], chained: bool,
                     requests: List[Any]) -> None:
        """Lookups of this module for ``context``'s batch, and its output collectives per chunk of
        ``sizes`` samples: all of them now (``chained`` False), or chunk 0 now and chunk j+1 when
        chunk j's embeddings have arrived and are read (``chained``). ``requests`` collects the
        collectives' requests as they are issued (the all-reduce's hook waits for their gradients)."""
        if id(context) in self._chunks:
            raise RuntimeError(f"batch split: the output_dist of {self._name} for batch {context.index} was "
                               "already started; start it once per batch")
        module = self._module
        _check_module(module, self._name)
        if self._name not in context.input_dist_tensors_requests:
            raise RuntimeError(f"batch split: the input_dist of {self._name} for batch {context.index} is not "
                               "available: the module is called more than once per forward")
        data = context.input_dist_tensors_requests.pop(self._name).wait()
        ctx = context.module_contexts.pop(self._name)
        if self._stream is not None:  # the input_dist ran on the data-dist stream
            current = torch.get_device_module(self._device).current_stream()
            current.wait_stream(self._stream)
            data.record_stream(current)
            ctx.record_stream(current)
        if ctx.variable_batch_per_feature:
            raise ValueError(f"batch split: {self._name} receives a variable batch per feature, which it does "
                             "not split: keep batch_split=1")
        batch = sum(sizes)
        local: List[torch.Tensor] = []  # per sharding group: its local pooled embeddings
        for i in range(len(module._lookups)):
            lookup = module._lookups[i]
            local.append(lookup(data[i]))
            if hasattr(lookup, "wait_for_forward"):
                lookup.wait_for_forward()
            if getattr(lookup, "get_resize_awaitables", None) is not None and lookup.get_resize_awaitables():
                raise ValueError(f"batch split: {self._name}'s lookups resize their outputs (2D fully sharded): "
                                 "keep batch_split=1")
        if self._side is None:
            self._side = _SideStream(local[0].device)
        self.held = []
        step = _ChunkIssuer(self, local, ctx, sizes, batch, chained, requests)
        self._chunks[id(context)] = step
        step.issue_through(0 if chained else len(sizes) - 1)

    def _chunk_inputs(self, embs: torch.Tensor, sharding_type: str, sctx: Any, sizes: Sequence[int],
                      batch: int) -> List[Tuple[torch.Tensor, Any]]:
        """Chunk j's slice of one sharding group's local pooled embeddings and the sharding context
        its output dist reads (its batch size per rank)."""
        if sharding_type not in _RANK_MAJOR:  # data-parallel: [B, D], this rank's own samples
            if embs.shape[0] != batch:
                raise ValueError(f"batch split: {self._name}'s data-parallel embeddings have {embs.shape[0]} rows "
                                 f"for a batch of {batch}")
            return [(p, sctx) for p in embs.split(list(sizes), dim=0)]
        per_rank = list(sctx.batch_size_per_rank) if sctx is not None and sctx.batch_size_per_rank else []
        world = embs.shape[0] // batch
        if per_rank and any(b != batch for b in per_rank) or embs.shape[0] != world * batch:
            raise ValueError(f"batch split: {self._name}'s ranks send batches of {per_rank or embs.shape[0]} "
                             f"samples; it splits only equal batches of {batch} per rank: keep batch_split=1")
        pieces = embs.view(world, batch, embs.shape[1]).split(list(sizes), dim=1)
        return [(p.reshape(world * b, embs.shape[1]),
                 dataclasses.replace(sctx, batch_size_per_rank=[b] * world) if sctx is not None else None)
                for p, b in zip(pieces, sizes)]

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        step = self._chunks.get(id(self._context))
        if step is None or step.next_call >= len(step.sizes):
            raise RuntimeError(f"batch split: {self._name} is called more often than the step has chunks (the "
                               "model calls each embedding module once per forward)")
        j = step.next_call
        step.next_call += 1
        step.issue_through(j)  # issued already unless the model never read the previous chunk
        if step.next_call == len(step.sizes):
            del self._chunks[id(self._context)]
        if self._side is not None:
            self._side.before_chunk(j)
        return step.awaitables[j]

    def discard(self, context: TrainPipelineContext) -> None:
        self._chunks.pop(id(context), None)
        super().discard(context)


#: the one-thread group made for each gloo group whose output collectives moved (held as long as
#: that group lives), reused by every later model on that group (``new_group`` is a collective
#: every rank calls, and a group lives until the process group is destroyed: a process that builds
#: many models, a benchmark or a calibration, would otherwise make one group per model)
_SERIAL_OF: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def serial_groups() -> List[Any]:
    """The one-thread gloo groups :func:`serialize_output_collectives` made in this process."""
    return list(_SERIAL_OF.values())


def serialize_output_collectives(model: nn.Module) -> int:
    """Run every sharded ``EmbeddingBagCollection``'s output collectives (and so their gradients)
    of ``model`` on a gloo process group with one worker thread, created once per group they used
    and reused by later models on that group:
    gloo runs a group's collectives on two threads at once, so chunks issued together would share
    the link and the first would arrive no earlier than the second; on one thread they travel in
    issue order, one at a time, as NCCL sends one communicator's. The same collectives, the same
    results. Table-row-wise outputs (two groups, within and across hosts) keep theirs. Returns how
    many output dists moved; a no-op for a model whose dists already moved (or NCCL groups)."""
    import torch.distributed as dist

    moved = 0
    for module in model.modules():
        if type(module) is not ShardedEmbeddingBagCollection:
            continue
        for out_dist in module._output_dists:
            pg = getattr(out_dist, "_pg", None)
            if pg is None or pg.name() != "gloo" or any(pg is g for g in _SERIAL_OF.values()):
                continue
            group = _SERIAL_OF.get(pg)
            if group is None:
                options = dist.ProcessGroupGloo._Options()
                options._threads = 1
                group = dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo", pg_options=options)
                _SERIAL_OF[pg] = group
            out_dist._pg = group
            for inner in ("_dist", "_variable_dist"):
                if getattr(out_dist, inner, None) is not None:
                    getattr(out_dist, inner)._pg = group
            moved += 1
    return moved


class _ChunkIssuer:
    """One step's chunked output collectives of one module: cuts chunk j's inputs and issues its
    collectives (:meth:`issue_through`), in chunk order, each once."""

    def __init__(self, forward: BatchSplitPipelinedForward, local: List[torch.Tensor], ctx: Any,
                 sizes: Sequence[int], batch: int, chained: bool, requests: List[Any]) -> None:
        self.forward, self.local, self.ctx, self.sizes, self.batch = forward, local, ctx, tuple(sizes), batch
        self.chained, self.requests = chained, requests
        self.awaitables: List[Any] = []
        self.next_call = 0
        self._groups: Optional[List[List[Tuple[torch.Tensor, Any]]]] = None

    def issue_through(self, last: int) -> None:
        if len(self.awaitables) > last:
            return
        f, module, side = self.forward, self.forward._module, self.forward._side
        with side.begin(fresh=not self.awaitables):  # CUDA: cut and issued on the side stream
            if self._groups is None:
                for embs in self.local:
                    side.used_by_side(embs)
                self._groups = [f._chunk_inputs(embs, module._sharding_types[i], self.ctx.sharding_contexts[i],
                                                self.sizes, self.batch) for i, embs in enumerate(self.local)]
            while len(self.awaitables) <= last:
                j = len(self.awaitables)
                awaitables = []
                for i, dist in enumerate(module._output_dists):
                    piece, sctx = self._groups[i][j]
                    f.held.append(piece)
                    awaitables.append(dist(piece, sctx))
                chunk = EmbeddingBagCollectionAwaitable(
                    awaitables=awaitables, embedding_dims=module._embedding_dims,
                    embedding_names=module._embedding_names)
                for request in _comm_requests(chunk, depth=8):
                    side.read_by_dense(request.tensor)  # the receive buffer the chunk's wait reads
                    self.requests.append(request)
                if self.chained and j + 1 < len(self.sizes):
                    chunk.callbacks.append(self._then_issue(j + 1))
                self.awaitables.append(chunk)
                side.issued()

    def _then_issue(self, j: int) -> Any:
        def issue(result: Any) -> Any:  # runs where chunk j-1's embeddings were waited for
            self.issue_through(j)
            return result

        return issue


class TrainPipelineBatchSplit(TrainPipelineOverlap):
    """The overlap pipeline with each pipelined embedding module's output collective split into
    ``chunks`` along the batch and the model run once per chunk (module docstring). Exact: the
    same losses and weights as the unsplit pipeline.

    Constructor arguments: those of ``TrainPipelineSparseDist`` (model: a DMP; optimizer; device),
    and ``chunks`` (1..16; 1 runs the overlap pipeline's step), ``per_sample`` (declare the
    dense model per-sample: :func:`per_sample_violation`), ``serial_link`` (default: on CPU; the
    embedding modules' output and gradient collectives on a one-thread gloo group,
    :func:`serialize_output_collectives`) and ``chain_chunks`` (issue chunk j+1's collectives when
    chunk j's embeddings are read, not all before the forward: one chunk on the wire at a time
    without ``serial_link``, at the price of a wait per chunk in the backward).
    ``NotPerSample`` with the reason where the model cannot be split."""

    _pipelined_forward_type = BatchSplitPipelinedForward

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *args: Any,
                 chunks: int = 2, per_sample: bool = False, chain_chunks: bool = False,
                 serial_link: Optional[bool] = None, **kwargs: Any) -> None:
        chunk_sizes(chunks, chunks)  # validates chunks
        check_per_sample(model, per_sample)
        super().__init__(model, optimizer, device, *args, **kwargs)
        self.chunks = chunks
        self.chain_chunks = bool(chain_chunks)
        if device.type == "cpu" if serial_link is None else serial_link:
            serialize_output_collectives(model)
        wrapped = getattr(model, "_dmp_wrapped_module", model)
        self._ddp: Optional[DistributedDataParallel] = (
            wrapped if isinstance(wrapped, DistributedDataParallel) else None)

    def _split_forwards(self) -> List[BatchSplitPipelinedForward]:
        forwards = self._overlap_forwards()
        wrong = [type(f).__name__ for f in forwards if not isinstance(f, BatchSplitPipelinedForward)]
        if wrong:
            raise RuntimeError(f"batch split: pipelined modules carry {sorted(set(wrong))} forwards: build the "
                               "TrainPipelineBatchSplit on an unpipelined DMP")
        return forwards  # type: ignore[return-value]

    def _batch_size(self, batch: Any) -> int:
        kjts = _find(batch, KeyedJaggedTensor)
        if kjts:
            return int(kjts[0].stride())
        tensors = [t for t in _find(batch, torch.Tensor) if t.dim() >= 1]
        if not tensors:
            raise ValueError("batch split: the batch holds no tensor with a batch dimension to split")
        return int(tensors[0].shape[0])

    def start_output_dist(self, context: TrainPipelineContext, sizes: Sequence[int] = ()) -> None:  # type: ignore[override]
        with record_function(BATCH_SPLIT_LABEL):
            requests: List[Any] = []  # filled as the chunks are issued; the all-reduce hook reads it
            for forward in self._split_forwards():
                forward.start_chunks(context, sizes, self.chain_chunks, requests)
            self._step_requests = requests

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        self._begin_step(dataloader_iter)
        batch = self.batches[0]
        size = self._batch_size(batch)
        sizes = chunk_sizes(size, self.chunks)
        self.start_output_dist(self.contexts[0], sizes)
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        if not self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)
        losses: List[torch.Tensor] = []
        outputs: List[Any] = []
        try:
            parts = split_batch(batch, sizes, size)
            for j, part in enumerate(parts):
                sync = j == len(sizes) - 1 or self._ddp is None
                with record_function(f"## forward {self.contexts[0].index} chunk {j} ##"):
                    with contextlib.nullcontext() if sync else self._ddp.no_sync():
                        loss_j, out_j = self._model_fwd(part)
                losses.append(loss_j)
                outputs.append(out_j)
        except BaseException:
            for forward in self._split_forwards():
                forward.discard(self.contexts[0])
            raise
        loss = merge_outputs(losses, sizes)
        output = merge_outputs(outputs, sizes)
        if self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])
        if self._model.training:
            self._backward(loss)
            self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, self.contexts[0])
            self._optimizer_step()
        for forward in self._split_forwards():
            forward.held = []
        self.dequeue_batch()
        return output


def _find(obj: Any, kind: type, depth: int = 4) -> List[Any]:
    """Values of type ``kind`` inside ``obj`` (dataclasses, sequences, dicts), in order."""
    if isinstance(obj, kind):
        return [obj]
    if depth == 0:
        return []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items: Sequence[Any] = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = list(obj.values())
    else:
        return []
    return [x for item in items for x in _find(item, kind, depth - 1)]
