"""The never-slower rule: leave TorchRec's plan only where the predicted gain exceeds the model's
measured error on the terms that differ.

Pure: it reads two plans' per-term breakdowns (what each cost term contributes to the predicted
step, :class:`TermTimes`) and the model's relative error per term (:class:`TermErrors`) and
returns a :class:`BaselineDecision`; :func:`term_seconds` splits a predicted step into those
terms. :func:`torchrec_sparselift.plan.planning.apply_never_slower` builds TorchRec's plan on the
same inputs, prices both with SparseLift's model and the profile, and applies the rule.

The rule (docs/cost_model.md, "Never slower than TorchRec")::

    gain   = T(baseline) - T(candidate)
    margin = sum over terms j whose time differs of  e_j * max(t_j(candidate), t_j(baseline))
    leave the baseline  iff  gain > margin

``t_j`` is the seconds term ``j`` puts on the plan's critical path (the ``fixed`` term holds the
rest of the step); ``e_j`` the model's relative error of that term. A term with the same time in
both plans moves both predictions alike and is left out; identical plans have no differing term,
a margin of 0 and no gain, so the baseline is kept.

With lossy comms allowed the candidate's precision is a choice of its own, and TorchRec's users
set it by hand (qcomm): :func:`never_slower_with_precision` compares the candidate with TorchRec's
plan under the *same* precisions first, and whichever of the two it keeps with TorchRec's plan as
its users run it (full precision), so the plan handed back is never predicted slower, beyond the
model's error, than either.

Where TorchRec's plan is kept, :func:`kept_plan_pipeline` chooses the pipeline to keep it with:
another of the planner's pipelines only if TorchRec's plan under it clears the rule against
TorchRec's plan under its default pipeline (the pipeline is a choice TorchRec's users also make by
hand; the sharding stays TorchRec's). There both sides are one plan, so a term's error is the same
in both (the same bytes at the same rate, the same kernels): it moves the predicted difference by
``e_j * |t_j(candidate) - t_j(baseline)|``, and that is the term's margin (``same_plan=True``)::

    margin = sum over terms j whose time differs of  e_j * |t_j(candidate) - t_j(baseline)|

A measured pipeline step factor is a term only one side has (:func:`with_pipeline_term`), so it
enters with its whole seconds either way.

Where the candidate is kept, :func:`same_sharding_price` asks whether TorchRec's sharding under the
candidate's own pipeline and precisions is priced no slower: then the candidate's gain is all in
those settings, its sharding only moves tables among placements the model prices alike, and
TorchRec's sharding is handed back under them (``BaselineDecision.baseline_sharding``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.cost.step_terms import CPU_STEP_TERMS, FitTerm, scaled_term

__all__ = ["FIXED_TERM", "REWRITE_TERM", "REWRITE_CHANGES", "rewrite_error", "with_rewrite_term", "TermErrors", "TermTimes", "TermDifference", "BaselineDecision", "never_slower",
           "never_slower_with_precision", "decision_from_dict", "pipeline_term", "with_pipeline_term",
           "kept_plan_pipeline", "same_sharding_price", "baseline_name", "term_seconds"]

#: The part of a predicted step that no fitted term multiplies (the breakdown's remainder).
FIXED_TERM = "fixed"
#: The seconds the rewrite stage's rewrites save (``plan.rewrites``): a term of the rewritten
#: plan alone (:func:`with_rewrite_term`), its error the model's on the terms the rewrites change
#: (:func:`rewrite_error`) unless ``TermErrors`` names it.
REWRITE_TERM = "rewrites"
#: The step-fit terms a rewrite changes: the collectives' bytes and latency, the dense compute
#: the chunks split.
REWRITE_CHANGES: Tuple[str, ...] = ("1/a2a_bw", "collective_latency_s", "1/dense_flops", "1/dense_mem_bw")


def _error_value(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    items = value.items() if isinstance(value, Mapping) else [(attribute.name, value)]
    for k, v in items:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"TermErrors: the error of {k!r} must be a finite number >= 0 (a relative "
                             f"error, 0.1 = 10%), got {v!r}")


@attrs.frozen
class TermErrors:
    """The model's relative error per cost term.

    ``errors``: term name -> relative error (0.1 = 10%); ``default``: the error of a term without
    its own (and of the ``fixed`` part when it has none); ``source``: where the numbers come from,
    for logs and the explanation (a stored step fit, or the documented error of an uncalibrated
    profile). ``measured``: False for an assumed error (``never_slower="auto"`` then skips the rule)."""

    errors: Mapping[str, float] = attrs.field(converter=dict, validator=_error_value)
    default: float = attrs.field(validator=_error_value)
    source: str = ""
    measured: bool = True  # False: an assumed error (a profile not fitted from real steps)

    def of(self, term: str) -> float:
        return float(self.errors.get(term, self.default))

    def to_dict(self) -> Dict[str, Any]:
        return dict(errors=dict(self.errors), default=self.default, source=self.source, measured=self.measured)


@attrs.frozen
class TermTimes:
    """A priced plan split by cost term: ``total_s`` and, per term, the seconds it contributes on
    the critical path (``terms``; :data:`FIXED_TERM` holds the rest; terms that multiply each other
    each carry the product's seconds, so they may sum to more than ``total_s``)."""

    total_s: float
    terms: Mapping[str, float] = attrs.field(converter=dict)

    def __attrs_post_init__(self) -> None:
        if not (math.isfinite(self.total_s) and self.total_s >= 0):
            raise ValueError(f"TermTimes.total_s must be a finite time >= 0, got {self.total_s!r}")
        bad = {k: v for k, v in self.terms.items() if not math.isfinite(v)}
        if bad:
            raise ValueError(f"TermTimes.terms must be finite seconds, got {bad}")


@attrs.frozen
class TermDifference:
    """One term whose time differs between the plans, with its error and its share of the margin:
    ``error * max(|candidate_s|, |baseline_s|)`` between two plans, ``error * |candidate_s -
    baseline_s|`` where both sides are one plan (``same_plan``: the term's error is common to both)."""

    term: str
    candidate_s: float
    baseline_s: float
    error: float
    same_plan: bool = False

    @property
    def margin_s(self) -> float:
        if self.same_plan:
            return self.error * abs(self.candidate_s - self.baseline_s)
        return self.error * max(abs(self.candidate_s), abs(self.baseline_s))


@attrs.frozen
class BaselineDecision:
    """What the rule decided: ``leave`` the baseline (use the candidate) or keep it, with the
    predicted ``gain_s`` (baseline - candidate) and the ``margin_s`` it had to exceed, the
    ``differing`` terms behind the margin, and ``errors.source``. ``note``: why the rule could
    not be applied (then ``leave`` is True and nothing else is set)."""

    leave: bool
    candidate_s: float = 0.0
    baseline_s: float = 0.0
    margin_s: float = 0.0
    differing: Tuple[TermDifference, ...] = ()
    error_source: str = ""
    baseline: str = "torchrec"
    note: str = ""
    #: set when the candidate is TorchRec's own plan under another pipeline (:func:`kept_plan_pipeline`)
    candidate_pipeline: str = ""
    #: True when SparseLift's plan cleared the rule but TorchRec's sharding under its pipeline and
    #: precisions is priced no slower (:func:`same_sharding_price`): that sharding is handed back
    baseline_sharding: bool = False

    @property
    def gain_s(self) -> float:
        return self.baseline_s - self.candidate_s

    @property
    def applied(self) -> bool:
        return not self.note

    @property
    def _with_comms(self) -> str:
        """``" with fp16/fp16 comms"`` for a baseline ``"torchrec+fp16/fp16"``
        (:func:`never_slower_with_precision`), else empty."""
        return f" with {self.baseline.split('+', 1)[1]} comms" if "+" in self.baseline else ""

    @property
    def baseline_label(self) -> str:
        """``"TorchRec's plan"``, or ``"TorchRec's plan with fp16/fp16 comms"`` for a baseline
        ``"torchrec+fp16/fp16"`` (:func:`never_slower_with_precision`)."""
        return "TorchRec's plan" + self._with_comms

    @property
    def with_rewrites(self) -> bool:
        """Whether the candidate carries the rewrites' saving (:data:`REWRITE_TERM` differs)."""
        return any(d.term == REWRITE_TERM for d in self.differing)

    @property
    def candidate_label(self) -> str:
        """``"SparseLift's plan"``, or ``"TorchRec's plan under fused"`` for a candidate that is
        TorchRec's plan under another pipeline (:func:`kept_plan_pipeline`; ``"... under overlap
        with its rewrites"`` where the rewrites chosen on it are part of the candidate)."""
        if not self.candidate_pipeline:
            return "SparseLift's plan"
        rewrites = " with its rewrites" if self.with_rewrites and not self.baseline_sharding else ""
        return f"TorchRec's plan under {self.candidate_pipeline}{rewrites}"

    def describe(self) -> str:
        """One line: what was kept and why (gain, margin, the largest differing terms)."""
        if not self.applied:
            return f"never-slower rule not applied: {self.note}"
        top = sorted(self.differing, key=lambda d: -d.margin_s)[:4]
        terms = ", ".join(f"{d.term} {d.candidate_s * 1e3:.2f} vs {d.baseline_s * 1e3:.2f} ms "
                          f"(error {d.error:.0%})" for d in top)
        theirs = self.baseline_label
        if self.candidate_pipeline:  # TorchRec's plan under its default pipeline is the baseline
            theirs += " under its default pipeline"
        verdict = (f"{self.candidate_label} kept: SparseLift's plan cleared the rule, and TorchRec's sharding "
                   "is priced no slower under its pipeline and precisions" if self.baseline_sharding
                   else f"{self.candidate_label} kept: predicted gain over {theirs} exceeds the model's error"
                   if self.leave else f"{theirs} kept: SparseLift's search found a plan priced the same"
                   if not self.differing else f"{theirs} kept: the predicted gain is within the model's error")
        rel = self.gain_s / self.baseline_s if self.baseline_s > 0 else 0.0
        vs = "TorchRec's" + self._with_comms
        return (f"never-slower rule: {verdict}; predicted {self.candidate_s * 1e3:.2f} ms vs {vs} "
                f"{self.baseline_s * 1e3:.2f} ms, gain {self.gain_s * 1e3:.2f} ms ({rel:+.1%}) vs margin "
                f"{self.margin_s * 1e3:.2f} ms" + (f"; differing terms: {terms}" if terms else "")
                + (f"; errors from {self.error_source}" if self.error_source else ""))

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON (what an execution plan's ``planner_info["never_slower"]`` holds)."""
        return dict(rule="never_slower", baseline=self.baseline, leave=self.leave, applied=self.applied,
                    note=self.note, candidate_pipeline=self.candidate_pipeline,
                    baseline_sharding=self.baseline_sharding, candidate_s=self.candidate_s,
                    baseline_s=self.baseline_s, gain_s=self.gain_s, margin_s=self.margin_s, error_source=self.error_source,
                    differing=[dict(term=d.term, candidate_s=d.candidate_s, baseline_s=d.baseline_s,
                                    error=d.error, same_plan=d.same_plan, margin_s=d.margin_s)
                               for d in self.differing])

    @classmethod
    def not_applied(cls, note: str) -> "BaselineDecision":
        return cls(leave=True, note=note)


def pipeline_term(name: str) -> str:
    """The term a measured pipeline step factor contributes (``HardwareProfile.pipeline_factors``):
    its seconds are the whole step it multiplies, its error the factor's measured spread."""
    return f"pipeline {name}"


def with_pipeline_term(unscaled: TermTimes, pipeline: str, factor: float) -> TermTimes:
    """A step priced with pipeline ``pipeline``'s measured step ``factor`` from its breakdown
    without the factor (``unscaled``): the total is ``factor`` times it, the terms stay unscaled (a
    term the same in two plans still cancels), and a factor other than 1 adds
    :func:`pipeline_term` with the unscaled step's seconds, whose error is the factor's (an
    error of ``e`` in the factor moves the step by ``e`` times those seconds)."""
    if factor == 1.0:
        return unscaled
    return TermTimes(total_s=factor * unscaled.total_s,
                     terms={**unscaled.terms, pipeline_term(pipeline): unscaled.total_s})


def rewrite_error(errors: TermErrors) -> float:
    """The error of :data:`REWRITE_TERM`: ``errors``' own for it where given, else the largest of
    the errors of the terms a rewrite changes (:data:`REWRITE_CHANGES`) and the default one (a
    saving is priced from those terms, so it is no surer than the least sure of them)."""
    if REWRITE_TERM in errors.errors:
        return errors.of(REWRITE_TERM)
    return max([errors.default] + [errors.of(t) for t in REWRITE_CHANGES])


def with_rewrite_term(times: TermTimes, saving_s: float, errors: TermErrors) -> Tuple[TermTimes, TermErrors]:
    """``times`` (a plan priced without its rewrites) with the rewrites' ``saving_s`` taken off its
    total and carried as :data:`REWRITE_TERM` (a term the unrewritten plan does not have, so its
    whole seconds enter the margin at its error), and ``errors`` with that term's error
    (:func:`rewrite_error`). No saving: both unchanged."""
    if not saving_s > 0:
        return times, errors
    out = TermTimes(total_s=max(0.0, times.total_s - saving_s), terms={**times.terms, REWRITE_TERM: float(saving_s)})
    return out, attrs.evolve(errors, errors={**errors.errors, REWRITE_TERM: rewrite_error(errors)})


def never_slower(candidate: TermTimes, baseline: TermTimes, errors: TermErrors,
                 tolerance_s: float = 1e-12, same_plan: bool = False) -> BaselineDecision:
    """Leave ``baseline`` for ``candidate`` only if ``baseline.total_s - candidate.total_s`` exceeds
    ``sum_j errors.of(j) * max(t_j(candidate), t_j(baseline))`` over the terms whose times differ by
    more than ``tolerance_s`` (module docstring), and never where no term differs (the two are
    priced the same). ``same_plan``: both are one sharding plan (under two pipelines or two comm
    precisions), so each term's margin is ``errors.of(j) * |t_j(candidate) - t_j(baseline)|``. A
    term missing from one breakdown counts 0 there."""
    diffs = []
    for term in sorted(set(candidate.terms) | set(baseline.terms)):
        c, b = float(candidate.terms.get(term, 0.0)), float(baseline.terms.get(term, 0.0))
        if abs(c - b) > tolerance_s:
            diffs.append(TermDifference(term, c, b, errors.of(term), same_plan=same_plan))
    margin = float(sum(d.margin_s for d in diffs))
    gain = baseline.total_s - candidate.total_s
    # no differing term: the two are priced the same, a "gain" is rounding (plans, or one plan
    # under two pipelines the model prices alike)
    return BaselineDecision(leave=bool(diffs) and gain > margin, candidate_s=candidate.total_s,
                            baseline_s=baseline.total_s, margin_s=margin, differing=tuple(diffs), error_source=errors.source)


def baseline_name(precision: Tuple[str, str], full: Tuple[str, str]) -> str:
    """:attr:`BaselineDecision.baseline` for TorchRec's plan with comm ``precision`` (fwd, bwd):
    ``"torchrec"`` at ``full``, else ``"torchrec+fwd/bwd"`` (qcomm set by hand)."""
    return "torchrec" if tuple(precision) == tuple(full) else f"torchrec+{precision[0]}/{precision[1]}"


def never_slower_with_precision(
    candidate: TermTimes, baseline_at: Callable[[str, str], TermTimes], precision: Tuple[str, str],
    full: Tuple[str, str], errors: TermErrors,
) -> Tuple[BaselineDecision, Optional[Tuple[str, str]]]:
    """The rule for a ``candidate`` planned with comm ``precision`` (fwd, bwd); ``baseline_at(fwd,
    bwd)``: TorchRec's plan priced with those comms; ``full``: the precision TorchRec's users run
    by default. Returns the decision and the precisions to keep TorchRec's plan with (None: the
    candidate is kept).

    At ``full`` it is :func:`never_slower`. A lossy ``precision``: the candidate against TorchRec's
    plan with the same comms (qcomm by hand); if it leaves that, it must also leave TorchRec's plan
    at ``full``, else TorchRec's plan at ``full`` is kept; if it does not, TorchRec's plan with the
    lossy comms against it at ``full`` decides the precision TorchRec's plan is kept with (one plan
    under two precisions: ``same_plan=True``)."""
    if tuple(precision) == tuple(full):
        d = never_slower(candidate, baseline_at(*full), errors)
        return d, (None if d.leave else tuple(full))
    at_full = baseline_at(*full)
    same = attrs.evolve(never_slower(candidate, baseline_at(*precision), errors),
                        baseline=baseline_name(precision, full))
    if same.leave:
        d = never_slower(candidate, at_full, errors)
        return d, (None if d.leave else tuple(full))
    comms = never_slower(baseline_at(*precision), at_full, errors, same_plan=True)  # the lossy comms alone
    if comms.leave:
        return same, tuple(precision)
    return comms, tuple(full)


def kept_plan_pipeline(baseline: TermTimes, under: Mapping[str, TermTimes], errors: TermErrors,
                       label: str = "torchrec", rewritten: Optional[Mapping[str, TermTimes]] = None,
                       default: Optional[str] = None, rel_tolerance: float = 1e-9,
                       ) -> Optional[Tuple[str, BaselineDecision]]:
    """Where TorchRec's plan is kept: the pipeline to keep it with. ``baseline``: TorchRec's plan
    under its default pipeline (named ``default``); ``under``: the same plan under each other
    pipeline the planner may choose (each priced with its measured factor term,
    :func:`with_pipeline_term`); ``rewritten``: the same plan under a pipeline with the rewrites
    chosen on it (:func:`with_rewrite_term`; the batch split needs ``overlap``, so TorchRec's
    sharding reaches it only this way). The fastest of these settings whose predicted gain over
    ``baseline`` clears the rule (:func:`never_slower` with ``same_plan=True``: one plan, so each
    term's error is common to both sides), with its decision (``candidate_pipeline`` set,
    ``baseline`` = ``label``, ``with_rewrites`` where it is one of ``rewritten``); None when none
    does (TorchRec's plan is kept under its default pipeline). Where the default pipeline with its
    rewrites (``rewritten[default]``) clears the rule, another setting must be faster than it
    beyond ``rel_tolerance`` (float rounding), else None: the gain is the rewrites', and the caller
    keeps them under the default pipeline."""
    rewritten = dict(rewritten or {})
    own = rewritten.pop(default, None) if default is not None else None
    limit = baseline.total_s
    if own is not None and never_slower(own, baseline, errors, same_plan=True).leave:
        limit = min(limit, own.total_s * (1 - rel_tolerance))
    settings = [(t, name) for name, t in under.items()] + [(t, name) for name, t in rewritten.items()]
    for times, name in sorted(settings, key=lambda tn: (tn[0].total_s, tn[1], REWRITE_TERM in tn[0].terms)):
        if times.total_s >= limit:
            break
        d = never_slower(times, baseline, errors, same_plan=True)
        if d.leave:
            return name, attrs.evolve(d, candidate_pipeline=name, baseline=label)
    return None


def same_sharding_price(candidate: TermTimes, baseline_same_settings: TermTimes, rel_tolerance: float = 1e-9) -> bool:
    """Whether TorchRec's sharding priced under the candidate's own pipeline and precisions
    (``baseline_same_settings``) is no slower than the ``candidate`` (SparseLift's plan), up to
    float rounding (``rel_tolerance``): then the candidate's predicted gain comes from those settings
    alone and its sharding is one the model cannot tell from TorchRec's, so TorchRec's sharding is
    handed back under them."""
    return baseline_same_settings.total_s <= candidate.total_s * (1.0 + rel_tolerance)


def term_seconds(predict: Callable[[Any], float], profile: Any,
                 terms: Sequence[FitTerm] = CPU_STEP_TERMS, rel: float = 0.05) -> TermTimes:
    """``predict(profile)`` (a pure ``profile -> seconds``) split by term: the seconds each step-fit
    term (:data:`~torchrec_sparselift.cost.step_terms.CPU_STEP_TERMS`, or any :class:`~torchrec_sparselift.cost.step_terms.FitTerm` list) contributes to the
    prediction, its elasticity in the term, ``t_j = x_j * d T / d x_j``, by a central difference that
    scales the term's profile fields (rates down, costs up) by ``1 +- rel`` (at a tie between two
    critical paths, e.g. balanced ranks, it averages their slopes); the rest of the step (never below
    0: terms that multiply each other each carry the product's seconds) is :data:`FIXED_TERM`.
    Scaling (not setting) the fields makes it exact for any profile, presets whose tied fields differ
    (``hbm_bw`` and ``ddr_bw``) included."""
    base = float(predict(profile))
    out: Dict[str, float] = {}
    for t in terms:
        up = float(predict(scaled_term(profile, t, 1.0 + rel)))
        down = float(predict(scaled_term(profile, t, 1.0 - rel)))
        out[t.name] = (up - down) / (2 * rel)
    # terms that multiply each other (a rate and ``reduce_scatter_factor``) each carry the product's
    # seconds (the product's relative error is the sum of theirs), so the terms can sum to more
    # than the step: the fixed part is what is left, never below 0
    out[FIXED_TERM] = max(0.0, base - sum(out.values()))
    return TermTimes(total_s=base, terms=out)


def decision_from_dict(data: Optional[Mapping[str, Any]]) -> Optional[BaselineDecision]:
    """The :class:`BaselineDecision` an execution plan stored (``None`` when it has none)."""
    if not data:
        return None
    return BaselineDecision(
        leave=bool(data["leave"]), candidate_s=float(data.get("candidate_s", 0.0)),
        baseline_s=float(data.get("baseline_s", 0.0)), margin_s=float(data.get("margin_s", 0.0)),
        differing=tuple(TermDifference(d["term"], float(d["candidate_s"]), float(d["baseline_s"]), float(d["error"]),
                                       bool(d.get("same_plan", False)))
                        for d in data.get("differing", [])),
        error_source=str(data.get("error_source", "")), baseline=str(data.get("baseline", "torchrec")),
        note=str(data.get("note", "")), candidate_pipeline=str(data.get("candidate_pipeline", "")),
        baseline_sharding=bool(data.get("baseline_sharding", False)))
