"""The model's measured error per cost term, one input of the never-slower rule
(:mod:`torchrec_sparselift.plan.baseline`, which splits a predicted step by term with
:func:`~torchrec_sparselift.plan.baseline.term_seconds`), and a stored profile moved to a job's
measured link (:func:`profile_on_link`).

* :func:`term_errors`: a stored step fit's relative error per term, from its whole-step records
  (:class:`~.step_fit.FitRecord` of kind "step": the probe plans, and the measured guard's trials
  added since; the attributed parts of steps are left out: their profiler attribution was 19-53%
  off the model per part on a 17%-MAPE fit, an error of the attribution as much as of the model).
  For record ``r`` with prediction ``p_r`` and measurement ``m_r`` and term ``j``'s share
  ``s_rj = q_rj x_j / p_r`` of the prediction::

      e_j = sum_r s_rj |p_r - m_r| / m_r  /  sum_r s_rj

  the error of the steps, each counted by how much of it the term carries; the ``fixed`` part the
  same way with ``fixed_r / p_r``; a term no record carries gets the records' MAPE.
  :func:`uncalibrated_errors`: one error for every term of a profile without a step fit
  (:data:`~torchrec_sparselift.defaults.UNCALIBRATED_MODEL_ERROR`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import attrs
import numpy as np

from torchrec_sparselift import defaults
from torchrec_sparselift.calibration.link import correct_link_terms, with_link_facts
from torchrec_sparselift.calibration.step_fit import StepFitInfo
from torchrec_sparselift.calibration.store import ProfileStore
from torchrec_sparselift.cost.hardware import HardwareProfile
from torchrec_sparselift.cost.step_terms import LINK_TERMS
from torchrec_sparselift.plan.baseline import FIXED_TERM, TermErrors, pipeline_term

__all__ = ["term_errors", "uncalibrated_errors", "profile_errors", "with_link_errors",
           "ProfileOnLink", "profile_on_link"]


def term_errors(info: StepFitInfo, name: str = "") -> TermErrors:
    """The relative error per term of a stored step fit (module docstring); ``name``: the
    profile's, for :attr:`TermErrors.source`. ``ValueError`` when the fit holds no records."""
    recs = [r for r in info.fit_records if r.kind == "step"] or list(info.fit_records)
    values = dict(info.fit.get("values") or {})
    if not recs or not values:
        raise ValueError(f"the profile {name or '?'} has no step-fit records to measure its error from; "
                         "calibrate it with `sparselift calibrate steps`")
    names = sorted({n for r in recs for n in r.quantities if n in values})
    weight = {n: 0.0 for n in names + [FIXED_TERM]}
    err = {n: 0.0 for n in names + [FIXED_TERM]}
    step_errors = []  # every record's error (all are whole steps unless the fit has none)
    for r in recs:
        parts = {n: r.quantities.get(n, 0.0) * values[n] for n in names}
        pred = r.fixed_s + sum(parts.values())
        if not pred > 0:
            continue
        e = abs(pred - r.measured_s) / r.measured_s
        step_errors.append(e)
        parts[FIXED_TERM] = r.fixed_s
        for n, sec in parts.items():
            share = max(0.0, sec) / pred
            weight[n] += share
            err[n] += share * e
    if not step_errors:
        raise ValueError(f"the profile {name or '?'}'s step-fit records predict no positive step time")
    overall = float(np.mean(step_errors))
    errors = {n: err[n] / weight[n] for n in weight if weight[n] > 0}
    for pipeline, record in (info.pipeline_factors or {}).items():  # measured with the calibration
        errors[pipeline_term(pipeline)] = float(record["error"])
    guard = f", {info.feedback_records} guard trials" if info.feedback_records else ""
    return TermErrors(errors=errors, default=overall,
                      source=f"the step fit of {name or 'the profile'} ({len(recs)} records{guard}, "
                             f"step MAPE {overall:.1%})")


def uncalibrated_errors(name: str) -> TermErrors:
    """Every term's error for a profile that was not fitted from real steps (a preset, a kernel
    microbenchmark profile): :data:`~torchrec_sparselift.defaults.UNCALIBRATED_MODEL_ERROR`."""
    e = defaults.UNCALIBRATED_MODEL_ERROR
    return TermErrors(errors={}, default=e, measured=False,
                      source=f"{name}, not fitted from real steps: {e:.0%} for every term (the measured error "
                             "of a profile without step calibration, docs/cost_model.md)")


logger = logging.getLogger(__name__)


def profile_errors(profile: Optional[HardwareProfile], stored_path: Optional[str] = None,
                   store: Any = None) -> TermErrors:
    """The model's error per term for ``profile``: the step fit of the stored profile at
    ``stored_path`` (what ``hardware="auto"`` loaded), else of a stored profile equal to
    ``profile`` in ``store`` (default: :class:`~.store.ProfileStore`), else
    :func:`uncalibrated_errors`. Reads the store only."""
    store = store or ProfileStore()
    stored = None
    if stored_path and os.path.isfile(stored_path):
        stored = store.load(stored_path)
    elif profile is not None:
        stored = next((p for p in store.all() if p.profile == profile), None)
    if stored is not None and stored.step_fit.fitted:
        try:
            return term_errors(stored.step_fit, stored.path)
        except ValueError as e:
            logger.warning("%s; assuming the error of an uncalibrated profile", e)
    return uncalibrated_errors(profile.name if profile is not None else "the preset")


def with_link_errors(errors: TermErrors, correction: Any, measured: Any) -> TermErrors:
    """``errors`` (a stored step fit's, :func:`profile_errors`) for the profile
    ``correction`` (a :class:`~.link.LinkCorrection`) moved to the link ``measured`` (its
    :class:`~.link.LinkRates`): each term whose rates the correction set from the measurement
    (the ``error_term`` of its row in :data:`~torchrec_sparselift.cost.step_terms.LINK_TERMS`: the
    all-to-all and all-reduce bandwidths, the inter-host
    reduce-scatter factor) has at least the measurement's relative spread. The step fit's error
    of those terms was measured on the calibration's link, not on this one. ``errors`` itself
    when nothing was corrected."""
    changed = {f for f, _old, _new in getattr(correction, "changed", ())}
    spread = float(getattr(measured, "spread", 0.0) or 0.0)
    term_of = {t.field: t.error_term for t in LINK_TERMS if t.error_term}
    moved = {term_of[f]: spread for f in changed if f in term_of}
    if not moved:
        return errors
    out = dict(errors.errors)
    raised = []
    for term, e in sorted(moved.items()):
        if e > errors.of(term):
            out[term] = e
            raised.append(f"{term} {e:.0%}")
    if not raised:
        return errors
    return attrs.evolve(errors, errors=out, source=f"{errors.source}; link terms corrected to this job's link at least "
                                                     f"its measured spread: {', '.join(raised)}")


@attrs.frozen
class ProfileOnLink:
    """A stored profile moved to the link a job measured, with the never-slower rule's errors for
    it: what ``hardware="auto"`` plans with (:func:`profile_on_link`).

    ``profile``: the stored profile with its link terms corrected (itself where nothing differs
    beyond the spread, or where the stored profile has no link record); ``correction``: the
    :class:`~.link.LinkCorrection` (None without a link record); ``errors``: the rule's error per
    term for ``profile`` (:func:`with_link_errors` on the stored step fit's, :func:`profile_errors`);
    ``note``: the one warning a user should see (the correction, or the missing link record),
    None when the profile fits the link."""

    profile: Any
    correction: Any
    errors: TermErrors
    note: Optional[str]

    @property
    def corrected(self) -> bool:
        """The link terms were moved to the measured link."""
        return self.correction is not None and bool(self.correction.differs)


def profile_on_link(profile: HardwareProfile, stored_link: Any, measured: Any, where: str,
                    store: Any = None) -> ProfileOnLink:
    """The stored profile ``profile`` (at ``where`` in ``store``, calibrated on ``stored_link``, a
    :class:`~.link.LinkRates` or None when it has no link record) on the link ``measured`` this job
    measured: its link terms corrected (:func:`~.link.correct_link_terms`) and the never-slower
    rule's errors for the result, the stored step fit's with the corrected bandwidths' at least
    the measurement's spread (:func:`with_link_errors`). The one place the planner's
    ``hardware="auto"``, the DLRM example and the benchmarks move a stored profile to a job's link.
    Reads the store only."""
    errors = profile_errors(None, where, store=store)
    if stored_link is None:
        return ProfileOnLink(with_link_facts(profile, measured), None, errors,
                             f"the profile {where} has no link record (its link is unknown), so this job's link "
                             "is not compared with it; calibrate under this link to store one")
    correction = correct_link_terms(profile, stored_link, measured)
    # the replica sync's rates are the job's own, measured as they run: taken, not corrected
    on_link = with_link_facts(correction.profile, measured)
    if not correction.differs:
        return ProfileOnLink(on_link, correction, errors, None)
    if errors.measured:
        errors = with_link_errors(errors, correction, measured)
    return ProfileOnLink(on_link, correction, errors, correction.describe(where))
