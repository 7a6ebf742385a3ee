"""The measured guard keeps the plan that measures fastest."""

import time

import pytest

from torchrec_sparselift.runtime.guard import Candidate, GuardResult, MeasuredGuard, choose_measured
from torchrec_sparselift.runtime.timing import StepTimer


def _timed_trial(step_cost_s):
    """A trial that really runs steps: each plan's step sleeps for its cost (differs by construction)."""

    def trial(label, plan):
        timer = StepTimer("cpu", warmup_steps=1)
        for _ in range(6):
            with timer.step():
                time.sleep(step_cost_s[plan])
        return timer.record().measured_s

    return trial


def test_guard_picks_the_measured_faster_plan_even_against_the_prediction():
    # the model ranks "slow" first (predicted faster), the measurement says otherwise
    cands = [Candidate("sparselift", "sparselift", "slow", predicted_s=0.001),
             Candidate("torchrec", "torchrec", "fast", predicted_s=0.010)]
    chosen, res = choose_measured(cands, _timed_trial({"slow": 0.012, "fast": 0.003}),
                                  settings=MeasuredGuard(candidates=1).to_dict())
    assert chosen.label == "torchrec"
    assert res.chosen == "torchrec"
    assert res.trial("sparselift").measured_s > res.trial("torchrec").measured_s * 2
    assert res.torchrec_over_chosen() == pytest.approx(1.0)
    # round trip through the ExecutionPlan's JSON
    again = GuardResult.from_dict(res.to_dict())
    assert again == res
    assert "<- kept" in res.format().splitlines()[1]


def test_guard_keeps_the_first_on_a_tie_and_checks_trials():
    cands = [Candidate("a", "sparselift", 1), Candidate("b", "torchrec", 2)]
    chosen, _ = choose_measured(cands, lambda label, plan: 0.005)
    assert chosen.label == "a"
    with pytest.raises(ValueError, match="positive step time"):
        choose_measured(cands, lambda label, plan: float("nan"))
    with pytest.raises(ValueError, match="unique"):
        choose_measured([cands[0], cands[0]], lambda label, plan: 1.0)
    with pytest.raises(ValueError, match="candidates must be an integer >= 1"):
        MeasuredGuard(candidates=0)
