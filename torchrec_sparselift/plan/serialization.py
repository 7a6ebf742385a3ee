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
``ValueError`` naming the module, parameter and field, rather than silently dropping it. One
deliberate exception: ``CacheParams.stats`` (a user ``CacheStatistics`` object that TorchRec's planner
reads to size caches and the sharded modules never read) is not written; it reads back as ``None``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Dict, List, Mapping, Optional

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


def _opt(d: Mapping[str, Any], key: str) -> Any:
    return d.get(key)


def _cache_params_from_dict(d: Mapping[str, Any]) -> Any:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, MultiPassPrefetchConfig
    from torchrec.distributed.types import CacheParams
    from torchrec.types import DataType

    mp = d.get("multipass_prefetch_config")
    return CacheParams(
        algorithm=None if d.get("algorithm") is None else CacheAlgorithm[d["algorithm"]],
        load_factor=_opt(d, "load_factor"),
        reserved_memory=_opt(d, "reserved_memory"),
        precision=None if d.get("precision") is None else DataType(d["precision"]),
        prefetch_pipeline=_opt(d, "prefetch_pipeline"),
        multipass_prefetch_config=None if mp is None else MultiPassPrefetchConfig(**mp),
    )


def _kv_params_from_dict(d: Mapping[str, Any]) -> Any:
    from torchrec.distributed.types import KeyValueParams

    kwargs: Dict[str, Any] = {}
    for key, value in d.items():
        if key == "ps_hosts":
            kwargs[key] = tuple((str(h), int(p)) for h, p in value)
        elif key == "stats_reporter_config":
            module_name, qualname = value["class"].split(":", 1)
            if not module_name.startswith("fbgemm_gpu."):
                raise ValueError(f"stats_reporter_config class {value['class']!r} is not an fbgemm config")
            cls: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            kwargs[key] = cls(**value["fields"])
        elif key == "kvzch_tbe_config":
            from fbgemm_gpu.tbe.ssd import KVZCHTBEConfig

            cfg = dict(value)
            if cfg.get("optimizer_state_dtypes_for_st") is not None:
                cfg["optimizer_state_dtypes_for_st"] = frozenset(
                    (str(a), int(b)) for a, b in cfg["optimizer_state_dtypes_for_st"]
                )
            kwargs[key] = KVZCHTBEConfig(**cfg)
        else:
            kwargs[key] = value
    return KeyValueParams(**kwargs)


def _param_sharding_from_dict(d: Mapping[str, Any]) -> Any:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torchrec.distributed.types import ParameterSharding
    from torchrec.types import DataType

    unknown = set(d) - set(_PS_FIELDS)
    if unknown:
        raise ValueError(f"unknown ParameterSharding fields {sorted(unknown)}")
    spec = d.get("sharding_spec")
    sharding_spec = None
    if spec is not None:
        if spec.get("kind") != "enumerable":
            raise ValueError(f"unknown sharding_spec kind {spec.get('kind')!r}")
        sharding_spec = EnumerableShardingSpec(
            [
                ShardMetadata(
                    shard_offsets=[int(x) for x in s["offsets"]],
                    shard_sizes=[int(x) for x in s["sizes"]],
                    placement=s["placement"],
                )
                for s in spec["shards"]
            ]
        )
    ranks: Optional[List[int]] = d.get("ranks")
    return ParameterSharding(
        sharding_type=d["sharding_type"],
        compute_kernel=d["compute_kernel"],
        ranks=None if ranks is None else [int(r) for r in ranks],
        sharding_spec=sharding_spec,
        cache_params=None if d.get("cache_params") is None else _cache_params_from_dict(d["cache_params"]),
        enforce_hbm=d.get("enforce_hbm"),
        stochastic_rounding=d.get("stochastic_rounding"),
        bounds_check_mode=None if d.get("bounds_check_mode") is None else BoundsCheckMode[d["bounds_check_mode"]],
        output_dtype=None if d.get("output_dtype") is None else DataType(d["output_dtype"]),
        key_value_params=None if d.get("key_value_params") is None else _kv_params_from_dict(d["key_value_params"]),
    )


def sharding_plan_from_dict(data: Mapping[str, Any]) -> Any:
    """Rebuild the ``ShardingPlan`` written by :func:`sharding_plan_to_dict` (equal to the original).

    Raises ``ValueError``/``KeyError``/``TypeError`` on malformed input (callers that must not
    crash, like the plan cache, catch them and re-plan).
    """
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        ObjectPoolShardingPlan,
        ObjectPoolShardingType,
        ShardingPlan,
    )

    plan: Dict[str, Any] = {}
    for module_path, m in data["modules"].items():
        kind = m.get("kind")
        if kind == "embedding":
            plan[module_path] = EmbeddingModuleShardingPlan(
                {name: _param_sharding_from_dict(ps) for name, ps in m["params"].items()}
            )
        elif kind == "object_pool":
            plan[module_path] = ObjectPoolShardingPlan(
                sharding_type=ObjectPoolShardingType[m["sharding_type"]],
                inference=bool(m["inference"]),
                memory_capacity_per_rank=m.get("memory_capacity_per_rank"),
            )
        else:
            raise ValueError(f"module {module_path!r}: unknown module plan kind {kind!r}")
    return ShardingPlan(plan=plan)
