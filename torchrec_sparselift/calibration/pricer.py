"""``profile -> predicted step seconds`` of one fixed plan: what the step fit linearizes."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from torchrec_sparselift import defaults
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.calibration.attribution import group_kinds, predicted_by_kind
from torchrec_sparselift.cost.model import dp_optimizer_s
from torchrec_sparselift.plan.evaluate import GivenPlan

__all__ = ["PlanPricer"]


class PlanPricer:
    """``profile -> predicted step seconds`` of one fixed ``ShardingPlan``: the plan is extracted
    once (:class:`~torchrec_sparselift.plan.evaluate.GivenPlan`: tables, topology, batch size, dense
    part, placement) and each call prices it under a profile in the planner's evaluator
    (:meth:`GivenPlan.step_time <torchrec_sparselift.plan.evaluate.GivenPlan.step_time>`, the numbers
    :func:`~torchrec_sparselift.plan.evaluate.evaluate_sharding_plan` gives). Column-wise shards are
    priced as equal splits. ``stats``: the run's
    :class:`~torchrec_sparselift.semantics.workload.WorkloadStats` (the planner's ``workload=``; its
    distinct ids price the fused backward)."""

    def __init__(self, module: Any, plan: Any, topology: Any, batch_size: int,
                 constraints: Optional[Dict[str, Any]] = None, sharders: Optional[Sequence[Any]] = None,
                 pipeline: str = defaults.PIPELINE, stats: Any = None) -> None:
        self.given = GivenPlan.of(module, plan, topology, batch_size, constraints, stats,
                                  list(sharders) if sharders is not None else None)
        self.topology = topology
        self.batch_size = batch_size
        self.pipeline = pipeline
        self.specs = [h.spec for h in self.given.handles]
        self.cands = [c for c, _r in self.given.placed]

    def step_time(self, profile: HardwareProfile) -> Any:
        """The plan's evaluated step under ``profile``. The fit's finite differences price the same
        profiles for a plan's step case and each of its group cases: each is priced once (the last
        64 profiles are kept)."""
        return self._memo("_step_by_profile", profile, self._evaluate)

    def _memo(self, name: str, profile: HardwareProfile, compute: Callable[[HardwareProfile], Any]) -> Any:
        """``compute(profile)``, remembered in the cache ``name`` (its last 64 profiles)."""
        cache = self.__dict__.setdefault(name, {})
        if profile not in cache:
            if len(cache) >= 64:
                cache.clear()
            cache[profile] = compute(profile)
        return cache[profile]

    def _evaluate(self, profile: HardwareProfile) -> Any:
        return self.given.step_time(profile, self.pipeline)

    def __call__(self, profile: HardwareProfile) -> float:
        return float(self.step_time(profile).total_s)

    def groups(self, profile: HardwareProfile) -> Dict[str, float]:
        """Predicted seconds per attribution fit group
        (:data:`~torchrec_sparselift.calibration.attribution.FIT_GROUPS`; they sum to the step)."""
        def split(p: HardwareProfile) -> Dict[str, float]:
            dp = dp_optimizer_s(self.specs, self.cands, self.given.context(p))
            return group_kinds(predicted_by_kind(self.step_time(p), dp_optimizer_s=dp))

        # every group's case of a plan prices the same profiles: split each one's step once
        return dict(self._memo("_groups_by_profile", profile, split))

    def group(self, name: str) -> Callable[[HardwareProfile], float]:
        """``profile -> seconds`` of one fit group (a case for the step fit)."""
        return lambda profile: self.groups(profile)[name]
