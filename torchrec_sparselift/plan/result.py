"""``PlanResult``: what one ``SparseLiftPlanner.plan()`` (or ``evaluate_sharding_plan``) decided and
predicted, with the live TorchRec values behind it: the sharding plan and options, the search
result, the planning problem, the tables' handles. :meth:`PlanResult.optimizations` and
:meth:`PlanResult.prediction` are the :class:`~torchrec_sparselift.plan.ExecutionPlan` parts."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import attrs
import numpy as np
from torchrec.distributed.planner.types import ShardingOption, Topology
from torchrec.distributed.types import ShardingPlan

from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.cost.report import rank_breakdown, ranks_repr
from torchrec_sparselift.cost.two_d import sync_evidence
from torchrec_sparselift.plan.baseline import BaselineDecision
from torchrec_sparselift.plan.execution_plan import Optimizations, Prediction, RankPrediction
from torchrec_sparselift.plan.rewrites import RewriteChoice
from torchrec_sparselift.search.problem import PlanningProblem
from torchrec_sparselift.search.solve import SearchResult
from torchrec_sparselift.search.two_d import ReplicaSyncChoice
from torchrec_sparselift.semantics.layout import Layout2D
from torchrec_sparselift.semantics.tables import TableHandle

__all__ = ["PlanResult"]


@attrs.frozen
class PlanResult:
    """What the last ``plan()`` decided and predicted (for logs, ExecutionPlan and explain)."""

    sharding_plan: ShardingPlan = attrs.field(eq=False)
    sharding_options: Tuple[ShardingOption, ...] = attrs.field(eq=False, repr=False)
    search: SearchResult
    problem: PlanningProblem = attrs.field(eq=False, repr=False)
    handles: Tuple[TableHandle, ...] = attrs.field(eq=False, repr=False)
    topology: Topology = attrs.field(eq=False, repr=False)
    profile: HardwareProfile
    sharding_group_size: Optional[int] = None  # None: 1D (tables sharded over all ranks)
    sync_interval: int = 1
    sync_s: float = 0.0  # replica sync per step (amortised), 2D only
    alternatives_2d: Tuple[Tuple[int, float], ...] = ()  # (group size, predicted step s)
    layout_2d: Optional[Layout2D] = None  # the rank layout priced (2D only)
    max_sync_interval: Optional[int] = None  # the sync-interval bound in force (2D only)
    alternatives_layout: Tuple[Tuple[int, str, float], ...] = ()  # (group, layout, step s)
    #: the never-slower rule's decision (plan.baseline.BaselineDecision); None: not asked for
    never_slower: Optional[BaselineDecision] = None
    replica_sync: Optional[ReplicaSyncChoice] = None  # the 2D strategy chosen and its rivals (2D only)
    #: with ``cost_model="torchrec"``: the problem TorchRec's estimators rated (their shards' Perf/Storage)
    torchrec_problem: Any = attrs.field(default=None, eq=False, repr=False)
    #: the rewrite stage's choice (``plan.rewrites``); None: the stage did not run
    rewrites: Optional[RewriteChoice] = None

    @property
    def strategy_2d(self) -> Optional[str]:
        """The 2D strategy (``vocabulary.STRATEGIES_2D``); None for 1D."""
        if not self.sharding_group_size:
            return None
        return self.replica_sync.strategy if self.replica_sync is not None else "default"

    @property
    def step_time_s(self) -> float:
        """Predicted steady-state step time including 2D replica sync and the chosen rewrites."""
        return self.rewritten_step_s + self.sync_s

    @property
    def rewritten_step_s(self) -> float:
        """The step (no replica sync) with the chosen rewrites (``plan.rewrites.RewriteChoice.step_s``:
        the search's priced step for the plan it chose); the search's step without a rewrite stage."""
        if self.rewrites is None:
            return self.search.priced_step_s
        return self.rewrites.step_s

    def _rewritten_search(self) -> SearchResult:
        """The search result with its step total the rewritten one (what the per-rank breakdown reads)."""
        s = self.search
        if self.rewritten_step_s == s.step.total_s:
            return s
        return attrs.evolve(s, step=attrs.evolve(s.step, total_s=self.rewritten_step_s))

    def rank_breakdown(self) -> List[Dict[str, float]]:
        """Per rank: compute, communication (exposed / overlapped) seconds and memory bytes."""
        return rank_breakdown(self.problem.ctx, self._rewritten_search())

    def optimizations(self) -> Optimizations:
        s = self.search
        return Optimizations(pipeline=s.pipeline, fwd_comm_precision=s.fwd_precision,
                             bwd_comm_precision=s.bwd_precision,
                             sharding_group_size=self.sharding_group_size,
                             sync_interval=self.sync_interval,
                             layout_2d=self.layout_2d if self.sharding_group_size else None,
                             strategy_2d=self.strategy_2d,
                             max_sync_interval=(self.max_sync_interval
                                                if self.sharding_group_size else None),
                             **self._rewrite_settings())

    def _rewrite_settings(self) -> Dict[str, Any]:
        r = self.rewrites
        if r is None or self.sharding_group_size:
            return {}
        # the stage splits only a dense model it proved per-sample or the request declared so: the plan
        # carries that for the runtime's batch-split pipeline (which checks the model again)
        return dict(batch_split=r.batch_split, id_dtype=r.id_dtype, dedup_features=r.dedup_features,
                    per_sample=r.batch_split > 1)

    def prediction(self) -> Prediction:
        s = self.search
        per_rank = [
            RankPrediction(rank=r, compute_s=b["compute_s"], exposed_comm_s=b["exposed_comm_s"],
                           overlapped_comm_s=b["overlapped_comm_s"], hbm_bytes=int(b["device_bytes"]),
                           ddr_bytes=int(b["host_bytes"]))
            for r, b in enumerate(self.rank_breakdown())
        ]
        lb = s.lower_bound_s if np.isfinite(s.lower_bound_s) else 0.0
        return Prediction(step_time_s=self.step_time_s, lower_bound_s=min(lb, self.step_time_s),
                          per_rank=per_rank, cost_model=f"sparselift/{self.profile.name}")

    def _sync_words(self) -> str:
        if self.strategy_2d == "fully_sharded":
            return (f"strategy fully_sharded (weights reduce-scattered and all-gathered every step, "
                    f"{self.sync_s * 1e3:.3f} ms/step)")
        return (f"replica sync every {self.sync_interval} steps ({self.sync_s * 1e3:.3f} ms/step)")

    def _strategy_lines(self) -> List[str]:
        """The 2D strategy's rivals and the fullest rank's memory under the chosen one."""
        c = self.replica_sync
        if c is None:
            return []
        MiB = 2.0 ** 20
        lines = ["2D strategy " + c.strategy + ": " + ", ".join(
            f"{n} {t * 1e3:.3f} ms/step" for n, t in c.alternatives)]
        lines += [f"  {n} not priced: {r}" for n, r in c.refused]
        m = c.memory
        lines.append(f"  fullest rank holds {m.weight_bytes / MiB:.1f} MiB weights + "
                     f"{m.optimizer_bytes / MiB:.1f} MiB optimizer state in the embedding backward, "
                     f"{m.dense_phase_bytes / MiB:.1f} MiB through the dense part")
        return lines

    def summary(self) -> str:
        s = self.search
        lines = [
            f"SparseLift plan: {len(self.handles)} tables on {self.topology.world_size} ranks "
            f"({self.profile.name}), pipeline={s.pipeline}, comm={s.fwd_precision}/{s.bwd_precision}"
            + (f", 2D: groups of {self.sharding_group_size} ranks, " + self._sync_words()
               if self.sharding_group_size else ", 1D"),
            f"  predicted step {self.step_time_s * 1e3:.3f} ms, lower bound "
            f"{s.lower_bound_s * 1e3:.3f} ms (gap {s.gap * 100:.1f}%), planned in "
            f"{s.planning_time_s:.2f} s by {s.solver}",
        ]
        if self.never_slower is not None:
            lines.append("  " + self.never_slower.describe())
        if self.rewrites is not None:
            lines += ["  " + line for line in self.rewrites.describe()]
        if self.sharding_group_size and self.layout_2d is not None:
            lines += ["  " + line for line in self.layout_2d.describe()]
            if self.strategy_2d == "default":
                lines.append(f"  sync interval {self.sync_interval} (bound {self.max_sync_interval}): "
                             f"{sync_evidence(self.sync_interval)}")
            lines += ["  " + line for line in self._strategy_lines()]
        for h, (cid, ranks) in zip(self.handles, s.assignment):
            c = self.problem.cands[cid]
            rk = ranks_repr(ranks)
            lines.append(
                f"  {h.spec.fqn:<32} {c.sharding_type:<15} {c.compute_kernel:<18} "
                f"{c.num_shards:>4} shard(s) on ranks {rk}"
            )
        return "\n".join(lines)
