"""Apply a plan: DistributedModelParallel with the plan's comm codecs, plus its train pipeline.

From a planner to a running loop::

    plan = SparseLiftPlanner(topology=topology, batch_size=batch_size).collective_plan(model, sharders, pg)
    model, pipeline = lift(model, plan, pg=pg, device=device,
                           embedding_optimizer=(torch.optim.SGD, {"lr": 0.1}),
                           dense_optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-3))
    for _ in range(steps):
        pipeline.progress(dataloader_iter)

``plan`` is either a TorchRec ``ShardingPlan`` (then the optimizations come from the keyword
arguments, default ``sparse_dist`` and fp32 comms) or an execution plan: any object with
``.sharding_plan`` and ``.optimizations`` (``pipeline``, ``fwd_comm_precision``,
``bwd_comm_precision``, ``sharding_group_size``, ``sync_interval``, ``id_dtype``,
``dedup_features``), such as
``torchrec_sparselift.plan.ExecutionPlan``. Explicit keyword arguments override the plan's choice.
The same code runs on CUDA (NCCL) and on CPU (gloo); the CPU adaptations live in
:mod:`torchrec_sparselift.runtime.cpu_compat`.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_sparselift import defaults, vocabulary
from torchrec_sparselift.vocabulary import COMM_PRECISIONS, PIPELINES, PIPELINES_2D
from torchrec_sparselift.semantics.tables import is_feature_processed
from torchrec_sparselift.runtime.batch_split import BATCH_SPLIT_PIPELINE
from torchrec_sparselift.runtime.pipelines import make_train_pipeline
from torchrec_sparselift.runtime.timing import StepTimer
from torchrec_sparselift.runtime.wire_ids import apply_wire_ids
from torchrec_sparselift.cost.wire_ids import ID_DTYPES, feature_tuple

__all__ = [
    "RuntimeSettings",
    "resolve_settings",
    "comm_codecs_registry",
    "sharders_with_comm_codecs",
    "default_device",
    "check_pipeline_supports_plan",
    "build_optimizer",
    "SparseLiftModelParallel",
    "Lifted",
    "lift",
    "copy_full_state",
]

logger = logging.getLogger(__name__)

EmbeddingOptimizerSpec = Tuple[Type[torch.optim.Optimizer], Mapping[str, Any]]
DenseOptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]


def _one_of(choices: Sequence[str]) -> Callable[[Any, "attrs.Attribute[Any]", Any], None]:
    def check(_: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name}={value!r} is not supported: use one of {', '.join(choices)}")

    return check


def _optional_positive_int(_: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{attribute.name} must be None or an int >= 1, got {value!r}")


def _optional_non_negative(_: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    if value is not None and not value >= 0:
        raise ValueError(f"{attribute.name} must be None or a time >= 0 in seconds, got {value!r}")


@attrs.frozen(kw_only=True)
class RuntimeSettings:
    """What the runtime applies: the plan's optimizations after keyword overrides.

    ``predicted_step_s`` is the plan's predicted steady-state step time (None for a bare
    ``ShardingPlan``); ``description`` is a one-line label for logs and measurement records.
    """

    pipeline: str = attrs.field(default=defaults.PIPELINE, validator=_one_of(PIPELINES))
    fwd_comm_precision: str = attrs.field(default=defaults.COMM_PRECISION, validator=_one_of(COMM_PRECISIONS))
    bwd_comm_precision: str = attrs.field(default=defaults.COMM_PRECISION, validator=_one_of(COMM_PRECISIONS))
    sharding_group_size: Optional[int] = attrs.field(default=None, validator=_optional_positive_int)
    sync_interval: Optional[int] = attrs.field(default=None, validator=_optional_positive_int)
    #: the plan's 2D rank layout (a ``Layout2D``; None for 1D or a bare ShardingPlan)
    layout_2d: Any = attrs.field(default=None)
    #: the plan's 2D strategy (``vocabulary.STRATEGIES_2D``; None for 1D)
    strategy_2d: Optional[str] = attrs.field(
        default=None, validator=attrs.validators.optional(_one_of(vocabulary.STRATEGIES_2D)))
    predicted_step_s: Optional[float] = attrs.field(default=None, validator=_optional_non_negative)
    description: str = attrs.field(default="")
    #: ids and lengths in the input all-to-all (:data:`torchrec_sparselift.cost.wire_ids.ID_DTYPES`)
    id_dtype: str = attrs.field(default="int64", validator=_one_of(ID_DTYPES))
    #: features whose ids the input all-to-all deduplicates (:mod:`.wire_ids`)
    dedup_features: Tuple[str, ...] = attrs.field(default=(), converter=feature_tuple)
    #: chunks of the overlap pipeline's all-to-alls (1: none; ``runtime.batch_split``)
    batch_split: int = attrs.field(default=1, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    #: the plan's per-sample declaration for its batch split (``Optimizations.per_sample``)
    per_sample: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.batch_split > 1 and (self.pipeline != BATCH_SPLIT_PIPELINE or self.is_2d):
            raise ValueError(
                f"batch_split={self.batch_split} splits the {BATCH_SPLIT_PIPELINE!r} pipeline's all-to-alls (1D), "
                f"but the settings run {self.pipeline!r}{' in 2D' if self.is_2d else ''}: choose pipeline "
                f"{BATCH_SPLIT_PIPELINE!r} or batch_split=1")

    @property
    def is_2d(self) -> bool:
        return self.sharding_group_size is not None

    def label(self) -> str:
        """``description`` if set, else the settings themselves in one line."""
        if self.description:
            return self.description
        sync = "fully_sharded" if self.strategy_2d == "fully_sharded" else f"sync {self.sync_interval}"
        two_d = f", 2D group {self.sharding_group_size}/{sync}" if self.is_2d else ""
        split = f" batch split {self.batch_split}" if self.batch_split > 1 else ""
        wire = "" if self.id_dtype == "int64" else f", ids {self.id_dtype}"
        wire += f", dedup {','.join(self.dedup_features)}" if self.dedup_features else ""
        return (f"pipeline={self.pipeline}{split}, comm={self.fwd_comm_precision}/{self.bwd_comm_precision}"
                f"{two_d}{wire}")


def resolve_settings(
    plan: Any,
    *,
    pipeline: Optional[str] = None,
    fwd_comm_precision: Optional[str] = None,
    bwd_comm_precision: Optional[str] = None,
    id_dtype: Optional[str] = None,
    dedup_features: Optional[Sequence[str]] = None,
    batch_split: Optional[int] = None,
) -> Tuple[ShardingPlan, RuntimeSettings]:
    """Split ``plan`` into the TorchRec ``ShardingPlan`` and the settings to apply.

    Promises: for a ``ShardingPlan``, settings from the keywords (defaults ``sparse_dist``, fp32,
    1D; ids on the wire ``int64``, no dedup); for an execution plan (duck-typed: ``.sharding_plan``
    and ``.optimizations``, optionally
    ``.prediction.step_time_s`` and ``.summary()``), the plan's optimizations with any non-None
    keyword taking precedence; a keyword that changes the plan's choice is logged and drops the
    plan's prediction and description (they describe another configuration). A 1D plan's
    ``sync_interval`` is dropped (it only means something for 2D), and so is its ``batch_split``
    where a ``pipeline`` keyword replaces the ``overlap`` pipeline it splits.
    """
    overrides = {
        "pipeline": pipeline,
        "fwd_comm_precision": fwd_comm_precision,
        "bwd_comm_precision": bwd_comm_precision,
        "id_dtype": id_dtype,
        "dedup_features": None if dedup_features is None else feature_tuple(dedup_features),
        "batch_split": batch_split,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(plan, ShardingPlan):
        return plan, RuntimeSettings(**given)
    if not (hasattr(plan, "sharding_plan") and hasattr(plan, "optimizations")):
        raise TypeError(
            f"plan must be a torchrec ShardingPlan or an execution plan with .sharding_plan and "
            f".optimizations (e.g. torchrec_sparselift.plan.ExecutionPlan), got {type(plan).__name__}"
        )
    sharding_plan = plan.sharding_plan
    if not isinstance(sharding_plan, ShardingPlan):
        raise TypeError(f"plan.sharding_plan must be a torchrec ShardingPlan, got {type(sharding_plan).__name__}")
    opt = plan.optimizations
    group = getattr(opt, "sharding_group_size", None)
    chosen = {
        "pipeline": getattr(opt, "pipeline", defaults.PIPELINE),
        "fwd_comm_precision": getattr(opt, "fwd_comm_precision", defaults.COMM_PRECISION),
        "bwd_comm_precision": getattr(opt, "bwd_comm_precision", defaults.COMM_PRECISION),
        "id_dtype": getattr(opt, "id_dtype", "int64"),
        "dedup_features": feature_tuple(getattr(opt, "dedup_features", ())),
        "batch_split": getattr(opt, "batch_split", 1),
    }
    changed = {k: v for k, v in given.items() if v != chosen[k]}
    for key, value in changed.items():
        logger.info(
            "sparselift: %s=%s overrides the plan's %s; the plan's step-time prediction no longer applies",
            key, value, chosen[key],
        )
    chosen.update(given)
    if "pipeline" in changed and "batch_split" not in given and chosen["pipeline"] != BATCH_SPLIT_PIPELINE:
        chosen["batch_split"] = 1  # the plan's chunks split the pipeline the keyword replaced
    # the plan's per-sample declaration holds for the model it planned, whatever the chunks
    per_sample = bool(getattr(opt, "per_sample", False)) and chosen["batch_split"] > 1
    prediction = getattr(plan, "prediction", None)
    summary = getattr(plan, "summary", None)
    return sharding_plan, RuntimeSettings(
        **chosen,
        per_sample=per_sample,
        sharding_group_size=group,
        sync_interval=getattr(opt, "sync_interval", None) if group is not None else None,
        layout_2d=getattr(opt, "layout_2d", None) if group is not None else None,
        strategy_2d=(getattr(opt, "strategy_2d", None) or "default") if group is not None else None,
        predicted_step_s=None if changed else getattr(prediction, "step_time_s", None),
        description="" if changed or not callable(summary) else summary(),
    )


def check_pipeline_supports_plan(kind: str, sharding_plan: ShardingPlan, device: Optional[torch.device] = None,
                                 module: Optional[nn.Module] = None) -> None:
    """Refuse plan/pipeline pairs that cannot train exactly; ``ValueError`` naming the tables or
    modules otherwise (the rule: :meth:`torchrec_sparselift.vocabulary.Pipeline.conflict`, which the
    search and the planner filter their pipelines by).

    The stale kinds (``semi_sync``, ``overlap_stale``) look up batch i+1 before step i's embedding
    update, so every table of a
    pipelined module must update inside its fused backward (TBE kernels ``fused*``/key-value).
    A ``dense`` kernel (which includes every data-parallel table) is updated in place after that
    lookup saved the weights for its backward, and autograd aborts the next backward ("modified
    by an inplace operation"); measured with TorchRec 1.8 on CPU/gloo.

    On a ``device`` with side streams (CUDA), a kind with ``lookup_before_dense_step`` (TorchRec's
    ``fused``) starts the next lookup on a stream that does not wait for the dense optimizer, so it
    also needs every looked-up weight updated in the fused backward: no dense-kernel tables and no
    feature processor in ``module`` (TorchRec: "this assumption is not true if there is feature
    processor(s)"). On CPU its order is the step's own and it trains them exactly.
    """
    if kind not in PIPELINES:
        return
    props = vocabulary.pipeline(kind)
    streams = device is not None and vocabulary.has_side_streams(device.type)
    if not props.can_conflict(streams):
        return  # no plan or module conflicts with it: skip the walks below
    dense = sorted(
        f"{path}.{name} ({ps.sharding_type})"
        for path, module_plan in sharding_plan.plan.items()
        if isinstance(module_plan, Mapping)
        for name, ps in module_plan.items()
        if getattr(ps, "compute_kernel", None) == "dense"
    )
    fp = [] if module is None else sorted(
        name or "(the model)" for name, m in module.named_modules() if is_feature_processed(type(m).__name__))
    why = props.conflict(bool(dense), streams, bool(fp))
    if why is vocabulary.PipelineConflict.DENSE_KERNEL:
        raise ValueError(
            f"pipeline {kind!r} needs fused embedding kernels, but {', '.join(dense)} use the dense kernel "
            "(data-parallel tables always do): shard those tables model-parallel with compute_kernel='fused', "
            "or choose pipeline 'fused' or 'sparse_dist'"
        )
    if why is vocabulary.PipelineConflict.DENSE_BEFORE_STEP:
        raise ValueError(
            f"pipeline {kind!r} on {device} looks up the next batch before the dense optimizer's step, but "
            f"{', '.join(dense)} use the dense kernel (data-parallel tables always do), which that step "
            "updates: choose pipeline 'sparse_dist', or shard those tables model-parallel with compute_kernel='fused'"
        )
    if why is vocabulary.PipelineConflict.FEATURE_PROCESSORS:
        raise ValueError(
            f"pipeline {kind!r} on {device} looks up the next batch before the dense optimizer's step, but "
            f"{', '.join(fp)} hold feature processors whose weights that step updates (TorchRec's "
            "TrainPipelineFusedSparseDist assumes none): choose pipeline 'sparse_dist'"
        )


def copy_full_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors into a sharded ``model``, shard by shard: each entry of
    ``model.state_dict()`` takes the ``state`` tensor whose key equals it or ends it after a dot
    (``"ebc.embedding_bags.t0.weight"`` fills ``"_dmp_wrapped_module.module.ebc..."``), each local
    shard (a 1D ``ShardedTensor``'s, or a ``DMPCollection`` ``DTensor``'s) its rows and columns of
    it. So 1D and 2D models of one module start from the same weights (then call a 2D model's
    ``install_replica_sync(model.replica_sync, ...)`` to re-anchor its merge). ``KeyError`` naming
    the key that matches no entry, or more than one."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            matches = [k for k in state if key == k or key.endswith("." + k)]
            if len(matches) != 1:
                raise KeyError(f"state key {key!r} of the model matches {len(matches)} of the given tensors "
                               f"({', '.join(matches[:3]) or 'none'}); give exactly one per model key")
            src = state[matches[0]]
            if hasattr(value, "local_shards"):  # ShardedTensor (1D)
                pieces = [(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
            elif hasattr(value, "to_local"):  # DTensor over LocalShardsWrapper (DMPCollection)
                local = value.to_local()
                pieces = list(zip(local.local_shards(), local.local_offsets()))
            else:
                value.copy_(src)
                continue
            for tensor, off in pieces:
                rows, cols = tensor.shape
                tensor.copy_(src[off[0]: off[0] + rows, off[1]: off[1] + cols])


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def comm_codecs_registry(
    fwd_comm_precision: str, bwd_comm_precision: str, device: torch.device
) -> Optional[Dict[str, Any]]:
    """TorchRec quantized-comm codecs for the pooled/sequence embedding all-to-alls and reduce-scatter.

    None for fp32/fp32 (no codec at all). How each precision runs on CPU (gloo) is declared once in
    :data:`torchrec_sparselift.vocabulary.COMM_PRECISION_REGISTRY` (measured): TorchRec replaces bf16
    with fp16 there and logs a warning; a precision that fails there (fp8) is refused.
    """
    for name, value in (("fwd_comm_precision", fwd_comm_precision), ("bwd_comm_precision", bwd_comm_precision)):
        if value not in COMM_PRECISIONS:
            raise ValueError(f"{name}={value!r} is not supported: use one of {', '.join(COMM_PRECISIONS)}")
        prec = vocabulary.comm_precision(value)
        if device.type == "cpu" and not prec.runs_on_cpu:
            raise ValueError(f"{name}={value!r} does not run on CPU: {prec.gloo_fails}; use fp16 or fp32 there")
    return get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType(fwd_comm_precision), backward_precision=CommType(bwd_comm_precision)),
        device=device,
    )


def sharders_with_comm_codecs(
    registry: Optional[Dict[str, Any]],
    sharders: Optional[Sequence[ModuleSharder[nn.Module]]] = None,
) -> Optional[List[ModuleSharder[nn.Module]]]:
    """Sharders that install ``registry`` (codecs from :func:`comm_codecs_registry`).

    Promises: with no codecs, ``sharders`` unchanged (None = TorchRec's defaults). With codecs and
    no sharders, TorchRec's default sharders with the embedding-bag, embedding and
    feature-processed sharders rebuilt with the codecs. With codecs and user sharders, the user's
    sharders as given, provided every embedding sharder already carries codecs; otherwise
    ``ValueError`` saying how to build them (a sharder's codecs are fixed at construction).
    """
    if registry is None:
        return None if sharders is None else list(sharders)
    if sharders is None:
        ebc = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
        replaced: Dict[Type[nn.Module], ModuleSharder[nn.Module]] = {
            EmbeddingBagCollection: ebc,
            EmbeddingCollection: EmbeddingCollectionSharder(qcomm_codecs_registry=registry),
        }
        fp = FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=ebc, qcomm_codecs_registry=registry)
        replaced[fp.module_type] = fp
        return [replaced.get(s.module_type, s) for s in get_default_sharders()]
    missing = [
        type(s).__name__
        for s in sharders
        if isinstance(s, (EmbeddingBagCollectionSharder, EmbeddingCollectionSharder))
        and not getattr(s, "qcomm_codecs_registry", None)
    ]
    if missing:
        raise ValueError(
            f"the plan chose quantized comms but sharders {missing} were built without codecs: build them "
            f"with qcomm_codecs_registry=comm_codecs_registry(fwd, bwd, device), or pass sharders=None"
        )
    return list(sharders)


def _embedding_modules(module: nn.Module) -> Iterator[nn.Module]:
    for sub in module.modules():
        if isinstance(sub, (EmbeddingBagCollection, EmbeddingCollection)):
            yield sub


def _apply_embedding_optimizer(module: nn.Module, spec: Optional[EmbeddingOptimizerSpec]) -> None:
    if spec is None:
        return
    optimizer_class, kwargs = spec
    params = [p for m in _embedding_modules(module) for p in m.parameters()]
    if not params:
        raise ValueError("embedding_optimizer was given but the model has no EmbeddingBagCollection/EmbeddingCollection")
    apply_optimizer_in_backward(optimizer_class, params, dict(kwargs))


class SparseLiftModelParallel(DistributedModelParallel):
    """``DistributedModelParallel`` built from a plan, with the plan's comm codecs installed.

    ``plan``: a ``ShardingPlan`` or an execution plan (see :func:`resolve_settings`); a 2D plan
    (``sharding_group_size`` set) needs ``DMPCollection``: use :func:`lift`.
    ``embedding_optimizer``: ``(optimizer class, kwargs)`` applied in backward
    (``apply_optimizer_in_backward``) to every embedding table before sharding, i.e. fused into
    TBE, and to the dense-kernel (e.g. data-parallel) tables (:func:`build_optimizer`); leave
    None if the model already has one. ``id_dtype`` / ``dedup_features`` override the plan's ids
    on the wire (:mod:`.wire_ids`). Other keywords go to ``DistributedModelParallel``.
    ``settings`` keeps what was applied; :meth:`train_pipeline` builds the planned pipeline.
    """

    def __init__(
        self,
        module: nn.Module,
        plan: Any,
        *,
        env: Optional[ShardingEnv] = None,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        sharders: Optional[Sequence[ModuleSharder[nn.Module]]] = None,
        pipeline: Optional[str] = None,
        fwd_comm_precision: Optional[str] = None,
        bwd_comm_precision: Optional[str] = None,
        embedding_optimizer: Optional[EmbeddingOptimizerSpec] = None,
        id_dtype: Optional[str] = None,
        dedup_features: Optional[Sequence[str]] = None,
        batch_split: Optional[int] = None,
        **dmp_kwargs: Any,
    ) -> None:
        sharding_plan, settings = resolve_settings(
            plan, pipeline=pipeline, fwd_comm_precision=fwd_comm_precision, bwd_comm_precision=bwd_comm_precision,
            id_dtype=id_dtype, dedup_features=dedup_features, batch_split=batch_split,
        )
        if settings.is_2d:
            raise ValueError(
                f"the plan is 2D (sharding_group_size={settings.sharding_group_size}): it needs DMPCollection, "
                "which SparseLiftModelParallel is not; call torchrec_sparselift.runtime.lift(...) instead"
            )
        device = device if device is not None else default_device()
        check_pipeline_supports_plan(settings.pipeline, sharding_plan, device, module)
        env = _resolve_env(env, pg)
        _apply_embedding_optimizer(module, embedding_optimizer)
        registry = comm_codecs_registry(settings.fwd_comm_precision, settings.bwd_comm_precision, device)
        super().__init__(
            module,
            env=env,
            device=device,
            plan=sharding_plan,
            sharders=sharders_with_comm_codecs(registry, sharders),
            **dmp_kwargs,
        )
        self.settings: RuntimeSettings = settings
        self.sharding_plan: ShardingPlan = sharding_plan
        self.embedding_optimizer: Optional[EmbeddingOptimizerSpec] = embedding_optimizer
        #: the model-parallel tables whose input all-to-all carries ids at ``settings.id_dtype``
        #: and deduplicates ``settings.dedup_features`` (:func:`.wire_ids.apply_wire_ids`)
        self.wire_ids_tables: List[str] = apply_wire_ids(self, settings.id_dtype, settings.dedup_features)
        logger.info("sparselift: DMP on %s applying %s", device, settings.label())

    def train_pipeline(
        self,
        *,
        dense_optimizer_factory: Optional[DenseOptimizerFactory] = None,
        kind: Optional[str] = None,
        options: Optional[Mapping[str, Any]] = None,
        batch_split: Optional[int] = None,
    ) -> Tuple[Any, KeyedOptimizer]:
        """The planned train pipeline over this model and the optimizer it steps.

        See :func:`build_optimizer` for ``dense_optimizer_factory``; ``kind`` overrides the
        planned pipeline (and then splits nothing unless ``batch_split`` says so); ``options`` go
        to the TorchRec pipeline constructor; ``batch_split`` overrides the planned chunks.
        """
        if batch_split is None:
            batch_split = self.settings.batch_split if kind is None else 1
        kind = kind or self.settings.pipeline
        if batch_split > 1 and self.settings.per_sample:  # the plan's declaration (Optimizations.per_sample)
            options = {"per_sample": True, **dict(options or {})}
        check_pipeline_supports_plan(kind, self.sharding_plan, self.device, self)
        optimizer = build_optimizer(self, dense_optimizer_factory, self.embedding_optimizer)
        pipeline = make_train_pipeline(kind, self, optimizer, self.device, options=options, batch_split=batch_split)
        return pipeline, optimizer


def _resolve_env(env: Optional[ShardingEnv], pg: Optional[dist.ProcessGroup]) -> ShardingEnv:
    if env is not None and pg is not None:
        raise ValueError("pass env or pg, not both")
    if env is not None:
        return env
    if pg is None:
        if not dist.is_initialized():
            raise RuntimeError("no process group: call torch.distributed.init_process_group first, or pass pg=/env=")
        pg = dist.GroupMember.WORLD
    return ShardingEnv.from_process_group(pg)


def _dense_kernel_tables(model: nn.Module) -> Dict[str, nn.Parameter]:
    """The embedding tables (or table shards) of ``model`` that no in-backward optimizer updates,
    under their ``model.named_parameters()`` names: TorchRec's dense-kernel tables, i.e. the
    data-parallel ones (gradients all-reduced) and any sharded with ``compute_kernel="dense"``. A
    rank's empty placeholder for a table it holds no shard of is left out (nothing to update)."""
    sharded_modules = [m for m in model.modules()
                       if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection))]
    ids = {id(p) for m in sharded_modules for p in m.parameters()
           if not hasattr(p, "_in_backward_optimizers") and p.dim() == 2 and p.numel() > 0}
    return {k: v for k, v in model.named_parameters() if id(v) in ids and v.requires_grad}


def build_optimizer(
    model: nn.Module,
    dense_optimizer_factory: Optional[DenseOptimizerFactory],
    embedding_optimizer: Optional[EmbeddingOptimizerSpec] = None,
) -> KeyedOptimizer:
    """The optimizer a train pipeline steps: fused (in-backward) embedding optimizer + dense one.

    With ``embedding_optimizer`` (the ``(class, kwargs)`` given to :func:`lift`), the tables no
    in-backward optimizer updates (TorchRec's dense kernel: data-parallel tables, and tables
    sharded with ``compute_kernel="dense"``) train with it too, a regular step on their gradient
    (a data-parallel table's all-reduced one is the sum over ranks, as a sharded table's), so a
    plan's choice of data-parallel does not change how a table learns
    (``tests/test_runtime_pipelines.py`` checks the losses equal table-wise ones). Without it (the
    embedding optimizer applied by the caller, as in TorchRec's examples) data-parallel tables are
    dense parameters.
    Dense parameters are every other parameter without an in-backward optimizer;
    ``dense_optimizer_factory(params)`` builds their optimizer; it is required whenever such
    parameters exist. The fused part's ``step()`` only pushes the learning rate into TBE (the
    update itself runs in backward).
    """
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense = {k: v for k, v in dense.items() if v.requires_grad}
    fused = getattr(model, "fused_optimizer", None)
    parts: List[Tuple[str, KeyedOptimizer]] = []
    if fused is not None and fused.params:
        parts.append(("embeddings", fused))
    if embedding_optimizer is not None:
        tables = {k: v for k, v in _dense_kernel_tables(model).items() if k in dense}
        if tables:
            cls, kwargs = embedding_optimizer
            parts.append(("dense_kernel_embeddings", KeyedOptimizerWrapper(
                tables, lambda params: cls(params, **dict(kwargs)))))
            dense = {k: v for k, v in dense.items() if k not in tables}
    if dense:
        if dense_optimizer_factory is None:
            names = ", ".join(sorted(dense)[:3]) + (", ..." if len(dense) > 3 else "")
            raise ValueError(
                f"the model has {len(dense)} dense parameters ({names}) but no dense_optimizer_factory: pass e.g. "
                "dense_optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-3)"
            )
        parts.append(("dense", KeyedOptimizerWrapper(dense, dense_optimizer_factory)))
    if not parts:
        raise ValueError("the model has no trainable parameters")
    return CombinedOptimizer(parts)


@attrs.frozen
class Lifted:
    """What :func:`lift` returns; unpacks as ``model, pipeline = lift(...)``.

    ``optimizer`` is the optimizer the pipeline steps (for LR schedules and checkpoints);
    ``settings`` what was applied; ``device`` where the model runs.
    """

    model: nn.Module
    pipeline: Any
    optimizer: KeyedOptimizer
    settings: RuntimeSettings
    device: torch.device

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.pipeline))

    def step_timer(self, warmup_steps: int = 5) -> StepTimer:
        """A :class:`StepTimer` on this device set to compare with the plan's predicted step time
        (a 2D plan's over whole sync intervals: ``period`` is its interval)."""
        return StepTimer(
            self.device,
            warmup_steps=warmup_steps,
            predicted_s=self.settings.predicted_step_s,
            plan=self.settings.label(),
            period=self.sync_period,
        )

    @property
    def sync_period(self) -> int:
        """Steps between two periodic replica syncs (1 where nothing syncs periodically): time
        whole multiples of it."""
        periodic = getattr(self.model, "periodic_sync", False)
        return int(self.settings.sync_interval or 1) if periodic and self.settings.is_2d else 1


def lift(
    module: nn.Module,
    plan: Any,
    *,
    env: Optional[ShardingEnv] = None,
    pg: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
    sharders: Optional[Sequence[ModuleSharder[nn.Module]]] = None,
    pipeline: Optional[str] = None,
    fwd_comm_precision: Optional[str] = None,
    bwd_comm_precision: Optional[str] = None,
    embedding_optimizer: Optional[EmbeddingOptimizerSpec] = None,
    dense_optimizer_factory: Optional[DenseOptimizerFactory] = None,
    pipeline_options: Optional[Mapping[str, Any]] = None,
    id_dtype: Optional[str] = None,
    dedup_features: Optional[Sequence[str]] = None,
    batch_split: Optional[int] = None,
    **dmp_kwargs: Any,
) -> Lifted:
    """Shard ``module`` per ``plan`` and return it with its planned train pipeline.

    1D plans build :class:`SparseLiftModelParallel`; 2D plans (``sharding_group_size`` set) are
    delegated to :mod:`torchrec_sparselift.runtime.two_d` (``DMPCollection``). ``pipeline`` /
    ``*_comm_precision`` override the plan (defaults for a bare ``ShardingPlan``: ``sparse_dist``,
    fp32). ``pipeline_options`` go to the TorchRec pipeline constructor (e.g.
    ``{"start_batch": 0}`` to make ``semi_sync`` stale from the first step, ``{"per_sample": True}``
    to declare a model per-sample for a batch split). ``batch_split`` overrides the plan's chunks
    (``Optimizations.batch_split``: the ``overlap`` pipeline's all-to-alls in k chunks).
    ``id_dtype`` / ``dedup_features`` override the plan's ids on the wire (1D plans only).
    """
    sharding_plan, settings = resolve_settings(
        plan, pipeline=pipeline, fwd_comm_precision=fwd_comm_precision, bwd_comm_precision=bwd_comm_precision,
        id_dtype=id_dtype, dedup_features=dedup_features, batch_split=batch_split,
    )
    if settings.is_2d:
        if settings.id_dtype != "int64" or settings.dedup_features:
            raise ValueError(
                f"the plan is 2D (sharding_group_size={settings.sharding_group_size}): ids on the wire "
                f"(id_dtype={settings.id_dtype!r}, dedup_features={list(settings.dedup_features)}) apply to 1D "
                "plans only; plan 1D or keep id_dtype='int64' and no dedup_features"
            )
        return _lift_2d(
            module,
            sharding_plan,
            settings,
            env=env,
            pg=pg,
            device=device,
            sharders=sharders,
            embedding_optimizer=embedding_optimizer,
            dense_optimizer_factory=dense_optimizer_factory,
            pipeline_options=pipeline_options,
            **dmp_kwargs,
        )
    model = SparseLiftModelParallel(
        module,
        plan,
        env=env,
        pg=pg,
        device=device,
        sharders=sharders,
        pipeline=pipeline,
        fwd_comm_precision=fwd_comm_precision,
        bwd_comm_precision=bwd_comm_precision,
        embedding_optimizer=embedding_optimizer,
        id_dtype=id_dtype,
        dedup_features=dedup_features,
        batch_split=batch_split,
        **dmp_kwargs,
    )
    train_pipeline, optimizer = model.train_pipeline(
        dense_optimizer_factory=dense_optimizer_factory, options=pipeline_options
    )
    return Lifted(model=model, pipeline=train_pipeline, optimizer=optimizer, settings=settings, device=model.device)


def _lift_2d(
    module: nn.Module,
    sharding_plan: ShardingPlan,
    settings: RuntimeSettings,
    *,
    env: Optional[ShardingEnv],
    pg: Optional[dist.ProcessGroup],
    device: Optional[torch.device],
    sharders: Optional[Sequence[ModuleSharder[nn.Module]]],
    embedding_optimizer: Optional[EmbeddingOptimizerSpec],
    dense_optimizer_factory: Optional[DenseOptimizerFactory],
    pipeline_options: Optional[Mapping[str, Any]],
    **two_d_kwargs: Any,
) -> Lifted:
    """2D: ``DMPCollection`` from :mod:`torchrec_sparselift.runtime.two_d`, then codecs, optimizer, pipeline."""
    try:
        two_d = importlib.import_module("torchrec_sparselift.runtime.two_d")
    except ModuleNotFoundError as exc:
        if exc.name != "torchrec_sparselift.runtime.two_d":
            raise
        two_d = None
    build = getattr(two_d, "build_2d_model_parallel", None)
    if build is None:
        raise NotImplementedError(
            f"the plan is 2D (sharding_group_size={settings.sharding_group_size}) but "
            "torchrec_sparselift.runtime.two_d.build_2d_model_parallel is not available in this version: "
            "plan 1D (sharding_group_size=None) or build DMPCollection yourself"
        )
    device = device if device is not None else default_device()
    check_pipeline_supports_plan(settings.pipeline, sharding_plan, device, module)
    global_pg = _resolve_env(env, pg).process_group
    _apply_embedding_optimizer(module, embedding_optimizer)
    registry = comm_codecs_registry(settings.fwd_comm_precision, settings.bwd_comm_precision, device)
    strategy = two_d_kwargs.pop("strategy", None) or settings.strategy_2d or "default"
    if strategy != (settings.strategy_2d or "default"):
        logger.warning("sparselift: 2D strategy %s overrides the plan's %s; the prediction assumed the other",
                       strategy, settings.strategy_2d)
    periodic = vocabulary.strategy_2d(strategy).periodic_sync
    sync_interval = settings.sync_interval or 1
    layout = settings.layout_2d
    if layout is not None:
        world = dist.get_world_size(global_pg)
        if layout.world_size != world or layout.group_size != settings.sharding_group_size:
            raise ValueError(
                f"the plan's 2D layout is for {layout.world_size} ranks in groups of {layout.group_size}, "
                f"but this job has {world} ranks; re-plan for this world size"
            )
        given = two_d_kwargs.setdefault("use_inter_host_allreduce", layout.use_inter_host_allreduce)
        if given != layout.use_inter_host_allreduce:
            logger.warning(
                "sparselift: use_inter_host_allreduce=%s overrides the plan's %s layout; the "
                "prediction assumed the other groups", given, layout.kind,
            )
    model = build(
        module,
        sharding_plan,
        settings.sharding_group_size,
        global_pg,
        device,
        sharders=sharders_with_comm_codecs(registry, sharders),
        sync_interval=sync_interval,
        strategy=strategy,
        **two_d_kwargs,
    )
    optimizer = build_optimizer(model, dense_optimizer_factory, embedding_optimizer)
    options = dict(pipeline_options or {})
    if not periodic and settings.pipeline in PIPELINES_2D:
        # fully_sharded averages the weights inside every step: the pipeline never calls sync()
        # (TorchRec's pipelines default to syncing every batch)
        options["dmp_collection_sync_interval_batches"] = None
    train_pipeline = make_train_pipeline(
        settings.pipeline, model, optimizer, device, sync_interval=sync_interval if periodic else None,
        options=options,
    )
    logger.info("sparselift: DMPCollection on %s applying %s", device, settings.label())
    return Lifted(model=model, pipeline=train_pipeline, optimizer=optimizer, settings=settings, device=device)
