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
from typing import TYPE_CHECKING, Any

#: The package version, declared once: ``pyproject.toml`` reads it (``dynamic = ["version"]``).
__version__ = "0.1.0"

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names import lazily below
    from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile
    from torchrec_sparselift.errors import SparseLiftPlannerError
    from torchrec_sparselift.optim import MomentumScaledRowWiseAdagrad
    from torchrec_sparselift.plan import ExecutionPlan, Optimizations, PlanCache, PlanRequest
    from torchrec_sparselift.plan.evaluate import evaluate_sharding_plan
    from torchrec_sparselift.plan.result import PlanResult
    from torchrec_sparselift.planner import SparseLiftPlanner
    from torchrec_sparselift.runtime.model_parallel import SparseLiftModelParallel, lift
    from torchrec_sparselift.runtime.two_d import build_2d_model_parallel
    from torchrec_sparselift.search.enumerator import SparseLiftEnumerator
    from torchrec_sparselift.search.proposer import SparseLiftProposer
    from torchrec_sparselift.semantics.workload import WorkloadStats, declare, observe

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
