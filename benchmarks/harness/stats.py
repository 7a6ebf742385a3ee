"""Statistics of rounds of measurements (pure)."""

from __future__ import annotations

import math
import statistics
from typing import Dict, List, Mapping, Sequence

__all__ = ["spread", "paired_ratio", "geomean", "median_step"]


def spread(runs: Sequence[float]) -> float:
    """How far a run's rounds disagree: slowest / fastest - 1 (0 for none)."""
    return max(runs) / min(runs) - 1.0 if runs else 0.0


def paired_ratio(a_runs: Sequence[float], b_runs: Sequence[float]) -> float:
    """Median over rounds of ``a / b`` measured in the same round (interleaved A/B: a slow stretch
    of the machine slows both runs of its round, so it cancels in their ratio)."""
    pairs = [a / b for a, b in zip(a_runs, b_runs) if b > 0]
    if not pairs:
        raise ValueError("paired_ratio needs rounds where both plans ran")
    return statistics.median(pairs)


def geomean(xs: Sequence[float]) -> float:
    """The geometric mean of ``xs`` (NaN for none)."""
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def median_step(steps: List[Mapping[str, float]]) -> Dict[str, float]:
    """Per key, the median over ``steps`` (dicts with the same keys, e.g. one per step's phases)."""
    keys = steps[0].keys()
    return {k: statistics.median(s[k] for s in steps) for k in keys}
