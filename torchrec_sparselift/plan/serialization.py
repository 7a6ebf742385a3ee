"""TorchRec ``ShardingPlan`` <-> JSON-ready dicts, losslessly.

TorchRec's own ``ShardingPlan._serialize`` is one-way and drops fields. These functions write every
``ParameterSharding`` field TorchRec uses and read them back into an *equal* ``ShardingPlan``:

- ``sharding_type``, ``compute_kernel``, ``ranks``;
- ``sharding_spec`` as an ``EnumerableShardingSpec`` of ``ShardMetadata(shard_offsets,
  shard_sizes, placement)`` with the placement written as its string ("rank:0/cuda:0");
- ``cache_params`` (algorithm, load factor, reserved memory, precision, prefetch pipeline,
  multi-pass prefetch config), ``enforce_hbm``, ``stochastic_rounding``, ``bounds_check_mode``,
  ``output_dtype`` and ``key_value_params`` (all scalar fields, PS hosts, the fbgemm stats
  reporter config, the KV-ZCH TBE config), each only where set.

Module plans may be ``EmbeddingModuleShardingPlan`` (EBC, EC, FP-EBC, MC-EBC/EC, ...) or
``ObjectPoolShardingPlan``. Anything these functions cannot write faithfully raises
``ValueError`` naming the module, parameter and field, rather than silently dropping it; reading
refuses anything else with a ``PlanFormatError`` naming the field path. One
deliberate exception: ``CacheParams.stats`` (a user ``CacheStatistics`` object that TorchRec's planner
reads to size caches and the sharded modules never read) is not written; it reads back as ``None``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Dict, Mapping, Optional

from torchrec_sparselift.errors import PlanFormatError
from torchrec_sparselift.files import Fields

__all__ = ["sharding_plan_to_dict", "sharding_plan_from_dict"]

_PS_FIELDS = (
    "sharding_type",
    "compute_kernel",
    "ranks",
    "sharding_spec",
    "cache_params",
    "enforce_hbm",
    "stochastic_rounding",
    "bounds_check_mode",
    "output_dtype",
    "key_value_params",
)


def _err(where: str, msg: str) -> ValueError:
    return ValueError(f"cannot serialize sharding plan at {where}: {msg}")


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------


def _shard_spec_to_dict(spec: Any, where: str) -> Dict[str, Any]:
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    if not isinstance(spec, EnumerableShardingSpec):
        raise _err(where, f"sharding_spec of type {type(spec).__name__} (only EnumerableShardingSpec is supported)")
    shards = []
    for shard in spec.shards:
        shards.append(
            {
                "offsets": [int(x) for x in shard.shard_offsets],
                "sizes": [int(x) for x in shard.shard_sizes],
                "placement": None if shard.placement is None else str(shard.placement),
            }
        )
    return {"kind": "enumerable", "shards": shards}


def _cache_params_to_dict(cp: Any, where: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if cp.algorithm is not None:
        out["algorithm"] = cp.algorithm.name
    for name in ("load_factor", "reserved_memory", "prefetch_pipeline"):
        value = getattr(cp, name)
        if value is not None:
            out[name] = value
    if cp.precision is not None:
        out["precision"] = cp.precision.value
    if cp.multipass_prefetch_config is not None:
        out["multipass_prefetch_config"] = dict(cp.multipass_prefetch_config._asdict())
    known = {"algorithm", "load_factor", "reserved_memory", "precision", "prefetch_pipeline", "stats",
             "multipass_prefetch_config"}
    for f in dataclasses.fields(cp):
        if f.name not in known and getattr(cp, f.name) != f.default:
            raise _err(where, f"CacheParams.{f.name} is set but this version of sparselift does not know it")
    return out


def _kv_params_to_dict(kv: Any, where: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(kv):
        value = getattr(kv, f.name)
        if value is None:
            continue
        if f.name == "ps_hosts":
            out[f.name] = [[str(host), int(port)] for host, port in value]
        elif f.name == "stats_reporter_config":
            cls = type(value)
            if not cls.__module__.startswith("fbgemm_gpu."):
                raise _err(where, f"key_value_params.stats_reporter_config of type {cls.__qualname__} is not an fbgemm config")
            out[f.name] = {
                "class": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {g.name: getattr(value, g.name) for g in dataclasses.fields(value)},
            }
        elif f.name == "kvzch_tbe_config":
            cfg = value._asdict()
            if cfg.get("enrichment_policy") is not None:
                raise _err(where, "key_value_params.kvzch_tbe_config.enrichment_policy cannot be serialized")
            dtypes = cfg.get("optimizer_state_dtypes_for_st")
            if dtypes is not None:
                cfg["optimizer_state_dtypes_for_st"] = sorted([list(t) for t in dtypes])
            out[f.name] = cfg
        elif isinstance(value, (bool, int, float, str)):
            out[f.name] = value
        else:
            raise _err(where, f"key_value_params.{f.name} of type {type(value).__name__} is not supported")
    return out


def _param_sharding_to_dict(ps: Any, where: str) -> Dict[str, Any]:
    for f in dataclasses.fields(ps):
        if f.name not in _PS_FIELDS and getattr(ps, f.name) != f.default:
            raise _err(where, f"ParameterSharding.{f.name} is set but this version of sparselift does not know it")
    out: Dict[str, Any] = {
        "sharding_type": str(ps.sharding_type),
        "compute_kernel": str(ps.compute_kernel),
        "ranks": None if ps.ranks is None else [int(r) for r in ps.ranks],
    }
    if ps.sharding_spec is not None:
        out["sharding_spec"] = _shard_spec_to_dict(ps.sharding_spec, where)
    if ps.cache_params is not None:
        out["cache_params"] = _cache_params_to_dict(ps.cache_params, where)
    if ps.enforce_hbm is not None:
        out["enforce_hbm"] = bool(ps.enforce_hbm)
    if ps.stochastic_rounding is not None:
        out["stochastic_rounding"] = bool(ps.stochastic_rounding)
    if ps.bounds_check_mode is not None:
        out["bounds_check_mode"] = ps.bounds_check_mode.name
    if ps.output_dtype is not None:
        out["output_dtype"] = ps.output_dtype.value
    if ps.key_value_params is not None:
        out["key_value_params"] = _kv_params_to_dict(ps.key_value_params, where)
    return out


def sharding_plan_to_dict(plan: Any) -> Dict[str, Any]:
    """A JSON-ready dict holding every field of ``plan`` (a TorchRec ``ShardingPlan``).

    Raises ``ValueError`` naming the module/parameter/field it cannot represent.
    """
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ObjectPoolShardingPlan

    modules: Dict[str, Any] = {}
    for module_path, module_plan in plan.plan.items():
        if isinstance(module_plan, ObjectPoolShardingPlan):
            modules[module_path] = {
                "kind": "object_pool",
                "sharding_type": module_plan.sharding_type.name,
                "inference": bool(module_plan.inference),
                "memory_capacity_per_rank": module_plan.memory_capacity_per_rank,
            }
        elif isinstance(module_plan, (EmbeddingModuleShardingPlan, dict)):
            modules[module_path] = {
                "kind": "embedding",
                "params": {
                    str(name): _param_sharding_to_dict(ps, f"{module_path}.{name}")
                    for name, ps in module_plan.items()
                },
            }
        else:
            raise _err(module_path, f"module plan of type {type(module_plan).__name__} is not supported")
    return {"modules": modules}


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------


def _built(f: Any, name: Optional[str], build: Any, *args: Any, **kwargs: Any) -> Any:
    """``build(*args, **kwargs)``; a library's refusal of stored values becomes a field error."""
    try:
        return build(*args, **kwargs)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, ImportError, OverflowError,
            RuntimeError) as e:
        raise f.fail(name, f"cannot be rebuilt: {type(e).__name__}: {e}",
                     "re-plan and store the plan again (it was edited or written by another version)") from None


def _enum_member(f: Any, name: str, enum_cls: Any, by: str = "name") -> Any:
    """Optional field ``name`` holding an enum member's name (or value, ``by="value"``)."""
    members = list(enum_cls.__members__.values())
    choices = [m.name for m in members] if by == "name" else [m.value for m in members]
    value = f.opt(name, type(choices[0]) if choices else str, choices=choices)
    if value is None:
        return None
    return enum_cls[value] if by == "name" else enum_cls(value)


def _cache_params_from_dict(f: Any) -> Any:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, MultiPassPrefetchConfig
    from torchrec.distributed.types import CacheParams
    from torchrec.types import DataType

    f.only(("algorithm", "load_factor", "reserved_memory", "precision", "prefetch_pipeline",
            "multipass_prefetch_config"))
    mp = f.opt("multipass_prefetch_config", dict)
    return CacheParams(
        algorithm=_enum_member(f, "algorithm", CacheAlgorithm),
        load_factor=f.opt("load_factor", float, lo=0.0),
        reserved_memory=f.opt("reserved_memory", float, lo=0.0),
        precision=_enum_member(f, "precision", DataType, by="value"),
        prefetch_pipeline=f.opt("prefetch_pipeline", bool),
        multipass_prefetch_config=None if mp is None else _built(f, "multipass_prefetch_config",
                                                                 MultiPassPrefetchConfig, **mp),
    )


def _kv_params_from_dict(f: Any) -> Any:
    from torchrec.distributed.types import KeyValueParams

    kwargs: Dict[str, Any] = {}
    for key, value in f.data.items():
        if key == "ps_hosts":
            hosts = f.values(key, list)
            for i, h in enumerate(hosts):
                if len(h) != 2 or not isinstance(h[0], str) or isinstance(h[1], bool) or not isinstance(h[1], int):
                    raise f.fail(key, f"host {i} must be [host, port], got {h!r}"[:200], "re-plan and store the plan again")
            kwargs[key] = tuple((h[0], h[1]) for h in hosts)
        elif key == "stats_reporter_config":
            cfg = f.obj(key)
            cls_name = cfg.req("class", str)
            module_name, _, qualname = cls_name.partition(":")
            if not module_name.startswith("fbgemm_gpu.") or not qualname:
                raise cfg.fail("class", f"{cls_name!r} is not an fbgemm config class",
                               "store a plan written by sparselift_plan_to_dict")
            cls: Any = _built(cfg, "class", importlib.import_module, module_name)
            for part in qualname.split("."):
                cls = _built(cfg, "class", getattr, cls, part)
            kwargs[key] = _built(cfg, "fields", cls, **cfg.req("fields", dict))
        elif key == "kvzch_tbe_config":
            from fbgemm_gpu.tbe.ssd import KVZCHTBEConfig

            cfg_d = dict(f.req(key, dict))
            if cfg_d.get("optimizer_state_dtypes_for_st") is not None:
                cfg_d["optimizer_state_dtypes_for_st"] = _built(
                    f, key, lambda v: frozenset((str(a), int(b)) for a, b in v), cfg_d["optimizer_state_dtypes_for_st"])
            kwargs[key] = _built(f, key, KVZCHTBEConfig, **cfg_d)
        else:
            kwargs[key] = value
    return _built(f, None, KeyValueParams, **kwargs)


def _sharding_spec_from_dict(f: Any) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    f.req("kind", str, choices=["enumerable"])
    shards = []
    for s in f.objs("shards"):
        s.only(("offsets", "sizes", "placement"))
        offsets = s.values("offsets", int, lo=0)
        sizes = s.values("sizes", int, lo=0, length=len(offsets))
        placement = s.opt("placement", str)
        shards.append(_built(s, None, ShardMetadata, shard_offsets=offsets, shard_sizes=sizes, placement=placement))
    return _built(f, "shards", EnumerableShardingSpec, shards)


def _param_sharding_from_dict(f: Any) -> Any:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec.distributed.types import ParameterSharding
    from torchrec.types import DataType

    f.only(_PS_FIELDS)
    spec = f.obj("sharding_spec", required=False)
    cache = f.obj("cache_params", required=False)
    kv = f.obj("key_value_params", required=False)
    return ParameterSharding(
        sharding_type=f.req("sharding_type", str),
        compute_kernel=f.req("compute_kernel", str),
        ranks=f.values("ranks", int, required=False, lo=0),
        sharding_spec=None if spec is None else _sharding_spec_from_dict(spec),
        cache_params=None if cache is None else _cache_params_from_dict(cache),
        enforce_hbm=f.opt("enforce_hbm", bool),
        stochastic_rounding=f.opt("stochastic_rounding", bool),
        bounds_check_mode=_enum_member(f, "bounds_check_mode", BoundsCheckMode),
        output_dtype=_enum_member(f, "output_dtype", DataType, by="value"),
        key_value_params=None if kv is None else _kv_params_from_dict(kv),
    )


def sharding_plan_from_dict(data: Mapping[str, Any], file: Optional[str] = None,
                            path: str = "sharding_plan") -> Any:
    """Rebuild the ``ShardingPlan`` written by :func:`sharding_plan_to_dict` (equal to the original).

    Raises :class:`~torchrec_sparselift.errors.PlanFormatError` (a ``FileFormatError``) on
    malformed input, naming the field path (``sharding_plan.modules["sparse.ebc"].params.t0.ranks[1]``)
    and ``file`` when given; no other exception type escapes for any JSON-like ``data``.
    """
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        ObjectPoolShardingPlan,
        ObjectPoolShardingType,
        ShardingPlan,
    )

    top = Fields(data, file=file, what="" if file is None else "execution plan", path=path, error=PlanFormatError)
    plan: Dict[str, Any] = {}
    for module_path, m in top.mapping("modules"):
        kind = m.req("kind", str, choices=["embedding", "object_pool"])
        if kind == "embedding":
            m.only(("kind", "params"))
            plan[module_path] = EmbeddingModuleShardingPlan(
                {name: _param_sharding_from_dict(ps) for name, ps in m.mapping("params")}
            )
        else:
            m.only(("kind", "sharding_type", "inference", "memory_capacity_per_rank"))
            plan[module_path] = ObjectPoolShardingPlan(
                sharding_type=ObjectPoolShardingType[
                    m.req("sharding_type", str, choices=list(ObjectPoolShardingType.__members__))],
                inference=m.req("inference", bool),
                memory_capacity_per_rank=m.values("memory_capacity_per_rank", int, required=False, lo=0),
            )
    return ShardingPlan(plan=plan)
