"""plan: the plan request (everything a plan is asked for), the execution plan (sharding plan +
optimizations + prediction + fingerprint), its JSON form, the on-disk cache that reuses it
across runs, and the stored planning inputs (``PlanInputs``) the command line keeps in a plan."""

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
from torchrec_sparselift.plan.stored_inputs import INPUTS_SCHEMA, PlanInputs, TopologySpec

__all__ = [
    "COMM_PRECISIONS",
    "EXECUTION_PLAN_SCHEMA",
    "INPUTS_SCHEMA",
    "PIPELINES",
    "ExecutionPlan",
    "Fingerprint",
    "Optimizations",
    "PlanCache",
    "PlanFormatError",
    "PlanInputs",
    "PlanRequest",
    "Prediction",
    "RankPrediction",
    "TopologySpec",
    "Versions",
    "fingerprint_inputs",
    "sharding_plan_digest",
    "sharding_plan_from_dict",
    "sharding_plan_to_dict",
    "table_specs",
]
