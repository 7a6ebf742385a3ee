"""Count what a real sharded step moves: bytes per collective per rank, and ids per lookup.

::

    with CommCounter(dmp) as counter:      # dmp: DistributedModelParallel (or any sharded model)
        loss = dmp(batch).sum(); loss.backward()
    counter.link_bytes()                   # {"input_dist": 1234, "output_dist": ..., "grad_dist": ...}
    counter.lookup_ids()                   # {"table_0": 512, ...} ids this rank's TBEs served
    counter.allreduce_bytes()              # bytes DDP all-reduced (data-parallel tables' gradients)
    counter.collective_calls()             # {"input_dist": 3, "output_dist": 1, "grad_dist": 1}

While active, the counter wraps ``torch.distributed``'s collectives that TorchRec calls
(``all_to_all_single``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``reduce_scatter``,
``all_gather``, ``all_to_all``) and restores them on exit. Each call is recorded with the bytes this
rank sends to and receives from *other* ranks (its own chunk never leaves it):

* ``all_to_all_single``: the input splits (output splits) except this rank's own, times the element size;
* ``reduce_scatter_tensor``: sends ``(W-1)/W`` of its input (the partials of the other ranks' slices),
  receives ``W-1`` partials of its own slice;
* ``all_gather_into_tensor``: sends its piece to ``W-1`` ranks, receives ``W-1`` pieces.

A call made inside autograd's backward is ``grad_dist``; in the forward, integer tensors (ids,
lengths, splits) are ``input_dist`` and floating tensors (embeddings) ``output_dist``. DDP's
all-reduce runs in C++ and never calls these functions: the counter registers a DDP communication
hook (TorchRec's default all-reduce, counted) on every ``DistributedDataParallel`` inside the
module it is given; a DDP hook cannot be removed, so it only counts while a counter is active.
Lookups: a forward pre-hook on every sharded module's lookup (``_lookups``) sums the lengths of
each feature of the KJT it receives, mapped to the table that feature reads.

The graph's quantities (:func:`torchrec_sparselift.semantics.graph.shard_nodes`) are checked
against these counts in ``tests/test_comm_semantics.py``; see docs/cost_model.md.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import attrs
import torch
import torch.distributed as dist
from torch import nn

from torchrec_sparselift.semantics.graph import shard_nodes

__all__ = ["CollectiveCall", "CommCounter", "expected_rank_quantities"]

LINK_KINDS = ("input_dist", "output_dist", "grad_dist")
_WRAPPED = ("all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "reduce_scatter",
            "all_gather", "all_to_all")
_active: List["CommCounter"] = []
_lock = threading.Lock()


@attrs.frozen
class CollectiveCall:
    """One collective this rank took part in: what, for which node kind, bytes sent/received."""

    op: str
    kind: str
    dtype: str
    sent_bytes: int
    recv_bytes: int


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def _rank_world(group: Any) -> Tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _in_backward() -> bool:
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - older torch
        return False


def _kind(t: torch.Tensor) -> str:
    if _in_backward():
        return "grad_dist"
    return "output_dist" if t.is_floating_point() else "input_dist"


def _count_all_to_all_single(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> CollectiveCall:
    names = ("output", "input", "output_split_sizes", "input_split_sizes", "group")
    a = dict(zip(names, args))
    a.update({k: v for k, v in kwargs.items() if k in names})
    out, inp = a["output"], a["input"]
    rank, world = _rank_world(a.get("group"))
    row_in = _nbytes(inp) // max(inp.size(0), 1) if inp.dim() else inp.element_size()
    row_out = _nbytes(out) // max(out.size(0), 1) if out.dim() else out.element_size()
    ins, outs = a.get("input_split_sizes"), a.get("output_split_sizes")
    kind = _kind(inp)
    if kind == "input_dist" and not a.get("input_split_sizes") and not a.get("output_split_sizes"):
        # KJTAllToAll's first exchange: per-destination counts (metadata), equal splits
        kind = "input_dist_splits"
    ins = list(ins) if ins else [inp.size(0) // world] * world
    outs = list(outs) if outs else [out.size(0) // world] * world
    sent = sum(int(s) for r, s in enumerate(ins) if r != rank) * row_in
    recv = sum(int(s) for r, s in enumerate(outs) if r != rank) * row_out
    return CollectiveCall("all_to_all_single", kind, str(inp.dtype), sent, recv)


def _count(op: str, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> CollectiveCall:
    group = kwargs.get("group")
    if op == "all_to_all_single":
        return _count_all_to_all_single(args, kwargs)
    if op == "reduce_scatter_tensor":
        out, inp = (list(args) + [kwargs.get("output"), kwargs.get("input")])[:2]
        group = args[3] if len(args) > 3 else group
        _, world = _rank_world(group)
        return CollectiveCall(op, _kind(inp), str(inp.dtype), _nbytes(inp) * (world - 1) // world,
                              _nbytes(out) * (world - 1))
    if op == "all_gather_into_tensor":
        out, inp = (list(args) + [kwargs.get("output_tensor"), kwargs.get("input_tensor")])[:2]
        group = args[2] if len(args) > 2 else group
        _, world = _rank_world(group)
        return CollectiveCall(op, _kind(inp), str(inp.dtype), _nbytes(inp) * (world - 1),
                              _nbytes(out) * (world - 1) // world)
    if op == "reduce_scatter":  # (output, input_list)
        out, inputs = args[0], args[1]
        group = args[3] if len(args) > 3 else group
        rank, _ = _rank_world(group)
        sent = sum(_nbytes(t) for r, t in enumerate(inputs) if r != rank)
        return CollectiveCall(op, _kind(out), str(out.dtype), sent, _nbytes(out) * (len(inputs) - 1))
    if op == "all_gather":  # (tensor_list, tensor)
        outs, inp = args[0], args[1]
        group = args[2] if len(args) > 2 else group
        rank, world = _rank_world(group)
        return CollectiveCall(op, _kind(inp), str(inp.dtype), _nbytes(inp) * (world - 1),
                              sum(_nbytes(t) for r, t in enumerate(outs) if r != rank))
    if op == "all_to_all":  # (output_list, input_list)
        outs, inputs = args[0], args[1]
        group = args[2] if len(args) > 2 else group
        rank, _ = _rank_world(group)
        return CollectiveCall(op, _kind(inputs[0]), str(inputs[0].dtype),
                              sum(_nbytes(t) for r, t in enumerate(inputs) if r != rank),
                              sum(_nbytes(t) for r, t in enumerate(outs) if r != rank))
    raise ValueError(f"no byte rule for collective {op!r}")


def _wrap(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _active:
            call = _count(op, args, kwargs)
            for c in _active:
                c.calls.append(call)
        return fn(*args, **kwargs)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapped._sparselift_counting = True  # type: ignore[attr-defined]
    return wrapped


def _feature_tables(lookup: nn.Module) -> Dict[str, str]:
    inner = getattr(lookup, "module", lookup)  # DDP-wrapped (data-parallel) lookups
    out: Dict[str, str] = {}
    for cfg in getattr(inner, "grouped_configs", None) or []:
        for table in cfg.embedding_tables:
            for f in table.feature_names:
                out[f] = table.name
    return out


class CommCounter:
    """Context manager counting this rank's collective bytes and lookup ids (see the module doc).

    ``module``: the sharded model; needed for lookup ids and DDP all-reduce bytes (collectives are
    counted without it). Counters nest; each sees every call made while it is active.
    """

    def __init__(self, module: Optional[nn.Module] = None) -> None:
        self.module = module
        self.calls: List[CollectiveCall] = []
        self.ids: Dict[str, int] = {}
        self.allreduce: List[Tuple[str, int]] = []
        self._handles: List[Any] = []
        self._saved: Dict[str, Callable[..., Any]] = {}

    # ---- lifecycle
    def __enter__(self) -> "CommCounter":
        with _lock:
            if not _active:
                for op in _WRAPPED:
                    fn = getattr(dist, op)
                    if not getattr(fn, "_sparselift_counting", False):
                        self._saved[op] = fn
                        setattr(dist, op, _wrap(op, fn))
            _active.append(self)
        if self.module is not None:
            self._install_hooks(self.module)
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with _lock:
            _active.remove(self)
            for op, fn in self._saved.items():
                setattr(dist, op, fn)
            self._saved.clear()

    def _install_hooks(self, module: nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        for sub in module.modules():
            lookups = getattr(sub, "_lookups", None)
            if isinstance(lookups, (list, nn.ModuleList)) and hasattr(sub, "_input_dists"):
                for lookup in lookups:
                    if not isinstance(lookup, nn.Module):
                        continue
                    self._handles.append(lookup.register_forward_pre_hook(self._lookup_hook(_feature_tables(lookup))))
                    if isinstance(lookup, DistributedDataParallel):  # data-parallel tables
                        _hook_ddp(lookup, "grad_allreduce")
            elif isinstance(sub, DistributedDataParallel):
                _hook_ddp(sub, "dense_allreduce")

    def _lookup_hook(self, feature_table: Mapping[str, str]) -> Callable[..., None]:
        def hook(_mod: nn.Module, inputs: Tuple[Any, ...]) -> None:
            kjt = inputs[0] if inputs else None
            if kjt is None or not hasattr(kjt, "keys"):
                return
            lengths = kjt.lengths().view(len(kjt.keys()), -1) if kjt.keys() else None
            if lengths is None:
                return
            for key, n in zip(kjt.keys(), lengths.sum(dim=1).tolist()):
                table = feature_table.get(key, key)
                self.ids[table] = self.ids.get(table, 0) + int(n)

        return hook

    def reset(self) -> None:
        """Forget what was counted so far (e.g. after warm-up steps); hooks stay installed."""
        self.calls.clear()
        self.ids.clear()
        self.allreduce.clear()

    # ---- results
    def link_bytes(self, direction: str = "both") -> Dict[str, int]:
        """Bytes per node kind on this rank: ``sent``, ``recv`` or ``both`` (their sum)."""
        out: Dict[str, int] = {}
        for c in self.calls:
            v = {"sent": c.sent_bytes, "recv": c.recv_bytes, "both": c.sent_bytes + c.recv_bytes}[direction]
            out[c.kind] = out.get(c.kind, 0) + v
        return out

    def collective_calls(self) -> Dict[str, int]:
        """Collective calls per link phase on this rank (``input_dist`` includes KJTAllToAll's splits
        exchange, ``input_dist_splits``): the calls whose latencies ``cost.model.collective_calls``
        charges."""
        out = {kind: 0 for kind in LINK_KINDS}
        for c in self.calls:
            kind = "input_dist" if c.kind == "input_dist_splits" else c.kind
            if kind in out:
                out[kind] += 1
        return out

    def lookup_ids(self) -> Dict[str, int]:
        """Ids served per table by this rank's lookups."""
        return dict(self.ids)

    def allreduce_bytes(self, kind: str = "grad_allreduce") -> int:
        """Bytes this rank's DDP modules all-reduced (buffer sizes, summed over buckets):
        ``grad_allreduce`` for the data-parallel tables' lookups, ``dense_allreduce`` for the rest."""
        return int(sum(n for k, n in self.allreduce if k == kind))


_DDP_HOOKED: Dict[int, str] = {}


def _hook_ddp(ddp: nn.Module, kind: str) -> None:
    """Register (once per DDP module) a comm hook that counts each bucket as ``kind``, then runs
    DDP's default all-reduce (``allreduce_hook``: divide by the world size, all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if id(ddp) in _DDP_HOOKED:
        return

    def hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP checks these annotations
        if _active:
            n = _nbytes(bucket.buffer())
            for c in _active:
                c.allreduce.append((kind, n))
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(state=ddp.process_group, hook=hook)  # type: ignore[operator]
    _DDP_HOOKED[id(ddp)] = kind


def expected_rank_quantities(
    specs: Any, candidates: Any, shard_ranks: Any, world_size: int, local_world_size: int
) -> List[Dict[str, float]]:
    """Per rank, the graph's quantity of each counted node kind: link bytes (``input_dist``,
    ``output_dist``, ``grad_dist``: what the rank sends plus receives), ``lookup`` ids per table
    (key ``lookup:<table name>``) and ``grad_allreduce`` bytes. Compute-only nodes are left out.

    ``specs[t]``/``candidates[t]`` are table ``t``'s TableSpec and Candidate; ``shard_ranks[t]`` the
    rank of each of its shards (in shard order). ``owner`` nodes land on the shard's rank,
    ``others`` nodes on every other rank, ``peers`` and ``global`` nodes (the all-reduce) on every rank.
    """
    out: List[Dict[str, float]] = [dict() for _ in range(world_size)]

    def add(r: int, key: str, v: float) -> None:
        out[r][key] = out[r].get(key, 0.0) + v

    for spec, cand, ranks in zip(specs, candidates, shard_ranks):
        for owner in ranks:
            for node in shard_nodes(spec, cand, world_size, local_world_size):
                if node.kind == "lookup":
                    key = f"lookup:{spec.name}"
                elif node.kind in LINK_KINDS or (node.kind == "grad_allreduce" and owner == ranks[0]):
                    key = node.kind  # the all-reduce is one per table: counted once
                else:
                    continue  # compute nodes (backward_update, per-id CPU work, ...): time, not counted here
                if node.scope in ("peers", "global"):
                    targets = list(range(world_size))
                elif node.scope == "others":
                    targets = [r for r in range(world_size) if r != owner]
                else:
                    targets = [owner]
                for r in targets:
                    add(r, key, node.quantity)
    return out
