"""TorchRec's DLRM / DLRM-DCN over a table set, its planner, and its sharding.

:func:`build_model` builds ``DLRMTrain`` on the meta device; :func:`make_planner` builds the chosen
planner with ``EmbeddingShardingPlanner``'s arguments (the one-word swap); :func:`shard_model`
wraps the model in ``DistributedModelParallel`` under a plan with one optimizer over everything
trainable. The run (:mod:`torchrec_sparselift.dlrm.run`), the benchmarks and the tests build
their models here.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import attrs
import torch
from torchrec.datasets.criteo import INT_FEATURE_COUNT
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.calibration.store import auto_profile_link
from torchrec_sparselift.calibration.term_error import profile_on_link
from torchrec_sparselift.cost.hardware import get_profile
from torchrec_sparselift.defaults import STRATEGY_2D as DEFAULT_STRATEGY_2D
from torchrec_sparselift.dlrm.options import UsageError
from torchrec_sparselift.dlrm.tables import ConstraintSpec, TableSpec
from torchrec_sparselift.measure.probe import shard_for_training
from torchrec_sparselift.vocabulary import COMPUTE_KERNELS, SHARDING_TYPES

__all__ = [
    "ArchSpec",
    "arch_spec",
    "build_model",
    "embedding_bags",
    "planner_constraints",
    "hardware_choice",
    "hardware_name",
    "check_hardware",
    "make_planner",
    "topology_for",
    "shard_model",
    "dense_optimizer_class",
    "plan_summary",
    "format_plan_summary",
    "execution_plan_prediction",
]


@attrs.frozen
class ArchSpec:
    """Dense layer sizes of the model: ``dense`` ends at the embedding dim, ``over`` at 1."""

    dense: List[int]
    over: List[int]
    dcn_layers: int
    dcn_rank: int


def arch_spec(name: str, dim: int) -> ArchSpec:
    """``mlperf``: the MLPerf DLRM-DCNv2 sizes (DESIGN.md section 3); ``small``: a CPU-sized net."""
    if name == "mlperf":
        return ArchSpec(dense=[512, 256, dim], over=[1024, 1024, 512, 256, 1], dcn_layers=3, dcn_rank=512)
    if name == "small":
        return ArchSpec(dense=[64, dim], over=[128, 64, 1], dcn_layers=2, dcn_rank=32)
    raise UsageError(f"unknown --arch {name!r}: use mlperf or small")


def embedding_bags(tables: Sequence[TableSpec]) -> EmbeddingBagCollection:
    """The tables as one EmbeddingBagCollection on the meta device."""
    configs = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.features))
        for t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def build_model(tables: Sequence[TableSpec], model_kind: str, arch: ArchSpec) -> DLRMTrain:
    """DLRMTrain(DLRM or DLRM_DCN) with its EmbeddingBagCollection on the meta device."""
    common = dict(
        embedding_bag_collection=embedding_bags(tables),
        dense_in_features=INT_FEATURE_COUNT,
        dense_arch_layer_sizes=arch.dense,
        over_arch_layer_sizes=arch.over,
    )
    if model_kind == "dcn":
        dlrm = DLRM_DCN(**common, dcn_num_layers=arch.dcn_layers, dcn_low_rank_dim=arch.dcn_rank)
    else:
        dlrm = DLRM(**common)
    return DLRMTrain(dlrm)


def planner_constraints(
    tables: Sequence[TableSpec], specs: Sequence[ConstraintSpec], one_hot: bool = False
) -> Dict[str, Any]:
    """TorchRec ``ParameterConstraints`` per table: every table's pooling factor (1 when
    ``one_hot``, e.g. Criteo files), plus what ``specs`` force. Raises UsageError for a sharding
    type or compute kernel TorchRec does not know."""
    known_types = list(SHARDING_TYPES)
    known_kernels = list(COMPUTE_KERNELS)
    by_table = {s.table: s for s in specs}
    out = {}
    for t in tables:
        # --constraints overrides what the table file says about the table
        spec = by_table.get(t.name) or ConstraintSpec(
            table=t.name, sharding_types=t.sharding_types, compute_kernels=t.compute_kernels,
            min_partition=t.min_partition)
        for value in spec.sharding_types or ():
            if value not in known_types:
                raise UsageError(f"--constraints: table {t.name!r}: unknown sharding type {value!r}; use one of {known_types}")
        for value in spec.compute_kernels or ():
            if value not in known_kernels:
                raise UsageError(f"--constraints: table {t.name!r}: unknown compute kernel {value!r}; use one of {known_kernels}")
        out[t.name] = ParameterConstraints(
            sharding_types=list(spec.sharding_types) if spec.sharding_types else None,
            compute_kernels=list(spec.compute_kernels) if spec.compute_kernels else None,
            min_partition=spec.min_partition,
            pooling_factors=[1.0 if one_hot else float(b) for b in t.bag_sizes()],
        )
    return out


def hardware_choice(flag: str, device_type: str, ranks: int = 1, say: Callable[[str], None] = print,
                    cores: Optional[int] = None, link: Any = None):
    """What ``--hardware`` hands the planner: a preset name or profile path; for ``auto``, this
    machine's profile fitted from real steps (``sparselift`` step calibration, stored per machine
    fingerprint in ~/.cache/torchrec_sparselift/profiles) as a HardwareProfile; without one, the
    closest stored profile or the committed CPU profile, with a line naming what differs; on GPU
    None (the planner picks a preset from the topology). ``cores``: the cores this process could use
    before pinning its ranks (the machine's fingerprint). ``link``: the ``LinkRates`` this job
    measured (``auto`` on CPU): compared with the link the stored profile was calibrated on; where
    they differ beyond the measured spread, a warning names each term and the profile's link terms
    are corrected (``calibration.term_error.profile_on_link``, as the planner's ``hardware="auto"``).

    Returns ``(hardware, model_errors)``: ``model_errors`` is the never-slower rule's error per term
    for a corrected profile (the stored step fit's, the corrected link terms' at least the link
    measurement's spread), None otherwise (the planner finds a stored profile's own)."""
    if flag != "auto":
        return flag, None
    if device_type != "cpu":
        return None, None
    profile, where, stored = auto_profile_link("cpu", ranks, warn=lambda m: say(f"[dlrm] warning: {m}"),
                                               cores=cores, hosts=link.hosts if link is not None else 1)
    if link is None:
        return profile, None
    on = profile_on_link(profile, stored, link, where)
    if on.note is not None:
        say(f"[dlrm] warning: sparselift: {on.note}")
    return on.profile, (on.errors if on.corrected and on.errors.measured else None)


def hardware_name(hardware: Any) -> Optional[str]:
    """A JSON-able name for what :func:`hardware_choice` returned."""
    return hardware if hardware is None or isinstance(hardware, str) else getattr(hardware, "name", str(hardware))


def check_hardware(name: str):
    """The HardwareProfile ``--hardware name`` names (preset or profile JSON); UsageError if none."""
    try:
        return get_profile(name)
    except (ValueError, OSError) as e:
        raise UsageError(f"--hardware {name}: {e}") from e


def topology_for(world_size: int, local_world_size: int, compute_device: str) -> Topology:
    """TorchRec's Topology of ``world_size`` ranks, ``local_world_size`` per host (its warning that
    TopologyFactory is preferred silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Topology(world_size=world_size, local_world_size=local_world_size, compute_device=compute_device)


def make_planner(
    name: str,
    world_size: int,
    local_world_size: int,
    compute_device: str,
    batch_size: int,
    constraints: Optional[Dict[str, Any]] = None,
    *,
    hardware: Any = None,
    cache_dir: Optional[str] = None,
    allow_lossy_comm: bool = False,
    allow_staleness: bool = False,
    workload: Any = None,
    sharding_group_size: Any = None,
    strategy_2d: str = DEFAULT_STRATEGY_2D,
    sync_interval: Optional[int] = None,
    model_errors: Any = None,
    per_sample: bool = False,
):
    """The planner ``name`` built with EmbeddingShardingPlanner's arguments (the one-word swap);
    SparseLift also gets ``hardware`` (preset name, profile JSON or HardwareProfile), ``cache_dir``
    (execution plan reuse), ``allow_lossy_comm``, ``allow_staleness``, ``workload`` (the ids'
    ``WorkloadStats``), ``model_errors`` (the never-slower rule's errors of a link-corrected
    profile) and ``per_sample`` (the dense model declared per-sample: the planner may batch-split it)."""
    topology = topology_for(world_size, local_world_size, compute_device)
    if name == "torchrec":
        return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    profile = check_hardware(hardware) if isinstance(hardware, str) else hardware
    return SparseLiftPlanner(
        topology=topology, batch_size=batch_size, constraints=constraints, hardware=profile, cache_dir=cache_dir,
        allow_lossy_comm=allow_lossy_comm, allow_staleness=allow_staleness, workload=workload,
        sharding_group_size=sharding_group_size, strategy_2d=strategy_2d, sync_interval=sync_interval,
        model_errors=model_errors, **({"per_sample": True} if per_sample else {}))


def shard_model(model, plan, device, lr: float, dense_optimizer: str, dense_lr: float):
    """DistributedModelParallel(model) under ``plan`` plus one optimizer over everything trainable:
    row-wise AdaGrad for every table (fused in backward; data-parallel tables, which lose the
    in-backward marker when sharded, after their all-reduce, as ``lift`` does), ``dense_optimizer``
    for the rest (``measure.probe.shard_for_training``, as the calibration's probes shard)."""
    opt_cls = dense_optimizer_class(dense_optimizer)
    return shard_for_training(model, plan, device, lr=lr,
                              dense_optimizer_factory=lambda params: opt_cls(params, lr=dense_lr))


def dense_optimizer_class(name: str):
    """``--dense-optimizer``'s torch optimizer class."""
    return torch.optim.Adagrad if name == "adagrad" else torch.optim.SGD


def plan_summary(plan) -> List[Dict[str, Any]]:
    """One row per table of ``plan``: module, table, sharding type, compute kernel, ranks."""
    rows = []
    for module_path, module_plan in sorted(plan.plan.items()):
        for table, ps in sorted(module_plan.items()):
            rows.append(
                dict(
                    module=module_path,
                    table=table,
                    sharding_type=ps.sharding_type,
                    compute_kernel=ps.compute_kernel,
                    ranks=sorted(set(ps.ranks)) if ps.ranks is not None else [],
                )
            )
    return rows


def execution_plan_prediction(ep, settings) -> Dict[str, Any]:
    """What the execution plan ``ep`` predicts, and whether it applies to what runs: it does not
    when an override (``--pipeline``) changed the plan's choice (``settings.predicted_step_s``
    is then None)."""
    o, p = ep.optimizations, ep.prediction
    return dict(
        step_time_ms=p.step_time_s * 1e3,
        lower_bound_ms=p.lower_bound_s * 1e3,
        pipeline=o.pipeline,
        comm_precision=f"{o.fwd_comm_precision}/{o.bwd_comm_precision}",
        solver=ep.planner_info.get("solver"),
        hardware=ep.planner_info.get("hardware"),
        applies=settings.predicted_step_s is not None,
        summary=ep.summary(),
    )


def format_plan_summary(rows: Sequence[Dict[str, Any]], tables: Sequence[TableSpec]) -> str:
    """The plan as a table, one line per embedding table in the order of ``tables``."""
    size = {t.name: (t.rows, t.dim) for t in tables}
    order = {t.name: i for i, t in enumerate(tables)}
    lines = [f"{'table':<14}{'rows':>10}{'dim':>5}  {'sharding':<16}{'kernel':<14}ranks"]
    for r in sorted(rows, key=lambda r: (order.get(r["table"], len(order)), r["table"])):
        rows_, dim = size.get(r["table"], ("?", "?"))
        ranks = ",".join(map(str, r["ranks"])) if r["ranks"] else "all"
        lines.append(f"{r['table']:<14}{rows_:>10}{dim:>5}  {r['sharding_type']:<16}{r['compute_kernel']:<14}{ranks}")
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["sharding_type"]] = counts.get(r["sharding_type"], 0) + 1
    lines.append("sharding types: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)
