"""Ids on the wire: narrow and deduplicated ids in the sharded modules' input all-to-all.

:func:`apply_wire_ids` rewrites every ``ShardedEmbeddingBagCollection`` of a sharded model, in
place, without touching the user's model code: each model-parallel sharding group's input dist
(``TwSparseFeaturesDist`` for table- and column-wise, ``RwSparseFeaturesDist`` for row-wise,
``TwRwSparseFeaturesDist`` for table-row-wise) is wrapped in a :class:`WireFeaturesDist`, which
keeps its bucketizing; a group that deduplicates sends through :class:`WireIdsAllToAll` instead
of TorchRec's ``KJTAllToAll``. Data-parallel groups send nothing and are left alone.

* ``id_dtype="int32"``: the KJT going into TorchRec's all-to-all is cast to int32 values and
  lengths, so both travel at 4 bytes (TorchRec's all-to-all keeps the KJT's dtype; its row-wise
  bucketizing takes the ids' dtype; TBE casts the received ids to int64 before the lookup). A
  table with more rows than int32 holds is refused, naming it.
* ``dedup_features``: a group holding one of them sends through a two-collective exchange of its
  own: an int32 header (per destination: the stride and, per feature, the ids it sends and the
  ids it stands for) and one byte payload per destination with the lengths, the distinct ids of
  each deduplicated feature
  (``torch.unique``), an inverse index per id at the narrowest of uint8/int16/int32 that holds
  it, the other features' ids as they are, and the weights of a weighted KJT. The receiver
  rebuilds every feature's ids (``unique[inverse]``) into the KJT TorchRec's all-to-all would
  have delivered (keys, lengths and weights equal, ids equal in value) and attaches the distinct
  ids to it (:class:`UniqueIds`). The group's lookup runs on the rebuilt ids: bit for bit
  TorchRec's lookup. ``unique_rows=True`` installs :class:`UniqueRowsLookup` instead, which runs
  the TBE once per distinct row and pools each bag from those rows by the inverse index, in the
  TBE's own pooling; the gradient of a row's every occurrence is summed before the TBE's backward,
  as that backward sums them itself, so the fused optimizer's update is the unrewritten one (up to
  the order of floating-point sums). It is not the default: on CPU it measures slower than the
  lookup on the rebuilt ids on every benchmark workload (docs/wire_ids.md, section 3), and the
  cost model prices dedup as the wire's saving and the dedup kernels alone.

What is priced and when each pays: :mod:`torchrec_sparselift.cost.wire_ids`; the manual:
docs/wire_ids.md.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_sparselift.cost.wire_ids import ID_DTYPES, feature_tuple, inverse_bytes, narrow_refusal
from torchrec_sparselift.vocabulary import DATA_PARALLEL

__all__ = ["UNIQUE_ATTR", "UniqueIds", "UniqueRowsLookup", "WireFeaturesDist", "WireIdsAllToAll", "apply_wire_ids",
           "wire_ids_modules"]

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"int64": torch.int64, "int32": torch.int32}
_INVERSE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_ALIGN = 8  # every message and section starts 8-byte aligned, so byte views reinterpret in place
_PATCHED = "_sparselift_wire_ids"


def _pad(n: int) -> int:
    return -n % _ALIGN


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def _cast(kjt: KeyedJaggedTensor, dtype: torch.dtype) -> KeyedJaggedTensor:
    """``kjt`` with values and lengths in ``dtype`` (keys, weights and strides unchanged)."""
    if kjt.values().dtype == dtype and kjt.lengths().dtype == dtype:
        return kjt
    stride: Dict[str, Any] = ({"stride_per_key_per_rank": kjt.stride_per_key_per_rank()}
                              if kjt.variable_stride_per_key() else {"stride": kjt.stride()})
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().to(dtype), lengths=kjt.lengths().to(dtype),
                             weights=kjt.weights_or_none(), **stride)


def _source_order(world: int, stagger: int) -> List[int]:
    """The source ranks in the order TorchRec's all-to-all lays a key's samples out (its recat:
    source ``x + (world // stagger) * y`` for ``x`` over ``world // stagger``, ``y`` over
    ``stagger``; the identity for ``stagger == 1``)."""
    per = world // stagger
    return [x + per * y for x in range(per) for y in range(stagger)]


class _Payload(Awaitable[KeyedJaggedTensor]):
    """The payload all-to-all in flight; ``wait()`` rebuilds the received KJT."""

    def __init__(self, owner: "WireIdsAllToAll", work: Any, buffer: torch.Tensor, layouts: List[Any],
                 weighted: bool) -> None:
        super().__init__()
        self._owner, self._work, self._buffer, self._layouts, self._weighted = owner, work, buffer, layouts, weighted

    def _wait_impl(self) -> KeyedJaggedTensor:
        self._work.wait()
        return self._owner._unpack(self._buffer, self._layouts, self._weighted)


class _Header(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """The header all-to-all in flight; ``wait()`` sizes and starts the payload all-to-all."""

    def __init__(self, owner: "WireIdsAllToAll", work: Any, recv: torch.Tensor, payloads: List[torch.Tensor],
                 weighted: bool) -> None:
        super().__init__()
        self._owner, self._work, self._recv, self._payloads, self._weighted = owner, work, recv, payloads, weighted

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        self._work.wait()
        return self._owner._exchange_payload(self._recv, self._payloads, self._weighted)


class WireIdsAllToAll(nn.Module):
    """A ``KJTAllToAll`` that sends ids at ``id_dtype`` and deduplicates the keys in ``dedup``.

    Same contract as the ``KJTAllToAll`` it wraps (``inner``: its process group, splits and
    stagger): ``forward(kjt)`` returns an awaitable of an awaitable of the received KJT. Without
    dedup keys in the KJT it casts and calls ``inner``; with some it runs the exchange of the
    module docs. Variable batch per key (VBE) is refused under dedup.
    """

    def __init__(self, inner: KJTAllToAll, id_dtype: str = "int64", dedup: Iterable[str] = ()) -> None:
        super().__init__()
        if id_dtype not in ID_DTYPES:
            raise ValueError(f"id_dtype={id_dtype!r} is not supported: use one of {', '.join(ID_DTYPES)}")
        if not isinstance(inner, KJTAllToAll):
            raise TypeError(f"WireIdsAllToAll wraps TorchRec's KJTAllToAll, got {type(inner).__name__}")
        self.inner = inner
        self.id_dtype = id_dtype
        self.dedup: FrozenSet[str] = frozenset(dedup)
        self._dtype = _TORCH_DTYPES[id_dtype]
        self._pg = inner._pg
        self._splits: List[int] = list(inner._splits)
        self._cumsum: List[int] = list(inner._splits_cumsum)
        self._world = self._pg.size()
        self._rank = dist.get_rank(self._pg)
        self._order = _source_order(self._world, inner._stagger)
        self._keys: List[str] = []

    def forward(self, kjt: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        keys = kjt.keys()
        if not self.dedup.intersection(keys) or self._world == 1:
            return self.inner(_cast(kjt, self._dtype))
        if kjt.variable_stride_per_key():
            raise ValueError(f"dedup of features {sorted(self.dedup.intersection(keys))} does not support a "
                             "variable batch per feature (VBE) KJT: leave them out of dedup_features")
        weights = kjt.weights_or_none()
        if weights is not None and weights.dtype != torch.float32:
            raise ValueError(f"dedup of features {sorted(self.dedup.intersection(keys))} sends fp32 weights, "
                             f"got {weights.dtype}: leave them out of dedup_features")
        self._keys = self._my_keys(keys)
        return self._exchange_header(kjt)

    # sender ---------------------------------------------------------------------------------------
    def _exchange_header(self, kjt: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Deduplicate, pack one payload per destination, and start the header all-to-all: per
        destination ``[stride] + [ids sent, ids] per key`` (int32)."""
        keys, stride = kjt.keys(), kjt.stride()
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        dev = values.device
        per_key = lengths.view(len(keys), stride).sum(1).tolist()
        key_values = list(torch.split(values, per_key))
        key_weights = list(torch.split(weights, per_key)) if weights is not None else []
        headers: List[torch.Tensor] = []
        payloads: List[torch.Tensor] = []
        for d in range(self._world):
            lo, hi = self._cumsum[d], self._cumsum[d + 1]
            counts: List[int] = [stride]
            ids: List[torch.Tensor] = []
            inverses: List[torch.Tensor] = []
            for k in range(lo, hi):
                if keys[k] in self.dedup:
                    u, inv = torch.unique(key_values[k], sorted=True, return_inverse=True)
                    ids.append(u)
                    inverses.append(inv)
                else:
                    ids.append(key_values[k])
                counts += [int(ids[-1].numel()), int(per_key[k])]
            headers.append(torch.tensor(counts, dtype=torch.int32, device=dev))
            sections = [torch.cat(ids).to(self._dtype) if ids else torch.empty(0, dtype=self._dtype, device=dev),
                        lengths[lo * stride: hi * stride].to(torch.int32)]
            if weights is not None:
                sections.append(torch.cat(key_weights[lo:hi]) if hi > lo else weights[:0])
            if inverses:
                width = inverse_bytes(max(int(u.numel()) for u, k in zip(ids, range(lo, hi)) if keys[k] in self.dedup))
                sections.append(torch.cat(inverses).to(_INVERSE_DTYPES[width]))
            payloads.append(_pack(sections, dev))
        nk = self._splits[self._rank]
        recv = torch.empty(self._world * (1 + 2 * nk), dtype=torch.int32, device=dev)
        work = dist.all_to_all_single(recv, torch.cat(headers), [1 + 2 * nk] * self._world,
                                      [int(h.numel()) for h in headers], group=self._pg, async_op=True)
        return _Header(self, work, recv, payloads, weights is not None)

    # receiver -------------------------------------------------------------------------------------
    def _my_keys(self, all_keys: Sequence[str]) -> List[str]:
        return list(all_keys[self._cumsum[self._rank]: self._cumsum[self._rank + 1]])

    def _layout(self, header: torch.Tensor, weighted: bool) -> Tuple[int, List[int], List[int], int, List[int]]:
        """One received message from its header: (stride, ids sent per key, ids per key, inverse
        width in bytes (0: no key deduplicated), section sizes in bytes: ids, lengths,
        [weights], [inverse])."""
        h = header.tolist()
        stride, sent, n = int(h[0]), [int(x) for x in h[1::2]], [int(x) for x in h[2::2]]
        dedup = [j for j, key in enumerate(self._keys) if key in self.dedup]
        width = inverse_bytes(max(sent[j] for j in dedup)) if dedup else 0
        sizes = [sum(sent) * self._dtype.itemsize, len(n) * stride * 4]
        if weighted:
            sizes.append(sum(n) * 4)
        if dedup:
            sizes.append(sum(n[j] for j in dedup) * width)
        return stride, sent, n, width, sizes

    def _exchange_payload(self, recv: torch.Tensor, payloads: List[torch.Tensor],
                          weighted: bool) -> Awaitable[KeyedJaggedTensor]:
        nk = self._splits[self._rank]
        layouts = [self._layout(h, weighted) for h in recv.view(self._world, 1 + 2 * nk)]
        sizes = [sum(b + _pad(b) for b in lay[4]) for lay in layouts]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=recv.device)
        work = dist.all_to_all_single(buffer, torch.cat(payloads), sizes, [int(p.numel()) for p in payloads],
                                      group=self._pg, async_op=True)
        return _Payload(self, work, buffer, layouts, weighted)

    def _unpack(self, buffer: torch.Tensor, layouts: List[Any], weighted: bool) -> KeyedJaggedTensor:
        """The KJT TorchRec's all-to-all delivers: this rank's keys, each key's samples from every
        source in :func:`_source_order`, ids rebuilt from the distinct ids and inverse index. It
        carries each key's distinct ids over all sources too (:class:`UniqueIds`, attribute
        ``UNIQUE_ATTR``) for a :class:`UniqueRowsLookup`."""
        nk = len(self._keys)
        per_source: List[Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor], List[Any], int]] = []
        at = 0
        for stride, sent, n, width, sizes in layouts:
            parts = []
            for b in sizes:
                parts.append(buffer[at: at + b])
                at += b + _pad(b)
            distinct = list(torch.split(parts[0].view(self._dtype), sent))
            ids = list(distinct)
            lengths = list(torch.split(parts[1].view(torch.int32), [stride] * nk))
            weights = list(torch.split(parts[2].view(torch.float32), n)) if weighted else []
            inverses: List[Any] = [None] * nk  # None: the ids are sent as they are
            if width:
                dedup = [j for j, key in enumerate(self._keys) if key in self.dedup]
                inverse = torch.split(parts[-1].view(_INVERSE_DTYPES[width]), [n[j] for j in dedup])
                for j, inv in zip(dedup, inverse):
                    inverses[j] = inv.long()
                    ids[j] = distinct[j][inverses[j]]
            per_source.append((ids, lengths, weights, (distinct, inverses), stride))
        values, lengths, weights = [], [], []
        unique_ids, unique_inverse = [], []
        for j in range(nk):
            base = 0
            key_distinct, key_inverse = [], []
            for s in self._order:
                ids_s, lengths_s, weights_s, (distinct_s, inverses_s), _ = per_source[s]
                values.append(ids_s[j])
                lengths.append(lengths_s[j])
                if weighted:
                    weights.append(weights_s[j])
                key_distinct.append(distinct_s[j])
                inv = inverses_s[j]
                key_inverse.append((inv if inv is not None else
                                    torch.arange(distinct_s[j].numel(), device=buffer.device)) + base)
                base += int(distinct_s[j].numel())
            distinct_j, inverse_j = torch.cat(key_distinct), torch.cat(key_inverse)
            if len(key_distinct) > 1:  # a row several sources sent: one distinct row
                distinct_j, merged = torch.unique(distinct_j, sorted=True, return_inverse=True)
                inverse_j = merged[inverse_j]
            unique_ids.append(distinct_j)
            unique_inverse.append(inverse_j)
        stride = sum(p[4] for p in per_source)
        kjt = KeyedJaggedTensor(
            keys=list(self._keys),
            values=torch.cat(values) if values else torch.empty(0, dtype=self._dtype, device=buffer.device),
            lengths=torch.cat(lengths) if lengths else torch.empty(0, dtype=torch.int32, device=buffer.device),
            weights=torch.cat(weights) if weighted and weights else None, stride=stride)
        setattr(kjt, UNIQUE_ATTR, UniqueIds(ids=unique_ids, inverse=unique_inverse))
        return kjt


def _pack(sections: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sections' bytes, each padded to :data:`_ALIGN`, in one uint8 tensor."""
    parts: List[torch.Tensor] = []
    for s in sections:
        b = _bytes(s)
        parts.append(b)
        if _pad(b.numel()):
            parts.append(torch.zeros(_pad(b.numel()), dtype=torch.uint8, device=b.device))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


#: The attribute of a KJT :class:`WireIdsAllToAll` delivers that holds its :class:`UniqueIds`.
UNIQUE_ATTR = "_sparselift_unique_ids"


class UniqueIds:
    """Per key of a received KJT: its distinct ids over every source (``ids[j]``, sorted) and,
    per id of the KJT, the index of its row among them (``inverse[j]``): the KJT's ids of key
    ``j`` are ``ids[j][inverse[j]]``."""

    def __init__(self, ids: List[torch.Tensor], inverse: List[torch.Tensor]) -> None:
        self.ids, self.inverse = ids, inverse


class UniqueRowsLookup:
    """The forward of a sharding group's TBE lookup (TorchRec's ``GroupedPooledEmbeddingsLookup``,
    installed as its ``forward``: the module, its parameters, state and fused optimizer stay as
    they are) that, for a KJT carrying :class:`UniqueIds`, looks up each distinct row once and
    pools the batch's bags from those rows.

    The TBE runs on a KJT whose bags are the distinct ids, one per bag (key ``j``'s first
    ``len(ids[j])`` bags of a common stride, the rest empty); each key's pooled output is then
    ``embedding_bag(inverse[j], rows_j, offsets_j)`` in the TBE's own pooling mode (sum, with the
    per-sample weights; or unweighted mean), so the output equals the TBE's on the full KJT up to
    the order of the floating-point sums. In backward the pooling adds the gradients of a row's
    every occurrence before the TBE's backward and its fused optimizer see them, as that backward
    does itself on the full KJT: the update is the one without dedup. A KJT without
    :class:`UniqueIds` (or a weighted one of a mean-pooled group) goes to the TBE as it is.
    """

    def __init__(self, lookup: nn.Module) -> None:
        if not self.supports(lookup):
            raise TypeError(f"UniqueRowsLookup rebuilds sum and mean pooling of TorchRec's grouped pooled lookup, "
                            f"got {type(lookup).__name__}")
        configs = lookup.grouped_configs
        self._forward = lookup.forward
        self._keys: List[str] = [f for c in configs for f in c.feature_names()]
        self._dims: List[int] = [d for c in configs for d in c.embedding_dims()]
        self._modes: List[str] = [mode for c, mode in zip(configs, _tbe_modes(lookup)) for _ in c.feature_names()]

    @staticmethod
    def supports(lookup: nn.Module) -> bool:
        """Whether ``lookup`` is a grouped pooled lookup whose TBEs all pool by sum or mean."""
        configs = getattr(lookup, "grouped_configs", None)
        modes = _tbe_modes(lookup)
        return bool(configs) and len(modes) == len(configs) and all(modes)

    def __call__(self, features: KeyedJaggedTensor) -> torch.Tensor:
        unique: Optional[UniqueIds] = getattr(features, UNIQUE_ATTR, None)
        if unique is None or list(features.keys()) != self._keys:
            return self._forward(features)
        weights = features.weights_or_none()
        if weights is not None and "mean" in self._modes:
            return self._forward(features)  # a weighted mean is not embedding_bag's
        counts = [int(u.numel()) for u in unique.ids]
        width = max(1, max(counts))
        device = features.values().device
        lengths = torch.zeros(len(counts), width, dtype=torch.int32, device=device)
        for j, c in enumerate(counts):
            lengths[j, :c] = 1
        rows_kjt = KeyedJaggedTensor(
            keys=self._keys, values=torch.cat(unique.ids), lengths=lengths.flatten(), stride=width,
            weights=None if weights is None else torch.ones(sum(counts), device=device, dtype=weights.dtype))
        rows = self._forward(rows_kjt)  # [width, sum of dims]: key j's distinct rows in its first counts[j]
        per_key_lengths = features.lengths().view(len(self._keys), -1)
        per_key_weights = (torch.split(weights, per_key_lengths.sum(1).tolist()) if weights is not None
                           else [None] * len(self._keys))
        out = []
        # one column block per key (a split: its backward writes the rows' gradient once, where a
        # 2D slice per key would allocate and add a rows-sized gradient per key)
        blocks = rows.split(self._dims, dim=1)
        for j, (dim, mode) in enumerate(zip(self._dims, self._modes)):
            offsets = torch.zeros(per_key_lengths.size(1) + 1, dtype=torch.long, device=device)
            torch.cumsum(per_key_lengths[j].long(), 0, out=offsets[1:])
            # a key with no ids here pools its empty bags from the (empty) row 0 of its padded
            # block: zeros, in the graph (every rank's backward then runs the group's collectives)
            table = blocks[j][: max(counts[j], 1)]
            out.append(torch.nn.functional.embedding_bag(
                unique.inverse[j], table, offsets, mode=mode, per_sample_weights=per_key_weights[j],
                include_last_offset=True))
        return torch.cat(out, dim=1)


def _tbe_modes(lookup: nn.Module) -> List[str]:
    """The pooling each TBE of a grouped lookup runs (``"sum"``, ``"mean"``, ``""`` for another):
    the TBE's own mode, which is sum for a mean-pooled row-wise or table-row-wise table (TorchRec
    divides after the reduce-scatter)."""
    out = []
    for m in getattr(lookup, "_emb_modules", None) or []:
        mode = getattr(getattr(m, "_pooling", None), "name", "")
        out.append({"SUM": "sum", "MEAN": "mean"}.get(mode, ""))
    return out


def _table_rows(sharded: ShardedEmbeddingBagCollection) -> Dict[str, Tuple[int, str, Tuple[str, ...]]]:
    """table -> (rows, sharding type, features) of a sharded EBC."""
    plan = sharded.module_sharding_plan
    return {c.name: (int(c.num_embeddings), plan[c.name].sharding_type, tuple(c.feature_names))
            for c in sharded._embedding_bag_configs if c.name in plan}


def wire_ids_modules(model: nn.Module) -> List[Tuple[str, ShardedEmbeddingBagCollection]]:
    """The ``(path in the user's model, module)`` of every sharded EmbeddingBagCollection in
    ``model`` but those inside a feature-processed one (left alone: its feature processors read
    the received KJT)."""
    inside_fp = {id(m._embedding_bag_collection) for m in model.modules()
                 if isinstance(m, ShardedFeatureProcessedEmbeddingBagCollection)}
    return [(_user_path(n), m) for n, m in model.named_modules()
            if isinstance(m, ShardedEmbeddingBagCollection) and id(m) not in inside_fp]


def _user_path(name: str) -> str:
    """``name`` as the user's model names it (without DMP's and DDP's wrapper prefixes)."""
    for prefix in ("_dmp_wrapped_module.", "module."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


class WireFeaturesDist(nn.Module):
    """A sharding group's input dist (TorchRec's ``*SparseFeaturesDist``, ``features_dist``) whose
    KJT enters at ``id_dtype``; with ``dedup`` keys its ``KJTAllToAll`` is a
    :class:`WireIdsAllToAll`.

    Without dedup it exposes the group's ``KJTAllToAll`` as ``_dist``, as TorchRec's dists do, so
    TorchRec's train pipelines still fuse its splits exchange with the other groups'; with dedup it
    exposes none (the pipelines then wait on its awaitables as they are, as on a data-parallel
    group's).
    """

    def __init__(self, features_dist: nn.Module, id_dtype: str, dedup: FrozenSet[str]) -> None:
        super().__init__()
        inner = getattr(features_dist, "_dist", None)
        if not isinstance(inner, KJTAllToAll):
            raise TypeError(f"the input dist {type(features_dist).__name__} sends through {type(inner).__name__}, "
                            "not KJTAllToAll: ids on the wire cannot rewrite it; keep id_dtype='int64' and no "
                            "dedup_features for this model")
        self.features_dist = features_dist
        self.id_dtype = id_dtype
        self._dtype = _TORCH_DTYPES[id_dtype]
        self.dedup = frozenset(dedup)
        if dedup:
            features_dist._dist = WireIdsAllToAll(inner, id_dtype, dedup)
        else:
            self._dist = inner

    def forward(self, kjt: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return self.features_dist(_cast(kjt, self._dtype))


def _wrap_dists(sharded: ShardedEmbeddingBagCollection, id_dtype: str, dedup: FrozenSet[str],
                unique_rows: bool) -> None:
    """Wrap every model-parallel group's input dist of ``sharded`` (data-parallel ones send nothing)
    and, with ``unique_rows``, install :class:`UniqueRowsLookup` on the lookups of the groups
    that deduplicate."""
    for i, (sharding_type, sharding) in enumerate(zip(sharded._sharding_types, sharded._embedding_shardings)):
        if sharding_type == DATA_PARALLEL or isinstance(sharded._input_dists[i], WireFeaturesDist):
            continue
        group = dedup.intersection(sharding.feature_names())
        sharded._input_dists[i] = WireFeaturesDist(sharded._input_dists[i], id_dtype, frozenset(group))
        lookup = sharded._lookups[i]
        if group and unique_rows and UniqueRowsLookup.supports(lookup):
            lookup.forward = UniqueRowsLookup(lookup)


def apply_wire_ids(model: nn.Module, id_dtype: str = "int64", dedup_features: Iterable[str] = (),
                   unique_rows: bool = False) -> List[str]:
    """Rewrite the input all-to-all of every sharded EmbeddingBagCollection in ``model`` (in place)
    to send ids at ``id_dtype`` and deduplicate ``dedup_features``; returns the tables rewritten
    (model-parallel tables; data-parallel ones send nothing). Nothing changes for ``"int64"`` and
    no dedup features. ``unique_rows``: the lookups of deduplicating groups look up each distinct
    row once (:class:`UniqueRowsLookup`); without it they look up the rebuilt ids, bit for bit
    TorchRec's lookup.

    Refuses, before changing anything: an unknown id dtype; ``"int32"`` when a model-parallel
    table has more rows than int32 holds (naming it); a dedup feature that no model-parallel table
    of the model reads (naming it and the ones that exist).
    """
    if id_dtype not in ID_DTYPES:
        raise ValueError(f"id_dtype={id_dtype!r} is not supported: use one of {', '.join(ID_DTYPES)}")
    dedup = frozenset(feature_tuple(dedup_features))
    modules = wire_ids_modules(model)
    tables = {(name, t): info for name, m in modules for t, info in _table_rows(m).items()}
    sharded = {k: v for k, v in tables.items() if v[1] != DATA_PARALLEL}
    if id_dtype == "int32":
        why = narrow_refusal((f"{m}.{t}" if m else t, rows) for (m, t), (rows, _, _) in sharded.items())
        if why:
            raise ValueError(why)
    features = {f for _, _, fs in sharded.values() for f in fs}
    every = {f for _, _, fs in tables.values() for f in fs}
    unknown = sorted(dedup - every)
    if unknown:
        raise ValueError(f"dedup_features {unknown} are not features of the model's sharded "
                         f"EmbeddingBagCollections; its features: {sorted(every)[:20]}")
    if dedup - features:
        logger.info("sparselift: dedup_features %s are data-parallel (nothing on the wire): left alone",
                    sorted(dedup - features))
    dedup = dedup & features
    if not sharded:
        return []
    if id_dtype == "int64" and not dedup:
        return []
    for name, m in modules:
        if getattr(m, _PATCHED, None) is not None:
            raise ValueError(f"{name or 'the model'} already has ids on the wire applied "
                             f"({getattr(m, _PATCHED)}); apply once per model")
        setattr(m, _PATCHED, (id_dtype, tuple(sorted(dedup))))
        if not m._has_uninitialized_input_dist:
            _wrap_dists(m, id_dtype, dedup, unique_rows)
            continue
        create = m._create_input_dist

        def create_and_wrap(input_feature_names: List[str], _m: Any = m, _create: Any = create) -> None:
            _create(input_feature_names)
            _wrap_dists(_m, id_dtype, dedup, unique_rows)

        m._create_input_dist = create_and_wrap
    logger.info("sparselift: ids on the wire %s, dedup %s on %d tables", id_dtype, sorted(dedup) or "none",
                len(sharded))
    return sorted(f"{m}.{t}" if m else t for m, t in sharded)
