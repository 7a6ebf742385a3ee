"""The planner's defaults, declared once: ``SparseLiftPlanner``, ``PlanRequest``, the command
line and the examples read them from here, so ``sparselift plan`` without a flag plans exactly
what ``SparseLiftPlanner(...)`` without that argument plans.

Also the one rule for how many ranks share a host (:func:`ranks_per_host`), which a machine
fingerprint records and the runtime pins cores by.

A base module like :mod:`~torchrec_sparselift.errors`: it imports nothing of the package, so
every layer may use it.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

__all__ = [
    "TIME_BUDGET_S",
    "BATCH_SIZE",
    "STORAGE_RESERVATION_PERCENTAGE",
    "DRIFT_TOLERANCE",
    "MAX_SYNC_INTERVAL",
    "SYNC_OVERHEAD",
    "PIPELINE",
    "COMM_PRECISION",
    "SOLVER",
    "LAYOUT_2D",
    "NEVER_SLOWER",
    "NEVER_SLOWER_CHOICES",
    "UNCALIBRATED_MODEL_ERROR",
    "STRATEGY_2D",
    "ranks_per_host",
]

#: Search time budget in seconds (``SparseLiftPlanner(time_budget_s=...)``, ``--time-budget``).
TIME_BUDGET_S = 8.0
#: Per-rank batch size when none is given (TorchRec's planner default).
BATCH_SIZE = 512
#: ``HeuristicalStorageReservation``'s percentage when no storage reservation is given (TorchRec's
#: planner default): the share of each rank's memory kept free of embedding storage.
STORAGE_RESERVATION_PERCENTAGE = 0.15
#: Relative change of the workload statistics up to which a cached plan is reused.
DRIFT_TOLERANCE = 0.2
#: Largest 2D replica-sync interval the planner may choose unless allowed more: the largest interval
#: measured at quality parity with 1D on every workload tried (``cost.two_d.PARITY_EVIDENCE``).
MAX_SYNC_INTERVAL = 2
#: The planner picks the smallest 2D sync interval whose amortised sync costs at most this share
#: of the step.
SYNC_OVERHEAD = 0.05
#: Train pipeline of a plan that does not name one (a bare ``ShardingPlan``).
PIPELINE = "sparse_dist"
#: Comm precision (both directions) of a plan that does not name one.
COMM_PRECISION = "fp32"
#: Search strategy.
SOLVER = "auto"
#: 2D rank layout.
LAYOUT_2D = "auto"
#: The never-slower rule (``SparseLiftPlanner(never_slower=...)``): plan with TorchRec's
#: ``EmbeddingShardingPlanner`` too and keep its plan unless SparseLift's predicted gain exceeds the
#: model's error on the terms the two plans differ in (docs/cost_model.md). "auto": where the
#: profile's error is measured (a step-fitted profile from the store); True: also with the assumed
#: error of an uncalibrated profile (presets); False: never.
NEVER_SLOWER = "auto"
#: What ``never_slower`` accepts.
NEVER_SLOWER_CHOICES = (True, False, "auto")
#: The relative error per cost term the never-slower rule assumes for a profile not fitted from real
#: steps (presets, kernel microbenchmark profiles): what the microbenchmark profile measured against
#: real CPU steps, 26.7-31.6% MAPE (docs/benchmarks.md section 7); no GPU step has been measured.
UNCALIBRATED_MODEL_ERROR = 0.30
#: 2D strategy (``vocabulary.STRATEGY_2D_CHOICES``): "auto" prices every strategy the device runs.
STRATEGY_2D = "auto"


def ranks_per_host(topology: Any = None, *, world_size: Optional[int] = None,
                   environ: Optional[Mapping[str, str]] = None) -> int:
    """How many ranks (processes) share this host: what a machine fingerprint records.

    From a planner's TorchRec ``Topology``: its ``local_world_size``. Otherwise from the launcher:
    ``LOCAL_WORLD_SIZE`` (torchrun sets it), else ``world_size`` (the process group's size: one
    host), else 1. ``environ`` defaults to ``os.environ``.
    """
    if topology is not None:
        return int(topology.local_world_size)
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_WORLD_SIZE")
    if local:
        n = int(local)
    elif world_size:
        n = int(world_size)
    else:
        n = 1
    if n < 1:
        raise ValueError(f"ranks per host must be >= 1, got {n} (LOCAL_WORLD_SIZE={local!r}, "
                         f"world_size={world_size!r}): launch with torchrun --nproc_per_node N")
    return n
