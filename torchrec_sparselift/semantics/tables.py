"""Find the embedding tables a planner must place, as plain values.

:func:`extract_tables` walks a module the way TorchRec's enumerator does (module by module,
asking each default sharder for its shardable parameters) and returns one :class:`TableSpec` per
table: shape, features, pooling, element size, and which sharding types and compute kernels the
device and the sharder really support. The live objects TorchRec needs to build
``ShardingOption``s (the parameter tensor, the owning module, the sharder) travel separately in a
:class:`TableHandle`, so everything the cost model and the search read is immutable and hashable.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import attrs
from torch import nn

from torchrec_sparselift import defaults
from torchrec_sparselift.validation import table_value_problems
from torchrec_sparselift.vocabulary import (
    CPU_EXTRA_SHARDING_TYPES,
    CPU_RUNTIME_SHARDING_TYPES,
    KEY_VALUE_KERNELS,
    OPT_IN_SHARDING_TYPES,
    ROW_SPLIT_TYPES,
)
from torchrec_sparselift.semantics.workload import distinct_ids

__all__ = [
    "TableSpec",
    "TableHandle",
    "extract_tables",
    "embedding_configs",
    "embedding_modules",
    "CPU_RUNTIME_SHARDING_TYPES",
    "ELEMENT_BYTES",
    "KEY_VALUE_KERNELS",
]

ELEMENT_BYTES: Dict[str, int] = {
    "FP32": 4,
    "FP16": 2,
    "BF16": 2,
    "INT8": 1,
    "UINT8": 1,
    "INT4": 1,
    "INT2": 1,
}


@attrs.frozen
class TableSpec:
    """One embedding table as the planner sees it.

    Attributes:
        module_path: FQN of the sharded module that owns the table ("" for the root module).
        name: table name (the key of the table in the module's sharding plan).
        num_embeddings: rows.
        embedding_dim: columns.
        feature_names: features that look this table up.
        pooling_factor: ids looked up per sample, summed over the table's features.
        is_pooled: True for bags (EmbeddingBagCollection), False for sequences.
        elem_bytes: bytes per weight element (4 for fp32).
        sharding_types: types the device, the sharder and the user's constraints all allow.
        compute_kernels: per sharding type, the allowed compute kernels.
        min_partition: smallest column-wise shard width the user allows (None: no preference).
        batch_size: per-rank batch size for this table's features.
        num_buckets: ``total_num_buckets`` of a virtual table (``use_virtual_table=True``): its
            id space is split into buckets, and row-wise shards hold whole buckets.
        kv_l1_bytes: per-shard HBM (L1) cache of a key-value kernel
            (``KeyValueParams.max_l1_cache_size``, MiB); 0 when not set.
        kv_l2_bytes: per-shard DRAM (L2) cache of a key-value kernel
            (``KeyValueParams.l2_cache_size``, GiB); 0 when not set.
        unique_ratio: distinct ids / ids in one rank's batch, over the table's features (their
            observed ``FeatureStats.unique_ratio`` weighted by their ids); None when not observed
            (the graph then takes the ids as uniform over the rows).
        unique_growth: how the distinct ids grow over pooled batches
            (``FeatureStats.unique_growth``, weighted likewise); None: 1.0.
    """

    module_path: str
    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: Tuple[str, ...]
    pooling_factor: float
    is_pooled: bool
    elem_bytes: int
    sharding_types: Tuple[str, ...]
    compute_kernels: Tuple[Tuple[str, Tuple[str, ...]], ...]
    min_partition: Optional[int] = None
    batch_size: int = defaults.BATCH_SIZE
    num_buckets: Optional[int] = None
    kv_l1_bytes: int = 0
    kv_l2_bytes: int = 0
    unique_ratio: Optional[float] = None
    unique_growth: Optional[float] = None

    def __attrs_post_init__(self) -> None:
        problems = table_value_problems(f"table {self.fqn!r}", self.num_embeddings,
                                        self.embedding_dim, self.pooling_factor, self.batch_size)
        for name in ("unique_ratio", "unique_growth"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                problems.append(f"table {self.fqn!r}: {name} must be in [0, 1] or None, got {v!r}")
        if problems:
            raise ValueError(problems[0])

    def distinct_rows(self, batches: float = 1.0) -> float:
        """Expected distinct rows among ``batches`` ranks' batches of this table's ids in one step
        (:func:`~torchrec_sparselift.semantics.workload.distinct_ids`)."""
        return distinct_ids(self.batch_size * self.pooling_factor, batches, self.num_embeddings,
                            self.unique_ratio, self.unique_growth)

    @property
    def fqn(self) -> str:
        return f"{self.module_path}.{self.name}" if self.module_path else self.name

    @property
    def weight_bytes(self) -> int:
        return self.num_embeddings * self.embedding_dim * self.elem_bytes

    @property
    def pinned_weight_bytes(self) -> int:
        """The least weight memory any allowed kernel pins: 0 when a key-value kernel is
        allowed (its store holds only inserted ids), else all rows."""
        if any(k in KEY_VALUE_KERNELS for _, ks in self.compute_kernels for k in ks):
            return 0
        return self.weight_bytes

    def kernels_for(self, sharding_type: str) -> Tuple[str, ...]:
        for st, kernels in self.compute_kernels:
            if st == sharding_type:
                return kernels
        return ()


@attrs.define(eq=False)
class TableHandle:
    """The live objects behind a :class:`TableSpec`, needed only to build TorchRec values."""

    spec: TableSpec
    tensor: Any
    module: Tuple[str, nn.Module]
    sharder: Any
    sharder_key: str
    constraints: Any = None


def is_feature_processed(name: str) -> bool:
    """Whether a module class name or TorchRec sharder key (``sharder_name``) is a
    feature-processed embedding module (``FeatureProcessedEmbeddingBagCollection`` and its sharded
    form): its lookups run a feature processor whose weights the dense optimizer updates."""
    return "FeatureProcessed" in name


def _sharder_key(module_type: type) -> str:
    # Same key TorchRec uses to match sharders to modules (planner.utils.sharder_name).
    from torchrec.distributed.planner.utils import sharder_name

    return sharder_name(module_type)


_WRAPPED = ("_embedding_bag_collection", "_embedding_collection", "_embedding_module")


def embedding_configs(module: nn.Module, search_children: bool = False) -> Tuple[Optional[List[Any]], bool]:
    """The table configs of an embedding module and whether its lookups pool: an EBC's
    ``embedding_bag_configs()`` (pooled), an EC's ``embedding_configs()``, or those of the
    collection a wrapper holds (FP-EBC, managed-collision modules: ``_embedding_bag_collection``,
    ``_embedding_collection``, ``_embedding_module``). ``search_children``: also look through
    the module's children, first found per table name. ``(None, False)`` when there are none."""
    for getter, pooled in (("embedding_bag_configs", True), ("embedding_configs", False)):
        fn = getattr(module, getter, None)
        if callable(fn):
            try:
                return list(fn()), pooled
            except Exception:  # a module whose configs need runtime state: look further
                continue
    for inner_name in _WRAPPED:
        inner = getattr(module, inner_name, None)
        if isinstance(inner, nn.Module):
            configs, pooled = embedding_configs(inner)
            if configs is not None:
                return configs, pooled
    if search_children:
        found: Dict[str, Any] = {}
        pooled_any = False
        for child in module.children():
            configs, pooled = embedding_configs(child, search_children=True)
            for cfg in configs or ():
                found.setdefault(cfg.name, cfg)
            pooled_any = pooled_any or (pooled and bool(configs))
        if found:
            return list(found.values()), pooled_any
    return None, False


def embedding_modules(
    module: nn.Module, is_unit: Optional[Callable[[nn.Module], bool]] = None
) -> Iterator[Tuple[str, nn.Module]]:
    """The one table walker: ``(path, submodule)`` for every submodule planned as a unit, depth
    first in registration order (as ``named_modules``, each module object once), not looking
    inside a unit. ``is_unit`` decides (the planner: "a sharder handles this module type");
    default: the module has table configs (:func:`embedding_configs`), which reports a wrapper
    such as an FP-EBC at the wrapper's path."""
    unit = is_unit or (lambda m: embedding_configs(m)[0] is not None)
    seen: set = set()

    def visit(path: str, m: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
        if id(m) in seen:
            return
        seen.add(id(m))
        if unit(m):
            yield path, m
            return
        for name, child in m.named_children():
            yield from visit(f"{path}.{name}" if path else name, child)

    yield from visit("", module)


def _device_sharding_types(sharder: Any, compute_device: str) -> List[str]:
    offered = list(sharder.sharding_types(compute_device))
    if compute_device == "cpu":
        # The CPU runtime also runs row-wise and table-row-wise; offer them when the sharder
        # supports them on CUDA (i.e. the module kind can be sharded that way at all).
        cuda_types = set(sharder.sharding_types("cuda"))
        for st in CPU_EXTRA_SHARDING_TYPES:
            if st in cuda_types and st not in offered:
                offered.append(st)
        offered = [t for t in offered if t in CPU_RUNTIME_SHARDING_TYPES]
    return offered


def _pooling_factor(
    feature_names: Sequence[str],
    constraint: Any,
    stats: Any,
    default: float,
) -> float:
    if constraint is not None and getattr(constraint, "pooling_factors", None):
        pfs = list(constraint.pooling_factors)
        # TorchRec's default is one entry [POOLING_FACTOR]; a user may give one per feature.
        if len(pfs) == 1 and len(feature_names) > 1 and stats is None:
            return float(pfs[0]) * len(feature_names)
        if not (len(pfs) == 1 and pfs[0] == default and stats is not None):
            return float(sum(pfs))
    if stats is not None:
        return float(sum(stats.pooling_factor(f, default) for f in feature_names))
    return float(default) * max(1, len(feature_names))


def _id_statistics(feature_names: Sequence[str], stats: Any, batch_size: Optional[int] = None
                   ) -> Dict[str, Optional[float]]:
    """The table's ``unique_ratio`` / ``unique_growth`` at a per-rank batch of ``batch_size``
    samples from its features' observed statistics (None unless every feature has a
    ``unique_ratio``). A feature observed at another batch size ``b`` has its ratio moved along its
    growth (``u (batch_size / b)^(g - 1)``, Heaps' law). The growth is the features' weighted by
    their distinct ids. ``f`` features sharing a table are taken to draw from the same rows, as
    ``f`` pooled batches: their union is ``(sum of their distinct ids) f^(g - 1)`` (observed statistics
    are per feature, so how far the features' hot rows overlap is not seen; measured on features that
    share their id distribution, the graph's distinct rows were then within ~15%, against 1.2-1.5x
    too many when the features' distinct ids were summed)."""
    out: Dict[str, Optional[float]] = {"unique_ratio": None, "unique_growth": None}
    if stats is None or not isinstance(stats, Mapping):
        return out
    per = [stats.get(f) for f in feature_names]
    if any(getattr(fs, "unique_ratio", None) is None for fs in per):
        return out
    ids = [float(fs.pooling_factor) for fs in per]
    growth = [getattr(fs, "unique_growth", None) for fs in per]

    def at_batch(fs: Any, g: Optional[float]) -> float:
        observed = getattr(fs, "batch_size", None)
        if batch_size is None or not observed:
            return float(fs.unique_ratio)
        return min(1.0, float(fs.unique_ratio) * (float(batch_size) / float(observed)) ** ((1.0 if g is None else g) - 1.0))

    distinct = [at_batch(fs, g) * n for fs, g, n in zip(per, growth, ids)]
    if sum(ids) <= 0:
        return out
    g = None
    if all(x is not None for x in growth) and sum(distinct) > 0:
        g = min(1.0, sum(x * d for x, d in zip(growth, distinct)) / sum(distinct))
    overlap = float(len(per)) ** ((1.0 if g is None else g) - 1.0)
    out["unique_ratio"] = min(1.0, sum(distinct) * overlap / sum(ids))
    out["unique_growth"] = g
    return out


def extract_tables(
    module: nn.Module,
    sharders: Sequence[Any],
    compute_device: str,
    batch_size: int,
    constraints: Optional[Mapping[str, Any]] = None,
    stats: Any = None,
    default_pooling_factor: float = 1.0,
    problems: Optional[List[str]] = None,
) -> List[TableHandle]:
    """Every shardable table of ``module``, in a deterministic order (module FQN, then table).

    Raises ``ValueError`` naming the table when the device, the sharder and the user's
    constraints leave no sharding type or kernel, when its values cannot make a
    :class:`TableSpec` (:func:`~torchrec_sparselift.validation.table_value_problems`), or when a
    constraint names a table the module does not have. Given ``problems`` (a
    :class:`~torchrec_sparselift.validation.Problems`), it raises nothing for those: it appends
    them, skips the table (recording its name and features there) and returns the rest, so
    :func:`~torchrec_sparselift.validation.validate_inputs` can list every problem at once.
    """
    constraints = dict(constraints or {})
    sharder_map = {_sharder_key(s.module_type): s for s in sharders}
    handles: List[TableHandle] = []

    def report(messages: Sequence[str]) -> None:
        if problems is None:
            raise ValueError(messages[0])
        problems.extend(messages)

    def visit(path: str, m: nn.Module) -> None:
        key = _sharder_key(type(m))
        sharder = sharder_map[key]
        configs = {cfg.name: cfg for cfg in reversed(embedding_configs(m, search_children=True)[0] or [])}
        is_pooled = _module_pooled(m)
        device_types = _device_sharding_types(sharder, compute_device)
        if is_feature_processed(key):
            # TorchRec guards position-weighted modules against row-splitting types.
            device_types = [t for t in device_types if t not in ROW_SPLIT_TYPES]
        for name, param in sorted(sharder.shardable_parameters(m).items()):
            c = constraints.get(name)
            cfg = configs.get(name)
            feature_names = tuple(
                (c.feature_names if c is not None and c.feature_names else None)
                or (cfg.feature_names if cfg is not None else None)
                or [name]
            )
            getattr(problems, "tables", set()).add(name)
            getattr(problems, "features", set()).update(feature_names)
            types = [t for t in device_types if t not in OPT_IN_SHARDING_TYPES]
            if c is not None and c.sharding_types:
                allowed = set(c.sharding_types)
                types = [t for t in device_types if t in allowed]
                if not types:
                    report([
                        f"table {name!r}: ParameterConstraints.sharding_types={list(c.sharding_types)} "
                        f"leaves nothing the {compute_device} runtime and {type(sharder).__name__} "
                        f"support ({device_types}); allow one of those"
                    ])
                    continue
            kernels: List[Tuple[str, Tuple[str, ...]]] = []
            for st in types:
                ks = list(sharder.compute_kernels(st, compute_device))
                if c is not None and c.compute_kernels:
                    ks = [k for k in ks if k in set(c.compute_kernels)]
                else:  # as TorchRec: key-value kernels only when a constraint asks for them
                    ks = [k for k in ks if k not in KEY_VALUE_KERNELS]
                if compute_device == "cpu" and not is_pooled:
                    # TorchRec 1.8's dense kernel for sequence tables does not train on CPU
                    # (heap corruption table-/column-wise, split-size errors row-wise and
                    # data-parallel; seen in tests/test_comm_semantics.py): never plan it there.
                    ks = [k for k in ks if k != "dense"]
                if ks:
                    kernels.append((st, tuple(ks)))
            if not kernels:
                report([
                    f"table {name!r}: no compute kernel is left for sharding types {types} on "
                    f"{compute_device}; ParameterConstraints.compute_kernels="
                    f"{list(c.compute_kernels) if c is not None and c.compute_kernels else None} "
                    "must include one the sharder supports"
                    + (" (the dense kernel of sequence tables does not run on CPU: allow fused "
                       "and a model-parallel sharding type)"
                       if compute_device == "cpu" and not is_pooled else "")
                ])
                continue
            rows, dim = int(param.shape[0]), int(param.shape[1])
            dtype_name = getattr(getattr(cfg, "data_type", None), "name", "FP32")
            where = f"table {(path + '.' + name) if path else name!r}"
            try:
                pooling = _pooling_factor(feature_names, c, stats, default_pooling_factor)
                tbs = int(max(c.batch_sizes)) if c is not None and c.batch_sizes else batch_size
                bad = table_value_problems(where, rows, dim, pooling, tbs)
            except (TypeError, ValueError) as e:
                pooling, tbs = 0.0, 1
                bad = [f"{where}: its ParameterConstraints cannot be read ({e})"]
            if bad:
                if problems is not None and c is not None:
                    # validate_inputs names the constraint's malformed fields; add only the shape
                    bad = table_value_problems(where, rows, dim)
                if bad or problems is None:
                    report(bad)
                continue
            spec = TableSpec(
                module_path=path,
                name=name,
                num_embeddings=rows,
                embedding_dim=dim,
                feature_names=feature_names,
                pooling_factor=pooling,
                is_pooled=is_pooled,
                elem_bytes=ELEMENT_BYTES.get(dtype_name, 4),
                sharding_types=tuple(st for st, _ in kernels),
                compute_kernels=tuple(kernels),
                min_partition=(c.min_partition if c is not None else None),
                batch_size=tbs,
                **_key_value_fields(cfg, c),
                **_id_statistics(feature_names, stats, tbs),
            )
            handles.append(
                TableHandle(
                    spec=spec,
                    tensor=param,
                    module=(path, m),
                    sharder=sharder,
                    sharder_key=key,
                    constraints=c,
                )
            )

    for path, m in embedding_modules(module, lambda m: _sharder_key(type(m)) in sharder_map):
        visit(path, m)
    if constraints and problems is None:  # with ``problems``, validate_inputs names them
        known = {h.spec.name for h in handles}
        unknown = sorted(set(constraints) - known)
        if unknown:
            raise ValueError(
                f"constraints name tables the model does not have: {unknown}; "
                f"known tables: {sorted(known)[:20]}{' ...' if len(known) > 20 else ''}"
            )
    handles.sort(key=lambda h: (h.spec.module_path, h.spec.name))
    return handles


def _key_value_fields(cfg: Any, constraint: Any) -> Dict[str, Any]:
    """Bucket count of a virtual table and the cache sizes its key-value kernel pins."""
    out: Dict[str, Any] = {}
    if cfg is not None and getattr(cfg, "use_virtual_table", False) and getattr(cfg, "total_num_buckets", None):
        out["num_buckets"] = int(cfg.total_num_buckets)
    kv = getattr(constraint, "key_value_params", None)
    if kv is not None:
        out["kv_l1_bytes"] = int((getattr(kv, "max_l1_cache_size", None) or 0) * 2**20)
        out["kv_l2_bytes"] = int((getattr(kv, "l2_cache_size", None) or 0) * 2**30)
    return out


def _module_pooled(m: nn.Module) -> bool:
    from torchrec.distributed.planner.types import ShardingOption

    try:
        return bool(ShardingOption.module_pooled(m, ""))
    except Exception:
        return "Bag" in type(m).__name__
