"""Measured guard: measure a few candidate plans on the real model and keep the fastest.

The cost model ranks plans; a few real steps decide between the top ones. :func:`choose_measured`
is the rule, independent of how plans are made or run: it calls ``trial(label, plan)`` (seconds per
steady-state step, measured) for each candidate, in the given order, and keeps the candidate with the
lowest measured time (ties: the earlier candidate, i.e. the one the model ranked first). Candidates
whose plans are the same (equal ``key``) are measured once: the later ones share the first one's
trials (TorchRec's plan is often exactly SparseLift's; measuring it twice would only let noise pick
between a plan and itself).
:class:`GuardResult` records every trial (label, source, predicted and measured seconds) as plain
JSON, which the execution plan stores so a cached plan is reused without measuring again.

:class:`MeasuredGuard` holds the settings (how many SparseLift candidates, TorchRec's plan or not,
steps per trial); :func:`torchrec_sparselift.measured_guard.guarded_execution_plan` makes the
candidates and runs the trials with :func:`torchrec_sparselift.runtime.probe.measure_plan`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.validation import int_at_least

__all__ = ["MeasuredGuard", "GuardTrial", "GuardResult", "Candidate", "choose_measured"]


@attrs.frozen(kw_only=True)
class MeasuredGuard:
    """Guard settings. ``candidates``: SparseLift plans measured (its plan and the next-best
    alternatives the model ranks); ``torchrec``: also measure ``EmbeddingShardingPlanner``'s plan;
    ``steps`` / ``warmup``: timed and untimed steps per trial; ``rounds``: trials per candidate,
    interleaved (every candidate once per round), a candidate's time being its fastest round (a
    disturbance only ever slows a trial down); ``feedback``: add the trials to this machine's
    stored step-fit records and refit its profile."""

    candidates: int = attrs.field(default=3, validator=int_at_least(1))
    torchrec: bool = True
    steps: int = attrs.field(default=16, validator=int_at_least(1))
    warmup: int = attrs.field(default=5, validator=int_at_least(0))
    rounds: int = attrs.field(default=2, validator=int_at_least(1))
    feedback: bool = True

    def to_dict(self) -> Dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Candidate:
    """A plan to try: ``label`` (unique), ``source`` ("sparselift" or "torchrec"), the plan and
    the model's prediction (seconds; None when not priced)."""

    label: str
    source: str
    plan: Any = attrs.field(eq=False, repr=False)
    predicted_s: Optional[float] = None


@attrs.frozen
class GuardTrial:
    """A candidate's measured step time (its fastest round) and every round's (``runs_s``).
    ``same_as``: the label of an earlier candidate with the same plan, whose trials these are (the
    plan was not measured again); None when this candidate was measured itself."""

    label: str
    source: str
    predicted_s: Optional[float]
    measured_s: float
    runs_s: Tuple[float, ...] = attrs.field(default=(), converter=tuple)
    same_as: Optional[str] = None


@attrs.frozen
class GuardResult:
    """Every trial and the chosen label."""

    chosen: str
    trials: Tuple[GuardTrial, ...]
    settings: Dict[str, Any] = attrs.field(factory=dict)

    def trial(self, label: str) -> GuardTrial:
        return next(t for t in self.trials if t.label == label)

    @property
    def chosen_trial(self) -> GuardTrial:
        return self.trial(self.chosen)

    def torchrec_over_chosen(self) -> Optional[float]:
        """TorchRec's measured step time / the chosen plan's (None without a TorchRec trial)."""
        tr = [t for t in self.trials if t.source == "torchrec"]
        if not tr:
            return None
        return tr[0].measured_s / self.chosen_trial.measured_s

    def to_dict(self) -> Dict[str, Any]:
        return dict(chosen=self.chosen, settings=dict(self.settings),
                    trials=[dict(attrs.asdict(t), runs_s=list(t.runs_s)) for t in self.trials])

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "GuardResult":
        return cls(chosen=data["chosen"], trials=tuple(GuardTrial(**t) for t in data["trials"]),
                   settings=dict(data.get("settings") or {}))

    def format(self) -> str:
        """One line per trial: measured and predicted ms, the chosen one marked."""
        lines = []
        for t in self.trials:
            pred = "" if t.predicted_s is None else f", predicted {t.predicted_s * 1e3:.2f} ms"
            mark = "  <- kept" if t.label == self.chosen else ""
            same = f" (the same plan as {t.same_as})" if t.same_as else ""
            lines.append(f"  {t.label:<28} measured {t.measured_s * 1e3:8.2f} ms/step{pred}{same}{mark}")
        ratio = self.torchrec_over_chosen()
        if ratio is not None:
            lines.append(f"  TorchRec / kept plan: {ratio:.3f}x")
        return "\n".join(lines)


def choose_measured(candidates: Sequence[Candidate], trial: Callable[[str, Any], float],
                    settings: Optional[Dict[str, Any]] = None, rounds: int = 1,
                    key: Optional[Callable[[Any], Any]] = None) -> Tuple[Candidate, GuardResult]:
    """Measure every candidate ``rounds`` times, interleaved (round r trials every candidate in the
    given order), with ``trial(label, plan) -> seconds``; a candidate's time is its fastest round;
    keep the fastest candidate (ties: the earlier one). Labels must be unique; a trial must return
    a positive finite time. ``key(plan)``: plan identity (e.g.
    :func:`~torchrec_sparselift.plan.sharding_plan_digest`); a candidate whose key equals an earlier
    one's is not measured but shares its trials (``GuardTrial.same_as``), so the earlier is kept."""
    if not candidates:
        raise ValueError("the measured guard needs at least one candidate plan")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    labels = [c.label for c in candidates]
    if len(set(labels)) != len(labels):
        raise ValueError(f"candidate labels must be unique, got {labels}")
    first: Dict[Any, int] = {}
    owner = [first.setdefault(key(c.plan), i) if key is not None else i for i, c in enumerate(candidates)]
    runs: List[List[float]] = [[] for _ in candidates]
    for _ in range(rounds):
        for i, (c, r) in enumerate(zip(candidates, runs)):
            if owner[i] != i:
                continue
            s = float(trial(c.label, c.plan))
            if not (s > 0 and math.isfinite(s)):
                raise ValueError(f"trial of {c.label!r} returned {s!r}: expected a positive step time in seconds")
            r.append(s)
    runs = [runs[o] for o in owner]
    trials = tuple(GuardTrial(label=c.label, source=c.source, predicted_s=c.predicted_s, measured_s=min(r),
                              runs_s=tuple(r), same_as=None if o == i else candidates[o].label)
                   for i, (c, r, o) in enumerate(zip(candidates, runs, owner)))
    i = min(range(len(candidates)), key=lambda k: (trials[k].measured_s, k))
    return candidates[i], GuardResult(chosen=candidates[i].label, trials=trials, settings=dict(settings or {}))
