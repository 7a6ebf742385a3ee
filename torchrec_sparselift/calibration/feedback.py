"""Measured plans refit this machine's stored profile (the measured guard's feedback)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import attrs

from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.calibration.step_fit import (
    CPU_STEP_TERMS,
    STEP_MODEL_VERSION,
    FitRecord,
    fit_terms,
    host_fit_setup,
    linearize,
    term_value,
    with_a2a_host_split,
    with_terms,
)
from torchrec_sparselift.calibration.store import ProfileStore, current_fingerprint
from torchrec_sparselift.cost.hardware import HardwareProfile

__all__ = ["feedback_records", "add_feedback"]


def feedback_records(pricers: Sequence[Tuple[str, float, Callable[[HardwareProfile], float]]],
                     profile: HardwareProfile) -> List[FitRecord]:
    """FitRecords of measured plans ``(label, measured seconds, profile -> predicted seconds)``,
    linearized at ``profile`` (what the step-fit store keeps)."""
    out = []
    for label, measured, pricer in pricers:
        _b, q, fixed = linearize(pricer, profile, CPU_STEP_TERMS)
        out.append(FitRecord(label=label, quantities=q, fixed_s=fixed, measured_s=measured))
    return out


def add_feedback(records: Sequence[FitRecord], profile: HardwareProfile, topology: Any,
                 store: Optional[ProfileStore] = None, prior_weight: float = 1e-2,
                 cores: Optional[int] = None) -> Optional[str]:
    """Add measured-guard trials (FitRecords) to this machine's stored step-fit records and refit
    its profile; returns the store path, or None when this machine has no stored profile of its
    own (feedback never edits another machine's profile). The read-refit-rewrite holds the
    store's lock on this machine's profile (:meth:`ProfileStore.locked`), so records added by
    several processes at once are all kept. ``cores``: see
    :func:`~torchrec_sparselift.calibration.store.current_fingerprint`."""
    store = store or ProfileStore()
    fp = current_fingerprint(topology.compute_device, ranks_per_host(topology), cores=cores)
    with store.locked(fp):  # read, refit and rewrite as one step: another process's records are kept
        return _add_locked(store, fp, records, prior_weight)


def _add_locked(store: ProfileStore, fp: Any, records: Sequence[FitRecord], prior_weight: float) -> Optional[str]:
    found, diff = store.lookup(fp)
    if found is None or diff:
        return None  # another machine's profile: never edited
    info = found.step_fit
    version = info.fitted_model_version()
    if version is not None and version != STEP_MODEL_VERSION:
        return None  # records linearized under another model structure: never mixed
    _base, terms, floors = host_fit_setup(found.profile, info.host_terms)
    fitted_names = {t.name for t in terms}
    kept = {t.name: term_value(found.profile, t) for t in CPU_STEP_TERMS if t.name not in fitted_names}
    # a term the calibration measured instead of fitting (host terms) is part of the fixed time
    allrecs = [attrs.evolve(r, fixed_s=r.fixed_s + sum(r.quantities.get(n, 0.0) * v for n, v in kept.items()),
                            quantities={n: q for n, q in r.quantities.items() if n not in kept})
               for r in list(info.fit_records) + list(records)]
    prior = {t.name: term_value(found.profile, t) for t in terms}
    fit = fit_terms(allrecs, prior, prior_weight, floors)
    refit = with_a2a_host_split(with_terms(found.profile, fit.values, terms), info.host_terms)
    updated = attrs.evolve(info, fit_records=allrecs, feedback_records=info.feedback_records + len(records),
                           extra={**info.extra, "feedback_fit_mape": fit.mape})
    return store.save(refit, fp, updated)
