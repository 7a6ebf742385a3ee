"""The step-fit terms: which profile fields one fitted coefficient of the cost model sets.

The cost model's step time is piecewise linear in each *term* (a profile field, or the reciprocal
of a rate field: seconds per byte, per FLOP). :data:`CPU_STEP_TERMS` is what the step calibration
fits (:mod:`torchrec_sparselift.calibration.step_fit`) and what the never-slower rule splits a
predicted step by (:func:`torchrec_sparselift.plan.baseline.term_seconds`); :func:`scaled_term`
moves one term of a profile. Pure data and one pure function.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import attrs

from torchrec_sparselift.cost.hardware import HardwareProfile

__all__ = ["FitTerm", "CPU_STEP_TERMS", "TIED_OPTIONAL_FIELDS", "scaled_term"]


@attrs.frozen
class FitTerm:
    """One fitted coefficient. ``fields``: the profile fields it sets (all to the same value);
    ``reciprocal``: the term is ``1 / field`` (a rate enters the step time as its inverse);
    ``step``: the finite-difference step used by :func:`linearize` when the value is 0."""

    name: str
    fields: Tuple[str, ...]
    reciprocal: bool = False
    step: float = 1e-5


#: The terms fitted from real CPU steps (the rest of the profile is kept).
CPU_STEP_TERMS: Tuple[FitTerm, ...] = (
    FitTerm("1/lookup_bw", ("hbm_bw", "ddr_bw"), reciprocal=True, step=1e-11),
    FitTerm("lookup_overhead_s", ("lookup_overhead_s",), step=1e-5),
    FitTerm("1/a2a_bw", ("intra_host_bw", "inter_host_bw"), reciprocal=True, step=1e-10),
    FitTerm("collective_latency_s", ("collective_latency_s",), step=1e-5),
    FitTerm("1/allreduce_bw", ("allreduce_bw",), reciprocal=True, step=1e-10),
    FitTerm("1/dense_flops", ("dense_flops",), reciprocal=True, step=1e-12),
    FitTerm("step_overhead_s", ("step_overhead_s",), step=1e-4),
    FitTerm("feature_overhead_s", ("feature_overhead_s",), step=1e-5),
    FitTerm("table_overhead_s", ("table_overhead_s",), step=1e-5),
    FitTerm("dp_table_overhead_s", ("dp_table_overhead_s",), step=1e-5),
    FitTerm("1/dense_update_bw", ("dense_update_bw",), reciprocal=True, step=1e-11),
    FitTerm("bucketize_id_s", ("bucketize_id_s",), step=1e-8),
    FitTerm("1/interaction_flops", ("interaction_flops",), reciprocal=True, step=1e-12),
    FitTerm("1/dense_mem_bw", ("dense_mem_bw",), reciprocal=True, step=1e-11),
    FitTerm("bwd_row_s", ("bwd_row_s",), step=1e-8),
    FitTerm("reduce_scatter_factor", ("reduce_scatter_factor",), step=1e-3),
    FitTerm("cold_row_s", ("cold_row_s",), step=1e-9),
)


#: Optional fields that belong to a fitted term where a profile sets them (a link correction's
#: inter-host reduce-scatter factor is the ``reduce_scatter_factor`` term's on that link).
TIED_OPTIONAL_FIELDS = {"reduce_scatter_factor": ("inter_reduce_scatter_factor",)}


def scaled_term(profile: HardwareProfile, term: FitTerm, factor: float) -> HardwareProfile:
    """``profile`` with term ``term``'s value multiplied by ``factor`` (its rate fields divided by
    it for a reciprocal term), every field of the term alike (and the optional fields tied to it
    that the profile sets, :data:`TIED_OPTIONAL_FIELDS`)."""
    changes: Dict[str, Any] = {f: (profile.rate(f) / factor if term.reciprocal else profile.rate(f) * factor)
                               for f in term.fields}
    for f in TIED_OPTIONAL_FIELDS.get(term.name, ()):
        v = getattr(profile, f)
        if v is not None:
            changes[f] = float(v) / factor if term.reciprocal else float(v) * factor
    return attrs.evolve(profile, **changes)
