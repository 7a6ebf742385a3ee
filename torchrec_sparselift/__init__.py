"""torchrec_sparselift: plan TorchRec's sparse path like a compiler.

Drop-in use::

    from torchrec_sparselift import SparseLiftPlanner
    planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    plan = planner.collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, plan=plan, ...)
"""

__version__ = "0.1.0"

from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile  # noqa: E402

__all__ = [
    "__version__",
    "HardwareProfile",
    "get_profile",
]
