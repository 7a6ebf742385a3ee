"""runtime: apply a plan. ``lift`` / ``SparseLiftModelParallel`` build DistributedModelParallel with
the plan's comm codecs and the planned train pipeline; ``StepTimer`` measures steady-state step time
against the prediction; ``CommCounter`` counts the bytes and ids a step moves. A step's time by
sparse-path node kind (``StepAttribution``, saved and loaded here) is profiled by
``torchrec_sparselift.measure.attribution.attribute_steps``. ``TrainPipelineOverlap`` (pipeline
kind ``overlap``) is the package's own exact overlap of the sparse path's collectives with dense
work; ``TrainPipelineOverlapStale`` (kind ``overlap_stale``, opt-in) its one-step-stale schedule. CPU adaptations live in ``runtime.cpu_compat``; 2D (DMPCollection) in ``runtime.two_d``.
"""

from torchrec_sparselift.calibration.attribution import (
    RankAttribution,
    StepAttribution,
    load_attribution,
    save_attribution,
)
from torchrec_sparselift.runtime.comm_counter import CommCounter
from torchrec_sparselift.runtime.model_parallel import (
    Lifted,
    RuntimeSettings,
    SparseLiftModelParallel,
    build_optimizer,
    check_pipeline_supports_plan,
    comm_codecs_registry,
    copy_full_state,
    default_device,
    lift,
    resolve_settings,
    sharders_with_comm_codecs,
)
from torchrec_sparselift.runtime.overlap import TrainPipelineOverlap
from torchrec_sparselift.runtime.stale import TrainPipelineOverlapStale
from torchrec_sparselift.runtime.pipelines import (
    make_train_pipeline,
    pipeline_class,
)
from torchrec_sparselift.runtime.timing import (
    StepRecord,
    StepStats,
    StepTimer,
    load_records,
    save_records,
    step_stats,
)

__all__ = [
    "CommCounter",
    "RankAttribution",
    "StepAttribution",
    "load_attribution",
    "save_attribution",
    "Lifted",
    "RuntimeSettings",
    "SparseLiftModelParallel",
    "StepRecord",
    "StepStats",
    "StepTimer",
    "TrainPipelineOverlap",
    "TrainPipelineOverlapStale",
    "build_optimizer",
    "check_pipeline_supports_plan",
    "copy_full_state",
    "comm_codecs_registry",
    "default_device",
    "lift",
    "load_records",
    "make_train_pipeline",
    "pipeline_class",
    "resolve_settings",
    "save_records",
    "sharders_with_comm_codecs",
    "step_stats",
]
