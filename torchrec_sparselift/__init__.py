"""torchrec_sparselift: plan TorchRec's sparse path like a compiler.

Drop-in use::

    from torchrec_sparselift import SparseLiftPlanner
    planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    plan = planner.collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, plan=plan, ...)

Names are imported lazily, so the cost layer (hardware profiles, calibration) works on machines
that have torch but not torchrec.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "HardwareProfile": "torchrec_sparselift.cost.hardware",
    "get_profile": "torchrec_sparselift.cost.hardware",
    "SparseLiftPlanner": "torchrec_sparselift.planner",
    "PlanResult": "torchrec_sparselift.plan.result",
    "evaluate_sharding_plan": "torchrec_sparselift.plan.evaluate",
    "SparseLiftPlannerError": "torchrec_sparselift.errors",
    "SparseLiftEnumerator": "torchrec_sparselift.search.enumerator",
    "SparseLiftProposer": "torchrec_sparselift.search.proposer",
    "ExecutionPlan": "torchrec_sparselift.plan",
    "PlanCache": "torchrec_sparselift.plan",
    "Optimizations": "torchrec_sparselift.plan",
    "PlanRequest": "torchrec_sparselift.plan",
    "WorkloadStats": "torchrec_sparselift.semantics.workload",
    "observe": "torchrec_sparselift.semantics.workload",
    "declare": "torchrec_sparselift.semantics.workload",
    "lift": "torchrec_sparselift.runtime.model_parallel",
    "SparseLiftModelParallel": "torchrec_sparselift.runtime.model_parallel",
    "build_2d_model_parallel": "torchrec_sparselift.runtime.two_d",
    "MomentumScaledRowWiseAdagrad": "torchrec_sparselift.optim",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'torchrec_sparselift' has no attribute {name!r}")
