"""The step-fit terms: which profile fields one fitted coefficient of the cost model sets.

The cost model's step time is piecewise linear in each *term* (a profile field, or the reciprocal
of a rate field: seconds per byte, per FLOP). :data:`CPU_STEP_TERMS` is what the step calibration
fits (:mod:`torchrec_sparselift.calibration.step_fit`) and what the never-slower rule splits a
predicted step by (:func:`torchrec_sparselift.plan.baseline.term_seconds`); :func:`scaled_term`
moves one term of a profile. :data:`LINK_TERMS` is the one table from a link measurement to the
profile fields it moves and the terms whose error that changes. Pure data and pure functions.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import attrs

from torchrec_sparselift.cost.hardware import HardwareProfile

__all__ = ["FitTerm", "CPU_STEP_TERMS", "TIED_OPTIONAL_FIELDS", "scaled_term", "LinkTerm", "LINK_TERMS", "link_terms",
           "TWO_D_ONLY_FIELDS"]


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


@attrs.frozen
class LinkTerm:
    """One row of :data:`LINK_TERMS`: a rate a job's link measurement records
    (``measured``, an attribute of :class:`~torchrec_sparselift.calibration.link.LinkRates`), the
    profile field it moves (``field``), how (``move``), and the step-fit term whose error the move
    changes (``error_term``: at least the measurement's spread once moved; None: the fit's own).

    ``move``: "bandwidth" (:func:`~torchrec_sparselift.calibration.link.corrected_bandwidth` of the
    measured change, in the profile's byte count: ``profile_bytes_per_measured`` profile bytes per
    measured byte; the cost model's all-to-all columns count bytes sent plus received, the
    measurement bytes sent), "reduce_scatter" (the inter-host reduce-scatter factor, set from the
    corrected inter-host bandwidth), "latency" (``collective_latency_s`` shifted by the measured
    change; the first flagged row wins) or "taken" (the job's own rate set as measured: the 2D
    replica sync's, which only 2D plans price)."""

    measured: str
    field: str
    move: str = attrs.field(validator=attrs.validators.in_(("bandwidth", "reduce_scatter", "latency", "taken")))
    profile_bytes_per_measured: float = 1.0
    error_term: Optional[str] = None


#: The one table from a link measurement to profile fields to step-fit terms
#: (``calibration.link.correct_link_terms`` and ``with_link_facts`` move the fields,
#: ``calibration.term_error.with_link_errors`` the errors, ``plan.request`` keys 1D plans without the
#: 2D-only fields).
LINK_TERMS: Tuple[LinkTerm, ...] = (
    LinkTerm("intra_bw", "intra_host_bw", "bandwidth", 2.0, "1/a2a_bw"),
    LinkTerm("inter_bw", "inter_host_bw", "bandwidth", 2.0, "1/a2a_bw"),
    LinkTerm("allreduce_bw", "allreduce_bw", "bandwidth", 1.0, "1/allreduce_bw"),
    LinkTerm("inter_bw", "inter_reduce_scatter_factor", "reduce_scatter", error_term="reduce_scatter_factor"),
    LinkTerm("inter_latency_s", "collective_latency_s", "latency"),
    LinkTerm("intra_latency_s", "collective_latency_s", "latency"),
    LinkTerm("replica_intra_bw", "replica_intra_bw", "taken"),
    LinkTerm("replica_inter_bw", "replica_inter_bw", "taken"),
)


def link_terms(move: str) -> Tuple[LinkTerm, ...]:
    """The rows of :data:`LINK_TERMS` that move their field by ``move``, in the table's order."""
    return tuple(t for t in LINK_TERMS if t.move == move)


#: Fields that price only 2D plans (the replica sync's rates): a 1D plan request's fingerprint
#: leaves them out, so a cached 1D plan is reused whatever the job measured for them.
TWO_D_ONLY_FIELDS: Tuple[str, ...] = tuple(t.field for t in link_terms("taken"))
