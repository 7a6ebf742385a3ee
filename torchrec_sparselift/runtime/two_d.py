"""2D sparse parallelism at runtime: TorchRec's ``DMPCollection``, on GPUs and on CPU/gloo.

Vocabulary (used throughout): the world of ``W`` ranks is split into ``R = W / L`` *replicas*
(TorchRec: "parallel worlds"); each replica is a *sharding group* of ``L`` ranks over which
every table is sharded by an ordinary plan whose ranks are group-local (``0..L-1``). Ranks that
hold the same shard in different replicas form a *replica group*; a *replica sync* merges their
copies (weights and optimizer state) every ``sync_interval`` steps.

On CUDA/MTIA, :func:`build_2d_model_parallel` builds TorchRec's own ``DMPCollection`` (a thin
subclass that only adds the pluggable replica sync below). On CPU it builds
:class:`CpuDMPCollection`, which confines the two CPU adaptations to that one class:

1. ``DMPCollection.__init__`` asserts a CUDA/MTIA device. ``CpuDMPCollection.__init__`` performs
   the same construction steps (process groups from a device mesh, plan remapping, sharding via
   ``DistributedModelParallel``, caching of the sync tensors) through TorchRec's own methods,
   without that assertion.
2. ``DMPCollection._remap_sharding_plan`` writes shard placements ``rank:K/cpu:<K % local>``;
   ShardedTensor rejects them because CPU tensors live on ``cpu``, not ``cpu:N``.
   ``CpuDMPCollection._remap_sharding_plan`` rewrites them to ``rank:K/cpu``.

Nothing is patched into TorchRec globally; a CUDA run never touches this class.

The *strategy* (:data:`torchrec_sparselift.vocabulary.STRATEGY_2D_REGISTRY`) is TorchRec's
``ShardingStrategy``: ``default`` (replicas merged by ``sync()`` every ``sync_interval`` steps) or
``fully_sharded`` (TorchRec reduce-scatters the weights over the replica group after each lookup
and all-gathers them before the embedding backward; ``sync()`` is never called). TorchRec's
``fully_sharded`` kernels need CUDA streams, so on CPU it is refused with the measured reason.

The replica sync is pluggable: ``replica_sync=None`` keeps TorchRec's plain averaging
(all-reduce AVG of weights and row-wise accumulators); an object implementing
:class:`ReplicaSync` (e.g. ``torchrec_sparselift.optim.MomentumScaledRowWiseAdagrad``) replaces
it with its own merge over the :class:`RowWiseAdagradSlot` s of this rank.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Iterable, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed.remote_device import _remote_device

from torchrec_sparselift import vocabulary
from torchrec.distributed.model_parallel import (
    DataParallelWrapper,
    DistributedModelParallel,
    DMPCollection,
)
from torchrec.distributed.types import (
    DMPCollectionConfig,
    DMPCollectionContext,
    ModuleSharder,
    ShardingEnv2D,
    ShardingPlan,
    ShardingStrategy,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec_sparselift.optim import MomentumScaledRowWiseAdagrad

__all__ = [
    "TwoDConfig",
    "ModuleTwoD",
    "torchrec_strategy",
    "RowWiseAdagradSlot",
    "ReplicaSync",
    "ReplicaSyncSession",
    "SparseLiftDMPCollection",
    "CpuDMPCollection",
    "build_2d_model_parallel",
    "row_wise_adagrad_slots",
    "auto_replica_sync",
    "AUTO_REPLICA_SYNC",
    "MODULE_TYPES_2D",
    "replica_groups",
]


logger = logging.getLogger(__name__)

#: ``build_2d_model_parallel(replica_sync="auto")``: :func:`auto_replica_sync` decides.
AUTO_REPLICA_SYNC = "auto"

#: The module types :class:`ModuleTwoD` takes by name (any ``nn.Module`` class is taken as itself).
MODULE_TYPES_2D = {t.__name__: t for t in (EmbeddingBagCollection, EmbeddingCollection)}


def _module_type(value: Any) -> type:
    """``ModuleTwoD.module_type``: a module class, or the name of one in :data:`MODULE_TYPES_2D`."""
    if isinstance(value, str):
        if value not in MODULE_TYPES_2D:
            raise ValueError(f"ModuleTwoD: unknown module type {value!r}; valid names: {sorted(MODULE_TYPES_2D)} "
                             "(or pass the module class itself)")
        return MODULE_TYPES_2D[value]
    if not (isinstance(value, type) and issubclass(value, nn.Module)):
        raise ValueError(f"ModuleTwoD: module_type must be an nn.Module class or one of {sorted(MODULE_TYPES_2D)}, "
                         f"got {value!r} ({type(value).__name__})")
    return value


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}; pass a positive integer.")


@attrs.frozen
class TwoDConfig:
    """Shape of a 2D layout: ``world_size`` ranks in sharding groups of ``sharding_group_size``.

    ``sync_interval`` is the number of training steps between replica syncs (the
    ``dmp_collection_sync_interval_batches`` of TorchRec's train pipelines).
    """

    world_size: int = attrs.field(validator=_positive)
    sharding_group_size: int = attrs.field(validator=_positive)
    sync_interval: int = attrs.field(default=1, validator=_positive)
    use_inter_host_allreduce: bool = False

    def __attrs_post_init__(self) -> None:
        if self.world_size % self.sharding_group_size != 0:
            raise ValueError(
                f"sharding_group_size={self.sharding_group_size} must divide world_size="
                f"{self.world_size}; pick a divisor such as "
                f"{[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}."
            )

    @property
    def num_replicas(self) -> int:
        """R = world_size / sharding_group_size."""
        return self.world_size // self.sharding_group_size


def torchrec_strategy(name: str) -> ShardingStrategy:
    """TorchRec's ``ShardingStrategy`` for the 2D strategy ``name`` (``vocabulary.STRATEGIES_2D``)."""
    return ShardingStrategy[vocabulary.strategy_2d(name).torchrec_name]


def _strategy_name(strategy: ShardingStrategy) -> str:
    for s in vocabulary.STRATEGY_2D_REGISTRY:
        if s.torchrec_name == strategy.name:
            return s.name
    raise ValueError(f"ShardingStrategy.{strategy.name} is not a 2D strategy SparseLift runs; use one of "
                     f"{vocabulary.STRATEGIES_2D}")


def _check_strategy_runs(strategy: ShardingStrategy, device: torch.device) -> None:
    """Refuse a strategy TorchRec cannot run on ``device``, with the measured reason."""
    s = vocabulary.strategy_2d(_strategy_name(strategy))
    if device.type == "cpu" and not s.runs_on_cpu:
        raise ValueError(f"2D strategy {s.name!r} does not run on CPU: {s.not_on_cpu}; use strategy 'default' there")


@attrs.frozen
class ModuleTwoD:
    """Different 2D settings for the embedding modules of one type (TorchRec's
    ``DMPCollectionConfig``): ``module_type`` (a module class such as ``EmbeddingCollection``, or
    one of the names in :data:`MODULE_TYPES_2D`), its own group-local ``plan`` (a
    ``ShardingPlan``, ``{module path: module plan}`` of those modules only),
    ``sharding_group_size``, ``strategy`` and ``layout`` ("strided" or "contiguous"). The other
    modules keep the collection's settings. A value of the wrong type or an unknown name is a
    ``ValueError`` naming the module type and the valid values."""

    module_type: type = attrs.field(converter=lambda t: _module_type(t))
    plan: ShardingPlan = attrs.field(eq=False)
    sharding_group_size: int = attrs.field()
    strategy: str = attrs.field(default="default")
    layout: str = attrs.field(default="strided")

    def __attrs_post_init__(self) -> None:
        who = f"ModuleTwoD({self.module_type.__name__})"
        if not isinstance(self.plan, ShardingPlan):
            raise ValueError(f"{who}: plan must be a ShardingPlan (the group-local plan of the "
                             f"{self.module_type.__name__} modules), got {type(self.plan).__name__}")
        g = self.sharding_group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"{who}: sharding_group_size must be an integer >= 1, got {g!r}")
        for field, value, valid in (("strategy", self.strategy, vocabulary.STRATEGIES_2D),
                                    ("layout", self.layout, vocabulary.LAYOUTS_2D)):
            if not isinstance(value, str) or value not in valid:
                raise ValueError(f"{who}: unknown {field} {value!r}; valid: {list(valid)}")

    def to_torchrec(self) -> DMPCollectionConfig:
        return DMPCollectionConfig(
            module=self.module_type, plan=self.plan, sharding_group_size=self.sharding_group_size,
            use_inter_host_allreduce=self.layout == "contiguous", sharding_strategy=torchrec_strategy(self.strategy),
        )


def replica_groups(config: TwoDConfig) -> List[List[int]]:
    """Global ranks of each replica group (ranks holding the same shard), as DMPCollection builds them.

    With intra-host all-reduce (the default) sharding group ``g`` is ranks ``g, g+R, g+2R, ...``
    and replica group ``j`` is ranks ``j*R .. j*R+R-1``; with ``use_inter_host_allreduce`` the
    sharding groups are contiguous and the replica groups strided.
    """
    R, L = config.num_replicas, config.sharding_group_size
    if config.use_inter_host_allreduce:
        return [[shard + replica * L for replica in range(R)] for shard in range(L)]
    return [[shard * R + replica for replica in range(R)] for shard in range(L)]


@attrs.frozen(eq=False)
class RowWiseAdagradSlot:
    """One table's (or table shard's) local state under a fused exact row-wise AdaGrad.

    ``weight`` is a ``[rows, dim]`` view and ``accumulator`` a ``[rows]`` view into the fused
    kernel's storage (in-place writes reach the kernel). ``kernel`` is the fbgemm TBE module that
    owns them; the learning rate and eps are read from it at sync time so schedulers are honoured.
    """

    weight: torch.Tensor
    accumulator: torch.Tensor
    kernel: nn.Module

    def learning_rate(self) -> float:
        return float(self.kernel.get_learning_rate())

    def eps(self) -> float:
        return float(self.kernel.optimizer_args.eps)


@runtime_checkable
class ReplicaSyncSession(Protocol):
    """A replica sync bound to one rank's slots: ``sync()`` merges them across the replica group."""

    def sync(self) -> None: ...


@runtime_checkable
class ReplicaSync(Protocol):
    """A replica merge rule. ``bind`` is called once, after the replicas were made identical."""

    def bind(
        self,
        slots: Sequence[RowWiseAdagradSlot],
        replica_pg: dist.ProcessGroup,
        sync_interval: int,
    ) -> ReplicaSyncSession: ...


def _tbe_kernels(model: DMPCollection) -> Iterable[nn.Module]:
    """The fused TBE kernels DMPCollection syncs (found by TorchRec after sharding), in order."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    seen = set()
    for ctx in model._ctxs:
        for kernel, _ in ctx.modules_to_sync:
            if isinstance(kernel, SplitTableBatchedEmbeddingBagsCodegen) and id(kernel) not in seen:
                seen.add(id(kernel))
                yield kernel


def row_wise_adagrad_slots(model: DMPCollection) -> List[RowWiseAdagradSlot]:
    """Every fused TBE table that ``model`` syncs, as a :class:`RowWiseAdagradSlot`, in a rank-stable order.

    Raises ``ValueError`` if a fused kernel is not plain exact row-wise AdaGrad (the rule the
    row-aware merges are derived for).
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        OptimType,
        WeightDecayMode,
    )

    slots: List[RowWiseAdagradSlot] = []
    for kernel in _tbe_kernels(model):
        if kernel.optimizer != OptimType.EXACT_ROWWISE_ADAGRAD:
            raise ValueError(
                f"row-aware replica sync needs EXACT_ROWWISE_ADAGRAD tables, found {kernel.optimizer}; "
                'pass fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, ...} to the sharders.'
            )
        if WeightDecayMode(kernel.optimizer_args.weight_decay_mode) != WeightDecayMode.NONE:
            raise ValueError(
                "row-aware replica sync assumes no weight decay in the fused optimizer; "
                "drop weight_decay/weight_decay_mode from fused_params."
            )
        weights = kernel.split_embedding_weights()
        states = kernel.get_optimizer_state()
        for w, state in zip(weights, states):
            acc = state["sum"].view(-1)
            if acc.numel() != w.shape[0]:
                raise ValueError(
                    f"expected one accumulator per row ({w.shape[0]}), got {acc.numel()}"
                )
            slots.append(RowWiseAdagradSlot(weight=w, accumulator=acc, kernel=kernel))
    return slots


class SparseLiftDMPCollection(DMPCollection):
    """TorchRec's ``DMPCollection`` whose ``sync()`` can be replaced by a row-aware replica merge.

    Construction is TorchRec's (CUDA/MTIA only); see :class:`CpuDMPCollection` for CPU.
    Call :meth:`install_replica_sync` after construction (``build_2d_model_parallel`` does) and
    again after loading weights or a checkpoint, so the row-aware merge re-anchors on them.
    """

    _sparselift_sync: Optional[ReplicaSyncSession] = None
    _sparselift_rule: Optional[ReplicaSync] = None
    _sparselift_sync_interval: int = 1
    _sparselift_steps: int = 0

    def install_replica_sync(
        self, replica_sync: Optional[ReplicaSync], sync_interval: int = 1
    ) -> None:
        """Make replicas identical (plain average), then bind ``replica_sync`` (None: TorchRec's).

        A row-aware ``replica_sync`` merges one replica group: it needs the default strategy
        everywhere and no per-module contexts."""
        if replica_sync is not None and (
            self._submodule_ctxs or self._default_ctx.sharding_strategy != ShardingStrategy.DEFAULT
        ):
            raise ValueError(
                "a row-aware replica_sync replaces the periodic sync of one replica group: it needs "
                "strategy 'default' and no per-module 2D settings; pass replica_sync=None"
            )
        self._sparselift_sync_interval = sync_interval
        self._sparselift_steps = 0
        self._sparselift_rule = replica_sync
        DMPCollection.sync(self, include_optimizer_state=True)
        if replica_sync is None:
            self._sparselift_sync = None
            return
        slots = row_wise_adagrad_slots(self)
        self._sparselift_sync = replica_sync.bind(
            slots, self._default_ctx.replica_pg, sync_interval
        )

    @property
    def sync_interval(self) -> int:
        return self._sparselift_sync_interval

    @property
    def replica_sync(self) -> Optional[ReplicaSync]:
        """The installed row-aware merge (None: TorchRec's plain averaging); pass it to
        :meth:`install_replica_sync` again to re-anchor after loading weights."""
        return self._sparselift_rule

    def sync(self, include_optimizer_state: bool = True) -> None:
        """Merge the replicas now: the installed replica sync, or TorchRec's plain averaging."""
        if self._sparselift_sync is None:
            DMPCollection.sync(self, include_optimizer_state)
        else:
            self._sparselift_sync.sync()

    @property
    def periodic_sync(self) -> bool:
        """Whether ``sync()`` is what keeps the replicas in step (False under ``fully_sharded``,
        whose weights are averaged inside every step)."""
        return self._default_ctx.sharding_strategy != ShardingStrategy.FULLY_SHARDED

    def step_done(self) -> bool:
        """Count one finished training step; sync every ``sync_interval`` steps. Returns True if synced.

        For hand-written loops; TorchRec's pipelines call ``sync()`` themselves when given
        ``dmp_collection_sync_interval_batches``. Never syncs under ``fully_sharded``.
        """
        if not self.periodic_sync:
            return False
        self._sparselift_steps += 1
        if self._sparselift_steps % self._sparselift_sync_interval == 0:
            self.sync()
            return True
        return False


class CpuDMPCollection(SparseLiftDMPCollection):
    """``DMPCollection`` on CPU/gloo (tests and small experiments); see the module docstring.

    Supports the default context and per-module contexts (``submodule_configs``, TorchRec's
    ``DMPCollectionConfig``), ``ShardingStrategy.DEFAULT`` only (``FULLY_SHARDED``'s kernels need
    CUDA streams); no sharded relay, no custom all-reduce.
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        plan: ShardingPlan,
        world_size: int,
        sharding_group_size: int,
        global_pg: dist.ProcessGroup,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: Optional[DataParallelWrapper] = None,
        use_inter_host_allreduce: bool = False,
        sharding_strategy: ShardingStrategy = ShardingStrategy.DEFAULT,
        submodule_configs: Optional[List[DMPCollectionConfig]] = None,
    ) -> None:
        if device.type != "cpu":
            raise ValueError(
                f"CpuDMPCollection is for device 'cpu', got {device}; use build_2d_model_parallel, "
                "which builds TorchRec's DMPCollection on accelerators."
            )
        for strategy in [sharding_strategy] + [c.sharding_strategy for c in submodule_configs or []]:
            _check_strategy_runs(strategy, device)
        from torchrec.distributed.sharding_plan import get_default_sharders

        self._device = device
        self._pg = global_pg
        self._global_rank = dist.get_rank(global_pg)
        self._custom_all_reduce = None
        # TorchRec 1.9: DMPCollection.sync() also consults a process-group-aware hook
        # (set_all_reduce_hook); none here, as DMPCollection.__init__ leaves it
        self._all_reduce_hook = None
        self._use_sharded_relay = False
        self._sharded_relay_state = None
        sharders = sharders if sharders is not None else get_default_sharders()
        self._sharder_map = {sharder.module_type: sharder for sharder in sharders}
        self._default_ctx = DMPCollectionContext(
            module=None,  # type: ignore[arg-type]  (TorchRec's default context has no module type)
            plan=plan,
            sharding_group_size=sharding_group_size,
            node_group_size=None,
            use_inter_host_allreduce=use_inter_host_allreduce,
            sharding_strategy=sharding_strategy,
        )
        self._submodule_ctxs = [
            DMPCollectionContext(
                module=c.module,
                plan=c.plan,
                sharding_group_size=c.sharding_group_size,
                use_inter_host_allreduce=c.use_inter_host_allreduce,
                sharding_strategy=c.sharding_strategy,
            )
            for c in submodule_configs or []
        ]
        self._ctxs = [self._default_ctx] + self._submodule_ctxs
        for ctx in self._ctxs:
            ctx.device_mesh, ctx.sharding_pg, ctx.replica_pg = self._create_process_groups(
                global_rank=self._global_rank,
                world_size=world_size,
                local_size=ctx.sharding_group_size,
                use_inter_host_allreduce=ctx.use_inter_host_allreduce,
            )
            self._remap_sharding_plan(
                plan=ctx.plan,
                rank=self._global_rank,
                step=world_size // ctx.sharding_group_size,
                sharding_group_size=ctx.sharding_group_size,
                use_inter_host_allreduce=ctx.use_inter_host_allreduce,
            )
            if ctx.module:
                ctx.sharded_module = self._sharder_map[ctx.module].sharded_module_type
        ctx = self._default_ctx
        for sub in self._submodule_ctxs:
            ctx.plan.plan.update(sub.plan.plan)
        env = ShardingEnv2D(
            global_pg=global_pg,
            sharding_pg=ctx.sharding_pg,
            replica_pg=ctx.replica_pg,
            device_mesh=ctx.device_mesh,
            node_group_size=None,
            use_inter_host_allreduce=use_inter_host_allreduce,
            sharding_strategy=sharding_strategy,
        )
        DistributedModelParallel.__init__(
            self,
            module,
            env,
            device,
            ctx.plan,
            sharders,
            init_data_parallel,
            init_parameters,
            data_parallel_wrapper,
        )
        self._group_sharded_modules(self._ctxs)
        self._cache_sync_tensors(self._ctxs)

    def _remap_sharding_plan(
        self,
        plan: ShardingPlan,
        rank: int,
        step: int,
        sharding_group_size: int,
        use_inter_host_allreduce: bool = False,
    ) -> None:
        """TorchRec's remapping, then placements ``rank:K/cpu:N`` rewritten to ``rank:K/cpu``."""
        super()._remap_sharding_plan(
            plan, rank, step, sharding_group_size, use_inter_host_allreduce
        )
        for module_plan in plan.plan.values():
            for param_sharding in module_plan.values():  # type: ignore[attr-defined]
                spec = param_sharding.sharding_spec
                if isinstance(spec, EnumerableShardingSpec) and spec.shards is not None:
                    for shard in spec.shards:
                        shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")


def build_2d_model_parallel(
    module: nn.Module,
    plan: ShardingPlan,
    sharding_group_size: int,
    global_pg: dist.ProcessGroup,
    device: torch.device,
    sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
    sync_interval: int = 1,
    replica_sync: Union[ReplicaSync, None, str] = None,
    use_inter_host_allreduce: bool = False,
    init_data_parallel: bool = True,
    data_parallel_wrapper: Optional[DataParallelWrapper] = None,
    strategy: str = "default",
    submodule_configs: Optional[Sequence[ModuleTwoD]] = None,
) -> SparseLiftDMPCollection:
    """Shard ``module`` in 2D: tables over sharding groups of ``sharding_group_size`` ranks, replicated.

    ``plan`` must be made for a group-local topology (``world_size=sharding_group_size``), e.g.
    by a planner given ``Topology(world_size=sharding_group_size, ...)``; it is deep-copied (the
    remapping to global ranks is rank-specific). Returns a ``DMPCollection`` (TorchRec's on
    CUDA/MTIA, :class:`CpuDMPCollection` on CPU) whose replicas are already identical and whose
    ``sync()`` runs ``replica_sync``: None (the default) TorchRec's plain averaging of weights and
    accumulators; a :class:`ReplicaSync` such as ``optim.MomentumScaledRowWiseAdagrad()``; or
    ``"auto"`` (:func:`auto_replica_sync`), that merge wherever it applies and the averaging
    elsewhere. Call ``sync()`` every ``sync_interval`` steps, or ``step_done()`` after each.

    ``strategy`` is the 2D strategy (``vocabulary.STRATEGIES_2D``; "fully_sharded" not on CPU, and
    without ``replica_sync`` or sync calls); ``submodule_configs`` give the modules of some types
    their own plan, group size, strategy and layout (:class:`ModuleTwoD`).
    """
    world_size = dist.get_world_size(global_pg)
    config = TwoDConfig(
        world_size=world_size,
        sharding_group_size=sharding_group_size,
        sync_interval=sync_interval,
        use_inter_host_allreduce=use_inter_host_allreduce,
    )
    subs = []
    seen: List[type] = []
    present = {type(m) for m in module.modules()}
    for i, sub in enumerate(submodule_configs or ()):
        if not isinstance(sub, ModuleTwoD):
            raise ValueError(f"submodule_configs[{i}]: takes ModuleTwoD values (ModuleTwoD(EmbeddingCollection, "
                             f"plan, sharding_group_size=...)), got {type(sub).__name__}")
        name = sub.module_type.__name__
        if sub.module_type in seen:
            raise ValueError(f"submodule_configs[{i}]: module type {name} is configured twice; give each type once")
        seen.append(sub.module_type)
        if sub.module_type not in present:
            kinds = sorted({t.__name__ for t in present if t in MODULE_TYPES_2D.values()})
            raise ValueError(f"submodule_configs[{i}]: the model has no {name} module (its embedding module "
                             f"types: {kinds}); configure one of those")
        try:
            TwoDConfig(world_size=world_size, sharding_group_size=sub.sharding_group_size)
        except ValueError as e:
            raise ValueError(f"submodule_configs[{i}] ({name}): {e}") from None
        _check_2d_plan(sub.plan, sub.sharding_group_size)
        subs.append(attrs.evolve(sub, plan=copy.deepcopy(sub.plan)).to_torchrec())
    if isinstance(replica_sync, str):
        if replica_sync != AUTO_REPLICA_SYNC:
            raise ValueError(f"replica_sync={replica_sync!r}: pass None (TorchRec's plain averaging, the default), "
                             f"{AUTO_REPLICA_SYNC!r} or a ReplicaSync such as MomentumScaledRowWiseAdagrad()")
    elif replica_sync is not None and not isinstance(replica_sync, ReplicaSync):
        raise TypeError(
            f"replica_sync must implement bind(slots, replica_pg, sync_interval), got {type(replica_sync).__name__}; "
            "use e.g. torchrec_sparselift.optim.MomentumScaledRowWiseAdagrad()."
        )
    _check_2d_plan(plan, sharding_group_size)
    sharding_strategy = torchrec_strategy(strategy)
    _check_strategy_runs(sharding_strategy, device)
    plan = copy.deepcopy(plan)
    kwargs = dict(
        module=module,
        device=device,
        plan=plan,
        world_size=config.world_size,
        sharding_group_size=config.sharding_group_size,
        global_pg=global_pg,
        sharders=sharders,
        init_data_parallel=init_data_parallel,
        data_parallel_wrapper=data_parallel_wrapper,
        use_inter_host_allreduce=config.use_inter_host_allreduce,
        sharding_strategy=sharding_strategy,
        submodule_configs=subs or None,
    )
    if device.type == "cpu":
        model: SparseLiftDMPCollection = CpuDMPCollection(**kwargs)
    else:
        model = SparseLiftDMPCollection(**kwargs)
    if isinstance(replica_sync, str):
        replica_sync, why = auto_replica_sync(model)
        if replica_sync is None:
            logger.info("sparselift: 2D replicas merge by TorchRec's plain averaging: %s", why)
    model.install_replica_sync(replica_sync, config.sync_interval)
    return model


def auto_replica_sync(model: SparseLiftDMPCollection) -> Tuple[Optional[ReplicaSync], str]:
    """The replica sync ``build_2d_model_parallel(replica_sync="auto")`` installs: ``(rule, "")`` with
    ``MomentumScaledRowWiseAdagrad()`` (docs/optimizer.md: merging after every step it reproduces
    1D row-wise AdaGrad, which plain averaging does not) where it applies,
    i.e. strategy ``default``, one 2D context, and every synced table a fused exact row-wise
    AdaGrad kernel without weight decay (:func:`row_wise_adagrad_slots`); else ``(None, why)``:
    TorchRec's plain averaging, and the reason."""
    if model._submodule_ctxs:
        return None, "per-module 2D settings (submodule_configs): the row-aware merge handles one context"
    if model._default_ctx.sharding_strategy != ShardingStrategy.DEFAULT:
        return None, "strategy fully_sharded averages inside every step"
    try:
        slots = row_wise_adagrad_slots(model)
    except ValueError as e:  # the tables' optimizer is not the one the merge is derived for
        return None, str(e)
    if not slots:
        return None, "no fused table to merge"
    return MomentumScaledRowWiseAdagrad(), ""


def _check_2d_plan(plan: ShardingPlan, sharding_group_size: int) -> None:
    """Refuse plans DMPCollection would run wrongly: ranks outside the group, unsynced kernels.

    A model-parallel table on the ``dense`` compute kernel is updated by the dense optimizer but
    is neither all-reduced by DDP nor synced by ``DMPCollection.sync`` (which syncs fused TBEs
    only): its replicas would silently drift apart.
    """
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.types import ShardingType

    for module_path, module_plan in plan.plan.items():
        for name, param_sharding in module_plan.items():  # type: ignore[attr-defined]
            if (
                param_sharding.compute_kernel == EmbeddingComputeKernel.DENSE.value
                and param_sharding.sharding_type != ShardingType.DATA_PARALLEL.value
            ):
                raise ValueError(
                    f"{module_path}.{name} is {param_sharding.sharding_type} on the 'dense' compute "
                    "kernel, which DMPCollection never syncs across replicas; plan it with "
                    "compute_kernel='fused' (EmbeddingComputeKernel.FUSED)."
                )
            for r in param_sharding.ranks or []:
                if not 0 <= r < sharding_group_size:
                    raise ValueError(
                        f"plan places {module_path}.{name} on rank {r}, outside the sharding group "
                        f"0..{sharding_group_size - 1}; plan with a group-local topology "
                        f"(Topology(world_size={sharding_group_size}, ...))."
                    )
