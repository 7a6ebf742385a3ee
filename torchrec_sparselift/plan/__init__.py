"""plan: the plan request (everything a plan is asked for), the execution plan (sharding plan +
optimizations + prediction + fingerprint), its JSON form, and the on-disk cache that reuses it
across runs."""

from torchrec_sparselift.plan.cache import PlanCache
from torchrec_sparselift.plan.execution_plan import (
    COMM_PRECISIONS,
    EXECUTION_PLAN_SCHEMA,
    PIPELINES,
    ExecutionPlan,
    Fingerprint,
    Optimizations,
    PlanFormatError,
    Prediction,
    RankPrediction,
    Versions,
    fingerprint_inputs,
    sharding_plan_digest,
    table_specs,
)
from torchrec_sparselift.plan.request import PlanRequest
from torchrec_sparselift.plan.serialization import sharding_plan_from_dict, sharding_plan_to_dict

__all__ = [
    "COMM_PRECISIONS",
    "EXECUTION_PLAN_SCHEMA",
    "PIPELINES",
    "ExecutionPlan",
    "Fingerprint",
    "Optimizations",
    "PlanCache",
    "PlanFormatError",
    "PlanRequest",
    "Prediction",
    "RankPrediction",
    "Versions",
    "fingerprint_inputs",
    "sharding_plan_digest",
    "sharding_plan_from_dict",
    "sharding_plan_to_dict",
    "table_specs",
]
